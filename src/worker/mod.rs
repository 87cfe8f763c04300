//! One job's lifecycle, and the reader loop that feeds jobs to at most
//! `worker.concurrency + worker.read_ahead` job tasks (at most `worker.concurrency` of
//! them worked on). Rooms: [`reader`] (read, reclaim, spawn), [`lifecycle`]
//! (one job from parse to decision), [`bill`] (usage and exact cost), [`commit`] (the
//! job's end written with its acknowledgement), [`keepalive`] (running entries kept
//! ours), [`cancels`] (tasks' own cancel-marker reads, gathered); this file holds the
//! `Worker`.
//!
//! Invariants:
//! - never more jobs read than there are free read permits (`worker.concurrency +
//!   worker.read_ahead`, back-pressure); at most `worker.concurrency` jobs are worked on
//!   (a job permit from the parse to the decision), the rest wait for one, read ahead,
//!   or commit;
//! - a job is acknowledged with its result ([`Queue::commit`]), or without one only when
//!   it moves on: handed back as a new entry ([`Queue::hand_back`]) or found deleted from
//!   the stream while pending ([`Queue::reclaim`]);
//! - one task per entry in this process: an entry in `active`, or among the last
//!   [`RECENTLY_FINISHED`] it settled, is never started again (a self-reclaim is
//!   skipped), and a task's bookkeeping is undone by its drop guard;
//! - a job without a producer id that is delivered again calls no model unless its entry
//!   is still pending under this consumer right before the call;
//! - no provider call starts after the first signal; a job stopped by shutdown without a
//!   result is handed back to the fleet (or, if Redis is away, left pending);
//! - every provider call starts holding a slot of its model's pool and keeps it unless
//!   the lease is lost (this process paused or cut off alone past `slots.ttl_ms` while
//!   another takes the slot; logged and counted); its release is detached from the job,
//!   so it never stands between a paid answer and its commit.

mod bill;
mod cancels;
mod commit;
mod keepalive;
mod lifecycle;
mod reader;

use bill::*;
use keepalive::*;
use lifecycle::*;

use crate::backoff::Backoff;
use crate::config::Config;
use crate::cost::Price;
use crate::provider::{self, ProviderClient};
use crate::queue::{Queue, ResultStatus};
use crate::router::RetryPolicy;
use crate::slots::Slots;
use crate::sync::{FastMap, FastSet};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::state::WorkerState;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Provider(#[from] provider::ProviderError),
}

