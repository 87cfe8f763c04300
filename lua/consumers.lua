-- Remove consumers that own no pending entry from the jobs group. Never one with pending
-- entries: XGROUP DELCONSUMER would drop them from the pending list, and then nobody
-- would ever reclaim them.
-- KEYS[1] jobs stream
-- ARGV[1] group   ARGV[2] mode: 'self' (remove ARGV[3], a clean exit) or 'idle' (remove
-- every consumer but ARGV[3] idle at least ARGV[4] ms)   ARGV[3] this worker's consumer
-- ARGV[4] idle threshold in ms ('idle' mode)
-- Returns the names removed.
local removed = {}
local list = redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
for _, c in ipairs(list) do
  local f = {}
  for j = 1, #c, 2 do
    f[c[j]] = c[j + 1]
  end
  local name = f['name']
  local remove = false
  if tonumber(f['pending']) == 0 then
    if ARGV[2] == 'self' then
      remove = name == ARGV[3]
    else
      remove = name ~= ARGV[3] and tonumber(f['idle']) >= tonumber(ARGV[4])
    end
  end
  if remove then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], name)
    removed[#removed + 1] = name
  end
end
return removed
