//! The streams: key names, reading jobs (XREADGROUP on a connection of its own), and the
//! atomic commit of a finished job (result + XACK + dead letter + dedupe marker + costs).
//!
//! Invariants:
//! - every key carries the `{namespace}` hash tag (one Cluster slot per queue);
//! - a job entry is acknowledged by `lua/commit.lua` in the same step as its result, or
//!   by `lua/handback.lua` in the same step as the new entry that carries it on (one
//!   more exception: an entry deleted from the stream while pending has no payload left
//!   to process; [`Queue::reclaim`]'s XAUTOCLAIM drops it and leaves a tombstone, and the
//!   worker logs and counts it; a worker still running it writes its result anyway);
//! - a take-over (`lua/reclaim.lua`) is one atomic step with the stall gate and the
//!   delivery counts of exactly the entries it claimed;
//! - a commit checks everything that can fail before its first write and acknowledges
//!   last, so an error leaves the job pending with nothing written;
//! - a commit for an entry another worker already committed writes nothing (no second
//!   result); an entry neither pending nor in the stream gets a result only with a
//!   dropped-entry tombstone of the reclaim.

pub mod reply;
mod wire;
pub use reply::{AutoClaimReply, Entries, Field, ReadReply, StreamEntry};
pub use wire::{
    DeadLetter, MAX_VERBATIM_FIELDS, PACKED_FIELDS, ResultEntry, ResultStatus, WireError,
    pack_fields, unpack_fields,
};

use crate::config::Config;
use crate::connect::{Commands, ConnectError};
use crate::line::{Line, Role, Waiting};
use crate::scripts;
use redis::aio::MultiplexedConnection;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// Connection, timeout or server error; [`QueueError::heals`] says whether retrying
    /// the same command can succeed.
    #[error("redis: {0}")]
    Redis(redis::RedisError),
    #[error("redis pool: {0} (retry when Redis answers again)")]
    Pool(deadpool_redis::PoolError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("redis did not answer within {0:?} (retry when Redis answers again)")]
    Timeout(Duration),
}

from_cause!(QueueError, QueueError::Redis, redis::RedisError);
from_cause!(QueueError, QueueError::Pool, deadpool_redis::PoolError);

/// Server error codes that go away by themselves: memory freed under `noeviction`, a
/// dataset loading, a failover or resharding in progress, a busy script, too few
/// replicas for `min-replicas-to-write` (NOREPLICAS), writes stopped after a failed
/// background save (MISCONF, lifted by the next good save).
const HEALING_CODES: &[&str] = &[
    "OOM",
    "NOREPLICAS",
    "MISCONF",
    "LOADING",
    "MASTERDOWN",
    "READONLY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "BUSY",
    "NOSCRIPT",
    "MOVED",
    "ASK",
];

impl QueueError {
    /// True when the same command can succeed later without anyone changing anything:
    /// IO, timeouts, dropped or refused connections, and the server errors of
    /// [`HEALING_CODES`]. False for errors that repeat until someone acts: a key of the
    /// wrong type (WRONGTYPE), a script error, a bad argument, a bad URL.
    pub fn heals(&self) -> bool {
        match self {
            QueueError::Redis(e) => redis_error_heals(e),
            QueueError::Pool(deadpool_redis::PoolError::Backend(e)) => redis_error_heals(e),
            QueueError::Pool(_) | QueueError::Timeout(_) => true,
            QueueError::Connect(ConnectError::Redis(e)) => redis_error_heals(e),
            QueueError::Connect(
                ConnectError::Timeout(_) | ConnectError::Sentinel(_) | ConnectError::Cluster(_),
            ) => true,
            QueueError::Connect(ConnectError::Url(_)) => false,
        }
    }
}

impl QueueError {
    /// The same error again, for telling several waiters of one failed call (`None` for
    /// the kinds that cannot be copied: a pool error other than the backend's, which all
    /// heal, and a connect error).
    pub(crate) fn copy(&self) -> Option<QueueError> {
        match self {
            QueueError::Redis(e) => Some(QueueError::Redis(e.clone())),
            QueueError::Timeout(d) => Some(QueueError::Timeout(*d)),
            QueueError::Pool(deadpool_redis::PoolError::Backend(e)) => Some(QueueError::Pool(
                deadpool_redis::PoolError::Backend(e.clone()),
            )),
            QueueError::Pool(_) | QueueError::Connect(_) => None,
        }
    }
}

pub(crate) fn redis_error_heals(e: &redis::RedisError) -> bool {
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        return true;
    }
    match e.code() {
        // A MULTI aborted for one of its commands (EXECABORT): heals as that command's
        // error does (a full Redis refuses the INCRBY with OOM inside it).
        Some("EXECABORT") => e.clone().into_server_errors().is_some_and(|errs| {
            errs.iter()
                .any(|(_, se)| HEALING_CODES.contains(&se.code()))
        }),
        Some(code) => HEALING_CODES.contains(&code),
        // No server code: a client-side failure (parse, protocol); retrying helps
        // only if the connection was at fault, which the checks above cover.
        None => false,
    }
}

/// The status in a result marker (`{ns}:done:<id>` = `<result entry id>|<status>`); a
/// marker without one (older workers) stands for `ok`, as `lua/claim_id.lua` reads it.
pub fn marker_status(marker: &str) -> &str {
    marker.rsplit_once('|').map_or("ok", |(_, s)| s)
}

/// How long a job entry's record of what its deliveries spent against its `max_cost_usd`
/// is kept ([`Keys::cap_spent`]); it is dropped at the entry's result, so this only
/// bounds what a worker that died after its commit leaves behind.
pub const CAP_SPENT_TTL: std::time::Duration = std::time::Duration::from_secs(86_400);

/// Every Redis key name in one place. Names are joined with `[..].concat()` (one
/// allocation of the exact size), not `format!` (about 700 instructions a name; each job's
/// commit and cancel check build 8-9).
#[derive(Debug, Clone)]
pub struct Keys {
    pub prefix: String,
    pub jobs: String,
    pub results: String,
    pub dead: String,
    /// Copies of jobs that ended `failed` (dead-letter shape, reason = the error), so
    /// `llm-worker retry ID` and `dead replay --failed` can run them again; trimmed like
    /// the dead stream.
    pub failed: String,
    pub costs: String,
}

