//! Operations HTTP: `/health` (200 while the process runs), `/ready` (200 only while
//! Redis answers and jobs are being taken), `/metrics` (Prometheus text).
//!
//! Invariant: knows no job logic; it only reads [`WorkerState`] and renders metrics.
//! Nothing here prints configuration or environment.

use crate::state::WorkerState;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
struct AppState {
    worker: Arc<WorkerState>,
    prom: Option<PrometheusHandle>,
}

pub fn router(worker: Arc<WorkerState>, prom: Option<PrometheusHandle>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .route("/metrics", get(render_metrics))
        .with_state(AppState { worker, prom })
}

async fn ready(State(s): State<AppState>) -> (StatusCode, &'static str) {
    if s.worker.ready() {
        (StatusCode::OK, "ready\n")
    } else if !s
        .worker
        .taking_jobs
        .load(std::sync::atomic::Ordering::SeqCst)
    {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not taking jobs (starting or draining)\n",
        )
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "redis unreachable\n")
    }
}

async fn render_metrics(State(s): State<AppState>) -> String {
    with_usd(s.prom.as_ref().map(|h| h.render()).unwrap_or_default())
}

/// Adds `llm_worker_cost_usd_total{model}` to a rendered scrape, derived from
/// `llm_worker_cost_picodollars_total{model}` (value / 10^12). Why derived: the metrics
/// crate's counters are integers, and exact cost is kept in whole pico-dollars (prices
/// have at most 6 decimals per million tokens); Prometheus counters are floats, so USD is
/// what dashboards want. Invariant: both series always show the same spend.
fn with_usd(mut text: String) -> String {
    const PICOS: &str = "llm_worker_cost_picodollars_total";
    let usd: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix(PICOS))
        .filter(|rest| rest.starts_with(['{', ' ']))
        .filter_map(|rest| {
            let (labels, v) = rest.rsplit_once(' ')?;
            let picos: u64 = v.parse().ok()?;
            Some(format!(
                "llm_worker_cost_usd_total{labels} {}\n",
                picos as f64 / 1e12
            ))
        })
        .collect();
    if usd.is_empty() {
        return text;
    }
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str("# HELP llm_worker_cost_usd_total What billed calls cost, in USD (llm_worker_cost_picodollars_total / 1e12).\n");
    text.push_str("# TYPE llm_worker_cost_usd_total counter\n");
    for l in usd {
        text.push_str(&l);
    }
    text
}

/// Serves on an already-bound listener until `shutdown` fires (tests bind 127.0.0.1:0).
pub async fn serve(
    listener: tokio::net::TcpListener,
    worker: Arc<WorkerState>,
    prom: Option<PrometheusHandle>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(worker, prom))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// Histogram buckets for LLM latencies (a call, a job): 100 ms to 5 min.
pub const LLM_SECONDS: [f64; 12] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];
/// Histogram buckets for a slot wait: mostly milliseconds, up to 5 min.
pub const WAIT_SECONDS: [f64; 13] = [
    0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Buckets of `llm_worker_commit_batch_jobs` (jobs per commit call, at most 32).
const BATCH_JOBS: [f64; 6] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];

/// The Prometheus exporter's builder: every histogram with buckets (they aggregate
/// across a fleet of pods; a summary's quantiles do not): every `*_seconds` metric, and
/// `llm_worker_commit_batch_jobs`.
pub fn metrics_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    use metrics_exporter_prometheus::Matcher;
    let b = metrics_exporter_prometheus::PrometheusBuilder::new();
    let b = b
        .set_buckets_for_metric(
            Matcher::Full("llm_worker_slot_wait_seconds".into()),
            &WAIT_SECONDS,
        )
        .expect("non-empty buckets")
        .set_buckets_for_metric(
            Matcher::Full("llm_worker_commit_batch_jobs".into()),
            &BATCH_JOBS,
        )
        .expect("non-empty buckets");
    b.set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LLM_SECONDS)
        .expect("non-empty buckets")
}

#[cfg(test)]
mod tests {
    use super::with_usd;

    /// Every histogram the worker records renders with buckets, never as a summary:
    /// `llm_worker_commit_batch_jobs` (recorded only when a commit call carries several
    /// jobs) once rendered as one (`quantile=`), and tests/observability.rs failed when
    /// a run happened to batch.
    #[test]
    fn recorded_histograms_render_as_histograms() {
        let recorder = super::metrics_builder().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::histogram!("llm_worker_commit_batch_jobs").record(5.0);
            metrics::histogram!("llm_worker_commit_seconds").record(0.002);
            metrics::histogram!("llm_worker_job_seconds").record(0.1);
        });
        let text = handle.render();
        assert!(!text.contains("quantile="), "{text}");
        assert!(
            text.contains("llm_worker_commit_batch_jobs_bucket{le=\"8\"} 1"),
            "{text}"
        );
        assert!(text.contains("llm_worker_commit_seconds_bucket"), "{text}");
    }

    #[test]
    fn usd_series_follow_the_picodollar_counters() {
        let text = "# TYPE llm_worker_cost_picodollars_total counter\nllm_worker_cost_picodollars_total{model=\"a\"} 46900000\nllm_worker_cost_picodollars_total{model=\"b\"} 2500000000000\nllm_worker_cost_picodollars_total_other 5\nllm_worker_jobs_total 3";
        let out = with_usd(text.to_string());
        assert!(out.starts_with(text), "{out}");
        assert!(
            out.contains("# TYPE llm_worker_cost_usd_total counter\n"),
            "{out}"
        );
        assert!(
            out.contains("llm_worker_cost_usd_total{model=\"a\"} 0.0000469\n"),
            "{out}"
        );
        assert!(
            out.contains("llm_worker_cost_usd_total{model=\"b\"} 2.5\n"),
            "{out}"
        );
        assert_eq!(
            out.matches("llm_worker_cost_usd_total{").count(),
            2,
            "{out}"
        );
        let none = "llm_worker_jobs_total 3\n";
        assert_eq!(with_usd(none.to_string()), none);
    }
}
