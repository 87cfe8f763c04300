-- Commit finished jobs, each in one step of its own: result entry (+ dead letter) (+ exact
-- cost totals) (+ result marker of the id) (+ XACK of the job entry, last) (+ XDEL of it).
-- One call commits a batch of jobs (the worker sends what finished while the previous
-- call ran); a batch of one is the same as a call for that job alone. Every key shares
-- the {namespace} hash tag, so this also runs on Redis Cluster.
--
-- KEYS[1] jobs stream   KEYS[2] results stream   KEYS[3] cost totals hash
-- KEYS[4] dropped-entry tombstones (lua/reclaim.lua; sorted set: entry id -> expiry ms)
-- KEYS[5] KEYS[6] spend of the UTC day and month (hash: model -> picodollars), what
-- `status` shows per model: each `<model>:cost_picos` increment is added there too, with
-- redis.pcall (display figures: a wrong type or overflow there never fails a commit; the
-- exact bill is KEYS[3]). The day expires after 40 days, the month after 400.
-- Then 4 keys per job: its dead-letter stream (`dead` or `failed`), the result marker of
-- its id, the in-progress marker of its id (deleted if it is this entry's), the hand-back
-- tombstone of its entry (lua/handback.lua: the entry was moved).
-- ARGV[1] group   ARGV[2] results/dead MAXLEN (approximate)   ARGV[3] 1 = XDEL job entries
-- ARGV[4] this worker's consumer name
-- Then per job: its entry id, the result marker ttl in seconds (0 = no marker), the
-- result's status (stored in the marker), 1 if it has an in-progress marker (a producer
-- id) else 0, n, then n field/value pairs of the result entry
-- (its `job_entry` and `worker` fields are how a later try recognises its own result),
-- then m, then m field/value pairs of the dead-letter entry (m = 0: none), then k, then k
-- field/increment pairs for the cost totals hash (integers).
--
-- Redis does not roll a script back, so each job's argument shape and pending-ness are
-- checked before its first write; the writes that can still be refused (the cost totals'
-- HINCRBYs, the result's XADD: a field that is not an integer, an overflow, a key of the
-- wrong type) run first, with pcall, and a refusal undoes the increments made for it; the
-- first write of the call is one Redis refuses under `maxmemory` + `noeviction` before
-- anything is written (after it Redis refuses no write of the script), and each job's
-- XACK comes after its own writes. The cost totals of the batch's jobs are added together,
-- one HINCRBY per field (sums of decimal strings, exact).
-- Per job on the common path: XPENDING, XADD, XACK, XDEL; a producer id adds GET, SET,
-- GET (+ DEL); per call: HMGET and one HINCRBY per cost field (no TYPE, no HGET).
-- Invariant: an entry is acknowledged only if its result was written in the same call,
-- and a job answered with an error left every key as it was for it.
--
-- Returns one reply per job, in the order given:
--   {'written', result id}: written now;
--   {'had', result id}: not pending any more, and its result is one this worker wrote
--                       (an earlier try whose reply was lost): nothing written;
--   {'superseded', result id or ''}: another worker committed the entry: nothing written
--                       (a job never gets two results);
--   an error reply: nothing written for this job (the worker sends it again alone, so
--                       what it is told is what a call for it alone says).
-- An entry neither pending nor in the jobs stream gets a result only on positive evidence
-- that it was dropped from the pending list without one: a tombstone of lua/reclaim.lua
-- in KEYS[4] (the producer deleted it while pending, and an XAUTOCLAIM dropped it; the
-- tombstone is removed with the write). Otherwise (acknowledged and deleted by the commit
-- of another worker, delete_acked; handed back, its tombstone; an ok result of its id)
-- the commit is superseded: a job never gets two results, with or without a producer id.
-- Known limit: a reply lost after a successful commit whose retry comes after more than
-- 1000 other results of a job without a producer id is answered `superseded` instead of
-- `had` (still exactly one result).
-- Errors (nothing written for the job): `WRONGTYPE <key> ...` naming the key,
-- `ERR <key> field <f> ...` for a cost totals field HINCRBY would refuse (not an integer,
-- or the sum leaves the 64-bit range: both like a key of the wrong type, someone must fix
-- it), `ERR commit.lua: ...` for a malformed call (including more fields than Lua can
-- pass to one XADD: the worker packs wide dead letters, see src/queue/wire.rs); a
-- malformed call as a whole is one error reply.
local jobs, results, costs, dropped, day, month = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local group, maxlen, del, consumer = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

