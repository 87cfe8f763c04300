#!lua flags=allow-oom
-- Shared prelude of every slot script (prepended to it in src/slots.rs): the pool's
-- lease clock, so that time in which Redis itself could not answer does not count
-- against a lease's holder.
--
-- Every slot key has a shadow entry in the pool's lease hash (KEYS: `{ns}:slotlease:<pool>`):
--   field <i> = "<token>|<deadline ms, server TIME>|<lease length ms>", written by whoever
--   sets the key (take, hand-off, renewal, restore) and removed with it (release);
--   field t   = server TIME (ms) of the last slot script that ran for this pool;
--   field h   = server TIME (ms) of the pool's last hand-off to another process
--               (lua/slot_release.lua: its receiver still counts as waiting a moment);
--   field hb  = the same time and that receiver's token, "<ms>|<token>" (one field, so
--               a writer of h alone, an older release script, never pairs a new time
--               with an old receiver);
--   field n|<token> = "<count>|<ms>": how many leases of the pool that process said it
--               holds at server time ms (lua/slot_release.lua, its count word);
--   field ns  = server TIME (ms) of the last sweep of count words (lua/slot_release.lua).
-- Only numeric fields are slot records: every loop over the hash skips the others.
-- Every live worker runs a slot script at least every ttl/8 (its renewer ticks even when
-- it holds nothing), so a gap larger than `gap` ms (ttl/2) between two scripts means
-- nobody could reach Redis: it was stopped, busy forking, failing over, or cut off. Slot
-- keys' PX expiry runs on the wall clock, so after such a gap leases may have lapsed
-- while their calls still run. Then every lease that was live when Redis was last seen
-- (deadline > t) gets its key back, with the same token and its full length from now,
-- before this script (or anyone) may take a slot. A key that holds another token is
-- never touched: a slot key is only written by its token's holder, or restored to it.
-- Returns the server time now, in ms.
--
-- `base`: slot i of the pool is KEYS[base + i], for i < n (every slot key the script
-- may restore is passed in KEYS; nothing here builds a key name). A script that does
-- not carry the pool's slot keys (release: it holds only the keys it releases) passes
-- base = nil: it cannot restore, so on a gap it leaves the clock as it found it (`t`
-- unwritten) for the next script that can (acquire and renewal carry every slot key,
-- and the renewer of every live worker runs one within ttl/8). Nothing it does takes a
-- free slot; what it releases is its own lease, which the restore would give back to
-- it: so a key found absent for that reason is judged by the value recorded for it
-- (`slot_lapsed_in_stall`); if that is its own, it is released or handed on, and its
-- record goes with it.
--
-- The shebang (first line of every concatenated slot script) declares allow-oom: under
-- maxmemory + noeviction, Redis 7 refuses the first memory-growing write of a flagless
-- script, so the clock's HSET would make renewals (PEXPIRE) and releases (DEL) fail and
-- a running call would lose its slot. With it, renewal, release and release-all work
-- while Redis is full; acquire may still take a free slot (a few bytes, N bounded), and
-- the result of its call waits in commit_until_written until Redis takes writes again.
-- The last time Redis was seen, when the latest slot_clock call found a gap it could
-- not repair (base = nil); else nil. Per pool: every call sets it.
local slot_unrestored = nil
-- The server TIME ({seconds, microseconds}) the latest slot_clock call read: a script
-- that needs the time again in the same call uses it (Redis runs one script at a time,
-- so it orders the script against every other as well as a later TIME would).
local slot_tm = nil

local function slot_clock(h, base, n, gap)
  slot_unrestored = nil
  local tm = redis.call('TIME')
  slot_tm = tm
  local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
  local last = tonumber(redis.call('HGET', h, 't'))
  if last and now - last > tonumber(gap) then
    if base == nil then
      slot_unrestored = last
      return now
    end
    local all = redis.call('HGETALL', h)
    local restored = 0
    for j = 1, #all, 2 do
      local f, v = all[j], all[j + 1]
      local i = tonumber(f)
      if f ~= 't' and i and i >= 0 and i < n then
        local tok, dl, len = string.match(v, '^(.*)|(%d+)|(%d+)$')
        dl, len = tonumber(dl), tonumber(len)
        if tok and dl and len and dl > last then
          local key = KEYS[base + i]
          local cur = redis.call('GET', key)
          if cur == false or cur == tok then
            redis.call('SET', key, tok, 'PX', len)
            redis.call('HSET', h, f, tok .. '|' .. (now + len) .. '|' .. len)
            restored = restored + 1
          end
        end
      end
    end
    if restored > 0 then
      redis.log(redis.LOG_NOTICE, 'llm-worker: no slot script for ' .. (now - last) ..
        ' ms; restored ' .. restored .. ' lease(s) of ' .. h)
    end
  end
  redis.call('HSET', h, 't', now)
  return now
end

-- For a slot whose key is absent: the value a restore would give it back, if its key is
-- absent only because Redis stalled (the last slot_clock call found a gap it could not
-- repair, and the lease hash records a lease for the slot that was live when Redis was
-- last seen); else nil.
local function slot_lapsed_in_stall(h, idx)
  if slot_unrestored == nil then
    return nil
  end
  local tok, dl = string.match(redis.call('HGET', h, idx) or '', '^(.*)|(%d+)|%d+$')
  if tok ~= nil and tonumber(dl) > slot_unrestored then
    return tok
  end
  return nil
end

-- Records a slot key just set to `tok` for `len` ms in the lease hash.
local function slot_note(h, idx, tok, now, len)
  redis.call('HSET', h, idx, tok .. '|' .. (now + tonumber(len)) .. '|' .. len)
end
