#!lua flags=allow-oom
-- Fleet-wide requests-per-minute and tokens-per-minute limits: a sliding window of 60 s
-- per limit, exact (every admitted amount is remembered until it leaves the window), so
-- no minute of any worker's clock sees more than the limit admitted fleet-wide.
-- One call is admitted in every limit that covers it, or in none.
--
-- KEYS: per limit, a sorted set (member "<id>|<amount>", score = admission time ms) and
--       its running total (a string).
-- ARGV[1] call id   ARGV[2] window ms
-- ARGV[3..] per limit: the limit, the amount this call takes (1 for requests, the
--           estimated tokens for tokens)
-- Returns {1} = admitted (also for an id admitted already: a retry after a lost reply);
--         {0, i, ms} = limit i (from 1) has no room; in ms its oldest admission leaves
--         the window (when to try again).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, window = ARGV[1], tonumber(ARGV[2])
local n = #KEYS / 2
if redis.call('ZSCORE', KEYS[1], id .. '|' .. ARGV[4]) then
  return {1}
end
for i = 1, n do
  local z, total = KEYS[2 * i - 1], KEYS[2 * i]
  local old = redis.call('ZRANGEBYSCORE', z, '-inf', now - window)
  if #old > 0 then
    local gone = 0
    for _, m in ipairs(old) do
      gone = gone + (tonumber(string.match(m, '|(%d+)$')) or 0)
    end
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now - window)
    redis.call('DECRBY', total, gone)
  end
  local used = tonumber(redis.call('GET', total) or '-1')
  if used < 0 then
    -- no total (or a broken one) while entries may live: recount it from the entries
    used = 0
    for _, m in ipairs(redis.call('ZRANGE', z, 0, -1)) do
      used = used + (tonumber(string.match(m, '|(%d+)$')) or 0)
    end
    redis.call('SET', total, used, 'PX', window + 1000)
  end
  local limit, amount = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  -- An amount above the whole limit is admitted alone into an empty window (else a
  -- large call could never run).
  if used + amount > limit and used > 0 then
    local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
    local wait = 1
    if #first == 2 then
      wait = math.max(1, tonumber(first[2]) + window - now)
    end
    return {0, i, wait}
  end
end
for i = 1, n do
  local z, total = KEYS[2 * i - 1], KEYS[2 * i]
  local amount = ARGV[2 + 2 * i]
  redis.call('ZADD', z, now, id .. '|' .. amount)
  redis.call('INCRBY', total, amount)
  redis.call('PEXPIRE', z, window + 1000)
  redis.call('PEXPIRE', total, window + 1000)
end
return {1}
