-- Start-time probe of the Redis user's key permissions (ACL). Touches nothing and
-- returns 1: the point is its KEYS, one key of each family a job's path reads and writes
-- (jobs, results, letters, cost totals, tombstones, spend, and the per-job markers of a
-- probe id). Redis checks every declared key of an EVALSHA against the user's ACL,
-- for reading and writing, before it runs the script, so a user that may not touch one
-- family is refused here (NOPERM), at start, instead of by every job that meets it.
return 1
