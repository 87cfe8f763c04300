//! Simulated OpenAI-compatible chat-completion provider.
//!
//! Used by the demo, the integration tests and the benchmarks, so that the worker can be
//! exercised end to end without network access, API keys or cost. It listens on loopback
//! only (unless the `sim-provider` subcommand is explicitly told otherwise) and answers
//! `POST /v1/chat/completions` like a real provider would, with:
//!
//! - **deterministic usage**: [`estimate_prompt_tokens`] and [`completion_tokens_for`] are
//!   public so a test can predict exactly what the worker must bill;
//! - **configurable latency** (base + per-model override + uniform jitter), kept to within a
//!   fraction of a millisecond ([`clock`]), spent while the call is counted in flight, so
//!   concurrency limits are observable through [`SimStats`];
//! - **fault injection** through [`Rule`]s ([`Fault`]: 429 with `Retry-After`, 5xx, context
//!   length, hangs, malformed 200 bodies...), each with a probability and an optional
//!   "first n calls only" limit, so retry and fallback paths can be tested deterministically;
//! - **runtime control** over HTTP (`GET/PUT /options`, `GET /stats`, `POST /stats/reset`)
//!   for tests that run the sim as a separate process.
//!
//! State is behind `std::sync::Mutex`es that are never held across an `.await`; a poisoned
//! lock is recovered (`into_inner`) because the data it guards (counters, options) stays
//! valid even if a holder panicked, and the sim must keep answering.
//!
//! Rooms: [`options`] (what the sim does: latency, fault rules), [`stats`] (what it saw),
//! [`tokens`] (the deterministic token counts tests predict), [`handlers`] (the HTTP
//! routes), [`cli`] (the `sim-provider` subcommand), [`clock`] (the latency's timer); this
//! file holds the shared state.

mod cli;
mod clock;
mod handlers;
mod options;
mod stats;
mod tokens;

pub use cli::{SimArgs, SimError, options_from_args, run_cli};
use handlers::{chat_completions, get_options, get_stats, list_models, put_options, reset_stats};
pub use options::{Fault, Rule, SimOptions};
pub use stats::{Billed, SimStats};
pub use tokens::{completion_tokens_for, estimate_prompt_tokens};

use crate::sync::lock;
use axum::Router;
use axum::routing::{get, post};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Request header carrying the worker's job id; counted in [`SimStats::calls_per_job`] so
/// tests can check how many provider calls (retries, fallbacks) one job cost.
pub const JOB_HEADER: &str = "x-llm-worker-job";

/// How long a [`Fault::Hang`] call sleeps at most when the server is not shut down first.
pub(super) const HANG_MAX: Duration = Duration::from_secs(3600);

/// Key used in [`SimStats::requests`] for requests whose body had no usable `model`.
pub const INVALID_MODEL_KEY: &str = "<invalid>";

/// Mutable state guarded by one lock so that stats stay mutually consistent.
#[derive(Default)]
pub(super) struct Shared {
    stats: SimStats,
    /// Current in-flight count per model (stats only keep the maxima).
    in_flight_per_model: HashMap<String, u64>,
    /// (rule index, model) -> calls seen, for `first_n`.
    rule_calls: HashMap<(usize, String), u64>,
}

pub(super) struct Inner {
    opts: Mutex<SimOptions>,
    state: Mutex<Shared>,
    seq: AtomicU64,
    /// Cancelled by [`Sim::serve`] on shutdown so that hanging calls end and graceful
    /// shutdown does not wait an hour; replaced afterwards so a re-served sim hangs again.
    hang_release: Mutex<CancellationToken>,
}

/// The simulated provider. Cheap to clone: all clones share options and stats.
#[derive(Clone)]
pub struct Sim {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("options", &self.options())
            .finish_non_exhaustive()
    }
}

