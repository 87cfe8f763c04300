-- A job paused by a budget that covers only some jobs (`on_exhausted = "pause"`, some
-- models or one tenant) parked in one step: moved like a shutdown hand-back (same fields,
-- delivery count and spend carried, marker released, tombstone) to the budget's parked
-- stream, so it holds no job permit while it waits and does not hold up the jobs behind
-- it; budget_unpark.lua moves it back once the budget has room.
-- (Runs after the preludes key_types.lua and move_entry.lua.)
--
-- KEYS[1] jobs stream   KEYS[2] in-progress marker of the job id   KEYS[3] hand-back
-- tombstone of the entry (all three as in handback.lua)
-- KEYS[4] the budget's parked stream   KEYS[5] index of budget parked streams (hash:
-- parked stream key -> "<need>|<next>|<json>": the smallest worst case parked there
-- (pico-dollars, its digits), the server ms before which no sweep moves any back, and
-- the budget as the worker that parked last saw it, see src/budget/mod.rs `ParkAt`)
-- ARGV[1..8] as handback.lua's ARGV[1..8]   ARGV[9] the index field   ARGV[10] the JSON
-- ARGV[11] this job's worst case, pico-dollars (digits)
--
-- Every key's type is checked before the first write, so an error leaves nothing half
-- done (a job moved but not in the index would never be moved back).
-- Returns {'parked', new entry id} | {'notours', ''} | {'deleted', ''} (as handback.lua)
local bad = key_types({{KEYS[1], 'stream'}, {KEYS[4], 'stream'}, {KEYS[5], 'hash'}})
if bad then
  return bad
end
local r = move_entry(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV)
if r[1] == 'moved' then
  local need, nxt = ARGV[11], '0'
  local cur = redis.call('HGET', KEYS[5], ARGV[9])
  if cur then
    local cn, cx = string.match(cur, '^(%d+)|(%d+)|')
    -- the smaller need: a small job is not held back by a large one parked after it
    if cn and (#cn < #need or (#cn == #need and cn < need)) then
      need = cn
    end
    nxt = cx or '0'
  end
  redis.call('HSET', KEYS[5], ARGV[9], need .. '|' .. nxt .. '|' .. ARGV[10])
  return {'parked', r[2]}
end
return r
