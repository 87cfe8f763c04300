-- Renews this process's tenant leases (one call per tick for all of them).
-- KEYS: holder sets   ARGV[1] lease ttl ms   ARGV[2..]: for each key, a count c then c
-- members. A member already gone (released, or expired and dropped) is not brought back;
-- one expired but not yet dropped is (the job still runs: it still holds its place).
-- Returns the number of members renewed.
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local until_ = now + tonumber(ARGV[1])
local a, n = 2, 0
for k = 1, #KEYS do
  local c = tonumber(ARGV[a])
  a = a + 1
  for _ = 1, c do
    n = n + redis.call('ZADD', KEYS[k], 'XX', 'CH', until_, ARGV[a])
    a = a + 1
  end
  redis.call('PEXPIRE', KEYS[k], 2 * tonumber(ARGV[1]) + 600000)
end
return n
