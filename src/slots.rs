//! The fleet-wide semaphore: N concurrency slots per pool, shared by every worker
//! process through Redis keys `{ns}:slot:<pool>:<i>` (value = holder token, PX ttl).
//!
//! How it works (scripts in `lua/`):
//! - **acquire** (`slot_acquire.lua`, one round trip): take a free slot, or join the
//!   pool's FIFO waiter queue and (the first two in it) learn when the nearest lease
//!   expires;
//! - **release** (`slot_release.lua`): token-checked; if a process is waiting, the slot is
//!   handed to it directly (value set to its token with a short hand-off lease, and
//!   `{t: token, i: index}` appended to the pool's hand-off stream), so a releasing
//!   process cannot re-take its own slot
//!   while others starve. The waiter **picks it up** (`slot_renew.lua`),
//!   extending it to the full TTL before any call runs on it; a waiter that died after
//!   its last liveness refresh costs the fleet the slot only for `HANDOFF_LEASE` (500 ms, at most the TTL);
//! - **waiting**: one driver task per process blocks (XREAD BLOCK, on a connection of its
//!   own) on the hand-off streams of the pools it waits for, from the last entry it read,
//!   for at most the time until the nearest lease expires, takes the entries addressed to
//!   it, and serves the process's local waiters in FIFO order. Waiters in one process share
//!   that one wait; processes are served round robin. A process is in the fleet queue
//!   only while one of its local waiters waits: every step that queues it (a try that
//!   enqueues) or takes it out (`leave_if_idle`, when an acquire gives up) runs under the
//!   pool's `queue_lock` and checks the local waiters first, since a release hands the
//!   slot to the queue's live head whether or not anyone there still wants it;
//! - **renewal** (`slot_renew.lua`): one script every `ttl / 8` for every lease of the
//!   process, extending leases whose value is still our token; a lease that lapsed (the
//!   process was paused or cut off alone) is taken again, ahead of the queue since its
//!   call still runs, if its slot is free and the lease hash still records our token for
//!   it (so a renewal racing with our own release never re-creates a released slot); one
//!   held by someone else is reported lost, never overwritten;
//! - **lease clock** (`slot_clock.lua`, the prelude of every slot script): time in which
//!   Redis could not answer does not count against a holder. Each pool's lease hash
//!   `{ns}:slotlease:<pool>` shadows every slot key (token, deadline, lease length) and
//!   records the server `TIME` of the last slot script. Every worker runs one at least
//!   every `ttl / 8` (the renewer ticks even when it holds nothing), so a gap above
//!   `ttl / 2` means Redis stalled (SIGSTOP, a slow fork, a failover, a partition of the
//!   whole fleet): the first script after it gives every lease that was live when Redis
//!   was last seen its key back (same token, full length from now) before anything can
//!   be taken. Slot keys' PX expiry keeps running on the wall clock while Redis is
//!   stopped, so restoring from the shadow is what makes a stall of any length safe.
//!   Cost of the rule: if the whole fleet is gone for longer than the gap, a holder that
//!   died just before keeps its slot one more TTL;
//! - **release-all**: every slot of every pool, one round trip, at shutdown.
//!
//! Invariants:
//! - a slot key is only ever deleted or overwritten by the holder whose token it holds
//!   (or by its TTL expiring); an absent key is only re-created for the holder that the
//!   lease hash records for it (after a stall) or by that holder itself (renewal);
//! - while Redis answers the fleet, at most N keys of a pool exist; a stall of Redis
//!   does not free a slot whose holder was live when Redis stopped answering;
//! - within a process, the `held` table says which [`Lease`] uses which slot; a slot is
//!   in the table at most once;
//! - N for a pool is the one recorded in Redis by the first worker (`{ns}:poolsize:<pool>`);
//!   a worker configured with another N logs an error and uses the recorded one, so a
//!   misconfigured pod cannot overshoot the quota.

