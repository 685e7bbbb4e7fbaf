-- Runs after summary.lua: the loader (scripts.py) puts that file first.
-- Same keys. ARGV[1]: the live incarnations (u32 each, concatenated); then segment fields. Drops the
-- holders of other incarnations from those summaries, and their records; returns the locations dropped.
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
