-- Runs after summary.lua: the loader (scripts.py) puts that file first.
-- KEYS: the namespace's summaries, its per-page hash, its records. ARGV[1]: MAX_TAGS; then pairs of
-- a segment field and its items (segments.ITEM_BYTES each: the page's 16-byte field, then u8 offset
-- | 8-byte tag | u32 incarnation | u8 medium | u32 slot | u64 generation). A page's record replaces
-- the one of the same page, incarnation and medium. An offset whose layers hold other chains' tags
-- sends the page to its per-page field and marks the offset; a page that finds room again leaves
-- its field.
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
