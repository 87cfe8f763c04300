//! The cancel-marker reads job tasks make of their own, gathered into one command.
//!
//! A job without a producer id that waited, read ahead, longer than the freshness of
//! every read of its marker reads the marker again right before its call (see
//! `Worker::process`). Tasks get their job permits together when calls that started
//! together end together (a job permit is freed at the job's decision, before its
//! commit): 8 jobs of 200 ms each end in a burst every 200 ms, and with 8 processes on
//! one pool the fleet's slots come back in bursts. Each such task sent its own MGET (with
//! 8 processes, 0.48 MGETs a job in all, the command sent most after the commit). Here
//! the first ask of a burst sends one read; the asks that come while it is out go
//! together in the next, and so on: never more than one read out at a time, and no
//! ask waits longer than the read in flight plus its own (a [`Line`] with one sender,
//! the line the commit sender uses too).
//!
//! Invariants:
//! - an ask is answered `Ok(found)` only with the flag Redis gave for that very id in
//!   a read sent after the ask was made (a marker set before the ask is seen);
//! - every ask is answered: with its flag, with the read's error (one that cannot heal
//!   stays so), or (the reading task gone: a panic, the task dropped before or while it
//!   ran) with a healing error the asker retries on;
//! - at most one read is out at a time, and while asks wait one is out or about to be.

use crate::line::{Line, Role};
use crate::queue::QueueError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// One ask's answer: whether the id has a cancel marker.
pub(super) type Answer = Result<bool, QueueError>;

/// Reads the markers of the ids given in one command, one flag per id in order
/// (bounded by whoever builds it: the gatherer adds no bound of its own).
pub(super) type ReadMarkers = Arc<
    dyn Fn(Vec<String>) -> Pin<Box<dyn Future<Output = Result<Vec<bool>, QueueError>> + Send>>
        + Send
        + Sync,
>;

/// The gatherer (see the module doc): a [`Line`] of ids with one sender, the reader.
pub(super) struct CancelReads {
    read: ReadMarkers,
    line: Arc<Line<String, Answer>>,
}

impl CancelReads {
    pub(super) fn new(read: ReadMarkers) -> CancelReads {
        CancelReads {
            read,
            line: Arc::new(Line::new(1)),
        }
    }

    /// Whether `id` has a cancel marker, read after this call: in the read that goes
    /// out next (at once when none is out). Cancel-safe: a dropped ask is simply not
    /// answered.
    pub(super) async fn ask(self: &Arc<Self>, id: String) -> Answer {
        let (rx, role) = self.line.join(id);
        if let Some(role) = role {
            tokio::spawn(CancelReads::serve(self.clone(), role));
        }
        // The reader ended without answering (a panic, dropped): retry.
        rx.await.unwrap_or_else(|_| Err(gone()))
    }

    /// Sends reads until no ask waits: each read takes every ask that came before it
    /// (an asker that stopped waiting, its bound run out or a signal, is not read for).
    async fn serve(self: Arc<Self>, mut role: Role<String, Answer>) {
        while let Some(asks) = role.next(std::mem::take) {
            // The ids go to the read, moved (not copied); the answers' channels stay here.
            let (ids, done): (Vec<String>, Vec<_>) =
                asks.into_iter().map(|w| (w.item, w.done)).unzip();
            let n = ids.len();
            match (self.read)(ids).await {
                Ok(flags) if flags.len() == n => {
                    for (tx, found) in done.into_iter().zip(flags) {
                        let _ = tx.send(Ok(found));
                    }
                }
                Ok(flags) => {
                    for tx in done {
                        let _ = tx.send(Err(wrong_count(flags.len(), n)));
                    }
                }
                Err(e) => {
                    for tx in done {
                        let _ = tx.send(Err(e.copy().unwrap_or_else(|| lost(&e))));
                    }
                }
            }
        }
    }
}

/// A read that answered `got` flags for `want` markers (cannot heal: the job fails
/// without a call rather than run unchecked).
pub(super) fn wrong_count(got: usize, want: usize) -> QueueError {
    QueueError::Redis(redis::RedisError::from((
        redis::ErrorKind::Parse,
        "cancel markers' read answered",
        format!("{got} flags for {want} cancel markers"),
    )))
}

/// The answer of an ask whose reader ended without answering: heals (the asker retries).
fn gone() -> QueueError {
    QueueError::Redis(redis::RedisError::from((
        redis::ErrorKind::Io,
        "the cancel markers' read ended without an answer; retrying",
    )))
}

