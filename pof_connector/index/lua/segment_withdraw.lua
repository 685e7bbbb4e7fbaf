-- Runs after summary.lua: the loader (scripts.py) puts that file first.
-- Same keys and items (no MAX_TAGS): removes exactly these locations, from the segment (its record
-- and summary bit) or, for a page that is not there, from its per-page field.
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
