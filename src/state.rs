//! The small state the worker publishes and the HTTP server reads (`/ready`, the drain
//! log): a room of its own so that `server` does not import `worker`.
//!
//! Invariant: plain atomics, written by the worker only, read by anyone.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Shared liveness/readiness facts, read by `/ready` and the drain log.
#[derive(Debug, Default)]
pub struct WorkerState {
    /// The reader is taking jobs (false before start and once draining).
    pub taking_jobs: AtomicBool,
    /// The last Redis operation of the reader succeeded.
    pub redis_ok: AtomicBool,
    /// Job tasks running now.
    pub in_flight: AtomicUsize,
    /// When the reader loop last went round (ms since [`epoch`]); the systemd watchdog
    /// pings only while it is recent.
    pub reader_beat_ms: AtomicU64,
}

/// The process's reference instant for [`WorkerState::reader_beat_ms`].
fn epoch() -> tokio::time::Instant {
    static EPOCH: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(tokio::time::Instant::now)
}

impl WorkerState {
    /// The reader loop is alive now.
    pub fn beat(&self) {
        let ms = epoch().elapsed().as_millis() as u64;
        self.reader_beat_ms.store(ms.max(1), Ordering::SeqCst);
    }

    /// How long ago the reader loop last went round (`Duration::MAX` before it ever did).
    pub fn reader_beat_age(&self) -> std::time::Duration {
        match self.reader_beat_ms.load(Ordering::SeqCst) {
            0 => std::time::Duration::MAX,
            ms => epoch()
                .elapsed()
                .saturating_sub(std::time::Duration::from_millis(ms)),
        }
    }

    pub fn ready(&self) -> bool {
        self.taking_jobs.load(Ordering::SeqCst) && self.redis_ok.load(Ordering::SeqCst)
    }
}
