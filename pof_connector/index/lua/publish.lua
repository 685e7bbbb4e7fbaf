-- ARGV[1]: concatenated 16-byte fields; ARGV[2]: concatenated 17-byte records, one per field.
-- Publish replaces this incarnation's record for the same medium (a record's first 5 bytes).
-- KEYS[2], when given: the namespace's flag "placeless pages here", set (see RedisIndex._segment_lookup).
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
