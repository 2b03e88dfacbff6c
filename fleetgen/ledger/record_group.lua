-- Adds a group of finished prompts' records, each once (HSETNX), and moves the counters, the
-- per-worker and per-minute tallies, the canary's window and the failure breaker's window only
-- for a first copy. Each counter moves once per call: the caller sends the group's sums, and
-- each record's own values only to be read when some record is not a first copy (a re-run's
-- duplicate), when the sums are made again over the first copies alone. A record costs one
-- HSETNX and six arguments whatever its counters, the cost that bounds a group's
-- (tests/perf/checkpoint_cost.py).
-- Answers that skip the checkpoint (an embeddings batch's: their batch is their group, and
-- finish_batch.lua counts them) come as a number alone: they only push an answer's outcome to
-- the failure breaker's window, ahead of the group's records.
-- KEYS: stats, workers, minutes, recent, job, worker_minutes, outcomes, checkpoint keys...
-- ARGV: worker, minute, window, outcomes kept, answers not checkpointed, number of counters,
--       counter name/sum pairs,
--       then per record: checkpoint key index, id, record, fact, outcome ("" when the breaker
--       does not count it, else "+" and its token), its counter values (comma-separated in the
--       names' order, empty where it has none).
-- Returns: canary_seen after the group (or -1), then 1/0 per record (first copy or not); if a
-- first copy's outcome was a failure, then the job's state, its accepted causes and the
-- breaker's window, newest first (what workers/breaker.py judges).
local worker, minute, window, kept = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local answers, m = tonumber(ARGV[5]), tonumber(ARGV[6])
local first_record = 7 + 2 * m
local firsts, new, outcomes, failures, repeated = {}, 0, 0, 0, false
if kept > 0 and answers > 0 then
  -- Past the window's length the older ones would be trimmed at once.
  local empty = {}
  for k = 1, math.min(answers, kept) do
    empty[k] = ''
  end
  redis.call('lpush', KEYS[7], unpack(empty))
  outcomes = #empty
end
for i = first_record, #ARGV, 6 do
  local first = redis.call('hsetnx', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
  firsts[#firsts + 1] = first
  if first == 1 then
    if window > 0 then
      redis.call('lpush', KEYS[4], ARGV[i + 3])
      new = new + 1
    end
    local outcome = ARGV[i + 4]
    if kept > 0 and outcome ~= '' then
      redis.call('lpush', KEYS[7], string.sub(outcome, 2))
      outcomes = outcomes + 1
      if outcome ~= '+' then
        failures = failures + 1
      end
    end
  else
    repeated = true
  end
end
local names, sums = {}, {}
if repeated then
  -- Some copies were there already: sum the first copies' own values, in order.
  local k = 0
  for i = first_record, #ARGV, 6 do
    k = k + 1
    if firsts[k] == 1 then
      local j = 0
      for value in string.gmatch(ARGV[i + 5] .. ',', '([^,]*),') do
        j = j + 1
        if value ~= '' then
          local name = ARGV[5 + 2 * j]
          if sums[name] == nil then
            sums[name] = 0
            names[#names + 1] = name
          end
          sums[name] = sums[name] + tonumber(value)
        end
      end
    end
  end
else
  for j = 1, m do
    names[j] = ARGV[5 + 2 * j]
    sums[names[j]] = ARGV[6 + 2 * j]
  end
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