pub struct Worker {
    cfg: Arc<Config>,
    queue: Queue,
    slots: Slots,
    providers: FastMap<String, Arc<ProviderClient>>,
    prices: FastMap<String, Price>,
    policy: RetryPolicy,
    pub state: Arc<WorkerState>,
    /// Entries this process is working on: entry id -> job id (for keepalive; empty until
    /// the payload is parsed). An entry is added when its task is spawned and removed by
    /// the task's [`JobGuard`] on any exit (return, panic, cancellation), so keepalive
    /// never keeps alive an entry nobody works on, and no second task starts on it.
    active: Mutex<FastMap<String, String>>,
    /// Entries whose task ended settled (committed, or found committed elsewhere), the
    /// last [`RECENTLY_FINISHED`] settles, with when (see [`Recent`]): a reclaim racing
    /// that commit may still return one, and it must not start again. Only a reclaim that began before
    /// the finish can (see `is_active_or_finished`); an entry reclaimed by a later one
    /// lost its commit in Redis (a failover to a replica that had not received it, a
    /// restart from an older snapshot) and must run again.
    finished: Mutex<Recent>,
    /// Entries of `active` the keepalive found no longer pending under this worker (taken
    /// over by another after a pause, or acknowledged elsewhere): a job not yet calling
    /// must not call (another worker owns it and may be calling already).
    taken_over: Mutex<FastSet<String>>,
    /// Entries of `active` whose job claimed its producer id (`lua/claim_id.lua`): only
    /// their in-progress markers are kept by the keepalive.
    claimed: Mutex<FastSet<String>>,
    /// Each running job's stop switch, by entry id: (job id, token). The cancel watcher
    /// ([`keepalive`]) fires the token of a job whose id got a cancel marker; the job's
    /// loop ends on it (or on its `deadline_ms`) with its call aborted. Registered once
    /// the payload is parsed, removed by the [`JobGuard`].
    stops: Mutex<FastMap<String, (String, CancellationToken)>>,
    /// The job permit of each task being worked on, by entry id: taken before the parse
    /// (a task read ahead waits for one), given back at the decision (so the next job
    /// starts while this one commits), or by a copy of a busy job id while it waits
    /// (`wait_for_busy_id`); the guard drops the rest.
    permits: Mutex<FastMap<String, OwnedSemaphorePermit>>,
    /// At most `worker.concurrency` job tasks hold a job permit.
    sem: Arc<Semaphore>,
    /// The read permit of each task, by entry id, from its read to its end (commit
    /// included): the reader reads only for a free one. A copy of a busy job id gives
    /// it back while it waits, as it does its job permit.
    read_permits: Mutex<FastMap<String, OwnedSemaphorePermit>>,
    /// `worker.concurrency + worker.read_ahead` read permits: entries this process holds
    /// (worked on, read ahead and waiting, or committing), copies of busy ids aside.
    read_sem: Arc<Semaphore>,
    /// Fired on the first signal (mirrors `run`'s `stop`): no job starts a provider call
    /// after it; jobs not yet calling give up and are handed back.
    draining: CancellationToken,
    /// Fired when the reader loop has ended: hand-backs wait for it, so a draining worker
    /// never reads its own handed-back entries (its last blocking read is not cut short).
    reader_stopped: CancellationToken,
    /// CLIENT ID was refused once (logged once).
    warned_client_id: std::sync::atomic::AtomicBool,
    /// Slot releases after a call, detached from their job (see
    /// `Worker::release_detached`); `run` waits for them, bounded, before it returns.
    releases: tokio_util::task::TaskTracker,
    /// Fleet-wide spending budgets (reserve before a call, settle after it).
    budgets: crate::budget::Budgets,
    /// Fleet-wide rpm / tpm limits (admit before a call, correct the tokens after it).
    rates: crate::ratelimit::RateLimits,
    /// The one script each before and after a call for budgets and rate limits together.
    gate: crate::gate::Gate,
    /// Fleet-wide rate room admitted for several calls at once, drawn on locally.
    rate_blocks: crate::ratelimit::Blocks,
    /// This process's budget blocks (several calls' worst cases reserved at once).
    budget_blocks: crate::budget::blocks::Blocks,
    /// When each budget last said (in the log) that it parks jobs.
    park_announced: Mutex<std::collections::HashMap<String, tokio::time::Instant>>,
    /// Models and providers the fleet routes around for a while.
    pub cooldowns: crate::cooldown::Cooldowns,
    /// Tenant places under `pools.<p>.max_per_tenant` (admit or park before a slot).
    tenants: crate::tenants::Tenants,
    /// Per configured model, its /metrics handles (registered once: a call records
    /// without building label strings).
    model_metrics: FastMap<String, ModelMetrics>,
    /// The job path's own /metrics handles.
    job_metrics: JobMetrics,
    /// While a budget with `on_exhausted = "pause"` has no room: until when the reader
    /// takes no new jobs (each paused job pushes it on while it still waits).
    paused_until: Mutex<Option<Instant>>,
    /// Tasks of jobs without a producer id waiting for a job permit (read ahead), by
    /// entry id: (job id, the newest later read of its cancel marker). Each read's cancel
    /// check, beside the read, asks for their markers too, so a task that waited longer
    /// than `CANCEL_CHECK_FRESH` for its permit mostly finds a read that recent and makes
    /// no round trip of its own before its call (at 40 jobs/s it made one a job). Only a
    /// read with a job without an id among its entries sends that command. Registered by
    /// the task while it waits; its [`AwaitGuard`] removes it.
    awaiting: Arc<Mutex<Awaiting>>,
    /// The cancel-marker reads tasks make of their own before a call, gathered into one
    /// command while one is out (see [`cancels`]); the waiters next in line ride along.
    cancel_reads: Arc<cancels::CancelReads>,
    /// Tasks waiting for a job permit (read ahead), and a wake-up for the reader each
    /// time one gets it: the reader holds its next read back while half the read-ahead
    /// or more still waits (see `Worker::run`).
    in_line: std::sync::atomic::AtomicUsize,
    place_taken: tokio::sync::Notify,
}

