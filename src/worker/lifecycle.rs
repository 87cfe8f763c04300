//! One job's lifecycle: parse -> id check -> poison check -> route plan -> per attempt a
//! slot and a provider call -> decision; handed back when shutdown stops it first.
//!
//! Invariants: no provider call starts after the first signal; a task's bookkeeping is
//! undone by its drop guard on any exit (return, panic, cancellation); nothing is
//! awaited between a provider's answer and the decision (the slot release is detached),
//! so `abort` cannot cut a paid answer off from its commit; what calls cost is recorded
//! in the task's `Spent` as they end, so a hand-back carries it.

use crate::context;
use crate::gate::Answer;
use crate::job::{self};
use crate::provider::{self, CallError, ProviderClient};
use crate::queue::{Commit, Delivery, HandBack, IdClaim, QueueError, ResultStatus, TenantAdmit};
use crate::quota;
use crate::router::{Candidate, Decision, ErrorClass, Plan};
use crate::slots::{Lease, SlotError};
use crate::sync::lock;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::*;

impl Worker {
    /// Runs one job to its commit. A job stopped by shutdown before its result exists
    /// (`abort` fired, or it had not started its call when draining began) is handed back
    /// to the fleet. Cleanup of `active`, the permit and `in_flight` is the caller's
    /// [`JobGuard`], so it also happens on a panic. Returns true when the entry is settled
    /// (its commit wrote a result or found one): it can never be pending again.
    pub async fn handle(&self, d: Delivery, abort: CancellationToken) -> bool {
        let started = Instant::now();
        let spent = Mutex::new(Spent::carried(d.billed.as_deref(), &d.entry_id));
        // The call on the wire (outside `process`, so the shutdown abort that drops it
        // still finds the call).
        let on_wire: OnWire = Mutex::new(None);
        let commit = tokio::select! {
            // A job whose end is decided in the same poll as `abort` keeps its result.
            biased;
            // Boxed: the job's state machine is large (kilobytes); on the heap it is
            // never copied when the task is spawned or polled.
            c = Box::pin(self.process(&d, started, &spent, &on_wire)) => c,
            _ = abort.cancelled() => {
                tracing::info!(entry = %d.entry_id, "job cancelled by shutdown; handing it back");
                metrics::counter!("llm_worker_jobs_abandoned_total").increment(1);
                None
            }
        };
        // A call cut off by the abort counts in what the hand-back carries.
        self.cut_off(&on_wire, &spent);
        // A place kept for this entry (moved back from a parked stream) and not taken:
        // given back now, so the tenant does not wait for it to lapse.
        if let Some(field) = &d.unparked {
            let s = lock(&spent);
            if !s.kept_taken && !s.parked {
                self.tenants.release_kept(field, &d.entry_id);
            }
        }
        match commit {
            Some(commit) => {
                // Decided: the next job (read ahead) starts now, while this one commits
                // (its read permit, held to the end, bounds the results held).
                drop(lock(&self.permits).remove(&d.entry_id));
                let settled = Box::pin(self.commit_until_written(&d, commit, &abort)).await;
                if settled && lock(&spent).cap_recorded {
                    self.drop_cap_spent(&d.entry_id);
                }
                settled
            }
            // Moved to a parked stream and acknowledged: never pending again.
            None if {
                let s = lock(&spent);
                s.parked || s.budget_parked
            } =>
            {
                true
            }
            None if self.draining.is_cancelled() => {
                let (called, billed) = {
                    let s = lock(&spent);
                    (s.called, s.carry())
                };
                Box::pin(self.hand_back(&d, called, billed.as_deref())).await;
                false
            }
            None => false,
        }
    }

