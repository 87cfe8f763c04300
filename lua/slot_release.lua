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
-- ARGV[6] hand-off lease ms   ARGV[7] stall gap ms
-- ARGV[8..] for each group: pool name, prefix of its slot keys, count c, then c pairs:
--         slot index, the value of the lease released (release-all: any value of this
--         process, `<token>` or `<token>#...`)
--
-- A slot whose value is not the lease's (lease lost, maybe someone else's now, or a
-- newer lease of this same process) is left alone. A hand-off sets the slot to the waiter's token with a SHORT lease (ARGV[6]),
-- which the waiter extends to the full ttl when it picks the slot up: a waiter that
-- died after its last liveness refresh costs the fleet the slot only that long. It
-- removes the waiter from the queue (it re-queues at the tail if it still waits: round
-- robin) and pushes "<i>|<pool>" onto the waiter's hand-off list, which its process
-- blocks on.
-- Returns {released, handed_off, not_ours, then per slot in the order given: 0 not ours,
-- 1 released, 2 handed off}.
local token = ARGV[1]
local released, handed, not_ours = 0, 0, 0
local each = {}
local a, k = 8, 1
while a <= #ARGV do
  local pool, prefix = ARGV[a], ARGV[a + 1]
  local c = tonumber(ARGV[a + 2])
  a = a + 3
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
