//! The one retry delay of the crate: exponential backoff with equal jitter, capped.
//!
//! Used for model-call retries (`router::Plan`, from `[retry]`), and for every loop that
//! waits for Redis to answer again (reader, commit, idempotency check, slot waiter
//! driver, start-up; [`Backoff::redis`]).
//!
//! The n-th retry (n >= 1) waits a time in `[d/2, d]`, `d = min(max, base * 2^(n-1))`,
//! placed by a jitter number in `[0, 1)`. Equal jitter rather than full jitter (`[0, d]`):
//! a retry never comes back at once (a provider that just failed, a Redis still loading,
//! gets at least half the step), while the spread still keeps a fleet that failed
//! together from retrying in lockstep. A server's `Retry-After` replaces the computed
//! delay ([`Backoff::delay_or_after`]); whether it is too long to wait for is the
//! caller's decision (the router then switches models).
//!
//! Invariants: no delay exceeds `max` (nor a given `Retry-After`, which is returned as
//! is); delays are whole milliseconds; the jitter is a parameter, so every schedule is
//! reproducible in a test, and [`Backoff::sleep_jittered`] sleeps on tokio's clock, so
//! a test with paused time sees exact durations.

use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A backoff schedule (`base`, `max`) and where a retry loop stands in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    /// Delays taken since the start or the last [`Backoff::reset`].
    failures: u32,
}

