//! One job's lifecycle, and the reader loop that feeds jobs to at most
//! `worker.concurrency` job tasks.
//!
//! Invariants:
//! - never more jobs read than there are free job permits (back-pressure: a job is read
//!   only when a task can start on it at once);
//! - a job is acknowledged only through [`Queue::commit`], together with its result;
//! - one task per entry in this process: an entry in `active` is never started again (a
//!   self-reclaim is skipped), and a task's bookkeeping is undone by its drop guard;
//! - no provider call starts after the first signal; a job stopped by shutdown without a
//!   result is handed back to the fleet (or, if Redis is away, left pending);
//! - every provider call holds a slot of its model's pool for its whole duration.

use crate::config::Config;
use crate::connect::blocking_connection;
use crate::cost::{self, Price, Usage};
use crate::job::{self, Job};
use crate::provider::{self, CallError, ProviderClient};
use crate::queue::{
    Commit, CommitOutcome, DeadLetter, Delivery, HandBack, IdClaim, Queue, QueueError, ResultEntry,
    ResultStatus,
};
use crate::router::{Candidate, Decision, ErrorClass, Plan, RetryPolicy};
use crate::slots::{Lease, SlotError, Slots};
use crate::sync::lock;
use rust_decimal::Decimal;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
    providers: HashMap<String, Arc<ProviderClient>>,
    prices: HashMap<String, Price>,
    policy: RetryPolicy,
    pub state: Arc<WorkerState>,
    /// Entries this process is working on: entry id -> job id (for keepalive; empty until
    /// the payload is parsed). An entry is added when its task is spawned and removed by
    /// the task's [`JobGuard`] on any exit (return, panic, cancellation), so keepalive
    /// never keeps alive an entry nobody works on, and no second task starts on it.
    active: Mutex<HashMap<String, String>>,
    /// The job permit of each running task, by entry id. A copy of a busy job id gives
    /// its permit back while it waits (`wait_for_busy_id`); the guard drops the rest.
    permits: Mutex<HashMap<String, OwnedSemaphorePermit>>,
    /// At most `worker.concurrency` job tasks hold a permit.
    sem: Arc<Semaphore>,
    /// Fired on the first signal (mirrors `run`'s `stop`): no job starts a provider call
    /// after it; jobs not yet calling give up and are handed back.
    draining: CancellationToken,
    /// Fired when the reader loop has ended: hand-backs wait for it, so a draining worker
    /// never reads its own handed-back entries (its last blocking read is not cut short).
    reader_stopped: CancellationToken,
}

/// Costs and tokens of one job, per model, for the result and the exact Redis totals.
#[derive(Debug, Default)]
struct Bill {
    usage: Usage,
    cost: Decimal,
    per_model: BTreeMap<String, (Usage, Decimal, u64)>,
    /// One-line notes for the result's `warning` field (e.g. a provider gave no usage).
    warnings: Vec<String>,
}

impl Bill {
    fn add(&mut self, model: &str, usage: Option<Usage>, price: &Price) {
        let entry = self.per_model.entry(model.to_string()).or_default();
        entry.2 += 1;
        if let Some(u) = usage {
            // Never a panic: an uncomputable cost (implausible usage) is reported, counted 0.
            let c = cost::checked_cost(&u, price).unwrap_or_else(|e| {
                tracing::error!(model = %model, error = %e, "cannot price a call");
                self.warnings.push(format!("{model}: {e}"));
                Decimal::ZERO
            });
            self.usage.add(&u);
            self.cost += c;
            entry.0.add(&u);
            entry.1 += c;
        }
    }

    fn usage_missing(&mut self, model: &str) {
        metrics::counter!("llm_worker_usage_missing_total", "model" => model.to_string())
            .increment(1);
        self.warnings.push(format!(
            "{model} answered without usage: that call's cost is unknown and counted as 0"
        ));
    }

    fn cost_fields(&self) -> Vec<(String, i64)> {
        let mut out = vec![];
        for (m, (u, c, calls)) in &self.per_model {
            // Validated prices make every cost a whole number of pico-dollars.
            let picos = cost::to_picos(*c).unwrap_or_else(|| {
                tracing::error!(model = %m, cost = %c, "cost is not whole pico-dollars; total rounded");
                cost::to_picos(c.round_dp(12)).unwrap_or(0)
            });
            out.push((format!("{m}:cost_picos"), picos));
            out.push((format!("{m}:input_tokens"), u.prompt_tokens as i64));
            out.push((format!("{m}:output_tokens"), u.completion_tokens as i64));
            out.push((format!("{m}:cached_tokens"), u.cached_tokens as i64));
            out.push((format!("{m}:calls"), *calls as i64));
        }
        out
    }
}

enum Finished {
    Ok {
        model: String,
        completion: provider::Completion,
    },
    Failed(String),
}

impl Worker {
    pub fn new(cfg: Arc<Config>, queue: Queue, slots: Slots) -> Result<Worker, WorkerError> {
        let cfg_concurrency = cfg.worker.concurrency.get();
        let mut providers = HashMap::new();
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
        Ok(Worker {
            cfg,
            queue,
            slots,
            providers,
            prices,
            policy,
            state: Arc::new(WorkerState::default()),
            active: Mutex::new(HashMap::new()),
            permits: Mutex::new(HashMap::new()),
            sem: Arc::new(Semaphore::new(cfg_concurrency)),
            draining: CancellationToken::new(),
            reader_stopped: CancellationToken::new(),
        })
    }

