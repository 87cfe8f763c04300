-- Release slots this process holds (token-checked), handing each directly to the
-- longest live waiter of its pool if there is one. Also release-all, in one round trip.
-- (Runs after the prelude slot_clock.lua.)
--
-- KEYS: for each pool group: the pool's waiter queue, its lease hash, its waiter
--       liveness set, its hand-off stream, then the group's slot keys (only those
--       released: so the prelude cannot restore lapsed leases here, see slot_clock.lua)
-- ARGV[1] holder token   ARGV[2] slot ttl ms
-- ARGV[3] '1' = release-all: also leave every waiter queue and liveness set named
-- ARGV[4] hand-off lease ms   ARGV[5] stall gap ms   ARGV[6] waiter liveness ttl ms
-- ARGV[7] how many entries a hand-off stream keeps (approximately, MAXLEN ~)
-- ARGV[8..] for each group: count c, w = how many local waiters of this process want a
--         slot of the pool (-1: none, but keep one for the process's next job if nobody
--         else waits or it heads the queue: never by fair share, and tell no share; see
--         Ask below), prefix of the values of slots kept for them, m = how many
--         other slots of the pool this process holds ('' = not known: see Count words),
--         n = the pool's N, then c pairs:
--         slot index, the value of the lease released (release-all: any value of this
--         process, `<token>` or `<token>#...`)
--
-- A slot whose value is not the lease's (lease lost, maybe someone else's now, or a
-- newer lease of this same process) is left alone. A hand-off sets the slot to the
-- waiter's token with a SHORT lease (ARGV[4]), which the waiter extends to the full ttl
-- when it picks the slot up: a waiter that died after its last liveness refresh costs
-- the fleet the slot only that long. It removes the waiter from the queue (it re-queues
-- at the tail if it still waits: round robin) and appends {t = waiter token, i = slot}
-- to the pool's hand-off stream, which every waiting process reads (XREAD BLOCK),
-- taking the entries addressed to it. Every key is in KEYS (Redis Cluster, proxies):
-- the waiter is named in the entry, never in a key name.
--
-- Keep: when the queue's live head is this process itself (or nobody waits) and w > 0, the
-- slot is not handed through Redis to ourselves (hand-off stream, XREAD, pick-up: three
-- round trips) but kept: it gets a fresh full lease with value <keep prefix> .. j (the
-- j-th slot kept in the group) and the caller gives it to a local waiter. Exactly the
-- order a hand-off would give: this process leaves the head, and goes back to the tail
-- (ZADD with the time now, liveness refreshed) if more of its waiters still want a slot,
-- so the next release goes to the next process in the queue (round robin). The caller
-- holds the pool's queue lock while this runs (w is its waiters under that lock).
-- Fair share: a slot is kept the same way, whoever heads the queue, while this process
-- would hold no more than its share, floor(n / (processes in the queue other than this
-- one + 1)): processes that all want more than their share each keep that many, cycling
-- among their own jobs, instead of handing every slot round the fleet (a release
-- script, a hand-off stream entry, an XREAD of every waiting process and a pick-up
-- script per job); one above its share hands its slots on, FIFO, until it is at it.
-- Ask: a process whose last word was that nobody else waits asks again, with w = -1,
-- after QUIET_FOR (src/slots.rs): if that still holds (or it heads the queue), its slot
-- is kept as for one local waiter, for its next job, instead of being freed for that job
-- to take back with an acquire script a moment later.
-- Count words: each release script this process runs ends each group by writing field
-- `n|<token>` of the lease hash, "<how many leases of the pool it holds now>|<server ms>"
-- (m + the slots kept); a release that does not know m (m = '': the lone releases of
-- src/slots.rs `release_values`, after a lost reply or a pick-up nobody waits for any
-- more) and release-all delete it instead, and a hand-off to another process adds one to
-- the receiver's word (its time unchanged). A word at most COUNT_FRESH_MS old stands in
-- for counting the head's live records (an HGETALL of a record per slot, most of a
-- release's time at N=64 with 8 processes: each asks every SHARE_FOR, 100 ms, in
-- src/slots.rs); an older or missing word (a newcomer, a process that has not released
-- lately, one that died) is read from the records, as before. Once every COUNT_GONE_MS
-- per pool (field `ns`: when the last sweep ran), a release deletes the words silent for
-- that long (a process that died without release-all leaves one) or dated after its own
-- time. A word may be short
-- (slots its process took by acquire, or was handed, since it was written) or long (a
-- lease it lost since), for at most COUNT_FRESH_MS: it decides only who is handed a slot
-- next, never whether a slot is free; a short word gets its process a slot sooner, a
-- long one keeps slots from it for at most that long.
-- Returns {released, handed_off, not_ours, then per slot in the order given: 0 not ours,
-- 1 released, 2 handed off, 3 kept, then per pool group in the order given: how many
-- other processes are in its waiter queue, plus one if a slot of it was handed to another
-- process less than HANDED_RECENT_MS ago (by this script or any other) that is not in
-- the queue again yet (0 lets the
-- caller keep the pool's slots among its own jobs for a moment; see QUIET_FOR in
-- src/slots.rs), then per pool group: this process's fair share of the pool (as
-- above, after this script), with which the caller keeps slots among its own jobs
-- for a moment while it holds no more).
local token = ARGV[1]
-- How long after a hand-off to another process its receiver counts as waiting (see the
-- end of the group loop).
local HANDED_RECENT_MS = 100
-- How old a process's count word may be and still be read instead of its records, and
-- after how long without a new one its word is deleted (see the header).
local COUNT_FRESH_MS = 250
local COUNT_GONE_MS = 60000
-- The count word of `who` in lease hash lh: its count and time, or nil.
local function count_word(lh, who)
  local c, at = string.match(redis.call('HGET', lh, 'n|' .. who) or '', '^(%d+)|(%d+)$')
  if c then
    return tonumber(c), at
  end
  return nil, nil