    /// Hands an unfinished job back (see [`Queue::hand_back`]), with what it spent; the
    /// delivery counts toward `queue.max_deliveries` only if it `called` a model.
    /// Bounded, so a Redis outage cannot hold up the exit: the job then stays pending for
    /// `queue.claim_idle_ms`.
    pub(super) async fn hand_back(&self, d: &Delivery, called: bool, billed: Option<&[u8]>) {
        let job_id = lock(&self.active)
            .get(&d.entry_id)
            .filter(|j| !j.is_empty())
            .cloned();
        // The reader ends within its BLOCK (+2 s bound) of the signal.
        let bound = self.cfg.queue.block_ms + Duration::from_secs(2);
        let _ = tokio::time::timeout(bound, self.reader_stopped.cancelled()).await;
        // A delivery that never called a model (a rolling restart while it waited for a
        // slot) is not one: the next read adds 1 back.
        let deliveries = if called {
            d.deliveries
        } else {
            d.deliveries.saturating_sub(1)
        };
        let fut = self
            .queue
            .hand_back(&d.entry_id, job_id.as_deref(), deliveries, billed);
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
    pub(super) async fn wait_for_busy_id(
        &self,
        entry_id: &str,
        since: &mut Option<tokio::time::Instant>,
    ) -> bool {
        let first = since.is_none();
        let since = *since.get_or_insert_with(tokio::time::Instant::now);
        if first {
            // Tasks without a read permit: copies waiting so, and those that worked on
            // after their wait without one (none was free): at most `concurrency` in
            // all, so results held stay within `concurrency + read_ahead + concurrency`.
            let waiting = lock(&self.active)
                .len()
                .saturating_sub(lock(&self.read_permits).len());
            if waiting < self.cfg.worker.concurrency() {
                drop(lock(&self.permits).remove(entry_id));
                drop(lock(&self.read_permits).remove(entry_id));
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

    /// A job permit for a task read ahead (none was free at its read) or for a copy that
    /// gave its permits back while waiting and may now call a model, in the order they
    /// asked; such a copy also takes a read permit again if one is free (not waiting for
    /// one: the reader holds every free read permit through its blocking read, so on a
    /// quiet stream that wait would be up to `queue.block_ms`). `None` when draining
    /// began first; else how long it waited.
    pub(super) async fn regain_permit(&self, entry_id: &str) -> Option<Duration> {
        if lock(&self.permits).contains_key(entry_id) {
            return Some(Duration::ZERO);
        }
        let began = Instant::now();
        if !lock(&self.read_permits).contains_key(entry_id)
            && let Ok(read) = self.read_sem.clone().try_acquire_owned()
        {
            lock(&self.read_permits).insert(entry_id.to_string(), read);
        }
        // In line until the permit comes or the wait ends otherwise (the reader counts
        // the tasks in line; see `Worker::run`).
        struct InLine<'a>(&'a Worker);
        impl Drop for InLine<'_> {
            fn drop(&mut self) {
                self.0.in_line.fetch_sub(1, Ordering::SeqCst);
                self.0.place_taken.notify_one();
            }
        }
        self.in_line.fetch_add(1, Ordering::SeqCst);
        let in_line = InLine(self);
        let permit = tokio::select! {
            biased;
            _ = self.draining.cancelled() => return None,
            p = self.sem.clone().acquire_owned() => p.ok()?,
        };
        drop(in_line);
        lock(&self.permits).insert(entry_id.to_string(), permit);
        Some(began.elapsed())
    }

    /// Everything between reading a job and its commit. `None`: leave the job pending.
    /// What provider calls cost goes into `spent` as it happens (the caller reads it
    /// when this future is dropped by `abort`).
    pub(super) async fn process(
        &self,
        d: &Delivery,
        started: Instant,
        spent: &Mutex<Spent>,
        on_wire: &OnWire,
    ) -> Option<Commit> {
        // A task read ahead waits here for a job to end. Its cancel marker was read with
        // the entry, and again with each read while it waits (`awaiting`); after a long
        // wait with no read that recent it is read again (below) before any call.
        let recheck = d.cancel_check.as_ref().map(|_| {
            let r = Arc::new(Recheck::new());
            let id = super::reader::job_id_of(d).to_string();
            lock(&self.awaiting).insert(d.entry_id.clone(), (id, r.clone()));
            r
        });
        let waiting = AwaitGuard(self, &d.entry_id, recheck.clone());
        let waited = self.regain_permit(&d.entry_id).await?;
        drop(waiting);
        // The reader's check of this entry, if it sent one: `Some(found)` once answered.
        let read_with_entry = match &d.cancel_check {
            Some(check) => self.unless_draining(check.wait()).await?,
            None => None,
        };
        // A later read's word, if one came: a marker found counts whenever; none found,
        // only if that read was sent less than CANCEL_CHECK_FRESH ago.
        let later = recheck.and_then(|r| r.status(CANCEL_CHECK_FRESH));
        let read_with_entry = if later == Some(true) {
            Some(true)
        } else {
            read_with_entry
        };
        let cancel_known =
            (read_with_entry.is_some() && waited < CANCEL_CHECK_FRESH) || later == Some(false);
        if let Some(reason) = &d.malformed {
            tracing::warn!(entry = %d.entry_id, %reason, "invalid job entry; dead-lettered");
            let id = job::salvage_id(d.payload.as_deref());
            return Some(self.reject(
                d,
                id.as_deref(),
                id.is_some(),
                ResultStatus::Invalid,
                reason,
                started,
                &lock(spent),
            ));
        }
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
                    id.is_some(),
                    ResultStatus::Invalid,
                    &e.to_string(),
                    started,
                    &lock(spent),
                ));
            }
        };
        // Quoted and escaped (Debug): a job id is producer text and may hold newlines.
        tracing::Span::current().record("id", job.id.as_str());
        if job.keyed {
            // The id, for a hand-back (which releases the id's in-progress marker if it
            // is this entry's); the keepalive keeps the marker only once it is claimed.
            lock(&self.active).insert(d.entry_id.clone(), job.id.clone());
        }
        #[cfg(debug_assertions)]
        debug_hooks::maybe_panic(&job.id);
        // Idempotency by id: one model call per id, however many copies are pushed. A job
        // without a producer id is its entry alone (pending-ness gives one result per
        // entry, `active` one task per entry in this process): no marker, no round trip.
        let mut backoff = Backoff::redis();
        let mut busy_since = None;
        if job.keyed {
            loop {
                match self.queue.claim_id(&job.id, &d.entry_id).await {
                    Ok(IdClaim::Claimed) => {
                        // From now on the keepalive extends (or re-creates) the id's
                        // in-progress marker. Not before: a copy waiting for another copy
                        // of its id owns no marker, and must not take one that lapsed.
                        lock(&self.claimed).insert(d.entry_id.clone());
                        self.regain_permit(&d.entry_id).await?;
                        break;
                    }
                    Ok(IdClaim::Done { result_id, status }) => {
                        tracing::info!(entry = %d.entry_id, job = %job.id, original = %result_id, "duplicate job id; acknowledged without a model call");
                        metrics::counter!("llm_worker_jobs_duplicate_total").increment(1);
                        let dup = self.duplicate(d, &job, &result_id, &status, started).await;
                        return Some(self.charge(dup, &lock(spent)));
                    }
                    Ok(IdClaim::Cancelled) => {
                        let f = Finished::Stopped(Stop::Cancelled);
                        return Some(self.finish(d, &job, f, &lock(spent), started));
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
                        let check = ("idempotency", "fix the key named");
                        let s = lock(spent);
                        return Some(self.check_impossible(d, &job, check, &e, started, &s));
                    }
                    Err(e) => {
                        // One line per job, not per retry: the reader logs the outage itself.
                        if backoff.failures() == 0 {
                            tracing::warn!(entry = %d.entry_id, error = %e, "idempotency check failed; retrying until Redis answers");
                        }
                        backoff.sleep(&self.draining).await;
                        if self.draining.is_cancelled() {
                            return None;
                        }
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
            let s = lock(spent);
            tracing::error!(
                tried = %s.tried.join(","),
                attempts = s.attempts,
                class = s.last_class.unwrap_or("dead"),
                "poison job; dead-lettered"
            );
            drop(s);
            return Some(self.reject(
                d,
                Some(&job.id),
                job.keyed,
                ResultStatus::Dead,
                &reason,
                started,
                &lock(spent),
            ));
        }
        if !d.extra_fields.is_empty() {
            lock(spent).bill.warnings.push(format!(
                "ignored stream fields other than payload: {}",
                d.extra_fields.join(", ")
            ));
        }
        // Cancel and deadline: a job that must not start ends here without a call; from
        // here on, the job's loop runs against its stop switch (below). A job with an id
        // had its cancel marker checked by its id claim; one without, by the reader (or
        // here, the rare entry the reader took for one with an id).
        let stop = CancellationToken::new();
        lock(&self.stops).insert(d.entry_id.clone(), (job.id.clone(), stop.clone()));
        if !job.keyed {
            let cancelled = if read_with_entry == Some(true) {
                true // found with the entry: a cancel is never taken back
            } else if cancel_known {
                false
            } else {
                // Its own read, as the id claim does for a job with an id: retried while
                // Redis does not answer; an error retrying cannot heal (NOPERM: an ACL
                // without `{ns}:cancel:*`) fails the job without a call, never calls it
                // unchecked. Tasks starting together (calls that started together end
                // together) share one read (`cancel_reads`), and the waiters next in line
                // ride along (see `awaiting`): at one job start every 25 ms, one read
                // serves the next few. A signal ends the wait: no call starts after it.
                loop {
                    let asked = self.cancel_reads.ask(job.id.clone());
                    // Bounded by the read out when the ask came and its own (1 s each).
                    let asked = tokio::time::timeout(Duration::from_secs(2), asked);
                    let e = match self.unless_draining(asked).await? {
                        Ok(Ok(found)) => break found,
                        Ok(Err(e)) => e,
                        Err(_) => QueueError::Timeout(Duration::from_secs(2)),
                    };
                    if !e.heals() {
                        let check = ("cancel", "let the Redis user read the cancel markers");
                        let s = lock(spent);
                        return Some(self.check_impossible(d, &job, check, &e, started, &s));
                    }
                    if backoff.failures() == 0 {
                        tracing::warn!(entry = %d.entry_id, error = %e, "cancel check failed; retrying until Redis answers");
                    }
                    backoff.sleep(&self.draining).await;
                    if self.draining.is_cancelled() {
                        return None;
                    }
                }
            };
            if cancelled {
                let f = Finished::Stopped(Stop::Cancelled);
                return Some(self.finish(d, &job, f, &lock(spent), started));
            }
        }
        if job
            .deadline_ms
            .is_some_and(|at| crate::cost::unix_now_ms() >= at)
        {
            let f = Finished::Stopped(Stop::Expired);
            return Some(self.finish(d, &job, f, &lock(spent), started));
        }
        let order = match quota::tier_filter(
            &self.cfg,
            job.tier.as_deref(),
            job::model_order(&job, &self.cfg),
        ) {
            Ok(order) => order,
            Err(e) => {
                let f = Finished::Failed(e.to_string());
                return Some(self.finish(d, &job, f, &lock(spent), started));
            }
        };
        let candidates: Vec<Candidate> = order
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
            tracing::warn!(
                class = "invalid",
                "no model to run on (every model of the route is unavailable); dead-lettered"
            );
            return Some(self.reject(
                d,
                Some(&job.id),
                job.keyed,
                ResultStatus::Invalid,
                "no model to run on",
                started,
                &lock(spent),
            ));
        }
        // The per-job cost cap: each candidate's worst case, checked before every call
        // against what the job has spent so far.
        let worst: Vec<_> = match job.max_cost_usd {
            Some(_) => candidates
                .iter()
                .map(|c| match self.cfg.models.get(&c.model) {
                    Some(mc) => quota::worst_case(&job.body, mc),
                    None => Ok(rust_decimal::Decimal::ZERO),
                })
                .collect(),
            None => vec![],
        };
        // A delivery of an entry taken over from another worker starts from what earlier
        // deliveries recorded against the cap: a worker killed mid-call left that call's
        // worst case there ([`Queue::cap_spent_add`]); else the job could spend its cap
        // once per delivery.
        if job.max_cost_usd.is_some() && (d.deliveries > 1 || d.reclaimed) {
            let earlier = self.cap_spent_before(&d.entry_id).await?;
            if earlier > rust_decimal::Decimal::ZERO {
                let mut s = lock(spent);
                s.earlier_deliveries = earlier;
                s.cap_recorded = true; // dropped with the result
                s.bill.warnings.push(format!(
                    "an earlier delivery of this job stopped during or after a model call without a result (its worker died): up to {} USD it may have been billed is counted against max_cost_usd, and is not in this result's cost",
                    crate::cost::format_usd(earlier)
                ));
            }
        }
        let mut plan = Plan::new(candidates, self.policy);
        // A job without a producer id has no marker that would stop a second paid call:
        // delivered again, it checks once, right before its first call, that its entry is
        // still pending under this worker (not committed meanwhile by the worker it was
        // taken over from). A first delivery skips the round trip.
        // So does one first delivered here that waited a third of `claim_idle_ms` or more
        // since its read (read ahead, for a slot, through an outage of this worker alone):
        // another worker may have taken it over before this one's keepalive could tell.
        let mut check_ours = !job.keyed && (d.deliveries > 1 || d.reclaimed);
        // (Again before a later call, if as long has passed since the last check.)
        let long_held = self.cfg.queue.claim_idle_ms / 3;
        let mut ours_since = started;
        // Since when the current model has been held back by a fleet-wide rate limit.
        let mut limited_since: Option<Instant> = None;
        // The job's place under its tenant's cap in the current model's pool, if capped.
        let mut place: Option<crate::tenants::TenantLease> = None;
        // The call on the wire, if any: its model and its quota ticket. Outside the loop,
        // so a stop that drops the loop mid-call still settles what the call may cost.
        // The job's loop, raced against its stop switch. Dropping it on a stop aborts the
        // call in flight (the provider sees the connection close) and drops its slot lease,
        // tenant place and quota reservation, which release themselves (the reservation
        // lapses at its ttl: the aborted call may still be billed). Biased: a call that
        // ended in the same poll as the stop keeps its answer.
        let run = async {
            let finished = loop {
                // A model or provider in a shared cooldown: a later model of the route that is
                // not cooling runs instead; when every one is, wait for this one (no call is
                // spent rediscovering what another worker found).
                let cooling = {
                    let c = plan.current();
                    self.cooldowns.remaining(&c.model, &c.provider)
                };
                if let Some(left) = cooling {
                    // About to end (a job back from its own Retry-After wait finds the
                    // cooldown its 429 set a few ms from its end): wait it out rather than
                    // move to another model.
                    if left <= COOLDOWN_NEARLY_OVER {
                        self.unless_draining(tokio::time::sleep(left)).await?;
                        continue;
                    }
                    let alt = plan.usable_alternatives().into_iter().find(|&i| {
                        let c = &plan.candidates()[i];
                        self.cooldowns.remaining(&c.model, &c.provider).is_none()
                    });
                    match alt {
                        Some(i) => {
                            plan.switch_to(i);
                            metrics::counter!("llm_worker_fallbacks_total").increment(1);
                        }
                        None => {
                            self.unless_draining(tokio::time::sleep(
                                left.min(Duration::from_secs(5)),
                            ))
                            .await?;
                        }
                    }
                    continue;
                }
                // The local rate limit first: a fleet slot is never held while waiting on it.
                // Draining: no provider call starts after the first signal (the job is handed
                // back). Checked before each wait and once more with the slot in hand.
                if let Some(cap) = job.max_cost_usd
                    && let Err(e) = within_cap(&mut plan, cap, lock(spent).counted(), &worst)
                {
                    break Finished::Failed(e.to_string());
                }
                // A place under the tenant's cap before a slot: with none free the job is
                // parked (it holds no slot and no permit while it waits; jobs behind it go on).
                let pool_now = &plan.current().pool;
                if place.as_ref().is_some_and(|l| l.pool() != pool_now) {
                    place = None; // gives the other pool's place back
                }
                if place.is_none()
                    && let Some(tenant) = job.tenant.as_deref()
                    && let Some(cap) = self.tenants.cap(pool_now)
                {
                    let pool_now = pool_now.clone();
                    match self
                        .tenant_place(d, &job, tenant, &pool_now, cap, spent)
                        .await?
                    {
                        Place::Held(l) => place = Some(l),
                        Place::Parked => {
                            lock(spent).parked = true;
                            return None;
                        }
                        Place::Gone => return None,
                        Place::Broken(why) => break Finished::Failed(why),
                    }
                }
                let throttled = plan.current().provider.clone();
                if let Some(c) = self.providers.get(&throttled) {
                    self.unless_draining(c.throttle()).await?;
                }
                let lease = self
                    .take_slot(
                        &mut plan,
                        job.tenant.as_deref(),
                        place.as_ref().map(|l| l.pool()),
                    )
                    .await?;
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
                if check_ours || (!job.keyed && ours_since.elapsed() >= long_held) {
                    check_ours = false;
                    ours_since = Instant::now();
                    if !self.still_ours(&d.entry_id).await {
                        release_unused(lease).await;
                        return None;
                    }
                }
                // The model's context window: trim, move on, or fail (see `context`).
                let trimmed = match self.fit_context(&job, &cand) {
                    context::Fit::AsIs => None,
                    context::Fit::Trimmed { messages, dropped } => Some((messages, dropped)),
                    context::Fit::Skip(why) => {
                        release_unused(lease).await;
                        if plan.skip_current() {
                            metrics::counter!("llm_worker_fallbacks_total").increment(1);
                            continue;
                        }
                        break Finished::Failed(why);
                    }
                    context::Fit::Fail(why) => {
                        release_unused(lease).await;
                        break Finished::Failed(why);
                    }
                };
                // A capped job records the call's worst case before it starts, so a worker
                // that takes the job over after this one dies counts it. Before the quotas:
                // the call goes out right after its rate room was counted, never a Redis
                // outage later, in another second.
                let call_worst = match job.max_cost_usd {
                    Some(_) => worst
                        .get(plan.current_index())
                        .and_then(|w| w.as_ref().ok())
                        .copied(),
                    None => None,
                };
                // Only a record that was written is corrected later.
                let cap_worst = match call_worst {
                    Some(w) => match self.record_cap_spent(&d.entry_id, w).await {
                        CapRecord::Written => {
                            lock(spent).cap_recorded = true;
                            Some(w)
                        }
                        CapRecord::Refused => None,
                        CapRecord::Draining => {
                            release_unused(lease).await;
                            return None;
                        }
                    },
                    None => None,
                };
                // The budgets and the fleet-wide rate limits, in one round trip, all or
                // nothing (a call held back by a rate limit reserves no budget).
                let quota = self.admit_quota(&job, &cand.model).await;
                if let Some(w) = cap_worst
                    && !matches!(quota, Quota::Yes(_))
                {
                    // No call this time: the record goes back.
                    self.correct_cap_spent(&d.entry_id, rust_decimal::Decimal::ZERO, w);
                }
                let ticket = match quota {
                    Quota::Yes(t) => t,
                    Quota::Stopped => {
                        release_unused(lease).await;
                        return None;
                    }
                    Quota::Again => {
                        // Not a rate limit's wait: no fallback clock runs for it.
                        release_unused(lease).await;
                        continue;
                    }
                    Quota::Skip(e) => {
                        // on_exhausted = "cheaper" (or a worst case not computable): another
                        // model of the route whose worst case fits may run.
                        release_unused(lease).await;
                        if plan.skip_current() {
                            continue;
                        }
                        break Finished::Failed(e);
                    }
                    Quota::Fail(e) => {
                        release_unused(lease).await;
                        break Finished::Failed(e);
                    }
                    Quota::Pause(e, park) => {
                        release_unused(lease).await;
                        let Some(at) = park else {
                            // Every job would wait for it: take no new ones meanwhile.
                            self.pause_for_budget(&e);
                            self.unless_draining(tokio::time::sleep(BUDGET_PAUSE_POLL))
                                .await?;
                            continue;
                        };
                        // A budget covering some models or one tenant: the job is parked
                        // (it holds no permit while it waits; the jobs behind it go on),
                        // unless it called a model in this delivery (moved back, it would
                        // start its route again: those calls again, and a delivery
                        // counted each time) or has a deadline (a parked job is not
                        // watched: it waits here, where its deadline still stops it).
                        let parkable = !lock(spent).called && job.deadline_ms.is_none();
                        let parked = if parkable {
                            self.park_for_budget(d, &job, &at, spent).await?
                        } else {
                            None
                        };
                        match parked {
                            Some(true) => {
                                lock(spent).budget_parked = true;
                                return None;
                            }
                            Some(false) => return None,
                            None => {
                                // Not parked (see above, or a key of the wrong type,
                                // logged): it waits here instead, holding its permit.
                                self.unless_draining(tokio::time::sleep(BUDGET_PAUSE_POLL))
                                    .await?;
                                continue;
                            }
                        }
                    }
                    Quota::Wait(wait) => {
                        // No slot is held while a fleet-wide rate limit has no room. Limited
                        // past `slots.acquire_timeout_ms`, a later model of the route runs
                        // instead (when there is one); else the job waits for room.
                        release_unused(lease).await;
                        let since = *limited_since.get_or_insert_with(Instant::now);
                        if since.elapsed() >= self.cfg.slots.acquire_timeout_ms
                            && !plan.usable_alternatives().is_empty()
                        {
                            plan.skip_current();
                            limited_since = None;
                            metrics::counter!("llm_worker_fallbacks_total").increment(1);
                            continue;
                        }
                        self.unless_draining(tokio::time::sleep(wait.min(Duration::from_secs(1))))
                            .await?;
                        continue;
                    }
                };
                limited_since = None;
                // Checked again just before the call: the round trips since the slot was
                // taken (the id check, the cap record, the quotas) may have taken long. No
                // call starts after the first signal, and none on a lease that may have
                // lapsed (another process may hold its key: N would be exceeded).
                let draining = self.draining.is_cancelled();
                let taken_over = lock(&self.taken_over).contains(&d.entry_id);
                if draining || taken_over || !lease.surely_live() {
                    if let Some(t) = ticket {
                        self.undo_draws(t.draw, t.budget);
                    }
                    if let Some(w) = cap_worst {
                        self.correct_cap_spent(&d.entry_id, rust_decimal::Decimal::ZERO, w);
                    }
                    if draining {
                        release_unused(lease).await;
                        return None;
                    }
                    if taken_over {
                        // Another worker owns the entry now: nothing to commit or hand back.
                        tracing::warn!(entry = %d.entry_id, job = %job.id, "job was taken over by another worker before its call; not calling here");
                        metrics::counter!("llm_worker_jobs_taken_over_before_call_total")
                            .increment(1);
                        release_unused(lease).await;
                        return None;
                    }
                    tracing::warn!(job = %job.id, model = %cand.model, pool = %lease.pool(), slot = lease.index(), "slot lease may have lapsed before the call (a late reply, or renewals not answered); taking a slot again");
                    metrics::counter!("llm_worker_slot_leases_stale_total", "pool" => lease.pool().to_string())
                        .increment(1);
                    release_unused(lease).await;
                    // Redis answers slowly (its round trips near half a TTL): not at once.
                    self.unless_draining(tokio::time::sleep(STALE_LEASE_PAUSE))
                        .await?;
                    continue;
                }
                let counted_before = lock(spent).counted();
                lock(spent).start_call(&cand.model);
                plan.record_attempt();
                let Some(client) = self.providers.get(&cand.provider) else {
                    break Finished::Failed(format!(
                        "provider: {} is not configured (fix the model's provider)",
                        cand.provider
                    ));
                };
                let upstream = self.cfg.upstream_name(&cand.model);
                lock(spent).trimmed_messages = trimmed.as_ref().map(|(_, n)| *n as u64);
                let body = ProviderClient::request_body(
                    &job.body,
                    trimmed.as_ref().map(|(m, _)| m.as_slice()),
                    upstream,
                );
                let call_started = Instant::now();
                let mut ticket = ticket;
                if let Some(t) = ticket.as_mut() {
                    if let Some(d) = t.draw.as_mut() {
                        d.mark_sent();
                    }
                    if let Some(d) = t.budget.as_mut() {
                        d.mark_sent();
                    }
                }
                *lock(on_wire) = Some((cand.model.clone(), ticket, call_worst));
                let mut outcome = client.call(&body, &job.id).await;
                let ticket = lock(on_wire).take().and_then(|(_, t, _)| t);
                if lease.is_lost() {
                    tracing::warn!(job = %job.id, model = %cand.model, "call finished after its slot lease was lost");
                }
                {
                    let mut s = lock(spent);
                    if let Some(price) = self.prices.get(&cand.model) {
                        // Priced once: the bill, the budgets and /metrics use the same figure.
                        let priced = s.bill.add(&cand.model, outcome.usage, price);
                        if let Some(t) = ticket {
                            // The call's real cost replaces its worst case in the budgets. A
                            // success without usage may have been billed anything up to the
                            // worst case: that is what stays counted.
                            // A call cut off after it was sent (timeout, reset) is counted the
                            // same way: the provider may bill it. Its tokens correct the
                            // estimate the rate limits admitted.
                            let real = match outcome.usage {
                                Some(_) => priced,
                                None if outcome.cost_unknown() => None,
                                None => Some(rust_decimal::Decimal::ZERO),
                            };
                            let used = outcome
                                .usage
                                .map(|u| u.prompt_tokens.saturating_add(u.completion_tokens));
                            self.settle_detached(t, real, used);
                        }
                        if outcome.cost_unknown()
                            && let Some(Ok(w)) = worst.get(plan.current_index())
                        {
                            // Its cap counts it at its worst case too.
                            s.unknown_worst = s.unknown_worst.saturating_add(*w);
                        }
                        if let (Some(u), Some(m)) =
                            (outcome.usage, self.model_metrics.get(&cand.model))
                        {
                            call_metrics(m, &u, priced);
                        }
                        // Moved, not cloned (a copy of the provider's usage object a
                        // call): nothing reads it from `outcome` after this.
                        if outcome.usage.is_some()
                            && let Some(raw) = outcome.raw_usage.take()
                        {
                            s.bill.raw_usage.push(raw);
                        }
                    }
                    // A 2xx answer without readable usage (a success, or a body the
                    // worker cannot read): the provider may have billed it.
                    let answered_2xx = match &outcome.result {
                        Ok(_) => true,
                        Err(e) => e.status.is_some_and(|s| (200..300).contains(&s)),
                    };
                    if outcome.usage.is_none() && answered_2xx {
                        s.bill.usage_missing(&cand.model);
                    }
                }
                if let Some(w) = cap_worst {
                    // The record now says what the call cost (its worst case stays when the
                    // cost is unknown); a correction lost leaves the worst case: too much,
                    // never too little.
                    let counted = lock(spent).counted().saturating_sub(counted_before);
                    self.correct_cap_spent(&d.entry_id, counted, w);
                }
                // Never awaited here: nothing (a slow Redis, `abort`) may stand between a paid
                // answer and its commit.
                self.release_detached(lease);
                let outcome_at = match &outcome.result {
                    Ok(_) => 0,
                    Err(e) => class_index(&e.class),
                };
                if let Some(m) = self.model_metrics.get(&cand.model) {
                    m.count_call(outcome_at);
                    m.call_seconds.record(call_started.elapsed().as_secs_f64());
                } else {
                    metrics::counter!("llm_worker_provider_calls_total", "model" => cand.model.clone(), "outcome" => CALL_OUTCOMES[outcome_at])
                        .increment(1);
                }
                if outcome.result.is_ok() {
                    self.cooldowns.record(&cand.model, false);
                }
                match outcome.result {
                    Ok(completion) => {
                        break Finished::Ok {
                            model: cand.model,
                            completion,
                        };
                    }
                    Err(CallError { class, message, .. }) => {
                        lock(spent).last_class = Some(class_label(&class));
                        self.share_cooldown(&cand, &class, &message).await;
                        let decision = plan.on_error(&class, rand::random::<f64>());
                        tracing::debug!(job = %job.id, model = %cand.model, error = %message, ?decision, "attempt failed");
                        match decision {
                            Decision::RetryAfter(after) => {
                                self.unless_draining(tokio::time::sleep(after)).await?
                            }
                            Decision::Switch(_) => {
                                tracing::info!(
                                    model = %cand.model,
                                    class = %class_label(&class),
                                    next = %plan.current().model,
                                    "model failed; falling back to the route's next model"
                                );
                                metrics::counter!("llm_worker_fallbacks_total").increment(1);
                            }
                            Decision::Fail => {
                                break Finished::Failed(format!(
                                    "provider: {}: {message}",
                                    cand.model
                                ));
                            }
                        }
                    }
                }
            };
            Some(finished)
        };
        // Pinned in place: `select!` would otherwise move the whole routing loop (its
        // state machine is kilobytes: every call, retry and fallback inline) into its own
        // tuple, a copy per job (callgrind: 4.8 % of the worker's instructions).
        tokio::pin!(run);
        let finished = tokio::select! {
            biased;
            f = &mut run => f?,
            why = self.stop_signal(&stop, job.deadline_ms) => Finished::Stopped(why),
        };
        self.cut_off(on_wire, spent);
        Some(self.finish(d, &job, finished, &lock(spent), started))
    }

    /// The call on the wire, if any, when its job's loop was dropped (a stop, or the
    /// shutdown abort): the provider may bill it, like a call cut off by its timeout. Its
    /// worst case stays counted in the budgets (settled, not left to lapse) and against
    /// the job's cap (a hand-back carries it); the bill counts the call, its cost unknown.
    pub(super) fn cut_off(&self, on_wire: &OnWire, spent: &Mutex<Spent>) {
        let Some((model, ticket, worst)) = lock(on_wire).take() else {
            return;
        };
        if let Some(t) = ticket {
            self.settle_detached(t, None, None);
        }
        let mut s = lock(spent);
        s.aborted_call = true;
        if let Some(w) = worst {
            s.unknown_worst = s.unknown_worst.saturating_add(w);
        }
        if let Some(price) = self.prices.get(&model) {
            s.bill.add(&model, None, price);
        }
        s.bill.warnings.push(format!(
            "{model}: the call was aborted after it was sent; its cost is unknown and counted as 0 here (budgets keep its worst case)"
        ));
    }

    /// A slot for the plan's current model; if its pool stays busy past
    /// `slots.acquire_timeout_ms`, a later model of the route with a free slot is used
    /// instead, else it waits again. It never fails for lack of a slot alone; `None` only
    /// when the slots are stopped (shutdown): the job is then left pending.
    /// A job of a `tenant` never moves by the fast path into a capped pool other than
    /// `placed` (the pool of the place it holds): it holds no place there, and the job
    /// loop asks for one first.
    pub(super) async fn take_slot(
        &self,
        plan: &mut Plan,
        tenant: Option<&str>,
        placed: Option<&str>,
    ) -> Option<Lease> {
        let timeout = self.cfg.slots.acquire_timeout_ms;
        let mut backoff = Backoff::redis();
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
                        let no_place = tenant.is_some()
                            && self.tenants.cap(&alt_pool).is_some()
                            && placed != Some(alt_pool.as_str());
                        if alt_pool == pool || no_place {
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
                    if backoff.failures() == 0 {
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

    /// A place for the job under its tenant's cap in `pool` ([`Queue::admit_tenant`]),
    /// retried while Redis does not answer; `None` when draining began first.
    async fn tenant_place(
        &self,
        d: &Delivery,
        job: &job::Job,
        tenant: &str,
        pool: &str,
        cap: u32,
        spent: &Mutex<Spent>,
    ) -> Option<Place> {
        let mut backoff = Backoff::redis();
        // One member for every try: a retry after a lost reply finds it admitted.
        let member = self.tenants.new_member();
        let (gap_ms, transit_ms) = self.tenants.gap_and_transit_ms();
        loop {
            let (deliveries, billed) = moved_as(d, spent);
            let at = crate::queue::TenantPlace {
                pool,
                tenant,
                member: &member,
                cap,
                ttl_ms: self.tenants.ttl_ms(),
                gap_ms,
                transit_ms,
            };
            let job_id = job.keyed.then_some(job.id.as_str());
            match self
                .queue
                .admit_tenant(&d.entry_id, job_id, deliveries, billed.as_deref(), &at)
                .await
            {
                Ok(TenantAdmit::Admitted) => {
                    // A place kept for this entry (moved back from the parked stream) was
                    // taken by this admission, if it was for this pool and tenant.
                    if d.unparked.as_deref() == Some(format!("{pool}:{tenant}").as_str()) {
                        lock(spent).kept_taken = true;
                    }
                    return Some(Place::Held(self.tenants.admitted(pool, tenant, member)));
                }
                Ok(TenantAdmit::Parked(new)) => {
                    tracing::debug!(entry = %d.entry_id, parked = %new, pool, "tenant at its cap; job parked until a place frees");
                    metrics::counter!("llm_worker_tenant_parked_total", "pool" => pool.to_string())
                        .increment(1);
                    return Some(Place::Parked);
                }
                Ok(TenantAdmit::NotOurs) => {
                    tracing::info!(entry = %d.entry_id, "job no longer ours (committed or taken over); left alone");
                    return Some(Place::Gone);
                }
                Ok(TenantAdmit::Deleted) => {
                    tracing::warn!(entry = %d.entry_id, "job was deleted from the stream while pending; acknowledged");
                    return Some(Place::Gone);
                }
                Err(e) if !e.heals() => {
                    tracing::error!(entry = %d.entry_id, error = %e, "tenant place check impossible; job failed without a model call (fix the key named)");
                    return Some(Place::Broken(format!(
                        "tenant place check impossible, no model called: {e}"
                    )));
                }
                Err(e) => {
                    if backoff.failures() == 0 {
                        tracing::warn!(entry = %d.entry_id, error = %e, "tenant place check failed; retrying until Redis answers");
                    }
                    backoff.sleep(&self.draining).await;
                    if self.draining.is_cancelled() {
                        return None;
                    }
                }
            }
        }
    }

    /// Whether a redelivered entry is still pending under this worker ([`Queue::still_ours`]),
    /// retried while Redis does not answer. `false` (log at info, nothing committed): it
    /// was committed or taken over meanwhile, or draining began.
    pub(super) async fn still_ours(&self, entry_id: &str) -> bool {
        let what = "check that a redelivered job is still ours";
        match self
            .until_answered(entry_id, what, || self.queue.still_ours(entry_id))
            .await
        {
            Some(Ok(true)) => true,
            Some(Ok(false)) => {
                tracing::info!(entry = %entry_id, "redelivered job is no longer pending under this worker (committed or taken over meanwhile); not calling a model for it");
                metrics::counter!("llm_worker_redeliveries_dropped_total").increment(1);
                false
            }
            Some(Err(e)) => {
                // Cannot tell; the commit still keeps it to one result.
                tracing::warn!(entry = %entry_id, error = %e, "cannot check that a redelivered job is still ours; running it");
                true
            }
            None => false,
        }
    }

    /// `op` until Redis answers: `Some(Ok)` with its answer, `Some(Err)` with an error
    /// that repeats until someone acts (not retried), `None` once draining began. One
    /// warning (`cannot {what}`) when the first try fails.
    async fn until_answered<T, F, Fut>(
        &self,
        entry_id: &str,
        what: &str,
        mut op: F,
    ) -> Option<Result<T, crate::queue::QueueError>>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, crate::queue::QueueError>>,
    {
        let mut backoff = Backoff::redis();
        loop {
            match op().await {
                Ok(v) => return Some(Ok(v)),
                Err(e) if !e.heals() => return Some(Err(e)),
                Err(e) => {
                    if backoff.failures() == 0 {
                        tracing::warn!(entry = %entry_id, error = %e, "cannot {what}; retrying until Redis answers");
                    }
                    backoff.sleep(&self.draining).await;
                    if self.draining.is_cancelled() {
                        return None;
                    }
                }
            }
        }
    }

    /// What earlier deliveries of `entry_id` recorded against its cost cap. Retries while
    /// Redis does not answer (`None`: draining began); a record that cannot be read (a
    /// key of another type) is logged and counted as nothing.
    async fn cap_spent_before(&self, entry_id: &str) -> Option<rust_decimal::Decimal> {
        let what = "read what earlier deliveries of this job spent against its max_cost_usd";
        match self
            .until_answered(entry_id, what, || self.queue.cap_spent_get(entry_id))
            .await?
        {
            Ok(picos) => Some(crate::cost::from_picos(picos)),
            Err(e) => {
                tracing::warn!(entry = %entry_id, error = %e, "cannot {what}; counting nothing");
                Some(rust_decimal::Decimal::ZERO)
            }
        }
    }

    /// Adds a call's worst case to its entry's cap record before the call. Retries while
    /// Redis does not answer (a full Redis included): no capped call starts unrecorded,
    /// unless the record cannot be written until someone acts (a key of another type).
    async fn record_cap_spent(&self, entry_id: &str, worst: rust_decimal::Decimal) -> CapRecord {
        let picos = picos_up(worst);
        let what = "record the call against the job's max_cost_usd";
        match self
            .until_answered(entry_id, what, || self.queue.cap_spent_add(entry_id, picos))
            .await
        {
            Some(Ok(())) => CapRecord::Written,
            Some(Err(e)) => {
                tracing::warn!(entry = %entry_id, error = %e, "cannot {what}; a worker taking the job over will not count it");
                CapRecord::Refused
            }
            None => CapRecord::Draining,
        }
    }

    /// Corrects a call's cap record from its worst case to `counted` (what the cap counts
    /// for it), in a task of its own, bounded: a correction lost leaves the worst case.
    fn correct_cap_spent(
        &self,
        entry_id: &str,
        counted: rust_decimal::Decimal,
        worst: rust_decimal::Decimal,
    ) {
        let delta = picos_up(counted).saturating_sub(picos_up(worst));
        if delta == 0 {
            return;
        }
        let queue = self.queue.clone();
        let entry = entry_id.to_string();
        self.releases.spawn(async move {
            let fix = queue.cap_spent_add(&entry, delta);
            if !matches!(tokio::time::timeout(RELEASE_BOUND, fix).await, Ok(Ok(()))) {
                tracing::debug!(entry = %entry, "cap record not corrected; it keeps the call's worst case");
            }
        });
    }

    /// Drops the cap record of an entry that has its result, in a task of its own (its
    /// ttl removes it otherwise).
    pub(super) fn drop_cap_spent(&self, entry_id: &str) {
        let queue = self.queue.clone();
        let entry = entry_id.to_string();
        self.releases.spawn(async move {
            let _ = tokio::time::timeout(RELEASE_BOUND, queue.cap_spent_drop(&entry)).await;
        });
    }

    /// `fut`'s output, or `None` as soon as draining begins (the wait is dropped).
    /// A check before the call that Redis refuses in a way retrying cannot heal (a
    /// marker key of the wrong type, an ACL): the job fails without a model call, its
    /// reason naming the check and Redis's error.
    fn check_impossible(
        &self,
        d: &Delivery,
        job: &job::Job,
        (check, hint): (&str, &str),
        e: &QueueError,
        started: Instant,
        spent: &Spent,
    ) -> Commit {
        tracing::error!(entry = %d.entry_id, job = %job.id, error = %e, "{check} check impossible; job failed without a model call ({hint})");
        let reason = format!("{check} check impossible, no model called: {e}");
        let id = Some(job.id.as_str());
        self.reject(
            d,
            id,
            job.keyed,
            ResultStatus::Failed,
            &reason,
            started,
            spent,
        )
    }

    pub(super) async fn unless_draining<T>(
        &self,
        fut: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        if self.draining.is_cancelled() {
            return None;
        }
        tokio::select! {
            v = fut => Some(v),
            _ = self.draining.cancelled() => None,
        }
    }
}

pub(super) enum Finished {
    Ok {
        model: String,
        completion: provider::Completion,
    },
    Failed(String),
    /// Cancelled or expired: ended without an answer, its call (if one ran) aborted.
    Stopped(Stop),
}

/// Why a job was stopped before it ended by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stop {
    /// Its id got a cancel marker (`llm-worker cancel`).
    Cancelled,
    /// Its `deadline_ms` passed.
    Expired,
}

impl Worker {
    /// Resolves when the job must stop: its cancel token fired (the cancel watcher saw its
    /// id's marker) or its deadline (Unix ms, the worker's wall clock) passed.
    async fn stop_signal(&self, token: &CancellationToken, deadline_ms: Option<u64>) -> Stop {
        let deadline = async {
            match deadline_ms {
                Some(at) => {
                    let left = at.saturating_sub(crate::cost::unix_now_ms());
                    tokio::time::sleep(Duration::from_millis(left)).await
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = token.cancelled() => Stop::Cancelled,
            _ = deadline => Stop::Expired,
        }
    }
}

impl Worker {
    /// Releases the slot of a finished call in a task of its own, bounded by
    /// [`RELEASE_BOUND`] (past it the slot's TTL frees it). The reader's `run` waits for
    /// these tasks (bounded) before the daemon's `release_all`.
    pub(super) fn release_detached(&self, lease: Lease) {
        self.releases.spawn(async move {
            #[cfg(debug_assertions)]
            debug_hooks::slow_release().await;
            match tokio::time::timeout(RELEASE_BOUND, lease.release()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "slot release failed; its TTL frees it"),
                Err(_) => tracing::warn!("slot release timed out; its TTL frees it"),
            }
        });
    }
}

/// `usd` in pico-dollars, rounded up (a cap record may count too much, never too little).
fn picos_up(usd: rust_decimal::Decimal) -> i64 {
    let up = usd.round_dp_with_strategy(12, rust_decimal::RoundingStrategy::AwayFromZero);
    crate::cost::to_picos(up).unwrap_or(i64::MAX)
}

/// Excludes every candidate whose worst case no longer fits `cap` after `spent`, and
/// makes sure the current one fits; the `budget:` error when none is left.
fn within_cap(
    plan: &mut Plan,
    cap: rust_decimal::Decimal,
    spent: rust_decimal::Decimal,
    worst: &[Result<rust_decimal::Decimal, crate::cost::CostError>],
) -> Result<(), quota::QuotaError> {
    for (i, w) in worst.iter().enumerate() {
        if !quota::fits(cap, spent, w) {
            plan.exclude(i);
        }
    }
    if plan.ensure_usable() {
        return Ok(());
    }
    let left: Vec<_> = worst
        .iter()
        .enumerate()
        .skip(plan.current_index())
        .map(|(_, w)| w.clone())
        .collect();
    Err(quota::over_cap(cap, spent, &left))
}

/// A cancel marker read with the entry still counts before its call if the job waited
/// less than this for its job permit (read ahead), as does one read with a later read
/// while it waited (`Worker::awaiting`) and sent less than this before; else it is read again,
/// so a cancel set meanwhile stops the job before any call (the cancel watcher covers
/// the jobs already past their parse, every `CANCEL_POLL`). A marker found with the
/// entry always counts.
const CANCEL_CHECK_FRESH: Duration = Duration::from_millis(100);

/// How long a budget settle is retried while Redis does not answer.
const SETTLE_GIVE_UP: Duration = Duration::from_secs(600);

/// Most jobs parked by one budget moved back by one sweep of one worker.
const UNPARK_MAX: u64 = 100;

/// A shared cooldown this close to its end is waited out, not routed around.
const COOLDOWN_NEARLY_OVER: Duration = Duration::from_millis(250);

/// How long a job waits before taking a slot again after its lease was found possibly
/// lapsed just before its call (see [`crate::slots::Lease::surely_live`]).
const STALE_LEASE_PAUSE: Duration = Duration::from_millis(250);

/// How often a job paused by a budget (`on_exhausted = "pause"`) checks it again.
const BUDGET_PAUSE_POLL: Duration = Duration::from_secs(2);

impl Worker {
    /// How `job`'s messages go to `cand` under its context window.
    fn fit_context(&self, job: &job::Job, cand: &Candidate) -> context::Fit {
        let Some(messages) = job
            .body
            .get("messages")
            .and_then(serde_json::Value::as_array)
        else {
            return context::Fit::AsIs;
        };
        // The rest of the prompt a provider counts: tool schemas, the response format.
        let extra: String = ["tools", "functions", "response_format"]
            .iter()
            .filter_map(|k| job.body.get(*k))
            .map(|v| v.to_string())
            .collect();
        context::fit(
            self.cfg.upstream_name(&cand.model),
            cand.context_window,
            self.cfg.context.headroom,
            quota::requested_output(&job.body).unwrap_or(0),
            messages,
            &extra,
            job.context_policy.unwrap_or(self.cfg.context.policy),
        )
    }

    /// Shares what a failed call taught about its model or provider: a Retry-After puts
    /// the model in a cooldown that long, a provider-wide rejection the provider for
    /// [`crate::cooldown::PROVIDER_REJECTED`], and a model failing most of its recent
    /// calls cools down for [`crate::cooldown::FAILING`].
    async fn share_cooldown(&self, cand: &Candidate, class: &ErrorClass, message: &str) {
        let cd = &self.cooldowns;
        match class {
            ErrorClass::RateLimited {
                retry_after: Some(after),
            } if !after.is_zero() => {
                cd.set(
                    'm',
                    &cand.model,
                    *after,
                    &format!("429 with Retry-After: {message}"),
                )
                .await;
            }
            ErrorClass::ProviderRejected => {
                cd.set(
                    'p',
                    &cand.provider,
                    crate::cooldown::PROVIDER_REJECTED,
                    message,
                )
                .await;
            }
            _ => {}
        }
        let failed = matches!(
            class,
            ErrorClass::Transient | ErrorClass::RateLimited { .. }
        );
        if failed && cd.record(&cand.model, true) {
            cd.set(
                'm',
                &cand.model,
                crate::cooldown::FAILING,
                &format!("most of its calls in the last minute failed; last: {message}"),
            )
            .await;
        }
    }
}

/// What the budgets and the fleet-wide rate limits say about one call.
enum Quota {
    /// Go on (with what to settle after the call, if any quota covers it).
    Yes(Option<Ticket>),
    /// Try another model of the route (`cheaper`), or fail with this if none is left.
    Skip(String),
    /// The job fails with this (`fail`).
    Fail(String),
    /// `pause`: `None` = the budget covers every job (wait and try again; the reader takes
    /// no new jobs meanwhile); else the job is parked there until the budget has room.
    Pause(String, Option<crate::budget::ParkAt>),
    /// A rate limit has no room: try again after this long (or another model).
    Wait(Duration),
    /// Draining: the job is left for hand-back.
    Stopped,
    /// Its rate room went stale while the budget answered (Redis slow): everything went
    /// back; take it again at once.
    Again,
}

/// The call of a job on the wire: its model, its quota ticket, and its worst case when
/// the job has a cost cap.
pub(super) type OnWire = Mutex<Option<(String, Option<Ticket>, Option<rust_decimal::Decimal>)>>;

/// What [`Worker::record_cap_spent`] did.
enum CapRecord {
    /// Written: correct it after the call.
    Written,
    /// Refused until someone acts: the call goes ahead unrecorded (nothing to correct).
    Refused,
    /// Draining began before Redis answered: no call.
    Draining,
}

/// A call asking for its model's next rate block: if it ends without opening one (the
/// script refused it, draining, a panic), the calls waiting for it are told, and one of
/// them asks instead.
struct FetchGuard<'a> {
    blocks: &'a crate::ratelimit::Blocks,
    model: &'a str,
    opened: bool,
}

impl FetchGuard<'_> {
    /// The block is opened by the caller ([`crate::ratelimit::Blocks::open`] ends the fetch).
    fn opened(mut self) {
        self.opened = true;
    }
}

impl Drop for FetchGuard<'_> {
    fn drop(&mut self) {
        if !self.opened {
            self.blocks.fetch_failed(self.model);
        }
    }
}

