-- Moves one pending entry of this consumer to the tail of `dest` (the jobs stream itself
-- for a hand-back, a tenant's parked stream for a park). See handback.lua for what it
-- writes; `a` holds handback.lua's ARGV[1..8].
local function move_entry(jobs, marker, tomb, dest, a)
  local p = redis.call('XPENDING', jobs, a[1], a[3], a[3], 1)
  if #p == 0 or p[1][2] ~= a[2] then
    return {'notours', ''}
  end
  local release = false
  local t = redis.call('TYPE', marker)['ok']
  if t == 'string' and redis.call('GET', marker) == a[3] then
    release = true
  end
  local e = redis.call('XRANGE', jobs, a[3], a[3])
  if #e == 0 then
    redis.call('XACK', jobs, a[1], a[3])
    if release then
      redis.call('DEL', marker)
    end
    return {'deleted', ''}
  end
  local fields = {}
  local old = e[1][2]
  local first = a[3]
  for j = 1, #old, 2 do
    if old[j] == '_entry' then
      first = old[j + 1]
    elseif old[j] ~= '_deliveries' and old[j] ~= '_billed' and old[j] ~= '_unparked' then
      fields[#fields + 1] = old[j]
      fields[#fields + 1] = old[j + 1]
    end
  end
  if #fields > 2 * tonumber(a[8]) then
    local parts = {}
    for j = 1, #fields do
      parts[#parts + 1] = #fields[j] .. ':' .. fields[j] .. ','
    end
    fields = {'_packed', table.concat(parts)}
  end
  fields[#fields + 1] = '_deliveries'
  fields[#fields + 1] = a[4]
  fields[#fields + 1] = '_entry'
  fields[#fields + 1] = first
  if a[7] ~= '' then
    fields[#fields + 1] = '_billed'
    fields[#fields + 1] = a[7]
  end
  local id = redis.call('XADD', dest, '*', unpack(fields))
  redis.call('SET', tomb, id, 'EX', a[6])
  if release then
    redis.call('DEL', marker)
  end
  redis.call('XACK', jobs, a[1], a[3])
  if a[5] == '1' then
    redis.call('XDEL', jobs, a[3])
  end
  return {'moved', id}
end
