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
-- KEYS[3 + i] in-progress marker of entry i's job id (a placeholder when it has none)
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] claim_idle_ms (also the marker ttl)
-- ARGV[4] heartbeat gap (ms) above which the stall gate is set
-- ARGV[3 + 2i], ARGV[4 + 2i]: entry id i, '1' if its job has a producer id (and so an
-- in-progress marker; a job without one, or not parsed yet, has none: never create it)
-- Returns {stalled (1: do not reclaim now), entries no longer ours, entries deleted}.
local stalled = stall_gate(KEYS[2], KEYS[3], ARGV[3], ARGV[4])

local gone, deleted = {}, {}
for i = 1, (#ARGV - 4) / 2 do
  local id, keyed = ARGV[3 + 2 * i], ARGV[4 + 2 * i] == '1'
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    if #redis.call('XRANGE', KEYS[1], id, id) == 0 then
      table.insert(deleted, id)
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    end
    if keyed then
      local marker = KEYS[3 + i]
      local cur = redis.call('GET', marker)
      if cur == id then
        redis.call('PEXPIRE', marker, ARGV[3])
      elseif not cur then
        redis.call('SET', marker, id, 'NX', 'PX', ARGV[3])
      end
    end
  else
    table.insert(gone, id)
  end
end
return {stalled, gone, deleted}