/// A call's share of a budget block and of a rate block, to settle after it.
pub(super) struct Ticket {
    budget: Option<crate::budget::blocks::Draw>,
    draw: Option<crate::ratelimit::Draw>,
}

impl Worker {
    /// Reserves the worst case of one call of `model` for `job` in every budget window
    /// covering it and admits it in every fleet-wide rate limit covering it, in one
    /// script (`gate`; no round trip when nothing covers it). Retries while Redis does not
    /// answer: a call never runs unreserved or unadmitted when a quota covers it.
    async fn admit_quota(&self, job: &job::Job, model: &str) -> Quota {
        #[cfg(debug_assertions)]
        debug_hooks::slow_admit().await;
        let Some(mc) = self.cfg.models.get(model) else {
            return Quota::Skip(format!("budget: unknown model {model}"));
        };
        let limited = mc.rpm.is_some()
            || mc.tpm.is_some()
            || self
                .cfg
                .providers
                .get(&mc.provider)
                .is_some_and(|p| p.rpm.is_some() || p.tpm.is_some());
        if self.budgets.is_empty() && !limited {
            // Nothing to reserve: no id drawn (a getrandom call per job otherwise).
            return Quota::Yes(None);
        }
        // One id for every try: a try whose reply was lost is not reserved twice.
        let id = uuid::Uuid::new_v4().simple().to_string();
        let budget = if self.budgets.is_empty() {
            None
        } else {
            let worst = match quota::worst_case(&job.body, mc) {
                Ok(w) => w,
                Err(e) => return Quota::Skip(format!("budget: {model}: {e}")),
            };
            match self.budgets.ask(&id, model, job.tenant.as_deref(), worst) {
                Ok(a) => a,
                Err(e) => return on_exhausted(e),
            }
        };
        let tokens = if limited {
            crate::ratelimit::token_estimate(&job.body, mc)
        } else {
            0
        };
        let rate = if limited {
            self.rates.ask(&id, model, tokens)
        } else {
            None
        };
        // The budget room drawn from this process's block for the call's windows when it
        // has some; else this call reserves the next block (the others wait for it).
        let mut bdraw = None;
        let mut bfetch = None;
        if let Some(b) = &budget {
            let cover = b.cover();
            loop {
                let changed = self.budget_blocks.changed();
                let (t, closed) = self.budget_blocks.take(&cover, b.amount());
                self.settle_budget_blocks(closed);
                match t {
                    crate::budget::blocks::Take::Drawn(d) => bdraw = Some(d),
                    crate::budget::blocks::Take::Fetch(f) => bfetch = Some(f),
                    crate::budget::blocks::Take::Wait => {
                        if !self.await_block(changed).await {
                            return Quota::Stopped;
                        }
                        continue;
                    }
                }
                break;
            }
        }
        // The rate limits' room drawn from this process's block for the model when it has
        // some: then the script only reserves the budget, or does not run at all.
        let mut draw = None;
        // Set when this call asks for the model's next block: others wait for it.
        let mut fetching = None;
        if rate.is_some() {
            loop {
                let changed = self.rate_blocks.changed();
                let (t, closed) = self.rate_blocks.take(model, tokens);
                self.settle_blocks(closed);
                match t {
                    crate::ratelimit::Take::Drawn(d) => draw = Some(d),
                    crate::ratelimit::Take::Fetch => {
                        fetching = Some(FetchGuard {
                            blocks: &self.rate_blocks,
                            model,
                            opened: false,
                        })
                    }
                    crate::ratelimit::Take::Wait => {
                        if !self.await_block(changed).await {
                            return Quota::Stopped;
                        }
                        continue;
                    }
                }
                break;
            }
        }
        let rate = rate.filter(|_| draw.is_none());
        let budget = budget.filter(|_| bdraw.is_none());
        if bdraw.as_ref().is_some_and(|d| !d.usable()) {
            // Held past its block's life (waiting for a rate block): taken again.
            return self.stale_draws(draw, bdraw);
        }
        if budget.is_none() && rate.is_none() {
            if bdraw.is_none() && draw.is_none() {
                return Quota::Yes(None);
            }
            return Quota::Yes(Some(Ticket {
                budget: bdraw,
                draw,
            }));
        }
        // A budget block: room for as many calls as the last block served, twice over,
        // within its windows' bound.
        let mut kb = budget
            .as_ref()
            .map_or(1, |b| self.budget_blocks.size(&b.cover(), b.max_block()));
        let mut budget = budget;
        // Else a block: room for as many calls as the last block served, twice over.
        let mut k = rate
            .as_ref()
            .map_or(1, |r| self.rate_blocks.size(model, r.max_block()));
        let mut backoff = Backoff::redis();
        loop {
            let ask = rate.as_ref().map(|r| r.block(k));
            budget = budget.map(|b| b.block(kb));
            let sent = Instant::now();
            match self
                .gate
                .admit(budget.as_ref(), self.budgets.ttl_ms(), ask.as_ref())
                .await
            {
                Ok(Answer::Admitted { ms, .. }) => {
                    // The budget block reserved: opened, this call drawn on it. A retry's
                    // answer (`ms` unknown: the reservation may be old) serves its own
                    // call only.
                    if let (Some(b), Some(f)) = (budget.take(), bfetch.take()) {
                        let k = if ms.is_some() { b.k() } else { 1 };
                        let (total, worst) = (b.total(), b.amount());
                        let (d, closed) =
                            self.budget_blocks.open(f, b.reservation(), k, total, worst);
                        self.settle_budget_blocks(closed);
                        bdraw = Some(d);
                    }
                    if bdraw.as_ref().is_some_and(|d| !d.usable()) {
                        // Drawn from a block whose life ended while the rate limits'
                        // script was retried: its reservation may lapse during the call.
                        return self.stale_draws(draw, bdraw);
                    }
                    let draw = match (draw, ask) {
                        (Some(d), _) if !d.usable() => {
                            // The budget script took past the second the room was counted
                            // in (Redis away): this room is stale. Everything goes back
                            // (the budget block stays open for the next calls) and the
                            // call is admitted afresh.
                            self.settle_blocks(self.rate_blocks.undo(d));
                            if let Some(d) = bdraw {
                                self.settle_budget_blocks(self.budget_blocks.undo(d));
                            }
                            return Quota::Again;
                        }
                        (Some(d), _) => Some(d),
                        (None, Some(a)) => {
                            // Drawn on until shortly before the server's second ends.
                            let until = ms.and_then(|ms| {
                                let left = Duration::from_millis(1000u64.saturating_sub(ms as u64));
                                left.checked_sub(crate::ratelimit::BLOCK_MARGIN)
                                    .map(|l| sent + l)
                            });
                            if let Some(f) = fetching.take() {
                                f.opened();
                            }
                            let (d, closed) =
                                self.rate_blocks
                                    .open(model, k, tokens, a.admission(), until);
                            self.settle_blocks(closed);
                            Some(d)
                        }
                        (None, None) => None,
                    };
                    return Quota::Yes(Some(Ticket {
                        budget: bdraw,
                        draw,
                    }));
                }
                Ok(Answer::Budget { i, left }) => {
                    if kb > 1 {
                        // No room for a block: room for this call alone may remain.
                        kb = 1;
                        continue;
                    }
                    if let Some(b) = &budget {
                        // This process's own blocks may hold the room (unused, until their
                        // calls end): wait for it rather than decide on it, if with it the
                        // call would fit.
                        let (unused, closed) = self.budget_blocks.release_unused(&b.cover());
                        self.settle_budget_blocks(closed);
                        if unused > 0 && left.saturating_add(unused) >= b.amount() {
                            // Not a rate limit's wait: no fallback clock runs for it.
                            if let Some(d) = draw {
                                self.settle_blocks(self.rate_blocks.undo(d));
                            }
                            tokio::select! {
                                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                                _ = self.draining.cancelled() => return Quota::Stopped,
                            }
                            return Quota::Again;
                        }
                    }
                    // The room drawn for this call goes back to its block.
                    if let Some(d) = draw {
                        self.settle_blocks(self.rate_blocks.undo(d));
                    }
                    let Some(b) = &budget else {
                        return Quota::Wait(Duration::from_secs(1));
                    };
                    return on_exhausted(self.budgets.exhausted(b, i, left));
                }
                Ok(Answer::Rate { wait, i }) => {
                    if k > 1 {
                        // No room for a block: room for this call alone may remain.
                        k = 1;
                        continue;
                    }
                    metrics::counter!("llm_worker_rate_limited_total", "model" => model.to_string())
                        .increment(1);
                    if let Some(r) = &rate {
                        tracing::debug!(job = %job.id, reason = %r.limited(i, wait), "held back by a rate limit");
                    }
                    return Quota::Wait(wait);
                }
                Err(e) => {
                    if backoff.failures() == 0 {
                        tracing::warn!(error = %e, job = %job.id, "cannot check the call's budget and rate limits; retrying until Redis answers");
                    }
                    backoff.sleep(&self.draining).await;
                    if self.draining.is_cancelled() {
                        if let Some(d) = draw {
                            self.settle_blocks(self.rate_blocks.undo(d));
                        }
                        if let Some(d) = bdraw {
                            self.settle_budget_blocks(self.budget_blocks.undo(d));
                        }
                        return Quota::Stopped;
                    }
                }
            }
        }
    }

