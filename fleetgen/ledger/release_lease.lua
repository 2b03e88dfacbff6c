-- Gives a lease back if ARGV[1] still holds it; ARGV[2] = 1 refunds the attempt taken with it
-- (the batch was handed back, not abandoned). KEYS: lease, attempts, running; ARGV[3]: batch.
-- A lease no longer held leaves `running` alone: an expired one is the reconciler's to see, and
-- a taken-over one belongs to the new holder.
if redis.call('get', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('del', KEYS[1])
if ARGV[2] == '1' then
  redis.call('hincrby', KEYS[2], ARGV[3], -1)
end
redis.call('zrem', KEYS[3], ARGV[3])
return 1
