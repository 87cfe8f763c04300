#!lua flags=allow-oom
-- Correct a call's tokens admission (lua/rate_admit.lua) to the tokens it really used,
-- in the bucket it was admitted in, if that bucket is still in the window (later, the
-- correction no longer matters: the amount has left the window).
-- KEYS: the windows of the tokens limits the call was admitted in
-- ARGV[1] estimated tokens   ARGV[2] tokens used   ARGV[3] the admission's second
-- A bucket or total is never corrected below zero.
local delta = tonumber(ARGV[2]) - tonumber(ARGV[1])
for i = 1, #KEYS do
  local k = KEYS[i]
  local c = tonumber(redis.call('HGET', k, ARGV[3]))
  if c then
    local d = math.max(delta, -c)
    redis.call('HINCRBY', k, ARGV[3], d)
    local n = tonumber(redis.call('HINCRBY', k, 'n', d))
    if n < 0 then
      redis.call('HSET', k, 'n', 0)
    end
  end
end
return 1
