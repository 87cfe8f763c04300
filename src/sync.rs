//! The one lock helper: the crate's `std::sync::Mutex`es guard plain data (tables, counters,
//! options) that stays valid even if a holder panicked, so a poisoned lock is recovered
//! rather than spreading the panic (a panic must not take the worker or the sim down).
//!
//! Invariant: no lock is held across an `.await`.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering it if a holder panicked.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
