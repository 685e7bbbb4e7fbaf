-- Runs after page_fields.lua: the loader (scripts.py) puts that file first.
-- Summaries (KEYS[1]) and records (KEYS[3]) as summary.py lays them out. Bits are kept as numbers
-- (u16 masks) and tested with arithmetic: not every Redis-protocol server's Lua has a bit library.
local function u16(s, p) local a, b = string.byte(s, p, p + 1); return a + b * 256 end
local function p16(n) return string.char(n % 256, math.floor(n / 256)) end
local function has(m, o) return math.floor(m / 2 ^ o) % 2 == 1 end
local function ones(m) local c = 0; while m > 0 do c = c + m % 2; m = math.floor(m / 2) end; return c end
local function sum_parse(v)
  local s = {marks = 0, tags = {}, holders = {}, order = {}, touched = {}}
  if not v or #v < 3 or string.byte(v, 3) > 4 then return s end
  s.marks = u16(v, 1)
  local L = string.byte(v, 3)
  local p = 4 + 2 * L
  for l = 0, L - 1 do
    local pres = u16(v, 4 + 2 * l)
    for o = 0, 15 do
      if has(pres, o) then s.tags[l * 16 + o] = string.sub(v, p, p + 7); p = p + 8 end
    end
  end
  local w = 5 + 2 * L
  while L > 0 and p + w - 1 <= #v do
    local who = string.sub(v, p, p + 4)
    local m = {0, 0, 0, 0}
    for l = 0, L - 1 do m[l + 1] = u16(v, p + 5 + 2 * l) end
    if not s.holders[who] then s.order[#s.order + 1] = who end
    s.holders[who] = m
    p = p + w
  end
  return s
end
local function sum_write(f, s)
  -- A tag whose last holder left frees its layer for another chain's page.
  for pos in pairs(s.touched) do
    local l, o, used = math.floor(pos / 16), pos % 16, false
    for _, who in ipairs(s.order) do
      if has(s.holders[who][l + 1], o) then used = true; break end
    end
    if not used then s.tags[pos] = nil end
  end
  local L = 0
  for pos in pairs(s.tags) do L = math.max(L, math.floor(pos / 16) + 1) end
  local out, tags = {p16(s.marks), string.char(L)}, {}
  for l = 0, L - 1 do
    local pres = 0
    for o = 0, 15 do
      local t = s.tags[l * 16 + o]
      if t then pres = pres + 2 ^ o; tags[#tags + 1] = t end
    end
    out[#out + 1] = p16(pres)
  end
  out[#out + 1] = table.concat(tags)
  local n = 0
  for _, who in ipairs(s.order) do
    local m = s.holders[who]
    if m[1] + m[2] + m[3] + m[4] > 0 then
      out[#out + 1] = who
      for l = 1, L do out[#out + 1] = p16(m[l]) end
      n = n + 1
    end
  end
  if n == 0 and s.marks == 0 then
    redis.call('HDEL', KEYS[1], f)
  else
    redis.call('HSET', KEYS[1], f, table.concat(out))
  end
end
local function rec_parse(v)
  local t = {}
  if not v then return t end
  local p = 1
  while p + 3 <= #v do
    local md, l = string.byte(v, p, p + 1)
    local mask = u16(v, p + 2)
    p = p + 4
    for o = 0, 15 do
      if has(mask, o) and p + 11 <= #v then t[md * 64 + l * 16 + o] = string.sub(v, p, p + 11); p = p + 12 end
    end
  end
  return t
end
local function rec_write(key, t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  if #ks == 0 then redis.call('HDEL', KEYS[3], key); return end
  table.sort(ks)
  local out, i = {}, 1
  while i <= #ks do
    local g, mask, vals = math.floor(ks[i] / 16), 0, {}
    while i <= #ks and math.floor(ks[i] / 16) == g do
      mask = mask + 2 ^ (ks[i] % 16); vals[#vals + 1] = t[ks[i]]; i = i + 1
    end
    out[#out + 1] = string.char(math.floor(g / 4), g % 4) .. p16(mask) .. table.concat(vals)
  end
  redis.call('HSET', KEYS[3], key, table.concat(out))
end
local function records(cache, f, inc4)
  local rc = cache[inc4]
  if not rc then rc = rec_parse(redis.call('HGET', KEYS[3], f .. inc4)); cache[inc4] = rc end
  return rc
end