use crate::backoff::Backoff;
use crate::config::Config;
use crate::connect::{Commands, ConnectError, blocking_connection};
use crate::sync::{FastMap, lock};
use redis::aio::MultiplexedConnection;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long a waiting process counts as alive without refreshing (it refreshes at least
/// every second while it waits). A dead waiter is skipped once this has passed.
const WAITER_ALIVE_MS: u64 = 3000;
/// Upper bound of one blocking read, so liveness is refreshed and expiries are noticed.
const MAX_WAIT_TICK: Duration = Duration::from_millis(1000);
/// Lease given with a hand-off (capped by the TTL): the waiter turns it into a full lease
/// when it picks the slot up, one round trip after the hand-off. A waiter that died after
/// its last liveness refresh holds the slot only this long, not `slots.ttl_ms`. Long
/// enough for a loaded process to pick up (a pick-up that comes late still re-takes the
/// slot if nobody took it meanwhile).
const HANDOFF_LEASE: Duration = Duration::from_millis(500);
/// How many hand-offs a pool's hand-off stream keeps (approximately: `MAXLEN ~`). A
/// waiting process's driver reads every pool's stream on from the last entry it saw, so
/// it only misses its own if this many hand-offs of the pool happen between two of its
/// reads; the missed slot then comes back to the fleet when its short hand-off lease
/// ends.
const WAKE_MAXLEN: u64 = 1000;

/// How long a slot this process no longer uses stays with it, idle (still renewed), for
/// its next job to take without a round trip, when no other process waits for the pool
/// ([`QUIET_FOR`]); then it goes back to the fleet through the release script.
const IDLE_HOLD: Duration = Duration::from_millis(20);
/// How long the release script's word that no other process waits for a pool lets this
/// process keep slots idle among its own jobs ([`IDLE_HOLD`]) without asking again:
/// after it the next release goes through Redis (one at a time, the others staying idle
/// meanwhile), which hands the slot to a waiting process if one came. So a process that
/// starts waiting gets a slot from a busy one within about this plus a round trip.
const QUIET_FOR: Duration = Duration::from_millis(25);
/// How long the release script's word on this process's fair share of a pool (while
/// other processes wait for it) lets a release within that share go straight to a local
/// waiter without asking again. Longer than [`QUIET_FOR`]: a process within its share
/// takes nothing from anyone, and one asking per job's worth of releases would cost the
/// fleet a release script per job. The script keeps by share only while the queue's
/// head holds a slot (by the head's count word, at most 250 ms old, or its lease records:
/// lua/slot_release.lua), so a process that starts waiting is served in queue order; this
/// bounds how stale the word it is served by may be: such a process gets its first slot
/// within about this plus a job (`a_newcomer_is_served_while_others_keep_slots_by_their_share`).
/// Not longer: the releases that ask bunch a process's jobs, and with them its commits
/// (with 8 processes at N=64, 500 ms saved 0.13 release scripts a job but cost 0.2
/// commit calls more: docs/performance.md, twenty-second round).
const SHARE_FOR: Duration = Duration::from_millis(100);
/// How long a job asking for a slot waits for the answer of this process's release that
/// asks (`PoolState::asks`) before it sends a try of its own: a round trip is about a
/// millisecond, so this is only reached when Redis is slow.
const ASK_WAIT_MAX: Duration = Duration::from_millis(100);

/// The lease clock's timings, derived from the lease TTL (see `lua/slot_clock.lua`).
/// Every worker ticks every `ttl / 8` (its renewer), so a lease has at least about
/// `7/8 ttl` left at any time; a gap of more than `ttl / 2` between two slot scripts of
/// a pool therefore means Redis could not answer (and is detected before a lease lapses
/// unnoticed), while normal gaps stay well under it: a false alarm needs every worker
/// of the fleet silent for four ticks, and then only extends leases that were live.
fn clock_tick(ttl: Duration) -> Duration {
    ttl / 8
}
fn stall_gap(ttl: Duration) -> Duration {
    ttl / 2
}

/// The slot rooms' own key names, all under the queue's `{namespace}` hash tag.
#[derive(Debug, Clone)]
pub struct SlotKeys {
    prefix: String,
}

impl SlotKeys {
    pub fn new(namespace: &str) -> SlotKeys {
        SlotKeys {
            prefix: format!("{{{namespace}}}"),
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
    /// Liveness of the processes waiting for a slot of `pool` (sorted set: token ->
    /// server ms until which it counts as alive; the key lapses with its last member).
    pub fn waiter_alive(&self, pool: &str) -> String {
        format!("{}:slotalive:{pool}", self.prefix)
    }
    /// Hand-offs of `pool`'s slots (stream of `{t: waiter token, i: slot}`, capped at
    /// about `WAKE_MAXLEN` entries); every waiting process reads it and takes its own.
    pub fn wake(&self, pool: &str) -> String {
        format!("{}:slotwake:{pool}", self.prefix)
    }
    /// The pool's lease clock: a hash shadowing every slot key (token, deadline, lease
    /// length) plus the server time of the last slot script.
    pub fn lease(&self, pool: &str) -> String {
        format!("{}:slotlease:{pool}", self.prefix)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error(
        "no slot of pool {pool} became free within {waited:?} (try another model, or wait again)"
    )]
    Timeout { pool: String, waited: Duration },
    #[error("unknown pool {0} (fix the model's pool in config)")]
    UnknownPool(String),
    #[error("slots are shut down (the worker is stopping)")]
    Stopped,
    #[error("redis: {0} (retry when Redis answers again)")]
    Redis(redis::RedisError),
    #[error("redis pool: {0} (retry when Redis answers again)")]
    Pool(deadpool_redis::PoolError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("slot release: {0} (the slot's TTL frees it)")]
    Release(String),
}

from_cause!(SlotError, SlotError::Redis, redis::RedisError);
from_cause!(SlotError, SlotError::Pool, deadpool_redis::PoolError);

struct Waiter {
    id: u64,
    tx: oneshot::Sender<Lease>,
}

struct PoolState {
    name: String,
    /// N as recorded fleet-wide.
    size: u32,
    slot_keys: Vec<String>,
    queue_key: String,
    /// Waiter liveness (sorted set) and hand-off stream of the pool.
    live_key: String,
    wake_key: String,
    /// Id of the last entry of the hand-off stream this process has read: the driver
    /// reads on from there, so a hand-off written while it was not blocked is not missed.
    wake_last: Mutex<String>,
    /// The hand-off stream cannot be read (a key of another type, refused by an ACL):
    /// left out of the driver's reads, so the other pools' hand-offs still arrive, until
    /// the next (re)connection checks it again. This pool's waiters are served by their
    /// own tries meanwhile.
    wake_broken: AtomicBool,
    /// The pool's lease hash: a shadow of every slot key plus the lease clock.
    lease_key: String,
    waiters: Mutex<VecDeque<Waiter>>,
    /// When the driver should next try on its own (nearest lease expiry).
    next_check: Mutex<Instant>,
    /// The slot this process released last: the acquire script tries it first.
    hint: AtomicU32,
    /// The last try of `retry_pool` failed (see there).
    try_failed: AtomicBool,
    /// Held by every step that may put this process into the pool's fleet queue (a try
    /// that enqueues) or take it out (`leave_if_idle`), each checking the local waiters
    /// under it. Without it a try of the driver, on the wire while an acquire's first try
    /// took a slot and its waiter left, queued the process with nobody here waiting: the
    /// next release handed the slot to a process that did not want it (see
    /// `leave_if_idle`).
    queue_lock: tokio::sync::Mutex<()>,
    /// Slots this process holds that no job uses, for [`IDLE_HOLD`] at most (see there).
    /// Each is still in `held` (renewed, same value, same lost flag).
    idle: Mutex<Vec<IdleSlot>>,
    /// Whether a task releases idle slots once their time is up.
    idle_flusher: AtomicBool,
    /// Asking releases of the pool (`PendingRelease::ask`) sent and not yet answered, and
    /// the wake-up when one is. A job that asks for a slot meanwhile waits for that
    /// answer (bounded) before an acquire script of its own: the release usually keeps
    /// the slot for it, and a try sent beside it would find every slot held, queue this
    /// process fleet-wide and leave again, two scripts for nothing.
    asks: AtomicU32,
    asked: Notify,
    /// Tries that may queue this process fleet-wide (acquire scripts with `enqueue`):
    /// how many were sent, and how many are on the wire. An asking release runs without
    /// the queue lock, so a try sent beside it may queue the process while the release
    /// keeps a slot for the very job that tried; these tell the release to leave the
    /// queue again then (`release_batch`).
    queue_tries: AtomicU64,
    queue_tries_out: AtomicU32,
    /// When the last release script said no other process waits for the pool (None:
    /// some did, or no word yet), and when the release asking again since went out.
    /// See [`PoolState::keep_local`].
    quiet_since: Mutex<(Option<Instant>, Option<Instant>)>,
    /// When the last release script was sent that said other processes wait for the
    /// pool, and this process's fair share of it then (N / (processes waiting + 1)):
    /// for [`SHARE_FOR`] after it, a slot released while this process holds no more than
    /// that goes straight to a local waiter, as the script would have kept it (see
    /// `lua/slot_release.lua`). None: no such word, or it is void (a lost reply).
    share: Mutex<Option<(Instant, u32)>>,
    /// `llm_worker_slot_wait_seconds` of this pool (see `observe_wait`).
    wait_seconds: std::sync::OnceLock<metrics::Histogram>,
}

/// A held slot no job uses (see `PoolState::idle`).
struct IdleSlot {
    idx: u32,
    value: String,
    lost: Arc<AtomicBool>,
    since: Instant,
}

impl PoolState {
    /// One asking release of the pool is answered (or will never be): the jobs waiting
    /// for it go on (`asks`).
    fn ask_answered(&self) {
        self.asks.fetch_sub(1, Ordering::SeqCst);
        self.asked.notify_waiters();
    }

    /// True if a slot released now may stay idle in this process: the last word of the
    /// release script was that no other process waits, less than [`QUIET_FOR`] ago, or
    /// the release asking again is on its way (for at most a second). False makes the
    /// caller's release the one that asks.
    fn keep_local(&self) -> bool {
        let mut q = lock(&self.quiet_since);
        let Some(t) = q.0 else {
            return false;
        };
        if t.elapsed() < QUIET_FOR {
            return true;
        }
        match q.1 {
            Some(p) if p.elapsed() < Duration::from_secs(1) => true,
            _ => {
                q.1 = Some(Instant::now());
                false
            }
        }
    }

    /// True if the release script's last word, less than [`SHARE_FOR`] ago, gave this
    /// process a fair share of at least `held` slots of the pool (`held` counting the
    /// slot being released).
    fn within_share(&self, held: usize) -> bool {
        lock(&self.share)
            .is_some_and(|(t, share)| t.elapsed() < SHARE_FOR && held <= share as usize)
    }

    /// True if the last word of the release script was that another process waits.
    fn others_wait(&self) -> bool {
        lock(&self.quiet_since).0.is_none()
    }

    /// An idle slot of this process that cannot have lapsed (see [`Held::confirmed`]),
    /// as a lease of the caller's. One that might have is sent back to the fleet through
    /// the release script (token-checked) instead.
    fn take_idle(&self, inner: &Arc<Inner>) -> Option<Lease> {
        let mut idle = lock(&self.idle);
        while let Some(s) = idle.pop() {
            if s.lost.load(Ordering::SeqCst) {
                continue; // the renewer found it taken; it left `held` then
            }
            let key = &self.slot_keys[s.idx as usize];
            let live = lock(&inner.held)
                .get(key)
                .is_some_and(|h| Arc::ptr_eq(&h.lost, &s.lost) && h.surely_live(inner.ttl));
            if !live {
                tokio::spawn(release_idle(inner.clone(), self.name.clone(), s));
                continue;
            }
            return Some(Lease::again(inner, &self.name, s.idx, key, s.value, s.lost));
        }
        None
    }

    /// True if a live local waiter exists (dropping the ones whose acquire was abandoned).
    fn has_waiters(&self) -> bool {
        self.live_waiters() > 0
    }

    /// How many local waiters still wait (dropping the ones whose acquire was abandoned).
    fn live_waiters(&self) -> usize {
        let mut w = lock(&self.waiters);
        w.retain(|x| !x.tx.is_closed());
        w.len()
    }

    /// True while local waiter `id` has not been served (or abandoned).
    fn is_waiting(&self, id: u64) -> bool {
        lock(&self.waiters).iter().any(|x| x.id == id)
    }
}

struct Held {
    pool: String,
    idx: u32,
    /// The slot key's value while this lease holds it (see [`Lease`]).
    value: String,
    lost: Arc<AtomicBool>,
    /// When a script last gave this lease a full TTL (taken, or renewed: the time the
    /// script was sent). The `lost` flag is only as fresh as the last renewal; a lease is
    /// kept in the process for another job only while this is under half a TTL old, so
    /// it cannot have lapsed meanwhile (a paused process, a renewer cut off).
    confirmed: Instant,
}

impl Held {
    /// True while this lease cannot have lapsed since a script last extended it.
    fn surely_live(&self, ttl: Duration) -> bool {
        !self.lost.load(Ordering::SeqCst) && self.confirmed.elapsed() < ttl / 2
    }
}

struct Inner {
    conn: Commands,
    cfg: Config,
    token: String,
    ttl: Duration,
    /// Lease of a slot handed to a waiter, until it picks it up.
    handoff: Duration,
    pools: FastMap<String, PoolState>,
    held: Mutex<FastMap<String, Held>>,
    driver_wake: Notify,
    next_waiter: AtomicU64,
    stopped: AtomicBool,
    acquire_script: redis::Script,
    release_script: redis::Script,
    renew_script: redis::Script,
    /// Releases waiting for the release script, and whether one is running: releases
    /// that arrive while a release script is on the wire go together in the next one
    /// (one round trip for many jobs when calls end close together).
    releases: Mutex<(Vec<PendingRelease>, bool)>,
    /// Source of the per-lease part of slot values.
    next_nonce: AtomicU64,
    /// Fault injection for tests: how long the releaser waits before each release script.
    release_delay: Mutex<Duration>,
    /// Fault injection for tests: how long an acquire's reply is held before its leases
    /// are made (as in a process paused right after the script ran).
    acquire_reply_delay: Mutex<Duration>,
    /// Acquire scripts sent (every try, by a job or the driver). For tests.
    acquire_scripts: AtomicU64,
    /// Fault injection for tests: how long the driver's stream check of a fresh
    /// connection stalls (as on a Redis that stopped answering after the connect).
    mark_check_delay: Mutex<Duration>,
}

/// One slot waiting to be released by the batching releaser.
struct PendingRelease {
    pool: String,
    idx: u32,
    key: String,
    /// The lease's value: the script releases the slot only if it still holds it.
    value: String,
    /// The release that asks again whether other processes wait, after a word that none
    /// did ([`PoolState::keep_local`]): if still none does, the script keeps the slot for
    /// this process (idle, for its next job) instead of freeing it for that job to take
    /// back with an acquire script a moment later. Never set for an idle slot going
    /// back (that would keep it forever).
    ask: bool,
    done: oneshot::Sender<Result<bool, String>>,
}

/// Handle to this process's view of the fleet-wide slots. Cheap to clone.
#[derive(Clone)]
pub struct Slots {
    inner: Arc<Inner>,
}

/// One held slot. Release it with [`Lease::release`]; dropping it releases it in the
/// background (so a cancelled job never leaks a slot beyond its TTL).
pub struct Lease {
    inner: Arc<Inner>,
    pool: String,
    idx: u32,
    key: String,
    /// The slot key's value while this lease holds it: `<process token>#<nonce>`, one
    /// per lease (a slot handed to this process holds the bare token until its pick-up
    /// stamps the lease's own value). Renewal and release check it, so a late release
    /// of an old lease of this process can never delete a newer lease of the same slot.
    value: String,
    lost: Arc<AtomicBool>,
    done: bool,
}

impl Lease {
    /// A new lease object for a slot this process keeps holding (its `held` entry, value
    /// and lost flag unchanged): the previous object was consumed by its release.
    fn again(
        inner: &Arc<Inner>,
        pool: &str,
        idx: u32,
        key: &str,
        value: String,
        lost: Arc<AtomicBool>,
    ) -> Lease {
        Lease {
            inner: inner.clone(),
            pool: pool.to_string(),
            idx,
            key: key.to_string(),
            value,
            lost,
            done: false,
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({})", self.key)
    }
}

enum Try {
    /// Slots taken (at least one, at most the number asked for), with their values, and
    /// when the script that took them was sent (each lease's [`Held::confirmed`]).
    Got(Vec<(u32, String)>, Instant),
    Wait(Duration),
}

impl Slots {
    /// Records (or reads) each pool's fleet-wide N and prepares the scripts. Needs Redis.
    pub async fn connect(cfg: &Config, conn: Commands) -> Result<Slots, SlotError> {
        let keys = SlotKeys::new(&cfg.queue.namespace);
        let mut pools = FastMap::default();
        {
            let mut c = conn.get().await?;
            for (name, pc) in &cfg.pools {
                let size_key = keys.pool_size(name);
                let _: Option<String> = redis::cmd("SET")
                    .arg(&size_key)
                    .arg(pc.slots)
                    .arg("NX")
                    .query_async(&mut c)
                    .await?;
                let recorded: Option<u32> =
                    redis::cmd("GET").arg(&size_key).query_async(&mut c).await?;
                let size = match recorded {
                    Some(n) if n > 0 => n,
                    _ => pc.slots.get(),
                };
                if size != pc.slots.get() {
                    tracing::error!(
                        pool = %name,
                        configured = pc.slots,
                        recorded = size,
                        key = %size_key,
                        "pool size differs from the fleet's recorded N; using the recorded N \
                         (to change N for the whole fleet, SET that key and restart the workers)"
                    );
                    metrics::counter!("llm_worker_pool_size_mismatch_total", "pool" => name.clone())
                        .increment(1);
                }
                // N in use, for dashboards (slots held against N).
                metrics::gauge!("llm_worker_pool_slots", "pool" => name.clone()).set(size as f64);
                // Hand-offs to this process can only come after it first queues (below,
                // later): everything in the stream now is someone else's.
                let wake_key = keys.wake(name);
                // (A stream that cannot be read now is checked again by the driver.)
                let wake_last = crate::connect::stream_end(&mut c, &wake_key)
                    .await
                    .unwrap_or_else(|_| "0-0".to_string());
                pools.insert(
                    name.clone(),
                    PoolState {
                        name: name.clone(),
                        size,
                        slot_keys: (0..size).map(|i| keys.slot(name, i)).collect(),
                        queue_key: keys.slot_queue(name),
                        live_key: keys.waiter_alive(name),
                        wake_key,
                        wake_last: Mutex::new(wake_last),
                        wake_broken: AtomicBool::new(false),
                        lease_key: keys.lease(name),
                        waiters: Mutex::new(VecDeque::new()),
                        next_check: Mutex::new(Instant::now()),
                        hint: AtomicU32::new(0),
                        try_failed: AtomicBool::new(false),
                        queue_lock: tokio::sync::Mutex::new(()),
                        idle: Mutex::new(Vec::new()),
                        idle_flusher: AtomicBool::new(false),
                        asks: AtomicU32::new(0),
                        asked: Notify::new(),
                        queue_tries: AtomicU64::new(0),
                        queue_tries_out: AtomicU32::new(0),
                        quiet_since: Mutex::new((None, None)),
                        share: Mutex::new(None),
                        wait_seconds: std::sync::OnceLock::new(),
                    },
                );
            }
        }
        let token = format!(
            "{}:{}",
            cfg.queue.consumer,
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        Ok(Slots {
            inner: Arc::new(Inner {
                conn,
                cfg: cfg.clone(),
                token,
                ttl: cfg.slots.ttl_ms,
                handoff: HANDOFF_LEASE.min(cfg.slots.ttl_ms),
                pools,
                held: Mutex::default(),
                driver_wake: Notify::new(),
                next_waiter: AtomicU64::new(0),
                stopped: AtomicBool::new(false),
                acquire_script: crate::scripts::SLOT_ACQUIRE.clone(),
                release_script: crate::scripts::SLOT_RELEASE.clone(),
                renew_script: crate::scripts::SLOT_RENEW.clone(),
                releases: Mutex::new((Vec::new(), false)),
                next_nonce: AtomicU64::new(1),
                release_delay: Mutex::new(Duration::ZERO),
                acquire_reply_delay: Mutex::new(Duration::ZERO),
                acquire_scripts: AtomicU64::new(0),
                mark_check_delay: Mutex::new(Duration::ZERO),
            }),
        })
    }

    /// This process's holder token (the value of the slot keys it holds).
    pub fn token(&self) -> &str {
        &self.inner.token
    }

    /// Fault injection for tests: every release script waits `d` first (as on a
    /// connection that stalled), after its lease has left the held table.
    #[doc(hidden)]
    pub fn delay_releases_for_tests(&self, d: Duration) {
        *lock(&self.inner.release_delay) = d;
    }

    /// Fault injection for tests: every acquire script's reply is held `d` before its
    /// leases are made (a process paused right after the script ran).
    #[doc(hidden)]
    pub fn delay_acquire_replies_for_tests(&self, d: Duration) {
        *lock(&self.inner.acquire_reply_delay) = d;
    }

    /// Fault injection for tests: the driver's check of the hand-off streams on every
    /// fresh connection first waits `d` (a Redis that stops answering right after the
    /// connect).
    #[doc(hidden)]
    pub fn stall_mark_checks_for_tests(&self, d: Duration) {
        *lock(&self.inner.mark_check_delay) = d;
    }

    /// How many acquire scripts this process has sent. For tests.
    #[doc(hidden)]
    pub fn acquire_scripts_for_tests(&self) -> u64 {
        self.inner.acquire_scripts.load(Ordering::Relaxed)
    }

    /// N of `pool` as recorded fleet-wide.
    pub fn pool_size(&self, pool: &str) -> Option<u32> {
        self.inner.pools.get(pool).map(|p| p.size)
    }

    /// Number of slots this process holds now.
    pub fn held(&self) -> usize {
        lock(&self.inner.held).len()
    }

    /// Number of this process's acquires of `pool` waiting for a slot now (0 for an
    /// unknown pool).
    pub fn waiting(&self, pool: &str) -> usize {
        self.inner.pools.get(pool).map_or(0, |p| p.live_waiters())
    }

    /// Whether the last release script's word for `pool` was that no other process waits
    /// (which lets released slots stay in this process for [`QUIET_FOR`]). For tests.
    #[doc(hidden)]
    pub fn heard_nobody_else_waits_for_tests(&self, pool: &str) -> bool {
        self.inner
            .pools
            .get(pool)
            .is_some_and(|p| lock(&p.quiet_since).0.is_some())
    }

    /// Starts the driver (serves waiters) and the renewer. Both end when `cancel` fires.
    pub fn spawn_background(&self, cancel: CancellationToken) -> tokio::task::JoinHandle<()> {
        let driver = tokio::spawn(driver(self.inner.clone(), cancel.clone()));
        let renewer = tokio::spawn(renewer(self.inner.clone(), cancel));
        tokio::spawn(async move {
            let _ = driver.await;
            let _ = renewer.await;
        })
    }

    /// Takes a slot of `pool` without waiting: `Ok(None)` if none is free (or others wait).
    pub async fn try_acquire(&self, pool: &str) -> Result<Option<Lease>, SlotError> {
        let ps = self.pool_state(pool)?;
        if ps.has_waiters() {
            return Ok(None);
        }
        if let Some(lease) = ps.take_idle(&self.inner) {
            return Ok(Some(lease));
        }
        match try_take_detached(&self.inner, pool, false).await? {
            Try::Got(mut i, sent) => {
                let (idx, value) = i.swap_remove(0);
                Ok(Some(make_lease(&self.inner, ps, idx, value, sent)))
            }
            Try::Wait(_) => Ok(None),
        }
    }

    /// Takes a slot of `pool`, waiting up to `timeout` (woken by hand-off, not by polling).
    pub async fn acquire(&self, pool: &str, timeout: Duration) -> Result<Lease, SlotError> {
        let inner = &self.inner;
        let ps = self.pool_state(pool)?;
        let started = Instant::now();
        if !ps.has_waiters()
            && let Some(lease) = ps.take_idle(inner)
        {
            observe_wait(ps, started);
            return Ok(lease);
        }
        let (tx, mut rx) = oneshot::channel();
        let id = inner.next_waiter.fetch_add(1, Ordering::Relaxed);
        // Queue locally first, so a hand-off that arrives while our first try is on the
        // wire finds us.
        let first = {
            let mut w = lock(&ps.waiters);
            w.retain(|x| !x.tx.is_closed());
            w.push_back(Waiter { id, tx });
            w.len() == 1
        };
        // A slot that went idle while we queued: to the first waiter, in order.
        if let Some(lease) = ps.take_idle(inner) {
            deliver(ps, lease);
        }
        if first && ps.asks.load(Ordering::SeqCst) > 0 {
            // A release of this process that asks is on the wire: its answer usually
            // keeps the slot, for us (`deliver`). Wait for it (bounded, below) rather
            // than send a try beside it.
            let answered = ps.asked.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if ps.asks.load(Ordering::SeqCst) > 0 {
                // Not long, and never past the caller's timeout: a slow answer must not
                // keep a job from a slot that is free meanwhile.
                let bound = ASK_WAIT_MAX.min(timeout.saturating_sub(started.elapsed()));
                tokio::select! {
                    got = &mut rx => {
                        return match got {
                            Ok(lease) => {
                                observe_wait(ps, started);
                                Ok(lease)
                            }
                            Err(_) => Err(SlotError::Stopped),
                        };
                    }
                    _ = answered => {}
                    _ = tokio::time::sleep(bound) => {}
                }
            }
        }
        if first {
            let queue = ps.queue_lock.lock().await;
            // The driver may have served us while we waited for the lock; then the
            // lease is in `rx` already, and a try would only queue us for nothing.
            let tried = if ps.is_waiting(id) {
                Some(try_take_detached(inner, pool, true).await)
            } else {
                None
            };
            match tried {
                None => {}
                Some(Ok(Try::Got(mut i, sent))) => {
                    let (idx, value) = i.swap_remove(0);
                    let lease = make_lease(inner, ps, idx, value, sent);
                    if !remove_waiter(ps, id) {
                        // A hand-off reached our entry meanwhile; whatever it sends us is
                        // dropped with `rx` and so released.
                        drop(rx);
                    }
                    drop(queue);
                    if ps.has_waiters() {
                        // Local waiters queued behind us while our try was on the wire;
                        // they counted on it to queue this process, but taking a slot
                        // left the fleet queue instead. Queue again (or take a free slot
                        // for them) now, not when the driver's tick next fires (up to 1 s
                        // later, while releases elsewhere skip us).
                        spawn_retry(inner, ps);
                    }
                    observe_wait(ps, started);
                    return Ok(lease);
                }
                Some(Ok(Try::Wait(d))) => {
                    *lock(&ps.next_check) = Instant::now() + d;
                }
                Some(Err(e)) => {
                    remove_waiter(ps, id);
                    return Err(e);
                }
            }
        }
        inner.driver_wake.notify_one();
        match tokio::time::timeout(timeout.saturating_sub(started.elapsed()), &mut rx).await {
            Ok(Ok(lease)) => {
                observe_wait(ps, started);
                Ok(lease)
            }
            Ok(Err(_)) => Err(SlotError::Stopped),
            Err(_) => {
                remove_waiter(ps, id);
                rx.close();
                if let Ok(lease) = rx.try_recv() {
                    observe_wait(ps, started);
                    return Ok(lease);
                }
                leave_if_idle(inner, ps).await;
                Err(SlotError::Timeout {
                    pool: pool.to_string(),
                    waited: started.elapsed(),
                })
            }
        }
    }

    /// Releases every slot of every pool this process holds, leaves every waiter queue,
    /// and stops handing out slots. One round trip. Returns how many were released or
    /// handed on.
    pub async fn release_all(&self) -> Result<u64, SlotError> {
        let inner = &self.inner;
        inner.stopped.store(true, Ordering::SeqCst);
        for ps in inner.pools.values() {
            lock(&ps.waiters).clear();
            lock(&ps.idle).clear(); // still in `held`: released below with the rest
        }
        let mut inv = release_invoke(inner, true);
        for ps in inner.pools.values() {
            release_group_keys(&mut inv, ps);
            // nothing kept: no local waiter is served any more
            inv.arg(ps.size).arg(0).arg("").arg(0).arg(ps.size);
            for (i, k) in ps.slot_keys.iter().enumerate() {
                inv.key(k);
                // release-all matches any value of this process
                inv.arg(i).arg(&inner.token);
            }
        }
        let mut conn = inner.conn.get().await?;
        let reply: Vec<u64> = inv.invoke(&mut conn).await?;
        let (released, handed) = (
            reply.first().copied().unwrap_or(0),
            reply.get(1).copied().unwrap_or(0),
        );
        for (_, h) in lock(&inner.held).drain() {
            h.lost.store(true, Ordering::SeqCst); // their own release must not run again
        }
        Ok(released + handed)
    }

    fn pool_state(&self, pool: &str) -> Result<&PoolState, SlotError> {
        if self.inner.stopped.load(Ordering::SeqCst) {
            return Err(SlotError::Stopped);
        }
        self.inner
            .pools
            .get(pool)
            .ok_or_else(|| SlotError::UnknownPool(pool.to_string()))
    }
}

/// Records a slot wait of `ps`'s pool in `llm_worker_slot_wait_seconds` (its handle
/// registered at the pool's first wait, so /metrics shows the pool once it has one).
fn observe_wait(ps: &PoolState, started: Instant) {
    ps.wait_seconds
        .get_or_init(
            || metrics::histogram!("llm_worker_slot_wait_seconds", "pool" => ps.name.clone()),
        )
        .record(started.elapsed().as_secs_f64());
}

/// Takes this process out of `ps`'s fleet queue if nobody here waits for the pool any
/// more. Every release hands a slot to the queue's live head, so a process queued with
/// no local waiter would be handed a slot it does not want: its driver (which blocks
/// only while something waits) would not even pick it up, and the slot would sit idle
/// for the hand-off lease while the processes behind it wait. Best effort: if Redis
/// does not answer, the entry lapses with the process's liveness (`WAITER_ALIVE_MS`).
async fn leave_if_idle(inner: &Inner, ps: &PoolState) {
    let _queue = ps.queue_lock.lock().await;
    if ps.has_waiters() {
        return;
    }
    let left = async {
        let mut conn = inner.conn.get().await?;
        let _: i64 = redis::cmd("ZREM")
            .arg(&ps.queue_key)
            .arg(&inner.token)
            .query_async(&mut conn)
            .await?;
        Ok::<(), SlotError>(())
    };
    if let Err(e) = left.await {
        tracing::debug!(error = %e, pool = %ps.name, "leaving the slot queue failed; the entry lapses with our liveness");
    }
}

fn remove_waiter(ps: &PoolState, id: u64) -> bool {
    let mut w = lock(&ps.waiters);
    match w.iter().position(|x| x.id == id) {
        Some(p) => {
            w.remove(p);
            true
        }
        None => false,
    }
}

/// The release script with its fixed arguments; the caller adds the pool groups.
fn release_invoke(inner: &Inner, all: bool) -> crate::scripts::Call<'_> {
    let mut inv = crate::scripts::Call::new(&inner.release_script);
    inv.arg(&inner.token)
        .arg(inner.ttl.as_millis() as u64)
        .arg(if all { "1" } else { "0" })
        .arg(inner.handoff.as_millis() as u64)
        .arg(stall_gap(inner.ttl).as_millis() as u64)
        .arg(WAITER_ALIVE_MS)
        .arg(WAKE_MAXLEN);
    inv
}

/// The release script's keys of `ps`'s group (before the group's slot keys).
fn release_group_keys(inv: &mut crate::scripts::Call<'_>, ps: &PoolState) {
    inv.key(&ps.queue_key)
        .key(&ps.lease_key)
        .key(&ps.live_key)
        .key(&ps.wake_key);
}

/// [`try_take`] of one slot for a caller that may be dropped mid-call (a job stopped by
/// its cancel or deadline): the script runs in a task of its own, and a slot it took for
/// a caller that is gone becomes a lease dropped at once (so released), instead of a key
/// holding our token until its TTL.
async fn try_take_detached(
    inner: &Arc<Inner>,
    pool: &str,
    enqueue: bool,
) -> Result<Try, SlotError> {
    let (tx, rx) = oneshot::channel();
    let (inner, pool) = (inner.clone(), pool.to_string());
    tokio::spawn(async move {
        let Some(ps) = inner.pools.get(&pool) else {
            let _ = tx.send(Err(SlotError::UnknownPool(pool)));
            return;
        };
        let r = try_take(&inner, ps, enqueue, 1).await;
        if let Err(Ok(Try::Got(taken, sent))) = tx.send(r) {
            for (idx, value) in taken {
                drop(make_lease(&inner, ps, idx, value, sent));
            }
        }
    });
    rx.await
        .unwrap_or_else(|_| Err(SlotError::Release("the acquire task ended".into())))
}

/// One acquire script: up to `want` free slots, or (`enqueue`) this process queued.
async fn try_take(
    inner: &Inner,
    ps: &PoolState,
    enqueue: bool,
    want: usize,
) -> Result<Try, SlotError> {
    inner.acquire_scripts.fetch_add(1, Ordering::Relaxed);
    // Counted as on the wire until this returns, whatever the outcome.
    struct Out<'a>(&'a PoolState);
    impl Drop for Out<'_> {
        fn drop(&mut self) {
            self.0.queue_tries_out.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _out = enqueue.then(|| {
        ps.queue_tries.fetch_add(1, Ordering::SeqCst);
        ps.queue_tries_out.fetch_add(1, Ordering::SeqCst);
        Out(ps)
    });
    let mut inv = crate::scripts::Call::new(&inner.acquire_script);
    inv.key(&ps.queue_key).key(&ps.lease_key).key(&ps.live_key);
    for k in &ps.slot_keys {
        inv.key(k);
    }
    inv.arg(&inner.token)
        .arg(inner.ttl.as_millis() as u64)
        .arg(if enqueue { "1" } else { "0" })
        .arg(WAITER_ALIVE_MS)
        .arg(stall_gap(inner.ttl).as_millis() as u64)
        .arg(ps.hint.load(Ordering::Relaxed))
        .arg(want);
    let prefix = format!("{}.", lease_value(inner));
    inv.arg(&prefix);
    let sent = Instant::now();
    let mut conn = inner.conn.get().await?;
    let reply: Vec<i64> = inv.invoke(&mut conn).await?;
    let held_up = *lock(&inner.acquire_reply_delay);
    if !held_up.is_zero() {
        tokio::time::sleep(held_up).await;
    }
    #[cfg(debug_assertions)]
    if let Some(ms) = std::env::var("LLM_WORKER_DEBUG_SLOW_ACQUIRE_REPLY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tracing::warn!(ms, "debug hook: slowing an acquire reply");
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let (taken, wait) = (
        reply.first().copied().unwrap_or(0),
        reply.get(1).copied().unwrap_or(0),
    );
    Ok(if taken > 0 {
        let size = ps.slot_keys.len() as i64;
        // The j-th slot taken (from 1) holds `prefix` .. j (see lua/slot_acquire.lua).
        let got: Vec<(u32, String)> = reply
            .get(2..)
            .unwrap_or(&[])
            .iter()
            .enumerate()
            .filter(|(_, i)| (0..size).contains(*i))
            .map(|(j, &i)| (i as u32, format!("{prefix}{}", j + 1)))
            .collect();
        if got.is_empty() {
            Try::Wait(Duration::from_millis(1))
        } else {
            Try::Got(got, sent)
        }
    } else {
        Try::Wait(Duration::from_millis(wait.max(1) as u64))
    })
}

/// `confirmed`: when the script that gave this lease its full TTL was sent.
fn make_lease(
    inner: &Arc<Inner>,
    ps: &PoolState,
    idx: u32,
    value: String,
    confirmed: Instant,
) -> Lease {
    let key = ps.slot_keys[idx as usize].clone();
    let lost = Arc::new(AtomicBool::new(false));
    let prev = lock(&inner.held).insert(
        key.clone(),
        Held {
            pool: ps.name.clone(),
            idx,
            value: value.clone(),
            lost: lost.clone(),
            confirmed,
        },
    );
    if let Some(old) = prev {
        // We were given a slot our table still shows as ours: the old lease expired
        // unnoticed (e.g. the process was paused) and the key was taken again.
        old.lost.store(true, Ordering::SeqCst);
        lease_lost(&ps.name, idx, "expired and re-taken before renewal noticed");
    }
    metrics::gauge!("llm_worker_slots_held").set(lock(&inner.held).len() as f64);
    Lease {
        inner: inner.clone(),
        pool: ps.name.clone(),
        idx,
        key,
        value,
        lost,
        done: false,
    }
}

/// A fresh value for a lease of this process: `<token>#<nonce>`.
/// A lease's value: `<process token>#<unix ms>n<nonce>`. Scripts compare only the
/// `<token>#` prefix (and whole values); the time is when this holder's lease began, so
/// `status` can show how long a slot has been held (renewals keep the value).
fn lease_value(inner: &Inner) -> String {
    format!(
        "{}#{}n{}",
        inner.token,
        crate::cost::unix_now_ms(),
        inner.next_nonce.fetch_add(1, Ordering::Relaxed)
    )
}

fn lease_lost(pool: &str, idx: u32, why: &str) {
    tracing::warn!(
        pool,
        slot = idx,
        why,
        "slot lease lost; the call it covered finishes without it"
    );
    metrics::counter!("llm_worker_slot_leases_lost_total", "pool" => pool.to_string()).increment(1);
}

impl Lease {
    pub fn index(&self) -> u32 {
        self.idx
    }
    /// The pool this slot belongs to.
    pub fn pool(&self) -> &str {
        &self.pool
    }
    /// True once renewal found the lease expired or taken by someone else.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// True while this lease cannot have lapsed: not found lost, and a script gave it a
    /// full TTL less than half a TTL ago (taken or renewed: counted from when the script
    /// was sent). A call starts only on such a lease: one whose acquire reply was read
    /// late (a paused process, a slow link) may have lapsed, and its key been taken by
    /// another process, before this process ever saw it.
    pub fn surely_live(&self) -> bool {
        !self.is_lost()
            && lock(&self.inner.held)
                .get(&self.key)
                .is_some_and(|h| Arc::ptr_eq(&h.lost, &self.lost) && h.surely_live(self.inner.ttl))
    }

    /// Token-checked release; hands the slot to a waiter if one is queued.
    pub async fn release(mut self) -> Result<(), SlotError> {
        self.done = true;
        release_lease(
            &self.inner,
            &self.pool,
            self.idx,
            &self.key,
            &self.value,
            &self.lost,
        )
        .await
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let (inner, pool, idx, key, lost) = (
            self.inner.clone(),
            self.pool.clone(),
            self.idx,
            self.key.clone(),
            self.lost.clone(),
        );
        let value = self.value.clone();
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move {
                if let Err(e) = release_lease(&inner, &pool, idx, &key, &value, &lost).await {
                    tracing::warn!(error = %e, slot = %key, "background slot release failed; the TTL frees it");
                }
            });
        }
    }
}

async fn release_lease(
    inner: &Arc<Inner>,
    pool: &str,
    idx: u32,
    key: &str,
    value: &str,
    lost: &Arc<AtomicBool>,
) -> Result<(), SlotError> {
    // No other process waits for the pool (the release script said so less than
    // QUIET_FOR ago): the slot stays in this process, its entry in `held` untouched
    // (same value, same lost flag, still renewed): to the job here that waits longest,
    // or idle for the next job; the idle flusher gives it back to the fleet after
    // IDLE_HOLD. Only one lease object at a time holds a `held` entry (this one is
    // consumed), so a shared value is never released twice. The cap on fairness: a
    // process that starts waiting gets the first slot this one releases more than
    // QUIET_FOR (plus a round trip) after it queued, not the very first.
    let mut ask = false;
    if let Some(ps) = inner.pools.get(pool)
        && !lost.load(Ordering::SeqCst)
        && !inner.stopped.load(Ordering::SeqCst)
        && lock(&inner.held)
            .get(key)
            .is_some_and(|h| Arc::ptr_eq(&h.lost, lost) && h.surely_live(inner.ttl))
        && (ps.keep_local() || {
            // Not kept without asking: this release asks. If the last word was that no
            // other process waits, it may keep the slot should that still hold.
            ask = !ps.others_wait();
            ps.has_waiters() && ps.within_share(held_in_pool(inner, pool))
        })
    {
        if ps.has_waiters() {
            let lease = Lease::again(inner, pool, idx, key, value.to_string(), lost.clone());
            hand_to_waiter(inner, ps, lease);
            return Ok(());
        }
        push_idle(inner, ps, idx, value.to_string(), lost.clone());
        return Ok(());
    }
    release_to_fleet(inner, pool, idx, key, value, lost, ask).await
}

/// A slot this process keeps though no job of it uses it: into the pool's idle slots
/// (for [`IDLE_HOLD`] at most), its `held` entry untouched (same value, same lost flag,
/// still renewed). Only under a word that no other process waits (the callers check).
fn push_idle(inner: &Arc<Inner>, ps: &PoolState, idx: u32, value: String, lost: Arc<AtomicBool>) {
    lock(&ps.idle).push(IdleSlot {
        idx,
        value,
        lost,
        since: Instant::now(),
    });
    if !ps.idle_flusher.swap(true, Ordering::SeqCst) {
        tokio::spawn(flush_idle(inner.clone(), ps.name.clone()));
    }
    // A job that began waiting while the slot went idle: it gets it now.
    if ps.has_waiters()
        && let Some(lease) = ps.take_idle(inner)
    {
        hand_to_waiter(inner, ps, lease);
    }
}

/// How many slots of `pool` this process holds (`held`: in use, idle, or being released
/// and not yet out of it).
fn held_in_pool(inner: &Inner, pool: &str) -> usize {
    lock(&inner.held)
        .values()
        .filter(|h| h.pool == pool)
        .count()
}

/// Gives a lease kept in the process to the local waiter that waits longest (dropped, so
/// released again, if every waiter left meanwhile). If that was the last waiter, whose
/// try may have queued this process in the fleet queue, the process leaves the queue (in
/// a task of its own), or a release elsewhere would hand it a slot nobody here wants.
fn hand_to_waiter(inner: &Arc<Inner>, ps: &PoolState, lease: Lease) {
    deliver(ps, lease);
    if !ps.has_waiters() {
        let (inner, name) = (inner.clone(), ps.name.clone());
        tokio::spawn(async move {
            if let Some(ps) = inner.pools.get(&name) {
                leave_if_idle(&inner, ps).await;
            }
        });
    }
}

/// An idle slot back to the fleet through the release script (token-checked).
async fn release_idle(inner: Arc<Inner>, pool: String, s: IdleSlot) {
    let key = inner.pools[&pool].slot_keys[s.idx as usize].clone();
    if let Err(e) = release_to_fleet(&inner, &pool, s.idx, &key, &s.value, &s.lost, false).await {
        tracing::warn!(error = %e, slot = %key, "idle slot release failed; the TTL frees it");
    }
}

/// Gives idle slots of `pool` back to the fleet once they have been idle [`IDLE_HOLD`]
/// (or at once when another process waits), until none is left.
async fn flush_idle(inner: Arc<Inner>, pool: String) {
    let Some(ps) = inner.pools.get(&pool) else {
        return;
    };
    // Should this task end early, the next idle slot must start another. (A second
    // flusher started in the moment between the flag going down under the lock and this
    // guard is harmless: both give idle slots back.)
    struct Flag<'a>(&'a AtomicBool);
    impl Drop for Flag<'_> {
        fn drop(&mut self) {
            self.0.store(false, Ordering::SeqCst);
        }
    }
    let _flag = Flag(&ps.idle_flusher);
    loop {
        let oldest = {
            let idle = lock(&ps.idle);
            match idle.iter().map(|s| s.since).min() {
                Some(t) => t,
                None => {
                    // Under the idle lock: a slot pushed after this sees the flag down.
                    ps.idle_flusher.store(false, Ordering::SeqCst);
                    return;
                }
            }
        };
        if !ps.others_wait() {
            tokio::time::sleep_until(oldest + IDLE_HOLD).await;
        }
        let due: Vec<IdleSlot> = {
            let mut idle = lock(&ps.idle);
            let now_all = ps.others_wait();
            let (due, keep) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|s| now_all || s.since.elapsed() >= IDLE_HOLD);
            *idle = keep;
            due
        };
        let releases = due
            .into_iter()
            .filter(|s| !s.lost.load(Ordering::SeqCst))
            .map(|s| release_idle(inner.clone(), pool.clone(), s));
        futures::future::join_all(releases).await;
    }
}

