-- Replays one letter (dead letter or failed copy) as a job, once: only if the letter is
-- still there (another replay, run at the same time, may have taken it), the job is
-- pushed, then the letter deleted and the cancel marker of its id cleared.
-- KEYS[1] the letters stream   KEYS[2] the jobs stream   KEYS[3] cancel marker of the
-- job's id ({ns}:cancel:<id>; a key that never exists when the job has no id)
-- ARGV[1] the letter's entry id   ARGV[2] the payload to push
-- Returns the new job entry id, or false when the letter is gone (nothing done).
-- The XADD is the first write: on a full Redis (OOM) it fails before anything is
-- written, so a letter is never deleted without its job pushed.
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then
  return false
end
local new = redis.call('XADD', KEYS[2], '*', 'payload', ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[3])
return new