/// The tasks waiting for a job permit, by entry id: (job id, its later reads' word).
pub(super) type Awaiting = FastMap<String, (String, Arc<Recheck>)>;

/// The newest read of a waiting task's cancel marker sent after the one with its entry:
/// when it was sent, and whether it found the marker. Found stays found (a cancel is never
/// taken back); a read sent earlier never replaces a later one.
pub(super) struct Recheck {
    /// Registration order: job permits go first come, first served, so the lowest are
    /// the next to start (see [`next_in_line`]).
    order: u64,
    last: Mutex<Option<(Instant, bool)>>,
}

impl Recheck {
    pub(super) fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Recheck {
            order: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            last: Mutex::new(None),
        }
    }

    /// A read of the marker sent at `sent` found it (`true`) or not.
    pub(super) fn record(&self, sent: Instant, found: bool) {
        let mut r = crate::sync::lock(&self.last);
        match *r {
            Some((_, true)) => {}
            Some((t, false)) if !found && t >= sent => {}
            _ => *r = Some((sent, found)),
        }
    }

    /// `Some(true)`: a read found the marker; `Some(false)`: a read sent less than
    /// `fresh` ago found none; `None`: no such read (the task reads it itself).
    pub(super) fn status(&self, fresh: std::time::Duration) -> Option<bool> {
        match *crate::sync::lock(&self.last) {
            Some((_, true)) => Some(true),
            Some((t, false)) if t.elapsed() < fresh => Some(false),
            _ => None,
        }
    }
}

/// The waiting tasks whose markers a read asks for again: at most `cap` (the job
/// concurrency), those registered first, which are the next to get a job permit; so the
/// command stays small whatever `read_ahead` is (up to 10,000).
pub(super) fn next_in_line(
    awaiting: &FastMap<String, (String, Arc<Recheck>)>,
    cap: usize,
) -> Vec<(String, Arc<Recheck>)> {
    let mut all: Vec<&(String, Arc<Recheck>)> = awaiting.values().collect();
    if all.len() > cap {
        all.select_nth_unstable_by_key(cap, |(_, r)| r.order);
        all.truncate(cap);
    }
    all.into_iter().cloned().collect()
}

impl Worker {
    /// The waiting tasks whose markers ride along in a cancel read (see `awaiting`).
    pub(super) fn waiters_to_recheck(&self) -> Vec<(String, Arc<Recheck>)> {
        next_in_line(
            &crate::sync::lock(&self.awaiting),
            self.cfg.worker.concurrency(),
        )
    }
}

/// Records a read's answers for the waiters that rode along in it (`flags` in their
/// order; `sent`: when the read was sent).
pub(super) fn record_rechecks(waiting: &[(String, Arc<Recheck>)], sent: Instant, flags: &[bool]) {
    for ((_, r), &found) in waiting.iter().zip(flags) {
        r.record(sent, found);
    }
}

/// The read behind [`Worker::cancel_reads`]: the markers of the ids asked, with the
/// markers of the waiters next in line (at most `cap`) riding along in the same MGET
/// and recorded for them; bounded (1 s).
fn marker_reader(queue: Queue, awaiting: Arc<Mutex<Awaiting>>, cap: usize) -> cancels::ReadMarkers {
    Arc::new(move |ids: Vec<String>| {
        let (queue, awaiting) = (queue.clone(), awaiting.clone());
        Box::pin(async move {
            let riders = next_in_line(&crate::sync::lock(&awaiting), cap);
            let all: Vec<&str> = ids
                .iter()
                .map(String::as_str)
                .chain(riders.iter().map(|(id, _)| id.as_str()))
                .collect();
            let sent = Instant::now();
            let bound = std::time::Duration::from_secs(1);
            let mut flags = match tokio::time::timeout(bound, queue.cancelled(&all)).await {
                Ok(r) => r?,
                Err(_) => return Err(crate::queue::QueueError::Timeout(bound)),
            };
            if flags.len() != all.len() {
                return Err(cancels::wrong_count(flags.len(), all.len()));
            }
            record_rechecks(&riders, sent, &flags[ids.len()..]);
            flags.truncate(ids.len());
            Ok(flags)
        })
    })
}