/// The release through Redis (batched with the others of this moment): token-checked,
/// handed to the longest-waiting process, or kept for a local waiter.
async fn release_to_fleet(
    inner: &Arc<Inner>,
    pool: &str,
    idx: u32,
    key: &str,
    value: &str,
    lost: &Arc<AtomicBool>,
    ask: bool,
) -> Result<(), SlotError> {
    {
        let mut held = lock(&inner.held);
        if held.get(key).is_some_and(|h| Arc::ptr_eq(&h.lost, lost)) {
            held.remove(key);
        }
        metrics::gauge!("llm_worker_slots_held").set(held.len() as f64);
    }
    if lost.load(Ordering::SeqCst) {
        return Ok(()); // not ours any more: never touch another holder's slot
    }
    if !inner.pools.contains_key(pool) {
        return Ok(());
    }
    let (tx, rx) = oneshot::channel();
    if ask && let Some(ps) = inner.pools.get(pool) {
        ps.asks.fetch_add(1, Ordering::SeqCst);
    }
    let lead = {
        let mut q = lock(&inner.releases);
        q.0.push(PendingRelease {
            pool: pool.to_string(),
            idx,
            key: key.to_string(),
            value: value.to_string(),
            ask,
            done: tx,
        });
        !std::mem::replace(&mut q.1, true)
    };
    if lead {
        // A task of its own: a caller that stops waiting (a timeout) cannot strand the
        // releases of others.
        tokio::spawn(run_releases(inner.clone()));
    }
    match rx.await {
        Ok(Ok(not_ours)) => {
            if not_ours {
                lease_lost(pool, idx, "found expired or taken at release");
            }
            Ok(())
        }
        Ok(Err(e)) => Err(SlotError::Release(e)),
        Err(_) => Err(SlotError::Release("the releaser stopped".into())),
    }
}

