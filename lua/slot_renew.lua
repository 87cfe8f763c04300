-- Renew the leases this process holds, and tick the pools' lease clocks.
-- (Runs after the prelude slot_clock.lua.) Called by every worker every ttl/8, with
-- every pool (c may be 0), and once for a slot handed to us (the pick-up that turns
-- the short hand-off lease into a full one).
--
-- KEYS: for each pool group: its lease hash, then the group's slot keys
-- ARGV[1] token   ARGV[2] ttl ms   ARGV[3] stall gap ms
-- ARGV[4..] for each group: prefix of its slot keys, count c, then the c slot indices
--
-- Per key: our token -> PEXPIRE ttl (1). Absent, and the lease hash still records our
-- token for it -> our lease lapsed (this process was paused or cut off from Redis alone;
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
    local key, idx = KEYS[k], ARGV[a]
    k = k + 1
    a = a + 1
    local cur = redis.call('GET', key)
    if cur == token then
      redis.call('PEXPIRE', key, ARGV[2])
      slot_note(lh, idx, token, now, ARGV[2])
      out[#out + 1] = 1
    elseif cur == false and
        string.sub(redis.call('HGET', lh, idx) or '', 1, #token + 1) == token .. '|' then
      redis.call('SET', key, token, 'PX', ARGV[2])
      slot_note(lh, idx, token, now, ARGV[2])
      out[#out + 1] = 2
    else
      out[#out + 1] = 0
    end
  end
end
return out
