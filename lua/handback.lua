-- Hand an unfinished job back to the fleet (shutdown), in one atomic step: a new entry on
-- the jobs stream with every field of the old one verbatim plus `_deliveries` (the
-- deliveries that count so far), `_entry` (the entry id the job was first pushed as; kept
-- from an earlier hand-back) and `_billed` (what earlier deliveries spent, if anything),
-- the XACK (+XDEL) of the old entry, and the release of the job id's in-progress marker
-- if it is the old entry's (so the new entry can claim the id).
-- Only if the old entry is still pending under this consumer: a job committed or taken
-- over meanwhile is left alone. Every check runs before the first write.
-- An entry of more than ARGV[8] fields (besides ours) is kept whole as one field
-- `_packed`: every name and value in order as a netstring (`<byte length>:<bytes>,`),
-- which the reader unpacks. Lua passes at most ~8000 arguments to one command, so a
-- wider entry could not be copied field by field.
-- KEYS[1] jobs stream   KEYS[2] in-progress marker of the job id
-- KEYS[3] hand-back tombstone of the old entry (set to the new entry id, so a late commit
-- of the old entry by a worker cut off meanwhile is superseded, not a second result)
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] entry id   ARGV[4] deliveries that count
-- ARGV[5] 1 = XDEL the old entry   ARGV[6] tombstone ttl in seconds
-- ARGV[7] the `_billed` value ('' = none)   ARGV[8] most fields copied one by one
-- Returns {'moved', new entry id} | {'notours', ''} | {'deleted', ''}
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then
  return {'notours', ''}
end
local release = false
local t = redis.call('TYPE', KEYS[2])['ok']
if t == 'string' and redis.call('GET', KEYS[2]) == ARGV[3] then
  release = true
end
local e = redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3])
if #e == 0 then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  if release then
    redis.call('DEL', KEYS[2])
  end
  return {'deleted', ''}
end
local fields = {}
local old = e[1][2]
local first = ARGV[3]
for j = 1, #old, 2 do
  if old[j] == '_entry' then
    first = old[j + 1]
  elseif old[j] ~= '_deliveries' and old[j] ~= '_billed' then
    fields[#fields + 1] = old[j]
    fields[#fields + 1] = old[j + 1]
  end
end
if #fields > 2 * tonumber(ARGV[8]) then
  local parts = {}
  for j = 1, #fields do
    parts[#parts + 1] = #fields[j] .. ':' .. fields[j] .. ','
  end
  fields = {'_packed', table.concat(parts)}
end
fields[#fields + 1] = '_deliveries'
fields[#fields + 1] = ARGV[4]
fields[#fields + 1] = '_entry'
fields[#fields + 1] = first
if ARGV[7] ~= '' then
  fields[#fields + 1] = '_billed'
  fields[#fields + 1] = ARGV[7]
end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('SET', KEYS[3], id, 'EX', ARGV[6])
if release then
  redis.call('DEL', KEYS[2])
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
if ARGV[5] == '1' then
  redis.call('XDEL', KEYS[1], ARGV[3])
end
return {'moved', id}
