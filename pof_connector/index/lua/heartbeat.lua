-- Runs after now.lua and leases.lua: the loader (scripts.py) puts those files first.
-- ARGV: node id, this client's last incarnation ('' if it never registered), TTL in ms, info JSON,
-- this client's owner token. Returns {incarnation, 1} for a new registration, {incarnation, 0} for
-- a renewal, and {holder, -1} when another live client registered the node id after this one.
-- Each incarnation records its owner's token (KEYS[6]): a registration that this very client made
-- by a heartbeat whose reply it never got (a timeout) is recognised as its own and adopted.
-- KEYS[7]: the leases a lookup reads (leases.lua), written with every change of the live ZSET.
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  redis.call('HDEL', KEYS[4], unpack(expired))
  redis.call('HDEL', KEYS[6], unpack(expired))
  leases_drop(KEYS[7], expired)
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
      leases_drop(KEYS[7], {inc})
    end
    inc = tostring(redis.call('INCR', KEYS[5]))
    redis.call('HSET', KEYS[1], ARGV[1], inc)
    redis.call('HSET', KEYS[2], inc, ARGV[1])
    redis.call('HSET', KEYS[6], inc, ARGV[5])
  end
end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), inc)
leases_put(KEYS[7], inc, now + tonumber(ARGV[3]))
redis.call('HSET', KEYS[4], inc, ARGV[4])
return {inc, fresh}
