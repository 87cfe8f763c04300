//! The one lock helper: the crate's `std::sync::Mutex`es guard plain data (tables, counters,
//! options) that stays valid even if a holder panicked, so a poisoned lock is recovered
//! rather than spreading the panic (a panic must not take the worker or the sim down).
//!
//! Invariant: no lock is held across an `.await`.

use std::sync::{Mutex, MutexGuard};

/// The hash maps of a job's path (entry ids, job ids, model and pool names): several
/// lookups per job, each of a short string, where std's SipHash cost more than the
/// lookups themselves. foldhash (hashbrown's own default) with a random seed per map:
/// not hardened like SipHash, so only for maps whose size the worker bounds (the jobs
/// it holds, the last few thousand entries it settled) or its config sets; a map an
/// outsider could fill with chosen keys at will keeps std's hasher.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// The set of [`FastMap`].
pub type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

/// Locks `m`, recovering it if a holder panicked.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
