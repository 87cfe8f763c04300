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
//! deadline; a caller that is dropped first (the client hung up) leaves an entry that
//! fires into a closed channel at its deadline, so the heap holds at most the calls of the
//! last `latency + jitter`; the thread never exits and holds the lock only while it pops
//! or pushes, never while it waits.
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

struct Timers {
    heap: Mutex<BinaryHeap<Entry>>,
    cv: Condvar,
}

static TIMERS: Timers = Timers {
    heap: Mutex::new(BinaryHeap::new()),
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
    let mut g = lock(&t.heap);
    loop {
        let now = Instant::now();
        while g.peek().is_some_and(|e| e.at <= now) {
            if let Some(e) = g.pop() {
                let _ = e.tx.send(());
            }
        }
        g = match g.peek().map(|e| e.at - now) {
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
        lock(&t.heap).push(Entry {
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
