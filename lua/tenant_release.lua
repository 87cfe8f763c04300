-- A tenant lease given back, and parked jobs of the tenant moved back into the jobs
-- stream for the places free now. Also the periodic sweep (ARGV[1] = ''), which gives
-- the places of expired members (a killed worker's) to parked jobs.
--
-- KEYS[1] the tenant's holders in the pool (see tenant_admit.lua)
-- KEYS[2] the tenant's parked stream   KEYS[3] jobs stream   KEYS[4] index of parked
-- streams
-- ARGV[1] member released ('' = none)   ARGV[2] the cap   ARGV[3] how long a place is
-- kept for an entry moved back (ms)   ARGV[4] the index field of this pool and tenant
--
-- Each entry moved back gets a kept place `u:<new entry id>` (see tenant_admit.lua), so
-- no more entries are in transit than there are places: a tenant never runs more than
-- the cap, and a parked entry is moved back at most once per free place. Entries keep
-- every field verbatim (`_deliveries`, `_entry`, `_billed`, `_packed` included).
-- Returns the number of entries moved back.
local holders, parked, jobs = KEYS[1], KEYS[2], KEYS[3]
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
if ARGV[1] ~= '' then
  redis.call('ZREM', holders, ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
local room = tonumber(ARGV[2]) - redis.call('ZCARD', holders)
local moved = 0
if room > 0 and redis.call('EXISTS', parked) == 1 then
  local es = redis.call('XRANGE', parked, '-', '+', 'COUNT', room)
  for _, e in ipairs(es) do
    local id = redis.call('XADD', jobs, '*', unpack(e[2]))
    redis.call('ZADD', holders, now + tonumber(ARGV[3]), 'u:' .. id)
    redis.call('XDEL', parked, e[1])
    moved = moved + 1
  end
  if moved > 0 then
    redis.call('PEXPIRE', holders, 2 * tonumber(ARGV[3]) + 600000)
  end
end
if redis.call('XLEN', parked) == 0 then
  redis.call('DEL', parked)
  redis.call('HDEL', KEYS[4], ARGV[4])
end
return moved
