//! The streams: key names, reading jobs (XREADGROUP on a connection of its own), and the
//! atomic commit of a finished job (result + XACK + dead letter + dedupe marker + costs).
//!
//! Invariants:
//! - every key carries the `{namespace}` hash tag (one Cluster slot per queue);
//! - a job entry is acknowledged only by `lua/commit.lua`, in the same step as its result
//!   (one exception: an entry deleted from the stream while pending has no payload left to
//!   process; [`Queue::reclaim`] acknowledges it and the worker logs and counts it);
//! - a commit for an entry that is no longer pending writes nothing (no second result).

use crate::config::Config;
use redis::aio::MultiplexedConnection;
use redis::streams::StreamReadReply;
use redis::{AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo, Value};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("redis: {0} (retry when Redis answers again)")]
    Redis(#[from] redis::RedisError),
    #[error("redis pool: {0} (retry when Redis answers again)")]
    Pool(#[from] deadpool_redis::PoolError),
    #[error("redis url: {0} (fix redis.url)")]
    Url(String),
    #[error("redis did not answer within {0:?} (retry when Redis answers again)")]
    Timeout(Duration),
}

/// Every Redis key name in one place.
#[derive(Debug, Clone)]
pub struct Keys {
    pub prefix: String,
    pub jobs: String,
    pub results: String,
    pub dead: String,
    pub costs: String,
}

impl Keys {
    pub fn new(namespace: &str) -> Keys {
        let prefix = format!("{{{namespace}}}");
        Keys {
            jobs: format!("{prefix}:jobs"),
            results: format!("{prefix}:results"),
            dead: format!("{prefix}:dead"),
            costs: format!("{prefix}:cost"),
            prefix,
        }
    }
    /// Slot `i` of `pool`: value = holder token, absent = free.
    pub fn slot(&self, pool: &str, i: u32) -> String {
        format!("{}:slot:{pool}:{i}", self.prefix)
    }
    /// The fleet-wide N of `pool`, recorded by the first worker that used it.
    pub fn pool_size(&self, pool: &str) -> String {
        format!("{}:poolsize:{pool}", self.prefix)
    }
    /// Processes waiting for a slot of `pool` (sorted set, FIFO by enqueue time).
    pub fn slot_queue(&self, pool: &str) -> String {
        format!("{}:slotq:{pool}", self.prefix)
    }
    /// Prefix of per-process "still waiting" keys (`<prefix><token>`, short TTL).
    pub fn waiter_alive_prefix(&self) -> String {
        format!("{}:slotalive:", self.prefix)
    }
    /// Prefix of per-process hand-off lists (`<prefix><token>`).
    pub fn wake_prefix(&self) -> String {
        format!("{}:slotwake:", self.prefix)
    }
    /// Result marker of a job id (idempotency), value = `<result entry id>|<status>`.
    pub fn done(&self, job_id: &str) -> String {
        format!("{}:done:{job_id}", self.prefix)
    }
    /// In-progress marker of a job id, value = the job entry working on it (short TTL,
    /// extended while the job runs).
    pub fn inflight(&self, job_id: &str) -> String {
        format!("{}:inflight:{job_id}", self.prefix)
    }
}

/// Connection info from config: `redis.url`, with the password from `redis.password_env` if set.
pub fn connection_info(cfg: &Config) -> Result<ConnectionInfo, QueueError> {
    let info = cfg
        .redis
        .url
        .as_str()
        .into_connection_info()
        .map_err(|e| QueueError::Url(e.to_string()))?;
    let info = match &cfg.redis.password {
        Some(pw) => {
            let settings = info.redis_settings().clone().set_password(pw.expose());
            info.set_redis_settings(settings)
        }
        None => info,
    };
    if cfg.redis.tls_ca_file.is_empty() {
        return Ok(info);
    }
    // A private CA: the TLS parameters travel inside the connection info, so every
    // connection (pool, blocking, tools) trusts it.
    let ca = std::fs::read(&cfg.redis.tls_ca_file).map_err(|e| {
        QueueError::Url(format!(
            "redis.tls_ca_file {:?}: {e}",
            cfg.redis.tls_ca_file
        ))
    })?;
    let client = redis::Client::build_with_tls(
        info,
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )?;
    Ok(client.get_connection_info().clone())
}

/// A pool for ordinary (non-blocking) commands.
pub fn command_pool(cfg: &Config, size: usize) -> Result<deadpool_redis::Pool, QueueError> {
    // The manager is built from our ConnectionInfo directly (not deadpool's serialisable
    // config), so TLS parameters (a private CA) reach every pooled connection.
    let manager = deadpool_redis::Manager::new(connection_info(cfg)?)?;
    let mut pool_cfg = deadpool_redis::PoolConfig::new(size.max(4));
    pool_cfg.timeouts.wait = Some(Duration::from_secs(5));
    pool_cfg.timeouts.create = Some(Duration::from_secs(2));
    pool_cfg.timeouts.recycle = Some(Duration::from_secs(2));
    deadpool_redis::Pool::builder(manager)
        .config(pool_cfg)
        .runtime(deadpool_redis::Runtime::Tokio1)
        .build()
        .map_err(|e| QueueError::Url(e.to_string()))
}

/// A connection of its own for blocking commands (XREADGROUP BLOCK, BLPOP): no response
/// timeout (redis 1.x's default 500 ms would cut a BLOCK short), and nothing else queued
/// behind it. Callers bound each blocking call themselves.
pub async fn blocking_connection(cfg: &Config) -> Result<MultiplexedConnection, QueueError> {
    let client = redis::Client::open(connection_info(cfg)?)?;
    let conn_cfg = AsyncConnectionConfig::new()
        .set_response_timeout(None)
        .set_connection_timeout(Some(Duration::from_secs(2)));
    let fut = client.get_multiplexed_async_connection_with_config(&conn_cfg);
    match tokio::time::timeout(Duration::from_secs(3), fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(QueueError::Timeout(Duration::from_secs(3))),
    }
}

/// One job entry as read from the stream.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub entry_id: String,
    /// The `payload` field, raw bytes (kept verbatim for dead letters), if present.
    pub payload: Option<Vec<u8>>,
    /// Names of fields other than `payload` (reported, not fatal).
    pub extra_fields: Vec<String>,
    /// How many times this entry has been delivered (1 for a fresh read), plus the
    /// deliveries a hand-back carried over.
    pub deliveries: u64,
    /// The entry id the job was first pushed as, if this entry is a hand-back of it
    /// (field `_entry`): the job id of a payload without `id`, so it stays the same.
    pub first_entry: Option<String>,
}

