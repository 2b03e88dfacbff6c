-- Records when a finished job's keys expire, and drops the placements (and their records) of
-- the jobs whose keys expired before a cutoff: fg:placement holds no more than the jobs Redis
-- holds. Enqueue and rebuild take a job out of the record as they place it (Shards.place).
-- KEYS: placement hash, placement expiry zset.
-- ARGV: job, its keys' expiry (unix ms), cutoff (unix ms).
-- Returns how many placements went.
redis.call('zadd', KEYS[2], ARGV[2], ARGV[1])
local due = redis.call('zrangebyscore', KEYS[2], '-inf', ARGV[3], 'LIMIT', 0, 500)
for _, job in ipairs(due) do
  redis.call('hdel', KEYS[1], job)
end
if #due > 0 then
  redis.call('zrem', KEYS[2], unpack(due))
end
return #due
