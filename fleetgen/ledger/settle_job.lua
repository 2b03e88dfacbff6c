-- Files a job under the active or the finished jobs by its state, and makes its keys expire or
-- last to match. Finished is what the job view calls done (running, every batch done) or a
-- cancelled job. A finished job keeps the time it first finished, so calling again sets the
-- same expiry; an entry older than the retention is from an earlier life of the job (its keys
-- expired, then it was rebuilt from the sink) and starts again.
-- KEYS: active set, finished zset, done set, extra set, then the job's lasting keys (its hash
--       first; keys.job_keys).
-- ARGV: job, now (s), retention (s).
-- Returns {"finished", expiry in unix ms} | {"active", 1 if it was finished until now, else 0}
--         | {"gone", 0} (no manifest: the job expired or never was).
local job = ARGV[1]
local now = tonumber(ARGV[2])
local retention = tonumber(ARGV[3])
local manifest = redis.call('hget', KEYS[5], 'manifest')
if not manifest then
  redis.call('srem', KEYS[1], job)
  redis.call('zrem', KEYS[2], job)
  return {'gone', 0}
end
local state = redis.call('hget', KEYS[5], 'state') or 'running'
local finished = state == 'cancelled'
if state == 'running' then
  local batches = cjson.decode(manifest)['batches']
  finished = redis.call('scard', KEYS[3]) >= batches + redis.call('scard', KEYS[4])
end
if not finished then
  redis.call('sadd', KEYS[1], job)
  local was = redis.call('zrem', KEYS[2], job)
  -- Every time, not only when it was filed as finished: an index entry dropped early (another
  -- process with a shorter retention) must not leave a running job's keys expiring.
  for i = 5, #KEYS do
    redis.call('persist', KEYS[i])
  end
  return {'active', was}
end
local at = tonumber(redis.call('zscore', KEYS[2], job))
if not at or at + retention <= now then
  at = now
  redis.call('zadd', KEYS[2], at, job)
end
redis.call('srem', KEYS[1], job)
local expiry = math.floor((at + retention) * 1000)
for i = 5, #KEYS do
  redis.call('pexpireat', KEYS[i], expiry)
end
-- The index holds no more than the jobs finished within the retention.
redis.call('zremrangebyscore', KEYS[2], '-inf', '(' .. string.format('%.3f', now - retention))
return {'finished', expiry}
