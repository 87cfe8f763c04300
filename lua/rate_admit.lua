#!lua flags=allow-oom
-- Fleet-wide requests-per-minute and tokens-per-minute limits: a window of the last 60
-- seconds in one-second buckets, so no 60 s of any worker's clock sees more than the
-- limit plus what one second's bucket holds (the window moves in one-second steps), and
-- each admission costs a few O(1) commands whatever the rate (no entry per call).
-- One call is admitted in every limit that covers it, or in none.
--
-- KEYS: per limit, its window (hash: field <unix second> = amount admitted in it, `n` =
--       sum of the buckets in the window, `o` = the oldest second still counted, `l` =
--       the call id admitted last)
-- ARGV[1] call id   ARGV[2] window ms (a whole number of seconds)
-- ARGV[3..] per limit: the limit, the amount this call takes (1 for requests, the
--           estimated tokens for tokens)
-- Returns {1, second} = admitted in the bucket of `second` (also for the call admitted
--         last in the first limit: a retry after a lost reply);
--         {0, i, ms} = limit i (from 1) has no room; in ms its oldest bucket leaves the
--         window (when to try again).
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sec = tonumber(t[1])
local span = math.floor(tonumber(ARGV[2]) / 1000)
local cutoff = sec - span + 1
local fresh = {}
for i = 1, #KEYS do
  local k = KEYS[i]
  local v = redis.call('HMGET', k, 'n', 'o', 'l')
  if i == 1 and v[3] == ARGV[1] then
    return {1, sec}
  end
  local n, o = tonumber(v[1]) or 0, tonumber(v[2])
  if not o then
    -- a new window (or one without its oldest second: start it afresh)
    if n > 0 then
      redis.call('DEL', k)
      n = 0
    end
    fresh[i] = true
    o = cutoff
  elseif o < cutoff then
    if cutoff - o > span then
      redis.call('DEL', k)
      n = 0
    else
      for s = o, cutoff - 1 do
        local c = tonumber(redis.call('HGET', k, s))
        if c then
          n = n - c
          redis.call('HDEL', k, s)
        end
      end
      if n < 0 then n = 0 end
      redis.call('HSET', k, 'n', n)
    end
    redis.call('HSET', k, 'o', cutoff)
  end
  local limit, amount = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  -- An amount above the whole limit is admitted alone into an empty window (else a
  -- large call could never run).
  if n + amount > limit and n > 0 then
    local first = sec
    for s = cutoff, sec do
      if redis.call('HEXISTS', k, s) == 1 then
        first = s
        break
      end
    end
    return {0, i, math.max(1, (first + span) * 1000 - now_ms)}
  end
end
for i = 1, #KEYS do
  local k, amount = KEYS[i], ARGV[2 + 2 * i]
  local b = redis.call('HINCRBY', k, sec, amount)
  redis.call('HINCRBY', k, 'n', amount)
  if fresh[i] then
    redis.call('HSET', k, 'o', cutoff)
  end
  -- a new second's bucket pushes the expiry on (once a second, not once a call)
  if fresh[i] or b == tonumber(amount) then
    redis.call('PEXPIRE', k, tonumber(ARGV[2]) + 2000)
  end
end
redis.call('HSET', KEYS[1], 'l', ARGV[1])
return {1, sec}
