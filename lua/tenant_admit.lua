-- A tenant's place under `pools.<p>.max_per_tenant`, or the job parked, in one step.
-- (Runs after the prelude move_entry.lua.)
--
-- KEYS[1] jobs stream   KEYS[2] in-progress marker of the job id   KEYS[3] hand-back
-- tombstone of the entry (all three as in handback.lua)
-- KEYS[4] the tenant's holders in the pool (sorted set: member -> expiry ms, server time)
-- KEYS[5] the tenant's parked stream in the pool   KEYS[6] index of parked streams (hash:
-- "<pool>:<tenant>" -> 1), which the sweep of tenant_release.lua walks
-- ARGV[1..8] as handback.lua's ARGV[1..8]
-- ARGV[9] this lease's member   ARGV[10] the cap   ARGV[11] lease ttl ms
-- ARGV[12] the index field of this pool and tenant
--
-- Members: a running job's lease (`<token>#<nonce>`, renewed by tenant_renew.lua while
-- the job runs) or `u:<entry id>`: a place kept for an entry that tenant_release.lua
-- moved from the parked stream back to the jobs stream (in transit), which only that
-- entry may take. Expired members (a killed worker's, a parked job that never came back)
-- are dropped first, so they hold no place past their expiry.
--
-- Returns {'admitted', ''} | {'parked', new entry id in the parked stream} |
--         {'notours', ''} | {'deleted', ''} (as handback.lua; nothing written but cleanup)
local holders = KEYS[4]
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local ttl = tonumber(ARGV[11])
redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
local admitted = false
if redis.call('ZREM', holders, 'u:' .. ARGV[3]) == 1 then
  admitted = true
elseif redis.call('ZCARD', holders) < tonumber(ARGV[10]) then
  admitted = true
end
if admitted then
  redis.call('ZADD', holders, now + ttl, ARGV[9])
  -- the key outlives its longest member (in-transit places included) and no longer
  redis.call('PEXPIRE', holders, 2 * ttl + 600000)
  return {'admitted', ''}
end
local r = move_entry(KEYS[1], KEYS[2], KEYS[3], KEYS[5], ARGV)
if r[1] == 'moved' then
  redis.call('HSET', KEYS[6], ARGV[12], '1')
  return {'parked', r[2]}
end
return r