impl Delivery {
    fn from_stream_id(id: redis::streams::StreamId, deliveries: u64) -> Delivery {
        let mut payload = None;
        let mut extra = vec![];
        let mut deliveries = deliveries;
        let mut first_entry = None;
        for (k, v) in id.map {
            if k == HANDED_BACK_ENTRY {
                first_entry = redis::from_redis_value::<String>(v).ok();
            } else if k == HANDED_BACK_DELIVERIES {
                // A hand-back (see `Queue::hand_back`) carries the deliveries so far.
                deliveries += redis::from_redis_value::<u64>(v).unwrap_or(0);
            } else if k == "payload" {
                payload = match v {
                    Value::BulkString(b) => Some(b),
                    Value::SimpleString(s) => Some(s.into_bytes()),
                    Value::Int(i) => Some(i.to_string().into_bytes()),
                    _ => Some(vec![]),
                };
            } else {
                extra.push(k);
            }
        }
        extra.sort();
        Delivery {
            entry_id: id.id,
            payload,
            extra_fields: extra,
            deliveries,
            first_entry,
        }
    }
}

/// What to write when a job is done. Field values are bytes so a dead letter keeps a
/// payload that is not UTF-8 verbatim.
#[derive(Debug, Clone, Default)]
pub struct Commit {
    pub entry_id: String,
    pub result: Vec<(&'static str, Vec<u8>)>,
    pub dead: Vec<(&'static str, Vec<u8>)>,
    /// The job id whose result marker to set (None: no marker).
    pub dedupe_id: Option<String>,
    /// The job id whose in-progress marker to clear if it is this entry's.
    pub inflight_id: Option<String>,
    /// The result's status, stored in the result marker.
    pub status: String,
    /// (hash field, integer increment) for `{ns}:cost`.
    pub costs: Vec<(String, i64)>,
}

#[derive(Clone)]
pub struct Queue {
    pub keys: Keys,
    pool: deadpool_redis::Pool,
    group: String,
    consumer: String,
    results_maxlen: u64,
    dedupe_ttl_s: u64,
    delete_acked: bool,
    commit_script: redis::Script,
    claim_id_script: redis::Script,
    keepalive_script: redis::Script,
    claim_idle_ms: u64,
}

/// What the idempotency check says about a job id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdClaim {
    /// Go ahead: this entry now owns the id's in-progress marker.
    Claimed,
    /// The id already has a result: `(result entry id, status)`.
    Done { result_id: String, status: String },
    /// Another entry with the same id is being worked on now.
    Busy { other_entry: String },
}

/// Entries taken over from stalled consumers.
#[derive(Debug, Default)]
pub struct Reclaimed {
    pub deliveries: Vec<Delivery>,
    /// Entries that were pending but deleted from the stream; already acknowledged.
    pub deleted: Vec<String>,
}

impl Queue {
    pub fn new(cfg: &Config, pool: deadpool_redis::Pool) -> Queue {
        Queue {
            keys: Keys::new(&cfg.queue.namespace),
            pool,
            group: cfg.queue.group.clone(),
            consumer: cfg.queue.consumer.clone(),
            results_maxlen: cfg.queue.results_maxlen,
            dedupe_ttl_s: cfg.queue.dedupe_ttl_s,
            delete_acked: cfg.queue.delete_acked,
            commit_script: redis::Script::new(include_str!("../lua/commit.lua")),
            claim_id_script: redis::Script::new(include_str!("../lua/claim_id.lua")),
            keepalive_script: redis::Script::new(include_str!("../lua/keepalive.lua")),
            claim_idle_ms: cfg.queue.claim_idle_ms,
        }
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    pub fn pool(&self) -> &deadpool_redis::Pool {
        &self.pool
    }

    /// Creates the consumer group at id 0 with MKSTREAM (jobs pushed before the first
    /// worker started are processed); an existing group is fine.
    pub async fn ensure_group(&self) -> Result<(), QueueError> {
        let mut conn = self.pool.get().await?;
        let r: Result<(), redis::RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.keys.jobs)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut *conn)
            .await;
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Reads up to `count` new entries, blocking up to `block`. The caller owns `conn`
    /// (a [`blocking_connection`]); the wait is bounded by `block` + 2 s.
    pub async fn read_new(
        &self,
        conn: &mut MultiplexedConnection,
        count: usize,
        block: Duration,
    ) -> Result<Vec<Delivery>, QueueError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.group)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(count)
            .arg("BLOCK")
            .arg(block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.keys.jobs)
            .arg(">");
        let fut = cmd.query_async::<Option<StreamReadReply>>(conn);
        let bound = block + Duration::from_secs(2);
        let reply = match tokio::time::timeout(bound, fut).await {
            Ok(r) => r?,
            Err(_) => return Err(QueueError::Timeout(bound)),
        };
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .map(|id| Delivery::from_stream_id(id, 1))
            .collect())
    }

    /// Writes the result (and dead letter, marker, costs) and acknowledges the job, in one
    /// script. `Ok(Some(result_id))` when written; `Ok(None)` when the job was no longer
    /// pending (already committed elsewhere): nothing was written.
    pub async fn commit(&self, c: &Commit) -> Result<Option<String>, QueueError> {
        let dedupe_key = self.keys.done(c.dedupe_id.as_deref().unwrap_or(""));
        let inflight_key = self.keys.inflight(c.inflight_id.as_deref().unwrap_or(""));
        let ttl = if c.dedupe_id.is_some() {
            self.dedupe_ttl_s
        } else {
            0
        };
        let mut inv = self.commit_script.prepare_invoke();
        inv.key(&self.keys.jobs)
            .key(&self.keys.results)
            .key(&self.keys.dead)
            .key(&self.keys.costs)
            .key(dedupe_key)
            .key(inflight_key)
            .arg(&self.group)
            .arg(&c.entry_id)
            .arg(self.results_maxlen)
            .arg(ttl)
            .arg(if self.delete_acked { 1 } else { 0 })
            .arg(&c.status);
        inv.arg(c.result.len());
        for (k, v) in &c.result {
            inv.arg(*k).arg(v.as_slice());
        }
        inv.arg(c.dead.len());
        for (k, v) in &c.dead {
            inv.arg(*k).arg(v.as_slice());
        }
        inv.arg(c.costs.len());
        for (k, v) in &c.costs {
            inv.arg(k).arg(*v);
        }
        let mut conn = self.pool.get().await?;
        Ok(inv.invoke_async::<Option<String>>(&mut *conn).await?)
    }
}

