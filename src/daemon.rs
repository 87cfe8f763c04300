//! Wiring of the `run` subcommand: Redis, slots, worker, HTTP server and shutdown, in
//! the order that makes a clean stop possible. Shared by `main` and the in-process demo.
//!
//! Shutdown order (vector-style): stop the source (reader) first; jobs not yet calling a
//! provider stop and are handed back at once; calls running drain within the grace
//! period, the rest are cancelled and handed back; then every slot is released and this
//! worker's consumer removed from the group (if it owns no pending entry), then return.

use crate::backoff::Backoff;
use crate::config::Config;
use crate::connect::commands;
use crate::queue::{Queue, QueueError};
use crate::server;
use crate::shutdown::Shutdown;
use crate::slots::{SlotError, Slots};
use crate::state::WorkerState;
use crate::worker::{Worker, WorkerError};
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Connect(#[from] crate::connect::ConnectError),
    #[error(
        "redis.require_noeviction: Redis's maxmemory-policy is {0}, which evicts slot keys, pending jobs and idempotency markers when Redis is full; set `maxmemory-policy noeviction` on the server (or redis.require_noeviction = false to only warn)"
    )]
    Eviction(String),
    /// Redis refused the credentials or a command to this user: no retry can help.
    #[error(
        "Redis refused access ({0}): check redis.username and the password (redis.password_env, redis.password_file or the url), and that the ACL user may run EVALSHA, XREADGROUP and the other commands README lists"
    )]
    Access(String),
    /// The Redis user may not read and write key families a job's path touches.
    #[error(
        "redis.username: the Redis user {user} may not read and write the keys {keys} (its ACL); grant it read and write on every key of the namespace (queue.namespace), or jobs meeting those keys would fail"
    )]
    KeyAccess { user: String, keys: String },
    #[error("cannot listen on {addr} (fix server.listen)")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
}