    /// Waits while another call fetches a block (rate or budget) until `changed` fires,
    /// at most a second (a fetch stuck on Redis is retried by its own call); `false` when
    /// draining began.
    async fn await_block(&self, changed: tokio::sync::futures::Notified<'_>) -> bool {
        tokio::select! {
            _ = changed => true,
            _ = tokio::time::sleep(Duration::from_secs(1)) => true,
            _ = self.draining.cancelled() => false,
        }
    }

    /// Draws that went stale before their call was sent: both go back, and the call is
    /// admitted afresh ([`Quota::Again`]).
    fn stale_draws(
        &self,
        draw: Option<crate::ratelimit::Draw>,
        bdraw: Option<crate::budget::blocks::Draw>,
    ) -> Quota {
        self.undo_draws(draw, bdraw);
        Quota::Again
    }

    /// Gives back the draws of a call that was never sent, as if never admitted (a settle
    /// would count the request in its rate window).
    fn undo_draws(
        &self,
        draw: Option<crate::ratelimit::Draw>,
        bdraw: Option<crate::budget::blocks::Draw>,
    ) {
        if let Some(d) = draw {
            self.settle_blocks(self.rate_blocks.undo(d));
        }
        if let Some(d) = bdraw {
            self.settle_budget_blocks(self.budget_blocks.undo(d));
        }
    }

