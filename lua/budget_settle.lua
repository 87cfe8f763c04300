#!lua flags=allow-oom
-- Settle one reservation: the call's real cost replaces its worst case in every window
-- it was reserved in. A window that still holds the reservation counts the cost; one
-- that does not (the reservation expired: Redis was away past its ttl) counts it only on
-- a first try (ARGV[3] = '1'), so a settle sent twice (a retry after a lost reply)
-- counts once.
--
-- KEYS: the windows of the reservation   ARGV[1] reservation id   ARGV[2] cost picos
-- ARGV[3] '1' = no earlier try of this settle can have run
-- Returns how many windows were settled (0: the reservation had expired everywhere).
local settled = 0
for i = 1, #KEYS do
  if redis.call('HDEL', KEYS[i], 'r:' .. ARGV[1]) == 1 or ARGV[3] == '1' then
    redis.call('HINCRBY', KEYS[i], 'spent', ARGV[2])
    settled = settled + 1
  end
end
return settled
