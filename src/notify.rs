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

/// `STOPPING=1` with a status line, and `EXTEND_TIMEOUT_USEC` = `drain`: systemd waits
/// that long for the exit from now, whatever the unit's `TimeoutStopSec` (so a grace raised
/// in the config is never cut short by a unit written for the default).
pub fn stopping(status: &str, drain: Duration) {
    let usec = u32::try_from(drain.as_micros()).unwrap_or(u32::MAX);
    send(&[
        NotifyState::Stopping,
        NotifyState::Status(status),
        NotifyState::ExtendTimeoutUsec(usec),
    ]);
}

/// A `STATUS=` line.
pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

/// Until `stop`: `READY=1` the first time the worker takes jobs, then every 5 s a
/// `STATUS=` line (jobs in flight) until `draining`, and, when the unit sets
/// `WatchdogSec`, `WATCHDOG=1` every half of it while the reader loop has beaten within
/// that half (a reader that hangs stops the pings; systemd then restarts the service).
/// `longest_round`: the longest a healthy reader loop may take between beats (its
/// blocking read plus its bound); a `WatchdogSec` under twice that is logged as too short.
pub fn spawn(
    state: Arc<WorkerState>,
    draining: CancellationToken,
    stop: CancellationToken,
    longest_round: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if std::env::var_os("NOTIFY_SOCKET").is_none() {
            return;
        }
        let watchdog = sd_notify::watchdog_enabled();
        if let Some(w) = watchdog
            && w < longest_round * 4
        {
            tracing::warn!(
                watchdog_sec = w.as_secs_f64(),
                at_least = (longest_round * 4).as_secs_f64(),
                "WatchdogSec is shorter than four rounds of the reader loop (queue.block_ms + 2 s each): systemd may restart a healthy worker; raise it"
            );
        }
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
            if ready && !draining.is_cancelled() && last_status.elapsed() >= Duration::from_secs(5)
            {
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