    /// Settles a call's ticket in a task of its own (tracked like slot releases, so a
    /// stopping worker waits for it, bounded): `real` = the call's cost, `None` = unknown
    /// (the worst case stays counted); `used` = its real tokens, if it reported usage.
    fn settle_detached(&self, t: Ticket, real: Option<rust_decimal::Decimal>, used: Option<u64>) {
        if let Some(d) = t.draw {
            self.settle_blocks(self.rate_blocks.settle(d, used));
        }
        if let Some(d) = t.budget {
            // A cost not representable in pico-dollars counts at the worst case.
            let picos = real.map(|c| crate::cost::to_picos(c).unwrap_or(d.worst()));
            self.settle_budget_blocks(self.budget_blocks.settle(d, picos));
        }
    }

    /// Sends the settles of closed budget blocks (see [`crate::budget::blocks`]).
    fn settle_budget_blocks(
        &self,
        closed: impl IntoIterator<Item = crate::budget::blocks::BlockSettle>,
    ) {
        for b in closed {
            self.spawn_settle(Some(b.reservation), b.cost_picos, None, None, None);
        }
    }

    /// Sends the tokens corrections of closed rate blocks (see [`crate::ratelimit::Blocks`]).
    fn settle_blocks(&self, closed: impl IntoIterator<Item = crate::ratelimit::BlockSettle>) {
        for b in closed {
            self.spawn_settle(None, 0, Some(b.admission), Some(b.used), Some(b.calls));
        }
    }

