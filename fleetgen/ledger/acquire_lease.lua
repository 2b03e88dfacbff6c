-- Takes a batch's lease if nobody holds it, and in the same step counts the attempt and moves
-- the batch from queued to running, so a lease is never held without its attempt counted.
-- KEYS: lease, attempts, queued, running. ARGV: token, ttl in milliseconds, batch, now (s).
-- Returns the attempt number, or false when another run holds the lease.
if not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return false
end
local attempt = redis.call('hincrby', KEYS[2], ARGV[3], 1)
redis.call('zrem', KEYS[3], ARGV[3])
redis.call('zadd', KEYS[4], ARGV[4], ARGV[3])
return attempt
