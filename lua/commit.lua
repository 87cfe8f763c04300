-- Commit one finished job in one atomic step: result entry (+ dead letter) (+ exact cost
-- totals) (+ result marker of the id) (+ XACK of the job entry, last) (+ XDEL of it).
-- Every key shares the {namespace} hash tag, so this also runs on Redis Cluster.
--
-- KEYS[1] jobs stream   KEYS[2] results stream   KEYS[3] dead stream
-- KEYS[4] cost totals hash   KEYS[5] result marker of the job id
-- KEYS[6] in-progress marker of the job id (deleted if it is this entry's)
-- KEYS[7] hand-back tombstone of the job entry (lua/handback.lua): the entry was moved
-- ARGV[1] group   ARGV[2] job entry id   ARGV[3] results/dead MAXLEN (approximate)
-- ARGV[4] result marker ttl in seconds (0 = no marker)   ARGV[5] 1 = XDEL the job entry
-- ARGV[6] the result's status (stored in the marker)   ARGV[7] this worker's consumer name
-- ARGV[8] n, then n field/value pairs of the result entry (its `job_entry` and `worker`
-- fields are how a later try recognises its own result)
-- then m, then m field/value pairs of the dead-letter entry (m = 0: none)
-- then k, then k field/increment pairs for the cost totals hash (integers)
--
-- Redis does not roll a script back, so everything that can fail is checked before the
-- first write (argument shape, key types, pending-ness), the first write is a
-- memory-consuming one (under `maxmemory` + `noeviction` it fails before anything is
-- written) and the XACK comes last. Invariant: the entry is acknowledged only if its
-- result was written in the same call.
--
-- Returns {'written', result id}: written now;
--         {'had', result id}: not pending any more, and its result is one this worker
--                             wrote (an earlier try whose reply was lost): nothing written;
--         {'superseded', result id or ''}: another worker committed the entry: nothing
--                             written (a job never gets two results).
-- An entry deleted from the jobs stream while pending (XDEL, MAXLEN) may have been dropped
-- from the pending list by XCLAIM/XAUTOCLAIM; if no result exists for it nor an ok
-- result for its id, its result is written anyway (there is nothing left to acknowledge),
-- unless it was handed back (tombstone KEYS[7]): then the new entry's worker answers the
-- job, and this commit is superseded (one result per job).
-- Errors (nothing written): `WRONGTYPE <key> ...` naming the key, `ERR commit.lua: ...`
-- for a malformed call.
local jobs, results, dead, costs, marker, inflight, handedback =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
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
for j = 2, #costl, 2 do
  local v = tonumber(costl[j])
  if not v or v % 1 ~= 0 then
    return redis.error_reply('ERR commit.lua: cost increment ' .. costl[j - 1] .. ' is not an integer (a worker bug: report it)')
  end
end

-- 2. Key types (a write to a key of another type fails half-way otherwise).
local function kind(key)
  return redis.call('TYPE', key)['ok']
end
local function wrong(key, want)
  local got = kind(key)
  if got ~= 'none' and got ~= want then
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. got .. ', not a ' .. want ..
      ': rename or delete it (results wait until then)')
  end
  return nil
end
local e = wrong(jobs, 'stream') or wrong(results, 'stream')
  or (#deadl > 0 and wrong(dead, 'stream')) or (#costl > 0 and wrong(costs, 'hash'))
  or wrong(marker, 'string')
if e then
  return e
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
local mval = redis.call('GET', marker)
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
local pending = #redis.call('XPENDING', jobs, group, entry, entry, 1) == 1
if not pending then
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
end

-- 4. Writes; the first one (XADD) is the one refused under OOM, before anything else.
local id = redis.call('XADD', results, 'MAXLEN', '~', maxlen, '*', unpack(result))
if #deadl > 0 then
  redis.call('XADD', dead, 'MAXLEN', '~', maxlen, '*', unpack(deadl))
end
for j = 1, #costl, 2 do
  redis.call('HINCRBY', costs, costl[j], costl[j + 1])
end
-- An ok marker is never replaced: the id's answer stays the one producers already saw.
if ttl > 0 and mstatus ~= 'ok' then
  redis.call('SET', marker, id .. '|' .. status, 'EX', ttl)
end
if kind(inflight) == 'string' and redis.call('GET', inflight) == entry then
  redis.call('DEL', inflight)
end
if pending then
  redis.call('XACK', jobs, group, entry)
end
if del == '1' then
  redis.call('XDEL', jobs, entry)
end
return {'written', id}
