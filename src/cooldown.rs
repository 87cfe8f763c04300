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
use crate::sync::{FastMap, lock};
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
    /// Per model, this process's recent calls.
    recent: Mutex<FastMap<String, RecentCalls>>,
}

/// How long a call counts toward [`FAILING_MIN_CALLS`].
const RECENT_WINDOW: Duration = Duration::from_secs(60);
/// Most calls of a model kept: the newest ones decide.
const RECENT_KEPT: usize = 4 * FAILING_MIN_CALLS;

/// One model's last calls in this process, oldest first, and how many of them failed.
/// Invariants: `calls` is in order of `when` (each is recorded under the lock with the
/// time read there), holds at most [`RECENT_KEPT`], and `fails` counts its failed ones;
/// so dropping the stale ones is popping from the front, and nothing is rescanned per
/// call (this runs on every call that succeeds or fails transiently).
#[derive(Default)]
struct RecentCalls {
    calls: std::collections::VecDeque<(Instant, bool)>,
    fails: usize,
}

impl RecentCalls {
    /// Records a call made at `now` (no earlier than the last one recorded); true when
    /// at least [`FAILING_MIN_CALLS`] calls of the last [`RECENT_WINDOW`] are kept and
    /// more than half of them failed. Then the count starts afresh.
    fn record(&mut self, now: Instant, failed: bool) -> bool {
        while let Some(&(t, f)) = self.calls.front() {
            if now.duration_since(t) < RECENT_WINDOW {
                break;
            }
            self.calls.pop_front();
            self.fails -= usize::from(f);
        }
        self.calls.push_back((now, failed));
        self.fails += usize::from(failed);
        if self.calls.len() > RECENT_KEPT
            && let Some((_, f)) = self.calls.pop_front()
        {
            self.fails -= usize::from(f);
        }
        let tripped = self.calls.len() >= FAILING_MIN_CALLS && self.fails * 2 > self.calls.len();
        if tripped {
            // start counting afresh after the cooldown
            self.calls.clear();
            self.fails = 0;
        }
        tripped
    }
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
                known: Mutex::default(),
                recent: Mutex::default(),
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
        let mut recent = lock(&self.inner.recent);
        // The time is read under the lock, so each model's calls stay in order.
        let now = Instant::now();
        if let Some(calls) = recent.get_mut(model) {
            return calls.record(now, failed);
        }
        let mut calls = RecentCalls::default();
        let tripped = calls.record(now, failed);
        recent.insert(model.to_string(), calls);
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

/// The fleet's cooldowns hash of namespace `ns`.
pub(crate) fn hash_key(ns: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rule as it was first written: keep the calls of the last minute, add this one,
    /// keep the newest [`RECENT_KEPT`], count the failed ones again.
    fn by_rescan(calls: &mut Vec<(Instant, bool)>, now: Instant, failed: bool) -> bool {
        calls.retain(|(t, _)| now.duration_since(*t) < RECENT_WINDOW);
        calls.push((now, failed));
        if calls.len() > RECENT_KEPT {
            calls.remove(0);
        }
        let fails = calls.iter().filter(|(_, f)| *f).count();
        let tripped = calls.len() >= FAILING_MIN_CALLS && fails * 2 > calls.len();
        if tripped {
            calls.clear();
        }
        tripped
    }

    #[test]
    fn six_failures_of_ten_trip_and_the_count_starts_afresh() {
        let t0 = Instant::now();
        let mut r = RecentCalls::default();
        for i in 0..4 {
            assert!(!r.record(t0 + Duration::from_millis(i), false));
        }
        for i in 4..9 {
            assert!(!r.record(t0 + Duration::from_millis(i), true), "call {i}");
        }
        // the tenth call, the sixth failure: 6 of 10
        assert!(r.record(t0 + Duration::from_millis(9), true));
        assert_eq!((r.calls.len(), r.fails), (0, 0));
        // failures older than the window do not count
        for i in 0..9 {
            assert!(!r.record(t0 + Duration::from_secs(1) + Duration::from_millis(i), true));
        }
        let later = t0 + Duration::from_secs(62);
        assert!(!r.record(later, true));
        assert_eq!((r.calls.len(), r.fails), (1, 1));
    }

    #[test]
    fn the_forty_first_call_in_a_minute_pushes_out_the_oldest() {
        let t0 = Instant::now();
        let mut r = RecentCalls::default();
        // one failure first, then successes: it must leave when the 41st call comes
        assert!(!r.record(t0, true));
        for i in 1..RECENT_KEPT as u64 {
            assert!(!r.record(t0 + Duration::from_millis(i), false));
        }
        assert_eq!((r.calls.len(), r.fails), (RECENT_KEPT, 1));
        assert!(!r.record(t0 + Duration::from_millis(100), false));
        assert_eq!((r.calls.len(), r.fails), (RECENT_KEPT, 0));
    }

    #[test]
    fn a_call_exactly_a_window_old_no_longer_counts() {
        let t0 = Instant::now();
        let mut r = RecentCalls::default();
        assert!(!r.record(t0, true));
        assert!(!r.record(t0 + RECENT_WINDOW - Duration::from_millis(1), false));
        assert_eq!(r.calls.len(), 2);
        assert!(!r.record(t0 + RECENT_WINDOW, false));
        assert_eq!((r.calls.len(), r.fails), (2, 0));
    }

    /// Calls as (gap since the last one in ms, failed): bursts (no gap, or a few
    /// milliseconds) that fill the window past what is kept, gaps up to and over the
    /// window (exactly the window included), mostly successes so that runs go long
    /// without a trip, and runs of failures that trip.
    fn calls(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<(u64, bool)>> {
        proptest::collection::vec(
            (
                prop_oneof![
                    10 => Just(0u64),
                    10 => 0u64..2_000,
                    1 => 0u64..70_000,
                    1 => Just(RECENT_WINDOW.as_millis() as u64),
                ],
                prop_oneof![4 => Just(false), 1 => Just(true)],
            ),
            len,
        )
    }

    proptest! {
        /// Same answers as the rescan on any sequence of [`calls`].
        #[test]
        fn answers_as_the_rescan_does(steps in calls(1..400)) {
            let mut now = Instant::now();
            let mut fast = RecentCalls::default();
            let mut slow = Vec::new();
            for (gap_ms, failed) in steps {
                now += Duration::from_millis(gap_ms);
                prop_assert_eq!(fast.record(now, failed), by_rescan(&mut slow, now, failed));
                prop_assert_eq!(fast.calls.iter().copied().collect::<Vec<_>>(), slow.clone());
                prop_assert_eq!(fast.fails, slow.iter().filter(|(_, f)| *f).count());
            }
        }
    }

    /// [`calls`] does fill the window to the cap, and does trip (else the proptest would
    /// not cover them).
    #[test]
    fn the_proptest_reaches_the_cap() {
        use proptest::strategy::ValueTree;
        use proptest::test_runner::TestRunner;
        let strat = calls(300..400);
        let mut runner = TestRunner::deterministic();
        let (mut full, mut tripped) = (0, 0);
        for _ in 0..50 {
            let steps = strat.new_tree(&mut runner).expect("a case").current();
            let (mut now, mut slow) = (Instant::now(), Vec::new());
            let (mut longest, mut trips) = (0, 0);
            for (gap_ms, failed) in steps {
                now += Duration::from_millis(gap_ms);
                trips += usize::from(by_rescan(&mut slow, now, failed));
                longest = longest.max(slow.len());
            }
            full += usize::from(longest == RECENT_KEPT);
            tripped += usize::from(trips > 0);
        }
        assert!(full >= 10, "only {full} of 50 cases filled the window");
        assert!(tripped >= 5, "only {tripped} of 50 cases tripped");
    }
}
