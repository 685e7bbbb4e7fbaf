-- Runs after leases.lua. KEYS: the live ZSET, the info and owner hashes, the leases; ARGV[1]: the incarnation.
redis.call('ZREM', KEYS[1], ARGV[1])
leases_drop(KEYS[4], {ARGV[1]})
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
