#!lua flags=allow-oom
-- Reserve the worst case of one provider call against every budget window that covers
-- it, atomically: either every window takes the reservation or none does.
--
-- KEYS: one hash per budget window `{ns}:budget:<name>:<tenant or *>:<d:YYYY-MM-DD |
--       m:YYYY-MM>`; field `spent` = pico-dollars settled, fields `r:<id>` = live
--       reservations "<picos>|<expiry ms, server TIME>".
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
if redis.call('HEXISTS', KEYS[1], 'r:' .. id) == 1 then
  return {1} -- a retry of a try whose reply was lost: reserved already
end
for i = 1, #KEYS do
  local limit, amount = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  local all = redis.call('HGETALL', KEYS[i])
  local used = 0
  for j = 1, #all, 2 do
    local f, v = all[j], all[j + 1]
    if f == 'spent' then
      used = used + (tonumber(v) or 0)
    elseif string.sub(f, 1, 2) == 'r:' then
      local amt, exp = string.match(v, '^(%d+)|(%d+)$')
      if amt and tonumber(exp) > now then
        used = used + tonumber(amt)
      else
        redis.call('HDEL', KEYS[i], f)
      end
    end
  end
  if used + amount > limit then
    return {0, i, math.max(0, limit - used)}
  end
end
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'r:' .. id, ARGV[3 * i + 1] .. '|' .. (now + ttl))
  redis.call('PEXPIREAT', KEYS[i], ARGV[3 * i + 2])
end
return {1}