/// Removes a waiting task from [`Worker::awaiting`] however its wait ends (only its own
/// registration: the same entry registered again by another task stays).
pub(super) struct AwaitGuard<'a>(
    pub(super) &'a Worker,
    pub(super) &'a str,
    pub(super) Option<Arc<Recheck>>,
);

impl Drop for AwaitGuard<'_> {
    fn drop(&mut self) {
        let Some(mine) = &self.2 else { return };
        let mut a = crate::sync::lock(&self.0.awaiting);
        if a.get(self.1).is_some_and(|(_, r)| Arc::ptr_eq(r, mine)) {
            a.remove(self.1);
        }
    }
}

/// One model's /metrics handles.
pub(crate) struct ModelMetrics {
    model: String,
    /// `llm_worker_provider_calls_total` per outcome of [`CALL_OUTCOMES`], registered at
    /// its first call (so /metrics shows only outcomes that happened, as before).
    calls: [std::sync::OnceLock<metrics::Counter>; CALL_OUTCOMES.len()],
    pub(crate) cost_picodollars: metrics::Counter,
    pub(crate) tokens_input: metrics::Counter,
    pub(crate) tokens_output: metrics::Counter,
    pub(crate) tokens_cached: metrics::Counter,
    pub(crate) tokens_cache_write: metrics::Counter,
    pub(crate) call_seconds: metrics::Histogram,
}

impl ModelMetrics {
    fn new(model: &str) -> ModelMetrics {
        let m = model.to_string();
        let tokens = |kind: &'static str| metrics::counter!("llm_worker_tokens_total", "model" => m.clone(), "kind" => kind);
        ModelMetrics {
            model: m.clone(),
            calls: Default::default(),
            cost_picodollars: metrics::counter!("llm_worker_cost_picodollars_total", "model" => m.clone()),
            tokens_input: tokens("input"),
            tokens_output: tokens("output"),
            tokens_cached: tokens("cached"),
            tokens_cache_write: tokens("cache_write"),
            call_seconds: metrics::histogram!("llm_worker_provider_call_seconds", "model" => m.clone()),
        }
    }

    /// Counts one call of this model that ended with the outcome at `at` in
    /// [`CALL_OUTCOMES`].
    pub(crate) fn count_call(&self, at: usize) {
        self.calls[at]
            .get_or_init(|| {
                metrics::counter!("llm_worker_provider_calls_total", "model" => self.model.clone(), "outcome" => CALL_OUTCOMES[at])
            })
            .increment(1);
    }
}

/// The job path's own /metrics handles, each registered at its first use (a job's
/// start and end record without building a label or looking the series up; /metrics
/// shows a series once it has one, as it did when every use went through the registry).
#[derive(Default)]
pub(crate) struct JobMetrics {
    /// `llm_worker_jobs_total` per status of [`ResultStatus::ALL`].
    jobs_total: [std::sync::OnceLock<metrics::Counter>; ResultStatus::ALL.len()],
    in_flight: std::sync::OnceLock<metrics::Gauge>,
    job_seconds: std::sync::OnceLock<metrics::Histogram>,
    commit_seconds: std::sync::OnceLock<metrics::Histogram>,
}

impl JobMetrics {
    /// Counts one job that ended with `status` in `llm_worker_jobs_total`.
    pub(crate) fn count(&self, status: ResultStatus) {
        self.jobs_total[status.index()]
            .get_or_init(|| metrics::counter!("llm_worker_jobs_total", "status" => status.as_str()))
            .increment(1);
    }
    /// `llm_worker_jobs_in_flight`.
    pub(crate) fn in_flight(&self) -> &metrics::Gauge {
        self.in_flight
            .get_or_init(|| metrics::gauge!("llm_worker_jobs_in_flight"))
    }
    /// `llm_worker_job_seconds`.
    pub(crate) fn job_seconds(&self) -> &metrics::Histogram {
        self.job_seconds
            .get_or_init(|| metrics::histogram!("llm_worker_job_seconds"))
    }
    /// `llm_worker_commit_seconds`.
    pub(crate) fn commit_seconds(&self) -> &metrics::Histogram {
        self.commit_seconds
            .get_or_init(|| metrics::histogram!("llm_worker_commit_seconds"))
    }
}

