-- Takes failed prompts out of a batch's checkpoint, so that the batch's next run sends them
-- again, and takes back what each added to the live counters (record_group.lua): once per
-- prompt, whoever calls it twice. The per-minute tallies stay: that work was done in its minute.
-- Refused (-1, nothing changed) while the batch's lease is held: its worker may be writing it.
-- KEYS: checkpoint, lease, stats, workers.
-- ARGV: per prompt: id, error code, worker that recorded it.
-- Returns: prompts taken out, or -1.
if redis.call('exists', KEYS[2]) == 1 then
  return -1
end
local taken = 0
for i = 1, #ARGV, 3 do
  if redis.call('hdel', KEYS[1], ARGV[i]) == 1 then
    taken = taken + 1
    redis.call('hincrbyfloat', KEYS[3], 'prompts_failed', -1)
    redis.call('hincrbyfloat', KEYS[3], 'error_' .. ARGV[i + 1], -1)
    redis.call('hincrbyfloat', KEYS[4], ARGV[i + 2] .. '|prompts_failed', -1)
  end
end
return taken
