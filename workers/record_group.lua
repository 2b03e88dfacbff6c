-- Adds a group of finished prompts' records, each once (HSETNX), and moves the counters, the
-- per-worker and per-minute tallies and the canary's window only for a first copy; each counter
-- once per call, summed over the group's first copies (per-prompt writes were most of Redis's
-- cost per prompt: tests/perf/redis_capacity.py).
-- KEYS: stats, workers, minutes, recent, job, worker_minutes, checkpoint keys...
-- ARGV: worker, minute, window, then per record: checkpoint key index, id, record, fact,
--       number of counters, counter name/value pairs.
-- Returns: canary_seen after the group (or -1), then 1/0 per record (first copy or not).
local worker, minute, window = ARGV[1], ARGV[2], tonumber(ARGV[3])
local firsts, new, sums, names = {}, 0, {}, {}
local i = 4
while i <= #ARGV do
  local key, id, record, fact, n = KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  local first = redis.call('hsetnx', key, id, record)
  firsts[#firsts + 1] = first
  if first == 1 then
    for j = i + 5, i + 4 + 2 * n, 2 do
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
  end
  i = i + 5 + 2 * n
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
local seen = -1
if window > 0 then
  redis.call('ltrim', KEYS[4], 0, window - 1)
  seen = redis.call('hincrby', KEYS[5], 'canary_seen', new)
end
table.insert(firsts, 1, seen)
return firsts
