"""The index's Lua scripts (one per write, so a key's record lists stay consistent); the schema is in
:mod:`.redis` and :mod:`.summary`."""

NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# ARGV: node id, this client's last incarnation ('' if it never registered), TTL in ms, info JSON,
# this client's owner token. Returns {incarnation, 1} for a new registration, {incarnation, 0} for
# a renewal, and {holder, -1} when another live client registered the node id after this one.
# Each incarnation records its owner's token (KEYS[6]): a registration that this very client made
# by a heartbeat whose reply it never got (a timeout) is recognised as its own and adopted.
HEARTBEAT = NOW + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  redis.call('HDEL', KEYS[4], unpack(expired))
  redis.call('HDEL', KEYS[6], unpack(expired))
end
local inc = redis.call('HGET', KEYS[1], ARGV[1])
local live = inc and redis.call('ZSCORE', KEYS[3], inc)
local fresh = 0
if not (live and inc == ARGV[2]) then
  fresh = 1
  if live and redis.call('HGET', KEYS[6], inc) == ARGV[5] then
    -- Ours, registered by a heartbeat whose reply we lost: adopt it (and publish again).
  elseif live and ARGV[2] ~= '' then
    return {inc, -1}
  else
    if live then
      -- A new process of a node whose registration is live: the node restarted, and what its
      -- former incarnation published points into memory that is gone. It dies now, not at its TTL.
      redis.call('ZREM', KEYS[3], inc)
      redis.call('HDEL', KEYS[4], inc)
      redis.call('HDEL', KEYS[6], inc)
    end
    inc = tostring(redis.call('INCR', KEYS[5]))
    redis.call('HSET', KEYS[1], ARGV[1], inc)
    redis.call('HSET', KEYS[2], inc, ARGV[1])
    redis.call('HSET', KEYS[6], inc, ARGV[5])
  end
