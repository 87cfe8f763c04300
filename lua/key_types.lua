-- Prelude: a redis.error_reply naming the first key of the wrong type, or nil, so a
-- script can check every key before its first write. `checks`: pairs {key, type}; a
-- missing key is fine.
local function key_types(checks)
  for _, c in ipairs(checks) do
    local t = redis.call('TYPE', c[1])['ok']
    if t ~= 'none' and t ~= c[2] then
      return redis.error_reply('WRONGTYPE ' .. c[1] .. ' is a ' .. t .. ', not a ' .. c[2]
        .. ': rename or delete that key')
    end
  end
  return nil
end
