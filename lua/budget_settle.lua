#!lua flags=allow-oom
-- Settle one reservation: the call's real cost replaces its worst case in every window
-- it was reserved in. A window that still holds the reservation counts the cost; one
-- that does not (the reservation expired: Redis was away past its ttl) counts it only on
-- a first try (ARGV[3] = '1'), so a settle sent twice (a retry after a lost reply)
-- counts once.
--
-- KEYS: the windows of the reservation   ARGV[1] reservation id   ARGV[2] cost picos
-- ARGV[3] '1' = no earlier try of this settle can have run
-- The reservation's amount leaves the window's running sum `h` with it (see
-- budget_reserve.lua).
-- Returns how many windows were settled (0: the reservation had expired everywhere).
local settled = 0
for i = 1, #KEYS do
  local v = redis.call('HGET', KEYS[i], 'r:' .. ARGV[1])
  if v then
    redis.call('HDEL', KEYS[i], 'r:' .. ARGV[1])
    local amt = tonumber(string.match(v, '^(%d+)|')) or 0
    -- (in a window of an earlier version without `h` this leaves it negative: the next
    -- reserve recounts it)
    redis.call('HINCRBY', KEYS[i], 'h', -amt)
  end
  if v or ARGV[3] == '1' then
    redis.call('HINCRBY', KEYS[i], 'spent', ARGV[2])
    settled = settled + 1
  end
end
return settled
