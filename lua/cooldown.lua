#!lua flags=allow-oom
-- Put a model or provider in a cooldown for the whole fleet: a later cooldown may
-- lengthen one, never shorten it.
-- KEYS[1] `{ns}:cooldown:<m|p>:<name>`   ARGV[1] length ms   ARGV[2] reason
-- Returns 1 if set or lengthened, 0 if a longer one was already running.
local left = redis.call('PTTL', KEYS[1])
if left >= tonumber(ARGV[1]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
return 1
