-- Jobs parked by a budget (budget_park.lua) moved back to the jobs stream's tail, as many
-- as the budget has room for now: every worker runs it for every parked stream once a
-- second (src/budget/parked.rs), so no event is needed for progress (a window that
-- ended, a limit raised, reservations settled or expired).
--
-- KEYS[1] jobs stream   KEYS[2] the parked stream   KEYS[3] index of budget parked
-- streams   KEYS[4..] the budget's windows now (see quota_admit.lua)
-- ARGV[1] the index field   ARGV[2] one parked job's worst case, pico-dollars (the last
-- one parked)   ARGV[3] the most entries moved at once   ARGV[4..] each window's limit
--
-- Room: the least of limit - spent - live reservations over the windows, in worst cases.
-- A window whose reservation sum may hold expired ones (`x` passed, or `h` missing)
-- counts as room for one job: its admission recounts the window. Entries keep every
-- field verbatim (`_deliveries`, `_entry`, `_billed`, `_packed` included), so a job
-- moved back is a hand-back: its next reader runs it as such. If it finds no room after
-- all it is parked again (nothing spins: at most the room is moved per run).
-- (Runs after the prelude key_types.lua.)
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
local need = math.max(1, tonumber(ARGV[2]))
local room = tonumber(ARGV[3])
for i = 4, #KEYS do
  local limit = tonumber(ARGV[i])
  local v = redis.call('HMGET', KEYS[i], 'spent', 'h', 'x')
  local spent, held, x = tonumber(v[1]) or 0, tonumber(v[2]), tonumber(v[3])
  local n
  if v[1] and (held == nil or held < 0 or (x and x <= now)) then
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
end
return moved
