-- Start-time probe of the Redis user's key permissions (ACL). Touches nothing and
-- returns 1: the point is its KEYS, called with the keys one of the worker's script calls
-- declares, as that call declares them (see Queue::refused_key_families). Redis checks
-- every declared key of an EVALSHA against the user's ACL, for reading and writing,
-- before it runs the script, so a user that may not touch them is refused here
-- (NOPERM), at start, instead of by every job that meets them.
return 1
