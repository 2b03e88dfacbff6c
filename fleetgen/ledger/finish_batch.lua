-- Records a written batch once: only the call that adds it to the done set counts its prompts,
-- so a late duplicate, or a re-count after a crash between the write and this call, adds nothing.
-- Besides the written counters, the first call makes the increments the caller lists: the
-- batch's own figures (batches done, bytes) and, for answers that skipped the checkpoint (an
-- embeddings batch's: the batch is their group), what their checkpoint would have added to the
-- live counters and the per-worker and per-minute tallies.
-- KEYS: done, running, queued, written, job, checkpoint, failures, calls (a rollout's journal),
--       then the keys the increments name.
-- ARGV: batch, now, failures kept, number of counters, counter name/value pairs, number of
--       increments, increment triples (KEYS index, field, value), failure lines.
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
local l = tonumber(ARGV[5 + 2 * n])
local lines = 6 + 2 * n + 3 * l
for i = 6 + 2 * n, lines - 1, 3 do
  redis.call('hincrbyfloat', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
end
redis.call('hset', KEYS[5], 'last_write_at', ARGV[2])
if #ARGV >= lines then
  for i = lines, #ARGV do
    redis.call('lpush', KEYS[7], ARGV[i])
  end
  redis.call('ltrim', KEYS[7], 0, tonumber(ARGV[3]) - 1)
end
return 1