    /// Reads jobs until `stop` fires, then waits for the job tasks to end. Tasks whose
    /// provider call runs finish their jobs unless `abort` fires (the shutdown module fires
    /// it after the grace period); tasks not yet calling (waiting for a slot, the rate
    /// limit, a busy id, or in a retry backoff) stop at once. Both hand their jobs back.
    pub async fn run(self: Arc<Self>, stop: CancellationToken, abort: CancellationToken) {
        let sem = self.sem.clone();
        let tracker = TaskTracker::new();
        let draining = self.draining.clone();
        let stop_watch = stop.clone();
        let mirror = tokio::spawn(async move {
            stop_watch.cancelled().await;
            draining.cancel();
        });
        let _mirror_guard = AbortOnDrop(mirror);
        let prune_idle = self.cfg.queue.consumer_idle_remove_ms;
        let prune_every =
            (prune_idle / 2).clamp(Duration::from_millis(100), Duration::from_secs(60));
        let mut next_prune = tokio::time::Instant::now();
        let block = self.cfg.queue.block_ms;
        let mut conn = None;
        let mut backoff = Backoff::new();
        let claim_idle = self.cfg.queue.claim_idle_ms;
        let reclaim_every =
            (claim_idle / 2).clamp(Duration::from_millis(100), Duration::from_secs(30));
        let mut next_reclaim = Instant::now();
        let keeper_stop = CancellationToken::new();
        let keeper = tokio::spawn(self.clone().keep_alive(keeper_stop.clone()));
        self.state.taking_jobs.store(true, Ordering::SeqCst);
        loop {
            let first = tokio::select! {
                p = sem.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                _ = stop.cancelled() => break,
            };
            if stop.is_cancelled() {
                break;
            }
            let mut permits = vec![first];
            while let Ok(p) = sem.clone().try_acquire_owned() {
                permits.push(p);
            }
            if conn.is_none() {
                match self.connect_reader().await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        self.redis_down(&e);
                        backoff.sleep(&stop).await;
                        continue;
                    }
                }
            }
            // Take over jobs of stalled workers first (on start, then periodically).
            if Instant::now() >= next_reclaim {
                next_reclaim = Instant::now() + reclaim_every;
                match self.queue.reclaim(permits.len()).await {
                    Ok(r) => {
                        for id in &r.deleted {
                            tracing::warn!(entry = %id, "pending job was deleted from the stream; acknowledged without a result");
                            metrics::counter!("llm_worker_jobs_deleted_while_pending_total")
                                .increment(1);
                        }
                        let (ours, others): (Vec<Delivery>, Vec<Delivery>) = r
                            .deliveries
                            .into_iter()
                            .partition(|d| self.is_active(&d.entry_id));
                        if !others.is_empty() {
                            tracing::info!(
                                count = others.len(),
                                "took over jobs pending longer than queue.claim_idle_ms"
                            );
                            metrics::counter!("llm_worker_jobs_reclaimed_total")
                                .increment(others.len() as u64);
                        }
                        for d in ours {
                            // Our own running entry, reclaimed because its keepalive
                            // lagged: it already has a task (and maybe a paid call).
                            tracing::warn!(entry = %d.entry_id, "reclaimed an entry this worker is already running; not started twice (keepalive is lagging: check Redis latency and queue.claim_idle_ms)");
                            metrics::counter!("llm_worker_self_reclaims_skipped_total")
                                .increment(1);
                        }
                        for d in others {
                            let Some(permit) = permits.pop() else { break };
                            self.spawn_job(&tracker, d, permit, &abort);
                        }
                        if permits.is_empty() {
                            continue;
                        }
                    }
                    Err(e) => {
                        conn = None;
                        self.redis_down(&e);
                        backoff.sleep(&stop).await;
                        continue;
                    }
                }
            }
            if tokio::time::Instant::now() >= next_prune {
                next_prune = tokio::time::Instant::now() + prune_every;
                self.prune_consumers(prune_idle).await;
            }
            let Some(c) = conn.as_mut() else { continue };
            // Not raced against `stop`: entries Redis hands us must reach a task, or they
            // would sit pending until another worker reclaims them. BLOCK is short. Only
            // `abort` (grace over, or Redis hanging) cuts a read short.
            let read = tokio::select! {
                r = self.queue.read_new(c, permits.len(), block) => r,
                _ = abort.cancelled() => break,
            };
            match read {
                Ok(deliveries) => {
                    self.redis_up();
                    backoff.reset();
                    for d in deliveries {
                        let Some(permit) = permits.pop() else { break };
                        self.spawn_job(&tracker, d, permit, &abort);
                    }
                }
                Err(e) => {
                    conn = None;
                    self.redis_down(&e);
                    backoff.sleep(&stop).await;
                }
            }
        }
        self.state.taking_jobs.store(false, Ordering::SeqCst);
        self.reader_stopped.cancel();
        tracker.close();
        let _keeper_guard = KeeperGuard(keeper_stop, keeper);
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        tick.tick().await;
        loop {
            tokio::select! {
                _ = tracker.wait() => break,
                _ = tick.tick() => tracing::info!(
                    in_flight = self.state.in_flight.load(Ordering::SeqCst),
                    aborting = abort.is_cancelled(),
                    "draining: jobs still in flight"
                ),
            }
        }
    }

    /// Starts a task on `d`. The entry joins `active` now (so a reclaim of it is skipped
    /// while the task lives), and its [`JobGuard`] undoes everything on any exit.
    fn spawn_job(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        d: Delivery,
        permit: OwnedSemaphorePermit,
        abort: &CancellationToken,
    ) {
        lock(&self.active).insert(d.entry_id.clone(), String::new());
        lock(&self.permits).insert(d.entry_id.clone(), permit);
        self.state.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = JobGuard {
            worker: self.clone(),
            entry_id: d.entry_id.clone(),
            ended: false,
        };
        let me = self.clone();
        let abort = abort.clone();
        tracker.spawn(async move {
            let mut guard = guard; // moved in whole: dropped with the task, whatever ends it
            me.handle(d, abort).await;
            guard.ended = true;
        });
    }

    fn is_active(&self, entry_id: &str) -> bool {
        lock(&self.active).contains_key(entry_id)
    }

    /// The reclaimer's sweep of consumers left by stopped workers (see
    /// [`Queue::remove_consumers`]). Failures are logged only: the next sweep retries.
    async fn prune_consumers(&self, idle: Duration) {
        let sweep = self.queue.remove_consumers(Some(idle));
        match tokio::time::timeout(Duration::from_secs(2), sweep).await {
            Ok(Ok(names)) => {
                for n in names {
                    tracing::info!(consumer = %n, idle_ms = idle.as_millis() as u64, "removed an idle consumer with no pending job from the group");
                    metrics::counter!("llm_worker_consumers_removed_total").increment(1);
                }
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "consumer sweep failed; retrying later"),
            Err(_) => tracing::debug!("consumer sweep timed out; retrying later"),
        }
    }

    /// At a clean exit: removes this worker's consumer from the group if it owns no
    /// pending entry (else it stays, so its entries can still be reclaimed). Bounded.
    pub async fn remove_own_consumer(&self) {
        let own = self.queue.remove_consumers(None);
        match tokio::time::timeout(Duration::from_millis(1000), own).await {
            Ok(Ok(n)) if !n.is_empty() => {
                tracing::info!("removed this worker's consumer from the group")
            }
            Ok(Ok(_)) => tracing::info!(
                "consumer kept in the group: it still owns pending jobs (another worker reclaims them)"
            ),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not remove this worker's consumer; the reclaimer of another worker removes it later")
            }
            Err(_) => tracing::warn!(
                "removing this worker's consumer timed out; the reclaimer of another worker removes it later"
            ),
        }
    }

    /// Every third of `queue.claim_idle_ms`, resets the idle time of the jobs this process
    /// is working on, so a call that legitimately runs long is not taken over (and paid
    /// for a second time) by another worker.
    async fn keep_alive(self: Arc<Self>, stop: CancellationToken) {
        let period = (self.cfg.queue.claim_idle_ms / 3).max(Duration::from_millis(50));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            let entries: Vec<(String, String)> = lock(&self.active)
                .iter()
                .map(|(e, j)| (e.clone(), j.clone()))
                .collect();
            match self.queue.keepalive(&entries).await {
                Ok(gone) => {
                    // A job that committed since the snapshot is gone too, legitimately.
                    let active = lock(&self.active);
                    for e in gone.iter().filter(|e| active.contains_key(*e)) {
                        tracing::warn!(entry = %e, "job is no longer pending under this worker (taken over or acknowledged elsewhere); its result will be discarded if another worker commits first");
                    }
                }
                Err(e) => tracing::debug!(error = %e, "keepalive failed; retrying next tick"),
            }
        }
    }

    async fn connect_reader(&self) -> Result<redis::aio::MultiplexedConnection, QueueError> {
        let c = blocking_connection(&self.cfg).await?;
        self.queue.ensure_group().await?;
        Ok(c)
    }

    fn redis_down(&self, e: &QueueError) {
        if self.state.redis_ok.swap(false, Ordering::SeqCst) {
            tracing::error!(error = %e, "Redis unreachable; not taking jobs until it answers");
        }
        metrics::counter!("llm_worker_redis_errors_total").increment(1);
    }

    fn redis_up(&self) {
        if !self.state.redis_ok.swap(true, Ordering::SeqCst) {
            tracing::info!("Redis reachable; taking jobs");
        }
    }

    /// Runs one job to its commit. A job stopped by shutdown before its result exists
    /// (`abort` fired, or it had not started its call when draining began) is handed back
    /// to the fleet. Cleanup of `active`, the permit and `in_flight` is the caller's
    /// [`JobGuard`], so it also happens on a panic.
    pub async fn handle(&self, d: Delivery, abort: CancellationToken) {
        let started = Instant::now();
        let commit = tokio::select! {
            c = self.process(&d, started) => c,
            _ = abort.cancelled() => {
                tracing::info!(entry = %d.entry_id, "job cancelled by shutdown; handing it back");
                metrics::counter!("llm_worker_jobs_abandoned_total").increment(1);
                None
            }
        };
        match commit {
            Some(commit) => self.commit_until_written(&d, &commit, &abort).await,
            None if self.draining.is_cancelled() => self.hand_back(&d).await,
            None => {}
        }
    }

    /// Hands an unfinished job back (see [`Queue::hand_back`]); bounded, so a Redis outage
    /// cannot hold up the exit: the job then stays pending for `queue.claim_idle_ms`.
    async fn hand_back(&self, d: &Delivery) {
        let job_id = lock(&self.active)
            .get(&d.entry_id)
            .filter(|j| !j.is_empty())
            .cloned();
        // The reader ends within its BLOCK (+2 s bound) of the signal.
        let bound = self.cfg.queue.block_ms + Duration::from_secs(2);
        let _ = tokio::time::timeout(bound, self.reader_stopped.cancelled()).await;
        let fut = self
            .queue
            .hand_back(&d.entry_id, job_id.as_deref(), d.deliveries);
        match tokio::time::timeout(Duration::from_millis(1000), fut).await {
            Ok(Ok(HandBack::Moved(new))) => {
                tracing::info!(entry = %d.entry_id, new_entry = %new, "unfinished job handed back for another worker");
                metrics::counter!("llm_worker_jobs_handed_back_total").increment(1);
            }
            Ok(Ok(HandBack::NotOurs)) => {
                tracing::info!(entry = %d.entry_id, "unfinished job no longer ours; nothing to hand back")
            }
            Ok(Ok(HandBack::Deleted)) => {
                tracing::warn!(entry = %d.entry_id, "unfinished job was deleted from the stream while pending; acknowledged");
                metrics::counter!("llm_worker_jobs_deleted_while_pending_total").increment(1);
            }
            Ok(Err(e)) => {
                tracing::warn!(entry = %d.entry_id, error = %e, "cannot hand the job back; it stays pending until another worker reclaims it (queue.claim_idle_ms)")
            }
            Err(_) => {
                tracing::warn!(entry = %d.entry_id, "handing the job back timed out; it stays pending until another worker reclaims it (queue.claim_idle_ms)")
            }
        }
    }

    /// A copy of a job id that another entry is running: waits for that entry's result
    /// without holding a job permit (the permit goes back on the first call; at most
    /// `worker.concurrency` copies wait that way, later ones keep theirs), polling with a
    /// growing delay. `false`: stop waiting and leave the copy pending — draining began, or
    /// it waited `queue.claim_idle_ms` (it is then reclaimed later, by us or another
    /// worker, and checked again).
    async fn wait_for_busy_id(
        &self,
        entry_id: &str,
        since: &mut Option<tokio::time::Instant>,
    ) -> bool {
        let first = since.is_none();
        let since = *since.get_or_insert_with(tokio::time::Instant::now);
        if first {
            let waiting = lock(&self.active)
                .len()
                .saturating_sub(lock(&self.permits).len());
            if waiting < self.cfg.worker.concurrency.get() {
                drop(lock(&self.permits).remove(entry_id));
            }
        }
        if since.elapsed() >= self.cfg.queue.claim_idle_ms {
            tracing::warn!(entry = %entry_id, "same job id still in flight elsewhere after queue.claim_idle_ms; leaving this copy pending");
            return false;
        }
        let delay = (since.elapsed() / 4).clamp(Duration::from_millis(100), Duration::from_secs(2));
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = self.draining.cancelled() => false,
        }
    }

    /// A job permit for a copy that gave its permit back while waiting and may now call a
    /// model. `false` when draining began first.
    async fn regain_permit(&self, entry_id: &str) -> bool {
        if lock(&self.permits).contains_key(entry_id) {
            return true;
        }
        let permit = tokio::select! {
            p = self.sem.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return false },
            _ = self.draining.cancelled() => return false,
        };
        lock(&self.permits).insert(entry_id.to_string(), permit);
        true
    }

    /// Writes a finished job's result. A paid result is never dropped because of time:
    ///
    /// - an error that heals ([`QueueError::heals`]: Redis unreachable, timeouts, `OOM`
    ///   under `noeviction`, `LOADING`, a failover) holds the result and retries with
    ///   backoff until Redis takes it. Held results are bounded by count (each holds its
    ///   job's permit, so at most `worker.concurrency`) and by bytes
    ///   ([`MAX_HELD_RESULT_BYTES`] per process; past that a result is dropped, logged and
    ///   counted in `llm_worker_results_lost_total`). While held, the entry stays in
    ///   `active`, so the keepalive keeps it from being taken over;
    /// - an error that does not heal (a key of the wrong type, a script error) is not
    ///   retried as is: a minimal `failed` result (no dead letter, cost totals or marker)
    ///   is written instead. If even that fails (the results stream itself is unusable),
    ///   the job stays pending under this worker, kept alive, not paid again, with an
    ///   error naming the key logged every [`UNWRITABLE_LOG_EVERY`], until someone fixes
    ///   the key;
    /// - a reply lost after the commit ran is recognised on retry (the entry's result is
    ///   ours) and counted as written, not as superseded.
    ///
    /// Only `abort` (shutdown past its grace) gives up on a held result; the job then
    /// stays pending for another worker.
    async fn commit_until_written(&self, d: &Delivery, commit: &Commit, abort: &CancellationToken) {
        let mut backoff = Backoff::new();
        let mut held: Option<HeldBytes> = None;
        let mut fallback: Option<Commit> = None;
        let mut last_unwritable_log: Option<Instant> = None;
        loop {
            let mut wait = false;
            let current = fallback.as_ref().unwrap_or(commit);
            match self.queue.commit(current).await {
                Ok(CommitOutcome::Written { .. }) => {
                    if held.is_some() {
                        tracing::info!(entry = %d.entry_id, "held result written");
                    }
                    return;
                }
                Ok(CommitOutcome::AlreadyWritten { result_id }) => {
                    tracing::info!(entry = %d.entry_id, result = %result_id, "result was written by an earlier try whose reply was lost");
                    metrics::counter!("llm_worker_commit_reply_lost_total").increment(1);
                    return;
                }
                Ok(CommitOutcome::Superseded) => {
                    tracing::warn!(entry = %d.entry_id, "job was already committed by another worker; result discarded");
                    metrics::counter!("llm_worker_commit_superseded_total").increment(1);
                    return;
                }
                Err(e) if e.heals() => {
                    wait = true;
                    if held.is_none() {
                        match HeldBytes::take(current.size()) {
                            Some(h) => held = Some(h),
                            None => {
                                tracing::error!(entry = %d.entry_id, error = %e, limit = MAX_HELD_RESULT_BYTES, "cannot write result and too many result bytes are held already; dropping it (the job will be reclaimed and paid again)");
                                metrics::counter!("llm_worker_results_lost_total").increment(1);
                                return;
                            }
                        }
                        tracing::warn!(entry = %d.entry_id, error = %e, "cannot write result; holding it until Redis takes it");
                        metrics::counter!("llm_worker_results_held_total").increment(1);
                    }
                }
                Err(e) if fallback.is_none() => {
                    if last_unwritable_log.is_none() {
                        tracing::error!(entry = %d.entry_id, error = %e, "result cannot be written as it is (fix the key named); writing a minimal failed result instead");
                        metrics::counter!("llm_worker_commit_unwritable_total").increment(1);
                    }
                    fallback = Some(self.minimal_failed(d, commit, &e));
                    continue;
                }
                Err(e) => {
                    if last_unwritable_log.is_none_or(|t| t.elapsed() >= UNWRITABLE_LOG_EVERY) {
                        last_unwritable_log = Some(Instant::now());
                        tracing::error!(entry = %d.entry_id, error = %e, "no result can be written for this job; it stays pending under this worker (not paid again) until the key named is fixed");
                    }
                    if held.is_none() {
                        held = HeldBytes::take(current.size());
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(UNWRITABLE_RETRY) => {}
                        _ = abort.cancelled() => {}
                    }
                    // The full result first again: the key may have been fixed.
                    fallback = None;
                }
            }
            if abort.is_cancelled() {
                tracing::error!(entry = %d.entry_id, "shutting down with a result not written; the job stays pending and will be redone");
                metrics::counter!("llm_worker_results_lost_total").increment(1);
                return;
            }
            if wait {
                backoff.sleep(abort).await;
            }
        }
    }

    /// The smallest result that says what happened when the full one cannot be written
    /// (a key it touches has the wrong type): status `failed`, the usage and cost of the
    /// calls made, the error; no dead letter, cost totals, or result marker.
    fn minimal_failed(&self, d: &Delivery, full: &Commit, e: &QueueError) -> Commit {
        let error = provider::one_line(&format!(
            "result could not be written ({}): {e}",
            full.status
        ));
        // `full.result` is our own encoding, so it decodes; if it ever did not, the
        // bare result still says which entry failed and why.
        let result = match ResultEntry::from_fields(full.result.iter().map(|(k, v)| (*k, v))) {
            Ok(r) => r.minimal_failed(error),
            Err(_) => {
                let mut r = ResultEntry::new(
                    &d.entry_id,
                    &d.entry_id,
                    ResultStatus::Failed,
                    0,
                    self.queue.consumer(),
                );
                r.error = Some(error);
                r
            }
        };
        Commit {
            entry_id: d.entry_id.clone(),
            result: result.into_fields(),
            dead: vec![],
            dedupe_id: None,
            inflight_id: None,
            status: ResultStatus::Failed.as_str().into(),
            costs: vec![],
        }
    }

    /// A result of `status` for this delivery with no model call counted yet.
    fn base_result(
        &self,
        d: &Delivery,
        job_id: &str,
        status: ResultStatus,
        started: Instant,
    ) -> ResultEntry {
        ResultEntry::new(
            job_id,
            &d.entry_id,
            status,
            started.elapsed().as_millis() as u64,
            self.queue.consumer(),
        )
    }

    /// The commit for a job that cannot be processed: `invalid` result + dead letter.
    fn reject(
        &self,
        d: &Delivery,
        job_id: Option<&str>,
        status: ResultStatus,
        reason: &str,
        started: Instant,
    ) -> Commit {
        let id = job_id.unwrap_or(&d.entry_id);
        let mut result = self.base_result(d, id, status, started);
        result.error = Some(reason.to_string());
        // Every field of the original entry, name and value verbatim (so `payload` when
        // there was one); see `DeadLetter` for the shape.
        let dead = DeadLetter::new(&d.entry_id, job_id, reason, d.deliveries, d.fields.clone());
        metrics::counter!("llm_worker_jobs_total", "status" => status.as_str()).increment(1);
        Commit {
            entry_id: d.entry_id.clone(),
            result: result.into_fields(),
            dead: dead.into_fields(),
            // A dead job with a known id has a result: later copies of the id are duplicates.
            dedupe_id: job_id
                .filter(|_| status == ResultStatus::Dead)
                .map(str::to_string),
            inflight_id: job_id.map(str::to_string),
            status: status.as_str().to_string(),
            costs: vec![],
        }
    }

    /// Everything between reading a job and its commit. `None`: leave the job pending.
    async fn process(&self, d: &Delivery, started: Instant) -> Option<Commit> {
        let mut bill = Bill::default();
        let job = match job::parse(
            d.payload.as_deref(),
            d.first_entry.as_deref().unwrap_or(&d.entry_id),
            self.cfg.queue.max_payload_bytes,
            &self.cfg,
        ) {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(entry = %d.entry_id, reason = %e, "invalid job; dead-lettered");
                // Keep the producer's id when it can be read, so it can find this result.
                let id = job::salvage_id(d.payload.as_deref());
                return Some(self.reject(
                    d,
                    id.as_deref(),
                    ResultStatus::Invalid,
                    &e.to_string(),
                    started,
                ));
            }
        };
        lock(&self.active).insert(d.entry_id.clone(), job.id.clone());
        #[cfg(debug_assertions)]
        debug_hooks::maybe_panic(&job.id);
        // Idempotency by id: one model call per id, however many copies are pushed.
        let mut backoff = Backoff::new();
        let mut busy_since = None;
        loop {
            match self.queue.claim_id(&job.id, &d.entry_id).await {
                Ok(IdClaim::Claimed) => {
                    if !self.regain_permit(&d.entry_id).await {
                        return None;
                    }
                    break;
                }
                Ok(IdClaim::Done { result_id, status }) => {
                    tracing::info!(entry = %d.entry_id, job = %job.id, original = %result_id, "duplicate job id; acknowledged without a model call");
                    metrics::counter!("llm_worker_jobs_duplicate_total").increment(1);
                    return Some(self.duplicate(d, &job, &result_id, &status, started).await);
                }
                Ok(IdClaim::Busy { other_entry }) => {
                    tracing::debug!(entry = %d.entry_id, job = %job.id, other = %other_entry, "same job id in flight elsewhere; waiting for its result");
                    if !self.wait_for_busy_id(&d.entry_id, &mut busy_since).await {
                        return None;
                    }
                }
                Err(e) if !e.heals() => {
                    // A marker key of the wrong type: retrying cannot help, and calling a
                    // model without the check could pay for the id twice.
                    tracing::error!(entry = %d.entry_id, job = %job.id, error = %e, "idempotency check impossible; job failed without a model call (fix the key named)");
                    let reason = format!("idempotency check impossible, no model called: {e}");
                    return Some(self.reject(
                        d,
                        Some(&job.id),
                        ResultStatus::Failed,
                        &reason,
                        started,
                    ));
                }
                Err(e) => {
                    // One line per job, not per retry: the reader logs the outage itself.
                    if backoff.next == Duration::from_millis(100) {
                        tracing::warn!(entry = %d.entry_id, error = %e, "idempotency check failed; retrying until Redis answers");
                    }
                    backoff.sleep(&self.draining).await;
                    if self.draining.is_cancelled() {
                        return None;
                    }
                }
            }
        }
        // The poison check after the id check: a copy of an id that already has a result
        // is a duplicate (pointing at that result), never a `dead` that would hide it.
        if d.deliveries > self.cfg.queue.max_deliveries.get() {
            let reason = format!(
                "delivered {} times (queue.max_deliveries = {}): every worker that took it stopped before finishing",
                d.deliveries, self.cfg.queue.max_deliveries
            );
            tracing::error!(entry = %d.entry_id, job = %job.id, "poison job; dead-lettered");
            return Some(self.reject(d, Some(&job.id), ResultStatus::Dead, &reason, started));
        }
        if !d.extra_fields.is_empty() {
            bill.warnings.push(format!(
                "ignored stream fields other than payload: {}",
                d.extra_fields.join(", ")
            ));
        }
        let candidates: Vec<Candidate> = job::model_order(&job, &self.cfg)
            .into_iter()
            .filter_map(|m| {
                let mc = self.cfg.models.get(&m)?;
                Some(Candidate {
                    provider: mc.provider.clone(),
                    pool: mc.pool.clone(),
                    context_window: mc.context_window,
                    model: m,
                })
            })
            .collect();
        if candidates.is_empty() {
            return Some(self.reject(
                d,
                Some(&job.id),
                ResultStatus::Invalid,
                "no model to run on",
                started,
            ));
        }
        let mut plan = Plan::new(candidates, self.policy);
        let mut attempts = 0u64;
        let mut tried: Vec<String> = vec![];
        let finished = loop {
            // The local rate limit first: a fleet slot is never held while waiting on it.
            // Draining: no provider call starts after the first signal (the job is handed
            // back). Checked before each wait and once more with the slot in hand.
            let throttled = plan.current().provider.clone();
            if let Some(c) = self.providers.get(&throttled) {
                self.unless_draining(c.throttle()).await?;
            }
            let lease = self.take_slot(&mut plan).await?;
            let cand = plan.current().clone();
            if cand.provider != throttled
                && let Some(c) = self.providers.get(&cand.provider)
                && self.unless_draining(c.throttle()).await.is_none()
            {
                // the slot fast path switched provider
                release_unused(lease).await;
                return None;
            }
            if self.draining.is_cancelled() {
                release_unused(lease).await;
                return None;
            }
            if tried.last() != Some(&cand.model) {
                tried.push(cand.model.clone());
            }
            plan.record_attempt();
            attempts += 1;
            let Some(client) = self.providers.get(&cand.provider) else {
                break Finished::Failed(format!("provider {} not configured", cand.provider));
            };
            let body = ProviderClient::request_body(&job.body, self.cfg.upstream_name(&cand.model));
            let call_started = Instant::now();
            let outcome = client.call(&body, &job.id).await;
            if lease.is_lost() {
                tracing::warn!(job = %job.id, model = %cand.model, "call finished after its slot lease was lost");
            }
            if let Err(e) = lease.release().await {
                tracing::warn!(error = %e, "slot release failed; its TTL frees it");
            }
            let label = match &outcome.result {
                Ok(_) => "ok",
                Err(e) => class_label(&e.class),
            };
            metrics::counter!("llm_worker_provider_calls_total", "model" => cand.model.clone(), "outcome" => label)
                .increment(1);
            metrics::histogram!("llm_worker_provider_call_seconds", "model" => cand.model.clone())
                .record(call_started.elapsed().as_secs_f64());
            if let Some(price) = self.prices.get(&cand.model) {
                bill.add(&cand.model, outcome.usage, price);
            }
            if outcome.usage.is_none() && outcome.result.is_ok() {
                bill.usage_missing(&cand.model);
            }
            match outcome.result {
                Ok(completion) => {
                    break Finished::Ok {
                        model: cand.model,
                        completion,
                    };
                }
                Err(CallError { class, message, .. }) => {
                    let decision = plan.on_error(&class, rand::random::<f64>());
                    tracing::debug!(job = %job.id, model = %cand.model, error = %message, ?decision, "attempt failed");
                    match decision {
                        Decision::RetryAfter(after) => {
                            self.unless_draining(tokio::time::sleep(after)).await?
                        }
                        Decision::Switch(_) => {
                            metrics::counter!("llm_worker_fallbacks_total").increment(1);
                        }
                        Decision::Fail => {
                            break Finished::Failed(format!("{}: {message}", cand.model));
                        }
                    }
                }
            }
        };
        Some(self.finish(d, &job, finished, &bill, attempts, &tried, started))
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        d: &Delivery,
        job: &Job,
        finished: Finished,
        bill: &Bill,
        attempts: u64,
        tried: &[String],
        started: Instant,
    ) -> Commit {
        let status = match finished {
            Finished::Ok { .. } => ResultStatus::Ok,
            Finished::Failed(_) => ResultStatus::Failed,
        };
        let mut result = self.base_result(d, &job.id, status, started);
        match finished {
            Finished::Ok { model, completion } => {
                result.model = Some(model);
                result.content = Some(completion.content);
                result.finish_reason = Some(completion.finish_reason);
            }
            Finished::Failed(e) => result.error = Some(provider::one_line(&e)),
        }
        result.input_tokens = bill.usage.prompt_tokens;
        result.output_tokens = bill.usage.completion_tokens;
        result.cached_tokens = Some(bill.usage.cached_tokens);
        result.cost_usd = bill.cost;
        result.attempts = attempts;
        result.tried = tried.to_vec();
        result.metadata = job.metadata.as_ref().map(|m| m.to_string());
        if !bill.warnings.is_empty() {
            result.warning = Some(provider::one_line(&bill.warnings.join("; ")));
        }
        metrics::counter!("llm_worker_jobs_total", "status" => status.as_str()).increment(1);
        metrics::histogram!("llm_worker_job_seconds").record(started.elapsed().as_secs_f64());
        Commit {
            entry_id: d.entry_id.clone(),
            result: result.into_fields(),
            dead: vec![],
            dedupe_id: Some(job.id.clone()),
            inflight_id: Some(job.id.clone()),
            status: status.as_str().to_string(),
            costs: bill.cost_fields(),
        }
    }

    /// The result for a copy of a job id that already has one: it points at the original
    /// (`duplicate_of`), repeats its answer, and costs nothing (no model was called).
    async fn duplicate(
        &self,
        d: &Delivery,
        job: &Job,
        result_id: &str,
        status: &str,
        started: Instant,
    ) -> Commit {
        let original = self
            .queue
            .result_fields(result_id)
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        // The marker's status is one commit.lua wrote from ours; anything else is
        // reported as failed rather than invented.
        let typed = ResultStatus::parse(status).unwrap_or(ResultStatus::Failed);
        let mut result = self.base_result(d, &job.id, typed, started);
        result.copy_answer(original);
        result.duplicate_of = Some(result_id.to_string());
        result.metadata = job.metadata.as_ref().map(|m| m.to_string());
        Commit {
            entry_id: d.entry_id.clone(),
            result: result.into_fields(),
            dead: vec![],
            dedupe_id: None,
            inflight_id: None,
            status: status.to_string(),
            costs: vec![],
        }
    }

    /// A slot for the plan's current model; if its pool stays busy past
    /// `slots.acquire_timeout_ms`, a later model of the route with a free slot is used
    /// instead, else it waits again. It never fails for lack of a slot alone; `None` only
    /// when the slots are stopped (shutdown): the job is then left pending.
    async fn take_slot(&self, plan: &mut Plan) -> Option<Lease> {
        let timeout = self.cfg.slots.acquire_timeout_ms;
        let mut backoff = Backoff::new();
        loop {
            let pool = plan.current().pool.clone();
            let acquired = self
                .unless_draining(self.slots.acquire(&pool, timeout))
                .await?;
            match acquired {
                Ok(l) => return Some(l),
                Err(SlotError::Timeout { .. }) => {
                    for i in plan.usable_alternatives() {
                        let alt_pool = plan.candidates()[i].pool.clone();
                        if alt_pool == pool {
                            continue;
                        }
                        if let Ok(Some(l)) = self.slots.try_acquire(&alt_pool).await {
                            plan.switch_to(i);
                            metrics::counter!("llm_worker_fallbacks_total").increment(1);
                            return Some(l);
                        }
                    }
                }
                Err(SlotError::Stopped) => return None,
                Err(e) => {
                    // One line per job, not per retry: the reader logs the outage itself.
                    if backoff.next == Duration::from_millis(100) {
                        tracing::warn!(error = %e, pool = %pool, "cannot take a slot; retrying until Redis answers");
                    }
                    backoff.sleep(&self.draining).await;
                    if self.draining.is_cancelled() {
                        return None;
                    }
                }
            }
        }
    }

    /// `fut`'s output, or `None` as soon as draining begins (the wait is dropped).
    async fn unless_draining<T>(&self, fut: impl std::future::Future<Output = T>) -> Option<T> {
        if self.draining.is_cancelled() {
            return None;
        }
        tokio::select! {
            v = fut => Some(v),
            _ = self.draining.cancelled() => None,
        }
    }
}