/// Runs release scripts until no release waits: each takes every release queued so far.
async fn run_releases(inner: Arc<Inner>) {
    // Should this task end early (a panic, the runtime shutting down), the next release
    // must lead again and nobody may wait forever: the guard clears the flag and answers
    // every queued release with an error (their slots' TTL frees them).
    struct Leader(Arc<Inner>);
    impl Drop for Leader {
        fn drop(&mut self) {
            let mut q = lock(&self.0.releases);
            q.1 = false;
            for p in q.0.drain(..) {
                if p.ask
                    && let Some(ps) = self.0.pools.get(&p.pool)
                {
                    ps.ask_answered();
                }
                let _ = p.done.send(Err("the releaser stopped".into()));
            }
        }
    }
    let _leader = Leader(inner.clone());
    loop {
        let batch = {
            let mut q = lock(&inner.releases);
            if q.0.is_empty() {
                q.1 = false;
                return;
            }
            std::mem::take(&mut q.0)
        };
        // Once the batch is answered (its keeps delivered), or this task ends early: the
        // jobs waiting for an asking release's answer go on (`PoolState::asks`).
        struct Answered<'a>(&'a Inner, Vec<String>);
        impl Drop for Answered<'_> {
            fn drop(&mut self) {
                for pool in &self.1 {
                    if let Some(ps) = self.0.pools.get(pool) {
                        ps.ask_answered();
                    }
                }
            }
        }
        let answered = Answered(
            &inner,
            batch
                .iter()
                .filter(|p| p.ask)
                .map(|p| p.pool.clone())
                .collect(),
        );
        let delay = *lock(&inner.release_delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let outcome = release_batch(&inner, &batch).await;
        drop(answered);
        for (i, p) in batch.into_iter().enumerate() {
            let r = match &outcome {
                Ok(status) => Ok(status.get(i).copied() == Some(0)),
                Err(e) => Err(e.to_string()),
            };
            if r.is_ok()
                && let Some(ps) = inner.pools.get(&p.pool)
            {
                ps.hint.store(p.idx, Ordering::Relaxed);
            }
            let _ = p.done.send(r);
        }
    }
}

