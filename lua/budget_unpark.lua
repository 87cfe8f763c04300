-- Jobs parked by a budget (budget_park.lua) moved back to the jobs stream's tail, as many
-- as the budget has room for now: every worker runs it for every parked stream once a
-- second, so no event is needed for progress (a window that ended, a limit raised,
-- reservations settled or expired).
-- (Runs after the prelude key_types.lua.)
--
-- KEYS[1] jobs stream   KEYS[2] the parked stream   KEYS[3] index of budget parked
-- streams (see budget_park.lua)   KEYS[4..] the budget's windows now (see
-- quota_admit.lua); none = move back regardless (the budget is gone or changed, or the
-- jobs can never fit it: their next reader decides)
-- ARGV[1] the index field   ARGV[2] the most entries moved at once
-- ARGV[3..] each window's limit, pico-dollars
--
-- Room: the least of limit - spent - live reservations over the windows, in units of the
-- smallest worst case parked. A window whose reservation sum may hold expired ones (`x`
-- passed, or `h` missing or negative while the window exists) counts as room for one
-- job: its admission recounts the window. After moving any, no sweep of any worker moves
-- more for 2 s, so the jobs in transit are admitted (or parked again) before more room is
-- counted: N workers do not move N times the room. Entries keep every field verbatim
-- (`_deliveries`, `_entry`, `_billed`, `_packed` included): a job moved back is a
-- hand-back to its next reader.
-- Returns the number of entries moved back.
local jobs, parked, index = KEYS[1], KEYS[2], KEYS[3]
local bad = key_types({{jobs, 'stream'}, {parked, 'stream'}, {index, 'hash'}})
if bad then
  return bad
end
if redis.call('EXISTS', parked) == 0 then
  redis.call('HDEL', index, ARGV[1])
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HGET', index, ARGV[1]) or ''
local cn, cx, rest = string.match(cur, '^(%d+)|(%d+)|(.*)$')
-- (a gate further ahead than one period is not ours to trust: a clock that went back)
if cx and tonumber(cx) > now and tonumber(cx) <= now + 2000 then
  return 0
end
local need = math.max(1, tonumber(cn or '1'))
local room = tonumber(ARGV[2])
for i = 4, #KEYS do
  local limit = tonumber(ARGV[i - 1])
  local v = redis.call('HMGET', KEYS[i], 'spent', 'h', 'x')
  local spent, held, x = tonumber(v[1]) or 0, tonumber(v[2]), tonumber(v[3])
  local exists = v[1] or v[2] or v[3]
  local n
  if exists and (held == nil or held < 0 or (x and x <= now)) then
    -- stale reservations may hold it: one job, whose admission recounts the window
    n = 1
  else
    n = math.floor((limit - spent - (held or 0)) / need)
  end
  if n < room then
    room = n
  end
end
local moved = 0
if room > 0 then
  for _, e in ipairs(redis.call('XRANGE', parked, '-', '+', 'COUNT', room)) do
    redis.call('XADD', jobs, '*', unpack(e[2]))
    redis.call('XDEL', parked, e[1])
    moved = moved + 1
  end
end
if redis.call('XLEN', parked) == 0 then
  redis.call('DEL', parked)
  redis.call('HDEL', index, ARGV[1])
elseif moved > 0 and rest then
  -- The smallest worst case parked may have left with these: the estimate doubles, and
  -- a job parked again with a smaller one lowers it (budget_park.lua), so larger jobs
  -- are not moved back in hundreds for room that fits only a small one.
  local up = string.format('%.0f', math.min(tonumber(cn) * 2, 9.0e18))
  redis.call('HSET', index, ARGV[1], up .. '|' .. (now + 2000) .. '|' .. rest)
end
return moved
