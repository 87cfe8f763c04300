//! Tenant caps: `pools.<p>.max_per_tenant` bounds how many of a pool's slots one tenant
//! (a job's `tenant`) holds at once, fleet-wide, without letting that tenant's backlog
//! stand in front of anyone else's jobs.
//!
//! A job of a capped pool asks for a place before it asks for a slot
//! (`Queue::admit_tenant`, `lua/tenant_admit.lua`). With no place free, the same script
//! parks it: the entry moves, like a shutdown hand-back (same fields, delivery count and
//! spend carried), to the tenant's parked stream `{ns}:parked:<pool>:<tenant>`. It then
//! holds neither a slot nor a job permit, and the reader goes on to the jobs behind it.
//! Each place given back (`lua/tenant_release.lua`) moves parked entries back to the
//! jobs stream's tail, one per free place, each with the place kept for it (`u:<entry>`),
//! so the number in transit never exceeds the free places and nothing spins.
//!
//! Invariants:
//! - at most `max_per_tenant` places per tenant and pool are held, each a lease that
//!   expires `slots.ttl_ms` after its last renewal (a killed worker's place frees itself),
//!   renewed every third of that while its job runs;
//! - a parked entry is never lost: it stays in its parked stream until moved back, and
//!   every worker's sweep (every [`SWEEP`]) moves parked entries back for places freed by
//!   expiry, so no release event is needed for progress;
//! - a place is given back on every exit of its job (the lease's drop), and every place
//!   still held is given back at shutdown ([`Tenants::release_all`]).

use crate::config::Config;
use crate::connect::Commands;
use crate::queue::Keys;
use crate::sync::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often every worker moves parked jobs back for places freed by expiry.
pub const SWEEP: Duration = Duration::from_secs(1);
/// How long a place stays kept for an entry moved back to the jobs stream: past it, a
/// backlog in front of that entry no longer holds the tenant below its cap (the entry is
/// parked again when it arrives and finds no place).
pub const TRANSIT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("tenant place script failed ({0}); retry when Redis answers")]
    Redis(#[from] redis::RedisError),
    #[error("no Redis connection for the tenant places ({0}); retry when Redis answers")]
    Pool(#[from] deadpool_redis::PoolError),
}

/// The fleet's tenant places as this process uses them. Cheap to clone.
#[derive(Clone)]
pub struct Tenants {
    inner: Arc<Inner>,
}

struct Inner {
    keys: Keys,
    conn: Commands,
    /// Pool -> cap, only pools with a cap.
    caps: HashMap<String, u32>,
    ttl: Duration,
    token: String,
    nonce: AtomicU64,
    /// Places this process holds: holder-set key -> members.
    held: Mutex<HashMap<String, Vec<String>>>,
    /// Detached releases (a lease dropped), awaited at shutdown.
    releases: tokio_util::task::TaskTracker,
}

/// One place of a tenant in a pool, held from admission until the job stops using the
/// pool. Dropping it gives the place back (detached); it is renewed meanwhile.
pub struct TenantLease {
    inner: Arc<Inner>,
    pool: String,
    tenant: String,
    member: String,
}

impl std::fmt::Debug for TenantLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantLease")
            .field("pool", &self.pool)
            .field("member", &self.member)
            .finish()
    }
}

impl Tenants {
    /// `token`: this process's holder token (members are `<token>#<n>`).
    pub fn new(cfg: &Config, conn: Commands, token: &str) -> Tenants {
        let caps = cfg
            .pools
            .iter()
            .filter(|(_, p)| p.max_per_tenant > 0)
            .map(|(n, p)| (n.clone(), p.max_per_tenant))
            .collect();
        Tenants {
            inner: Arc::new(Inner {
                keys: Keys::new(&cfg.queue.namespace),
                conn,
                caps,
                ttl: cfg.slots.ttl_ms,
                token: token.to_string(),
                nonce: AtomicU64::new(0),
                held: Mutex::new(HashMap::new()),
                releases: tokio_util::task::TaskTracker::new(),
            }),
        }
    }

    /// The cap of `pool`, if it has one.
    pub fn cap(&self, pool: &str) -> Option<u32> {
        self.inner.caps.get(pool).copied()
    }

    /// Whether any pool is capped (nothing to renew or sweep otherwise).
    pub fn any(&self) -> bool {
        !self.inner.caps.is_empty()
    }

    pub fn ttl_ms(&self) -> u64 {
        millis(self.inner.ttl)
    }

    /// The stall gap and the kept-place length, in ms, as the admission script takes them.
    pub fn gap_and_transit_ms(&self) -> (u64, u64) {
        (millis(self.gap()), millis(transit()))
    }

    /// A fresh member name for a place about to be asked for (unique per lease, so a late
    /// release of an old one can never remove a newer one).
    pub fn new_member(&self) -> String {
        let n = self.inner.nonce.fetch_add(1, Ordering::Relaxed);
        format!("{}#{n}", self.inner.token)
    }

