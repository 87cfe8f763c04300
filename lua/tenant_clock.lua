#!lua flags=allow-oom
-- Shared prelude of the tenant scripts (tenant_admit, tenant_release, tenant_renew): the
-- type checks that run before their first write, and the tenant clock, so that time in
-- which Redis itself could not answer does not count against a place's holder (the idea
-- of slot_clock.lua for slots).
--
-- Holders: a sorted set per tenant and pool (member -> expiry) of leases `<token>#<n>`
-- (renewed every ttl/3 by their process) and kept places `u:<entry id>` (an entry moved
-- back from the parked stream, see tenant_release.lua). Expiries are in *tenant time*:
-- server ms minus every stall seen so far.
-- Clock: the hash `{ns}:tenantclock`, field `t` = server ms of the last tenant script,
-- `s` = stall ms so far. Every worker with a capped pool runs a tenant script at least
-- every ttl/3 (its renewer ticks even when it holds nothing), so a gap above `gap`
-- (ttl/2) means nobody could reach Redis (stopped, busy, failing over, cut off), and it
-- does not count: tenant time stands still through it, so a running job keeps its place
-- through a stall instead of a parked job taking it. (A fleet that was all down counts
-- the same way: its places live one ttl after it is back.)
-- Expired members are dropped, except a kept place whose entry is still in the jobs
-- stream (not yet acknowledged): it is kept another `transit` ms, so a backlog in front
-- of an entry moved back never costs it its place.
--
-- allow-oom: under maxmemory + noeviction, renewals and releases must go on (a refused
-- renewal would let a place lapse while its call runs); nothing here grows by more than
-- a member, and a park or move-back only moves an entry between streams.

-- A redis.error_reply naming the first key of the wrong type, or nil. `checks`: pairs
-- {key, type}; a missing key is fine.
local function tenant_types(checks)
  for _, c in ipairs(checks) do
    local t = redis.call('TYPE', c[1])['ok']
    if t ~= 'none' and t ~= c[2] then
      return redis.error_reply('WRONGTYPE ' .. c[1] .. ' is a ' .. t .. ', not a ' .. c[2] ..
        ': rename or delete it (tenant places cannot be checked until then)')
    end
  end
  return nil
end

-- Tenant time now (see above), after counting a stall since the last tenant script.
local function tenant_now(clock, gap)
  local tm = redis.call('TIME')
  local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
  local v = redis.call('HMGET', clock, 't', 's')
  local last, stalled = tonumber(v[1]), tonumber(v[2]) or 0
  if last and now - last > tonumber(gap) then
    stalled = stalled + (now - last)
    redis.call('HSET', clock, 't', now, 's', stalled)
  else
    redis.call('HSET', clock, 't', now)
  end
  return now - stalled
end

-- Drops the expired members of `holders` at tenant time `vnow` (kept places whose entry
-- is still in `jobs` are kept another `transit` ms instead).
local function tenant_expire(holders, vnow, jobs, transit)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', holders, '-inf', vnow)) do
    local id = string.match(m, '^u:(.+)$')
    if id and #redis.call('XRANGE', jobs, id, id) == 1 then
      redis.call('ZADD', holders, vnow + tonumber(transit), m)
    else
      redis.call('ZREM', holders, m)
    end
  end
end

