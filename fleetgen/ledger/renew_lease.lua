-- Extends a lease only for its owner (the batch runner's heartbeat runs it on its loop).
-- KEYS: lease. ARGV: token, ttl in milliseconds. Returns 1 if extended, 0 if not held.
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