    /// Closes every rate block whose second has ended (`all`: every one, at shutdown) and
    /// sends their corrections.
    pub(super) fn sweep_rate_blocks(&self, all: bool) {
        self.settle_blocks(self.rate_blocks.sweep(all));
        self.settle_budget_blocks(self.budget_blocks.sweep(all));
    }

    /// One settle script (`gate::Gate::settle`) in a task of its own (tracked like slot
    /// releases, so a stopping worker waits for it, bounded): a reservation settled to
    /// `picos`, and/or an admission's tokens corrected to `used`.
    fn spawn_settle(
        &self,
        reservation: Option<crate::budget::Reservation>,
        picos: i64,
        admission: Option<crate::ratelimit::Admission>,
        used: Option<u64>,
        calls: Option<u64>,
    ) {
        let gate = self.gate.clone();
        self.releases.spawn(async move {
            // Until Redis answers (a paid call must reach the budget), bounded so a
            // worker never keeps a task forever: after SETTLE_GIVE_UP the cost is lost to
            // the budget and logged.
            let started = Instant::now();
            let mut first = true;
            let mut wait = Duration::from_millis(100);
            loop {
                let settle = gate.settle(
                    reservation.as_ref(),
                    picos,
                    first,
                    admission.as_ref(),
                    used,
                    calls,
                );
                match tokio::time::timeout(RELEASE_BOUND, settle).await {
                    Ok(Ok(settled)) => {
                        if reservation.as_ref().is_some_and(|r| settled < r.keys.len()) {
                            tracing::warn!(
                                "a budget reservation had expired before its call was settled \
                                 (the worker stalled past the reservation's ttl); that call's cost \
                                 is not counted in the budget"
                            );
                        }
                        return;
                    }
                    Ok(Err(e)) => {
                        // A reply error means the script may have run.
                        first &= matches!(e, crate::gate::GateError::Pool(_));
                        if started.elapsed() > SETTLE_GIVE_UP {
                            tracing::error!(error = %e, "budget settle failed for 10 minutes; this call's cost is not in the budget");
                            return;
                        }
                    }
                    Err(_) => {
                        first = false; // it may have run
                        if started.elapsed() > SETTLE_GIVE_UP {
                            tracing::error!("budget settle timed out for 10 minutes; this call's cost is not in the budget");
                            return;
                        }
                    }
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
        });
    }

    /// Parks `d`'s job, paused by the budget of `at` ([`Queue::park_budget`]), retried
    /// while Redis does not answer. `Some(Some(true))`: parked; `Some(Some(false))`: not
    /// ours any more (committed, taken over or deleted: nothing to do); `Some(None)`:
    /// cannot be parked (a key of the wrong type: the job waits where it is); `None`:
    /// draining began first (the job is handed back).
    async fn park_for_budget(
        &self,
        d: &Delivery,
        job: &job::Job,
        at: &crate::budget::ParkAt,
        spent: &Mutex<Spent>,
    ) -> Option<Option<bool>> {
        let mut backoff = Backoff::redis();
        loop {
            let (deliveries, billed) = moved_as(d, spent);
            let job_id = job.keyed.then_some(job.id.as_str());
            match self
                .queue
                .park_budget(&d.entry_id, job_id, deliveries, billed.as_deref(), at)
                .await
            {
                Ok(crate::queue::Park::Parked(new)) => {
                    tracing::debug!(entry = %d.entry_id, parked = %new, budget = %at.budget, "budget exhausted; job parked until it has room");
                    self.announce_budget_park(&at.budget);
                    metrics::counter!("llm_worker_budget_parked_total", "budget" => at.budget.clone())
                        .increment(1);
                    return Some(Some(true));
                }
                Ok(crate::queue::Park::NotOurs) => {
                    tracing::info!(entry = %d.entry_id, "job no longer ours (committed or taken over); left alone");
                    return Some(Some(false));
                }
                Ok(crate::queue::Park::Deleted) => {
                    tracing::warn!(entry = %d.entry_id, "job was deleted from the stream while pending; acknowledged");
                    return Some(Some(false));
                }
                Err(e) if !e.heals() => {
                    tracing::error!(entry = %d.entry_id, error = %e, "cannot park the job paused by its budget; it waits in this worker, holding a permit (fix the key named)");
                    return Some(None);
                }
                Err(e) => {
                    if backoff.failures() == 0 {
                        tracing::warn!(entry = %d.entry_id, error = %e, "cannot park the job paused by its budget; retrying until Redis answers");
                    }
                    backoff.sleep(&self.draining).await;
                    if self.draining.is_cancelled() {
                        return None;
                    }
                }
            }
        }
    }

    /// One log line per budget (at most a minute apart) while it parks jobs.
    fn announce_budget_park(&self, budget: &str) {
        let mut seen = lock(&self.park_announced);
        let now = Instant::now();
        if seen
            .get(budget)
            .is_none_or(|t| now.duration_since(*t) >= Duration::from_secs(60))
        {
            seen.insert(budget.to_string(), now);
            tracing::info!(budget = %budget, "budget exhausted: the jobs it pauses are parked until it has room (status lists them)");
        }
    }

    /// Moves back the jobs parked by budgets, as many as each budget has room for
    /// (`lua/budget_unpark.lua`), once a second from every worker. Errors wait for the
    /// next sweep.
    pub(super) async fn unpark_budgets(&self) {
        let parked = match self.queue.budget_parked().await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "budget parked streams not read; next sweep");
                return;
            }
        };
        for (stream, at) in parked {
            // A budget gone or changed, or an index entry that cannot be read: no
            // windows, so its jobs go back and their next reader decides again.
            let windows = at
                .as_ref()
                .map(|at| self.budgets.windows_of(at))
                .unwrap_or_default();
            let budget = at.map_or_else(|| "?".to_string(), |at| at.budget);
            match self
                .queue
                .unpark_budget(&stream, &windows, UNPARK_MAX)
                .await
            {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(budget = %budget, moved = n, "budget has room: parked jobs moved back");
                    metrics::counter!("llm_worker_budget_unparked_total", "budget" => budget)
                        .increment(n);
                }
                Err(e) => {
                    tracing::warn!(stream = %stream, error = %e, "parked jobs not moved back; next sweep")
                }
            }
        }
    }

    /// A job found its budget exhausted with `on_exhausted = "pause"`: the reader takes
    /// no new jobs for the next poll period (one log line when the pause begins).
    fn pause_for_budget(&self, why: &str) {
        let mut until = lock(&self.paused_until);
        let now = Instant::now();
        if until.is_none_or(|u| u <= now) {
            tracing::warn!(reason = %why, "pausing: taking no new jobs until the budget has room");
        }
        // Two polls: a paused job re-checks every poll, so the pause lapses only when no
        // job found the budget exhausted for a whole poll.
        *until = Some(now + BUDGET_PAUSE_POLL * 2);
        metrics::gauge!("llm_worker_budget_paused").set(1.0);
    }

    /// How long the reader should still hold off new jobs for a paused budget.
    pub(super) fn budget_pause_left(&self) -> Option<Duration> {
        let mut until = lock(&self.paused_until);
        match *until {
            Some(u) if u > Instant::now() => Some(u - Instant::now()),
            Some(_) => {
                *until = None;
                metrics::gauge!("llm_worker_budget_paused").set(0.0);
                tracing::info!("budget pause over: taking jobs again");
                None
            }
            None => None,
        }
    }
}