/// Decrements in-flight counters when dropped, so calls cancelled by the client (timeout,
/// abort, hang) are accounted for exactly like completed ones.
pub(super) struct InFlightGuard {
    inner: Arc<Inner>,
    model: String,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let mut st = lock(&self.inner.state);
        st.stats.in_flight = st.stats.in_flight.saturating_sub(1);
        if let Some(n) = st.in_flight_per_model.get_mut(&self.model) {
            *n = n.saturating_sub(1);
        }
    }
}

impl Sim {
    pub fn new(opts: SimOptions) -> Sim {
        Sim {
            inner: Arc::new(Inner {
                opts: Mutex::new(opts),
                state: Mutex::new(Shared::default()),
                seq: AtomicU64::new(0),
                hang_release: Mutex::new(CancellationToken::new()),
            }),
        }
    }

    /// Replace the options at runtime. Resets the `first_n` counters, because rule indices
    /// of the old and new rule lists are unrelated.
    pub fn set_options(&self, opts: SimOptions) {
        *lock(&self.inner.opts) = opts;
        lock(&self.inner.state).rule_calls.clear();
    }

    pub fn options(&self) -> SimOptions {
        lock(&self.inner.opts).clone()
    }

    pub fn stats(&self) -> SimStats {
        lock(&self.inner.state).stats.clone()
    }

    /// Zero every counter except `in_flight`, which reflects calls still running (their
    /// guards will decrement it later); `max_in_flight` restarts from the current value.
    pub fn reset_stats(&self) {
        let mut st = lock(&self.inner.state);
        let in_flight = st.stats.in_flight;
        st.stats = SimStats {
            in_flight,
            max_in_flight: in_flight,
            ..SimStats::default()
        };
        let per_model: Vec<(String, u64)> = st
            .in_flight_per_model
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(m, n)| (m.clone(), *n))
            .collect();
        st.stats.max_in_flight_per_model.extend(per_model);
    }

    /// All routes: `POST /v1/chat/completions`, `GET /v1/models`, `GET /stats`,
    /// `POST /stats/reset`, `GET /options`, `PUT /options`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(list_models))
            .route("/stats", get(get_stats))
            .route("/stats/reset", post(reset_stats))
            .route("/options", get(get_options).put(put_options))
            .with_state(self.clone())
    }

    /// Serve on an already-bound listener until `shutdown` resolves (tests bind
    /// 127.0.0.1:0). On shutdown, hanging calls are released (answered 503) so the
    /// graceful shutdown completes promptly.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let app = self.router();
        let inner = self.inner.clone();
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                shutdown.cancelled().await;
                let mut tok = lock(&inner.hang_release);
                tok.cancel();
                *tok = CancellationToken::new();
            })
            .await
    }

    /// Convenience for tests/demo: bind 127.0.0.1:0, spawn [`Sim::serve`], return the bound
    /// address (base URL is `format!("http://{addr}/v1")`).
    pub async fn spawn(
        opts: SimOptions,
        shutdown: CancellationToken,
    ) -> std::io::Result<(Sim, SocketAddr)> {
        let listener = bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let sim = Sim::new(opts);
        let server = sim.clone();
        tokio::spawn(async move {
            if let Err(e) = server.serve(listener, shutdown).await {
                tracing::error!(error = %e, %addr, "sim provider stopped with an error");
            }
        });
        Ok((sim, addr))
    }

    fn record_status(&self, model: &str, status: u16) {
        let mut st = lock(&self.inner.state);
        *st.stats
            .requests
            .entry(model.to_string())
            .or_default()
            .entry(status)
            .or_default() += 1;
    }

    fn record_billed(&self, model: &str, prompt: u64, completion: u64, cached: u64) {
        let mut st = lock(&self.inner.state);
        let b = st.stats.billed.entry(model.to_string()).or_default();
        b.prompt_tokens += prompt;
        b.completion_tokens += completion;
        b.cached_tokens += cached;
        b.responses += 1;
    }

    fn enter(&self, model: &str) -> InFlightGuard {
        let mut st = lock(&self.inner.state);
        st.stats.in_flight += 1;
        st.stats.max_in_flight = st.stats.max_in_flight.max(st.stats.in_flight);
        let n = st.in_flight_per_model.entry(model.to_string()).or_default();
        *n += 1;
        let n = *n;
        let max = st
            .stats
            .max_in_flight_per_model
            .entry(model.to_string())
            .or_default();
        *max = (*max).max(n);
        InFlightGuard {
            inner: self.inner.clone(),
            model: model.to_string(),
        }
    }

    /// First rule that fires for `model`, updating `first_n` counters.
    fn pick_fault(&self, rules: &[Rule], model: &str) -> Option<Fault> {
        let mut st = lock(&self.inner.state);
        for (i, rule) in rules.iter().enumerate() {
            if rule.model != "*" && rule.model != model {
                continue;
            }
            let seen = st.rule_calls.entry((i, model.to_string())).or_default();
            if let Some(n) = rule.first_n
                && *seen >= n
            {
                continue;
            }
            *seen += 1;
            let p = if rule.probability.is_nan() {
                0.0
            } else {
                rule.probability.clamp(0.0, 1.0)
            };
            if rand::random_bool(p) {
                return Some(rule.fault.clone());
            }
        }
        None
    }
}

