-- A tenant's place under `pools.<p>.max_per_tenant`, or the job parked, in one step.
-- (Runs after the preludes tenant_clock.lua and move_entry.lua.)
--
-- KEYS[1] jobs stream   KEYS[2] in-progress marker of the job id   KEYS[3] hand-back
-- tombstone of the entry (all three as in handback.lua)
-- KEYS[4] the tenant's holders in the pool (see tenant_clock.lua)
-- KEYS[5] the tenant's parked stream in the pool   KEYS[6] index of parked streams (hash:
-- "<pool>:<tenant>" -> 1), which the sweep walks   KEYS[7] the tenant clock (hash)
-- ARGV[1..8] as handback.lua's ARGV[1..8]
-- ARGV[9] this lease's member   ARGV[10] the cap   ARGV[11] lease ttl ms
-- ARGV[12] the index field of this pool and tenant
-- ARGV[13] stall gap ms   ARGV[14] how long a kept place lasts (ms)
--
-- A member already present (a retry whose reply was lost) is admitted again. A kept
-- place `u:<this entry>` is taken by this entry only. Every key is type-checked before
-- the first write, so an error leaves nothing half done.
-- Returns {'admitted', ''} | {'parked', new entry id in the parked stream} |
--         {'notours', ''} | {'deleted', ''} (as handback.lua)
local holders = KEYS[4]
local bad = tenant_types({{KEYS[1], 'stream'}, {holders, 'zset'}, {KEYS[5], 'stream'},
  {KEYS[6], 'hash'}, {KEYS[7], 'hash'}})
if bad then
  return bad
end
local now = tenant_now(KEYS[7], ARGV[13])
tenant_expire(holders, now, KEYS[1], ARGV[14])
local ttl = tonumber(ARGV[11])
local admitted = redis.call('ZSCORE', holders, ARGV[9]) ~= false
if not admitted and redis.call('ZREM', holders, 'u:' .. ARGV[3]) == 1 then
  admitted = true
elseif not admitted and redis.call('ZCARD', holders) < tonumber(ARGV[10]) then
  admitted = true
end
if admitted then
  redis.call('ZADD', holders, now + ttl, ARGV[9])
  -- the key outlives its longest member (kept places included) and no longer
  redis.call('PEXPIRE', holders, 2 * ttl + 600000)
  return {'admitted', ''}
end
local r = move_entry(KEYS[1], KEYS[2], KEYS[3], KEYS[5], ARGV)
if r[1] == 'moved' then
  redis.call('HSET', KEYS[6], ARGV[12], '1')
  return {'parked', r[2]}
end
return r
