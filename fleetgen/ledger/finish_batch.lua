-- Records a written batch once: only the call that adds it to the done set counts its prompts,
-- so a late duplicate, or a re-count after a crash between the write and this call, adds nothing.
-- KEYS: done, running, queued, written, job, checkpoint, failures, calls (a rollout's journal).
-- ARGV: batch, now, failures kept, number of counters, counter name/value pairs, failure lines.
local batch = ARGV[1]
redis.call('zrem', KEYS[2], batch)
redis.call('zrem', KEYS[3], batch)
redis.call('del', KEYS[6], KEYS[8])
if redis.call('sadd', KEYS[1], batch) == 0 then
  return 0
end
local n = tonumber(ARGV[4])
for i = 5, 4 + 2 * n, 2 do
  redis.call('hincrbyfloat', KEYS[4], ARGV[i], ARGV[i + 1])
end
redis.call('hset', KEYS[5], 'last_write_at', ARGV[2])
if #ARGV > 4 + 2 * n then
  for i = 5 + 2 * n, #ARGV do
    redis.call('lpush', KEYS[7], ARGV[i])
  end
  redis.call('ltrim', KEYS[7], 0, tonumber(ARGV[3]) - 1)
end
return 1
