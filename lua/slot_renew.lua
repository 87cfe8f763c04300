-- Renew the leases this process holds, and tick the pools' lease clocks.
-- (Runs after the prelude slot_clock.lua.) Called by every worker every ttl/8, with
-- every pool (c may be 0), and once for a slot handed to us (the pick-up that turns
-- the short hand-off lease into a full one).
--
-- KEYS: for each pool group: its lease hash, then the group's slot keys
-- ARGV[1] token   ARGV[2] ttl ms   ARGV[3] stall gap ms
-- ARGV[4..] for each group: prefix of its slot keys, count c, then c triples: slot
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
-- never jumps the queue. Otherwise, or someone else's -> lost, reported, never
-- overwritten (0).
-- Returns one integer per key, in order.
local token = ARGV[1]
local out = {}
local a, k = 4, 1
while a <= #ARGV do
  local prefix = ARGV[a]
  local c = tonumber(ARGV[a + 1])
  a = a + 2
  local lh = KEYS[k]
  k = k + 1
  local now = slot_clock(lh, prefix, ARGV[3])
  for _ = 1, c do
    local key, idx, have, want = KEYS[k], ARGV[a], ARGV[a + 1], ARGV[a + 2]
    k = k + 1
    a = a + 3
    local cur = redis.call('GET', key)
    if cur == have then
      if want == have then
        redis.call('PEXPIRE', key, ARGV[2])
      else
        redis.call('SET', key, want, 'PX', ARGV[2])
      end
      slot_note(lh, idx, want, now, ARGV[2])
      out[#out + 1] = 1
    elseif cur == false and
        string.sub(redis.call('HGET', lh, idx) or '', 1, #have + 1) == have .. '|' then
      redis.call('SET', key, want, 'PX', ARGV[2])
      slot_note(lh, idx, want, now, ARGV[2])
      out[#out + 1] = 2
    else
      out[#out + 1] = 0
    end
  end
end
return out
