-- Take one free slot of a pool in one round trip, fairly.
-- (Runs after the prelude slot_clock.lua.)
--
-- KEYS[1] waiter queue of the pool (sorted set: token -> enqueue time, FIFO)
-- KEYS[2] lease hash of the pool (see slot_clock.lua)
-- KEYS[3] waiter liveness of the pool (sorted set: token -> server ms until which the
--         process counts as alive; refreshed by each of its tries that queues it)
-- KEYS[4..N+3] the pool's slot keys, slot i at KEYS[i+4]
-- ARGV[1] holder token of this process   ARGV[2] slot ttl ms
-- ARGV[3] '1' = on failure, enqueue this process as a waiter
-- ARGV[4] waiter liveness ttl ms         ARGV[5] stall gap ms
-- ARGV[6] index to try first (the slot this process released last: usually free, so a
--         busy pool costs one SET NX instead of a scan over every held slot)
-- ARGV[7] how many slots to take at most (the waiters of this process: one try serves
--         them all instead of one round trip each)
-- ARGV[8] prefix of the values of the slots taken: the j-th slot taken holds
--         ARGV[8] .. j (`<token>#<nonce>.j`: one value per lease, so a late release of
--         an old lease of this process can never delete a newer one)
--
-- Every key touched is in KEYS (Redis Cluster, proxies): other processes are only ever
-- named as members of the pool's sorted sets, never as parts of key names.
--
-- Fairness: while live waiters are queued, only the queue's head may take a free slot
-- (a slot freed by expiry goes to the longest waiter, not to whoever asks first).
-- Waiters whose liveness has run out (process gone) are dropped lazily.
-- After a Redis stall, the prelude has given lapsed leases back to their holders first.
--
-- Returns {k, 0, i1 .. ik}: k >= 1 slots taken (value = ARGV[8] .. j, PX ttl);
--         {0, ms}: none free; ms = time until the nearest lease expires (the full ttl
--         for a process further back than second in the queue: see below).
local token = ARGV[1]
local n = #KEYS - 3
local now = slot_clock(KEYS[2], 4, n, ARGV[5])
local head = nil
while true do
  local h = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #h == 0 then break end
  local alive = tonumber(redis.call('ZSCORE', KEYS[3], h[1]))
  if alive and alive > now then
    head = h[1]
    break
  end
  redis.call('ZREM', KEYS[1], h[1])
  redis.call('ZREM', KEYS[3], h[1])
end
if head == nil or head == token then
  local first = (tonumber(ARGV[6]) or 0) % n
  local want = math.max(1, tonumber(ARGV[7]) or 1)
  local got = {0, 0}
  for j = 0, n - 1 do
    local i = (first + j) % n
    local value = ARGV[8] .. (got[1] + 1)
    if redis.call('SET', KEYS[i + 4], value, 'NX', 'PX', ARGV[2]) then
      slot_note(KEYS[2], i, value, now, ARGV[2])
      got[#got + 1] = i
      got[1] = got[1] + 1
      if got[1] >= want then
        break
      end
    elseif j == 0 and n > 1 and n <= 4000
        and redis.call('EXISTS', unpack(KEYS, 4, n + 3)) >= n then
      -- The slot tried first is taken and so is every other: one EXISTS instead of a
      -- SET NX that fails on each (N of them in a full pool: at N=64 most of a failed
      -- try's time). Nothing was written, so the loop would have found none either.
      -- (Up to 4,000 keys: unpack's limit is near 8,000.)
      break
    end
  end
  if got[1] > 0 then
    if head == token then
      redis.call('ZREM', KEYS[1], token)
    end
    return got
  end
end
local wait = tonumber(ARGV[2])
-- Only the head (or anyone, with nobody queued) may take a slot freed by expiry: its next
-- try is due when the nearest lease expires. So is the next in line's, which is the head
-- as soon as the head leaves (served, gave up, gone). A process further back gets slots
-- by hand-off, or by its tries once it is one of the first two; its tries only keep it
-- alive in the queue, on the caller's tick (at most a second, well within ARGV[4]).
-- Scanning every slot's PTTL on every try was most of the fleet's Redis time per job
-- with 8 processes waiting (issue 9, scenario g).
local scan = head == nil or head == token
if not scan then
  local rank = redis.call('ZRANK', KEYS[1], token)
  scan = rank ~= false and rank <= 1
end
if scan then
  for k = 4, #KEYS do
    local t = redis.call('PTTL', KEYS[k])
    if t >= 0 and t < wait then wait = t end
  end
end
if ARGV[3] == '1' then
  -- Liveness: a member per waiting process, scored by when it lapses. Members of
  -- processes that died outside the queue are pruned here; the key itself lapses
  -- with its last member.
  local ttl = tonumber(ARGV[4])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  redis.call('ZADD', KEYS[3], now + ttl, token)
  redis.call('PEXPIRE', KEYS[3], ttl)
  if not redis.call('ZSCORE', KEYS[1], token) then
    local tm = redis.call('TIME')
    redis.call('ZADD', KEYS[1], tonumber(tm[1]) * 1000000 + tonumber(tm[2]), token)
  end
end
return {0, wait}
