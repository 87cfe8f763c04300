-- Commit one finished job in one atomic step: result entry (+ dead letter) (+ exact cost
-- totals) (+ result marker of the id) (+ XACK of the job entry, last) (+ XDEL of it).
-- Every key shares the {namespace} hash tag, so this also runs on Redis Cluster.
--
-- KEYS[1] jobs stream   KEYS[2] results stream   KEYS[3] dead stream
-- KEYS[4] cost totals hash   KEYS[5] result marker of the job id
-- KEYS[6] in-progress marker of the job id (deleted if it is this entry's)
-- KEYS[7] hand-back tombstone of the job entry (lua/handback.lua): the entry was moved
-- KEYS[8] dropped-entry tombstones (lua/reclaim.lua; sorted set: entry id -> expiry ms)
-- KEYS[9] KEYS[10] spend of the UTC day and month (hash: model -> picodollars), what
-- `status` shows per model: each `<model>:cost_picos` increment is added there too, with
-- redis.pcall (display figures: a wrong type or overflow there never fails a commit; the
-- exact bill is KEYS[4]). The day expires after 40 days, the month after 400.
-- ARGV[1] group   ARGV[2] job entry id   ARGV[3] results/dead MAXLEN (approximate)
-- ARGV[4] result marker ttl in seconds (0 = no marker)   ARGV[5] 1 = XDEL the job entry
-- ARGV[6] the result's status (stored in the marker)   ARGV[7] this worker's consumer name
-- ARGV[8] n, then n field/value pairs of the result entry (its `job_entry` and `worker`
-- fields are how a later try recognises its own result)
-- then m, then m field/value pairs of the dead-letter entry (m = 0: none)
-- then k, then k field/increment pairs for the cost totals hash (integers)
--
-- Redis does not roll a script back, so the argument shape and pending-ness are checked
-- before the first write; the writes that can still be refused (the cost totals'
-- HINCRBYs, the result's XADD: a field that is not an integer, an overflow, a key of the
-- wrong type) run first, with pcall, and a refusal undoes the increments made before it;
-- the first write is one Redis refuses under `maxmemory` + `noeviction` before anything
-- is written (after it Redis refuses no write of the script), and the XACK comes last.
-- Per job on the common path: GET, XPENDING, HMGET, one HINCRBY per non-zero cost field,
-- XADD, SET, GET, XACK, XDEL (no TYPE, no HGET). Invariant: the entry is acknowledged only if
-- its result was written in the same call, and a refused call leaves every key as it was.
--
-- Returns {'written', result id}: written now;
--         {'had', result id}: not pending any more, and its result is one this worker
--                             wrote (an earlier try whose reply was lost): nothing written;
--         {'superseded', result id or ''}: another worker committed the entry: nothing
--                             written (a job never gets two results).
-- An entry neither pending nor in the jobs stream gets a result only on positive evidence
-- that it was dropped from the pending list without one: a tombstone of lua/reclaim.lua
-- in KEYS[8] (the producer deleted it while pending, and an XAUTOCLAIM dropped it; the
-- tombstone is removed with the write). Otherwise (acknowledged and deleted by the commit
-- of another worker, delete_acked; handed back, tombstone KEYS[7]; an ok result of its
-- id) the commit is superseded: a job never gets two results, with or without a producer
-- id. Known limit: a reply lost after a successful commit whose retry comes after more
-- than 1000 other results of a job without a producer id is answered `superseded`
-- instead of `had` (still exactly one result).
-- Errors (nothing written): `WRONGTYPE <key> ...` naming the key, `ERR <key> field <f>
-- ...` for a cost totals field HINCRBY would refuse (not an integer, or the sum leaves
-- the 64-bit range: both like a key of the wrong type, someone must fix it),
-- `ERR commit.lua: ...` for a malformed call (including more fields than Lua can pass to
-- one XADD: the worker packs wide dead letters, see src/queue/wire.rs).
local jobs, results, dead, costs, marker, inflight, handedback, dropped =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local group, entry, maxlen, ttl, del, status, consumer =
  ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]

-- 1. Argument shape.
if not maxlen or not ttl or ttl < 0 then
  return redis.error_reply('ERR commit.lua: MAXLEN and marker ttl must be numbers (a worker bug: report it)')
