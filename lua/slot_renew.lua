-- Renew the leases this process holds, and tick the pools' lease clocks.
-- (Runs after the prelude slot_clock.lua.) Called by every worker every ttl/4, with
-- every pool (c may be 0), and once for a slot handed to us (the pick-up that turns
-- the short hand-off lease into a full one).
--
-- KEYS: for each pool group: its lease hash, then the group's slot keys
-- ARGV[1] token   ARGV[2] ttl ms   ARGV[3] stall gap ms
-- ARGV[4] '1' = renewal, '0' = pick-up of a hand-off
-- ARGV[5..] for each group: prefix of its slot keys, count c, then the c slot indices
--
-- Per key: our token -> PEXPIRE ttl (1). Absent, on renewal -> our lease lapsed (this
-- process was paused, or cut off from Redis alone) but nobody holds the slot now: take
-- it again at once, ahead of the waiter queue, since our call is still running (2).
-- Absent, on pick-up -> ours again only if the lease hash still records the hand-off to
-- us (nobody was given the slot since), so a late pick-up keeps a fair hand-off but a
-- stale one never jumps the queue (2). Otherwise, or someone else's -> lost, reported,
-- never overwritten (0).
-- Returns one integer per key, in order.
local token = ARGV[1]
local out = {}
local renewal = ARGV[4] == '1'
local a, k = 5, 1
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
    elseif cur == false and (renewal or
        string.sub(redis.call('HGET', lh, idx) or '', 1, #token + 1) == token .. '|') then
      redis.call('SET', key, token, 'PX', ARGV[2])
      slot_note(lh, idx, token, now, ARGV[2])
      out[#out + 1] = 2
    else
      out[#out + 1] = 0
    end
  end
end
return out