impl Queue {
    /// The idempotency check for `job_id` (see `lua/claim_id.lua`).
    pub async fn claim_id(&self, job_id: &str, entry_id: &str) -> Result<IdClaim, QueueError> {
        let mut conn = self.pool.get().await?;
        let (kind, val): (String, String) = self
            .claim_id_script
            .key(self.keys.done(job_id))
            .key(self.keys.inflight(job_id))
            .arg(entry_id)
            .arg(self.claim_idle_ms)
            .invoke_async(&mut *conn)
            .await?;
        Ok(match kind.as_str() {
            "done" => {
                let (rid, status) = val.split_once('|').unwrap_or((val.as_str(), "ok"));
                IdClaim::Done {
                    result_id: rid.to_string(),
                    status: status.to_string(),
                }
            }
            "busy" => IdClaim::Busy { other_entry: val },
            _ => IdClaim::Claimed,
        })
    }

    /// Resets the idle time of entries this consumer is still working on, and extends
    /// their ids' in-progress markers. Returns the entries no longer ours.
    pub async fn keepalive(&self, entries: &[(String, String)]) -> Result<Vec<String>, QueueError> {
        if entries.is_empty() {
            return Ok(vec![]);
        }
        let mut inv = self.keepalive_script.prepare_invoke();
        inv.key(&self.keys.jobs);
        for (_, job_id) in entries {
            inv.key(self.keys.inflight(job_id));
        }
        inv.arg(&self.group)
            .arg(&self.consumer)
            .arg(self.claim_idle_ms);
        for (entry, _) in entries {
            inv.arg(entry);
        }
        let mut conn = self.pool.get().await?;
        Ok(inv.invoke_async(&mut *conn).await?)
    }

