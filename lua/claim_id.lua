-- Idempotency by job id: decide, in one step, whether this entry may call a model.
-- KEYS[1] result marker of the id ({ns}:done:<id>, value "<result entry id>|<status>")
-- KEYS[2] in-progress marker of the id ({ns}:inflight:<id>, value = the job entry id)
-- KEYS[3] cancel marker of the id ({ns}:cancel:<id>, a string, any value)
-- ARGV[1] this job's entry id   ARGV[2] in-progress marker ttl ms
-- Returns {'done', marker}: the id already has an `ok` result (acknowledge, no model
--                           call); a `failed` or `dead` result does not count: the id
--                           runs again (its commit then replaces that marker);
--         {'claimed', ''}: go ahead (the marker is ours; a re-delivery of the same entry
--                          takes its own marker over);
--         {'busy', other entry id}: another copy of the id is being worked on now;
--         {'cancelled', ''}: the id has a cancel marker (and no `ok` result): end it
--                            `cancelled` with no model call.
-- Errors: `WRONGTYPE <key> ...` when a marker key holds another type (it will not heal).
for _, k in ipairs({KEYS[1], KEYS[2]}) do
  local t = redis.call('TYPE', k)['ok']
  if t ~= 'none' and t ~= 'string' then
    return redis.error_reply('WRONGTYPE ' .. k .. ' is a ' .. t .. ', not a string: rename or delete it')
  end
end
local done = redis.call('GET', KEYS[1])
if done then
  -- A marker without a status (older workers) stands for `ok`.
  local status = string.match(done, '|([^|]*)$')
  if status == nil or status == 'ok' then
    return {'done', done}
  end
end
-- A cancel marker is a string (`cancel`, `SET ... EX`), read as the reader's batch MGET
-- reads it: a key of another type at that name is not a marker.
if type(redis.pcall('GET', KEYS[3])) == 'string' then
  return {'cancelled', ''}
end
local cur = redis.call('GET', KEYS[2])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return {'claimed', ''}
end
return {'busy', cur}
