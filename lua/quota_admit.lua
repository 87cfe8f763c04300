#!lua flags=allow-oom
-- One call's fleet-wide quotas in one step: its worst case reserved in every budget
-- window that covers it, and the call admitted in every rpm / tpm limit that covers it;
-- all of it, or nothing (a call held back by a rate limit reserves no budget).
--
-- KEYS[1..B]: budget windows, one hash each `{ns}:budget:<name>:<tenant or *>:<d:YYYY-MM-DD
--   | m:YYYY-MM>`: `spent` = pico-dollars settled, `r:<id>` = live reservations
--   "<picos>|<expiry ms, server TIME>|<rate second>", `h` = the sum of the live
--   reservations, `x` = no reservation expires before this (sums written as integers,
--   exact below 2^53 pico-dollars, about 9,000 USD of reservations in flight). O(1) per call: the reservations are read one by one
--   (expired ones dropped from `h`: a killed worker's) only once `x` has passed or `h` is
--   missing or negative (a window of an earlier version).
-- KEYS[B+1..]: rate windows, one hash each: the last 60 s in one-second buckets (field
--   <unix second> = amount admitted in it, `n` = sum of the buckets in the window, `o` =
--   the oldest second still counted). Any 60 s sees at most the limit plus one second's
--   bucket; no entry per call. A clock that went back (a failover) moves `o` back with
--   it, so no bucket is left behind uncounted.
-- KEYS[#KEYS] (when there are rate windows): the admission record `{ns}:rate:adm:<id>` =
--   "<second>|<amount>", for the window's length: a retry answers the first try's second,
--   and quota_settle.lua corrects the tokens once, in that second's bucket.
-- ARGV[1] B   ARGV[2] reservation id   ARGV[3] reservation ttl ms   ARGV[4] rate call id
--   ('' = no rate windows)   ARGV[5] rate window ms (whole seconds)
-- then per budget window: limit picos, amount picos, key expiry (unix ms: the window's end
--   plus a margin, so old windows leave nothing behind)
-- then per rate window: the limit, the amount (1 for requests, the estimated tokens)
--
-- A window never holds more than its limit in spent + live reservations, so concurrent
-- calls overshoot a budget only by what providers bill beyond the worst cases reserved,
-- never by a race. A rate amount above the whole limit is admitted alone into an empty
-- window (else a large call could never run).
-- Returns {1, second, ms}: reserved and admitted; `second` = the rate bucket it was
--         admitted in, `ms` = the server's milliseconds into that second; {1, second}
--         (no ms): a retry after a lost reply whose reservation is still live, or whose
--         admission record is there;
--         {0, 1, i, left picos}: budget window i (from 1) has only `left`; nothing done;
--         {0, 2, i, ms}: rate window i (from 1) has no room; in ms its oldest bucket
--         leaves the window; nothing done.
-- allow-oom: a full Redis must not turn into unlimited spending; what is written is a
-- few bytes per call (the commit of the result waits for memory anyway).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sec = tonumber(t[1])
local nb = tonumber(ARGV[1])
local rid, ttl = ARGV[2], tonumber(ARGV[3])
local span = math.floor(tonumber(ARGV[5]) / 1000)
local cutoff = sec - span + 1
local ra = 6 + 3 * nb -- first rate argument
local has_rate = ARGV[4] ~= ''
local last_rate = #KEYS
local adm = nil
if has_rate then
  last_rate = #KEYS - 1
  adm = KEYS[#KEYS]
  local a = redis.call('GET', adm)
  if a then
    return {1, tonumber(string.match(a, '^(%d+)|')) or sec} -- a retry: done already
  end
end

-- 1. Budget windows: room for the worst case?
local has_x = {}
for i = 1, nb do
  local k = KEYS[i]
  local limit, amount = tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[4 + 3 * i])
  local v = redis.call('HMGET', k, 'spent', 'h', 'x', 'r:' .. rid)
  if i == 1 and v[4] then
    local exp, s0 = string.match(v[4], '^%d+|(%d+)|?(%d*)$')
    if exp and tonumber(exp) > now then
      return {1, tonumber(s0) or sec} -- a retry of a try whose reply was lost
    end
    -- its reservation expired (Redis away past its ttl): reserve again below
  end
  local spent, held, x = tonumber(v[1]) or 0, tonumber(v[2]), tonumber(v[3])
  if held == nil or held < 0 or (x and x <= now) then
    held, x = 0, nil
    local all = redis.call('HGETALL', k)
    for j = 1, #all, 2 do
      local f, fv = all[j], all[j + 1]
      if string.sub(f, 1, 2) == 'r:' then
        local amt, exp = string.match(fv, '^(%d+)|(%d+)')
        if amt and tonumber(exp) > now then
          held = held + tonumber(amt)
          if not x or tonumber(exp) < x then
            x = tonumber(exp)
          end
        else
          redis.call('HDEL', k, f)
        end
      end
    end
    redis.call('HSET', k, 'h', string.format('%d', held))
    if x then
      redis.call('HSET', k, 'x', x)
    else
      redis.call('HDEL', k, 'x')
    end
  end
  has_x[i] = x
  if spent + held + amount > limit then
    return {0, 1, i, math.max(0, limit - spent - held)}
  end
end

-- 2. Rate windows: room for the amount?
local fresh = {}
for i = nb + 1, last_rate do
  local k = KEYS[i]
  local j = i - nb
  local v = redis.call('HMGET', k, 'n', 'o')
  local n, o = tonumber(v[1]) or 0, tonumber(v[2])
  if o and o > cutoff then
    -- the clock went back: count from here, so the buckets written now leave in time
    o = cutoff
    redis.call('HSET', k, 'o', cutoff)
  end
  if not o then
    -- a new window (or one without its oldest second: start it afresh)
    if n > 0 then
      redis.call('DEL', k)
      n = 0
    end
    fresh[i] = true
  elseif o < cutoff then
    if cutoff - o > span then
      redis.call('DEL', k)
      n = 0
      fresh[i] = true
    else
      for s = o, cutoff - 1 do
        local c = tonumber(redis.call('HGET', k, s))
        if c then
          n = n - c
          redis.call('HDEL', k, s)
        end
      end
      if n < 0 then
        n = 0
      end
      redis.call('HSET', k, 'n', string.format('%d', n), 'o', cutoff)
    end
  end
  local limit, amount = tonumber(ARGV[ra + 2 * (j - 1)]), tonumber(ARGV[ra + 2 * (j - 1) + 1])
  if n + amount > limit and n > 0 then
    local first = sec
    for s = cutoff, sec do
      if redis.call('HEXISTS', k, s) == 1 then
        first = s
        break
      end
    end
    return {0, 2, j, math.max(1, (first + span) * 1000 - now)}
  end
end

-- 3. Writes.
for i = 1, nb do
  local k, amount = KEYS[i], ARGV[4 + 3 * i]
  local exp = now + ttl
  redis.call('HSET', k, 'r:' .. rid, amount .. '|' .. exp .. '|' .. sec)
  redis.call('HINCRBY', k, 'h', amount)
  if not has_x[i] or exp < has_x[i] then
    redis.call('HSET', k, 'x', exp)
  end
  redis.call('PEXPIREAT', k, ARGV[5 + 3 * i])
end
for i = nb + 1, last_rate do
  local k, j = KEYS[i], i - nb
  local amount = ARGV[ra + 2 * (j - 1) + 1]
  local b = redis.call('HINCRBY', k, sec, amount)
  redis.call('HINCRBY', k, 'n', amount)
  if fresh[i] then
    redis.call('HSET', k, 'o', cutoff)
  end
  -- a new second's bucket pushes the expiry on (once a second, not once a call)
  if fresh[i] or b == tonumber(amount) then
    redis.call('PEXPIRE', k, tonumber(ARGV[5]) + 2000)
  end
end
if adm then
  local amount = 0
  for j = 1, last_rate - nb do
    amount = math.max(amount, tonumber(ARGV[ra + 2 * (j - 1) + 1]))
  end
  -- never outliving the reservation made with it (a retry then reserves again)
  local adm_ttl = tonumber(ARGV[5]) + 2000
  if nb > 0 and ttl < adm_ttl then
    adm_ttl = ttl
  end
  redis.call('SET', adm, sec .. '|' .. string.format('%d', amount), 'PX', adm_ttl)
end
-- the third value: the server's milliseconds into `sec`, so a worker drawing on a block
-- of room (see src/ratelimit.rs) knows when that second ends
return {1, sec, now - sec * 1000}