/// Pending connections the simulated provider's listener queues before it accepts them
/// (the kernel caps it at `net.core.somaxconn`, 4096 on current kernels).
///
/// Why not `TcpListener::bind`'s backlog (128: 129 of 2,000 simultaneous connections got
/// through): a worker with 1,000 slots opens about 1,000 connections at once when it
/// starts; whatever overflows the accept queue has its SYN dropped and sent again a
/// second later, so a few dozen to hundreds of calls started 1 s late (the kernel's
/// `ListenOverflows`), and the benchmark's slot use at N=1,000 measured that second
/// rather than the worker.
pub const LISTEN_BACKLOG: u32 = 8192;

/// Binds the simulated provider's listener on the first address `addr` resolves to,
/// with [`LISTEN_BACKLOG`].
pub async fn bind(
    addr: impl tokio::net::ToSocketAddrs,
) -> std::io::Result<tokio::net::TcpListener> {
    let addr = tokio::net::lookup_host(addr).await?.next().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolves to nothing",
        )
    })?;
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As tokio's own bind does: a restarted simulator may take its port back at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

#[cfg(test)]
mod tests {
    use super::tokens::fnv1a;
    use super::*;
    use serde_json::json;

    /// 2,000 connections at once, none accepted yet: every one completes its handshake
    /// (waits in the accept queue), none has its SYN dropped and sent again a second
    /// later. With `TcpListener::bind`'s backlog (128) 1,871 of them waited that second.
    #[tokio::test]
    async fn a_burst_of_connections_waits_in_the_accept_queue_none_is_dropped() {
        let listener = bind((std::net::Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..2000 {
            tasks.spawn(async move {
                tokio::time::timeout(
                    std::time::Duration::from_millis(700),
                    tokio::net::TcpStream::connect(addr),
                )
                .await
            });
        }
        let (mut ok, mut late) = (0, 0);
        let mut held = Vec::new();
        while let Some(r) = tasks.join_next().await {
            match r.unwrap() {
                Ok(Ok(stream)) => {
                    ok += 1;
                    held.push(stream);
                }
                Ok(Err(e)) => panic!("connect failed: {e}"),
                Err(_) => late += 1,
            }
        }
        assert_eq!(
            (ok, late),
            (2000, 0),
            "connections not through the handshake within 700 ms (a dropped SYN is sent \
             again after 1 s)"
        );
        drop(listener);
    }

    #[test]
    fn prompt_tokens_string_and_parts() {
        let body = json!({"model":"m","messages":[
            {"role":"system","content":"abcd"},          // 4 + 1
            {"role":"user","content":"abcde"},           // 4 + 2
            {"role":"user","content":[{"type":"text","text":"ab"},{"type":"image_url","image_url":{}},{"type":"text","text":"cde"}]}, // 4 + 2
            {"role":"assistant","content":null}          // 4 + 0
        ]});
        assert_eq!(estimate_prompt_tokens(&body), 5 + 6 + 6 + 4);
        assert_eq!(estimate_prompt_tokens(&json!({})), 0);
    }

    #[test]
    fn prompt_tokens_count_chars_not_bytes() {
        let body = json!({"messages":[{"role":"user","content":"ééééé"}]});
        assert_eq!(estimate_prompt_tokens(&body), 4 + 2);
    }

    #[test]
    fn completion_tokens_deterministic_and_capped() {
        let a = json!({"messages":[{"role":"user","content":"hello"}]});
        let n = completion_tokens_for(&a);
        assert!((8..128).contains(&n));
        assert_eq!(n, completion_tokens_for(&a));
        let capped = json!({"messages":[{"role":"user","content":"hello"}],"max_tokens":3});
        assert_eq!(completion_tokens_for(&capped), n.min(3));
        let zero = json!({"messages":[{"role":"user","content":"hello"}],"max_completion_tokens":0,"max_tokens":50});
        assert_eq!(completion_tokens_for(&zero), 1);
    }

    #[test]
    fn fnv1a_known_vector() {
        assert_eq!(fnv1a(*b"a", 0xcbf2_9ce4_8422_2325), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn options_serde_defaults() {
        let o: SimOptions = serde_json::from_str(
            r#"{"latency_ms":5,"rules":[{"model":"*","fault":{"kind":"rate_limit","retry_after":"1"}},
                {"model":"m","fault":{"kind":"status","status":503},"probability":0.5,"first_n":2},
                {"model":"m","fault":{"kind":"hang"}}]}"#,
        )
        .expect("parse");
        assert_eq!(o.latency_ms, 5);
        assert_eq!(o.jitter_ms, 0);
        assert_eq!(o.rules[0].probability, 1.0);
        assert!(matches!(
            o.rules[0].fault,
            Fault::RateLimit { ref retry_after, retry_after_ms: None } if retry_after.as_deref() == Some("1")
        ));
        assert!(matches!(o.rules[1].fault, Fault::Status { status: 503 }));
        assert_eq!(o.rules[1].first_n, Some(2));
        assert!(matches!(o.rules[2].fault, Fault::Hang));
    }

    #[test]
    fn first_n_and_model_matching() {
        let sim = Sim::new(SimOptions {
            rules: vec![Rule {
                model: "m".into(),
                fault: Fault::Status { status: 500 },
                probability: 1.0,
                first_n: Some(2),
            }],
            ..SimOptions::default()
        });
        let rules = sim.options().rules;
        assert!(sim.pick_fault(&rules, "other").is_none());
        assert!(sim.pick_fault(&rules, "m").is_some());
        assert!(sim.pick_fault(&rules, "m").is_some());
        assert!(sim.pick_fault(&rules, "m").is_none());
        sim.set_options(sim.options());
        assert!(sim.pick_fault(&rules, "m").is_some());
    }

    #[test]
    fn cli_options() {
        let args = SimArgs {
            listen: "127.0.0.1:0".into(),
            latency_ms: 7,
            jitter_ms: 0,
            rules: Some(r#"[{"model":"x","fault":{"kind":"garbage"}}]"#.into()),
            options_file: None,
        };
        let o = options_from_args(&args).expect("options");
        assert_eq!(o.latency_ms, 7);
        assert_eq!(o.rules.len(), 1);
        let bad = SimArgs {
            rules: Some("[{".into()),
            ..args
        };
        let err = options_from_args(&bad).expect_err("bad json");
        assert!(err.to_string().contains("--rules"));
    }
}
