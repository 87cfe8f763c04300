#!lua flags=allow-oom
-- After a call: its budget reservation settled to the real cost, and its tokens
-- admission corrected to the tokens really used, in one step (see quota_admit.lua).
--
-- KEYS[1..B]: the budget windows of the reservation; then the rate windows of the
-- tokens limits it was admitted in, then (ARGV[8] of them) those of its requests limits;
-- KEYS[#KEYS] (when it was admitted in any rate window): its admission record (see
-- quota_admit.lua)
-- ARGV[1] B   ARGV[2] reservation id   ARGV[3] cost picos
-- ARGV[4] '1' = no earlier try of this settle can have run
-- ARGV[5] estimated tokens   ARGV[6] tokens used   ARGV[7] '1' = KEYS[#KEYS] is the
-- admission record   ARGV[8] (optional) how many requests windows follow the tokens
-- windows   ARGV[9] (optional) their correction (a block's calls not made, negative)
--
-- Budget: a window that still holds the reservation counts the cost (and the amount
-- leaves its running sum `h`); one that does not (the reservation expired: Redis was
-- away past its ttl) counts it only on a first try, so a settle sent twice counts once.
-- Tokens: once (the admission record is taken with the correction: a settle sent again
-- finds none), in the bucket the call was admitted in, if it is still in the window
-- (later, the correction no longer matters); never below zero.
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
    -- the amount as its digits: a Lua number of 1e17 or more would be sent as "1e+17"
    local amt = string.match(v, '^(%d+)|')
    if amt then
      redis.call('HINCRBY', k, 'h', '-' .. amt)
    end
  end
  if v or ARGV[4] == '1' then
    redis.call('HINCRBY', k, 'spent', ARGV[3])
    settled = settled + 1
  end
end
local delta = tonumber(ARGV[6]) - tonumber(ARGV[5])
-- requests windows (a block's room nobody drew on goes back): ARGV[8] of them, the last
-- before the admission record, corrected by ARGV[9] (absent: none)
local nr = tonumber(ARGV[8] or '0') or 0
local rdelta = tonumber(ARGV[9] or '0') or 0
local function correct(k, sec, d)
  local c = tonumber(redis.call('HGET', k, sec))
  if c then
    d = math.max(d, -c)
    redis.call('HINCRBY', k, sec, d)
    if tonumber(redis.call('HINCRBY', k, 'n', d)) < 0 then
      redis.call('HSET', k, 'n', 0)
    end
  end
end
if ARGV[7] == '1' then
  local rec = redis.call('GET', KEYS[#KEYS])
  local sec = rec and string.match(rec, '^(%d+)|')
  if sec then
    redis.call('DEL', KEYS[#KEYS])
    if delta ~= 0 then
      for i = nb + 1, #KEYS - 1 - nr do
        correct(KEYS[i], sec, delta)
      end
    end
    if rdelta ~= 0 then
      for i = #KEYS - nr, #KEYS - 1 do
        correct(KEYS[i], sec, rdelta)
      end
    end
  end
end
return settled
