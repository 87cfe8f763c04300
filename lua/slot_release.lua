-- Release slots this process holds (token-checked), handing each directly to the
-- longest live waiter of its pool if there is one. Also release-all, in one round trip.
-- (Runs after the prelude slot_clock.lua.)
--
-- KEYS: for each pool group: the pool's waiter queue, its lease hash, then the group's
--       slot keys
-- ARGV[1] holder token   ARGV[2] slot ttl ms   ARGV[3] prefix of waiter liveness keys
-- ARGV[4] prefix of hand-off lists
-- ARGV[5] '1' = release-all: also leave every waiter queue named and delete this
--         process's liveness key and hand-off list
-- ARGV[6] hand-off lease ms   ARGV[7] stall gap ms   ARGV[8] waiter liveness ttl ms
-- ARGV[9..] for each group: pool name, prefix of its slot keys, count c, w = how many
--         local waiters of this process want a slot of the pool, prefix of the values of
--         slots kept for them, then c pairs: slot index, the value of the lease released
--         (release-all: any value of this process, `<token>` or `<token>#...`)
--
-- A slot whose value is not the lease's (lease lost, maybe someone else's now, or a
-- newer lease of this same process) is left alone. A hand-off sets the slot to the waiter's token with a SHORT lease (ARGV[6]),
-- which the waiter extends to the full ttl when it picks the slot up: a waiter that
-- died after its last liveness refresh costs the fleet the slot only that long. It
-- removes the waiter from the queue (it re-queues at the tail if it still waits: round
-- robin) and pushes "<i>|<pool>" onto the waiter's hand-off list, which its process
-- blocks on.
--
-- Keep: when the queue's live head is this process itself (or nobody waits) and w > 0, the
-- slot is not handed through Redis to ourselves (hand-off list, BLPOP, pick-up: three
-- round trips) but kept: it gets a fresh full lease with value <keep prefix> .. j (the
-- j-th slot kept in the group) and the caller gives it to a local waiter. Exactly the
-- order a hand-off would give: this process leaves the head, and goes back to the tail
-- (ZADD with the time now, liveness refreshed) if more of its waiters still want a slot,
-- so the next release goes to the next process in the queue (round robin). The caller
-- holds the pool's queue lock while this runs (w is its waiters under that lock).
-- Returns {released, handed_off, not_ours, then per slot in the order given: 0 not ours,
-- 1 released, 2 handed off, 3 kept}.
local token = ARGV[1]
local released, handed, not_ours = 0, 0, 0
local each = {}
local a, k = 9, 1
while a <= #ARGV do
  local pool, prefix = ARGV[a], ARGV[a + 1]
  local c = tonumber(ARGV[a + 2])
  local want = tonumber(ARGV[a + 3]) or 0
  local keep_prefix = ARGV[a + 4]
  local kept = 0
  a = a + 5
  local q, lh = KEYS[k], KEYS[k + 1]
  k = k + 2
  local now = slot_clock(lh, prefix, ARGV[7])
  if ARGV[5] == '1' then
    redis.call('ZREM', q, token)
  end
  for _ = 1, c do
    local key, idx, value = KEYS[k], ARGV[a], ARGV[a + 1]
    k = k + 1
    a = a + 2
    local cur = redis.call('GET', key)
    local mine = cur == value
    if ARGV[5] == '1' then
      mine = cur == token or (cur and string.sub(cur, 1, #token + 1) == token .. '#')
    end
    if not mine then
      not_ours = not_ours + 1
      each[#each + 1] = 0
    else
      while true do
        local h = redis.call('ZRANGE', q, 0, 0)
        if want > 0 and (#h == 0 or h[1] == token) then
          kept = kept + 1
          want = want - 1
          local value = keep_prefix .. kept
          redis.call('SET', key, value, 'PX', ARGV[2])
          slot_note(lh, idx, value, now, ARGV[2])
          if want > 0 then
            redis.call('SET', ARGV[3] .. token, '1', 'PX', ARGV[8])
            local tm = redis.call('TIME')
            redis.call('ZADD', q, tonumber(tm[1]) * 1000000 + tonumber(tm[2]), token)
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
        if redis.call('EXISTS', ARGV[3] .. h[1]) == 1 then
          redis.call('SET', key, h[1], 'PX', ARGV[6])
          slot_note(lh, idx, h[1], now, ARGV[6])
          local wake = ARGV[4] .. h[1]
          redis.call('RPUSH', wake, idx .. '|' .. pool)
          redis.call('PEXPIRE', wake, ARGV[2])
          handed = handed + 1
          each[#each + 1] = 2
          break
        end
      end
    end
  end
end
if ARGV[5] == '1' then
  redis.call('DEL', ARGV[3] .. token, ARGV[4] .. token)
end
local out = {released, handed, not_ours}
for j = 1, #each do
  out[#out + 1] = each[j]
end
return out