    /// Takes over up to `count` entries pending longer than `queue.claim_idle_ms`
    /// (XAUTOCLAIM, cursor followed to the end or until `count` are claimed), with their
    /// delivery counts. Entries deleted from the stream while pending are acknowledged.
    pub async fn reclaim(&self, count: usize) -> Result<Reclaimed, QueueError> {
        let mut out = Reclaimed::default();
        let mut conn = self.pool.get().await?;
        let mut cursor = "0-0".to_string();
        while out.deliveries.len() < count {
            let reply: redis::streams::StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                .arg(&self.keys.jobs)
                .arg(&self.group)
                .arg(&self.consumer)
                .arg(self.claim_idle_ms)
                .arg(&cursor)
                .arg("COUNT")
                .arg(count - out.deliveries.len())
                .query_async(&mut *conn)
                .await?;
            if !reply.deleted_ids.is_empty() {
                let _: i64 = redis::cmd("XACK")
                    .arg(&self.keys.jobs)
                    .arg(&self.group)
                    .arg(&reply.deleted_ids)
                    .query_async(&mut *conn)
                    .await?;
                out.deleted.extend(reply.deleted_ids);
            }
            if !reply.claimed.is_empty() {
                let first = reply.claimed[0].id.clone();
                let last = reply.claimed[reply.claimed.len() - 1].id.clone();
                let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
                    .arg(&self.keys.jobs)
                    .arg(&self.group)
                    .arg(&first)
                    .arg(&last)
                    .arg(reply.claimed.len())
                    .arg(&self.consumer)
                    .query_async(&mut *conn)
                    .await?;
                let counts: std::collections::HashMap<String, u64> =
                    pending.into_iter().map(|(id, _, _, n)| (id, n)).collect();
                for id in reply.claimed {
                    let n = counts.get(&id.id).copied().unwrap_or(2);
                    out.deliveries.push(Delivery::from_stream_id(id, n));
                }
            }
            cursor = reply.next_stream_id;
            if cursor == "0-0" {
                break;
            }
        }
        Ok(out)
    }