/// Gives back a slot taken for a call that will not start (draining began).
async fn release_unused(lease: Lease) {
    if let Err(e) = lease.release().await {
        tracing::warn!(error = %e, "slot release failed; its TTL frees it");
    }
}

/// Undoes a job task's bookkeeping on every exit, including a panic or the task being
/// dropped: the entry leaves `active` (keepalive stops touching it, so a job whose task
/// died is reclaimed after `queue.claim_idle_ms`), its permit is freed, `in_flight` drops.
struct JobGuard {
    worker: Arc<Worker>,
    entry_id: String,
    /// `handle` returned (false on drop: the task panicked or was dropped mid-job).
    ended: bool,
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        let w = &self.worker;
        lock(&w.active).remove(&self.entry_id);
        drop(lock(&w.permits).remove(&self.entry_id));
        w.state.in_flight.fetch_sub(1, Ordering::SeqCst);
        if !self.ended {
            tracing::error!(entry = %self.entry_id, "job task ended abnormally (panic); its job stays pending and is reclaimed after queue.claim_idle_ms");
            metrics::counter!("llm_worker_job_panics_total").increment(1);
        }
    }
}

/// Aborts a helper task when the scope that spawned it ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Bytes of results one process holds at most while Redis does not take them (see
/// [`Worker::commit_until_written`]); a result past it is dropped and counted.
pub const MAX_HELD_RESULT_BYTES: usize = 256 << 20;
/// How often a result that no key fix can yet take is retried.
const UNWRITABLE_RETRY: Duration = Duration::from_secs(5);
/// How often the error for such a result is logged again.
const UNWRITABLE_LOG_EVERY: Duration = Duration::from_secs(60);

