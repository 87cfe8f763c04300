-- Keep this worker's long-running jobs from being taken over: for each entry still
-- pending under this consumer, reset its idle time (XCLAIM ... JUSTID, which does not
-- count a delivery) and extend its id's in-progress marker if that marker is the entry's.
-- Entries now owned by another consumer are left alone (never stolen back). Entries the
-- producer deleted from the stream (XDEL, MAXLEN) are not XCLAIMed: on Redis 7 that
-- would drop them from the pending list and the worker's result would be thrown away.
--
-- Also the fleet's heartbeat (prelude stall_gate.lua): every worker calls this at least
-- every claim_idle_ms / 3 (with no entries too).
--
-- KEYS[1] jobs stream   KEYS[2] heartbeat (server ms)   KEYS[3] stall gate
-- KEYS[4] dropped-entry tombstones (lua/reclaim.lua)
-- KEYS[4 + i] in-progress marker of entry i's job id (a placeholder when it has none)
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] claim_idle_ms
-- ARGV[4] heartbeat gap (ms) above which the stall gate is set
-- ARGV[5] in-progress marker ttl ms
-- ARGV[4 + 2i], ARGV[5 + 2i]: entry id i, '1' if its job claimed its producer id (and so
-- owns its in-progress marker; a job without one, not parsed yet, or a copy waiting
-- for another copy of its id, owns none: never create it)
-- Returns {stalled (1: do not reclaim now), entries no longer ours, entries deleted,
--          entries taken over: pending under another consumer, or settled or moved by
--          another worker (not pending, and no tombstone: only a reclaim that found the
--          entry deleted drops it from the pending list without settling it, and it
--          leaves a tombstone in the same step)}.
local stalled = stall_gate(KEYS[2], KEYS[3], ARGV[3], ARGV[4])

local gone, deleted, taken = {}, {}, {}
for i = 1, (#ARGV - 5) / 2 do
  local id, keyed = ARGV[4 + 2 * i], ARGV[5 + 2 * i] == '1'
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    if #redis.call('XRANGE', KEYS[1], id, id) == 0 then
      table.insert(deleted, id)
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    end
    if keyed then
      local marker = KEYS[4 + i]
      local cur = redis.call('GET', marker)
      if cur == id then
        redis.call('PEXPIRE', marker, ARGV[5])
      elseif not cur then
        redis.call('SET', marker, id, 'NX', 'PX', ARGV[5])
      end
    end
  else
    table.insert(gone, id)
    if #p == 1 then
      table.insert(taken, id)
    else
      -- A tombstone counts until its expiry (its score), as commit.lua reads it; a
      -- `dropped` key of another type is no evidence either way: not taken, as before.
      local z = redis.pcall('ZSCORE', KEYS[4], id)
      if type(z) ~= 'table' then
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        local until_ms = tonumber(z)
        if not until_ms or until_ms < now then
          table.insert(taken, id)
        end
      end
    end
  end
end
return {stalled, gone, deleted, taken}
