-- Shared prelude of keepalive.lua and reclaim.lua (prepended to them in src/scripts.rs):
-- the fleet's heartbeat and the stall gate, so that time in which Redis did not answer is
-- not counted as jobs' idle time.
--
-- Every worker runs one of those scripts at least every claim_idle_ms / 3 (its keepalive,
-- even with no entries). If no call at all arrived for longer than the gap threshold
-- (claim_idle_ms minus at least the keepalive period, e.g. half of it: an entry's idle
-- time already counts the time since its last keepalive, so a stall a bit shorter than
-- claim_idle_ms leaves it idle past claim_idle_ms) (Redis stopped, partitioned away, or
-- loading), the stall gate is set for claim_idle_ms from now: until it expires nobody
-- reclaims, so the workers that still hold those jobs (and maybe their paid results) get
-- to keep them alive or commit them. The gate is checked in the same script as the
-- XAUTOCLAIM it guards (reclaim.lua), so a reclaim queued behind a stall is gated too.
-- The heartbeat write is allowed to fail (pcall: under maxmemory + noeviction).
--
-- stall_gate(heartbeat key, gate key, claim_idle_ms, gap ms) -> 1 if reclaim must wait
-- now, else 0.
local function stall_gate(hb_key, gate_key, idle, gap)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local hb = redis.pcall('GET', hb_key)
  local last = type(hb) == 'string' and tonumber(hb) or nil
  if last and now - last > tonumber(gap) then
    redis.pcall('SET', gate_key, now, 'PX', idle)
  end
  redis.pcall('SET', hb_key, now, 'PX', 86400000)
  return redis.call('EXISTS', gate_key)
end