    /// One result entry's fields, if it is still in the results stream.
    pub async fn result_fields(
        &self,
        result_id: &str,
    ) -> Result<Option<Vec<(String, Vec<u8>)>>, QueueError> {
        let mut conn = self.pool.get().await?;
        let r: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(&self.keys.results)
            .arg(result_id)
            .arg(result_id)
            .query_async(&mut *conn)
            .await?;
        Ok(r.ids.into_iter().next().map(|e| {
            e.map
                .into_iter()
                .map(|(k, v)| {
                    let b = match v {
                        Value::BulkString(b) => b,
                        Value::SimpleString(s) => s.into_bytes(),
                        _ => vec![],
                    };
                    (k, b)
                })
                .collect()
        }))
    }
}

/// Field a handed-back entry carries: how many times the job was delivered before it was
/// handed back. The reader adds it to the entry's own delivery count, so
/// `queue.max_deliveries` still counts every worker that took the job.
pub const HANDED_BACK_DELIVERIES: &str = "_deliveries";
/// Field a handed-back entry carries: the entry id the job was first pushed as.
pub const HANDED_BACK_ENTRY: &str = "_entry";

/// What [`Queue::hand_back`] did with an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandBack {
    /// Re-queued as this new entry id; the old one is acknowledged (and deleted).
    Moved(String),
    /// Not pending under this consumer any more (committed, or taken over): untouched.
    NotOurs,
    /// Deleted from the stream while pending: acknowledged, nothing to re-queue.
    Deleted,
}

impl Queue {
    /// Hands an unfinished job back to the fleet at once (shutdown), instead of leaving it
    /// pending until another worker's `queue.claim_idle_ms` passes: in one script
    /// (`lua/handback.lua`), a new entry with every original field verbatim plus
    /// [`HANDED_BACK_DELIVERIES`] and [`HANDED_BACK_ENTRY`], the XACK (+XDEL) of the old one, and the release of the
    /// job id's in-progress marker if it is this entry's (so the new entry can claim the
    /// id). Only if the old entry is still pending under this consumer.
    pub async fn hand_back(
        &self,
        entry_id: &str,
        job_id: Option<&str>,
        deliveries: u64,
    ) -> Result<HandBack, QueueError> {
        let script = redis::Script::new(include_str!("../lua/handback.lua"));
        let mut inv = script.prepare_invoke();
        inv.key(&self.keys.jobs)
            .key(self.keys.inflight(job_id.unwrap_or("")))
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(entry_id)
            .arg(deliveries)
            .arg(if self.delete_acked { 1 } else { 0 });
        let mut conn = self.pool.get().await?;
        let (kind, id): (String, String) = inv.invoke_async(&mut *conn).await?;
        Ok(match kind.as_str() {
            "moved" => HandBack::Moved(id),
            "deleted" => HandBack::Deleted,
            _ => HandBack::NotOurs,
        })
    }

    /// Removes consumers that own no pending entry from the group (`lua/consumers.lua`):
    /// with `Some(idle)`, every other consumer idle at least that long (the reclaimer's
    /// sweep of stopped pods); with `None`, this worker's own consumer (a clean exit).
    /// A consumer with pending entries is never removed: that would drop its entries from
    /// the pending list, and nobody would ever reclaim them. Returns the removed names.
    pub async fn remove_consumers(
        &self,
        idle: Option<Duration>,
    ) -> Result<Vec<String>, QueueError> {
        let script = redis::Script::new(include_str!("../lua/consumers.lua"));
        let mut inv = script.prepare_invoke();
        inv.key(&self.keys.jobs)
            .arg(&self.group)
            .arg(if idle.is_some() { "idle" } else { "self" })
            .arg(&self.consumer)
            .arg(idle.map(|d| d.as_millis() as u64).unwrap_or(0));
        let mut conn = self.pool.get().await?;
        Ok(inv.invoke_async(&mut *conn).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_the_hash_tag() {
        let k = Keys::new("llm");
        assert_eq!(k.jobs, "{llm}:jobs");
        assert_eq!(k.results, "{llm}:results");
        assert_eq!(k.dead, "{llm}:dead");
        assert_eq!(k.slot("default", 3), "{llm}:slot:default:3");
        for key in [
            k.pool_size("p"),
            k.slot_queue("p"),
            k.done("x"),
            k.costs.clone(),
        ] {
            assert!(key.starts_with("{llm}:"), "{key}");
        }
    }
}
