-- Renew the leases this process holds: PEXPIRE only where the value is still our token.
-- A lease that is gone or someone else's is reported, never re-created.
-- KEYS: slot keys   ARGV[1] token   ARGV[2] ttl ms
-- Returns one integer per key: 1 renewed, 0 lost.
local out = {}
for k = 1, #KEYS do
  if redis.call('GET', KEYS[k]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[k], ARGV[2])
    out[k] = 1
  else
    out[k] = 0
  end
end
return out
