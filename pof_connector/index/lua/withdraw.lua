-- Same arguments; removes exactly these records (and the flag once no per-page field is left).
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