/// One release script for `batch` (grouped by pool); per slot, in batch order: 0 = not
/// ours, 1 = released, 2 = handed to a waiter, 3 = kept for a local waiter (and given
/// to it before this returns).
///
/// For a pool with local waiters the script runs under the pool's `queue_lock` (the
/// keep may queue this process again, which only a step under that lock that has seen
/// a waiter here may do; see `leave_if_idle`), and is told how many waiters there are:
/// a slot whose next fleet-wide taker would be this process is kept rather than sent
/// round through Redis (hand-off stream, XREAD, pick-up).
async fn release_batch(
    inner: &Arc<Inner>,
    batch: &[PendingRelease],
) -> Result<Vec<i64>, SlotError> {
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by(|&a, &b| batch[a].pool.cmp(&batch[b].pool));
    let mut inv = release_invoke(inner, false);
    // Per pool group: the pool, the queue-lock guard if it has waiters, the keep prefix.
    let mut groups = Vec::new();
    let mut start = 0;
    while start < order.len() {
        let pool = &batch[order[start]].pool;
        let end = order[start..]
            .iter()
            .position(|&j| &batch[j].pool != pool)
            .map_or(order.len(), |n| start + n);
        let ps = inner
            .pools
            .get(pool)
            .ok_or_else(|| SlotError::UnknownPool(pool.clone()))?;
        let (guard, waiters) = if ps.has_waiters() {
            let g = ps.queue_lock.lock().await;
            let w = ps.live_waiters();
            (Some(g), w)
        } else {
            (None, 0)
        };
        // No job here waits for a slot, but a release of the group asks after a word
        // that no other process waited (`PendingRelease::ask`): the script is asked
        // (want -1) to keep one slot for this process's next job, which it does only if
        // still nobody else waits or this process heads the queue, never by fair share,
        // and tells no share; else it hands the slot on or frees it as before. With one
        // to keep the script never queues this process (it may take it out of the queue
        // on a keep, as any keep does; a waiter that came meanwhile is then retried
        // below), so the queue lock is not taken.
        let ask = waiters == 0
            && !ps.others_wait()
            && !inner.stopped.load(Ordering::SeqCst)
            && order[start..end].iter().any(|&j| batch[j].ask);
        let want = if ask { 1 } else { waiters };
        // For an asking group: the queueing tries so far, and whether one is on the wire.
        let tries_seen = ask.then(|| {
            (
                ps.queue_tries.load(Ordering::SeqCst),
                ps.queue_tries_out.load(Ordering::SeqCst) > 0,
            )
        });
        let keep_prefix = if want > 0 {
            format!("{}.", lease_value(inner))
        } else {
            String::new()
        };
        // The pool's other slots this process holds (the released ones left `held`).
        let mine = held_in_pool(inner, &ps.name);
        release_group_keys(&mut inv, ps);
        inv.arg(end - start)
            .arg(if ask { -1 } else { want as i64 })
            .arg(&keep_prefix)
            .arg(mine)
            .arg(ps.size);
        for &j in &order[start..end] {
            inv.key(&batch[j].key);
            inv.arg(batch[j].idx).arg(&batch[j].value);
        }
        groups.push((
            ps,
            guard,
            want,
            waiters,
            tries_seen,
            keep_prefix,
            start,
            end,
        ));
        start = end;
    }
    let asked_at = Instant::now();
    let sent = async {
        let mut conn = inner.conn.get().await?;
        let reply: Vec<i64> = inv.invoke(&mut conn).await?;
        Ok::<_, SlotError>(reply)
    };
    let reply = match sent.await {
        Ok(r) => r,
        Err(e) => {
            // The reply is lost, not necessarily the script: it may still run (Redis
            // stalled past the command timeout runs it when it resumes) and keep slots for
            // us that no lease here knows of, each for a full TTL; or it never ran and the
            // released leases stay until their TTL. Release both kinds of value, on
            // another connection, until Redis answers (`release_orphans`).
            let mut orphans = vec![];
            for (ps, ..) in &groups {
                // No word: the pool's slots go through the script until one comes.
                *lock(&ps.quiet_since) = (None, None);
                *lock(&ps.share) = None;
            }
            for (ps, _, want, _, _, keep_prefix, start, end) in &groups {
                for &j in &order[*start..*end] {
                    let p = &batch[j];
                    orphans.push((ps.name.clone(), p.idx, p.value.clone()));
                    for k in 1..=(*want).min(end - start) {
                        orphans.push((ps.name.clone(), p.idx, format!("{keep_prefix}{k}")));
                    }
                }
            }
            release_orphans(inner.clone(), orphans);
            return Err(e);
        }
    };
    // The script answers {released, handed, not_ours, then one status per slot in the
    // order sent}; put them back in batch order.
    let per_slot = reply.get(3..).unwrap_or(&[]);
    let mut status = vec![0; batch.len()];
    for (k, &j) in order.iter().enumerate() {
        status[j] = per_slot.get(k).copied().unwrap_or(0);
    }
    // Then, per pool group, how many other processes wait for the pool, then this
    // process's fair share of it.
    let others = per_slot.get(batch.len()..).unwrap_or(&[]);
    let shares = others.get(groups.len()..).unwrap_or(&[]);
    for (g, (ps, ..)) in groups.iter().enumerate() {
        // Stamped with when the script was sent, not when its answer came: a slow answer
        // must not make "nobody else waits" count as fresh for another QUIET_FOR.
        let quiet = others.get(g) == Some(&0);
        *lock(&ps.quiet_since) = (quiet.then_some(asked_at), None);
        *lock(&ps.share) = match shares.get(g) {
            Some(&share) if !quiet && share > 0 => Some((asked_at, share as u32)),
            _ => None,
        };
    }
    for (ps, guard, want, waiters, tries_seen, keep_prefix, start, end) in groups {
        // An asking group's script ran without the queue lock: a try of this process
        // that was on the wire with it, or sent since, may have queued the process after
        // the script kept a slot for it; then the process leaves the queue once no job
        // here waits (a queued process nobody here waits for would be handed slots).
        let raced =
            tries_seen.is_some_and(|(n, out)| out || ps.queue_tries.load(Ordering::SeqCst) != n);
        // The j-th slot kept in a group holds `keep_prefix` .. j (lua/slot_release.lua).
        let mut kept = 0;
        for &j in &order[start..end] {
            if status[j] == 3 {
                kept += 1;
                let value = format!("{keep_prefix}{kept}");
                let mut lease = make_lease(inner, ps, batch[j].idx, value, asked_at);
                if ps.has_waiters() || ps.others_wait() || inner.stopped.load(Ordering::SeqCst) {
                    deliver(ps, lease);
                } else {
                    // Kept for no job yet (an asking release's keep, or waiters that
                    // left): idle for this process's next job, as a release under a
                    // fresh word keeps it (`release_lease`), without a task between.
                    lease.done = true; // not released on drop: it stays held, idle
                    let value = std::mem::take(&mut lease.value);
                    push_idle(inner, ps, lease.idx, value, lease.lost.clone());
                }
            }
        }
        drop(guard);
        if (raced || waiters > kept) && !ps.has_waiters() {
            // The script queued us again for waiters that another path (a hand-off's
            // pick-up racing this release) has served since, or (`raced`) a try beside an
            // asking release did: leave the queue, or the next release would hand its
            // slot to a process that wants none.
            let (inner, name) = (inner.clone(), ps.name.clone());
            tokio::spawn(async move {
                if let Some(ps) = inner.pools.get(&name) {
                    leave_if_idle(&inner, ps).await;
                }
            });
        }
        // Waiters that came while the script ran were not counted in `want`: a waiter
        // that is not its pool's first relies on the driver, which (no hand-off coming
        // to wake it) would only try again at its next tick, up to 100 ms later at
        // Redis's default hz, while other slots of this batch were freed. Try for them now.
        // Only when the script served every waiter it was told of: then it took this
        // process out of the fleet queue (or never put it in), and may have freed the
        // batch's other slots. With waiters it was told of left over, it queued this
        // process again and freed nothing (a slot it did not keep went to another
        // process), so the new waiters wait in that queue like the rest, and a try would
        // almost always fail: with 8 processes on one pool that was one failed acquire
        // script for every release that asked (docs/performance.md, twenty-third round).
        // (It could succeed only on a slot another process freed while this one was out
        // of the queue for a hand-off's pick-up; that pick-up tries for the rest of its
        // waiters itself, a round trip later.)
        if kept > 0 && kept == want && ps.live_waiters() > 0 {
            spawn_retry(inner, ps);
        }
    }
    Ok(status)
}

