-- Per-page fields as the segment scripts use them (KEYS[2] of theirs): put replaces the record of
-- the same incarnation and medium (`who`, 5 bytes), drop removes it.
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
