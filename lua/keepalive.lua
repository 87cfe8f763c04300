-- Keep this worker's long-running jobs from being taken over: for each entry still
-- pending under this consumer, reset its idle time (XCLAIM ... JUSTID, which does not
-- count a delivery) and extend its id's in-progress marker if that marker is the entry's.
-- Entries now owned by another consumer are left alone (never stolen back).
-- KEYS[1] jobs stream, then one in-progress marker key per entry (KEYS[1 + i])
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] marker ttl ms   ARGV[3 + i] entry id i
-- Returns the entry ids that are no longer ours.
local gone = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    local marker = KEYS[i - 2]
    if redis.call('GET', marker) == id then
      redis.call('PEXPIRE', marker, ARGV[3])
    end
  else
    table.insert(gone, id)
  end
end
return gone