/// Runs the worker until `shutdown` has stopped it, then releases every slot.
/// `listener`: an already-bound socket for /health, /ready, /metrics (None = no server).
/// `state`: where readiness is published (shared with the caller, e.g. for tests).
pub async fn run(
    cfg: Config,
    shutdown: Shutdown,
    listener: Option<tokio::net::TcpListener>,
    prom: Option<PrometheusHandle>,
    state_out: Option<tokio::sync::oneshot::Sender<Arc<WorkerState>>>,
) -> Result<(), DaemonError> {
    let cfg = Arc::new(cfg);
    let pool = commands(&cfg)?;
    let queue = Queue::new(&cfg, pool.clone());
    let background = CancellationToken::new();

    // Readiness is reported from the start, so /ready says 503 while Redis is away.
    let state_holder = Arc::new(WorkerState::default());
    let server_task = listener.map(|l| {
        let (st, prom, bg) = (state_holder.clone(), prom.clone(), background.clone());
        tokio::spawn(async move {
            if let Err(e) = server::serve(l, st, prom, bg).await {
                tracing::error!(error = %e, "HTTP server failed");
            }
        })
    });

    // Slots need Redis (to record N); wait for it, but give up on a signal.
    let mut backoff = Backoff::redis();
    let mut logged = false;
    let slots = loop {
        match Slots::connect(&cfg, pool.clone()).await {
            Ok(s) => break Some(s),
            Err(e) => {
                if crate::connect::refused_access(&e.to_string()) {
                    background.cancel();
                    return Err(DaemonError::Access(e.to_string()));
                }
                if !logged && e.to_string().contains("OOM") {
                    tracing::error!(error = %e, "Redis is out of memory (maxmemory reached, noeviction): nothing can be written until memory is freed or maxmemory raised; retrying until it accepts writes");
                    crate::notify::status("waiting for Redis: out of memory");
                    logged = true;
                } else if !logged {
                    tracing::error!(error = %e, url = %crate::config::redact_url(&cfg.redis.url), "cannot reach Redis at start; retrying until it answers");
                    crate::notify::status("waiting for Redis");
                    logged = true;
                }
                if shutdown.stop.is_cancelled() {
                    break None;
                }
                backoff.sleep(&shutdown.stop).await;
            }
        }
    };
    let Some(slots) = slots else {
        background.cancel();
        return Ok(());
    };
    if logged {
        tracing::info!("Redis answers; starting");
    }
    if let Err(e) = check_eviction(&cfg, &pool).await {
        background.cancel();
        return Err(e);
    }
    if let Err(e) = check_key_access(&cfg, &queue).await {
        background.cancel();
        return Err(e);
    }
    record_key_check(&cfg, &pool).await;
    let slots_task = slots.spawn_background(background.clone());
    let budgets = crate::budget::Budgets::new(cfg.clone());
    let rates = crate::ratelimit::RateLimits::new(cfg.clone());
    let cooldowns = crate::cooldown::Cooldowns::new(&cfg, pool.clone());
    // Known before the first job: a worker started during a cooldown routes around it.
    let _ = tokio::time::timeout(Duration::from_secs(1), cooldowns.refresh()).await;
    let cooldown_task = cooldowns.spawn_refresh(background.clone());
    metrics::gauge!("llm_worker_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    // Shown from the start (at 0), not only after the first event.
    metrics::counter!("llm_worker_redis_reconnects_total").increment(0);
    metrics::counter!("llm_worker_redis_errors_total").increment(0);
    metrics::counter!("llm_worker_fallbacks_total").increment(0);
    metrics::gauge!("llm_worker_jobs_in_flight").set(0.0);
    // Queue length, group lag and pending, dead letters: sampled every 5 s (3 commands).
    let sampler = {
        let queue = queue.clone();
        let stop = background.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    _ = stop.cancelled() => return,
                }
                if let Err(e) = queue.sample_gauges().await {
                    tracing::debug!(error = %e, "queue gauges not sampled; next try in 5 s");
                }
            }
        })
    };
    let tenants = crate::tenants::Tenants::new(&cfg, pool.clone(), slots.token());
    let tenant_task = tenants.spawn_background(background.clone());
    let mut worker = Worker::new(
        cfg.clone(),
        queue,
        slots.clone(),
        crate::worker::Quotas {
            budgets,
            rates,
            gate: crate::gate::Gate::new(pool.clone()),
            cooldowns,
            tenants: tenants.clone(),
        },
    )?;
    worker.state = state_holder.clone();
    let worker = Arc::new(worker);
    if let Some(tx) = state_out {
        let _ = tx.send(worker.state.clone());
    }
    tracing::info!(
        consumer = %cfg.queue.consumer,
        concurrency = cfg.worker.concurrency(),
        read_ahead = cfg.worker.read_ahead(),
        pools = ?cfg.pools.keys().map(|p| (p.clone(), slots.pool_size(p).unwrap_or(0))).collect::<Vec<_>>(),
        "worker started"
    );
    // systemd: READY=1 once jobs are taken, STATUS= lines, the watchdog; STOPPING=1 at
    // the first signal (all no-ops when not under systemd).
    let notifier = crate::notify::spawn(
        worker.state.clone(),
        shutdown.stop.clone(),
        background.clone(),
        cfg.queue.block_ms + Duration::from_secs(2),
    );
    let stopping = {
        let stop = shutdown.stop.clone();
        let state = worker.state.clone();
        // The drain, the slot release and the exit: the grace plus 10 s.
        let drain = cfg.worker.shutdown_grace_ms + Duration::from_secs(10);
        tokio::spawn(async move {
            stop.cancelled().await;
            let n = state.in_flight.load(std::sync::atomic::Ordering::SeqCst);
            crate::notify::stopping(&format!("draining: {n} in flight"), drain);
        })
    };
    // Start-up is over: its code and heap are handed back before the first read.
    match crate::resident::shed_start_up_pages() {
        Ok(s) => tracing::debug!(
            mappings = s.mappings,
            resident_kb = s.resident_kb,
            refused = s.refused,
            "start-up's file pages dropped"
        ),
        Err(e) => tracing::debug!(error = %e, "start-up's pages left resident"),
    }
    worker
        .clone()
        .run(shutdown.stop.clone(), shutdown.abort.clone())
        .await;
    crate::notify::status("drained; releasing slots");

    // Both bounded, run together so an unreachable Redis costs 1.5 s once, not twice.
    let release = async {
        match tokio::time::timeout(Duration::from_millis(1500), slots.release_all()).await {
            Ok(Ok(n)) => tracing::info!(released = n, "released every slot"),
            Ok(Err(e)) => log_release_failure(&e),
            Err(_) => tracing::error!("releasing slots timed out; their TTL frees them"),
        }
    };
    let give_back = async {
        if !tenants.any() {
            return;
        }
        match tokio::time::timeout(
            Duration::from_millis(1500),
            tenants.release_all(Duration::from_millis(500)),
        )
        .await
        {
            Ok(Ok(n)) => tracing::info!(released = n, "released every tenant place"),
            Ok(Err(e)) => {
                tracing::error!(error = %e, "releasing tenant places failed; they expire after slots.ttl_ms")
            }
            Err(_) => {
                tracing::error!("releasing tenant places timed out; they expire after slots.ttl_ms")
            }
        }
    };
    tokio::join!(release, give_back, worker.remove_own_consumer());
    background.cancel();
    let _ = tokio::time::timeout(Duration::from_millis(300), slots_task).await;
    let _ = tokio::time::timeout(Duration::from_millis(300), cooldown_task).await;
    let _ = tokio::time::timeout(Duration::from_millis(300), tenant_task).await;
    let _ = tokio::time::timeout(Duration::from_millis(300), sampler).await;
    let _ = tokio::time::timeout(Duration::from_millis(300), notifier).await;
    stopping.abort();
    if let Some(t) = server_task {
        let _ = tokio::time::timeout(Duration::from_millis(300), t).await;
    }
    tracing::info!("stopped cleanly");
    Ok(())
}

