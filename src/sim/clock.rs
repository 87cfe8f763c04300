//! The simulated model's latency, kept to within a fraction of a millisecond.
//!
//! Why not `tokio::time::sleep`: tokio's timer wheel counts whole milliseconds and rounds
//! a deadline up, and its driver parks with a millisecond timeout, so a 200 ms `sleep`
//! answered after 201-202 ms (median 202.1 ms over a kept-alive connection, against 0.13 ms
//! for a 0 ms call). A "200 ms model" that takes 202 ms caps any worker's slot use at
//! 0.99 of N / 0.2 s before the worker does anything, which made the benchmark's slot-use
//! figures measure the simulator rather than the worker.
//!
//! How: one process-wide thread keeps the pending deadlines in a min-heap and waits on a
//! condition variable with a nanosecond timeout (a futex wait: the kernel's timer slack,
//! 50 µs by default, is the error). Each call registers its deadline with a oneshot
//! sender and awaits the receiver, so no runtime thread blocks.
//!
//! Invariants: an entry is fired (its sender used or dropped) no earlier than its
//! deadline; an entry whose caller was dropped first (the client hung up) is dropped
//! when the heap next doubles past the live entries of its last pruning, so clients that
//! hang up on a long `latency_ms` cannot grow it without bound, and pruning costs O(1)
//! per call amortized; the thread never exits and holds the lock only while it pops,
//! pushes or prunes, never while it waits.
//!
//! Paused tokio time (`tokio::time::pause`) does not apply here: no test pauses time
//! while a simulated call waits.

#![allow(clippy::disallowed_types)] // std's Instant: this thread runs outside tokio, see above.

use crate::sync::lock;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex, Once};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

struct Entry {
    at: Instant,
    tx: oneshot::Sender<()>,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.at == o.at
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    /// Reversed, so that `BinaryHeap` (a max-heap) pops the earliest deadline first.
    fn cmp(&self, o: &Self) -> Ordering {
        o.at.cmp(&self.at)
    }
}

struct Pending {
    heap: BinaryHeap<Entry>,
    /// Prune abandoned entries when the heap reaches this size (twice the live entries
    /// left by the last pruning, at least [`PRUNE_FLOOR`]).
    prune_at: usize,
}

/// Below this many pending entries the heap is never pruned.
const PRUNE_FLOOR: usize = 1024;

struct Timers {
    pending: Mutex<Pending>,
    cv: Condvar,
}

static TIMERS: Timers = Timers {
    pending: Mutex::new(Pending {
        heap: BinaryHeap::new(),
        prune_at: PRUNE_FLOOR,
    }),
    cv: Condvar::new(),
};

/// The timers, with their thread started on first use.
fn timers() -> &'static Timers {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        std::thread::Builder::new()
            .name("sim-clock".into())
            .spawn(|| run(&TIMERS))
            .expect("spawn the simulated model's clock thread");
    });
    &TIMERS
}

fn run(t: &'static Timers) {
    let mut g = lock(&t.pending);
    loop {
        let now = Instant::now();
        while g.heap.peek().is_some_and(|e| e.at <= now) {
            if let Some(e) = g.heap.pop() {
                let _ = e.tx.send(());
            }
        }
        // From the time after the sends, not `now`: they took a moment.
        g = match g
            .heap
            .peek()
            .map(|e| e.at.saturating_duration_since(Instant::now()))
        {
            Some(wait) => {
                t.cv.wait_timeout(g, wait)
                    .map_or_else(|p| p.into_inner().0, |r| r.0)
            }
            None => t.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
        };
    }
}

/// Waits `d`, to within the kernel's timer slack (not tokio's millisecond ticks).
pub(super) async fn sleep(d: Duration) {
    let (tx, rx) = oneshot::channel();
    let t = timers();
    {
        let mut g = lock(&t.pending);
        if g.heap.len() >= g.prune_at {
            g.heap.retain(|e| !e.tx.is_closed());
            g.prune_at = (g.heap.len() * 2).max(PRUNE_FLOOR);
        }
        g.heap.push(Entry {
            at: Instant::now() + d,
            tx,
        });
    }
    t.cv.notify_one();
    // The sender is never dropped unfired: the thread runs for the life of the process.
    let _ = rx.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn calls_abandoned_by_their_clients_do_not_pile_up() {
        // 10,000 calls of an hour each, whose clients hang up at once.
        for _ in 0..10_000 {
            let mut call = Box::pin(sleep(Duration::from_secs(3600)));
            // Polled once (its deadline registered), then dropped.
            assert!(futures::FutureExt::now_or_never(&mut call).is_none());
        }
        sleep(Duration::from_millis(1)).await;
        let left = lock(&TIMERS.pending).heap.len();
        // Other tests of this binary may have a few calls pending meanwhile.
        assert!(
            left <= 2 * PRUNE_FLOOR,
            "{left} entries pending after 10,000 abandoned calls"
        );
    }

    #[tokio::test]
    async fn waits_at_least_the_time_asked_and_not_a_millisecond_more() {
        // tokio's `sleep` is 1-2 ms late here every time; a loaded test machine can make
        // this clock late now and then, so the best of three rounds must be on time.
        let mut best = Duration::MAX;
        for _ in 0..3 {
            // Many at once, out of order, as concurrent calls register them.
            let mut tasks = Vec::new();
            for ms in [30u64, 10, 20, 10, 40] {
                tasks.push(tokio::spawn(async move {
                    let t0 = Instant::now();
                    sleep(Duration::from_millis(ms)).await;
                    (ms, t0.elapsed())
                }));
            }
            let mut late = Vec::new();
            for t in tasks {
                let (ms, took) = t.await.unwrap();
                assert!(
                    took >= Duration::from_millis(ms),
                    "{ms} ms woke after {took:?}"
                );
                late.push(took - Duration::from_millis(ms));
            }
            late.sort();
            best = best.min(late[late.len() / 2]);
        }
        assert!(
            best < Duration::from_micros(900),
            "median lateness {best:?}"
        );
    }
}
