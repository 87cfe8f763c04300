//! One job's lifecycle, and the reader loop that feeds jobs to at most
//! `worker.concurrency` job tasks.
//!
//! Invariants:
//! - never more jobs read than there are free job permits (back-pressure: a job is read
//!   only when a task can start on it at once);
//! - a job is acknowledged only through [`Queue::commit`], together with its result;
//! - a job cancelled by shutdown is left pending (no commit), for another worker;
//! - every provider call holds a slot of its model's pool for its whole duration.

use crate::config::Config;
use crate::cost::{self, Price, Usage};
use crate::job::{self, Job};
use crate::provider::{self, CallError, ProviderClient};
use crate::queue::{Commit, Delivery, Queue, QueueError, blocking_connection};
use crate::router::{Candidate, Decision, ErrorClass, Plan, RetryPolicy};
use crate::slots::{Lease, SlotError, Slots};
use rust_decimal::Decimal;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Shared liveness/readiness facts, read by `/ready` and the drain log.
#[derive(Debug, Default)]
pub struct WorkerState {
    /// The reader is taking jobs (false before start and once draining).
    pub taking_jobs: AtomicBool,
    /// The last Redis operation of the reader succeeded.
    pub redis_ok: AtomicBool,
    /// Job tasks running now.
    pub in_flight: AtomicUsize,
}

impl WorkerState {
    pub fn ready(&self) -> bool {
        self.taking_jobs.load(Ordering::SeqCst) && self.redis_ok.load(Ordering::SeqCst)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("provider setup: {0}")]
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
}

/// Costs and tokens of one job, per model, for the result and the exact Redis totals.
#[derive(Debug, Default)]
struct Bill {
    usage: Usage,
    cost: Decimal,
    per_model: BTreeMap<String, (Usage, Decimal, u64)>,
}