/// Gives `lease` to the longest-waiting local waiter of its pool; drops (releases) it if
/// nobody waits any more.
fn deliver(ps: &PoolState, mut lease: Lease) {
    loop {
        let next = lock(&ps.waiters).pop_front();
        match next {
            Some(w) => match w.tx.send(lease) {
                Ok(()) => return,
                Err(back) => lease = back,
            },
            None => return, // dropped here -> released in the background
        }
    }
}

/// Serves this process's waiters. While any pool has one, blocks reading the hand-off
/// streams of every pool (from the last entry it read of each, so a hand-off for a pool
/// that began waiting during the read is not left for later) and takes the entries
/// addressed to it. Other processes' entries only move the marks on: the driver tries on
/// its own (a lease may have expired with its holder; liveness needs a refresh) only when
/// its deadline passes, the nearest known lease expiry and at most a second away, however
/// often other hand-offs wake it.
async fn driver(inner: Arc<Inner>, cancel: CancellationToken) {
    let mut conn: Option<MultiplexedConnection> = None;
    let mut failing = false;
    let mut backoff = Backoff::redis();
    let mut deadline: Option<Instant> = None;
    let pools: Vec<&PoolState> = inner.pools.values().collect();
    loop {
        if cancel.is_cancelled() || inner.stopped.load(Ordering::SeqCst) {
            return;
        }
        let waiting: Vec<&PoolState> = pools.iter().copied().filter(|p| p.has_waiters()).collect();
        if waiting.is_empty() {
            deadline = None;
            tokio::select! {
                _ = inner.driver_wake.notified() => continue,
                _ = cancel.cancelled() => return,
            }
        }
        let now = Instant::now();
        let fresh = now
            + waiting
                .iter()
                .map(|p| lock(&p.next_check).saturating_duration_since(now))
                .min()
                .unwrap_or(MAX_WAIT_TICK)
                .clamp(Duration::from_millis(2), MAX_WAIT_TICK);
        let due = deadline.map_or(fresh, |d| d.min(fresh));
        deadline = Some(due);
        let tick = due
            .saturating_duration_since(now)
            .max(Duration::from_millis(1));
        if conn.is_none() {
            let connected = async {
                let mut c = blocking_connection(&inner.cfg)
                    .await
                    .map_err(|e| e.to_string())?;
                // Bounded: the blocking connection has no reply timeout of its own.
                let stall = *lock(&inner.mark_check_delay);
                let check = async {
                    tokio::time::sleep(stall).await;
                    check_marks(&mut c, &pools).await
                };
                tokio::time::timeout(MARK_CHECK_BOUND, check)
                    .await
                    .map_err(|_| "no answer to the hand-off stream check".to_string())?;
                Ok::<_, String>(c)
            };
            let r = tokio::select! {
                r = connected => r,
                _ = cancel.cancelled() => return,
            };
            match r {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "slot waiter cannot reach Redis; retrying");
                        failing = true;
                    }
                    wait_after_failure(&inner, &mut backoff, &mut deadline, &cancel).await;
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let readable: Vec<&PoolState> = pools
            .iter()
            .copied()
            .filter(|p| !p.wake_broken.load(Ordering::Relaxed))
            .collect();
        if readable.is_empty() {
            // Nothing to read: the waiters' own tries serve them, at the deadline.
            tokio::select! {
                _ = tokio::time::sleep_until(due) => {}
                _ = cancel.cancelled() => return,
            }
            deadline = None;
            retry_waiting(&inner).await;
            continue;
        }
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT")
            .arg(WAKE_MAXLEN)
            .arg("BLOCK")
            .arg(tick.as_millis().max(1) as u64)
            .arg("STREAMS");
        for ps in &readable {
            cmd.arg(&ps.wake_key);
        }
        for ps in &readable {
            cmd.arg(lock(&ps.wake_last).as_str());
        }
        let xread = cmd.query_async::<Option<redis::streams::StreamReadReply>>(c);
        let r = tokio::select! {
            r = tokio::time::timeout(tick + Duration::from_secs(2), xread) => r,
            _ = cancel.cancelled() => return,
        };
        let read = match r {
            Ok(Ok(v)) => {
                if failing {
                    tracing::info!("slot waiter reached Redis again");
                    failing = false;
                }
                backoff.reset();
                v
            }
            Ok(Err(e)) => {
                if !failing {
                    tracing::warn!(error = %e, "slot waiter lost Redis; retrying");
                    failing = true;
                }
                // Reconnecting checks every stream again (and leaves out one that
                // cannot be read).
                conn = None;
                wait_after_failure(&inner, &mut backoff, &mut deadline, &cancel).await;
                continue;
            }
            Err(_) => {
                conn = None;
                continue;
            }
        };
        // Ours, in stream order per pool; every entry read moves the pool's mark on.
        let mut ours: Vec<(&PoolState, u32)> = vec![];
        for sk in read.map(|r| r.keys).unwrap_or_default() {
            let Some(ps) = pools.iter().find(|p| p.wake_key == sk.key) else {
                continue;
            };
            for e in sk.ids {
                let to: Option<String> = e.get("t");
                let idx: Option<u32> = e.get("i");
                if to.as_deref() == Some(inner.token.as_str())
                    && let Some(idx) = idx.filter(|&i| i < ps.size)
                {
                    ours.push((ps, idx));
                }
                *lock(&ps.wake_last) = e.id;
            }
        }
        for (ps, idx) in ours {
            pick_up(&inner, ps, idx).await;
        }
        if Instant::now() >= due {
            deadline = None;
            retry_waiting(&inner).await;
        }
    }
}