/// A read's error that [`QueueError::copy`] cannot copy (a pool error other than the
/// backend's, which all heal; a connect error, which the read never gives) for each of
/// its asks: an IO error carrying its text, which heals.
fn lost(e: &QueueError) -> QueueError {
    QueueError::Redis(redis::RedisError::from((
        redis::ErrorKind::Io,
        "cancel markers' read failed",
        e.to_string(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::lock;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A reader whose reads each wait for `gate` to open, recording the ids of each
    /// read; ids starting with "c" have a marker.
    fn held_reader(
        gate: Arc<tokio::sync::Semaphore>,
        seen: Arc<Mutex<Vec<Vec<String>>>>,
    ) -> ReadMarkers {
        Arc::new(move |ids: Vec<String>| {
            let (gate, seen) = (gate.clone(), seen.clone());
            Box::pin(async move {
                lock(&seen).push(ids.clone());
                gate.acquire().await.expect("open").forget();
                Ok(ids.iter().map(|id| id.starts_with('c')).collect())
            })
        })
    }

    async fn until(what: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !what() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("bounded wait");
    }

    /// Ten asks while the first read is out: they go together in one second read, and
    /// each gets its own id's flag.
    #[tokio::test]
    async fn asks_made_while_a_read_is_out_share_the_next_read() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let seen = Arc::new(Mutex::new(vec![]));
        let reads = Arc::new(CancelReads::new(held_reader(gate.clone(), seen.clone())));
        let first = tokio::spawn({
            let r = reads.clone();
            async move { r.ask("a0".into()).await }
        });
        until(|| lock(&seen).len() == 1).await;
        let mut later = vec![];
        for i in 0..10 {
            let r = reads.clone();
            let id = if i % 3 == 0 {
                format!("c{i}")
            } else {
                format!("a{i}")
            };
            later.push((id.clone(), tokio::spawn(async move { r.ask(id).await })));
        }
        // Every later ask is queued before the first read comes back.
        until(|| reads.line.waiting() == 10).await;
        gate.add_permits(2);
        assert!(!first.await.expect("task").expect("answer"));
        for (id, t) in later {
            let found = t.await.expect("task").expect("answer");
            assert_eq!(found, id.starts_with('c'), "{id}");
        }
        let seen = lock(&seen).clone();
        assert_eq!(
            seen.len(),
            2,
            "one read for the first ask, one for the rest: {seen:?}"
        );
        assert_eq!(seen[1].len(), 10);
        assert!(
            reads.line.senders() == 0,
            "no reader left once every ask is answered"
        );
    }

    /// A failed read answers its ask with the read's error (a healing one heals), and
    /// the next ask sends a read again.
    #[tokio::test]
    async fn a_failed_read_answers_its_ask_with_the_error_and_the_next_ask_reads_again() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let read: ReadMarkers = Arc::new(move |ids: Vec<String>| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if n == 0 {
                    Err(QueueError::Timeout(Duration::from_secs(1)))
                } else {
                    Ok(vec![true; ids.len()])
                }
            })
        });
        let reads = Arc::new(CancelReads::new(read));
        let e = reads.ask("x".into()).await.expect_err("the read failed");
        assert!(e.heals(), "{e}");
        assert!(reads.ask("x".into()).await.expect("second read"));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    /// A reader that panics answers its asks with a healing error, and the next ask
    /// starts a reader again (nothing waits forever).
    #[tokio::test]
    async fn a_reader_that_panics_leaves_no_ask_waiting() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let read: ReadMarkers = Arc::new(move |_ids: Vec<String>| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                assert!(n > 0, "the first read panics");
                Ok(vec![false])
            })
        });
        let reads = Arc::new(CancelReads::new(read));
        let e = tokio::time::timeout(Duration::from_secs(5), reads.ask("x".into()))
            .await
            .expect("answered")
            .expect_err("its reader panicked");
        assert!(e.heals(), "{e}");
        let again = tokio::time::timeout(Duration::from_secs(5), reads.ask("x".into()))
            .await
            .expect("answered");
        assert!(!again.expect("the second read"));
    }

    /// A pool error that cannot heal (the pool's new connection refused: WRONGPASS after
    /// a password rotation) reaches each ask as one that cannot heal: the job fails
    /// without a call, as it did when each task read alone.
    #[tokio::test]
    async fn a_pool_error_that_cannot_heal_stays_so_for_each_ask() {
        let read: ReadMarkers = Arc::new(|_ids: Vec<String>| {
            Box::pin(async {
                let refused = redis::RedisError::from((
                    redis::ErrorKind::AuthenticationFailed,
                    "WRONGPASS invalid username-password pair",
                ));
                Err(QueueError::Pool(deadpool_redis::PoolError::Backend(
                    refused,
                )))
            })
        });
        let reads = Arc::new(CancelReads::new(read));
        let e = reads.ask("x".into()).await.expect_err("refused");
        assert!(!e.heals(), "{e}");
        assert!(e.to_string().contains("WRONGPASS"), "{e}");
    }

    /// A reader dropped before its first poll (spawned while the runtime shuts down)
    /// still ends its role: the asks it held are dropped (their askers retry) and the
    /// next ask starts a reader again.
    #[tokio::test]
    async fn a_reader_dropped_before_it_ran_leaves_no_ask_waiting() {
        let read: ReadMarkers =
            Arc::new(|ids: Vec<String>| Box::pin(async move { Ok(vec![false; ids.len()]) }));
        let reads = Arc::new(CancelReads::new(read));
        let (rx, role) = reads.line.join("x".into());
        let role = role.expect("the first ask takes the reading role");
        drop(CancelReads::serve(reads.clone(), role));
        let held = tokio::time::timeout(Duration::from_secs(5), rx).await;
        assert!(
            held.is_ok_and(|r| r.is_err()),
            "the held ask is dropped, not left waiting"
        );
        assert!(reads.line.senders() == 0);
        let again = tokio::time::timeout(Duration::from_secs(5), reads.ask("x".into()))
            .await
            .expect("answered");
        assert!(!again.expect("a new reader's read"));
    }

    /// A read answering a wrong number of flags answers no ask with a flag.
    #[tokio::test]
    async fn a_read_with_too_few_flags_answers_with_an_error() {
        let read: ReadMarkers = Arc::new(|_ids: Vec<String>| Box::pin(async { Ok(vec![]) }));
        let reads = Arc::new(CancelReads::new(read));
        let e = reads.ask("x".into()).await.expect_err("no flag for x");
        assert!(e.to_string().contains("0 flags for 1"), "{e}");
    }
}
