-- Take over entries pending longer than claim_idle_ms, in one atomic step with the stall
-- gate (prelude stall_gate.lua), their delivery counts and the tombstones of entries
-- found deleted. One XAUTOCLAIM per call (the caller follows the cursor), so one call
-- never scans more than 10 x COUNT pending entries.
--
-- Atomic, so: an XAUTOCLAIM queued behind a Redis stall runs only after the gate has seen
-- the stall; nothing is acknowledged between the claim and the delivery counts (an id
-- whose XPENDING is empty is not returned: it is not ours to run).
--
-- An entry deleted from the stream while pending (XDEL, MAXLEN) is dropped from the
-- pending list by XAUTOCLAIM (Redis 7 returns it as deleted). Its worker may still run it
-- and hold a paid result: a tombstone (member of KEYS[4], score = its expiry, server ms)
-- is the positive evidence commit.lua needs to write that result although the entry
-- is neither pending nor in the stream (without one, such a commit is superseded).
--
-- KEYS[1] jobs stream   KEYS[2] heartbeat (server ms)   KEYS[3] stall gate
-- KEYS[4] dropped-entry tombstones (sorted set: entry id -> expiry, server ms)
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] claim_idle_ms (min idle)
-- ARGV[4] heartbeat gap (ms) above which the stall gate is set
-- ARGV[5] cursor   ARGV[6] COUNT   ARGV[7] tombstone ttl (ms)
-- Returns {stalled (1: nothing done), {next cursor, claimed entries, deleted ids},
--          delivery counts (one per claimed entry, same order)}.
local stalled = stall_gate(KEYS[2], KEYS[3], ARGV[3], ARGV[4])
if stalled == 1 then
  return {1, {'0-0', {}, {}}, {}}
end
local kind = redis.call('TYPE', KEYS[4])['ok']
if kind ~= 'none' and kind ~= 'zset' then
  return redis.error_reply('WRONGTYPE ' .. KEYS[4] .. ' is a ' .. kind ..
    ', not a zset: rename or delete it (nothing is taken over until then)')
end
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[5], 'COUNT', ARGV[6])
local claimed, counts = {}, {}
for _, e in ipairs(r[2]) do
  -- Redis 6.2 lists an entry deleted while pending as nil (false here), leaving it in the
  -- pending list; Redis 7 reports it in r[3]. Indexing it would fail the whole call after
  -- XAUTOCLAIM moved the other entries to this consumer.
  if e then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
    if #p == 1 then
      table.insert(claimed, e)
      table.insert(counts, p[1][4])
    end
  end
end
local deleted = r[3] or {}
if #deleted > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local ttl = tonumber(ARGV[7])
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  for _, id in ipairs(deleted) do
    redis.call('ZADD', KEYS[4], now + ttl, id)
  end
  redis.call('PEXPIRE', KEYS[4], ttl)
end
return {0, {r[1], claimed, deleted}, counts}
