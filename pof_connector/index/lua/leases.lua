-- The registry's leases as a lookup reads them (keyspace.K_LEASES, a STRING): 12 bytes per
-- incarnation, u32 incarnation | f64 expiry in ms of the server's clock (its score in the live
-- ZSET), in no order. A lookup GETs one bulk string instead of ZRANGE's member and score per
-- holder. Every write of the live ZSET by these scripts writes it too, in the same script, so the
-- two agree; an incarnation an older release's script registered is not in it (a miss for a
-- reader of this release, never a holder counted after its lease).

-- Drop the entries of the incarnations in `incs` (decimal strings); the rest keep their bytes.
local function leases_drop(key, incs)
  local old = redis.call('GET', key)
  if not old then return end
  local gone = {}
  for _, inc in ipairs(incs) do gone[tonumber(inc)] = true end
  local out = {}
  for p = 1, #old - 11, 12 do
    if not gone[struct.unpack('<I4', old, p)] then out[#out + 1] = string.sub(old, p, p + 11) end
  end
  if #out == 0 then redis.call('DEL', key) else redis.call('SET', key, table.concat(out)) end
end

-- Set the expiry of `inc`: in place where it has an entry (an entry starts at a multiple of 12),
-- else appended. A renewal thus costs a search of the string, not a rewrite of it.
local function leases_put(key, inc, expiry)
  local n = tonumber(inc)
  if n < 1 or n > 4294967295 then return end      -- readers count 1..2^32-1 only
  local entry = struct.pack('<I4d', n, expiry)
  local old = redis.call('GET', key) or ''
  local head = string.sub(entry, 1, 4)
  local p = string.find(old, head, 1, true)
  while p do
    if (p - 1) % 12 == 0 and p + 11 <= #old then
      redis.call('SETRANGE', key, p - 1, entry)
      return
    end
    p = string.find(old, head, p + 1, true)
  end
  if #old % 12 == 0 then
    redis.call('APPEND', key, entry)
  else                                             -- a cut entry (not ours): dropped, so entries stay aligned
    redis.call('SET', key, string.sub(old, 1, #old - #old % 12) .. entry)
  end
end