/// How long the driver waits for the hand-off stream check of a fresh connection.
const MARK_CHECK_BOUND: Duration = Duration::from_secs(2);

/// After a failed connect, check or read: waits the next backoff step, but never past the
/// driver's deadline, when the local waiters get their try (each refreshes this process's
/// liveness: it must not look gone to the fleet because the hand-off streams cannot be
/// read).
async fn wait_after_failure(
    inner: &Arc<Inner>,
    backoff: &mut Backoff,
    deadline: &mut Option<Instant>,
    cancel: &CancellationToken,
) {
    let step = Instant::now() + backoff.next_delay(rand::random::<f64>());
    let until = deadline.map_or(step, |due| due.min(step));
    tokio::select! {
        _ = tokio::time::sleep_until(until) => {}
        _ = cancel.cancelled() => return,
    }
    if deadline.is_none_or(|due| Instant::now() >= due) {
        *deadline = None;
        retry_waiting(inner).await;
    }
}

/// One try for every pool with local waiters (see [`retry_pool`]).
async fn retry_waiting(inner: &Arc<Inner>) {
    for ps in inner.pools.values() {
        if ps.has_waiters() {
            retry_pool(inner, ps).await;
        }
    }
}

/// Parses a stream entry id `<ms>-<seq>` for ordering.
fn entry_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

/// On every (re)connection of the driver: a hand-off stream whose newest entry is older
/// than our mark was recreated with lower ids (Redis restarted from an older state, a
/// replica was promoted, its clock went back). Reading on from the mark would miss every
/// hand-off until the ids catch up, so read it again from the start (old entries
/// addressed to us are refused at pick-up; see `lua/slot_renew.lua`).
async fn check_marks(c: &mut MultiplexedConnection, pools: &[&PoolState]) {
    for ps in pools {
        match crate::connect::stream_end(c, &ps.wake_key).await {
            Ok(end) => {
                if ps.wake_broken.swap(false, Ordering::Relaxed) {
                    tracing::info!(pool = %ps.name, key = %ps.wake_key, "slot hand-off stream readable again");
                }
                let mut mark = lock(&ps.wake_last);
                if entry_id(&end) < entry_id(&mark) {
                    tracing::info!(pool = %ps.name, "slot hand-off stream restarted below our mark; reading it from the start");
                    *mark = "0-0".to_string();
                }
            }
            Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => return,
            Err(e) => {
                // Another type, or refused: leave it out, or no pool's hand-off would be
                // read. Its waiters are still served by their own tries.
                if !ps.wake_broken.swap(true, Ordering::Relaxed) {
                    tracing::error!(pool = %ps.name, key = %ps.wake_key, error = %e, "slot hand-off stream cannot be read; its waiters are served by their own tries (delete or fix the key)");
                }
            }
        }
    }
}

/// Takes slot `idx` of `ps`, handed to this process: extends its short hand-off lease to a
/// full one and gives it to the longest local waiter (or hands it on, if nobody here
/// waits any more).
async fn pick_up(inner: &Arc<Inner>, ps: &PoolState, idx: u32) {
    if !ps.has_waiters() {
        // Nobody here wants it any more: release (hand on) at once. A handed slot holds
        // the bare process token; the release touches the key only if it still does, and
        // no lease of the held table is involved (the entry may be old, and a lease of
        // ours may hold that slot now).
        // One pass, within the hand-off lease (after it the key has lapsed anyway): a
        // later pass could meet a newer hand-off of the same slot to this process, which
        // holds the same bare token, and take a local waiter's turn.
        release_values(
            inner.clone(),
            vec![(ps.name.clone(), idx, inner.token.clone())],
            inner.handoff,
            1,
        );
        return;
    }
    // Pick up: the hand-off came with a short lease; make it a full one before
    // any call runs on it.
    // The pick-up also stamps the lease's own value over the bare token.
    let value = lease_value(inner);
    let asked_at = Instant::now();
    match renew(inner, &[(ps, idx, &inner.token, &value)], &[])
        .await
        .map(|r| r.first().copied())
    {
        Ok(Some(Renewed::Extended | Renewed::Retaken)) => {
            deliver(ps, make_lease(inner, ps, idx, value, asked_at));
        }
        Ok(_) => {
            tracing::debug!(pool = %ps.name, slot = idx, "handed slot taken by another before pick-up");
        }
        Err(e) => {
            // Not ours for long: the short hand-off lease frees it for the fleet.
            tracing::debug!(error = %e, pool = %ps.name, slot = idx, "slot pick-up failed");
        }
    }
    // Still waiting here: queue again at the tail (round robin between processes).
    // Nobody left: make sure we are out of the queue (a keep racing this pick-up
    // may have queued us again for the waiter this pick-up served).
    if ps.has_waiters() {
        retry_pool(inner, ps).await;
    } else {
        leave_if_idle(inner, ps).await;
    }
}