/// The fleet-wide quota rooms a worker uses, built by the daemon.
pub struct Quotas {
    pub budgets: crate::budget::Budgets,
    pub rates: crate::ratelimit::RateLimits,
    pub gate: crate::gate::Gate,
    pub cooldowns: crate::cooldown::Cooldowns,
    pub tenants: crate::tenants::Tenants,
}

impl Worker {
    pub fn new(
        cfg: Arc<Config>,
        queue: Queue,
        slots: Slots,
        quotas: Quotas,
    ) -> Result<Worker, WorkerError> {
        let Quotas {
            budgets,
            rates,
            gate,
            cooldowns,
            tenants,
        } = quotas;
        let cfg_concurrency = cfg.worker.concurrency();
        let cfg_read_ahead = cfg.worker.read_ahead();
        let cfg_models: Vec<String> = cfg.models.keys().cloned().collect();
        let mut providers = FastMap::default();
        for (name, p) in &cfg.providers {
            providers.insert(name.clone(), Arc::new(ProviderClient::new(name, p)?));
        }
        let prices = cfg
            .models
            .iter()
            .map(|(n, m)| {
                (
                    n.clone(),
                    Price {
                        input_per_mtok: m.input_per_mtok,
                        output_per_mtok: m.output_per_mtok,
                        cached_input_per_mtok: m.cached_input_per_mtok,
                        cache_write_per_mtok: m.cache_write_per_mtok,
                    },
                )
            })
            .collect();
        let policy = RetryPolicy {
            max_attempts_per_model: cfg.retry.max_attempts_per_model.get(),
            base_delay: cfg.retry.base_delay_ms,
            max_delay: cfg.retry.max_delay_ms,
            max_retry_after: cfg.retry.max_retry_after_ms,
        };
        let awaiting = Arc::new(Mutex::new(FastMap::default()));
        let cancel_reads = Arc::new(cancels::CancelReads::new(marker_reader(
            queue.clone(),
            awaiting.clone(),
            cfg_concurrency,
        )));
        Ok(Worker {
            cfg,
            queue,
            slots,
            providers,
            prices,
            policy,
            state: Arc::new(WorkerState::default()),
            active: Mutex::default(),
            finished: Mutex::new(Recent::default()),
            taken_over: Mutex::default(),
            claimed: Mutex::default(),
            stops: Mutex::default(),
            permits: Mutex::default(),
            sem: Arc::new(Semaphore::new(cfg_concurrency)),
            read_permits: Mutex::default(),
            read_sem: Arc::new(Semaphore::new(cfg_concurrency + cfg_read_ahead)),
            draining: CancellationToken::new(),
            reader_stopped: CancellationToken::new(),
            warned_client_id: std::sync::atomic::AtomicBool::new(false),
            releases: tokio_util::task::TaskTracker::new(),
            budgets,
            rates,
            gate,
            rate_blocks: crate::ratelimit::Blocks::default(),
            budget_blocks: crate::budget::blocks::Blocks::default(),
            park_announced: Mutex::default(),
            cooldowns,
            tenants,
            model_metrics: cfg_models
                .iter()
                .map(|m| (m.clone(), ModelMetrics::new(m)))
                .collect(),
            job_metrics: JobMetrics::default(),
            paused_until: Mutex::new(None),
            awaiting,
            cancel_reads,
            in_line: std::sync::atomic::AtomicUsize::new(0),
            place_taken: tokio::sync::Notify::new(),
        })
    }
}

/// How many settles a worker remembers (see `Worker::finished`).
pub const RECENTLY_FINISHED: usize = 4096;

