//! Signals -> cancellation. One function waits for SIGTERM/SIGINT and drives two tokens:
//! `stop` (stop taking jobs, drain) on the first signal, and `abort` (cancel what is still
//! running) when the grace period ends or on a second signal.
//!
//! Invariant: this module knows nothing of jobs, Redis or HTTP.

use futures::StreamExt;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook_tokio::Signals;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    /// First signal: stop taking jobs, let in-flight ones finish.
    pub stop: CancellationToken,
    /// Grace over (or second signal): cancel in-flight jobs (the worker hands them back).
    pub abort: CancellationToken,
}

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Starts the drain: `stop` now, `abort` after `grace` unless already fired.
    pub fn begin(&self, grace: Duration) {
        if self.stop.is_cancelled() {
            return;
        }
        self.stop.cancel();
        let abort = self.abort.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(grace) => {
                    tracing::warn!(grace_ms = grace.as_millis() as u64, "grace period over; cancelling jobs still in flight (they are handed back)");
                    abort.cancel();
                }
                _ = abort.cancelled() => {}
            }
        });
    }

    /// Installs the signal handlers and returns at once; the returned task ends after
    /// the second signal (or never). `stopping` is what the first signal's log line says
    /// happens next (the worker drains jobs; the simulated provider just stops).
    pub fn listen_for_signals(
        &self,
        grace: Duration,
        stopping: &'static str,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        // SIGTERM: what systemd and Kubernetes send to stop a service.
        // SIGINT: Ctrl-C from a person running the worker in a terminal.
        let mut signals = Signals::new([SIGTERM, SIGINT])?;
        let me = self.clone();
        Ok(tokio::spawn(async move {
            let mut seen = 0;
            while let Some(sig) = signals.next().await {
                seen += 1;
                let name = if sig == SIGTERM { "SIGTERM" } else { "SIGINT" };
                if seen == 1 {
                    tracing::info!(
                        signal = name,
                        grace_ms = grace.as_millis() as u64,
                        "{stopping}"
                    );
                    me.begin(grace);
                } else {
                    tracing::warn!(signal = name, "second signal: skipping the grace period");
                    me.stop.cancel();
                    me.abort.cancel();
                    return;
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::Shutdown;
    use std::time::Duration;
    use tokio::time::Instant;

    /// The drain sequence in paused time: `stop` at once, `abort` exactly when the grace
    /// ends, not a tick earlier.
    #[tokio::test(start_paused = true)]
    async fn abort_fires_exactly_at_the_end_of_the_grace() {
        let s = Shutdown::new();
        let t0 = Instant::now();
        s.begin(Duration::from_secs(25));
        assert!(s.stop.is_cancelled(), "stop fires at once");
        assert!(!s.abort.is_cancelled());
        tokio::time::sleep(Duration::from_millis(24_999)).await;
        assert!(!s.abort.is_cancelled(), "no abort before the grace ends");
        tokio::time::timeout(Duration::from_secs(1), s.abort.cancelled())
            .await
            .expect("abort at the end of the grace");
        assert_eq!(t0.elapsed(), Duration::from_secs(25));
    }

    /// A second `begin` (a repeated drain request) neither restarts nor extends the grace.
    #[tokio::test(start_paused = true)]
    async fn a_second_begin_does_not_restart_the_grace() {
        let s = Shutdown::new();
        let t0 = Instant::now();
        s.begin(Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(6)).await;
        s.begin(Duration::from_secs(10));
        tokio::time::timeout(Duration::from_secs(30), s.abort.cancelled())
            .await
            .expect("abort");
        assert_eq!(t0.elapsed(), Duration::from_secs(10));
    }

    /// A second signal cancels `abort` early; the grace timer then ends without effect.
    #[tokio::test(start_paused = true)]
    async fn early_abort_skips_the_rest_of_the_grace() {
        let s = Shutdown::new();
        let t0 = Instant::now();
        s.begin(Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(2)).await;
        s.abort.cancel();
        s.abort.cancelled().await;
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(s.stop.is_cancelled() && s.abort.is_cancelled());
    }
}