    /// Records a place the admission script gave (`member`): renewed from now on,
    /// given back when the returned lease drops.
    pub fn admitted(&self, pool: &str, tenant: &str, member: String) -> TenantLease {
        let key = self.inner.keys.tenant_holders(pool, tenant);
        lock(&self.inner.held)
            .entry(key)
            .or_default()
            .push(member.clone());
        TenantLease {
            inner: self.inner.clone(),
            pool: pool.to_string(),
            tenant: tenant.to_string(),
            member,
        }
    }

    /// Places held by this process now (for tests and `status`).
    pub fn held(&self) -> usize {
        lock(&self.inner.held).values().map(Vec::len).sum()
    }

    /// Renews every place this process holds (one round trip), every third of the ttl,
    /// which is also this worker's tick of the tenant clock (`lua/tenant_clock.lua`);
    /// and, once a second fleet-wide (whichever worker takes `{ns}:tenantsweep` first),
    /// moves parked jobs back for places freed by expiry. Two loops, so a slow sweep
    /// never delays a renewal. Until `stop`.
    pub fn spawn_background(&self, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            // Renewals only where this worker can hold places; the sweep always (parked
            // jobs of a pool with no cap here are moved back).
            let renewer = async {
                if me.any() {
                    every(me.inner.ttl / 3, &stop, || me.renew_logged()).await;
                }
            };
            tokio::join!(renewer, every(SWEEP, &stop, || me.sweep_logged()));
        })
    }

    async fn renew_logged(&self) {
        if let Err(e) = self.renew().await {
            tracing::warn!(error = %e, "renewing tenant places failed; retrying next tick");
        }
    }

    async fn sweep_logged(&self) {
        if let Err(e) = self.sweep().await {
            tracing::debug!(error = %e, "tenant sweep failed; retrying next second");
        }
    }

    /// The stall gap of the holder clock: half the ttl (as the slots' lease clock).
    fn gap(&self) -> Duration {
        (self.inner.ttl / 2).max(Duration::from_millis(20))
    }

    async fn renew(&self) -> Result<(), TenantError> {
        let held: Vec<(String, Vec<String>)> = lock(&self.inner.held)
            .iter()
            .filter(|(_, m)| !m.is_empty())
            .map(|(k, m)| (k.clone(), m.clone()))
            .collect();
        // Run with nothing held too: it is this worker's tick of the tenant clock.
        let keys = &self.inner.keys;
        let mut inv = crate::scripts::Call::new(&crate::scripts::TENANT_RENEW);
        inv.key(keys.tenant_clock())
            .key(&keys.jobs)
            .arg(self.ttl_ms())
            .arg(millis(self.gap()))
            .arg(millis(transit()));
        for (k, members) in &held {
            inv.key(k).arg(members.len());
            for m in members {
                inv.arg(m);
            }
        }
        let mut conn = self.inner.conn.get().await?;
        let _: i64 = inv.invoke(&mut conn).await?;
        Ok(())
    }

    /// Moves parked jobs back for places free now, for every parked tenant, if this
    /// worker takes the fleet's sweep lock for this second. A pool this worker knows no
    /// cap for (the cap was removed, or the pool renamed) has its parked jobs moved back
    /// without places, so a config change never strands them. One tenant's error does
    /// not stop the others. Returns how many entries moved.
    pub async fn sweep(&self) -> Result<u64, TenantError> {
        let keys = &self.inner.keys;
        let mut conn = self.inner.conn.get().await?;
        let mine: Option<String> = redis::cmd("SET")
            .arg(keys.tenant_sweep())
            .arg(&self.inner.token)
            .arg("NX")
            .arg("PX")
            .arg(millis(SWEEP) * 9 / 10)
            .query_async(&mut conn)
            .await?;
        if mine.is_none() {
            return Ok(0);
        }
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg(keys.parked_index())
            .query_async(&mut conn)
            .await?;
        drop(conn);
        let mut moved = 0;
        let mut failed = None;
        for f in fields {
            let Some((pool, tenant)) = f.split_once(':') else {
                continue;
            };
            match release(&self.inner, pool, tenant, "").await {
                Ok(n) => {
                    if n > 0 && self.cap(pool).is_none() {
                        tracing::info!(
                            pool,
                            moved = n,
                            "pool has no max_per_tenant here: its parked jobs are moved back"
                        );
                    }
                    moved += n;
                }
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(moved),
        }
    }

    /// Gives back the place kept for `entry_id` (moved back from the parked stream of
    /// `field` = `<pool>:<tenant>`) when its job ended without taking it (a duplicate, an
    /// invalid job, another pool, a hand-back). Detached, tracked like a lease's release.
    pub fn release_kept(&self, field: &str, entry_id: &str) {
        let Some((pool, tenant)) = field.split_once(':') else {
            return;
        };
        spawn_release(&self.inner, pool, tenant, format!("u:{entry_id}"), &[0]);
    }

    /// Gives back every place this process still holds (shutdown), after the detached
    /// releases have had `bound` to finish. Returns how many it gave back here.
    pub async fn release_all(&self, bound: Duration) -> Result<usize, TenantError> {
        self.inner.releases.close();
        let _ = tokio::time::timeout(bound, self.inner.releases.wait()).await;
        let held: Vec<(String, Vec<String>)> = lock(&self.inner.held)
            .drain()
            .filter(|(_, m)| !m.is_empty())
            .collect();
        let mut n = 0;
        let mut failed = None;
        for (key, members) in held {
            let Some((pool, tenant)) = split_holders_key(&self.inner.keys, &key) else {
                continue;
            };
            for m in members {
                match release(&self.inner, &pool, &tenant, &m).await {
                    Ok(_) => n += 1,
                    Err(e) => failed = Some(e),
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }
}

/// [`TRANSIT`], or in debug builds `LLM_WORKER_DEBUG_TENANT_TRANSIT_MS` (tests of a
/// backlog longer than a kept place lasts).
fn transit() -> Duration {
    #[cfg(debug_assertions)]
    if let Some(ms) = std::env::var("LLM_WORKER_DEBUG_TENANT_TRANSIT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        return Duration::from_millis(ms);
    }
    TRANSIT
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// (pool, tenant) of a holder-set key (pool names of capped pools hold no ':').
fn split_holders_key(keys: &Keys, key: &str) -> Option<(String, String)> {
    let rest = key.strip_prefix(&format!("{}:tenant:", keys.prefix))?;
    let (pool, tenant) = rest.split_once(':')?;
    Some((pool.to_string(), tenant.to_string()))
}

/// Gives back `member`'s place ('' = none: a sweep) and moves parked entries back for
/// the places free now (`lua/tenant_release.lua`).
async fn release(
    inner: &Inner,
    pool: &str,
    tenant: &str,
    member: &str,
) -> Result<u64, TenantError> {
    // 0 = no cap here: the parked entries are moved back without places.
    let cap = inner.caps.get(pool).copied().unwrap_or(0);
    let mut inv = crate::scripts::Call::new(&crate::scripts::TENANT_RELEASE);
    inv.key(inner.keys.tenant_holders(pool, tenant))
        .key(inner.keys.parked(pool, tenant))
        .key(&inner.keys.jobs)
        .key(inner.keys.parked_index())
        .key(inner.keys.tenant_clock())
        .arg(member)
        .arg(cap)
        .arg(millis(transit()))
        .arg(format!("{pool}:{tenant}"))
        .arg(millis((inner.ttl / 2).max(Duration::from_millis(20))));
    let mut conn = inner.conn.get().await?;
    let moved: u64 = inv.invoke(&mut conn).await?;
    if moved > 0 {
        metrics::counter!("llm_worker_tenant_unparked_total", "pool" => pool.to_string())
            .increment(moved);
    }
    Ok(moved)
}

impl TenantLease {
    pub fn pool(&self) -> &str {
        &self.pool
    }
}

impl Drop for TenantLease {
    fn drop(&mut self) {
        let key = self.inner.keys.tenant_holders(&self.pool, &self.tenant);
        {
            let mut held = lock(&self.inner.held);
            if let Some(ms) = held.get_mut(&key) {
                ms.retain(|m| *m != self.member);
                if ms.is_empty() {
                    held.remove(&key);
                }
            }
        }
        let member = std::mem::take(&mut self.member);
        // Retried briefly: a lost release only costs the place until its expiry.
        spawn_release(
            &self.inner,
            &self.pool,
            &self.tenant,
            member,
            &[0, 200, 1000],
        );
    }
}

/// Runs `f` every `period` (the first at once) until `stop`.
async fn every<F, Fut>(period: Duration, stop: &CancellationToken, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        f().await;
    }
}

/// Gives `member`'s place back in a detached task, tracked for the exit: one try after
/// each of `waits_ms` (0 = at once) until Redis answers.
fn spawn_release(inner: &Arc<Inner>, pool: &str, tenant: &str, member: String, waits_ms: &[u64]) {
    let Ok(h) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (inner, pool, tenant) = (inner.clone(), pool.to_string(), tenant.to_string());
    let waits = waits_ms.to_vec();
    let tracker = inner.releases.clone();
    h.spawn(tracker.track_future(async move {
        for wait in waits {
            tokio::time::sleep(Duration::from_millis(wait)).await;
            match release(&inner, &pool, &tenant, &member).await {
                Ok(_) => return,
                Err(e) => tracing::debug!(error = %e, "giving a tenant place back failed"),
            }
        }
        tracing::warn!(pool = %pool, "giving a tenant place back failed; it frees itself at its expiry (a kept one once its entry is gone)");
    }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_key_splits_back_into_pool_and_tenant() {
        let keys = Keys::new("ns");
        let k = keys.tenant_holders("default", "acme:eu");
        assert_eq!(
            split_holders_key(&keys, &k),
            Some(("default".into(), "acme:eu".into()))
        );
        assert_eq!(split_holders_key(&keys, "{ns}:parked:default:x"), None);
    }
}
