//! The reader: XAUTOCLAIM of stalled entries, XREADGROUP of new ones (only as many as
//! there are free read permits), one task per job; the sweep of idle empty consumers.
//!
//! Invariant: never more jobs read than there are free read permits, and never a second
//! task for an entry this process already runs.

use crate::connect::blocking_connection;
use crate::queue::{CancelCheck, CancelFlags, Delivery, QueueError};
use crate::sync::lock;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::*;

impl Worker {
    /// Reads jobs until `stop` fires, then waits for the job tasks to end. Tasks whose
    /// provider call runs finish their jobs unless `abort` fires (the shutdown module fires
    /// it after the grace period); tasks not yet calling (waiting for a slot, the rate
    /// limit, a busy id, or in a retry backoff) stop at once. Both hand their jobs back.
    pub async fn run(self: Arc<Self>, stop: CancellationToken, abort: CancellationToken) {
        let sem = self.read_sem.clone();
        let tracker = TaskTracker::new();
        let draining = self.draining.clone();
        let stop_watch = stop.clone();
        // The reader's connection id (CLIENT ID), so the first signal can end its
        // blocking read at once (CLIENT UNBLOCK ... TIMEOUT: the read returns as if its
        // BLOCK ran out, with no entry delivered) instead of after up to `queue.block_ms`.
        let reader_id = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let (me, rid) = (self.clone(), reader_id.clone());
        let mirror = tokio::spawn(async move {
            stop_watch.cancelled().await;
            draining.cancel();
            // Not ready from the first signal on (the reader may still finish a read).
            me.state.taking_jobs.store(false, Ordering::SeqCst);
            // The read may not have reached Redis yet when the signal came (the reader was
            // reclaiming, say): unblock until the reader has stopped, a few times at most.
            // Unblocking a client that is not blocked does nothing.
            let mut warned = false;
            for _ in 0..40 {
                let id = rid.load(Ordering::SeqCst);
                if id > 0 {
                    let r = tokio::time::timeout(Duration::from_millis(500), me.queue.unblock(id));
                    if let Ok(Err(e)) = r.await
                        && !warned
                    {
                        warned = true;
                        tracing::warn!(error = %e, "cannot end the reader's blocking read early (CLIENT UNBLOCK refused: the Redis user may lack it); the worker stops within queue.block_ms");
                    }
                }
                tokio::select! {
                    _ = me.reader_stopped.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        });
        let _mirror_guard = AbortOnDrop(mirror);
        let prune_idle = self.cfg.queue.consumer_idle_remove_ms;
        let prune_every =
            (prune_idle / 2).clamp(Duration::from_millis(100), Duration::from_secs(60));
        let mut next_prune = tokio::time::Instant::now();
        let block = self.cfg.queue.block_ms;
        let mut conn = None;
        // The reader's own connection, lost and made again, counts as a reconnect too.
        let mut connected_once = false;
        let mut backoff = Backoff::redis();
        let claim_idle = self.cfg.queue.claim_idle_ms;
        let reclaim_every =
            (claim_idle / 2).clamp(Duration::from_millis(100), Duration::from_secs(30));
        let mut next_reclaim = Instant::now();
        let keeper_stop = CancellationToken::new();
        let keeper = tokio::spawn(self.clone().keep_alive(keeper_stop.clone()));
        let _cancel_watch = AbortOnDrop(tokio::spawn(
            self.clone().watch_cancels(keeper_stop.clone()),
        ));
        let _unparker = AbortOnDrop(tokio::spawn(self.clone().unpark_loop(keeper_stop.clone())));
        self.state.taking_jobs.store(true, Ordering::SeqCst);
        loop {
            self.state.beat();
            let first = tokio::select! {
                p = sem.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                _ = stop.cancelled() => break,
                // Every job permit busy (long calls): still alive, for the watchdog.
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
            };
            if stop.is_cancelled() {
                break;
            }
            if let Some(wait) = self.budget_pause_left() {
                // A budget with on_exhausted = "pause" has no room: take no new jobs
                // (they wait in the stream) until it has or its window ends.
                drop(first);
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.cancelled() => break,
                }
                continue;
            }
            let mut permits = vec![first];
            while let Ok(p) = sem.clone().try_acquire_owned() {
                permits.push(p);
            }
            // While half the read-ahead or more still waits for a job permit, a read
            // waits until as many read permits are free, and takes that many jobs at
            // once: not a read (and its cancel check) at each job's end, which is what
            // a process running a few jobs a second did (8 processes, each holding
            // `concurrency` jobs that wait for their share of the fleet's slots: 0.55
            // reads a job). A job starting frees no read permit, so the reader also wakes
            // at each start to see whether the line got short.
            let floor = (self.cfg.worker.read_ahead() / 2).max(1);
            while permits.len() < floor && self.in_line.load(Ordering::SeqCst) >= floor {
                // Each pass is a round of the reader for the watchdog: a job ending
                // less than a second after the last restarts the sleep below.
                self.state.beat();
                tokio::select! {
                    p = sem.clone().acquire_owned() => match p {
                        Ok(p) => permits.push(p),
                        Err(_) => break,
                    },
                    _ = self.place_taken.notified() => {}
                    _ = stop.cancelled() => break,
                    // At least a pass a second (every job long in its call).
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                while let Ok(p) = sem.clone().try_acquire_owned() {
                    permits.push(p);
                }
            }
            if stop.is_cancelled() {
                break;
            }
            if self.budget_pause_left().is_some() {
                // A budget paused while the reader waited: no read now (the permits go
                // back; the pause is waited out at the top).
                continue;
            }
            if conn.is_none() {
                match self.connect_reader().await {
                    Ok((c, id)) => {
                        if connected_once {
                            metrics::counter!("llm_worker_redis_reconnects_total").increment(1);
                        }
                        connected_once = true;
                        reader_id.store(id, Ordering::SeqCst);
                        // The group exists and Redis answers: ready now, not after the
                        // first read's BLOCK.
                        self.redis_up();
                        conn = Some(c);
                        if stop.is_cancelled() {
                            break;
                        }
                    }
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
                let reclaim_began = Instant::now();
                match self.queue.reclaim(permits.len()).await {
                    Ok(r) => {
                        for id in &r.deleted {
                            tracing::warn!(entry = %id, "pending job was deleted from the stream; dropped from the pending list (a worker still running it writes its result)");
                            metrics::counter!("llm_worker_jobs_deleted_while_pending_total")
                                .increment(1);
                        }
                        let (ours, others): (Vec<Delivery>, Vec<Delivery>) = r
                            .deliveries
                            .into_iter()
                            .partition(|d| self.is_active_or_finished(&d.entry_id, reclaim_began));
                        if !others.is_empty() {
                            tracing::info!(
                                count = others.len(),
                                "took over jobs pending longer than queue.claim_idle_ms"
                            );
                            metrics::counter!("llm_worker_jobs_reclaimed_total")
                                .increment(others.len() as u64);
                        }
                        for d in ours {
                            // Our own entry, reclaimed because its keepalive lagged: it
                            // already has a task (and maybe a paid call), or its task
                            // committed it since the reclaim ran.
                            tracing::warn!(entry = %d.entry_id, "reclaimed an entry this worker is already running or has just finished (or may have: more jobs settled during the reclaim than it remembers; the entry is reclaimed again later); not started twice (keepalive is lagging: check Redis latency and queue.claim_idle_ms)");
                            metrics::counter!("llm_worker_self_reclaims_skipped_total")
                                .increment(1);
                        }
                        let mut others = others;
                        self.check_cancels(&mut others);
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
                        reader_id.store(0, Ordering::SeqCst);
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
                Ok(mut deliveries) => {
                    // Not waited for: the next read goes out at once (see CancelCheck).
                    self.check_cancels(&mut deliveries);
                    self.redis_up();
                    backoff.reset();
                    for d in deliveries {
                        let Some(permit) = permits.pop() else { break };
                        self.spawn_job(&tracker, d, permit, &abort);
                    }
                }
                Err(e) => {
                    conn = None;
                    reader_id.store(0, Ordering::SeqCst);
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
        // Every job has ended: the rate blocks' corrections go with the other settles.
        self.sweep_rate_blocks(true);
        // Detached slot releases end before the daemon's release-all (which covers any
        // still waiting past this bound).
        self.releases.close();
        if tokio::time::timeout(Duration::from_secs(1), self.releases.wait())
            .await
            .is_err()
        {
            tracing::warn!("slot releases still running at exit; releasing every slot instead");
        }
    }

    /// Starts a task on `d`, holding `permit` (a read permit) to its end; it takes a job
    /// permit now if one is free, else it waits for one (read ahead) before its parse.
    /// The entry joins `active` now (so a reclaim of it is skipped and the keepalive keeps
    /// it ours while the task lives, waiting included), and its [`JobGuard`] undoes
    /// everything on any exit.
    pub(super) fn spawn_job(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        d: Delivery,
        permit: OwnedSemaphorePermit,
        abort: &CancellationToken,
    ) {
        lock(&self.active).insert(d.entry_id.clone(), String::new());
        lock(&self.read_permits).insert(d.entry_id.clone(), permit);
        if let Ok(p) = self.sem.clone().try_acquire_owned() {
            lock(&self.permits).insert(d.entry_id.clone(), p);
        }
        self.state.in_flight.fetch_add(1, Ordering::SeqCst);
        self.job_metrics.in_flight().increment(1.0);
        let guard = JobGuard {
            worker: self.clone(),
            entry_id: d.entry_id.clone(),
            ended: false,
            settled: false,
        };
        let me = self.clone();
        let abort = abort.clone();
        // Every log line of the job carries its entry id, and its job id once parsed.
        // At the ERROR level, so it is there for every line any log level lets through.
        let span = tracing::error_span!("job", entry = %d.entry_id, id = tracing::field::Empty);
        tracker.spawn(tracing::Instrument::instrument(
            async move {
                let mut guard = guard; // moved in whole: dropped with the task, whatever ends it
                guard.settled = me.handle(d, abort).await;
                guard.ended = true;
            },
            span,
        ));
    }

    /// Running here, or settled here since `since` (the start of the reclaim whose
    /// reply is being sorted): a commit settled before the reclaim began had its XACK
    /// executed before the XAUTOCLAIM, so it cannot be returned by it; one settled after
    /// may be (the race this guards). An entry settled earlier and reclaimed anyway lost its
    /// commit in Redis (a failover, a restart from an older snapshot) and runs again. (The
    /// guard fills `finished` before it leaves `active`, and this reads them in the
    /// opposite order, so an entry moving from one to the other is seen in one of them.)
    pub(super) fn is_active_or_finished(&self, entry_id: &str, since: Instant) -> bool {
        lock(&self.active).contains_key(entry_id) || lock(&self.finished).since(entry_id, since)
    }

    /// The reclaimer's sweep of consumers left by stopped workers (see
    /// [`Queue::remove_consumers`]). Failures are logged only: the next sweep retries.
    pub(super) async fn prune_consumers(&self, idle: Duration) {
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

    /// Cancel markers of the entries read that look like jobs without an `id` (their
    /// payload has no `"id"` key at all): one round trip for the whole batch, so a queued
    /// id-less job that was cancelled ends without a call. (Jobs with an id are checked by
    /// their id claim; an entry this skips and that turns out id-less is checked by its
    /// task.) Not waited for: the round trip runs beside the reader's next read instead
    /// of before it (on the path from one read to the next, it held back how soon freed
    /// permits were refilled), and each entry's task waits for its flag before its call
    /// ([`CancelCheck`]). Bounded (1 s); a failed or late check leaves the entries
    /// unchecked, and their tasks read their markers themselves.
    pub(super) fn check_cancels(&self, deliveries: &mut [Delivery]) {
        let idx = unkeyed(deliveries);
        if idx.is_empty() {
            return;
        }
        let ids: Vec<String> = idx
            .iter()
            .map(|&i| job_id_of(&deliveries[i]).to_string())
            .collect();
        // The tasks read earlier and still waiting for a job permit, the next
        // `concurrency` of them: their markers are read again in the same command.
        let waiting = self.waiters_to_recheck();
        let (tx, rx) = tokio::sync::watch::channel(None);
        let queue = self.queue.clone();
        tokio::spawn(async move {
            let refs: Vec<&str> = ids
                .iter()
                .chain(waiting.iter().map(|(id, _)| id))
                .map(String::as_str)
                .collect();
            let sent = Instant::now();
            let asked = tokio::time::timeout(Duration::from_secs(1), queue.cancelled(&refs));
            let flags: CancelFlags = match asked.await {
                Ok(Ok(f)) if f.len() == refs.len() => {
                    super::record_rechecks(&waiting, sent, &f[ids.len()..]);
                    Some(f[..ids.len()].into())
                }
                _ => None,
            };
            // No task waiting any more (all ended): nobody to tell.
            let _ = tx.send(Some(flags));
        });
        for (at, i) in idx.into_iter().enumerate() {
            deliveries[i].cancel_check = Some(CancelCheck::new(rx.clone(), at));
        }
    }

    /// The reader's own connection and its CLIENT ID, with the group ensured.
    pub(super) async fn connect_reader(
        &self,
    ) -> Result<(redis::aio::MultiplexedConnection, i64), QueueError> {
        let mut c = blocking_connection(&self.cfg).await?;
        self.queue.ensure_group().await?;
        // Best effort: a Redis user without CLIENT ID still reads jobs (the first signal
        // then waits out the current BLOCK).
        let mut cmd = redis::cmd("CLIENT");
        cmd.arg("ID");
        let asked = tokio::time::timeout(Duration::from_secs(2), cmd.query_async::<i64>(&mut c));
        let id = match asked.await {
            Ok(Ok(id)) => id,
            Ok(Err(e)) => {
                if !self.warned_client_id.swap(true, Ordering::SeqCst) {
                    tracing::warn!(error = %e, "CLIENT ID refused (the Redis user may lack it); at a signal the worker waits out its blocking read (queue.block_ms)");
                }
                0
            }
            Err(_) => return Err(QueueError::Timeout(Duration::from_secs(2))),
        };
        Ok((c, id))
    }

    pub(super) fn redis_down(&self, e: &QueueError) {
        if self.state.redis_ok.swap(false, Ordering::SeqCst) {
            tracing::error!(error = %e, "Redis unreachable; not taking jobs until it answers");
        }
        metrics::counter!("llm_worker_redis_errors_total").increment(1);
    }

    pub(super) fn redis_up(&self) {
        if !self.state.redis_ok.swap(true, Ordering::SeqCst) {
            tracing::info!("Redis reachable; taking jobs");
        }
    }
}

/// The entries whose payload has no `"id"` key at all: jobs without an id, which no id
/// claim checks for a cancel marker (an entry this skips and that turns out id-less is
/// checked by its task).
fn unkeyed(deliveries: &[Delivery]) -> Vec<usize> {
    deliveries
        .iter()
        .enumerate()
        .filter(|(_, d)| {
            d.payload
                .as_deref()
                .is_some_and(|p| !p.windows(4).any(|w| w == b"\"id\""))
        })
        .map(|(i, _)| i)
        .collect()
}

/// The job id of an entry without a producer id: the entry id it was first pushed as.
pub(super) fn job_id_of(d: &Delivery) -> &str {
    d.first_entry.as_deref().unwrap_or(&d.entry_id)
}