impl Keys {
    pub fn new(namespace: &str) -> Keys {
        let prefix = format!("{{{namespace}}}");
        Keys {
            jobs: format!("{prefix}:jobs"),
            results: format!("{prefix}:results"),
            dead: format!("{prefix}:dead"),
            failed: format!("{prefix}:failed"),
            costs: format!("{prefix}:cost"),
            prefix,
        }
    }
    /// Result marker of a job id (idempotency), value = `<result entry id>|<status>`.
    pub fn done(&self, job_id: &str) -> String {
        [self.prefix.as_str(), ":done:", job_id].concat()
    }
    /// Cancel marker of a job id (`llm-worker cancel`, or a producer's own `SET ... EX`):
    /// a job of that id ends `cancelled` (no call if none started, else its call aborted).
    pub fn cancel(&self, job_id: &str) -> String {
        [self.prefix.as_str(), ":cancel:", job_id].concat()
    }
    /// In-progress marker of a job id, value = the job entry working on it (short TTL,
    /// extended while the job runs).
    pub fn inflight(&self, job_id: &str) -> String {
        [self.prefix.as_str(), ":inflight:", job_id].concat()
    }
    /// What the deliveries of one job entry with a `max_cost_usd` have spent, in
    /// pico-dollars: each call adds its worst case before it starts and corrects it to
    /// its real cost after it, so a delivery that takes over from a killed one counts the
    /// calls it cannot know of (see `Queue::cap_spent_add`).
    pub fn cap_spent(&self, entry_id: &str) -> String {
        [self.prefix.as_str(), ":capspent:", entry_id].concat()
    }
    /// Tombstone of a handed-back job entry, value = the new entry id: a late commit of
    /// the old entry is superseded (`lua/commit.lua`), so a job never gets two results.
    pub fn handed_back(&self, entry_id: &str) -> String {
        [self.prefix.as_str(), ":handedback:", entry_id].concat()
    }
    /// Tombstones of pending entries a reclaim found deleted from the stream (sorted set:
    /// entry id -> expiry, server ms): a worker still running one may write its result.
    pub fn dropped(&self) -> String {
        [self.prefix.as_str(), ":dropped"].concat()
    }
    /// The fleet's heartbeat (server ms of the last keepalive; `lua/stall_gate.lua`).
    pub fn heartbeat(&self) -> String {
        [self.prefix.as_str(), ":heartbeat"].concat()
    }
    /// The stall gate: set while Redis itself stalled, so reclaims wait
    /// (`lua/stall_gate.lua`).
    pub fn stalled(&self) -> String {
        [self.prefix.as_str(), ":stalled"].concat()
    }
    /// What the workers' key checks found at start (hash: provider -> JSON).
    pub fn key_check(&self) -> String {
        [self.prefix.as_str(), ":keycheck"].concat()
    }
    /// Spend of one UTC day or month per model (hash: model -> picodollars); `period` as
    /// [`crate::cost::spend_periods`] names it.
    pub fn spend(&self, period: &str) -> String {
        [self.prefix.as_str(), ":spend:", period].concat()
    }
    /// A tenant's places in a pool under `pools.<p>.max_per_tenant` (sorted set: lease
    /// member -> expiry, server ms; see `lua/tenant_admit.lua`).
    pub fn tenant_holders(&self, pool: &str, tenant: &str) -> String {
        [self.prefix.as_str(), ":tenant:", pool, ":", tenant].concat()
    }
    /// A tenant's jobs parked while it had no free place in the pool (a stream; entries
    /// verbatim, moved back to the jobs stream as places free).
    pub fn parked(&self, pool: &str, tenant: &str) -> String {
        [self.prefix.as_str(), ":parked:", pool, ":", tenant].concat()
    }
    /// Index of the parked streams (hash: `<pool>:<tenant>` -> 1). Pool names hold no ':'
    /// when a pool has `max_per_tenant` (checked by the config), so the field splits at
    /// its first ':'.
    pub fn parked_index(&self) -> String {
        [self.prefix.as_str(), ":parked"].concat()
    }
    /// Jobs paused by budget `name` for `who` (`*` or `t=<tenant>`, as its windows), when
    /// the budget covers only some jobs: a stream, like a tenant's parked stream.
    pub fn budget_parked(&self, name: &str, who: &str) -> String {
        [self.prefix.as_str(), ":bparked:", name, ":", who].concat()
    }
    /// Index of the budget parked streams (hash: stream key -> JSON
    /// `{"budget", "who", "need"}`, see `lua/budget_unpark.lua`).
    pub fn budget_parked_index(&self) -> String {
        [self.prefix.as_str(), ":bparked"].concat()
    }
    /// The tenant holder clocks (hash: `<pool>:<tenant>` -> server ms of the last tenant
    /// script; see `lua/tenant_clock.lua`).
    pub fn tenant_clock(&self) -> String {
        [self.prefix.as_str(), ":tenantclock"].concat()
    }
    /// The fleet's once-a-second tenant sweep lock (one worker sweeps each second).
    pub fn tenant_sweep(&self) -> String {
        [self.prefix.as_str(), ":tenantsweep"].concat()
    }
}

/// The group's lag for the gauge: Redis's `lag`, or, where Redis cannot tell (it answers
/// nil once an entry between the last delivered and the stream's end was deleted, which
/// `delete_acked` does all the time), the stream's length less the pending entries
/// (with `delete_acked` the stream holds only those two kinds). `None`: unknown.
pub fn lag_or_estimate(
    lag: Option<u64>,
    len: u64,
    pending: Option<u64>,
    delete_acked: bool,
) -> Option<u64> {
    match (lag, pending) {
        (Some(l), _) => Some(l),
        (None, Some(p)) if delete_acked => Some(len.saturating_sub(p)),
        _ => None,
    }
}

/// Where a job asks for a place under its tenant's cap ([`Queue::admit_tenant`]).
#[derive(Debug, Clone)]
pub struct TenantPlace<'a> {
    pub pool: &'a str,
    pub tenant: &'a str,
    /// The lease's member in the holder set (unique per lease).
    pub member: &'a str,
    pub cap: u32,
    pub ttl_ms: u64,
    /// A pause of the holder clock longer than this is a Redis stall (ttl / 2).
    pub gap_ms: u64,
    /// How long a kept place lasts while its entry is no longer in the stream.
    pub transit_ms: u64,
}

/// What [`Queue::admit_tenant`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantAdmit {
    /// The job holds a place now (renew it while it runs, release it after).
    Admitted,
    /// No place: the entry moved to the tenant's parked stream (this new id there),
    /// acknowledged and deleted here; it comes back when a place frees.
    Parked(String),
    /// Not pending under this consumer any more: nothing done.
    NotOurs,
    /// Deleted from the stream while pending: acknowledged.
    Deleted,
}

/// What [`Queue::park_budget`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Park {
    /// Moved to the budget's parked stream (this new id there), acknowledged here.
    Parked(String),
    /// Not pending under this consumer any more: nothing done.
    NotOurs,
    /// Deleted from the stream while pending: acknowledged.
    Deleted,
}

/// One job entry as read from the stream.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub entry_id: String,
    /// The `payload` field, raw bytes (kept verbatim for dead letters), if present.
    pub payload: Option<Vec<u8>>,
    /// Names of fields other than `payload` (reported, not fatal).
    pub extra_fields: Vec<String>,
    /// Every field of the entry, names and values verbatim as bytes, in stream order
    /// (a repeated name repeated), except the hand-back's own bookkeeping fields
    /// ([`HANDED_BACK_DELIVERIES`], [`HANDED_BACK_ENTRY`], [`HANDED_BACK_BILLED`]); a
    /// [`PACKED_FIELDS`] field (a wide entry handed back) is unpacked into the fields it
    /// holds. Copied into a dead letter, so bad input never loses what the producer wrote.
    pub fields: Vec<Field>,
    /// Why the entry is bad input whatever its payload says (a field name that is not
    /// UTF-8): the worker dead-letters it without reading the payload.
    pub malformed: Option<String>,
    /// How many times this entry has been delivered (1 for a fresh read), plus the
    /// deliveries a hand-back carried over.
    pub deliveries: u64,
    /// What earlier deliveries of the job spent on provider calls, carried by a hand-back
    /// ([`HANDED_BACK_BILLED`], the worker's own encoding): the final result and the cost
    /// totals include it.
    pub billed: Option<Vec<u8>>,
    /// The entry id the job was first pushed as, if this entry is a hand-back of it
    /// (field `_entry`): the job id of a payload without `id`, so it stays the same.
    pub first_entry: Option<String>,
    /// Taken over from another consumer (or from this one) by [`Queue::reclaim`].
    pub reclaimed: bool,
    /// `<pool>:<tenant>` when the entry was moved back from a tenant's parked stream
    /// (field [`TENANT_UNPARKED`]): a place is kept for it, which the worker gives back if
    /// the job ends without taking it.
    pub unparked: Option<String>,
    /// The reader's check of this entry's cancel marker (a job without an `id` has no id
    /// claim that would), sent and not waited for (see [`CancelCheck`]); its task waits
    /// for it before any call. `None`: the reader sent none (its task reads the marker
    /// itself if it turns out to have no id).
    pub cancel_check: Option<CancelCheck>,
}

/// The answer of a batch's cancel check: one flag per entry asked, in order; `None` when
/// the check failed or took too long (the entries count as unchecked).
pub type CancelFlags = Option<Arc<[bool]>>;

/// One entry's place in a cancel check that was sent for a batch of entries and not
/// waited for by the reader: the round trip runs beside the reader's next read, and each
/// entry's task waits for its flag before its call (an entry read ahead mostly waits for
/// a job permit meanwhile anyway).
///
/// Invariant: [`CancelCheck::wait`] answers `Some(flag)` only with the flag Redis gave
/// for this very entry; anything else (an error, a timeout, the sender gone) is `None`,
/// i.e. unchecked, and the task reads the marker itself before any call.
#[derive(Debug, Clone)]
pub struct CancelCheck {
    answer: tokio::sync::watch::Receiver<Option<CancelFlags>>,
    at: usize,
}

impl CancelCheck {
    /// The entry at position `at` of the batch whose answer comes on `answer`.
    pub fn new(answer: tokio::sync::watch::Receiver<Option<CancelFlags>>, at: usize) -> Self {
        CancelCheck { answer, at }
    }

    /// Waits for the batch's answer: `Some(found)`, or `None` when the entry went
    /// unchecked (see the invariant). Unbounded here: the sender's own round trip is
    /// bounded, and a dropped sender ends the wait.
    pub async fn wait(&self) -> Option<bool> {
        let mut rx = self.answer.clone();
        let v = rx.wait_for(Option::is_some).await.ok()?;
        let flags = v.as_ref()?.as_ref()?;
        flags.get(self.at).copied()
    }
}

/// The longest part of a bad field name a `malformed` reason quotes.
const QUOTED_NAME_BYTES: usize = 64;