impl Bill {
    fn add(&mut self, model: &str, usage: Option<Usage>, price: &Price) {
        let entry = self.per_model.entry(model.to_string()).or_default();
        entry.2 += 1;
        if let Some(u) = usage {
            let c = cost::cost(&u, price);
            self.usage.add(&u);
            self.cost += c;
            entry.0.add(&u);
            entry.1 += c;
        }
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
            max_attempts_per_model: cfg.retry.max_attempts_per_model,
            base_delay: Duration::from_millis(cfg.retry.base_delay_ms),
            max_delay: Duration::from_millis(cfg.retry.max_delay_ms),
            max_retry_after: Duration::from_millis(cfg.retry.max_retry_after_ms),
        };
        Ok(Worker {
            cfg,
            queue,
            slots,
            providers,
            prices,
            policy,
            state: Arc::new(WorkerState::default()),
        })
    }

    /// Reads jobs until `stop` fires, then waits for the job tasks to end. Tasks finish
    /// their jobs unless `abort` fires (the shutdown module fires it after the grace
    /// period), in which case they stop and leave their jobs pending.
    pub async fn run(self: Arc<Self>, stop: CancellationToken, abort: CancellationToken) {
        let sem = Arc::new(Semaphore::new(self.cfg.worker.concurrency));
        let tracker = TaskTracker::new();
        let block = Duration::from_millis(self.cfg.queue.block_ms);
        let mut conn = None;
        let mut backoff = Backoff::new();
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
                        let me = self.clone();
                        let abort = abort.clone();
                        self.state.in_flight.fetch_add(1, Ordering::SeqCst);
                        tracker.spawn(async move {
                            me.handle(d, abort).await;
                            me.state.in_flight.fetch_sub(1, Ordering::SeqCst);
                            drop(permit);
                        });
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
        tracker.close();
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

    /// Runs one job to its commit, or leaves it pending if `abort` fires first.
    pub async fn handle(&self, d: Delivery, abort: CancellationToken) {
        let started = Instant::now();
        let commit = tokio::select! {
            c = self.process(&d, started) => c,
            _ = abort.cancelled() => {
                tracing::info!(entry = %d.entry_id, "job cancelled by shutdown; left pending for another worker");
                metrics::counter!("llm_worker_jobs_abandoned_total").increment(1);
                return;
            }
        };
        let Some(commit) = commit else { return };
        let mut backoff = Backoff::new();
        loop {
            match self.queue.commit(&commit).await {
                Ok(Some(_)) => return,
                Ok(None) => {
                    tracing::warn!(entry = %d.entry_id, "job was already committed by another worker; result discarded");
                    metrics::counter!("llm_worker_commit_superseded_total").increment(1);
                    return;
                }
                Err(e) => {
                    tracing::warn!(entry = %d.entry_id, error = %e, "commit failed; retrying");
                    if abort.is_cancelled() {
                        tracing::error!(entry = %d.entry_id, "shutting down with a result not written; the job stays pending and will be redone");
                        metrics::counter!("llm_worker_results_lost_total").increment(1);
                        return;
                    }
                    backoff.sleep(&abort).await;
                }
            }
        }
    }

    fn base_result(
        &self,
        d: &Delivery,
        job_id: &str,
        status: &str,
        started: Instant,
    ) -> Vec<(&'static str, Vec<u8>)> {
        vec![
            ("job_id", job_id.as_bytes().to_vec()),
            ("job_entry", d.entry_id.as_bytes().to_vec()),
            ("status", status.as_bytes().to_vec()),
            (
                "latency_ms",
                started.elapsed().as_millis().to_string().into_bytes(),
            ),
            ("worker", self.queue.consumer().as_bytes().to_vec()),
        ]
    }

    /// The commit for a job that cannot be processed: `invalid` result + dead letter.
    fn reject(
        &self,
        d: &Delivery,
        job_id: Option<&str>,
        status: &str,
        reason: &str,
        started: Instant,
    ) -> Commit {
        let id = job_id.unwrap_or(&d.entry_id);
        let mut result = self.base_result(d, id, status, started);
        result.extend([
            ("input_tokens", b"0".to_vec()),
            ("output_tokens", b"0".to_vec()),
            ("cost_usd", b"0".to_vec()),
            ("attempts", b"0".to_vec()),
            ("tried", vec![]),
            ("error", reason.as_bytes().to_vec()),
        ]);
        let mut dead = vec![("job_entry", d.entry_id.as_bytes().to_vec())];
        if let Some(j) = job_id {
            dead.push(("job_id", j.as_bytes().to_vec()));
        }
        dead.extend([
            ("reason", reason.as_bytes().to_vec()),
            ("deliveries", d.deliveries.to_string().into_bytes()),
            ("payload", d.payload.clone().unwrap_or_default()),
        ]);
        metrics::counter!("llm_worker_jobs_total", "status" => status.to_string()).increment(1);
        Commit {
            entry_id: d.entry_id.clone(),
            result,
            dead,
            dedupe_id: None,
            costs: vec![],
        }
    }

    /// Everything between reading a job and its commit. `None`: leave the job pending.
    async fn process(&self, d: &Delivery, started: Instant) -> Option<Commit> {
        let job = match job::parse(
            d.payload.as_deref(),
            &d.entry_id,
            self.cfg.queue.max_payload_bytes,
            &self.cfg,
        ) {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(entry = %d.entry_id, reason = %e, "invalid job; dead-lettered");
                return Some(self.reject(d, None, "invalid", &e.to_string(), started));
            }
        };
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
            return Some(self.reject(d, Some(&job.id), "invalid", "no model to run on", started));
        }
        let mut plan = Plan::new(candidates, self.policy);
        let mut bill = Bill::default();
        let mut attempts = 0u64;
        let mut tried: Vec<String> = vec![];
        let finished = loop {
            let lease = self.take_slot(&mut plan).await?;
            let cand = plan.current().clone();
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
                        Decision::RetryAfter(after) => tokio::time::sleep(after).await,
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
            Finished::Ok { .. } => "ok",
            Finished::Failed(_) => "failed",
        };
        let mut result = self.base_result(d, &job.id, status, started);
        match finished {
            Finished::Ok { model, completion } => result.extend([
                ("model", model.into_bytes()),
                ("content", completion.content.into_bytes()),
                ("finish_reason", completion.finish_reason.into_bytes()),
            ]),
            Finished::Failed(e) => result.push(("error", provider::one_line(&e).into_bytes())),
        }
        result.extend([
            (
                "input_tokens",
                bill.usage.prompt_tokens.to_string().into_bytes(),
            ),
            (
                "output_tokens",
                bill.usage.completion_tokens.to_string().into_bytes(),
            ),
            (
                "cached_tokens",
                bill.usage.cached_tokens.to_string().into_bytes(),
            ),
            ("cost_usd", cost::format_usd(bill.cost).into_bytes()),
            ("attempts", attempts.to_string().into_bytes()),
            ("tried", tried.join(",").into_bytes()),
        ]);
        if let Some(m) = &job.metadata {
            result.push(("metadata", m.to_string().into_bytes()));
        }
        metrics::counter!("llm_worker_jobs_total", "status" => status).increment(1);
        metrics::histogram!("llm_worker_job_seconds").record(started.elapsed().as_secs_f64());
        Commit {
            entry_id: d.entry_id.clone(),
            result,
            dead: vec![],
            dedupe_id: Some(job.id.clone()),
            costs: bill.cost_fields(),
        }
    }

    /// A slot for the plan's current model; if its pool stays busy past
    /// `slots.acquire_timeout_ms`, a later model of the route with a free slot is used
    /// instead, else it waits again. It never fails for lack of a slot alone; `None` only
    /// when the slots are stopped (shutdown): the job is then left pending.
    async fn take_slot(&self, plan: &mut Plan) -> Option<Lease> {
        let timeout = Duration::from_millis(self.cfg.slots.acquire_timeout_ms);
        let mut backoff = Backoff::new();
        loop {
            let pool = plan.current().pool.clone();
            match self.slots.acquire(&pool, timeout).await {
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
                    tracing::warn!(error = %e, pool = %pool, "cannot take a slot; retrying");
                    backoff.sleep(&CancellationToken::new()).await;
                }
            }
        }
    }
}

fn class_label(c: &ErrorClass) -> &'static str {
    match c {
        ErrorClass::Transient => "transient",
        ErrorClass::RateLimited { .. } => "rate_limited",
        ErrorClass::ProviderRejected => "rejected",
        ErrorClass::ContextTooLong => "context_too_long",
        ErrorClass::Fatal => "fatal",
    }
}

/// Jittered exponential backoff for Redis reconnects: 100 ms doubling to 5 s.
pub struct Backoff {
    next: Duration,
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
        let d = self.next.mul_f64(0.5 + rand::random::<f64>() / 2.0);
        self.next = (self.next * 2).min(Duration::from_secs(5));
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = cancel.cancelled() => {}
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new()
    }
}
