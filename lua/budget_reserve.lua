#!lua flags=allow-oom
-- Reserve the worst case of one provider call against every budget window that covers
-- it, atomically: either every window takes the reservation or none does.
--
-- KEYS: one hash per budget window `{ns}:budget:<name>:<tenant or *>:<d:YYYY-MM-DD |
--       m:YYYY-MM>`; field `spent` = pico-dollars settled, fields `r:<id>` = live
--       reservations "<picos>|<expiry ms, server TIME>", `h` = the sum of the live
--       reservations, `x` = no reservation expires before this (server ms).
--       O(1) per call: the reservations are only read one by one (and expired ones
--       dropped from `h`) once `x` has passed or `h` is missing or negative (a window
--       written by an earlier version), about once per reservation ttl under steady
--       traffic.
-- ARGV[1] reservation id   ARGV[2] reservation ttl ms
-- ARGV[3..] per key: limit picos, amount picos, key expiry (unix ms: the window's end
--           plus a margin, so old windows leave nothing behind)
--
-- A reservation whose expiry has passed (its worker was killed or cut off before it
-- settled) is dropped when the next reservation reads the window. The window may never
-- hold more than its limit in spent + live reservations: concurrent calls can overshoot
-- it only by what providers bill beyond the worst cases reserved, never by a race.
-- Returns {1} = reserved everywhere; {0, i, left picos} = window i (from 1) has only
-- `left` (spent + reserved already counted) and nothing was reserved.
--
-- allow-oom: a full Redis must not turn into unlimited spending; the reservation field
-- is a few bytes (the commit of the result waits for memory anyway).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, ttl = ARGV[1], tonumber(ARGV[2])
local has_x = {}
for i = 1, #KEYS do
  local limit, amount = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  local v = redis.call('HMGET', KEYS[i], 'spent', 'h', 'x', 'r:' .. id)
  if i == 1 and v[4] then
    return {1} -- a retry of a try whose reply was lost: reserved already
  end
  local spent, held, x = tonumber(v[1]) or 0, tonumber(v[2]), tonumber(v[3])
  if held == nil or held < 0 or (x and x <= now) then
    -- recount the live reservations; drop the expired ones (a killed worker's)
    held, x = 0, nil
    local all = redis.call('HGETALL', KEYS[i])
    for j = 1, #all, 2 do
      local f, fv = all[j], all[j + 1]
      if string.sub(f, 1, 2) == 'r:' then
        local amt, exp = string.match(fv, '^(%d+)|(%d+)$')
        if amt and tonumber(exp) > now then
          held = held + tonumber(amt)
          if not x or tonumber(exp) < x then
            x = tonumber(exp)
          end
        else
          redis.call('HDEL', KEYS[i], f)
        end
      end
    end
    redis.call('HSET', KEYS[i], 'h', held)
    if x then
      redis.call('HSET', KEYS[i], 'x', x)
    else
      redis.call('HDEL', KEYS[i], 'x')
    end
  end
  has_x[i] = x ~= nil
  if spent + held + amount > limit then
    return {0, i, math.max(0, limit - spent - held)}
  end
end
for i = 1, #KEYS do
  local exp = now + ttl
  redis.call('HSET', KEYS[i], 'r:' .. id, ARGV[3 * i + 1] .. '|' .. exp)
  redis.call('HINCRBY', KEYS[i], 'h', ARGV[3 * i + 1])
  if not has_x[i] then
    redis.call('HSET', KEYS[i], 'x', exp)
  end
  redis.call('PEXPIREAT', KEYS[i], ARGV[3 * i + 2])
end
return {1}
