//! systemd's service notifications for `Type=notify` units: `READY=1` once the consumer
//! group exists and jobs are being taken, `STOPPING=1` when the drain begins, `STATUS=`
//! lines (jobs in flight, draining), and `WATCHDOG=1` pings while the reader loop is
//! alive when the unit sets `WatchdogSec`. All of it is a no-op when the process is not
//! run by systemd (no `NOTIFY_SOCKET`).
//!
//! Invariant: a failure to notify is logged at debug and never stops the worker (the
//! service manager then only sees less).

use crate::state::WorkerState;
use sd_notify::NotifyState;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!(error = %e, "systemd notification not sent");
    }
}

/// `READY=1` with a status line.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// `STOPPING=1` with a status line.
pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// A `STATUS=` line.
pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

/// Until `stop`: `READY=1` the first time the worker takes jobs, then every 5 s a
/// `STATUS=` line (jobs in flight), and, when the unit sets `WatchdogSec`, `WATCHDOG=1`
/// every half of it while the reader loop has beaten within that half (a reader that
/// hangs stops the pings; systemd then restarts the service).
pub fn spawn(state: Arc<WorkerState>, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if std::env::var_os("NOTIFY_SOCKET").is_none() {
            return;
        }
        let watchdog = sd_notify::watchdog_enabled();
        let tick = watchdog
            .map(|w| (w / 2).max(Duration::from_millis(50)))
            .unwrap_or(Duration::from_secs(5))
            .min(Duration::from_secs(5));
        let mut ready = false;
        let mut last_status = tokio::time::Instant::now();
        loop {
            if !ready && state.ready() {
                ready = true;
                ready_now(&state);
            }
            if let Some(w) = watchdog
                && state.reader_beat_age() < w / 2
            {
                send(&[NotifyState::Watchdog]);
            }
            if ready && last_status.elapsed() >= Duration::from_secs(5) {
                last_status = tokio::time::Instant::now();
                status(&format!("taking jobs; {} in flight", in_flight(&state)));
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(if ready { tick } else { tick.min(Duration::from_millis(50)) }) => {}
            }
        }
    })
}

fn in_flight(state: &WorkerState) -> usize {
    state.in_flight.load(std::sync::atomic::Ordering::SeqCst)
}

fn ready_now(state: &WorkerState) {
    ready(&format!("taking jobs; {} in flight", in_flight(state)));
}
