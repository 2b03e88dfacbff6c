-- Adds a group of finished prompts' records, each once (HSETNX), and moves the counters, the
-- per-worker and per-minute tallies, the canary's window and the failure breaker's window only
-- for a first copy; each counter once per call, summed over the group's first copies
-- (per-prompt writes were most of Redis's cost per prompt: tests/perf/redis_capacity.py).
-- KEYS: stats, workers, minutes, recent, job, worker_minutes, outcomes, checkpoint keys...
-- ARGV: worker, minute, window, outcomes kept, then per record: checkpoint key index, id,
--       record, fact, 1/0 (the breaker counts it or not), outcome token, number of counters,
--       counter name/value pairs.
-- Returns: canary_seen after the group (or -1), then 1/0 per record (first copy or not); if a
-- first copy's outcome was a failure, then the job's state, its accepted causes and the
-- breaker's window, newest first (what workers/breaker.py judges).
local worker, minute, window, kept = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local firsts, new, outcomes, failures, sums, names = {}, 0, 0, 0, {}, {}
local i = 5
while i <= #ARGV do
  local key, id, record, fact = KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local counted, outcome, n = ARGV[i + 4], ARGV[i + 5], tonumber(ARGV[i + 6])
  local first = redis.call('hsetnx', key, id, record)
  firsts[#firsts + 1] = first
  if first == 1 then
    for j = i + 7, i + 6 + 2 * n, 2 do
      local name = ARGV[j]
      if sums[name] == nil then
        sums[name] = 0
        names[#names + 1] = name
      end
      sums[name] = sums[name] + tonumber(ARGV[j + 1])
    end
    if window > 0 then
      redis.call('lpush', KEYS[4], fact)
      new = new + 1
    end
    if kept > 0 and counted == '1' then
      redis.call('lpush', KEYS[7], outcome)
      outcomes = outcomes + 1
      if outcome ~= '' then
        failures = failures + 1
      end
    end
  end
  i = i + 7 + 2 * n
end
for _, name in ipairs(names) do
  local value = sums[name]
  redis.call('hincrbyfloat', KEYS[1], name, value)
  if name == 'prompts_done' or name == 'prompts_failed' or name == 'output_tokens' then
    redis.call('hincrbyfloat', KEYS[2], worker .. '|' .. name, value)
  end
  if name == 'prompts_done' or name == 'prompts_failed' then
    redis.call('hincrbyfloat', KEYS[3], minute, value)
    redis.call('hincrbyfloat', KEYS[6], worker .. '|' .. minute .. '|prompts', value)
  end
  if name == 'output_tokens' then
    redis.call('hincrbyfloat', KEYS[3], minute .. '|tokens', value)
    redis.call('hincrbyfloat', KEYS[6], worker .. '|' .. minute .. '|tokens', value)
  end
end
if outcomes > 0 then
  redis.call('ltrim', KEYS[7], 0, kept - 1)
end
local seen = -1
if window > 0 then
  redis.call('ltrim', KEYS[4], 0, window - 1)
  seen = redis.call('hincrby', KEYS[5], 'canary_seen', new)
end
table.insert(firsts, 1, seen)
if failures > 0 then
  local job = redis.call('hmget', KEYS[5], 'state', 'breaker_accepted')
  firsts[#firsts + 1] = job[1]
  firsts[#firsts + 1] = job[2]
  for _, outcome in ipairs(redis.call('lrange', KEYS[7], 0, kept - 1)) do
    firsts[#firsts + 1] = outcome
  end
end
return firsts
