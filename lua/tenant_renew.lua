-- Renews this process's tenant places (one call per tick for all of them); also the
-- tick of the tenant clock, run by every worker with a capped pool even when it holds
-- nothing (see tenant_clock.lua).
-- (Runs after the prelude tenant_clock.lua.)
-- KEYS[1] the tenant clock   KEYS[2] jobs stream   KEYS[3..] holder sets
-- ARGV[1] lease ttl ms   ARGV[2] stall gap ms   ARGV[3] how long a kept place lasts (ms)
-- ARGV[4..]: for each holder set, a count c, then c members.
-- A member already gone (released, or expired and dropped) is not brought back.
-- A holder set of the wrong type is skipped (tenant_admit reports it to the job).
-- Returns the number of members renewed.
local bad = tenant_types({{KEYS[1], 'hash'}, {KEYS[2], 'stream'}})
if bad then
  return bad
end
local now = tenant_now(KEYS[1], ARGV[2])
local a, n = 4, 0
for k = 3, #KEYS do
  local c = tonumber(ARGV[a])
  a = a + 1
  if not tenant_types({{KEYS[k], 'zset'}}) then
    tenant_expire(KEYS[k], now, KEYS[2], ARGV[3])
    for j = 0, c - 1 do
      n = n + redis.call('ZADD', KEYS[k], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[a + j])
    end
    redis.call('PEXPIRE', KEYS[k], 2 * tonumber(ARGV[1]) + 600000)
  end
  a = a + c
end
return n
