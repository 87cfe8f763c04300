-- Commit one finished job in one atomic step: XACK + result entry (+ dead letter)
-- (+ dedupe marker) (+ exact cost totals) (+ XDEL of the job entry).
-- Every key shares the {namespace} hash tag, so this also runs on Redis Cluster.
--
-- KEYS[1] jobs stream   KEYS[2] results stream   KEYS[3] dead stream
-- KEYS[4] cost totals hash   KEYS[5] result marker of the job id
-- KEYS[6] in-progress marker of the job id (deleted if it is this entry's)
-- ARGV[1] group   ARGV[2] job entry id   ARGV[3] results/dead MAXLEN (approximate)
-- ARGV[4] result marker ttl in seconds (0 = no marker)   ARGV[5] 1 = XDEL the job entry
-- ARGV[6] the result's status (stored in the marker)
-- ARGV[7] n, then n field/value pairs of the result entry
-- then m, then m field/value pairs of the dead-letter entry (m = 0: none)
-- then k, then k field/increment pairs for the cost totals hash (integers)
--
-- Returns the result entry id, or false when the job was no longer pending in the group
-- (another worker already committed it): then nothing at all is written, so a job never
-- gets two results.
local acked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if acked == 0 then
  return false
end
local i = 7
local function fields()
  local n = tonumber(ARGV[i])
  local out = {}
  for j = 1, 2 * n do
    out[j] = ARGV[i + j]
  end
  i = i + 2 * n + 1
  return out
end
local result = fields()
local dead = fields()
local costs = fields()
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(result))
if #dead > 0 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', unpack(dead))
end
for j = 1, #costs, 2 do
  redis.call('HINCRBY', KEYS[4], costs[j], costs[j + 1])
end
if tonumber(ARGV[4]) > 0 then
  redis.call('SET', KEYS[5], id .. '|' .. ARGV[6], 'EX', ARGV[4])
end
if redis.call('GET', KEYS[6]) == ARGV[2] then
  redis.call('DEL', KEYS[6])
end
if ARGV[5] == '1' then
  redis.call('XDEL', KEYS[1], ARGV[2])
end
return id