end
-- Whether a slot's value is the lease released (release-all: any value of this process).
local function matches(v, value)
  if ARGV[3] == '1' then
    return v == token or string.sub(v, 1, #token + 1) == token .. '#'
  end
  return v == value
end
-- How many other processes want a slot of the pool: those in its queue q, plus the
-- receiver of a hand-off to another process in the last HANDED_RECENT_MS (field hb of
-- the lease hash lh: "<when>|<to whom>") while it is out of the queue. That receiver
-- still waits as a rule (it queues again once it has picked the slot up and tried:
-- three round trips); counted only while out of the queue, so never twice (the fair
-- share must not shrink for a moment after every hand-off: every process at its share
-- would hand a slot on, and so on).
local function competitors(q, lh, now)
  local waiting = redis.call('ZCARD', q)
  if waiting > 0 and redis.call('ZSCORE', q, token) then
    waiting = waiting - 1
  end
  local last, who = string.match(redis.call('HGET', lh, 'hb') or '', '^(%d+)|(.*)$')
  last = tonumber(last)
  if last ~= nil and now - last < HANDED_RECENT_MS and who ~= token
      and not redis.call('ZSCORE', q, who) then
    waiting = waiting + 1
  end
  return waiting
end
-- How many live leases of the pool the process `who` holds, from the lease hash's slot
-- records `all` (HGETALL of lh: "<lease value>|<deadline>|<length>"; a lease value is the
-- process token, alone or followed by '#'). Only a record that starts with `who` can be
-- one of its leases, so the others are passed over by one string compare: the record
-- pattern is matched only for candidates (a release script asks about one or two
-- processes, the queue's head, while the hash holds a record per slot: with N=64 the
-- match for every record was most of a release's time).
local function leases_of(all, who, now)
  local count, w = 0, #who
  for j = 1, #all, 2 do
    local v = all[j + 1]
    if string.sub(v, 1, w) == who and tonumber(all[j]) then
      local holder, deadline = string.match(v, '^([^#|]+)[^|]*|(%d+)|%d+$')
      if holder == who and tonumber(deadline) > now then
        count = count + 1
      end
    end
  end
  return count
end
local released, handed, not_ours = 0, 0, 0
local each, others, shares = {}, {}, {}
local a, k = 8, 1
while a <= #ARGV do
  local c = tonumber(ARGV[a])
  local want = tonumber(ARGV[a + 1]) or 0
  local asking = want < 0
  if asking then
    want = 1
  end
  local keep_prefix = ARGV[a + 2]
  local held_other = tonumber(ARGV[a + 3]) -- nil: not known (see Count words)
  local n = tonumber(ARGV[a + 4]) or 0
  local kept = 0
  local wanted = asking and 0 or want
  a = a + 5
  local q, lh, live, wake = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  k = k + 4
  local now = slot_clock(lh, nil, 0, ARGV[5])
  -- The lease hash as first read (one HGETALL, at most once per pool group, and only
  -- when a slot may be kept by fair share or a share is to be told and the head's count
  -- word is missing or stale), and each process's
  -- count in it once asked. A hand-off this script makes after the read is not in it,
  -- and need not be: only the queue's head other than this process is ever asked
  -- about, and the process handed a slot has just left the queue (ZREM below; within
  -- one script only this process queues again), so it is not asked about again in
  -- this group.
  -- competitors(q, lh, now), asked once until another process's place in the queue
  -- changes here (a hand-off or a dead waiter dropped: ZREM of the head below). This
  -- process queueing again or leaving changes neither term: its own entry is never
  -- counted, and the hand-off receiver it checks is another process.
  local rivals = nil
  local function rivals_now()
    if rivals == nil then
      rivals = competitors(q, lh, now)
    end
    return rivals
  end
  local all, counted = nil, {}
  local function held_by(who)
    if counted[who] == nil then
      local c, at = count_word(lh, who)
      if c and now - tonumber(at) <= COUNT_FRESH_MS and now >= tonumber(at) then
        counted[who] = c
        return c
      end
      if all == nil then
        all = redis.call('HGETALL', lh)
      end
      counted[who] = leases_of(all, who, now)
    end
    return counted[who]
  end
  if ARGV[3] == '1' then
    redis.call('ZREM', q, token)
    redis.call('ZREM', live, token)
  end
  for _ = 1, c do
    local key, idx, value = KEYS[k], ARGV[a], ARGV[a + 1]
    k = k + 1
    a = a + 2
    local cur = redis.call('GET', key)
    -- An absent key whose lease lapsed only while Redis stalled is judged by the value a
    -- restore would give it back (see slot_clock.lua).
    local v = cur or slot_lapsed_in_stall(lh, idx)
    local mine = v and matches(v, value)
    if not mine then
      not_ours = not_ours + 1
      each[#each + 1] = 0
    else
      while true do
        local h = redis.call('ZRANGE', q, 0, 0)
        -- Kept by fair share only while the process at the head holds some slot and
        -- at most one fewer than this one would: a process holding slots but waiting
        -- for none is not in the queue, so the shares of those in it may add up to more
        -- than they can get, and a newcomer (holding none) must not wait for such a
        -- holder; handing on only to narrow a gap of two or more keeps uneven holdings
        -- (3 and 2, say) from bouncing a slot between two processes at every release.
        local fair = false
        if want > 0 and not asking and #h > 0 and h[1] ~= token then
          local mine_after = (held_other or 0) + kept + 1
          local theirs = held_by(h[1])
          fair = mine_after <= math.floor(n / (rivals_now() + 1))
            and theirs > 0 and theirs >= mine_after - 1
        end
        local nobody = #h == 0 and not (asking and rivals_now() > 0)
        if want > 0 and (nobody or h[1] == token or fair) then
          kept = kept + 1
          want = want - 1
          local value = keep_prefix .. kept
          redis.call('SET', key, value, 'PX', ARGV[2])
          slot_note(lh, idx, value, now, ARGV[2])
          if want > 0 then
            local ttl = tonumber(ARGV[6])
            redis.call('ZADD', live, now + ttl, token)
            redis.call('PEXPIRE', live, ttl)
            redis.call('ZADD', q, tonumber(slot_tm[1]) * 1000000 + tonumber(slot_tm[2]), token)
          elseif #h > 0 then
            redis.call('ZREM', q, token)
          end
          each[#each + 1] = 3
          break
        end
        if #h == 0 then
          redis.call('DEL', key)
          redis.call('HDEL', lh, idx)
          released = released + 1
          each[#each + 1] = 1
          break
        end
        redis.call('ZREM', q, h[1])
        rivals = nil
        local alive = tonumber(redis.call('ZSCORE', live, h[1]))
        if alive and alive > now then
          redis.call('SET', key, h[1], 'PX', ARGV[4])
          slot_note(lh, idx, h[1], now, ARGV[4])
          redis.call('XADD', wake, 'MAXLEN', '~', ARGV[7], '*', 't', h[1], 'i', idx)
          handed = handed + 1
          if h[1] ~= token then
            redis.call('HSET', lh, 'h', now, 'hb', now .. '|' .. h[1])
            local c, at = count_word(lh, h[1])
            if c then
              redis.call('HSET', lh, 'n|' .. h[1], (c + 1) .. '|' .. at)
            end
          end
          each[#each + 1] = 2
          break
        end
        redis.call('ZREM', live, h[1])
      end
    end
  end
  -- A process handed a slot left the queue, but it waited a moment ago and usually
  -- still does (see competitors): until it queues again it counts, or a release in
  -- that moment would answer "nobody else waits" and the caller would keep its next
  -- slots among its own jobs for QUIET_FOR, skipping it; with releases that bunch,
  -- after every hand-off (one of two busy processes ended up with almost every slot).
  -- HANDED_RECENT_MS is well above a pick-up's three round trips.
  local waiting = rivals_now()
  others[#others + 1] = waiting
  local share = math.floor(n / (waiting + 1))
  if wanted == 0 then
    share = 0 -- nobody here waits: nothing to keep by it
  elseif waiting > 0 and share > 0 then
    -- As the keep above: no more than one above what the first other process in the
    -- queue holds, and nothing while it holds none.
    local firsts = redis.call('ZRANGE', q, 0, 1)
    local head = firsts[1]
    if head == token then
      head = firsts[2]
    end
    if head then
      local theirs = held_by(head)
      share = math.min(share, theirs > 0 and theirs + 1 or 0)
    end
  end
  shares[#shares + 1] = share
  if ARGV[3] == '1' or held_other == nil then
    redis.call('HDEL', lh, 'n|' .. token)
  else
    redis.call('HSET', lh, 'n|' .. token, (held_other + kept) .. '|' .. now)
  end
  local swept = tonumber(redis.call('HGET', lh, 'ns'))
  if swept == nil or now - swept > COUNT_GONE_MS or swept > now then
    local fields = redis.call('HKEYS', lh)
    for j = 1, #fields do
      local f = fields[j]
      if string.sub(f, 1, 2) == 'n|' then
        local _, at = count_word(lh, string.sub(f, 3))
        at = tonumber(at)
        -- (A word from the future, after Redis's clock stepped back, goes too: else it
        -- would count as fresh once the clock caught up.)
        if at == nil or now - at > COUNT_GONE_MS or at > now then
          redis.call('HDEL', lh, f)
        end
      end
    end
    redis.call('HSET', lh, 'ns', now)
  end
end
local out = {released, handed, not_ours}
for j = 1, #each do
  out[#out + 1] = each[j]
end
for j = 1, #others do
  out[#out + 1] = others[j]
end
for j = 1, #shares do
  out[#out + 1] = shares[j]
end
return out