static HELD_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A share of [`MAX_HELD_RESULT_BYTES`], given back on drop.
struct HeldBytes(usize);

impl HeldBytes {
    fn take(n: usize) -> Option<HeldBytes> {
        HELD_BYTES
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                (cur + n <= MAX_HELD_RESULT_BYTES).then_some(cur + n)
            })
            .ok()
            .map(|_| HeldBytes(n))
    }
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        HELD_BYTES.fetch_sub(self.0, Ordering::SeqCst);
    }
}

/// Stops the keepalive task when the reader loop's drain ends.
struct KeeperGuard(CancellationToken, tokio::task::JoinHandle<()>);

impl Drop for KeeperGuard {
    fn drop(&mut self) {
        self.0.cancel();
        self.1.abort();
    }
}

fn class_label(c: &ErrorClass) -> &'static str {
    match c {
        ErrorClass::Transient => "transient",
        ErrorClass::RateLimited { .. } => "rate_limited",
        ErrorClass::ProviderRejected => "rejected",
        ErrorClass::AccessDenied => "access_denied",
        ErrorClass::ContextTooLong => "context_too_long",
        ErrorClass::Fatal => "fatal",
    }
}

/// Jittered exponential backoff for Redis reconnects: 100 ms doubling to 5 s.
pub struct Backoff {
    pub next: Duration,
}

