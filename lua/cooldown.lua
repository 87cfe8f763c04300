#!lua flags=allow-oom
-- Put a model or provider in a cooldown for the whole fleet: a later cooldown may
-- lengthen one, never shorten it. All cooldowns of a namespace live in one hash, so
-- reading them is one HGETALL (never a scan of the keyspace).
-- KEYS[1] `{ns}:cooldowns`, field `m:<model>` / `p:<provider>` = "<end ms>|<reason>"
-- ARGV[1] field   ARGV[2] length ms   ARGV[3] reason
-- Ended cooldowns are dropped here; the hash expires with the last one.
-- Returns 1 if set or lengthened, 0 if a longer one was already running.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local want = now + tonumber(ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
local last = want
local kept = 0
for j = 1, #all, 2 do
  local ends = tonumber(string.match(all[j + 1], '^(%d+)|')) or 0
  if ends <= now then
    redis.call('HDEL', KEYS[1], all[j])
  else
    if all[j] == ARGV[1] and ends >= want then
      kept = 1
    end
    if ends > last then
      last = ends
    end
  end
end
if kept == 1 then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], want .. '|' .. ARGV[3])
redis.call('PEXPIREAT', KEYS[1], last + 1000)
return 1
