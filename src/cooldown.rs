//! Shared cooldowns: a model or a whole provider that the fleet should route around for a
//! while, recorded in Redis (`{ns}:cooldown:<m|p>:<name>`, value = reason, PX = length)
//! so one worker's discovery (a 429 with a long Retry-After, a provider-wide rejection,
//! a model failing most calls) spares every other worker the same failed calls.
//!
//! Invariants: a cooldown is only ever lengthened, never shortened (`lua/cooldown.lua`);
//! reading costs no round trip per job: each worker refreshes a local copy every
//! [`REFRESH`] (one SCAN), and a worker that sets a cooldown sees it at once.

use crate::config::Config;
use crate::connect::Commands;
use crate::sync::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often every worker re-reads the fleet's cooldowns.
pub const REFRESH: Duration = Duration::from_secs(1);
/// Cooldown of a provider that rejected the key or the account (`insufficient_quota`).
pub const PROVIDER_REJECTED: Duration = Duration::from_secs(60);
/// Cooldown of a model that failed most of its recent calls.
pub const FAILING: Duration = Duration::from_secs(30);
/// A model "fails most calls" when at least this many of its last calls in this process
/// were made within a minute and more than half of them failed.
pub const FAILING_MIN_CALLS: usize = 10;

/// The fleet's cooldowns as this process knows them. Cheap to clone.
#[derive(Clone)]
pub struct Cooldowns {
    inner: Arc<Inner>,
}

struct Inner {
    ns: String,
    conn: Commands,
    /// Key (`m:<model>` / `p:<provider>`) -> when it ends.
    known: Mutex<HashMap<String, Instant>>,
    /// Per model, this process's recent calls: (when, failed).
    recent: Mutex<HashMap<String, Vec<(Instant, bool)>>>,
}

fn key_of(kind: char, name: &str) -> String {
    format!("{kind}:{name}")
}

impl Cooldowns {
    pub fn new(cfg: &Config, conn: Commands) -> Cooldowns {
        Cooldowns {
            inner: Arc::new(Inner {
                ns: cfg.queue.namespace.clone(),
                conn,
                known: Mutex::new(HashMap::new()),
                recent: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// How much longer `model` (or its `provider`) cools down; `None` = usable now.
    pub fn remaining(&self, model: &str, provider: &str) -> Option<Duration> {
        let now = Instant::now();
        let known = lock(&self.inner.known);
        [key_of('m', model), key_of('p', provider)]
            .iter()
            .filter_map(|k| known.get(k))
            .filter(|end| **end > now)
            .map(|end| *end - now)
            .max()
    }

    /// Puts `name` (`kind` 'm' = model, 'p' = provider) in a cooldown of `len` for the
    /// whole fleet (a longer one already set is kept). Best effort: if Redis does not
    /// answer, this process still routes around it.
    pub async fn set(&self, kind: char, name: &str, len: Duration, why: &str) {
        let k = key_of(kind, name);
        {
            let mut known = lock(&self.inner.known);
            let end = Instant::now() + len;
            let e = known.entry(k.clone()).or_insert(end);
            if *e < end {
                *e = end;
            }
        }
        tracing::warn!(what = %k, seconds = len.as_secs_f64(), reason = %why, "cooldown: the fleet routes around it until it ends");
        metrics::counter!("llm_worker_cooldowns_total").increment(1);
        let mut inv = crate::scripts::COOLDOWN.prepare_invoke();
        inv.key(format!("{{{}}}:cooldown:{k}", self.inner.ns))
            .arg(len.as_millis() as u64)
            .arg(why);
        let sent = async {
            let mut conn = self.inner.conn.get().await.map_err(|e| e.to_string())?;
            inv.invoke_async::<i64>(&mut conn)
                .await
                .map_err(|e| e.to_string())
        };
        if let Err(e) = sent.await {
            tracing::warn!(error = %e, what = %k, "cooldown not shared (Redis): only this worker routes around it");
        }
    }

    /// Records one call of `model`; true when the model now fails most of its recent
    /// calls (the caller puts it in a [`FAILING`] cooldown).
    pub fn record(&self, model: &str, failed: bool) -> bool {
        let now = Instant::now();
        let mut recent = lock(&self.inner.recent);
        let calls = recent.entry(model.to_string()).or_default();
        calls.retain(|(t, _)| now.duration_since(*t) < Duration::from_secs(60));
        calls.push((now, failed));
        if calls.len() > 4 * FAILING_MIN_CALLS {
            calls.remove(0);
        }
        let fails = calls.iter().filter(|(_, f)| *f).count();
        let tripped = calls.len() >= FAILING_MIN_CALLS && fails * 2 > calls.len();
        if tripped {
            calls.clear(); // start counting afresh after the cooldown
        }
        tripped
    }

    /// Reads the fleet's cooldowns into the local copy (best effort).
    pub async fn refresh(&self) {
        if let Ok(list) = self.list().await {
            let now = Instant::now();
            let mut known = lock(&self.inner.known);
            known.retain(|_, end| *end > now);
            for (k, ms, _) in list {
                let end = now + Duration::from_millis(ms);
                let e = known.entry(k).or_insert(end);
                if *e < end {
                    *e = end;
                }
            }
        }
    }

    /// Re-reads the fleet's cooldowns every [`REFRESH`] until `stop`.
    pub fn spawn_refresh(&self, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(REFRESH) => {}
                    _ = stop.cancelled() => return,
                }
                me.refresh().await;
            }
        })
    }

    /// Every cooldown in Redis now: (`m:<model>` / `p:<provider>`, ms left, reason).
    pub async fn list(&self) -> Result<Vec<(String, u64, String)>, redis::RedisError> {
        let mut conn =
            self.inner.conn.get().await.map_err(|e| {
                redis::RedisError::from((redis::ErrorKind::Io, "pool", e.to_string()))
            })?;
        list_with(&self.inner.ns, &mut conn).await
    }
}

/// Every cooldown of namespace `ns` (for `status` too).
pub async fn list_with<C: redis::aio::ConnectionLike + Send>(
    ns: &str,
    conn: &mut C,
) -> Result<Vec<(String, u64, String)>, redis::RedisError> {
    let prefix = format!("{{{ns}}}:cooldown:");
    let keys = crate::connect::scan_match(conn, &format!("{prefix}*")).await?;
    let mut out = vec![];
    for k in keys {
        let ttl: i64 = redis::cmd("PTTL").arg(&k).query_async(conn).await?;
        let why: Option<String> = redis::cmd("GET").arg(&k).query_async(conn).await?;
        if ttl > 0 {
            out.push((
                k.strip_prefix(&prefix).unwrap_or(&k).to_string(),
                ttl as u64,
                why.unwrap_or_default(),
            ));
        }
    }
    out.sort();
    Ok(out)
}
