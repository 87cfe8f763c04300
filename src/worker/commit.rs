//! Writing a job's end: the result (or dead letter) built from the job's outcome and
//! committed with its acknowledgement, held while Redis is away.
//!
//! Invariant: a paid result is never dropped because of time; it is held (bounded by
//! count and bytes) until Redis answers, then committed unless the id already has one.

use crate::job::Job;
use crate::provider::{self};
use crate::queue::{
    Commit, CommitOutcome, DeadLetter, Delivery, QueueError, ResultEntry, ResultStatus,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::*;

impl Worker {
    /// Writes a finished job's result. A paid result is never dropped because of time:
    ///
    /// - an error that heals ([`QueueError::heals`]: Redis unreachable, timeouts, `OOM`
    ///   under `noeviction`, `LOADING`, a failover) holds the result and retries with
    ///   backoff until Redis takes it. Held results are bounded by count (each holds its
    ///   task's read permit, so at most `worker.concurrency + worker.read_ahead`, plus
    ///   copies of busy ids that gave theirs back, at most `worker.concurrency` more) and
    ///   by bytes
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
    /// stays pending for another worker. Returns true when the entry is settled (a result
    /// written now, by an earlier try, or by another worker).
    pub(super) async fn commit_until_written(
        &self,
        d: &Delivery,
        commit: Commit,
        abort: &CancellationToken,
    ) -> bool {
        let commit = Arc::new(commit);
        let started = Instant::now();
        let _timed = CommitTimer(started, &self.job_metrics);
        let mut backoff = Backoff::redis();
        let mut held: Option<HeldBytes> = None;
        let mut fallback: Option<Arc<Commit>> = None;
        let mut last_unwritable_log: Option<Instant> = None;
        loop {
            let mut wait = false;
            let current = fallback.as_ref().unwrap_or(&commit);
            match self.queue.commit_shared(current.clone()).await {
                Ok(CommitOutcome::Written { .. }) => {
                    if held.is_some() {
                        tracing::info!(entry = %d.entry_id, "held result written");
                    }
                    return true;
                }
                Ok(CommitOutcome::AlreadyWritten { result_id }) => {
                    tracing::info!(entry = %d.entry_id, result = %result_id, "result was written by an earlier try whose reply was lost");
                    metrics::counter!("llm_worker_commit_reply_lost_total").increment(1);
                    return true;
                }
                Ok(CommitOutcome::Superseded) => {
                    tracing::warn!(entry = %d.entry_id, "job was already committed by another worker; result discarded");
                    metrics::counter!("llm_worker_commit_superseded_total").increment(1);
                    return true;
                }
                Err(e) if e.heals() => {
                    wait = true;
                    if held.is_none() {
                        match HeldBytes::take(current.size()) {
                            Some(h) => held = Some(h),
                            None => {
                                tracing::error!(entry = %d.entry_id, error = %e, limit = MAX_HELD_RESULT_BYTES, "cannot write result and too many result bytes are held already; dropping it (the job will be reclaimed and paid again)");
                                metrics::counter!("llm_worker_results_lost_total").increment(1);
                                return false;
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
                    fallback = Some(Arc::new(self.minimal_failed(d, &commit, &e)));
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
                return false;
            }
            if wait {
                backoff.sleep(abort).await;
            }
        }
    }

    /// The smallest result that says what happened when the full one cannot be written
    /// (a key it touches has the wrong type): status `failed`, the usage and cost of the
    /// calls made, the error; no dead letter, cost totals, or result marker.
    pub(super) fn minimal_failed(&self, d: &Delivery, full: &Commit, e: &QueueError) -> Commit {
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
        Commit::result_only(&d.entry_id, result)
    }

    /// A result of `status` for this delivery with no model call counted yet.
    pub(super) fn base_result(
        &self,
        d: &Delivery,
        job_id: &str,
        status: ResultStatus,
        started: Instant,
    ) -> ResultEntry {
        let mut r = ResultEntry::new(
            job_id,
            &d.entry_id,
            status,
            started.elapsed().as_millis() as u64,
            self.queue.consumer(),
        );
        // Every result says what was billed, even when nothing was.
        r.usage = Some("[]".into());
        r
    }

    /// The commit for a job that cannot be processed: `invalid` result + dead letter.
    /// What earlier deliveries of the job spent (`spent`, carried by a hand-back) is in
    /// the result and the cost totals.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reject(
        &self,
        d: &Delivery,
        job_id: Option<&str>,
        keyed: bool,
        status: ResultStatus,
        reason: &str,
        started: Instant,
        spent: &Spent,
    ) -> Commit {
        let id = job_id.unwrap_or(&d.entry_id);
        let mut result = self.base_result(d, id, status, started);
        result.error = Some(reason.to_string());
        // Every field of the original entry, name and value verbatim (so `payload` when
        // there was one); see `DeadLetter` for the shape.
        let dead = DeadLetter::new(&d.entry_id, job_id, reason, d.deliveries, d.fields.clone());
        self.job_metrics.count(status);
        let commit = Commit {
            dead: dead.into_fields(),
            // A dead job with a known id has a result: later copies of the id are duplicates.
            // Markers only for a producer's id (`keyed`; see `Job::keyed`).
            dedupe_id: job_id
                .filter(|_| keyed && status == ResultStatus::Dead)
                .map(str::to_string),
            inflight_id: job_id.filter(|_| keyed).map(str::to_string),
            ..Commit::result_only(&d.entry_id, result)
        };
        self.charge(commit, spent)
    }

    /// `commit` (a result for which this delivery called no model) with what earlier
    /// deliveries spent: their usage, cost, attempts and models tried in the result, their
    /// cost totals added. Unchanged when nothing was spent.
    pub(super) fn charge(&self, mut commit: Commit, spent: &Spent) -> Commit {
        if spent.attempts == 0 {
            return commit;
        }
        let Ok(mut result) = ResultEntry::from_fields(commit.result.iter().map(|(k, v)| (*k, v)))
        else {
            // Our own encoding always decodes; if it ever did not, the result stays as is.
            return commit;
        };
        result.input_tokens = spent.bill.usage.prompt_tokens;
        result.output_tokens = spent.bill.usage.completion_tokens;
        result.cached_tokens = Some(spent.bill.usage.cached_tokens);
        result.usage = serde_json::to_string(&spent.bill.raw_usage).ok();
        result.cost_usd = spent.bill.cost;
        result.attempts = spent.attempts;
        result.tried = spent.tried.clone();
        commit.result = result.into_fields();
        commit.costs = spent.bill.cost_fields();
        commit
    }

    /// The commit of a job that ran: its answer or error, with everything `spent` (this
    /// delivery's calls and those a hand-back carried).
    pub(super) fn finish(
        &self,
        d: &Delivery,
        job: &Job,
        finished: Finished,
        spent: &Spent,
        started: Instant,
    ) -> Commit {
        let bill = &spent.bill;
        let status = match finished {
            Finished::Ok { .. } => ResultStatus::Ok,
            Finished::Failed(_) => ResultStatus::Failed,
            Finished::Stopped(Stop::Cancelled) => ResultStatus::Cancelled,
            Finished::Stopped(Stop::Expired) => ResultStatus::Expired,
        };
        let mut result = self.base_result(d, &job.id, status, started);
        match finished {
            Finished::Ok { model, completion } => {
                result.model = Some(model);
                result.content = Some(completion.content);
                result.finish_reason = Some(completion.finish_reason);
            }
            Finished::Failed(e) => {
                // The class of the last call's error, else the reason's first word
                // (`budget:`, `tier:`, `context:`).
                let class = spent
                    .last_class
                    .unwrap_or_else(|| e.split(':').next().unwrap_or("").trim());
                tracing::warn!(
                    tried = %spent.tried.join(","),
                    attempts = spent.attempts,
                    class = %class,
                    error = %provider::one_line(&e),
                    "job failed"
                );
                result.error = Some(provider::one_line(&e));
            }
            Finished::Stopped(stop) => {
                let when = if spent.aborted_call {
                    "its model call was aborted; what was billed before is counted"
                } else if spent.attempts > 0 {
                    "between model calls; what was billed before is counted"
                } else {
                    "before any model call"
                };
                let why = match stop {
                    Stop::Cancelled => {
                        format!("cancelled: by a cancel of job id {} ({when})", job.id)
                    }
                    Stop::Expired => format!(
                        "expired: deadline_ms {} passed ({when})",
                        job.deadline_ms.unwrap_or(0)
                    ),
                };
                tracing::info!(
                    tried = %spent.tried.join(","),
                    attempts = spent.attempts,
                    status = %status,
                    "job stopped: {why}"
                );
                result.error = Some(provider::one_line(&why));
            }
        }
        result.input_tokens = bill.usage.prompt_tokens;
        result.output_tokens = bill.usage.completion_tokens;
        result.cached_tokens = Some(bill.usage.cached_tokens);
        result.usage = serde_json::to_string(&bill.raw_usage).ok();
        result.cost_usd = bill.cost;
        result.attempts = spent.attempts;
        result.tried = spent.tried.clone();
        result.metadata = job.metadata.as_ref().map(|m| m.to_string());
        result.tenant = job.tenant.clone();
        result.trimmed_messages = spent.trimmed_messages;
        // A failed job's payload is kept (in `{ns}:failed`) so it can be retried.
        let failed_copy = match (status, &result.error) {
            (ResultStatus::Failed, Some(e)) => {
                let id = job.keyed.then_some(job.id.as_str());
                DeadLetter::new(&d.entry_id, id, e, d.deliveries, d.fields.clone()).into_fields()
            }
            _ => vec![],
        };
        if !bill.warnings.is_empty() {
            result.warning = Some(provider::one_line(&bill.warnings.join("; ")));
        }
        self.job_metrics.count(status);
        self.job_metrics
            .job_seconds()
            .record(started.elapsed().as_secs_f64());
        // Markers only for a producer's id (see `Job::keyed`).
        let key = job.keyed.then(|| job.id.clone());
        Commit {
            dedupe_id: key.clone(),
            inflight_id: key,
            costs: bill.cost_fields(),
            dead_is_failed_copy: !failed_copy.is_empty(),
            dead: failed_copy,
            ..Commit::result_only(&d.entry_id, result)
        }
    }

    /// The result for a copy of a job id that already has one: it points at the original
    /// (`duplicate_of`), repeats its answer, and costs nothing (no model was called).
    pub(super) async fn duplicate(
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
        result.tenant = job.tenant.clone();
        Commit::result_only(&d.entry_id, result)
    }
}

/// Records how long a job's commit took (from its result to its settling, held results
/// included) in `llm_worker_commit_seconds` when the commit ends, however it ends. The
/// handle is taken then, not at the start: the series appears once a commit has ended.
struct CommitTimer<'a>(Instant, &'a JobMetrics);

impl Drop for CommitTimer<'_> {
    fn drop(&mut self) {
        self.1
            .commit_seconds()
            .record(self.0.elapsed().as_secs_f64());
    }
}

/// Bytes of results one process holds at most while Redis does not take them (see
/// [`Worker::commit_until_written`]); a result past it is dropped and counted.
pub const MAX_HELD_RESULT_BYTES: usize = 256 << 20;

/// How often a result that no key fix can yet take is retried.
pub(super) const UNWRITABLE_RETRY: Duration = Duration::from_secs(5);

/// How often the error for such a result is logged again.
pub(super) const UNWRITABLE_LOG_EVERY: Duration = Duration::from_secs(60);

pub(super) static HELD_BYTES: AtomicUsize = AtomicUsize::new(0);

/// A share of [`MAX_HELD_RESULT_BYTES`], given back on drop.
pub(super) struct HeldBytes(pub(super) usize);

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