/// The last [`RECENTLY_FINISHED`] settles (entry id, when), oldest dropped first.
///
/// A ring, not a map: it is written once per job and read only for entries a reclaim
/// returns (rare: stalled workers), so a scan from the newest end costs less than
/// hashing every job's id, and it holds no string per entry. A stream entry id
/// (`<ms>-<seq>`) is kept as two integers. Invariant: times never decrease from front to
/// back (`insert` reads the clock under the worker's lock), so the newest record of an
/// entry is the one nearest the back, and an entry settled again (a redelivery) simply
/// gets a newer record.
///
/// An entry that settled here during a long reclaim (many script calls) may have been
/// dropped before the reclaim's results are sorted: so when a record at or after the
/// reclaim's start was dropped, an entry not found counts as settled. It is then skipped,
/// not started: it stays pending under this consumer, idle, and a later reclaim takes it
/// again (a delay of `queue.claim_idle_ms`, never a second paid call).
#[derive(Default)]
struct Recent {
    order: VecDeque<(EntryKey, Instant)>,
    /// When the newest dropped record was made.
    dropped_newest: Option<Instant>,
}

/// An entry id as [`Recent`] keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum EntryKey {
    Stream(u64, u64),
    /// Not a stream id (never from Redis; kept exactly all the same).
    Other(Box<str>),
}

impl EntryKey {
    fn of(entry: &str) -> EntryKey {
        // Only the one spelling Redis writes maps to integers, so two different strings
        // never become the same key ("01-0", "+1-0" and "1-0" stay apart).
        fn canonical(s: &str) -> Option<u64> {
            let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
            if !digits || (s.len() > 1 && s.starts_with('0')) {
                return None;
            }
            s.parse().ok()
        }
        entry
            .split_once('-')
            .and_then(|(ms, seq)| Some(EntryKey::Stream(canonical(ms)?, canonical(seq)?)))
            .unwrap_or_else(|| EntryKey::Other(entry.into()))
    }
}

impl Recent {
    fn insert(&mut self, entry: &str) {
        if self.order.len() >= RECENTLY_FINISHED
            && let Some((_, at)) = self.order.pop_front()
        {
            self.dropped_newest = Some(at);
        }
        self.order.push_back((EntryKey::of(entry), Instant::now()));
    }