/// How long a detached slot release may take.
pub(super) const RELEASE_BOUND: Duration = Duration::from_secs(5);

/// What an entry moved like a hand-back (parked) carries: the deliveries that count (a
/// delivery that never called a model is not one) and what it spent.
fn moved_as(d: &Delivery, spent: &Mutex<Spent>) -> (u64, Option<Vec<u8>>) {
    let s = lock(spent);
    let deliveries = if s.called {
        d.deliveries
    } else {
        d.deliveries.saturating_sub(1)
    };
    (deliveries, s.carry())
}

/// What a budget's `on_exhausted` makes of `e` (a budget that has no room for the call).
fn on_exhausted(e: crate::budget::BudgetError) -> Quota {
    match e {
        crate::budget::BudgetError::Exhausted {
            on,
            covers_all,
            ref park,
            ..
        } => match on {
            crate::config::OnExhausted::Fail => Quota::Fail(e.to_string()),
            crate::config::OnExhausted::Cheaper => Quota::Skip(e.to_string()),
            crate::config::OnExhausted::Pause => {
                let park = (!covers_all).then(|| park.clone());
                Quota::Pause(e.to_string(), park)
            }
        },
        e => Quota::Skip(e.to_string()),
    }
}

/// What [`Worker::tenant_place`] found.
enum Place {
    Held(crate::tenants::TenantLease),
    /// Moved to the tenant's parked stream (acknowledged here).
    Parked,
    /// Not ours any more, or deleted while pending: nothing to do.
    Gone,
    /// A key of the wrong type: fail the job without a call.
    Broken(String),
}

