#!lua flags=allow-oom
-- After a call: its budget reservation settled to the real cost, and its tokens
-- admission corrected to the tokens really used, in one step (see quota_admit.lua).
--
-- KEYS[1..B]: the budget windows of the reservation; KEYS[B+1..]: the rate windows of
-- the tokens limits it was admitted in
-- ARGV[1] B   ARGV[2] reservation id   ARGV[3] cost picos
-- ARGV[4] '1' = no earlier try of this settle can have run
-- ARGV[5] estimated tokens   ARGV[6] tokens used   ARGV[7] the admission's second
--
-- Budget: a window that still holds the reservation counts the cost (and the amount
-- leaves its running sum `h`); one that does not (the reservation expired: Redis was
-- away past its ttl) counts it only on a first try, so a settle sent twice counts once.
-- Tokens: in the bucket the call was admitted in, if it is still in the window (later,
-- the correction no longer matters); never below zero.
-- Returns how many budget windows were settled.
local nb = tonumber(ARGV[1])
local settled = 0
for i = 1, nb do
  local k = KEYS[i]
  local v = redis.call('HGET', k, 'r:' .. ARGV[2])
  if v then
    redis.call('HDEL', k, 'r:' .. ARGV[2])
    -- (a window of an earlier version without `h` is left negative: the next
    -- admission recounts it)
    redis.call('HINCRBY', k, 'h', -(tonumber(string.match(v, '^(%d+)|')) or 0))
  end
  if v or ARGV[4] == '1' then
    redis.call('HINCRBY', k, 'spent', ARGV[3])
    settled = settled + 1
  end
end
local delta = tonumber(ARGV[6]) - tonumber(ARGV[5])
if delta ~= 0 then
  for i = nb + 1, #KEYS do
    local k = KEYS[i]
    local c = tonumber(redis.call('HGET', k, ARGV[7]))
    if c then
      local d = math.max(delta, -c)
      redis.call('HINCRBY', k, ARGV[7], d)
      if tonumber(redis.call('HINCRBY', k, 'n', d)) < 0 then
        redis.call('HSET', k, 'n', 0)
      end
    end
  end
end
return settled
