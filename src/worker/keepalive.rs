//! The keepalive: resets the idle time of the entries this process runs (and extends
//! their ids' in-progress markers) every `claim_idle_ms / 3`; also the fleet heartbeat.
//!
//! Invariant: touches only entries in `active`, never another consumer's.

use crate::sync::lock;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::*;

impl Worker {
    /// Every third of `queue.claim_idle_ms`, resets the idle time of the jobs this process
    /// is working on, so a call that legitimately runs long is not taken over (and paid
    /// for a second time) by another worker.
    pub(super) async fn keep_alive(self: Arc<Self>, stop: CancellationToken) {
        // At least 66 ms: validation keeps claim_idle_ms >= config::CLAIM_IDLE_FLOOR.
        let period = self.cfg.queue.claim_idle_ms / 3;
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            // A job id only for jobs that claimed it: a copy waiting for another copy of
            // its id owns no marker and must not re-create one that lapsed.
            let entries: Vec<(String, String)> = {
                let claimed = lock(&self.claimed);
                lock(&self.active)
                    .iter()
                    .map(|(e, j)| {
                        let keyed = claimed.contains(e);
                        (e.clone(), if keyed { j.clone() } else { String::new() })
                    })
                    .collect()
            };
            match self.queue.keepalive_report(&entries).await {
                Ok(hb) => {
                    // A job that committed since the snapshot is gone too, legitimately.
                    let active = lock(&self.active);
                    for e in hb.gone.iter().filter(|e| active.contains_key(*e)) {
                        if hb.taken.contains(e) {
                            // Another worker runs it now, or already settled it.
                            tracing::warn!(entry = %e, "job was taken over by another worker: not called here if it has not called yet; a call already made has its result discarded if the other worker commits first");
                            lock(&self.taken_over).insert(e.clone());
                        } else {
                            // Acknowledged elsewhere, or dropped from the pending list
                            // after its deletion (a tombstone lets this worker's result in).
                            tracing::warn!(entry = %e, "job is no longer pending under this worker (acknowledged elsewhere, or deleted by the producer and dropped); its result is written only if nobody else's was");
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "keepalive failed; retrying next tick"),
            }
        }
    }
}

/// How often the cancel watcher asks Redis about the ids of the jobs running here: a
/// cancel reaches a running job within this (plus a round trip), fleet-wide.
pub(super) const CANCEL_POLL: std::time::Duration = std::time::Duration::from_millis(500);
/// How often every worker moves back the jobs parked by budgets that have room again.
const UNPARK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Worker {
    /// Once a second: jobs parked by budgets go back as far as each budget has room
    /// (see [`Worker::unpark_budgets`]). Runs whatever the config says, so jobs parked
    /// under a budget since removed are moved back too. A task of its own: many parked
    /// streams never delay the cancel checks.
    pub(super) async fn unpark_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(UNPARK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            self.unpark_budgets().await;
        }
    }

    /// Every [`CANCEL_POLL`]: closes the rate blocks whose second ended. While jobs run
    /// here: one round trip (an MGET)
    /// asks whether their ids have a cancel marker, and fires the stop switch of each that
    /// has. No jobs, no round trip.
    pub(super) async fn watch_cancels(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(CANCEL_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => return,
            }
            // Rate blocks whose second ended while nothing drew on them: their corrections
            // go now, not at the model's next call.
            self.sweep_rate_blocks(false);

            let watched: Vec<(String, String)> = lock(&self.stops)
                .iter()
                .filter(|(_, (_, t))| !t.is_cancelled())
                .map(|(e, (id, _))| (e.clone(), id.clone()))
                .collect();
            if watched.is_empty() {
                continue;
            }
            let ids: Vec<&str> = watched.iter().map(|(_, id)| id.as_str()).collect();
            match self.queue.cancelled(&ids).await {
                Ok(flags) => {
                    let stops = lock(&self.stops);
                    for ((entry, id), _) in watched.iter().zip(flags).filter(|(_, f)| *f) {
                        if let Some((_, token)) = stops.get(entry) {
                            tracing::info!(entry = %entry, job = %id, "cancel requested; stopping the job");
                            token.cancel();
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "cancel check failed; retrying next tick"),
            }
        }
    }
}

/// Stops the keepalive task when the reader loop's drain ends.
pub(super) struct KeeperGuard(
    pub(super) CancellationToken,
    pub(super) tokio::task::JoinHandle<()>,
);

impl Drop for KeeperGuard {
    fn drop(&mut self) {
        self.0.cancel();
        self.1.abort();
    }
}