/// What Redis's `maxmemory-policy` means for the fleet, read at start. Anything but
/// `noeviction` lets Redis evict slot keys (a quota breached), pending entries (a job
/// lost) and idempotency markers (a job paid twice) when it is full: a loud warning, or
/// with `redis.require_noeviction` a refusal (an error naming the setting: exit 2).
/// Where `CONFIG GET` is not allowed (managed services), the warning says it could not
/// be checked.
pub async fn check_eviction(
    cfg: &Config,
    pool: &crate::connect::Commands,
) -> Result<(), DaemonError> {
    let read = async {
        let mut c = pool.get().await.map_err(|e| e.to_string())?;
        redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async::<Vec<String>>(&mut c)
            .await
            .map_err(|e| e.to_string())
    };
    let policy = match tokio::time::timeout(Duration::from_secs(2), read).await {
        Ok(Ok(v)) => v.get(1).cloned(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not read Redis's maxmemory-policy (CONFIG GET not allowed?): make sure it is noeviction, or a full Redis may evict slot keys, pending jobs and idempotency markers");
            return Ok(());
        }
        Err(_) => return Ok(()),
    };
    match policy.as_deref() {
        Some("noeviction") | None => Ok(()),
        Some(p) if cfg.redis.require_noeviction => Err(DaemonError::Eviction(p.to_string())),
        Some(p) => {
            tracing::warn!(
                policy = p,
                "Redis maxmemory-policy is not noeviction: when Redis is full it may evict slot keys (the fleet then exceeds its quota), pending jobs (lost) and idempotency markers (a job paid twice); set `maxmemory-policy noeviction` (or redis.require_noeviction = true to refuse to start)"
            );
            Ok(())
        }
    }
}

/// Refuses to start when the Redis user may not touch keys a job's path touches
/// ([`Queue::refused_key_families`], with the slots' keys of every pool, as a release
/// declares them, and the cooldowns): every job meeting them would fail (or wait)
/// instead, so the worker stops with exit 2 naming the keys, leaving every job where it
/// is. Bounded (2 s); a Redis that does not answer in time is left to the paths that
/// retry, with a warning.
async fn check_key_access(cfg: &Config, queue: &Queue) -> Result<(), DaemonError> {
    let sk = crate::slots::SlotKeys::new(&cfg.queue.namespace);
    let same = |key: String| (key.clone(), key);
    let mut more = vec![];
    for pool in cfg.pools.keys() {
        let slot0 = sk.slot(pool, 0);
        let slots = format!("{}*", slot0.strip_suffix('0').unwrap_or(&slot0));
        more.push((
            format!("slot_release.lua of pool {pool}"),
            vec![
                same(sk.slot_queue(pool)),
                same(sk.lease(pool)),
                same(sk.waiter_alive(pool)),
                same(sk.wake(pool)),
                (slot0, slots),
            ],
        ));
    }
    more.push((
        "the cooldowns".to_string(),
        vec![same(crate::cooldown::hash_key(&cfg.queue.namespace))],
    ));
    let probe = queue.refused_key_families(&more);
    match tokio::time::timeout(Duration::from_secs(2), probe).await {
        Ok(Ok(refused)) if refused.is_empty() => Ok(()),
        Ok(Ok(refused)) => Err(DaemonError::KeyAccess {
            user: if cfg.redis.username.is_empty() {
                "default (or the url's)".into()
            } else {
                cfg.redis.username.clone()
            },
            keys: refused.join("; "),
        }),
        Ok(Err(e)) if crate::connect::refused_access(&e.to_string()) => {
            Err(DaemonError::Access(e.to_string()))
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the Redis user's key access was not checked at start; going on");
            Ok(())
        }
        Err(_) => {
            tracing::warn!(
                "the Redis user's key access was not checked at start (no answer in 2 s); going on"
            );
            Ok(())
        }
    }
}

/// Records what this worker's key check found (`cfg.key_check`) in `{ns}:keycheck`
/// (provider -> JSON: found, worker, at_ms), so `status` shows what the fleet found.
/// Best effort and bounded: a Redis that does not answer only leaves `status` without it.
async fn record_key_check(cfg: &Config, pool: &crate::connect::Commands) {
    if cfg.key_check.is_empty() {
        return;
    }
    let at_ms = crate::cost::unix_now_ms();
    let mut cmd = redis::cmd("HSET");
    cmd.arg(crate::queue::Keys::new(&cfg.queue.namespace).key_check());
    for (provider, found) in &cfg.key_check {
        let v = serde_json::json!({"found": found, "worker": cfg.queue.consumer, "at_ms": at_ms});
        cmd.arg(provider).arg(v.to_string());
    }
    let write = async {
        let mut c = pool.get().await.map_err(|e| e.to_string())?;
        cmd.query_async::<i64>(&mut c)
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(Duration::from_secs(1), write).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "key check not recorded for status"),
        Err(_) => tracing::debug!("key check not recorded for status (timeout)"),
    }
}

fn log_release_failure(e: &SlotError) {
    tracing::error!(error = %e, "releasing slots failed; their TTL frees them");
}