impl Delivery {
    /// A delivery of entry `entry_id` with `fields` as Redis returned them (see
    /// [`reply`]): every entry of a reply becomes one, whatever its fields hold, so one
    /// bad entry never fails the others of its batch. `deliveries`: the entry's delivery
    /// count.
    pub fn from_fields(entry_id: String, fields: Vec<Field>, deliveries: u64) -> Delivery {
        let mut deliveries = deliveries;
        let mut first_entry = None;
        let mut billed = None;
        let mut unparked = None;
        let mut raw = vec![];
        for (k, v) in fields {
            if k == HANDED_BACK_ENTRY.as_bytes() {
                first_entry = String::from_utf8(v).ok();
            } else if k == HANDED_BACK_DELIVERIES.as_bytes() {
                // A hand-back (see `Queue::hand_back`) carries the deliveries so far.
                // Producer-writable: saturating, so u64::MAX cannot overflow.
                deliveries = deliveries.saturating_add(
                    std::str::from_utf8(&v)
                        .ok()
                        .and_then(|s| s.parse::<u64>().ok())
                        .unwrap_or(0),
                );
            } else if k == HANDED_BACK_BILLED.as_bytes() {
                billed = Some(v);
            } else if k == TENANT_UNPARKED.as_bytes() {
                unparked = String::from_utf8(v).ok();
            } else if k == PACKED_FIELDS.as_bytes()
                && let Some(unpacked) = unpack_fields(&v)
            {
                raw.extend(unpacked);
            } else {
                raw.push((k, v));
            }
        }
        let mut payload = None;
        let mut extra = vec![];
        let mut malformed = None;
        for (k, v) in &raw {
            match std::str::from_utf8(k) {
                // A repeated `payload`: the last one, as Redis-side readers of a map see it.
                Ok("payload") => payload = Some(v.clone()),
                Ok(name) => extra.push(name.to_string()),
                Err(_) if malformed.is_none() => {
                    let cut = k.len().min(QUOTED_NAME_BYTES);
                    let more = if cut < k.len() { "..." } else { "" };
                    malformed = Some(format!(
                        "entry field name \"{}{more}\" is not UTF-8 (stream field names must be text)",
                        k[..cut].escape_ascii()
                    ));
                }
                Err(_) => {}
            }
        }
        extra.sort();
        extra.dedup();
        Delivery {
            entry_id,
            payload,
            extra_fields: extra,
            fields: raw,
            malformed,
            deliveries,
            billed,
            first_entry,
            reclaimed: false,
            unparked,
            cancel_check: None,
        }
    }
}

/// What to write when a job is done. Field values are bytes so a dead letter keeps a
/// payload that is not UTF-8 verbatim.
#[derive(Debug, Clone, Default)]
pub struct Commit {
    pub entry_id: String,
    pub result: Vec<(&'static str, Vec<u8>)>,
    /// The dead-letter entry (empty: none). Field names are bytes: a dead letter carries
    /// the original entry's fields under their own names, whatever they are.
    pub dead: Vec<Field>,
    /// `dead` goes to the failed-jobs stream (`{ns}:failed`) instead of `{ns}:dead`: the
    /// copy of a `failed` job kept for a retry, not a dead letter.
    pub dead_is_failed_copy: bool,
    /// The job id whose result marker to set (None: no marker).
    pub dedupe_id: Option<String>,
    /// The job id whose in-progress marker to clear if it is this entry's.
    pub inflight_id: Option<String>,
    /// The result's status, stored in the result marker.
    pub status: String,
    /// (hash field, integer increment) for `{ns}:cost`.
    pub costs: Vec<(String, i64)>,
}

impl Commit {
    /// A commit that writes `result` for `entry_id` and nothing else: no dead letter, no
    /// id markers, no cost totals. Callers add those with struct update syntax.
    pub fn result_only(entry_id: &str, result: ResultEntry) -> Commit {
        Commit {
            entry_id: entry_id.to_string(),
            status: result.status.as_str().to_string(),
            result: result.into_fields(),
            dead: vec![],
            dead_is_failed_copy: false,
            dedupe_id: None,
            inflight_id: None,
            costs: vec![],
        }
    }
}

/// The queue's handle: one `Arc` clone. Each commit sender task takes one
/// ([`Queue::commit_shared`]), so cloning must not copy the key names or the
/// scripts' sources (commit.lua alone is 17 KB: a copy per batch cost a quarter of the
/// worker's `memcpy` at a 200 ms model).
#[derive(Clone)]
pub struct Queue(Arc<QueueInner>);

impl std::ops::Deref for Queue {
    type Target = QueueInner;
    fn deref(&self) -> &QueueInner {
        &self.0
    }
}

/// What a [`Queue`] holds; read through the handle.
pub struct QueueInner {
    pub keys: Keys,
    conn: Commands,
    group: String,
    consumer: String,
    results_maxlen: u64,
    /// `queue.dedupe_ttl_s` in whole seconds (the scripts' EX unit).
    dedupe_ttl_s: u64,
    delete_acked: bool,
    commit_script: &'static redis::Script,
    claim_id_script: &'static redis::Script,
    keepalive_script: &'static redis::Script,
    reclaim_script: &'static redis::Script,
    claim_idle_ms: u64,
    /// Commits waiting to be sent together ([`Queue::commit_shared`]).
    line: Arc<Line<Arc<Commit>, CommitAnswer>>,
    /// Entries already reported as deleted by the producer while we work on them (so the
    /// keepalive logs and counts each once).
    reported_deleted: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// What [`Queue::commit`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitOutcome {
    /// Written now, and the entry acknowledged in the same step.
    Written { result_id: String },
    /// The entry already has a result written by this worker: an earlier try succeeded
    /// but its reply was lost (connection dropped after the script ran). Nothing written.
    AlreadyWritten { result_id: String },
    /// Another worker committed the entry (after taking it over): nothing written.
    Superseded,
}

impl Commit {
    /// Bytes this commit holds in memory (what a held result costs).
    pub fn size(&self) -> usize {
        let r: usize = self.result.iter().map(|(k, v)| k.len() + v.len()).sum();
        let d: usize = self.dead.iter().map(|(k, v)| k.len() + v.len()).sum();
        r + d + self.costs.iter().map(|(k, _)| k.len() + 8).sum::<usize>()
    }
}

/// What one keepalive found ([`Queue::keepalive_report`]).
#[derive(Debug, Default)]
pub struct Heartbeat {
    /// Nobody may reclaim now (a Redis stall just ended).
    pub stalled: bool,
    /// Entries given that are no longer pending under this consumer.
    pub gone: Vec<String>,
    /// Entries given that the producer deleted from the stream (still ours).
    pub deleted: Vec<String>,
    /// Of `gone`, those taken over: pending under another consumer, or settled or moved
    /// by another worker (not pending and without a dropped-entry tombstone).
    pub taken: Vec<String>,
}

/// What the idempotency check says about a job id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdClaim {
    /// Go ahead: this entry now owns the id's in-progress marker.
    Claimed,
    /// The id already has an `ok` result: `(result entry id, status)`.
    Done { result_id: String, status: String },
    /// Another entry with the same id is being worked on now.
    Busy { other_entry: String },
    /// The id has a cancel marker: end `cancelled` without a call.
    Cancelled,
}

/// Entries taken over from stalled consumers.
#[derive(Debug, Default)]
pub struct Reclaimed {
    pub deliveries: Vec<Delivery>,
    /// Entries that were pending but deleted from the stream; already acknowledged.
    pub deleted: Vec<String>,
}

