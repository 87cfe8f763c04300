//! Shared cooldowns: a model or a whole provider that the fleet should route around for a
//! while, recorded in Redis (one hash `{ns}:cooldowns`, field `m:<model>` / `p:<provider>`
//! = "<end ms>|<reason>")
//! so one worker's discovery (a 429 with a long Retry-After, a provider-wide rejection,
//! a model failing most calls) spares every other worker the same failed calls.
//!
//! Invariants: a cooldown is only ever lengthened, never shortened (`lua/cooldown.lua`);
//! reading costs no round trip per job: each worker refreshes a local copy every
//! [`REFRESH`] (one HGETALL), and a worker that sets a cooldown sees it at once.

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
/// Longest cooldown: a Retry-After of hours (or a far HTTP date) must not park a model
/// (and the jobs that wait for it) for longer.
pub const MAX_COOLDOWN: Duration = Duration::from_secs(600);
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
        if known.is_empty() {
            return None; // the usual case: nothing cools, nothing to spell
        }
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
        let len = len.min(MAX_COOLDOWN);
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
        let mut inv = crate::scripts::Call::new(&crate::scripts::COOLDOWN);
        inv.key(hash_key(&self.inner.ns))
            .arg(&k)
            .arg(len.as_millis() as u64)
            .arg(why);
        let sent = async {
            let mut conn = self.inner.conn.get().await.map_err(|e| e.to_string())?;
            inv.invoke::<i64>(&mut conn)
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
        if !recent.contains_key(model) {
            recent.insert(model.to_string(), Vec::new());
        }
        let Some(calls) = recent.get_mut(model) else {
            return false;
        };
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

    /// Replaces the local copy with the fleet's cooldowns (best effort: kept as it is
    /// while Redis does not answer). Redis is the truth: a cooldown ended early there
    /// (`HDEL`) ends here too.
    pub async fn refresh(&self) {
        if let Ok(list) = self.list().await {
            let now = Instant::now();
            let fresh: HashMap<String, Instant> = list
                .into_iter()
                .map(|(k, ms, _)| (k, now + Duration::from_millis(ms)))
                .collect();
            *lock(&self.inner.known) = fresh;
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

fn hash_key(ns: &str) -> String {
    format!("{{{ns}}}:cooldowns")
}

/// Every cooldown of namespace `ns` still running (for `status` too): (`m:<model>` /
/// `p:<provider>`, ms left by the server's clock, reason). One round trip.
pub async fn list_with<C: redis::aio::ConnectionLike + Send>(
    ns: &str,
    conn: &mut C,
) -> Result<Vec<(String, u64, String)>, redis::RedisError> {
    let ((secs, micros), all): ((u64, u64), HashMap<String, String>) = redis::pipe()
        .cmd("TIME")
        .cmd("HGETALL")
        .arg(hash_key(ns))
        .query_async(conn)
        .await?;
    let now = secs * 1000 + micros / 1000;
    let mut out: Vec<(String, u64, String)> = all
        .into_iter()
        .filter_map(|(k, v)| {
            let (ends, why) = v.split_once('|')?;
            let ends: u64 = ends.parse().ok()?;
            (ends > now).then(|| (k, ends - now, why.to_string()))
        })
        .collect();
    out.sort();
    Ok(out)
}
