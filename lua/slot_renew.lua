-- Renew the leases this process holds, and tick the pools' lease clocks.
-- (Runs after the prelude slot_clock.lua.) Called by every worker every ttl/8, with
-- every pool (c may be 0), and once for a slot handed to us (the pick-up that turns
-- the short hand-off lease into a full one).
--
-- KEYS: for each pool group: its lease hash, then every slot key of the pool (slot i
--       at the group's first slot key + i: the prelude may restore any of them after a
--       Redis stall, and every key a script touches is in KEYS)
-- ARGV[1] token   ARGV[2] ttl ms   ARGV[3] stall gap ms
-- ARGV[4..] for each group: N (its slot keys in KEYS), count c, then c triples: slot
--         index, the value our lease holds now, the value it is to hold (the same, or,
--         at the pick-up of a hand-off, the lease's own `<token>#<nonce>` in place of the
--         bare process token the hand-off wrote)
--
-- Per key: our lease's value -> PEXPIRE ttl (1). Absent, and the lease hash still records
-- that value for it -> our lease lapsed (this process was paused or cut off from Redis alone;
-- or a pick-up came late) and nobody has been given the slot since: take it again at
-- once, ahead of the waiter queue, since our call is still running (2). The record is
-- what makes this safe: a release deletes it in the same step as the key, so a renewal
-- racing with our own release never re-creates a released slot, and a stale hand-off
-- does not jump the queue (see recorded_for: only within a TTL of its lease's end).
-- Otherwise, or someone else's -> lost, reported, never overwritten (0).
-- Returns one integer per key, in order.
-- True if the lease hash still records `have` for slot `idx`: the lease lapsed and nobody
-- was given the slot since. For a pick-up (want ~= have: a hand-off read from the pool's
-- stream) only if the hand-off lease ended less than a ttl ago: the stream keeps old
-- entries, and a hand-off read long after it lapsed must not jump the waiter queue.
local function recorded_for(lh, idx, have, want, now)
  local rec = redis.call('HGET', lh, idx) or ''
  if string.sub(rec, 1, #have + 1) ~= have .. '|' then
    return false
  end
  if want == have then
    return true
  end
  local dl = tonumber(string.match(string.sub(rec, #have + 2), '^(%d+)|'))
  return dl ~= nil and now - dl <= tonumber(ARGV[2])
end

local token = ARGV[1]
local out = {}
local a, k = 4, 1
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  local c = tonumber(ARGV[a + 1])
  a = a + 2
  local lh = KEYS[k]
  local base = k + 1
  k = base + n
  local now = slot_clock(lh, base, n, ARGV[3])
  for _ = 1, c do
    local idx, have, want = ARGV[a], ARGV[a + 1], ARGV[a + 2]
    a = a + 3
    local i = tonumber(idx)
    local key = i and i >= 0 and i < n and KEYS[base + i]
    local cur = key and redis.call('GET', key)
    if not key then
      out[#out + 1] = 0 -- not a slot of this pool: never ours (no error half-way)
    elseif cur == have then
      if want == have then
        redis.call('PEXPIRE', key, ARGV[2])
      else
        redis.call('SET', key, want, 'PX', ARGV[2])
      end
      slot_note(lh, idx, want, now, ARGV[2])
      out[#out + 1] = 1
    elseif cur == false and recorded_for(lh, idx, have, want, now) then
      redis.call('SET', key, want, 'PX', ARGV[2])
      slot_note(lh, idx, want, now, ARGV[2])
      out[#out + 1] = 2
    else
      out[#out + 1] = 0
    end
  end
end
return out