local function bug(msg)
  return redis.error_reply('ERR commit.lua: ' .. msg .. ' (a worker bug: report it)')
end
local function failed(r)
  return type(r) == 'table' and r['err'] ~= nil
end
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

-- 1. Argument shape, for every job before anything is read or written.
if not maxlen then
  return bug('MAXLEN must be a number')
end
if (#KEYS - 6) % 4 ~= 0 then
  return bug('keys are not 6 + 4 per job')
end
local n_jobs = (#KEYS - 6) / 4
local J = {}
local i = 5
for j = 1, n_jobs do
  local job = {entry = ARGV[i], ttl = tonumber(ARGV[i + 1]), status = ARGV[i + 2],
    keyed = ARGV[i + 3] == '1', k = 6 + 4 * (j - 1)}
  if not job.entry or not job.ttl or job.ttl < 0 then
    return bug('job ' .. j .. ': marker ttl must be a number')
  end
  i = i + 4
  local spans = {}
  for s = 1, 3 do
    local n = tonumber(ARGV[i])
    if not n or n < 0 or n % 1 ~= 0 or i + 2 * n > #ARGV then
      return bug('malformed field list at ARGV[' .. i .. ']')
    end
    spans[s] = {i + 1, i + 2 * n}
    i = i + 2 * n + 1
  end
  job.r, job.d, job.c = spans[1], spans[2], spans[3]
  if job.r[2] < job.r[1] then
    return bug('empty result entry')
  end
  -- unpack() below puts every value on Lua's C stack (at most 8000 slots).
  local widest = math.max(job.r[2] - job.r[1] + 1, job.d[2] - job.d[1] + 1)
  if widest > 7000 then
    return bug(widest / 2 .. ' fields are more than one XADD from Lua can take')
  end
  local seen = {}
  for c = job.c[1], job.c[2], 2 do
    local f, inc = ARGV[c], ARGV[c + 1]
    if seen[f] then
      return bug('cost increment ' .. f .. ' is repeated')
    end
    seen[f] = true
    if inc ~= '0' and not string.match(inc, '^[1-9]%d*$') then
      return bug('cost increment ' .. f .. ' = ' .. inc .. ' is not a whole number >= 0')
    end
  end
  J[j] = job
end
if i - 1 ~= #ARGV then
  return bug((#ARGV - i + 1) .. ' trailing arguments')
end

-- 2. Per job: key types of what it alone writes, pending-ness, what its id already has.
local function field(kv, name)
  for j = 1, #kv, 2 do
    if kv[j] == name then
      return kv[j + 1]
    end
  end
  return nil
end
local function result_of_entry(entry, mrid)
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
-- Returns nil to go on (job.pending set), or the job's reply.
-- The job's result marker into job.mrid, job.mstatus; an error reply if it cannot be read.
local function read_marker(job, marker)
  local mval = redis.pcall('GET', marker)
  if failed(mval) then
    return named(marker, 'string')
  end
  if mval then
    job.mrid, job.mstatus = string.match(mval, '^(.*)|([^|]*)$')
  end
  return nil
end
local function check(job)
  local dead, marker, handedback = KEYS[job.k + 1], KEYS[job.k + 2], KEYS[job.k + 4]
  if job.d[2] >= job.d[1] then
    local e = wrong(dead, 'stream')
    if e then
      return e
    end
  end
  if job.ttl > 0 then
    local e = read_marker(job, marker)
    if e then
      return e
    end
  end
  local p = redis.pcall('XPENDING', jobs, group, job.entry, job.entry, 1)
  if failed(p) then
    local t = redis.call('TYPE', jobs)['ok']
    if t ~= 'stream' and t ~= 'none' then
      return named(jobs, 'stream', t)
    end
    -- no such stream or group (NOGROUP): as Redis says it
    return p
  end
  job.pending = #p == 1
  if job.pending then
    return nil
  end
  if job.ttl == 0 then
    -- a job without a marker ttl was not read above
    local e = read_marker(job, marker)
    if e then
      return e
    end
  end
  local e = wrong(results, 'stream') or wrong(dropped, 'zset')
  if e then
    return e
  end
  local rid, by = result_of_entry(job.entry, job.mrid)
  if rid then
    if by == consumer then
      return {'had', rid}
    end
    return {'superseded', rid}
  end
  local exists = #redis.call('XRANGE', jobs, job.entry, job.entry) == 1
  if exists or job.mstatus == 'ok' or redis.call('EXISTS', handedback) == 1 then
    return {'superseded', ''}
  end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local until_ms = tonumber(redis.call('ZSCORE', dropped, job.entry))
  if not until_ms or until_ms < now then
    return {'superseded', ''}
  end
  return nil
end
-- A job whose entry, result marker or in-progress marker an earlier job of this call
-- also has is not committed here: its checks would read what that job is about to
-- change (an `ok` marker set by the earlier job, say). It is answered with an error, and
-- the worker sends it again alone, after the earlier one.
local out = {}
local going = {}
local taken = {}
for j = 1, n_jobs do
  local job = J[j]
  local marker, inflight = KEYS[job.k + 2], KEYS[job.k + 3]
  local again = taken[job.entry] or (job.ttl > 0 and taken[marker]) or (job.keyed and taken[inflight])
  if again then
    out[j] = redis.error_reply('ERR commit.lua: job ' .. j .. ' shares ' .. again ..
      ' with an earlier job of this call (send it alone)')
  else
    taken[job.entry] = 'entry ' .. job.entry
    if job.ttl > 0 then
      taken[marker] = 'key ' .. marker
    end
    if job.keyed then
      taken[inflight] = 'key ' .. inflight
    end
    local r = check(job)
    if r then
      out[j] = r
    else
      going[#going + 1] = job
    end
  end
end

-- 3. Cost totals of the jobs going on, summed per field, added first: HINCRBY itself
-- refuses a field that is not an integer as Redis reads one, or a sum that leaves the
-- 64-bit range, exactly, so nothing is parsed here. Under `maxmemory` + `noeviction`
-- the first write is refused before anything is written; after it Redis refuses no write
-- of this script, so an undo cannot fail. A refusal undoes what was added and answers
-- every job with costs with the error (each is then sent alone: the error it gets then
-- is its own).
-- a + b of two decimal strings of digits, exact at any length.
local function add(a, b)
  if #a < 16 and #b < 16 then
    return string.format('%d', tonumber(a) + tonumber(b))
  end
  local digits, carry, x, y = {}, 0, #a, #b
  while x > 0 or y > 0 or carry > 0 do
    local d = carry + (x > 0 and string.byte(a, x) - 48 or 0) + (y > 0 and string.byte(b, y) - 48 or 0)
    digits[#digits + 1] = d % 10
    carry = (d - d % 10) / 10
    x, y = x - 1, y - 1
  end
  local s = {}
  for q = #digits, 1, -1 do
    s[#s + 1] = digits[q]
  end
  return table.concat(s)
end
local names, sums = {}, {}
for _, job in ipairs(going) do
  for c = job.c[1], job.c[2], 2 do
    local f, inc = ARGV[c], ARGV[c + 1]
    if inc ~= '0' then
      if sums[f] then
        sums[f] = add(sums[f], inc)
      else
        names[#names + 1] = f
        sums[f] = inc
      end
    end
  end
end
local cost_error = nil
local had = {} -- field -> true if it existed before the HINCRBYs
if #names > 0 then
  -- What each field holds now (one HMGET), so an undo puts back exactly that: the old
  -- value, or no field at all.
  local before = redis.pcall('HMGET', costs, unpack(names))
  if failed(before) then
    if string.sub(before['err'], 1, 9) == 'WRONGTYPE' then
      cost_error = named(costs, 'hash')
    else
      cost_error = before
    end
  else
    for q = 1, #names do
      had[names[q]] = before[q] ~= false and before[q] ~= nil
    end
    for q = 1, #names do
      local f = names[q]
      local r = redis.pcall('HINCRBY', costs, f, sums[f])
      if failed(r) then
        for u = 1, q - 1 do
          if before[u] then
            redis.call('HSET', costs, names[u], before[u])
          else
            redis.call('HDEL', costs, names[u])
          end
        end
        if string.sub(r['err'], 1, 9) == 'WRONGTYPE' then
          cost_error = named(costs, 'hash')
        else
          local bad
          if string.find(r['err'], 'not an integer', 1, true) then
            bad = 'is not an integer'
          elseif string.find(r['err'], 'overflow', 1, true) then
            bad = 'plus ' .. sums[f] .. ' leaves the 64-bit integer range'
          end
          if bad then
            local cur = redis.call('HGET', costs, f) or ''
            local shown = cur
            if #shown > 40 then
              shown = string.sub(shown, 1, 40) .. '...'
            end
            cost_error = redis.error_reply('ERR ' .. costs .. ' field ' .. f .. ' holds "' .. shown ..
              '", which ' .. bad .. ': fix or delete the field (cost totals are not added until then)')
          else
            -- not about the field (OOM, say): the error as Redis gave it
            cost_error = r
          end
        end
        break
      end
    end
  end
end
-- Takes back one job's share of the totals (its result could not be written): a field
-- that did not exist before and holds 0 again goes, as if never added.
local function unadd(job)
  for c = job.c[1], job.c[2], 2 do
    if ARGV[c + 1] ~= '0' then
      local left = redis.call('HINCRBY', costs, ARGV[c], '-' .. ARGV[c + 1])
      if left == 0 and not had[ARGV[c]] then
        redis.call('HDEL', costs, ARGV[c])
      end
    end
  end
end

-- 4. Per job: the result (refused under OOM when it is the call's first write), then the
-- rest, its XACK last.
local spent, gone = {}, {}
for j = 1, n_jobs do
  local job = J[j]
  if not out[j] then
    local has_costs = job.c[2] >= job.c[1]
    if cost_error and has_costs then
      out[j] = cost_error
    else
      local id = redis.pcall('XADD', results, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, job.r[1], job.r[2]))
      if failed(id) then
        if has_costs then
          unadd(job)
        end
        if string.sub(id['err'], 1, 9) == 'WRONGTYPE' then
          out[j] = named(results, 'stream')
        else
          out[j] = id
        end
      else
        local marker, inflight = KEYS[job.k + 2], KEYS[job.k + 3]
        if job.d[2] >= job.d[1] then
          redis.call('XADD', KEYS[job.k + 1], 'MAXLEN', '~', maxlen, '*', unpack(ARGV, job.d[1], job.d[2]))
        end
        for c = job.c[1], job.c[2], 2 do
          local model = string.match(ARGV[c], '^(.*):cost_picos$')
          if model and ARGV[c + 1] ~= '0' then
            spent[model] = spent[model] and add(spent[model], ARGV[c + 1]) or ARGV[c + 1]
          end
        end
        -- An ok marker is never replaced: the id's answer stays the one producers already saw.
        if job.ttl > 0 and job.mstatus ~= 'ok' then
          redis.call('SET', marker, id .. '|' .. job.status, 'EX', job.ttl)
        end
        if job.keyed and redis.pcall('GET', inflight) == job.entry then
          redis.call('DEL', inflight)
        end
        if job.pending then
          redis.call('XACK', jobs, group, job.entry)
        else
          redis.call('ZREM', dropped, job.entry)
        end
        if del == '1' then
          gone[#gone + 1] = job.entry
        end
        out[j] = {'written', id}
      end
    end
  end
end

-- Acknowledged entries leave the stream together (a cleanup: an entry left by a script
-- that failed before here is only an acknowledged entry kept).
if #gone > 0 then
  redis.call('XDEL', jobs, unpack(gone))
end

-- 5. What `status` shows per model (display figures, never failing a commit); the expiry
-- is set when a model's field is new (its first job of the day / month).
for model, picos in pairs(spent) do
  if redis.pcall('HINCRBY', day, model, picos) == tonumber(picos) then
    redis.pcall('EXPIRE', day, 3456000)
  end
  if redis.pcall('HINCRBY', month, model, picos) == tonumber(picos) then
    redis.pcall('EXPIRE', month, 34560000)
  end
end
return out