impl Backoff {
    /// A schedule starting at `base` and doubling up to `max`.
    pub const fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max,
            failures: 0,
        }
    }

    /// Waiting for Redis: 100 ms doubling to 5 s (a restart or failover is noticed within
    /// 5 s, and a fleet of workers polls a dead Redis at most every 2.5 s each).
    pub const fn redis() -> Backoff {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(5))
    }

    /// The delay of the `n`-th retry (n >= 1; 0 counts as 1), with `jitter` in [0, 1).
    /// Pure: the schedule's position is not used or changed.
    pub fn delay(&self, n: u32, jitter: f64) -> Duration {
        let base = u64::try_from(self.base.as_millis()).unwrap_or(u64::MAX);
        let max = u64::try_from(self.max.as_millis()).unwrap_or(u64::MAX);
        let exp = base
            .saturating_mul(1u64 << n.saturating_sub(1).min(32))
            .min(max);
        let half = exp / 2;
        let j = jitter.clamp(0.0, 1.0);
        Duration::from_millis(half + ((exp - half) as f64 * j) as u64)
    }

    /// `retry_after` when the server gave one (it knows when it will take calls again),
    /// else [`Backoff::delay`].
    pub fn delay_or_after(&self, n: u32, jitter: f64, retry_after: Option<Duration>) -> Duration {
        retry_after.unwrap_or_else(|| self.delay(n, jitter))
    }

    /// The next delay of this loop's schedule, and one step further.
    pub fn next_delay(&mut self, jitter: f64) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.delay(self.failures, jitter)
    }

    /// Delays taken since the start or the last reset (0: the first failure is now, the
    /// moment to log it once).
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Back to the first step (the thing waited for answered again).
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Sleeps the next delay with random jitter, cut short by `cancel`.
    pub async fn sleep(&mut self, cancel: &CancellationToken) {
        self.sleep_jittered(rand::random::<f64>(), cancel).await;
    }

    /// [`Backoff::sleep`] with the jitter given (in [0, 1)), on tokio's clock. The
    /// schedule advances even when `cancel` cuts the sleep short.
    pub async fn sleep_jittered(&mut self, jitter: f64, cancel: &CancellationToken) {
        let d = self.next_delay(jitter);
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = cancel.cancelled() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delay_doubles_from_base_to_max_within_equal_jitter() {
        let b = Backoff::new(ms(500), ms(8000));
        assert_eq!(b.delay(1, 0.0), ms(250));
        assert_eq!(b.delay(0, 0.0), ms(250), "0 counts as the first retry");
        assert_eq!(b.delay(1, 0.999_999), ms(499));
        assert_eq!(b.delay(3, 0.0), ms(1000));
        assert_eq!(b.delay(10, 0.0), ms(4000));
        assert_eq!(b.delay(10, 0.999_999), ms(7999));
        for n in [1, 5, 33, 60, u32::MAX] {
            for j in [0.0, 0.5, 0.999_999, 1.0, 7.0, -1.0, f64::NAN] {
                let d = b.delay(n, j);
                assert!(d <= ms(8000), "n {n} jitter {j}: {d:?}");
                assert!(d >= b.delay(n, 0.0), "n {n} jitter {j}: {d:?}");
            }
        }
        // A base above the cap is capped at once; huge bases do not overflow.
        assert_eq!(Backoff::new(ms(9000), ms(8000)).delay(1, 0.0), ms(4000));
        let huge = Backoff::new(Duration::from_secs(u64::MAX / 4), Duration::MAX);
        assert!(huge.delay(40, 0.5) > Duration::from_secs(1 << 40));
    }

    #[test]
    fn retry_after_replaces_the_computed_delay() {
        let b = Backoff::new(ms(500), ms(8000));
        assert_eq!(b.delay_or_after(1, 0.0, None), ms(250));
        assert_eq!(b.delay_or_after(1, 0.0, Some(ms(20_000))), ms(20_000));
        assert_eq!(b.delay_or_after(9, 0.9, Some(ms(3))), ms(3));
    }

    #[test]
    fn next_delay_walks_the_schedule_and_reset_starts_over() {
        let mut b = Backoff::redis();
        assert_eq!(b.failures(), 0);
        let steps: Vec<u128> = (0..8).map(|_| b.next_delay(0.0).as_millis()).collect();
        assert_eq!(steps, [50, 100, 200, 400, 800, 1600, 2500, 2500]);
        assert_eq!(b.failures(), 8);
        b.reset();
        assert_eq!(b.failures(), 0);
        assert_eq!(b.next_delay(0.999_999), ms(99));
    }

    /// The Redis schedule as the loops sleep it: 100 ms doubling to 5 s, each step in
    /// `[d/2, d)`; cut short by the token; `reset` starts over. Paused time makes the
    /// durations exact and the test instant.
    #[tokio::test(start_paused = true)]
    async fn redis_backoff_sleeps_100ms_doubling_to_5s_on_paused_time() {
        let cancel = CancellationToken::new();
        let mut b = Backoff::redis();
        let mut slept = vec![];
        for _ in 0..8 {
            let t = Instant::now();
            b.sleep_jittered(0.0, &cancel).await;
            slept.push(t.elapsed().as_millis());
        }
        assert_eq!(slept, [50, 100, 200, 400, 800, 1600, 2500, 2500]);

        b.reset();
        let t = Instant::now();
        b.sleep_jittered(0.999_999, &cancel).await;
        assert_eq!(t.elapsed(), ms(99), "full jitter: just under the step");

        // The random-jitter form stays within [d/2, d].
        let t = Instant::now();
        b.sleep(&cancel).await;
        let slept = t.elapsed();
        assert!(
            (ms(100)..=ms(200)).contains(&slept),
            "second step slept {slept:?}"
        );

        // A cancelled token ends the sleep at once, and the schedule still advances.
        cancel.cancel();
        let t = Instant::now();
        b.sleep_jittered(0.0, &cancel).await;
        assert_eq!(t.elapsed(), Duration::ZERO);
        assert_eq!(b.failures(), 3);
        assert_eq!(b.next_delay(0.0), ms(400));
    }

    /// The router's schedule (`[retry]` base 500 ms, max 8 s), slept on paused time:
    /// the n-th retry waits d/2 at jitter 0 and just under d at full jitter.
    #[tokio::test(start_paused = true)]
    async fn retry_schedule_sleeps_exact_durations_on_paused_time() {
        let cancel = CancellationToken::new();
        let mut b = Backoff::new(ms(500), ms(8000));
        let started = Instant::now();
        let (mut low, mut high) = (vec![], vec![]);
        for i in 0..7 {
            let jitter = if i % 2 == 0 { 0.0 } else { 0.999_999 };
            let t = Instant::now();
            b.sleep_jittered(jitter, &cancel).await;
            let slept = t.elapsed().as_millis();
            if jitter == 0.0 {
                low.push(slept)
            } else {
                high.push(slept)
            }
        }
        assert_eq!(low, [250, 1000, 4000, 4000]);
        assert_eq!(high, [999, 3999, 7999]);
        assert_eq!(
            started.elapsed(),
            ms(250 + 999 + 1000 + 3999 + 4000 + 7999 + 4000)
        );
    }
}
