#!lua flags=allow-oom
-- Settle one reservation: the call's real cost replaces its worst case in every window
-- it was reserved in. Idempotent: only a window that still holds the reservation adds
-- the cost, so a settle sent twice (a retry after a lost reply) counts once.
--
-- KEYS: the windows of the reservation   ARGV[1] reservation id   ARGV[2] cost picos
-- Returns how many windows were settled (0: the reservation had expired everywhere).
local settled = 0
for i = 1, #KEYS do
  if redis.call('HDEL', KEYS[i], 'r:' .. ARGV[1]) == 1 then
    redis.call('HINCRBY', KEYS[i], 'spent', ARGV[2])
    settled = settled + 1
  end
end
return settled