pub(super) async fn release_unused(lease: Lease) {
    if let Err(e) = lease.release().await {
        tracing::warn!(error = %e, "slot release failed; its TTL frees it");
    }
}

/// Undoes a job task's bookkeeping on every exit, including a panic or the task being
/// dropped: the entry leaves `active` (keepalive stops touching it, so a job whose task
/// died is reclaimed after `queue.claim_idle_ms`), its permit is freed, `in_flight` drops.
/// A settled entry joins `finished`, so a reclaim racing its commit does not start it again.
pub(super) struct JobGuard {
    pub(super) worker: Arc<Worker>,
    pub(super) entry_id: String,
    /// `handle` returned (false on drop: the task panicked or was dropped mid-job).
    pub(super) ended: bool,
    /// `handle` said the entry is settled (committed, here or elsewhere).
    pub(super) settled: bool,
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        let w = &self.worker;
        if self.settled {
            // Before leaving `active`: the reader never sees the entry in neither.
            lock(&w.finished).insert(&self.entry_id);
        }
        lock(&w.active).remove(&self.entry_id);
        lock(&w.taken_over).remove(&self.entry_id);
        lock(&w.claimed).remove(&self.entry_id);
        lock(&w.stops).remove(&self.entry_id);
        drop(lock(&w.permits).remove(&self.entry_id));
        drop(lock(&w.read_permits).remove(&self.entry_id));
        w.state.in_flight.fetch_sub(1, Ordering::SeqCst);
        w.job_metrics.in_flight().decrement(1.0);
        if !self.ended {
            tracing::error!(entry = %self.entry_id, "job task ended abnormally (panic); its job stays pending and is reclaimed after queue.claim_idle_ms");
            metrics::counter!("llm_worker_job_panics_total").increment(1);
        }
    }
}

/// Aborts a helper task when the scope that spawned it ends.
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Per-model cost (pico-dollars, exact; `priced` as the bill priced it) and tokens of one
/// billed call, for /metrics.
fn call_metrics(m: &ModelMetrics, u: &crate::cost::Usage, priced: Option<rust_decimal::Decimal>) {
    if let Some(p) = priced.and_then(crate::cost::to_picos) {
        m.cost_picodollars.increment(p.max(0) as u64);
    }
    // Each input token under one kind: the sum over kinds is prompt + completion.
    let uncached = u
        .prompt_tokens
        .saturating_sub(u.cached_tokens)
        .saturating_sub(u.cache_write_tokens);
    m.tokens_input.increment(uncached);
    m.tokens_output.increment(u.completion_tokens);
    m.tokens_cached.increment(u.cached_tokens);
    m.tokens_cache_write.increment(u.cache_write_tokens);
}

/// The `outcome` label values of `llm_worker_provider_calls_total`: "ok", then one per
/// error class ([`class_index`]).
pub(super) const CALL_OUTCOMES: [&str; 7] = [
    "ok",
    "transient",
    "rate_limited",
    "rejected",
    "access_denied",
    "context_too_long",
    "fatal",
];

/// The error class's place in [`CALL_OUTCOMES`].
pub(super) fn class_index(c: &ErrorClass) -> usize {
    match c {
        ErrorClass::Transient => 1,
        ErrorClass::RateLimited { .. } => 2,
        ErrorClass::ProviderRejected => 3,
        ErrorClass::AccessDenied => 4,
        ErrorClass::ContextTooLong => 5,
        ErrorClass::Fatal => 6,
    }
}

pub(super) fn class_label(c: &ErrorClass) -> &'static str {
    CALL_OUTCOMES[class_index(c)]
}

/// Fault injection for the integration tests, compiled into debug builds only (release
/// binaries carry none of it). `LLM_WORKER_DEBUG_PANIC_ONCE_JOB=<job id>`: the first task
/// of this process that reaches the idempotency check for that id panics, as a bug in
/// the job path would. `LLM_WORKER_DEBUG_SLOW_RELEASE_MS=<ms>`: the release of a slot
/// after a provider call waits that long first, as with a Redis that stalls just then.
#[cfg(debug_assertions)]
pub(super) mod debug_hooks {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    pub(super) async fn slow_release() {
        let Some(ms) = std::env::var("LLM_WORKER_DEBUG_SLOW_RELEASE_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        else {
            return;
        };
        tracing::warn!(ms, "debug hook: slowing a slot release");
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// `LLM_WORKER_DEBUG_SLOW_ADMIT_MS=<ms>`: the quota admission before each call waits
    /// that long first, as with a Redis that answers slowly just then.
    pub(super) async fn slow_admit() {
        let Some(ms) = std::env::var("LLM_WORKER_DEBUG_SLOW_ADMIT_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        else {
            return;
        };
        tracing::warn!(ms, "debug hook: slowing a quota admission");
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

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