    /// Whether `entry` finished here at or after `since`, or may have (a record that
    /// recent was dropped). Reads only the records made since then (newest first).
    fn since(&self, entry: &str, since: Instant) -> bool {
        if self.dropped_newest.is_some_and(|at| at >= since) {
            return true;
        }
        let key = EntryKey::of(entry);
        self.order
            .iter()
            .rev()
            .take_while(|(_, at)| *at >= since)
            .any(|(k, _)| *k == key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_recheck_keeps_a_found_marker_and_the_newest_read_only() {
        let fresh = Duration::from_millis(100);
        let r = Recheck::new();
        assert_eq!(r.status(fresh), None, "no read yet");
        let t1 = Instant::now();
        tokio::time::advance(Duration::from_millis(30)).await;
        let t2 = Instant::now();
        r.record(t2, false);
        r.record(t1, false); // an older read answered late
        tokio::time::advance(Duration::from_millis(80)).await;
        assert_eq!(
            r.status(fresh),
            Some(false),
            "the newer read counts: sent 80 ms ago"
        );
        tokio::time::advance(Duration::from_millis(20)).await;
        assert_eq!(r.status(fresh), None, "100 ms after its read: stale");
        r.record(t1, true); // an older read that found the marker
        r.record(Instant::now(), false);
        assert_eq!(r.status(fresh), Some(true), "a found marker stays found");
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(r.status(fresh), Some(true));
    }

    #[test]
    fn the_next_in_line_are_the_waiters_registered_first() {
        let mut a: FastMap<String, (String, Arc<Recheck>)> = FastMap::default();
        let made: Vec<Arc<Recheck>> = (0..10).map(|_| Arc::new(Recheck::new())).collect();
        // Inserted in another order than made.
        for i in [7, 2, 9, 0, 5, 1, 8, 3, 6, 4] {
            a.insert(format!("{i}-0"), (format!("job{i}"), made[i].clone()));
        }
        let mut next: Vec<String> = next_in_line(&a, 3).into_iter().map(|(id, _)| id).collect();
        next.sort();
        assert_eq!(next, ["job0", "job1", "job2"]);
        assert_eq!(next_in_line(&a, 64).len(), 10, "fewer than the cap: all");
        assert!(next_in_line(&a, 0).is_empty());
    }

    #[test]
    fn recent_keeps_the_last_entries_only() {
        let mut r = Recent::default();
        for i in 0..11 {
            r.insert(&format!("{i}-0"));
        }
        // The first instant after the last of those records (the clock is monotonic).
        let last = Instant::now();
        let mid = std::iter::repeat_with(Instant::now)
            .find(|t| *t > last)
            .expect("the clock moves");
        for i in 11..RECENTLY_FINISHED + 10 {
            r.insert(&format!("{i}-0"));
        }
        assert_eq!(r.order.len(), RECENTLY_FINISHED);
        // "0-0" .. "9-0" were dropped, all made before `mid`: forgotten for a reclaim
        // that began at `mid`.
        assert!(!r.since("9-0", mid));
        assert!(r.since("11-0", mid));
        // Settled again (a redelivery): a newer record, which takes the oldest's place.
        let before = Instant::now();
        r.insert(&format!("{}-0", RECENTLY_FINISHED + 9));
        assert_eq!(r.order.len(), RECENTLY_FINISHED);
        assert!(r.since(&format!("{}-0", RECENTLY_FINISHED + 9), before));
        assert!(r.since(&format!("{}-0", RECENTLY_FINISHED + 9), mid));
        assert!(r.since("12-0", mid));
        // Finished before a reclaim began: no longer counts as finished for it.
        assert!(!r.since("12-0", Instant::now() + Duration::from_millis(1)));
    }

    #[test]
    fn recent_keeps_settles_made_during_a_running_reclaim() {
        // A reclaim of many calls began at t0; one entry it returned settled here
        // meanwhile, then more than the ring holds settled too. The entry must still not
        // start again: when records newer than t0 were dropped, an entry not found may be
        // one of them, so it counts as settled (skipped now, reclaimable again later).
        let mut r = Recent::default();
        let t0 = Instant::now();
        r.insert("7-0");
        for i in 0..RECENTLY_FINISHED {
            r.insert(&format!("100-{i}"));
        }
        assert!(r.since("7-0", t0));
        assert!(r.since("8-0", t0), "unsure counts as settled");
        // A reclaim that began after every dropped record is sure again.
        let later = Instant::now() + Duration::from_millis(1);
        assert!(!r.since("7-0", later));
        assert!(!r.since("8-0", later));
        // Dropped records older than the reclaim's start leave it sure.
        let mut r = Recent::default();
        for i in 0..RECENTLY_FINISHED + 5 {
            r.insert(&format!("100-{i}"));
        }
        let t1 = Instant::now() + Duration::from_millis(1);
        assert!(!r.since("100-0", t1));
        assert!(!r.since("8-0", t1));
    }

    #[test]
    fn recent_tells_entry_ids_apart_exactly() {
        let mut r = Recent::default();
        let long_ago = Instant::now() - Duration::from_secs(3600);
        let settled = [
            "1-0",
            "0-1",
            "18446744073709551615-18446744073709551615",
            "x",
            "1",
        ];
        for e in settled {
            r.insert(e);
        }
        for e in settled {
            assert!(r.since(e, long_ago), "{e}");
        }
        // Other spellings of the same numbers, an overflow, and no id at all.
        for e in [
            "01-0",
            "+1-0",
            "1-00",
            "1-+0",
            "1-",
            "-0",
            "0-01",
            "18446744073709551616-0",
            "",
            "1-0-0",
            "y",
        ] {
            assert!(!r.since(e, long_ago), "{e}");
        }
        assert_eq!(
            EntryKey::of("1796572232329-28"),
            EntryKey::Stream(1796572232329, 28)
        );
        assert_eq!(
            EntryKey::of("18446744073709551616-0"),
            EntryKey::Other("18446744073709551616-0".into())
        );
    }
}
