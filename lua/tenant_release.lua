-- A tenant's place given back, and parked jobs of the tenant moved back into the jobs
-- stream for the places free now. Also the periodic sweep (ARGV[1] = ''), which gives
-- the places of expired members (a killed worker's) to parked jobs.
-- (Runs after the prelude tenant_clock.lua.)
--
-- KEYS[1] the tenant's holders in the pool   KEYS[2] the tenant's parked stream
-- KEYS[3] jobs stream   KEYS[4] index of parked streams   KEYS[5] the tenant clock
-- ARGV[1] member released ('' = none)   ARGV[2] the cap; 0 = the pool has no cap (any
-- more, as this worker's config says): move up to 100 parked entries back, no places
-- ARGV[3] how long a kept place lasts (ms)   ARGV[4] the index field
-- ARGV[5] stall gap ms
--
-- Each entry moved back gets a kept place `u:<new entry id>` (see tenant_admit.lua) and
-- the field `_unparked` = ARGV[4] (so the worker that reads it gives the place back if
-- the job ends without taking it), so no more entries are in transit than there are free
-- places: a tenant never runs more than the cap, and nothing spins. Entries keep every
-- other field verbatim (`_deliveries`, `_entry`, `_billed`, `_packed` included).
-- Returns the number of entries moved back.
local holders, parked, jobs = KEYS[1], KEYS[2], KEYS[3]
local bad = tenant_types({{holders, 'zset'}, {parked, 'stream'}, {jobs, 'stream'},
  {KEYS[4], 'hash'}, {KEYS[5], 'hash'}})
if bad then
  return bad
end
local now = tenant_now(KEYS[5], ARGV[5])
tenant_expire(holders, now, jobs, ARGV[3])
if ARGV[1] ~= '' then
  redis.call('ZREM', holders, ARGV[1])
end
local cap = tonumber(ARGV[2])
local room = 100
if cap > 0 then
  room = cap - redis.call('ZCARD', holders)
end
local moved = 0
if room > 0 and redis.call('EXISTS', parked) == 1 then
  for _, e in ipairs(redis.call('XRANGE', parked, '-', '+', 'COUNT', room)) do
    local fields = e[2]
    fields[#fields + 1] = '_unparked'
    fields[#fields + 1] = ARGV[4]
    local id = redis.call('XADD', jobs, '*', unpack(fields))
    if cap > 0 then
      redis.call('ZADD', holders, now + tonumber(ARGV[3]), 'u:' .. id)
    end
    redis.call('XDEL', parked, e[1])
    moved = moved + 1
  end
  if moved > 0 and cap > 0 then
    redis.call('PEXPIRE', holders, 2 * tonumber(ARGV[3]) + 600000)
  end
end
if redis.call('XLEN', parked) == 0 then
  redis.call('DEL', parked)
  redis.call('HDEL', KEYS[4], ARGV[4])
end
return moved