impl Queue {
    pub fn new(cfg: &Config, conn: Commands) -> Queue {
        Queue(Arc::new(QueueInner {
            keys: Keys::new(&cfg.queue.namespace),
            conn,
            group: cfg.queue.group.clone(),
            consumer: cfg.queue.consumer.clone(),
            results_maxlen: cfg.queue.results_maxlen,
            dedupe_ttl_s: cfg.queue.dedupe_ttl_s.as_secs(),
            delete_acked: cfg.queue.delete_acked,
            commit_script: &scripts::COMMIT,
            claim_id_script: &scripts::CLAIM_ID,
            keepalive_script: &scripts::KEEPALIVE,
            reclaim_script: &scripts::RECLAIM,
            claim_idle_ms: u64::try_from(cfg.queue.claim_idle_ms.as_millis()).unwrap_or(u64::MAX),
            line: Arc::new(Line::new(COMMIT_SENDERS)),
            reported_deleted: Default::default(),
        }))
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Creates the consumer group at id 0 with MKSTREAM (jobs pushed before the first
    /// worker started are processed); an existing group is fine.
    pub async fn ensure_group(&self) -> Result<(), QueueError> {
        let mut conn = self.conn.get().await?;
        let r: Result<(), redis::RedisError> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.keys.jobs)
            .arg(&self.group)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Ends the blocking read of connection `client_id` now, as if its BLOCK ran out (no
    /// entry is delivered by an unblocked read). Used at the first signal.
    pub async fn unblock(&self, client_id: i64) -> Result<(), QueueError> {
        let mut conn = self.conn.get().await?;
        let _: i64 = redis::cmd("CLIENT")
            .arg("UNBLOCK")
            .arg(client_id)
            .arg("TIMEOUT")
            .query_async(&mut conn)
            .await?;
        Ok(())
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
        // Read raw (`ReadReply`): one entry the typed reply cannot hold must not fail the
        // batch, nor pass for a Redis outage.
        let fut = cmd.query_async::<ReadReply>(conn);
        let bound = block + Duration::from_secs(2);
        let reply = match tokio::time::timeout(bound, fut).await {
            Ok(r) => r?,
            Err(_) => return Err(QueueError::Timeout(bound)),
        };
        // An entry read as new always has its fields; `None` only in history reads.
        Ok(reply
            .0
            .into_iter()
            .map(|e| Delivery::from_fields(e.id, e.fields.unwrap_or_default(), 1))
            .collect())
    }

    /// Writes the result (and dead letter, marker, costs) and acknowledges the job, in one
    /// script (`lua/commit.lua`): every check that can fail runs before the first write and
    /// the XACK runs last, so an error leaves the job pending with nothing written.
    /// The entry may meanwhile belong to another consumer (taken over while this worker
    /// was cut off): XACK acts on the group, so whoever commits first writes the result.
    ///
    /// Errors: [`QueueError::heals`] tells a passing outage (hold the result, retry) from
    /// a key of the wrong type or a script error (retrying the same commit cannot help;
    /// the message names the key).
    pub async fn commit(&self, c: &Commit) -> Result<CommitOutcome, QueueError> {
        let mut all = self.commit_batch(&[c]).await?;
        // commit_batch answers exactly one reply per job given
        all.pop()
            .unwrap_or_else(|| Err(bad_reply("no job", String::new())))
    }

    /// [`Queue::commit`] for several jobs in one call of `lua/commit.lua`: each job is
    /// committed in a step of its own (checks, then writes, its XACK after them) and
    /// answered on its own, in the order given; the cost totals of the batch are added
    /// with one HINCRBY per field. `Err` is the call's error (nothing answered: some jobs
    /// may be written, and a later try of those is answered `AlreadyWritten`); a job's
    /// own error means nothing was written for it.
    ///
    /// A job's error in a batch of more than one may come from another job's part of
    /// the call (a cost field overflowing only in the sum); the error a job gets alone
    /// ([`Queue::commit`]) is its own.
    pub async fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> Result<Vec<Result<CommitOutcome, QueueError>>, QueueError> {
        let mut inv = crate::scripts::Call::new(self.commit_script);
        let [day, month] = crate::cost::spend_periods(crate::cost::unix_now_ms());
        inv.key(&self.keys.jobs)
            .key(&self.keys.results)
            .key(&self.keys.costs)
            .key(self.keys.dropped())
            .key(self.keys.spend(&day))
            .key(self.keys.spend(&month))
            .arg(&self.group)
            .arg(self.results_maxlen)
            .arg(if self.delete_acked { 1 } else { 0 })
            .arg(&self.consumer);
        for c in commits {
            let letters = if c.dead_is_failed_copy {
                &self.keys.failed
            } else {
                &self.keys.dead
            };
            let ttl = if c.dedupe_id.is_some() {
                self.dedupe_ttl_s
            } else {
                0
            };
            inv.key(letters)
                .key(self.keys.done(c.dedupe_id.as_deref().unwrap_or("")))
                .key(self.keys.inflight(c.inflight_id.as_deref().unwrap_or("")))
                .key(self.keys.handed_back(&c.entry_id))
                .arg(&c.entry_id)
                .arg(ttl)
                .arg(&c.status)
                .arg(if c.inflight_id.is_some() { 1 } else { 0 });
            inv.arg(c.result.len());
            for (k, v) in &c.result {
                inv.arg(*k).arg(v.as_slice());
            }
            inv.arg(c.dead.len());
            for (k, v) in &c.dead {
                inv.arg(k.as_slice()).arg(v.as_slice());
            }
            inv.arg(c.costs.len());
            for (k, v) in &c.costs {
                inv.arg(k).arg(*v);
            }
        }
        let mut conn = self.conn.get().await?;
        let reply = inv.invoke_value(&mut conn).await?;
        let redis::Value::Array(per_job) = reply else {
            return Err(bad_reply(
                "something other than one reply per job",
                format!("{reply:?}"),
            ));
        };
        if per_job.len() != commits.len() {
            return Err(bad_reply(
                "another number of jobs than it was given",
                format!("{} for {}", per_job.len(), commits.len()),
            ));
        }
        Ok(per_job.into_iter().map(commit_outcome).collect())
    }

    /// [`Queue::commit`], sent together with the commits other jobs of this process make
    /// meanwhile: one call of `lua/commit.lua` carries every commit that came while the
    /// previous call ran (at most [`COMMIT_BATCH_MAX`] jobs, about
    /// [`COMMIT_BATCH_BYTES`]; [`COMMIT_SENDERS`] calls on the wire at once), so under
    /// load a job costs a fraction of a script call and of a round trip, and when idle a
    /// commit is sent at once. A job whose part of a batch failed in a way that does not
    /// heal (or whose batch failed with a pool error that cannot be copied to each job) is
    /// sent again alone, so its answer is exactly [`Queue::commit`]'s.
    pub async fn commit_shared(&self, c: Arc<Commit>) -> Result<CommitOutcome, QueueError> {
        let (rx, role) = self.line.join(c.clone());
        if let Some(role) = role {
            // A task of its own: a caller that stops waiting cannot strand the others.
            tokio::spawn(run_commits(self.clone(), role));
        }
        match rx.await {
            Ok(Some(r)) => r,
            // Its part failed in a way that does not heal (or as a pool error that cannot be
            // copied), or the sender stopped: alone.
            Ok(None) | Err(_) => self.commit(&c).await,
        }
    }
}

/// How many calls of `lua/commit.lua` one process has on the wire at once
/// ([`Queue::commit_shared`]): with one, the time to build, send and answer a call
/// capped a process at about 9,000 jobs/s on a 2-core machine while Redis and the
/// worker were half idle; with two, one call is built while the other runs.
pub const COMMIT_SENDERS: usize = 2;
/// Most jobs one call of `lua/commit.lua` carries ([`Queue::commit_shared`]).
pub const COMMIT_BATCH_MAX: usize = 32;
/// A batch takes no further job once its commits hold this many bytes.
pub const COMMIT_BATCH_BYTES: usize = 256 << 10;

/// What [`run_commits`] answers a commit: `None` when the job must be sent alone.
type CommitAnswer = Option<Result<CommitOutcome, QueueError>>;
/// A commit waiting for the next batch of [`run_commits`].
type PendingCommit = Waiting<Arc<Commit>, CommitAnswer>;

/// Sends the waiting commits, a batch per call, until none waits.
/// `role`: a sender's place in the line (should this task end early, a panic or the
/// runtime shutting down, its drop gives it back, and if no other sender is left every
/// waiting job hears back and is sent alone). A caller that stopped waiting (shutdown
/// past its grace) is not committed behind its back: its entry stays pending for another
/// worker.
async fn run_commits(q: Queue, mut role: Role<Arc<Commit>, CommitAnswer>) {
    while let Some(batch) = role.next(take_batch) {
        if batch.len() == 1 {
            if let Some(p) = batch.into_iter().next() {
                let r = q.commit(&p.item).await;
                let _ = p.done.send(Some(r));
            }
            continue;
        }
        metrics::histogram!("llm_worker_commit_batch_jobs").record(batch.len() as f64);
        let refs: Vec<&Commit> = batch.iter().map(|p| &*p.item).collect();
        match q.commit_batch(&refs).await {
            Ok(per_job) => {
                for (p, r) in batch.into_iter().zip(per_job) {
                    let r = match r {
                        Ok(o) => Some(Ok(o)),
                        Err(e) if e.heals() => Some(Err(e)),
                        Err(_) => None,
                    };
                    let _ = p.done.send(r);
                }
            }
            Err(e) => {
                // Heals and can be copied: every job is told (each holds its result and
                // tries again); else (it cannot heal, or a pool error other than the
                // backend's) each is sent alone, so its answer is its own.
                for p in batch {
                    let _ = p.done.send(e.heals().then(|| e.copy()).flatten().map(Err));
                }
            }
        }
    }
}

/// The next batch from `waiting`, in order: at most [`COMMIT_BATCH_MAX`] jobs and about
/// [`COMMIT_BATCH_BYTES`], never two that share an entry or a job id (the second would
/// read markers the first is about to change; commit.lua refuses such a pair anyway, and
/// it waits for the next call).
fn take_batch(waiting: &mut Vec<PendingCommit>) -> Vec<PendingCommit> {
    let mut bytes = 0;
    let mut ids: Vec<&str> = Vec::new();
    let mut picked = Vec::new();
    for (i, p) in waiting.iter().enumerate() {
        let c = &p.item;
        if picked.len() == COMMIT_BATCH_MAX
            || (!picked.is_empty() && bytes + c.size() > COMMIT_BATCH_BYTES)
        {
            break;
        }
        let mine = [
            Some(c.entry_id.as_str()),
            c.dedupe_id.as_deref(),
            c.inflight_id.as_deref(),
        ];
        if mine.iter().flatten().any(|x| ids.contains(x)) {
            continue;
        }
        ids.extend(mine.into_iter().flatten());
        bytes += c.size();
        picked.push(i);
    }
    let mut batch = Vec::with_capacity(picked.len());
    for (n, i) in picked.into_iter().enumerate() {
        batch.push(waiting.remove(i - n));
    }
    batch
}

/// A commit.lua reply of the wrong shape (a worker bug: it does not heal).
fn bad_reply(what: &'static str, detail: String) -> QueueError {
    QueueError::Redis(redis::RedisError::from((
        redis::ErrorKind::Parse,
        what,
        format!("commit.lua answered {what}: {detail}"),
    )))
}

/// One job's part of a commit.lua reply.
fn commit_outcome(v: redis::Value) -> Result<CommitOutcome, QueueError> {
    let parsed: Result<(String, String), redis::RedisError> = match v {
        redis::Value::ServerError(e) => Err(e.into()),
        v => redis::from_redis_value(v).map_err(redis::RedisError::from),
    };
    let (what, result_id) = parsed?;
    Ok(match what.as_str() {
        "written" => CommitOutcome::Written { result_id },
        "had" => CommitOutcome::AlreadyWritten { result_id },
        _ => CommitOutcome::Superseded,
    })
}

impl Queue {
    /// The idempotency check for `job_id` (see `lua/claim_id.lua`).
    pub async fn claim_id(&self, job_id: &str, entry_id: &str) -> Result<IdClaim, QueueError> {
        let mut conn = self.conn.get().await?;
        let (kind, val): (String, String) = crate::scripts::Call::new(self.claim_id_script)
            .key(self.keys.done(job_id))
            .key(self.keys.inflight(job_id))
            .key(self.keys.cancel(job_id))
            .arg(entry_id)
            .arg(self.inflight_ttl_ms())
            .invoke(&mut conn)
            .await?;
        Ok(match kind.as_str() {
            "done" => {
                let rid = val.split_once('|').map_or(val.as_str(), |(r, _)| r);
                let status = marker_status(&val);
                IdClaim::Done {
                    result_id: rid.to_string(),
                    status: status.to_string(),
                }
            }
            "busy" => IdClaim::Busy { other_entry: val },
            "cancelled" => IdClaim::Cancelled,
            _ => IdClaim::Claimed,
        })
    }

    /// What the Redis user may not read and write of the keys a job's path touches: each
    /// item a key family refused on its own (`{llm}:cancel:*`), or families refused
    /// together (`{llm}:jobs + {llm}:results + ... (together, as commit.lua declares
    /// them)`: ACL selectors, Redis 7, that grant them apart); empty when nothing is
    /// refused. Runs `lua/access_probe.lua`, a script that touches nothing, declaring
    /// the keys of each script call and command of a job's path as that call does (Redis
    /// checks declared keys against the ACL, for reading and writing, before running a
    /// script): first with no key (the script itself may run), then every set in one
    /// pipeline, then, for a set refused, each family alone. `more`: further sets (the
    /// slots' keys of each pool, the cooldowns), as (label, [(a key, its pattern)]).
    ///
    /// `Err`: Redis did not answer, or refused the script itself (NOPERM for EVALSHA),
    /// which is the caller's to judge.
    pub async fn refused_key_families(
        &self,
        more: &[(String, Vec<(String, String)>)],
    ) -> Result<Vec<String>, QueueError> {
        const PROBE: &str = "access-probe";
        let [day, month] = crate::cost::spend_periods(crate::cost::unix_now_ms());
        let k = &self.keys;
        let same = |key: String| (key.clone(), key);
        let commit = |letters: &str| {
            vec![
                same(k.jobs.clone()),
                same(k.results.clone()),
                same(k.costs.clone()),
                same(k.dropped()),
                (k.spend(&day), k.spend("*")),
                (k.spend(&month), k.spend("*")),
                same(letters.to_string()),
                (k.done(PROBE), k.done("*")),
                (k.inflight(PROBE), k.inflight("*")),
                (k.handed_back(PROBE), k.handed_back("*")),
            ]
        };
        let mut sets: Vec<(String, Vec<(String, String)>)> = vec![
            ("commit.lua".into(), commit(&k.dead)),
            ("commit.lua, failed jobs".into(), commit(&k.failed)),
            (
                "keepalive.lua".into(),
                vec![
                    same(k.jobs.clone()),
                    same(k.heartbeat()),
                    same(k.stalled()),
                    same(k.dropped()),
                    (k.inflight(PROBE), k.inflight("*")),
                ],
            ),
            (
                "claim_id.lua".into(),
                vec![
                    (k.done(PROBE), k.done("*")),
                    (k.inflight(PROBE), k.inflight("*")),
                    (k.cancel(PROBE), k.cancel("*")),
                ],
            ),
            (
                "handback.lua".into(),
                vec![
                    same(k.jobs.clone()),
                    (k.inflight(PROBE), k.inflight("*")),
                    (k.handed_back(PROBE), k.handed_back("*")),
                ],
            ),
            (
                "the cost cap's counter".into(),
                vec![(k.cap_spent(PROBE), k.cap_spent("*"))],
            ),
        ];
        sets.extend(more.iter().cloned());
        // The probe's EVALSHA declaring `keys` (sent as a plain command: the keyless call
        // below has loaded the script).
        let evalsha = |keys: &mut dyn Iterator<Item = &String>| {
            let mut call = crate::scripts::Call::new(&scripts::ACCESS_PROBE);
            for key in keys {
                call.key(key);
            }
            call.command()
        };
        let mut conn = self.conn.get().await?;
        // No key: may this user run the script at all (and it is loaded from here on)?
        crate::scripts::Call::new(&scripts::ACCESS_PROBE)
            .invoke_value(&mut conn)
            .await?;
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for (_, set) in &sets {
            pipe.add_command(evalsha(&mut set.iter().map(|(key, _)| key)));
        }
        let answers: Vec<redis::RedisResult<redis::Value>> = pipe.query_async(&mut conn).await?;
        let mut refused: Vec<String> = vec![];
        for ((label, set), answer) in sets.iter().zip(answers) {
            match answer.and_then(|v| v.extract_error()) {
                Ok(_) => continue,
                Err(e) if e.code() == Some("NOPERM") => {}
                Err(e) => return Err(e.into()),
            }
            let mut alone = vec![];
            for (key, pattern) in set {
                let r: redis::RedisResult<redis::Value> = evalsha(&mut std::iter::once(key))
                    .query_async(&mut conn)
                    .await;
                match r {
                    Ok(_) => {}
                    Err(e) if e.code() == Some("NOPERM") => {
                        if !alone.contains(pattern) {
                            alone.push(pattern.clone());
                        }
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if alone.is_empty() {
                let mut all: Vec<&str> = set.iter().map(|(_, p)| p.as_str()).collect();
                all.dedup();
                alone.push(format!(
                    "{} (together, as {label} declares them: one ACL selector must grant them all)",
                    all.join(" + ")
                ));
            }
            for a in alone {
                if !refused.contains(&a) {
                    refused.push(a);
                }
            }
        }
        Ok(refused)
    }

    /// For each job id, whether it has a cancel marker (`{ns}:cancel:<id>`, a string as
    /// `cancel` and the README's `SET` write it): one command for the whole batch.
    pub async fn cancelled(&self, job_ids: &[&str]) -> Result<Vec<bool>, QueueError> {
        if job_ids.is_empty() {
            return Ok(vec![]);
        }
        // One MGET for the batch (one command, not one per id): every key shares the
        // namespace's hash tag, so this also holds on Redis Cluster. A marker is a string
        // (`SET ... EX`); a key of another type reads as nil, i.e. not cancelled.
        let mut cmd = redis::cmd("MGET");
        for id in job_ids {
            cmd.arg(self.keys.cancel(id));
        }
        let mut conn = self.conn.get().await?;
        let found: Vec<Option<Vec<u8>>> = cmd.query_async(&mut conn).await?;
        Ok(found.into_iter().map(|v| v.is_some()).collect())
    }

    /// Resets the idle time of entries this consumer is still working on, and extends
    /// their ids' in-progress markers (`lua/keepalive.lua`). Returns the entries no longer
    /// ours. Called with no entries too: every call is also the fleet's heartbeat that
    /// lets [`Queue::reclaim`] tell a Redis stall from stalled workers.
    ///
    /// Entries the producer deleted from the stream (XDEL, MAXLEN) are skipped (an XCLAIM
    /// would drop them from the pending list on Redis 7), logged and counted once each
    /// (`llm_worker_jobs_deleted_in_flight_total`); their result is still committed.
    pub async fn keepalive(&self, entries: &[(String, String)]) -> Result<Vec<String>, QueueError> {
        Ok(self.keepalive_report(entries).await?.gone)
    }

    /// [`Queue::keepalive`], with which of the entries no longer ours were taken over
    /// (`taken`: pending under another consumer, or settled or moved by another worker;
    /// the others were dropped from the pending list after the producer deleted them,
    /// and this worker's result still goes in through their tombstone).
    pub async fn keepalive_report(
        &self,
        entries: &[(String, String)],
    ) -> Result<Heartbeat, QueueError> {
        let hb = self.heartbeat(entries).await?;
        let mut reported = self
            .reported_deleted
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        reported.retain(|e| entries.iter().any(|(x, _)| x == e));
        for e in &hb.deleted {
            if reported.insert(e.clone()) {
                tracing::warn!(entry = %e, "job entry was deleted from the stream by the producer while running; not kept alive, its result is still written");
                metrics::counter!("llm_worker_jobs_deleted_in_flight_total").increment(1);
            }
        }
        drop(reported);
        Ok(hb)
    }

    /// One call of `lua/keepalive.lua`.
    async fn heartbeat(&self, entries: &[(String, String)]) -> Result<Heartbeat, QueueError> {
        let mut inv = crate::scripts::Call::new(self.keepalive_script);
        inv.key(&self.keys.jobs)
            .key(self.keys.heartbeat())
            .key(self.keys.stalled())
            .key(self.keys.dropped());
        for (_, job_id) in entries {
            inv.key(self.keys.inflight(job_id));
        }
        inv.arg(&self.group)
            .arg(&self.consumer)
            .arg(self.claim_idle_ms)
            .arg(self.stall_gap_ms())
            .arg(self.inflight_ttl_ms());
        for (entry, job_id) in entries {
            inv.arg(entry)
                .arg(if job_id.is_empty() { "0" } else { "1" });
        }
        let mut conn = self.conn.get().await?;
        let (stalled, gone, deleted, taken): (i64, Vec<String>, Vec<String>, Vec<String>) =
            inv.invoke(&mut conn).await?;
        Ok(Heartbeat {
            stalled: stalled == 1,
            gone,
            deleted,
            taken,
        })
    }

    /// The in-progress marker's TTL: three times `claim_idle_ms`, extended by each
    /// keepalive (every third of it). A marker lapses only after its worker is gone for
    /// that long, or after a Redis stall of over 2.6 x `claim_idle_ms` (Redis expires keys
    /// by its wall clock): a copy of the id read then would be claimed and called too.
    /// Its own entry, reclaimed, always takes its marker over, so a longer TTL only makes a
    /// *copy* of an id whose worker died wait longer.
    fn inflight_ttl_ms(&self) -> u64 {
        self.claim_idle_ms.saturating_mul(3)
    }

    /// The stall gate's heartbeat gap: claim_idle_ms minus more than the keepalive period
    /// (claim_idle_ms / 3) and its round trip, or an entry could be idle past
    /// claim_idle_ms after a stall the gate let through.
    fn stall_gap_ms(&self) -> u64 {
        self.claim_idle_ms / 2
    }

    /// How long a dropped-entry tombstone lives: it outlives any held result (a day, or
    /// the result marker's ttl if longer), like the hand-back tombstone.
    fn tombstone_ttl_s(&self) -> u64 {
        self.dedupe_ttl_s.max(86_400)
    }

    /// Takes over up to `count` entries pending longer than `queue.claim_idle_ms`, with
    /// their delivery counts: `lua/reclaim.lua`, one XAUTOCLAIM per call, the cursor
    /// followed to the end or until `count` are claimed. Each call checks the stall gate
    /// in the same atomic step: when Redis did not answer anyone for longer than
    /// `claim_idle_ms / 2`, entries look idle, though their workers may be alive and
    /// holding paid results; they get `claim_idle_ms` from the moment Redis answers again
    /// to keep them or commit them, and nothing is taken over meanwhile (also not by an
    /// XAUTOCLAIM that was queued behind the stall).
    ///
    /// Entries deleted from the stream while pending are dropped from the pending list
    /// (by XAUTOCLAIM itself) and get a tombstone ([`Keys::dropped`]), so a worker still
    /// running one writes its result.
    pub async fn reclaim(&self, count: usize) -> Result<Reclaimed, QueueError> {
        let mut out = Reclaimed::default();
        #[cfg(debug_assertions)]
        debug_hooks::reclaim_pause().await;
        let mut conn = self.conn.get().await?;
        let mut cursor = "0-0".to_string();
        while out.deliveries.len() < count {
            // Raw (`AutoClaimReply`): one entry the typed reply cannot hold must not fail
            // every reclaim from now on.
            let (stalled, reply, counts): (i64, AutoClaimReply, Vec<u64>) =
                crate::scripts::Call::new(self.reclaim_script)
                    .key(&self.keys.jobs)
                    .key(self.keys.heartbeat())
                    .key(self.keys.stalled())
                    .key(self.keys.dropped())
                    .arg(&self.group)
                    .arg(&self.consumer)
                    .arg(self.claim_idle_ms)
                    .arg(self.stall_gap_ms())
                    .arg(&cursor)
                    .arg(count - out.deliveries.len())
                    .arg(self.tombstone_ttl_s() * 1000)
                    .invoke(&mut conn)
                    .await?;
            if stalled == 1 {
                tracing::info!(
                    "Redis did not answer for longer than queue.claim_idle_ms; not taking over jobs for that long, so their workers can keep or commit them"
                );
                break;
            }
            out.deleted.extend(reply.deleted);
            for (e, n) in reply.claimed.into_iter().zip(counts) {
                match e.fields {
                    Some(fields) => {
                        let mut d = Delivery::from_fields(e.id, fields, n);
                        d.reclaimed = true;
                        out.deliveries.push(d);
                    }
                    // Redis 6.2 lists an entry deleted while pending among the claimed,
                    // without its fields.
                    None => out.deleted.push(e.id),
                }
            }
            cursor = reply.next;
            if cursor == "0-0" {
                break;
            }
        }
        Ok(out)
    }

    /// True when `entry_id` is still pending under this consumer (one XPENDING): checked
    /// before a redelivered job without a producer id calls a model, since nothing else
    /// (no id marker) would stop a second paid call for an entry committed meanwhile.
    pub async fn still_ours(&self, entry_id: &str) -> Result<bool, QueueError> {
        let mut conn = self.conn.get().await?;
        let p: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(&self.keys.jobs)
            .arg(&self.group)
            .arg(entry_id)
            .arg(entry_id)
            .arg(1)
            .query_async(&mut conn)
            .await?;
        Ok(p.first().is_some_and(|(_, c, _, _)| *c == self.consumer))
    }

    /// Adds `picos` (negative: a correction) to what entry `entry_id`'s deliveries have
    /// spent against its `max_cost_usd` ([`Keys::cap_spent`]), and keeps the record for
    /// [`CAP_SPENT_TTL`]. Atomic (MULTI), so the record never lacks its expiry.
    pub async fn cap_spent_add(&self, entry_id: &str, picos: i64) -> Result<(), QueueError> {
        let key = self.keys.cap_spent(entry_id);
        let mut conn = self.conn.get().await?;
        redis::pipe()
            .atomic()
            .cmd("INCRBY")
            .arg(&key)
            .arg(picos)
            .ignore()
            .cmd("PEXPIRE")
            .arg(&key)
            .arg(CAP_SPENT_TTL.as_millis() as u64)
            .ignore()
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// What earlier deliveries of `entry_id` recorded ([`Queue::cap_spent_add`]), in
    /// pico-dollars; 0 when none did.
    pub async fn cap_spent_get(&self, entry_id: &str) -> Result<i64, QueueError> {
        let mut conn = self.conn.get().await?;
        let v: Option<i64> = redis::cmd("GET")
            .arg(self.keys.cap_spent(entry_id))
            .query_async(&mut conn)
            .await?;
        Ok(v.unwrap_or(0).max(0))
    }

    /// Drops the record of [`Queue::cap_spent_add`] once the entry has its result (or was
    /// handed on as a new entry, which carries its bill itself).
    pub async fn cap_spent_drop(&self, entry_id: &str) -> Result<(), QueueError> {
        let mut conn = self.conn.get().await?;
        redis::cmd("DEL")
            .arg(self.keys.cap_spent(entry_id))
            .query_async::<()>(&mut conn)
            .await?;
        Ok(())
    }

    /// One result entry's fields, if it is still in the results stream.
    pub async fn result_fields(
        &self,
        result_id: &str,
    ) -> Result<Option<Vec<(String, Vec<u8>)>>, QueueError> {
        let mut conn = self.conn.get().await?;
        // Raw (`Entries`): a field name that is not UTF-8 (some other writer) is read
        // lossily instead of failing the read.
        let r: Entries = redis::cmd("XRANGE")
            .arg(&self.keys.results)
            .arg(result_id)
            .arg(result_id)
            .query_async(&mut conn)
            .await?;
        Ok(r.0.into_iter().next().map(|e| {
            e.fields
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (String::from_utf8_lossy(&k).into_owned(), v))
                .collect()
        }))
    }
}

/// Field a handed-back entry carries: how many deliveries of the job count so far (a
/// delivery handed back before its first provider call started does not). The reader
/// adds it to the entry's own delivery count, so `queue.max_deliveries` counts every
/// worker that called a model for the job and stopped, but not rolling restarts that
/// hand back a job still waiting for a slot.
pub const HANDED_BACK_DELIVERIES: &str = "_deliveries";
/// Field a handed-back entry carries: the entry id the job was first pushed as.
pub const HANDED_BACK_ENTRY: &str = "_entry";
/// Field of an entry moved back from a tenant's parked stream (`lua/tenant_release.lua`):
/// `<pool>:<tenant>` whose kept place `u:<entry id>` waits for it.
pub const TENANT_UNPARKED: &str = "_unparked";
/// Field a handed-back entry carries when earlier deliveries made provider calls: their
/// attempts, models tried, usage and cost (the worker's JSON), so the final result and
/// the cost totals count each paid call exactly once.
pub const HANDED_BACK_BILLED: &str = "_billed";

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
    /// (`lua/handback.lua`), a new entry with every original field verbatim (more than
    /// [`MAX_VERBATIM_FIELDS`]: packed into [`PACKED_FIELDS`]) plus
    /// [`HANDED_BACK_DELIVERIES`] = `deliveries` (the deliveries that count so far),
    /// [`HANDED_BACK_ENTRY`] and, when given, [`HANDED_BACK_BILLED`] = `billed`; the XACK
    /// (+XDEL) of the old one, and the release of the job id's in-progress marker if it is
    /// this entry's (so the new entry can claim the id). Only if the old entry is still
    /// pending under this consumer.
    pub async fn hand_back(
        &self,
        entry_id: &str,
        job_id: Option<&str>,
        deliveries: u64,
        billed: Option<&[u8]>,
    ) -> Result<HandBack, QueueError> {
        let inv = self.move_invocation(
            &scripts::HAND_BACK,
            entry_id,
            job_id,
            deliveries,
            billed,
            &[],
        );
        let mut conn = self.conn.get().await?;
        let (kind, id): (String, String) = inv.invoke(&mut conn).await?;
        Ok(match kind.as_str() {
            "moved" => HandBack::Moved(id),
            "deleted" => HandBack::Deleted,
            _ => HandBack::NotOurs,
        })
    }

    /// The invocation of a script that runs `lua/move_entry.lua` on `entry_id`: KEYS[1..3]
    /// (jobs, the id's in-progress marker, the entry's tombstone) then `more_keys`;
    /// ARGV[1..8] as `handback.lua` documents them.
    fn move_invocation<'s>(
        &self,
        script: &'s redis::Script,
        entry_id: &str,
        job_id: Option<&str>,
        deliveries: u64,
        billed: Option<&[u8]>,
        more_keys: &[String],
    ) -> crate::scripts::Call<'s> {
        let mut inv = crate::scripts::Call::new(script);
        inv.key(&self.keys.jobs)
            .key(self.keys.inflight(job_id.unwrap_or("")))
            .key(self.keys.handed_back(entry_id));
        for k in more_keys {
            inv.key(k);
        }
        inv.arg(&self.group)
            .arg(&self.consumer)
            .arg(entry_id)
            .arg(deliveries)
            .arg(if self.delete_acked { 1 } else { 0 })
            .arg(self.tombstone_ttl_s())
            .arg(billed.unwrap_or_default())
            .arg(MAX_VERBATIM_FIELDS);
        inv
    }

    /// A place for `entry_id`'s job under its tenant's cap in a pool, or, with none free,
    /// the job parked in one step (`lua/tenant_admit.lua`): moved like a hand-back (same
    /// fields, `deliveries`, `billed`, marker release, tombstone) but to the tenant's parked
    /// stream, so it holds neither a slot nor a job permit while it waits and does not
    /// hold up other tenants' jobs behind it.
    pub async fn admit_tenant(
        &self,
        entry_id: &str,
        job_id: Option<&str>,
        deliveries: u64,
        billed: Option<&[u8]>,
        place: &TenantPlace<'_>,
    ) -> Result<TenantAdmit, QueueError> {
        let keys = [
            self.keys.tenant_holders(place.pool, place.tenant),
            self.keys.parked(place.pool, place.tenant),
            self.keys.parked_index(),
            self.keys.tenant_clock(),
        ];
        let mut inv = self.move_invocation(
            &scripts::TENANT_ADMIT,
            entry_id,
            job_id,
            deliveries,
            billed,
            &keys,
        );
        inv.arg(place.member)
            .arg(place.cap)
            .arg(place.ttl_ms)
            .arg(format!("{}:{}", place.pool, place.tenant))
            .arg(place.gap_ms)
            .arg(place.transit_ms);
        let mut conn = self.conn.get().await?;
        let (kind, id): (String, String) = inv.invoke(&mut conn).await?;
        Ok(match kind.as_str() {
            "admitted" => TenantAdmit::Admitted,
            "parked" => TenantAdmit::Parked(id),
            "deleted" => TenantAdmit::Deleted,
            _ => TenantAdmit::NotOurs,
        })
    }

    /// Parks `entry_id`'s job, paused by a budget that covers only some jobs, in one step
    /// (`lua/budget_park.lua`): moved like a hand-back (same fields, `deliveries`,
    /// `billed`, marker release, tombstone) to the budget's parked `stream`, recorded in
    /// the index with `at` (see `lua/budget_park.lua`).
    pub async fn park_budget(
        &self,
        entry_id: &str,
        job_id: Option<&str>,
        deliveries: u64,
        billed: Option<&[u8]>,
        at: &crate::budget::ParkAt,
    ) -> Result<Park, QueueError> {
        let stream = self.keys.budget_parked(&at.budget, &at.who);
        let keys = [stream.to_string(), self.keys.budget_parked_index()];
        let mut inv = self.move_invocation(
            &scripts::BUDGET_PARK,
            entry_id,
            job_id,
            deliveries,
            billed,
            &keys,
        );
        inv.arg(&stream)
            .arg(serde_json::to_string(at).unwrap_or_default())
            .arg(at.need.max(0));
        let mut conn = self.conn.get().await?;
        let (kind, id): (String, String) = inv.invoke(&mut conn).await?;
        Ok(match kind.as_str() {
            "parked" => Park::Parked(id),
            "deleted" => Park::Deleted,
            _ => Park::NotOurs,
        })
    }

    /// Moves back to the jobs stream's tail as many of `stream`'s parked jobs as its
    /// budget's `windows` (key, limit in pico-dollars) have room for, at most `max`
    /// (`lua/budget_unpark.lua`; no windows: up to `max` regardless). Returns how many.
    pub async fn unpark_budget(
        &self,
        stream: &str,
        windows: &[(String, i64)],
        max: u64,
    ) -> Result<u64, QueueError> {
        let mut inv = crate::scripts::Call::new(&scripts::BUDGET_UNPARK);
        inv.key(&self.keys.jobs)
            .key(stream)
            .key(self.keys.budget_parked_index());
        for (k, _) in windows {
            inv.key(k);
        }
        inv.arg(stream).arg(max);
        for (_, limit) in windows {
            inv.arg(*limit);
        }
        let mut conn = self.conn.get().await?;
        let moved: u64 = inv.invoke(&mut conn).await?;
        Ok(moved)
    }

    /// The budget parked streams, each with its budget as last parked (`HGETALL` of the
    /// index); `None` for an index entry that cannot be read.
    pub async fn budget_parked(
        &self,
    ) -> Result<Vec<(String, Option<crate::budget::ParkAt>)>, QueueError> {
        let mut conn = self.conn.get().await?;
        let all: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(self.keys.budget_parked_index())
            .query_async(&mut conn)
            .await?;
        Ok(all
            .into_iter()
            .map(|(stream, v)| (stream, crate::budget::ParkAt::from_index(&v)))
            .collect())
    }

    /// The queue's gauges for /metrics (one pipeline: XLEN of the jobs and dead streams,
    /// XINFO GROUPS): queue length, the group's lag and pending entries, dead letters.
    /// A missing stream or group leaves its gauges as they were.
    pub async fn sample_gauges(&self) -> Result<(), QueueError> {
        let mut conn = self.conn.get().await?;
        let (len, dead, groups): (u64, u64, redis::Value) = redis::pipe()
            .cmd("XLEN")
            .arg(&self.keys.jobs)
            .cmd("XLEN")
            .arg(&self.keys.dead)
            .cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.keys.jobs)
            .query_async(&mut conn)
            .await
            .or_else(|e| {
                // no stream yet: XINFO fails; the lengths are 0
                if e.code() == Some("ERR") {
                    Ok((0, 0, redis::Value::Nil))
                } else {
                    Err(e)
                }
            })?;
        metrics::gauge!("llm_worker_queue_length").set(len as f64);
        metrics::gauge!("llm_worker_dead_letters").set(dead as f64);
        if let redis::Value::Array(gs) = groups {
            for g in gs {
                let m = reply::flat_map(g);
                if m.get("name").map(String::as_str) != Some(self.group.as_str()) {
                    continue;
                }
                let pending = m.get("pending").and_then(|v| v.parse::<u64>().ok());
                let lag = m.get("lag").and_then(|v| v.parse::<u64>().ok());
                if let Some(p) = pending {
                    metrics::gauge!("llm_worker_group_pending").set(p as f64);
                }
                if let Some(lag) = lag_or_estimate(lag, len, pending, self.delete_acked) {
                    metrics::gauge!("llm_worker_group_lag").set(lag as f64);
                }
            }
        }
        Ok(())
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
        let script = &*scripts::CONSUMERS;
        let mut inv = crate::scripts::Call::new(script);
        inv.key(&self.keys.jobs)
            .arg(&self.group)
            .arg(if idle.is_some() { "idle" } else { "self" })
            .arg(&self.consumer)
            .arg(idle.map(|d| d.as_millis() as u64).unwrap_or(0));
        let mut conn = self.conn.get().await?;
        Ok(inv.invoke(&mut conn).await?)
    }
}

/// Fault injection for the integration tests, compiled into debug builds only.
/// `LLM_WORKER_DEBUG_RECLAIM_PAUSE_MS=<ms>`: the first reclaim of this process waits that
/// long right before its XAUTOCLAIM (`lua/reclaim.lua`) is sent, as a command queued
/// behind a Redis stall.
#[cfg(debug_assertions)]
mod debug_hooks {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    static FIRED: AtomicBool = AtomicBool::new(false);

    pub(super) async fn reclaim_pause() {
        let Some(ms) = std::env::var("LLM_WORKER_DEBUG_RECLAIM_PAUSE_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        else {
            return;
        };
        if FIRED.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::warn!(ms, "debug hook: pausing before the reclaim's XAUTOCLAIM");
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_handle_is_one_pointer() {
        // Each commit batch's sender task takes a clone: it must copy neither the key
        // names nor a script's source (commit.lua is 17 KB).
        assert_eq!(std::mem::size_of::<Queue>(), std::mem::size_of::<usize>());
        assert!(
            scripts::COMMIT.get_hash().len() == 40
                && include_str!("../../lua/commit.lua").len() > 10_000
        );
    }

    #[test]
    fn key_names_are_the_contracts() {
        // CONTRACT.md and README's key list: built by `[..].concat()`, not `format!`; the same
        // names byte for byte, hash tag included, whatever the id holds.
        let k = Keys::new("llm");
        assert_eq!(k.done("a:b"), "{llm}:done:a:b");
        assert_eq!(k.cancel("x y"), "{llm}:cancel:x y");
        assert_eq!(k.inflight(""), "{llm}:inflight:");
        assert_eq!(k.cap_spent("1-0"), "{llm}:capspent:1-0");
        assert_eq!(k.handed_back("1-0"), "{llm}:handedback:1-0");
        assert_eq!(k.dropped(), "{llm}:dropped");
        assert_eq!(k.key_check(), "{llm}:keycheck");
        assert_eq!(k.spend("d:2026-12-06"), "{llm}:spend:d:2026-12-06");
        assert_eq!(k.tenant_holders("p", "t"), "{llm}:tenant:p:t");
        assert_eq!(k.parked("p", "t"), "{llm}:parked:p:t");
        assert_eq!(k.parked_index(), "{llm}:parked");
        assert_eq!(k.budget_parked("b", "*"), "{llm}:bparked:b:*");
        assert_eq!(k.budget_parked_index(), "{llm}:bparked");
        assert_eq!(k.tenant_clock(), "{llm}:tenantclock");
        assert_eq!(k.tenant_sweep(), "{llm}:tenantsweep");
    }

    #[test]
    fn a_commit_refused_by_a_passing_server_state_heals() {
        // What a job's part of a commit.lua reply says when Redis refuses the script's
        // first write: a state that passes (memory, replicas, a failed save) holds the
        // result for a retry; only what needs someone to act makes a minimal failed one.
        let part = |resp: &str| commit_outcome(redis::parse_redis_value(resp.as_bytes()).unwrap());
        for code in [
            "-OOM command not allowed when used memory > 'maxmemory'.\r\n",
            "-NOREPLICAS Not enough good replicas to write.\r\n",
            "-MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.\r\n",
            "-READONLY You can't write against a read only replica.\r\n",
        ] {
            let e = part(code).expect_err(code);
            assert!(e.heals(), "{code}: {e}");
        }
        let e = part("-WRONGTYPE {llm}:results is a hash, not a stream\r\n").unwrap_err();
        assert!(!e.heals(), "{e}");
    }

    #[test]
    fn lag_falls_back_to_length_less_pending_when_redis_cannot_tell() {
        // Redis 7.0 answers lag nil after a deleted entry (delete_acked): the gauge must
        // not freeze at its last value while a backlog grows.
        assert_eq!(lag_or_estimate(Some(7), 100, Some(3), true), Some(7));
        assert_eq!(lag_or_estimate(None, 10, Some(1), true), Some(9));
        assert_eq!(lag_or_estimate(None, 0, Some(1), true), Some(0));
        assert_eq!(lag_or_estimate(None, 10, Some(1), false), None);
        assert_eq!(lag_or_estimate(None, 10, None, true), None);
    }

    #[test]
    fn keys_share_the_hash_tag() {
        let k = Keys::new("llm");
        assert_eq!(k.jobs, "{llm}:jobs");
        assert_eq!(k.results, "{llm}:results");
        assert_eq!(k.dead, "{llm}:dead");
        for key in [
            k.done("x"),
            k.inflight("x"),
            k.handed_back("1-0"),
            k.dropped(),
            k.costs.clone(),
            k.spend("d:2026-12-03"),
            k.tenant_holders("default", "acme"),
            k.parked("default", "acme"),
            k.parked_index(),
        ] {
            assert!(key.starts_with("{llm}:"), "{key}");
        }
    }

    /// The reader's cancel check, sent and not waited for: each entry's task gets its own
    /// flag once the answer comes, and anything short of an answer for that entry (a
    /// failed check, a sender gone, a shorter answer) counts as unchecked.
    #[tokio::test]
    async fn a_cancel_check_answers_each_entry_its_own_flag_or_unchecked() {
        let (tx, rx) = tokio::sync::watch::channel(None);
        let (first, second, past) = (
            CancelCheck::new(rx.clone(), 0),
            CancelCheck::new(rx.clone(), 1),
            CancelCheck::new(rx.clone(), 2),
        );
        // Waits for the answer: nothing yet after 50 ms.
        let waiting = tokio::spawn(async move { second.wait().await });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "answered before the check did");
        tx.send(Some(Some(Arc::from(vec![false, true])))).unwrap();
        assert_eq!(waiting.await.unwrap(), Some(true));
        assert_eq!(first.wait().await, Some(false));
        assert_eq!(past.wait().await, None, "no flag for it in the answer");
        // The answer stays readable after the sender is gone.
        drop(tx);
        assert_eq!(first.wait().await, Some(false));

        let (tx, rx) = tokio::sync::watch::channel(None);
        tx.send(Some(None)).unwrap();
        assert_eq!(CancelCheck::new(rx, 0).wait().await, None, "a failed check");

        let (tx, rx) = tokio::sync::watch::channel::<Option<CancelFlags>>(None);
        let gone = tokio::spawn(async move { CancelCheck::new(rx, 0).wait().await });
        drop(tx);
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), gone).await;
        assert_eq!(got.expect("a sender gone ends the wait").unwrap(), None);
    }
}
