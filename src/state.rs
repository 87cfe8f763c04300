//! The small state the worker publishes and the HTTP server reads (`/ready`, the drain
//! log): a room of its own so that `server` does not import `worker`.
//!
//! Invariant: plain atomics, written by the worker only, read by anyone.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Shared liveness/readiness facts, read by `/ready` and the drain log.
#[derive(Debug, Default)]
pub struct WorkerState {
    /// The reader is taking jobs (false before start and once draining).
    pub taking_jobs: AtomicBool,
    /// The last Redis operation of the reader succeeded.
    pub redis_ok: AtomicBool,
    /// Job tasks running now.
    pub in_flight: AtomicUsize,
}

impl WorkerState {
    pub fn ready(&self) -> bool {
        self.taking_jobs.load(Ordering::SeqCst) && self.redis_ok.load(Ordering::SeqCst)
    }
}