/// Releases slot values this process may hold without a lease: those of a release
/// script whose reply was lost (the released leases, and the slots it may have kept for
/// local waiters). Retried until Redis answers (at most one TTL, after which the keys
/// have expired anyway), then once more after twice the command timeout: the lost
/// script, queued on a connection since dropped, may run after the first retry.
/// A value that is not (or no longer) the slot's is left alone by the script.
fn release_orphans(inner: Arc<Inner>, orphans: Vec<(String, u32, String)>) {
    let within = inner.ttl;
    release_values(inner, orphans, within, 2);
}

/// Releases `values` (pool, slot, value) in a task of its own: `passes` scripts that Redis
/// answered, retried until then for at most `within`.
fn release_values(
    inner: Arc<Inner>,
    orphans: Vec<(String, u32, String)>,
    within: Duration,
    passes_wanted: u32,
) {
    tokio::spawn(async move {
        let deadline = Instant::now() + within;
        let mut passes = 0;
        while passes < passes_wanted && Instant::now() < deadline {
            let mut inv = release_invoke(&inner, false);
            for (pool, idx, value) in &orphans {
                let Some(ps) = inner.pools.get(pool) else {
                    continue;
                };
                let Some(key) = ps.slot_keys.get(*idx as usize) else {
                    continue;
                };
                release_group_keys(&mut inv, ps);
                inv.key(key);
                // No local waiter (0), and m not known here (""): the script deletes this
                // process's count word rather than write a wrong one (slot_release.lua).
                inv.arg(1).arg(0).arg("").arg("").arg(ps.size);
                inv.arg(*idx).arg(value);
            }
            let sent = async {
                let mut conn = inner.conn.get().await?;
                let _: Vec<i64> = inv.invoke(&mut conn).await?;
                Ok::<_, SlotError>(())
            };
            match sent.await {
                Ok(()) => {
                    passes += 1;
                    tokio::time::sleep(inner.cfg.redis.command_timeout_ms * 2).await;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    });
}

/// [`retry_pool`] in a task of its own (it waits for the pool's queue lock).
fn spawn_retry(inner: &Arc<Inner>, ps: &PoolState) {
    let (inner, name) = (inner.clone(), ps.name.clone());
    tokio::spawn(async move {
        if let Some(ps) = inner.pools.get(&name) {
            retry_pool(&inner, ps).await;
        }
    });
}

/// Takes free slots for the local waiters until none is free (this process is then queued
/// fleet-wide) or nobody waits here any more. Taking a slot leaves the fleet queue, so
/// stopping after one while waiters remain would leave them unqueued until the driver's
/// next tick, with releases elsewhere deleting slots instead of handing them over. (That
/// "2 ms" tick is a blocking read's timeout, which Redis only checks on its `hz` timer: up to 100 ms
/// at the default hz 10; measured p99 hand-off gap 80 ms before this loop, 2.3 ms after.)
async fn retry_pool(inner: &Arc<Inner>, ps: &PoolState) {
    let _queue = ps.queue_lock.lock().await;
    loop {
        if inner.stopped.load(Ordering::SeqCst) {
            return; // released everything; take nothing more
        }
        if !ps.has_waiters() {
            return; // a try now would queue this process with nobody here waiting
        }
        // After a failed try (its script may still run late and take slots nobody here
        // knows of, until their TTL), ask for one slot at a time until a try succeeds.
        let want = if ps.try_failed.load(Ordering::SeqCst) {
            1
        } else {
            lock(&ps.waiters).len().max(1)
        };
        let tried = try_take(inner, ps, true, want).await;
        ps.try_failed.store(tried.is_err(), Ordering::SeqCst);
        match tried {
            Ok(Try::Got(taken, sent)) => {
                *lock(&ps.next_check) = Instant::now();
                for i in taken {
                    deliver(ps, make_lease(inner, ps, i.0, i.1, sent));
                }
                if !ps.has_waiters() {
                    return;
                }
            }
            Ok(Try::Wait(d)) => {
                *lock(&ps.next_check) = Instant::now() + d;
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, pool = %ps.name, "slot retry failed");
                *lock(&ps.next_check) = Instant::now() + Duration::from_millis(100);
                return;
            }
        }
    }
}

/// What the renew script did with one key (see `lua/slot_renew.lua`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Renewed {
    /// Still ours; extended to the full TTL.
    Extended,
    /// Had lapsed and nobody was given it since: ours again (a paused or cut-off holder
    /// catching up, or a late pick-up).
    Retaken,
    /// Someone else's now: the lease is lost.
    Lost,
}

/// One renew script for `items` (pool, slot index), which also ticks the lease clock of
/// every pool in `tick_pools`. One answer per item, in order. Used for renewal and for
/// the pick-up of a handed slot alike.
/// `items`: (pool, slot, the value the lease holds now, the value it is to hold).
async fn renew(
    inner: &Inner,
    items: &[(&PoolState, u32, &str, &str)],
    tick_pools: &[&PoolState],
) -> Result<Vec<Renewed>, SlotError> {
    let mut inv = crate::scripts::Call::new(&inner.renew_script);
    inv.arg(&inner.token)
        .arg(inner.ttl.as_millis() as u64)
        .arg(stall_gap(inner.ttl).as_millis() as u64);
    let mut groups: Vec<&PoolState> = tick_pools.to_vec();
    for (ps, ..) in items {
        if !groups.iter().any(|g| g.name == ps.name) {
            groups.push(ps);
        }
    }
    let mut order = Vec::with_capacity(items.len());
    for g in &groups {
        let mine: Vec<(usize, u32, &str, &str)> = items
            .iter()
            .enumerate()
            .filter(|(_, (ps, ..))| ps.name == g.name)
            .map(|(n, (_, i, have, want))| (n, *i, *have, *want))
            .collect();
        // Every slot key of the pool: the script's lease clock may restore any of them.
        inv.key(&g.lease_key);
        for k in &g.slot_keys {
            inv.key(k);
        }
        inv.arg(g.size).arg(mine.len());
        for (n, i, have, want) in mine {
            inv.arg(i).arg(have).arg(want);
            order.push(n);
        }
    }
    let mut conn = inner.conn.get().await?;
    let flags: Vec<i64> = inv.invoke(&mut conn).await?;
    let mut out = vec![Renewed::Lost; items.len()];
    for (n, f) in order.into_iter().zip(flags) {
        out[n] = match f {
            1 => Renewed::Extended,
            2 => Renewed::Retaken,
            _ => Renewed::Lost,
        };
    }
    Ok(out)
}

/// Every `ttl / 8`, in one script: renews every lease this process holds and ticks the
/// lease clock of every pool, even when nothing is held (that tick is what lets the
/// scripts tell a Redis stall from a quiet fleet; see `lua/slot_clock.lua`). A lapsed
/// lease whose slot is still free is taken again; one held by someone else is marked
/// lost, so its release never touches the key.
async fn renewer(inner: Arc<Inner>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(clock_tick(inner.ttl));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let all: Vec<&PoolState> = inner.pools.values().collect();
    let mut renew_failing = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = cancel.cancelled() => return,
        }
        let due: Vec<(String, Arc<AtomicBool>, String, u32, String)> = lock(&inner.held)
            .iter()
            .map(|(k, h)| {
                let (lost, pool) = (h.lost.clone(), h.pool.clone());
                (k.clone(), lost, pool, h.idx, h.value.clone())
            })
            .collect();
        let items: Vec<(&PoolState, u32, &str, &str)> = due
            .iter()
            .filter_map(|(_, _, pool, idx, v)| {
                inner
                    .pools
                    .get(pool)
                    .map(|ps| (ps, *idx, v.as_str(), v.as_str()))
            })
            .collect();
        if items.len() != due.len() {
            continue; // unreachable: leases are only made for known pools
        }
        let sent = Instant::now();
        match renew(&inner, &items, &all).await {
            Ok(flags) => {
                for ((key, lost, pool, idx, _), r) in due.iter().zip(flags) {
                    if matches!(r, Renewed::Extended | Renewed::Retaken)
                        && let Some(h) = lock(&inner.held).get_mut(key)
                        && Arc::ptr_eq(&h.lost, lost)
                    {
                        h.confirmed = sent;
                    }
                    match r {
                        Renewed::Extended => {}
                        Renewed::Retaken => {
                            tracing::warn!(
                                pool = %pool,
                                slot = idx,
                                "slot lease had lapsed (process paused or cut off from Redis); \
                                 the slot was still free and is ours again"
                            );
                            metrics::counter!("llm_worker_slot_leases_retaken_total", "pool" => pool.clone())
                                .increment(1);
                        }
                        Renewed::Lost => {
                            // Only a lease still in the table was lost; one whose release
                            // ran while this renewal was on the wire was simply released.
                            let mut held = lock(&inner.held);
                            let current = held.get(key).is_some_and(|h| Arc::ptr_eq(&h.lost, lost));
                            if current {
                                held.remove(key);
                            }
                            drop(held);
                            if current && !lost.swap(true, Ordering::SeqCst) {
                                lease_lost(
                                    pool,
                                    *idx,
                                    "expired and taken by another holder before renewal \
                                     (process paused or cut off from Redis)",
                                );
                            }
                        }
                    }
                }
            }
            Err(e) => {
                if !renew_failing {
                    tracing::warn!(error = %e, "slot renewal failed; retrying every tick (time Redis cannot answer does not count against a lease; a lease of this process lapses only if Redis answers others but not us past slots.ttl_ms)");
                    renew_failing = true;
                }
                continue;
            }
        }
        if renew_failing {
            tracing::info!("slot renewal works again");
            renew_failing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_keys_share_the_hash_tag() {
        let k = SlotKeys::new("llm");
        assert_eq!(k.slot("default", 3), "{llm}:slot:default:3");
        for key in [
            k.pool_size("p"),
            k.slot_queue("p"),
            k.lease("p"),
            k.waiter_alive("p"),
            k.wake("p"),
        ] {
            assert!(key.starts_with("{llm}:"), "{key}");
        }
    }
}