end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), inc)
redis.call('HSET', KEYS[4], inc, ARGV[4])
return {inc, fresh}
"""

# ARGV[1]: concatenated 16-byte fields; ARGV[2]: concatenated 17-byte records, one per field.
# Publish replaces this incarnation's record for the same medium (a record's first 5 bytes).
# KEYS[2], when given: the namespace's flag "placeless pages here", set (see RedisIndex._segment_lookup).
PUBLISH = r"""
local fields, recs = ARGV[1], ARGV[2]
for k = 0, #fields / 16 - 1 do
  local f = string.sub(fields, k * 16 + 1, k * 16 + 16)
  local rec = string.sub(recs, k * 17 + 1, k * 17 + 17)
  local head = string.sub(rec, 1, 5)
  local old = redis.call('HGET', KEYS[1], f)
  if not old then
    redis.call('HSET', KEYS[1], f, rec)
  else
    local out = {}
    for p = 1, #old, 17 do
      local r = string.sub(old, p, p + 16)
      if string.sub(r, 1, 5) ~= head then out[#out + 1] = r end
    end
    out[#out + 1] = rec
    redis.call('HSET', KEYS[1], f, table.concat(out))
  end
end
if KEYS[2] then redis.call('SET', KEYS[2], '1') end
return #fields / 16
"""

# Same arguments; removes exactly these records (and the flag once no per-page field is left).
WITHDRAW = r"""
local fields, recs = ARGV[1], ARGV[2]
for k = 0, #fields / 16 - 1 do
  local f = string.sub(fields, k * 16 + 1, k * 16 + 16)
  local rec = string.sub(recs, k * 17 + 1, k * 17 + 17)
  local old = redis.call('HGET', KEYS[1], f)
  if old then
    local out = {}
    for p = 1, #old, 17 do
      local r = string.sub(old, p, p + 16)
      if r ~= rec then out[#out + 1] = r end
    end
    if #out == 0 then redis.call('HDEL', KEYS[1], f) else redis.call('HSET', KEYS[1], f, table.concat(out)) end
  end
end
if KEYS[2] and redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[2]) end
return #fields / 16
"""

LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""


# Per-page fields as the segment scripts use them (KEYS[2] of theirs): put replaces the record of
# the same incarnation and medium (`who`, 5 bytes), drop removes it.
PAGE_FIELDS = r"""
local function page_records(f)
  local old = redis.call('HGET', KEYS[2], f) or ''
  local out = {}
  for p = 1, #old - 16, 17 do out[#out + 1] = string.sub(old, p, p + 16) end
  return out
end
local function page_write(f, out)
  if #out == 0 then redis.call('HDEL', KEYS[2], f) else redis.call('HSET', KEYS[2], f, table.concat(out)) end
end
local function page_drop(f, who)
  local out = {}
  for _, r in ipairs(page_records(f)) do
    if string.sub(r, 1, 5) ~= who then out[#out + 1] = r end
  end
  page_write(f, out)
end
local function page_put(f, rec)
  page_drop(f, string.sub(rec, 1, 5))
  local out = page_records(f)
  out[#out + 1] = rec
  page_write(f, out)
end
"""

# Summaries (KEYS[1]) and records (KEYS[3]) as summary.py lays them out. Bits are kept as numbers
# (u16 masks) and tested with arithmetic: not every Redis-protocol server's Lua has a bit library.
SUMMARY = PAGE_FIELDS + r"""
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
"""

# KEYS: the namespace's summaries, its per-page hash, its records. ARGV[1]: MAX_TAGS; then pairs of
# a segment field and its items (segments.ITEM_BYTES each: the page's 16-byte field, then u8 offset
# | 8-byte tag | u32 incarnation | u8 medium | u32 slot | u64 generation). A page's record replaces
# the one of the same page, incarnation and medium. An offset whose layers hold other chains' tags
# sends the page to its per-page field and marks the offset; a page that finds room again leaves
# its field.
SEGMENT_PUBLISH = SUMMARY + r"""
local K = tonumber(ARGV[1])
local n = 0
for a = 2, #ARGV, 2 do
  local f, items = ARGV[a], ARGV[a + 1]
  local s, cache = sum_parse(redis.call('HGET', KEYS[1], f)), {}
  for q = 1, #items - 41, 42 do
    local pf, r = string.sub(items, q, q + 15), string.sub(items, q + 16, q + 41)
    local o, tag, who, md = string.byte(r, 1), string.sub(r, 2, 9), string.sub(r, 10, 14), string.byte(r, 14)
    if o < 16 then
      local layer, free = nil, nil
      for l = 0, K - 1 do
        local t = s.tags[l * 16 + o]
        if t == tag then layer = l; break end
        if not t and not free then free = l end
      end
      local marked = has(s.marks, o)
      layer = layer or free
      if layer then
        s.tags[layer * 16 + o] = tag
        local m = s.holders[who]
        if not m then m = {0, 0, 0, 0}; s.holders[who] = m; s.order[#s.order + 1] = who end
        if not has(m[layer + 1], o) then m[layer + 1] = m[layer + 1] + 2 ^ o end
        records(cache, f, string.sub(who, 1, 4))[md * 64 + layer * 16 + o] = string.sub(r, 15, 26)
        if marked then page_drop(pf, who) end
      else
        if not marked then s.marks = s.marks + 2 ^ o end
        page_put(pf, string.sub(r, 10, 26))
      end
      n = n + 1
    end
  end
  for inc4, rc in pairs(cache) do rec_write(f .. inc4, rc) end
  sum_write(f, s)
end
return n
"""

# Same keys and items (no MAX_TAGS): removes exactly these locations, from the segment (its record
# and summary bit) or, for a page that is not there, from its per-page field.
SEGMENT_WITHDRAW = SUMMARY + r"""
local n = 0
for a = 1, #ARGV, 2 do
  local f, items = ARGV[a], ARGV[a + 1]
  local s, cache = sum_parse(redis.call('HGET', KEYS[1], f)), {}
  for q = 1, #items - 41, 42 do
    local pf, r = string.sub(items, q, q + 15), string.sub(items, q + 16, q + 41)
    local o, tag, who, md = string.byte(r, 1), string.sub(r, 2, 9), string.sub(r, 10, 14), string.byte(r, 14)
    local found = false
    for l = 0, 3 do
      if o < 16 and s.tags[l * 16 + o] == tag then
        local m = s.holders[who]
        if m and has(m[l + 1], o) then
          local rc, k = records(cache, f, string.sub(who, 1, 4)), md * 64 + l * 16 + o
          if rc[k] == string.sub(r, 15, 26) then
            rc[k] = nil
            m[l + 1] = m[l + 1] - 2 ^ o
            s.touched[l * 16 + o] = true
            found = true
          end
        end
        break
      end
    end
    if not found then
      local rec, out = string.sub(r, 10, 26), {}
      for _, x in ipairs(page_records(pf)) do
        if x ~= rec then out[#out + 1] = x end
      end
      page_write(pf, out)
    end
    n = n + 1
  end
  for inc4, rc in pairs(cache) do rec_write(f .. inc4, rc) end
  sum_write(f, s)
end
return n
"""

# Same keys. ARGV[1]: the live incarnations (u32 each, concatenated); then segment fields. Drops the
# holders of other incarnations from those summaries, and their records; returns the locations dropped.
SEGMENT_PRUNE = SUMMARY + r"""
local live = {}
for p = 1, #ARGV[1] - 3, 4 do live[string.sub(ARGV[1], p, p + 3)] = true end
local dropped = 0
for a = 2, #ARGV do
  local f = ARGV[a]
  local s = sum_parse(redis.call('HGET', KEYS[1], f))
  for _, who in ipairs(s.order) do
    local inc4, m = string.sub(who, 1, 4), s.holders[who]
    if not live[inc4] then
      for l = 0, 3 do
        dropped = dropped + ones(m[l + 1])
        for o = 0, 15 do if has(m[l + 1], o) then s.touched[l * 16 + o] = true end end
        m[l + 1] = 0
      end
      redis.call('HDEL', KEYS[3], f .. inc4)
    end
  end
  sum_write(f, s)
end
return dropped
"""