impl Backoff {
    pub fn new() -> Backoff {
        Backoff {
            next: Duration::from_millis(100),
        }
    }
    pub fn reset(&mut self) {
        self.next = Duration::from_millis(100);
    }
    /// Sleeps (cut short by `cancel`) and doubles the next delay.
    pub async fn sleep(&mut self, cancel: &CancellationToken) {
        self.sleep_jittered(rand::random::<f64>(), cancel).await;
    }

    /// [`Backoff::sleep`] with the jitter given (in [0, 1)): sleeps `next * (1 + jitter) / 2`
    /// on tokio's clock, so a test with `tokio::time::pause()` sees exact durations.
    pub async fn sleep_jittered(&mut self, jitter: f64, cancel: &CancellationToken) {
        let d = self.next_delay(jitter);
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = cancel.cancelled() => {}
        }
    }

    /// The delay of this step (`next` x a factor in [0.5, 1) from `jitter`), and doubles
    /// `next` up to 5 s.
    pub fn next_delay(&mut self, jitter: f64) -> Duration {
        let d = self.next.mul_f64(0.5 + jitter.clamp(0.0, 1.0) / 2.0);
        self.next = (self.next * 2).min(Duration::from_secs(5));
        d
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new()
    }
}

/// Fault injection for the integration tests, compiled into debug builds only (release
/// binaries carry none of it). `LLM_WORKER_DEBUG_PANIC_ONCE_JOB=<job id>`: the first task
/// of this process that reaches the idempotency check for that id panics, as a bug in
/// the job path would.
#[cfg(debug_assertions)]
mod debug_hooks {
    use std::sync::atomic::{AtomicBool, Ordering};

    static FIRED: AtomicBool = AtomicBool::new(false);

    pub(super) fn maybe_panic(job_id: &str) {
        let Ok(target) = std::env::var("LLM_WORKER_DEBUG_PANIC_ONCE_JOB") else {
            return;
        };
        if target == job_id && !FIRED.swap(true, Ordering::SeqCst) {
            tracing::warn!(job = %job_id, "debug hook: panicking in the job task");
            panic!("debug hook: LLM_WORKER_DEBUG_PANIC_ONCE_JOB={job_id}");
        }
    }
}
