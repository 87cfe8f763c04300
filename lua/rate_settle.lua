#!lua flags=allow-oom
-- Correct a call's token admissions to the tokens it really used (same admission time),
-- in every tokens-per-minute limit it was admitted in.
-- KEYS: per tokens limit, its sorted set and its total
-- ARGV[1] call id   ARGV[2] amount admitted   ARGV[3] amount used   ARGV[4] window ms
-- An admission that already left the window is left alone.
local member = ARGV[1] .. '|' .. ARGV[2]
for i = 1, #KEYS / 2 do
  local z, total = KEYS[2 * i - 1], KEYS[2 * i]
  local score = redis.call('ZSCORE', z, member)
  if score then
    redis.call('ZREM', z, member)
    redis.call('ZADD', z, score, ARGV[1] .. '|' .. ARGV[3])
    redis.call('INCRBY', total, tonumber(ARGV[3]) - tonumber(ARGV[2]))
    -- the ZREM may have deleted a set that held only this entry: both keys keep the
    -- window's expiry, so the total never outlives (or dies before) its entries
    redis.call('PEXPIRE', z, tonumber(ARGV[4]) + 1000)
    redis.call('PEXPIRE', total, tonumber(ARGV[4]) + 1000)
  end
end
return 1