end
local spans = {}
local i = 8
for s = 1, 3 do
  local n = tonumber(ARGV[i])
  if not n or n < 0 or n % 1 ~= 0 or i + 2 * n > #ARGV then
    return redis.error_reply('ERR commit.lua: malformed field list at ARGV[' .. i .. '] (a worker bug: report it)')
  end
  spans[s] = {i + 1, i + 2 * n}
  i = i + 2 * n + 1
end
if i - 1 ~= #ARGV then
  return redis.error_reply('ERR commit.lua: ' .. (#ARGV - i + 1) .. ' trailing arguments (a worker bug: report it)')
end
local function slice(s)
  local out = {}
  for j = spans[s][1], spans[s][2] do
    out[#out + 1] = ARGV[j]
  end
  return out
end
local result, deadl, costl = slice(1), slice(2), slice(3)
if #result == 0 then
  return redis.error_reply('ERR commit.lua: empty result entry (a worker bug: report it)')
end
-- unpack() below puts every value on Lua's C stack (at most 8000 slots).
if #result > 7000 or #deadl > 7000 then
  return redis.error_reply('ERR commit.lua: ' .. math.max(#result, #deadl) / 2 ..
    ' fields are more than one XADD from Lua can take (a worker bug: report it)')
end

local seen = {}
for j = 1, #costl, 2 do
  if seen[costl[j]] then
    return redis.error_reply('ERR commit.lua: cost increment ' .. costl[j] ..
      ' is repeated (a worker bug: report it)')
  end
  seen[costl[j]] = true
  local inc = costl[j + 1]
  if inc ~= '0' and not string.match(inc, '^[1-9]%d*$') then
    return redis.error_reply('ERR commit.lua: cost increment ' .. costl[j] .. ' = ' .. inc ..
      ' is not a whole number >= 0 (a worker bug: report it)')
  end
end

-- 2. Key types. A read of a key of the wrong type fails before anything is written, so
-- the reads below run with pcall and a failure is answered naming the key; a key only
-- written (the dead stream, the dropped tombstones) is checked with TYPE, on the rare
-- paths that write it.
local function named(key, want, got)
  got = got or redis.call('TYPE', key)['ok']
  return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. got .. ', not a ' .. want ..
    ': rename or delete it (results wait until then)')
end
local function wrong(key, want)
  local got = redis.call('TYPE', key)['ok']
  if got ~= 'none' and got ~= want then
    return named(key, want, got)
  end
  return nil
end
local function failed(r)
  return type(r) == 'table' and r['err'] ~= nil
end
if #deadl > 0 then
  local e = wrong(dead, 'stream')
  if e then
    return e
  end
end

-- 3. Pending-ness and what the id already has.
local function field(kv, name)
  for j = 1, #kv, 2 do
    if kv[j] == name then
      return kv[j + 1]
    end
  end
  return nil
end
local mval = redis.pcall('GET', marker)
if failed(mval) then
  return named(marker, 'string')
end
local mrid, mstatus = nil, nil
if mval then
  mrid, mstatus = string.match(mval, '^(.*)|([^|]*)$')
end
-- The result entry written for this job entry, if any: the marker's first, else among
-- the most recent results (bounded scan; this path runs only for entries not pending).
local function result_of_entry()
  if mrid then
    local r = redis.call('XRANGE', results, mrid, mrid)
    if #r == 1 and field(r[1][2], 'job_entry') == entry then
      return mrid, field(r[1][2], 'worker')
    end
  end
  local r = redis.call('XREVRANGE', results, '+', '-', 'COUNT', 1000)
  for j = 1, #r do
    if field(r[j][2], 'job_entry') == entry then
      return r[j][1], field(r[j][2], 'worker')
    end
  end
  return nil, nil
end
local p = redis.pcall('XPENDING', jobs, group, entry, entry, 1)
if failed(p) then
  local t = redis.call('TYPE', jobs)['ok']
  if t ~= 'stream' and t ~= 'none' then
    return named(jobs, 'stream', t)
  end
  -- no such stream or group (NOGROUP): as Redis says it
  return p
end
local pending = #p == 1
if not pending then
  local e = wrong(results, 'stream') or wrong(dropped, 'zset')
  if e then
    return e
  end
  local rid, by = result_of_entry()
  if rid then
    if by == consumer then
      return {'had', rid}
    end
    return {'superseded', rid}
  end
  local exists = #redis.call('XRANGE', jobs, entry, entry) == 1
  if exists or mstatus == 'ok' or redis.call('EXISTS', handedback) == 1 then
    return {'superseded', ''}
  end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local until_ms = tonumber(redis.call('ZSCORE', dropped, entry))
  if not until_ms or until_ms < now then
    return {'superseded', ''}
  end
end

-- 4. Cost totals first, each undone if a later one (or the result's XADD) is refused:
-- HINCRBY itself refuses a field that is not an integer as Redis reads one, or a sum
-- that leaves the 64-bit range, exactly, so nothing is parsed here. Under `maxmemory` +
-- `noeviction` the first write is refused before anything is written; after it Redis
-- refuses no write of this script, so an undo cannot fail.
-- What each field holds now (one HMGET), so an undo puts back exactly that: the old
-- value, or no field at all.
local before = {}
if #costl > 0 then
  local names = {}
  for j = 1, #costl, 2 do
    names[#names + 1] = costl[j]
  end
  before = redis.pcall('HMGET', costs, unpack(names))
  if failed(before) then
    if string.sub(before['err'], 1, 9) == 'WRONGTYPE' then
      return named(costs, 'hash')
    end
    return before
  end
end
local added = 0
local function undo()
  for j = 1, added * 2, 2 do
    local old = before[(j + 1) / 2]
    if old then
      redis.call('HSET', costs, costl[j], old)
    else
      redis.call('HDEL', costs, costl[j])
    end
  end
end
for j = 1, #costl, 2 do
  local f, inc = costl[j], costl[j + 1]
  local r = 0
  if inc ~= '0' then
    r = redis.pcall('HINCRBY', costs, f, inc)
  end
  if failed(r) then
    undo()
    if string.sub(r['err'], 1, 9) == 'WRONGTYPE' then
      return named(costs, 'hash')
    end
    local bad
    if string.find(r['err'], 'not an integer', 1, true) then
      bad = 'is not an integer'
    elseif string.find(r['err'], 'overflow', 1, true) then
      bad = 'plus ' .. inc .. ' leaves the 64-bit integer range'
    else
      -- not about the field (OOM, say): the error as Redis gave it
      return r
    end
    local cur = redis.call('HGET', costs, f) or ''
    local shown = cur
    if #shown > 40 then
      shown = string.sub(shown, 1, 40) .. '...'
    end
    return redis.error_reply('ERR ' .. costs .. ' field ' .. f .. ' holds "' .. shown .. '", which ' ..
      bad .. ': fix or delete the field (cost totals are not added until then)')
  end
  added = added + 1
end

-- 5. The result (refused under OOM when it is the first write), then the rest.
local id = redis.pcall('XADD', results, 'MAXLEN', '~', maxlen, '*', unpack(result))
if failed(id) then
  undo()
  if string.sub(id['err'], 1, 9) == 'WRONGTYPE' then
    return named(results, 'stream')
  end
  return id
end
if #deadl > 0 then
  redis.call('XADD', dead, 'MAXLEN', '~', maxlen, '*', unpack(deadl))
end
for j = 1, #costl, 2 do
  local model = string.match(costl[j], '^(.*):cost_picos$')
  if model then
    -- the expiry is set when a model's field is new (its first job of the day / month)
    if redis.pcall('HINCRBY', KEYS[9], model, costl[j + 1]) == tonumber(costl[j + 1]) then
      redis.pcall('EXPIRE', KEYS[9], 3456000)
    end
    if redis.pcall('HINCRBY', KEYS[10], model, costl[j + 1]) == tonumber(costl[j + 1]) then
      redis.pcall('EXPIRE', KEYS[10], 34560000)
    end
  end
end
-- An ok marker is never replaced: the id's answer stays the one producers already saw.
if ttl > 0 and mstatus ~= 'ok' then
  redis.call('SET', marker, id .. '|' .. status, 'EX', ttl)
end
if redis.pcall('GET', inflight) == entry then
  redis.call('DEL', inflight)
end
if pending then
  redis.call('XACK', jobs, group, entry)
else
  redis.call('ZREM', dropped, entry)
end
if del == '1' then
  redis.call('XDEL', jobs, entry)
end
return {'written', id}
