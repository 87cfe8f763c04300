//! Simulated OpenAI-compatible chat-completion provider.
//!
//! Used by the demo, the integration tests and the benchmarks, so that the worker can be
//! exercised end to end without network access, API keys or cost. It listens on loopback
//! only (unless the `sim-provider` subcommand is explicitly told otherwise) and answers
//! `POST /v1/chat/completions` like a real provider would, with:
//!
//! - **deterministic usage**: [`estimate_prompt_tokens`] and [`completion_tokens_for`] are
//!   public so a test can predict exactly what the worker must bill;
//! - **configurable latency** (base + per-model override + uniform jitter), spent while the
//!   call is counted in flight, so concurrency limits are observable through [`SimStats`];
//! - **fault injection** through [`Rule`]s ([`Fault`]: 429 with `Retry-After`, 5xx, context
//!   length, hangs, malformed 200 bodies...), each with a probability and an optional
//!   "first n calls only" limit, so retry and fallback paths can be tested deterministically;
//! - **runtime control** over HTTP (`GET/PUT /options`, `GET /stats`, `POST /stats/reset`)
//!   for tests that run the sim as a separate process.
//!
//! State is behind `std::sync::Mutex`es that are never held across an `.await`; a poisoned
//! lock is recovered (`into_inner`) because the data it guards (counters, options) stays
//! valid even if a holder panicked, and the sim must keep answering.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Request header carrying the worker's job id; counted in [`SimStats::calls_per_job`] so
/// tests can check how many provider calls (retries, fallbacks) one job cost.
pub const JOB_HEADER: &str = "x-llm-worker-job";

/// How long a [`Fault::Hang`] call sleeps at most when the server is not shut down first.
const HANG_MAX: Duration = Duration::from_secs(3600);

/// Key used in [`SimStats::requests`] for requests whose body had no usable `model`.
pub const INVALID_MODEL_KEY: &str = "<invalid>";

fn one() -> f64 {
    1.0
}

/// Behaviour of the simulated provider. Replaceable at runtime ([`Sim::set_options`] or
/// `PUT /options`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SimOptions {
    /// Base latency of every call, in milliseconds.
    #[serde(default)]
    pub latency_ms: u64,
    /// Added to the latency: uniform random `0..=jitter_ms`.
    #[serde(default)]
    pub jitter_ms: u64,
    /// Fault rules; the first one that fires for a call decides its answer.
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// Model -> context window; a request whose estimated prompt tokens exceed it gets
    /// 400 `context_length_exceeded`.
    #[serde(default)]
    pub context_windows: HashMap<String, u64>,
    /// Per-model override of `latency_ms` (jitter still applies).
    #[serde(default)]
    pub model_latency_ms: HashMap<String, u64>,
    /// 0..1: report `usage.prompt_tokens_details.cached_tokens = floor(prompt_tokens * fraction)`.
    #[serde(default)]
    pub cached_fraction: f64,
}

/// A fault-injection rule.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Rule {
    /// Exact model name, or `"*"` for every model.
    pub model: String,
    pub fault: Fault,
    /// 0..1 chance per call (clamped); default 1.
    #[serde(default = "one")]
    pub probability: f64,
    /// Only the first n calls to a model seen by this rule are candidates (counted per rule
    /// and per model, whether or not the probability roll fires). Counters restart when the
    /// options are replaced.
    #[serde(default)]
    pub first_n: Option<u64>,
}

/// What a firing [`Rule`] makes the sim answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// 429 `rate_limit_exceeded`, with `Retry-After: <retry_after>` (verbatim: seconds or an
    /// HTTP date) and/or `retry-after-ms` headers when given.
    RateLimit {
        #[serde(default)]
        retry_after: Option<String>,
        #[serde(default)]
        retry_after_ms: Option<u64>,
    },
    /// 429 with error code `insufficient_quota` (must not be retried like a rate limit).
    InsufficientQuota,
    /// Any status (500, 503, 529, 408, 401, 403, 404, 400...), body
    /// `{"error":{"message":"simulated <status>","type":...,"code":...}}`.
    Status { status: u16 },
    /// 400 with error code `context_length_exceeded`.
    ContextLength,
    /// Never answers: sleeps until the server shuts down (or one hour). Counted under
    /// status 0 when it starts.
    Hang,
    /// 200 with `"choices": []`.
    EmptyChoices,
    /// 200 whose body is `{"error":{...}}`.
    ErrorBody,
    /// 200 with a non-JSON body.
    Garbage,
    /// 200 with a JSON body cut in the middle.
    Truncated,
    /// 200 normal answer without `usage`.
    NoUsage,
}

/// Counters observed by the sim, for assertions in tests and benchmarks.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SimStats {
    /// Model -> HTTP status -> count. Hang counts under status 0 when it starts; requests
    /// without a usable model count under [`INVALID_MODEL_KEY`].
    pub requests: BTreeMap<String, BTreeMap<u16, u64>>,
    pub in_flight: u64,
    /// Most calls ever in flight at once (across all models).
    pub max_in_flight: u64,
    pub max_in_flight_per_model: BTreeMap<String, u64>,
    /// Model -> tokens reported in `usage` of every response that carried usage.
    pub billed: BTreeMap<String, Billed>,
    /// Value of request header `x-llm-worker-job` -> number of calls.
    pub calls_per_job: BTreeMap<String, u64>,
}

/// Tokens reported to the client for one model, summed over responses carrying usage.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Billed {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub responses: u64,
}

/// Mutable state guarded by one lock so that stats stay mutually consistent.
#[derive(Default)]
struct Shared {
    stats: SimStats,
    /// Current in-flight count per model (stats only keep the maxima).
    in_flight_per_model: HashMap<String, u64>,
    /// (rule index, model) -> calls seen, for `first_n`.
    rule_calls: HashMap<(usize, String), u64>,
}

struct Inner {
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

/// Recover a poisoned lock: the guarded counters/options are always valid values.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Decrements in-flight counters when dropped, so calls cancelled by the client (timeout,
/// abort, hang) are accounted for exactly like completed ones.
struct InFlightGuard {
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
        let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
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

/// Text of a message's `content`: a string, or the concatenated `text` of
/// `{"type":"text","text":...}` parts; anything else counts as empty.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

fn messages(body: &Value) -> &[Value] {
    body.get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

/// Deterministic prompt-token estimate: per message, 4 + ceil(chars(content) / 4).
/// Content may be a string or an array of `{"type":"text","text":...}` parts.
pub fn estimate_prompt_tokens(body: &Value) -> u64 {
    messages(body)
        .iter()
        .map(|m| {
            let chars = content_text(m.get("content")).chars().count() as u64;
            4 + chars.div_ceil(4)
        })
        .sum()
}

/// 64-bit FNV-1a: tiny, stable across platforms and Rust versions (unlike `DefaultHasher`),
/// which is what makes completion sizes predictable by tests.
fn fnv1a(bytes: impl IntoIterator<Item = u8>, mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Deterministic completion size: `8 + fnv1a(text of every message, each followed by a
/// 0 byte) % 120`, capped by `max_completion_tokens` (preferred) or `max_tokens`, min 1.
pub fn completion_tokens_for(body: &Value) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    for m in messages(body) {
        h = fnv1a(content_text(m.get("content")).into_bytes(), h);
        h = fnv1a([0u8], h);
    }
    let n = 8 + h % 120;
    let cap = body
        .get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| body.get("max_tokens").and_then(Value::as_u64));
    match cap {
        Some(c) => n.min(c).max(1),
        None => n,
    }
}

fn error_json(message: &str, typ: &str, code: &str) -> Value {
    json!({"error": {"message": message, "type": typ, "code": code, "param": null}})
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// `type`/`code` pairs close to what OpenAI-compatible providers send for each status.
fn status_error(status: u16) -> (&'static str, &'static str) {
    match status {
        400 => ("invalid_request_error", "invalid_request"),
        401 => ("authentication_error", "invalid_api_key"),
        403 => ("permission_error", "permission_denied"),
        404 => ("not_found_error", "model_not_found"),
        408 => ("timeout_error", "request_timeout"),
        429 => ("rate_limit_error", "rate_limit_exceeded"),
        503 => ("service_unavailable_error", "service_unavailable"),
        529 => ("overloaded_error", "overloaded"),
        _ => ("server_error", "server_error"),
    }
}

async fn chat_completions(State(sim): State<Sim>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(job) = headers.get(JOB_HEADER) {
        let job = String::from_utf8_lossy(job.as_bytes()).into_owned();
        *lock(&sim.inner.state)
            .stats
            .calls_per_job
            .entry(job)
            .or_default() += 1;
    }

    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            sim.record_status(INVALID_MODEL_KEY, 400);
            let msg = format!("invalid JSON body: {e}");
            return json_response(
                StatusCode::BAD_REQUEST,
                &error_json(&msg, "invalid_request_error", "invalid_request"),
            );
        }
    };
    let model = match req.get("model").and_then(Value::as_str) {
        Some(m) if !m.is_empty() => m.to_string(),
        _ => {
            sim.record_status(INVALID_MODEL_KEY, 400);
            return json_response(
                StatusCode::BAD_REQUEST,
                &error_json(
                    "missing or empty 'model'",
                    "invalid_request_error",
                    "invalid_request",
                ),
            );
        }
    };
    if !req.get("messages").is_some_and(Value::is_array) {
        sim.record_status(&model, 400);
        return json_response(
            StatusCode::BAD_REQUEST,
            &error_json(
                "missing 'messages' array",
                "invalid_request_error",
                "invalid_request",
            ),
        );
    }

    // Counted in flight from here; the guard decrements even if this future is dropped.
    let _guard = sim.enter(&model);
    let opts = sim.options();
    let fault = sim.pick_fault(&opts.rules, &model);

    if let Some(Fault::Hang) = fault {
        sim.record_status(&model, 0);
        let release = lock(&sim.inner.hang_release).clone();
        tokio::select! {
            _ = tokio::time::sleep(HANG_MAX) => {}
            _ = release.cancelled() => {}
        }
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &error_json(
                "simulated hang released",
                "service_unavailable_error",
                "service_unavailable",
            ),
        );
    }

    let base = opts
        .model_latency_ms
        .get(&model)
        .copied()
        .unwrap_or(opts.latency_ms);
    let jitter = if opts.jitter_ms > 0 {
        rand::random_range(0..=opts.jitter_ms)
    } else {
        0
    };
    let delay = base.saturating_add(jitter);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }

    let prompt = estimate_prompt_tokens(&req);
    let (status, resp) = match fault {
        Some(f) => fault_response(&sim, &req, &model, &opts, prompt, f),
        None => match opts.context_windows.get(&model) {
            Some(&window) if prompt > window => {
                (400, context_length_response(&model, window, prompt))
            }
            _ => {
                let (v, _) = success_body(&sim, &req, &model, &opts, prompt, true);
                (200, json_response(StatusCode::OK, &v))
            }
        },
    };
    sim.record_status(&model, status);
    resp
}

fn context_length_response(model: &str, window: u64, prompt: u64) -> Response {
    let msg = format!(
        "This model's maximum context length is {window} tokens. However, your messages \
         resulted in {prompt} tokens. Please reduce the length of the messages. (model {model})"
    );
    let mut v = error_json(&msg, "invalid_request_error", "context_length_exceeded");
    v["error"]["param"] = json!("messages");
    json_response(StatusCode::BAD_REQUEST, &v)
}

/// Builds the OpenAI-shaped 200 body and records billing when `usage` is included.
/// Returns the body and the completion tokens it reports.
fn success_body(
    sim: &Sim,
    req: &Value,
    model: &str,
    opts: &SimOptions,
    prompt: u64,
    with_usage: bool,
) -> (Value, u64) {
    let completion = completion_tokens_for(req);
    let last_user = messages(req)
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .or_else(|| messages(req).last())
        .map(|m| content_text(m.get("content")))
        .unwrap_or_default();
    let echo: String = last_user.chars().take(40).collect();
    let content = format!("[sim {model}] You said: {echo}");
    let n = sim.inner.seq.fetch_add(1, Ordering::Relaxed) + 1;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut v = json!({
        "id": format!("chatcmpl-sim-{n}"),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop"
        }],
    });
    if with_usage {
        v["usage"] = usage_json(sim, model, opts, prompt, completion);
    }
    (v, completion)
}

/// `usage` object; records the figures as billed, since the client receives them.
fn usage_json(sim: &Sim, model: &str, opts: &SimOptions, prompt: u64, completion: u64) -> Value {
    let fraction = if opts.cached_fraction.is_nan() {
        0.0
    } else {
        opts.cached_fraction.clamp(0.0, 1.0)
    };
    let cached = ((prompt as f64) * fraction).floor() as u64;
    sim.record_billed(model, prompt, completion, cached);
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}
    })
}

fn fault_response(
    sim: &Sim,
    req: &Value,
    model: &str,
    opts: &SimOptions,
    prompt: u64,
    fault: Fault,
) -> (u16, Response) {
    match fault {
        Fault::RateLimit {
            retry_after,
            retry_after_ms,
        } => {
            let body = error_json(
                "Rate limit reached (simulated)",
                "rate_limit_error",
                "rate_limit_exceeded",
            );
            let mut resp = json_response(StatusCode::TOO_MANY_REQUESTS, &body);
            if let Some(ra) = retry_after
                && let Ok(v) = HeaderValue::from_str(&ra)
            {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
            if let Some(ms) = retry_after_ms {
                resp.headers_mut()
                    .insert("retry-after-ms", HeaderValue::from(ms));
            }
            (429, resp)
        }
        Fault::InsufficientQuota => (
            429,
            json_response(
                StatusCode::TOO_MANY_REQUESTS,
                &error_json(
                    "You exceeded your current quota (simulated)",
                    "insufficient_quota",
                    "insufficient_quota",
                ),
            ),
        ),
        Fault::Status { status } => {
            // An out-of-range status in the options must not crash the sim: answer 500.
            let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let (typ, c) = status_error(code.as_u16());
            let msg = format!("simulated {}", code.as_u16());
            (
                code.as_u16(),
                json_response(code, &error_json(&msg, typ, c)),
            )
        }
        Fault::ContextLength => {
            let window = opts.context_windows.get(model).copied().unwrap_or(0);
            (400, context_length_response(model, window, prompt))
        }
        // Handled before the latency; kept here so the match is exhaustive.
        Fault::Hang => (
            503,
            json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &error_json(
                    "simulated hang",
                    "service_unavailable_error",
                    "service_unavailable",
                ),
            ),
        ),
        Fault::EmptyChoices => {
            // Providers still bill the prompt of such answers; report it so the worker's
            // cost accounting can be checked on this path too.
            let (mut v, _) = success_body(sim, req, model, opts, prompt, false);
            v["choices"] = json!([]);
            v["usage"] = usage_json(sim, model, opts, prompt, 0);
            (200, json_response(StatusCode::OK, &v))
        }
        Fault::ErrorBody => (
            200,
            json_response(
                StatusCode::OK,
                &error_json(
                    "simulated error inside a 200 response",
                    "server_error",
                    "internal_error",
                ),
            ),
        ),
        Fault::Garbage => (
            200,
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "text/html")],
                "<html><body>502 Bad Gateway (simulated garbage)</body></html>",
            )
                .into_response(),
        ),
        Fault::Truncated => {
            // No usage is billed: the client cannot read it.
            let (v, _) = success_body(sim, req, model, opts, prompt, false);
            let mut s = v.to_string();
            let mut cut = s.len() / 2;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
            (
                200,
                (
                    StatusCode::OK,
                    [(header::CONTENT_TYPE, "application/json")],
                    s,
                )
                    .into_response(),
            )
        }
        Fault::NoUsage => {
            let (v, _) = success_body(sim, req, model, opts, prompt, false);
            (200, json_response(StatusCode::OK, &v))
        }
    }
}

async fn list_models(State(sim): State<Sim>) -> Response {
    let opts = sim.options();
    let mut models: BTreeSet<String> = opts
        .rules
        .iter()
        .map(|r| r.model.clone())
        .filter(|m| m != "*")
        .collect();
    models.extend(opts.context_windows.keys().cloned());
    models.extend(opts.model_latency_ms.keys().cloned());
    models.extend(
        sim.stats()
            .requests
            .into_keys()
            .filter(|m| m != INVALID_MODEL_KEY),
    );
    let data: Vec<Value> = models
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "sim"}))
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

async fn get_stats(State(sim): State<Sim>) -> Response {
    json_response(StatusCode::OK, &json!(sim.stats()))
}

async fn reset_stats(State(sim): State<Sim>) -> Response {
    sim.reset_stats();
    json_response(StatusCode::OK, &json!(sim.stats()))
}

async fn get_options(State(sim): State<Sim>) -> Response {
    json_response(StatusCode::OK, &json!(sim.options()))
}

async fn put_options(State(sim): State<Sim>, body: Bytes) -> Response {
    match serde_json::from_slice::<SimOptions>(&body) {
        Ok(opts) => {
            sim.set_options(opts);
            json_response(StatusCode::OK, &json!(sim.options()))
        }
        Err(e) => json_response(
            StatusCode::BAD_REQUEST,
            &error_json(
                &format!("invalid SimOptions JSON: {e}"),
                "invalid_request_error",
                "invalid_request",
            ),
        ),
    }
}

/// Errors of the `sim-provider` subcommand.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("--rules is not a valid JSON array of rules: {0}")]
    Rules(#[source] serde_json::Error),
    #[error("--options-file {path}: cannot read: {source}")]
    OptionsFileRead {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--options-file {path}: not valid SimOptions JSON: {source}")]
    OptionsFileJson {
        path: std::path::PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("--listen {addr}: cannot bind: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sim provider server failed: {0}")]
    Serve(#[source] std::io::Error),
}

/// Arguments of the `sim-provider` subcommand.
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Address to listen on. The default is loopback; any other address is bound as given.
    #[arg(long, default_value = "127.0.0.1:8089")]
    pub listen: String,
    /// Base latency of every call (ignored when --options-file is given).
    #[arg(long, default_value_t = 200)]
    pub latency_ms: u64,
    /// Uniform random extra latency 0..=jitter (ignored when --options-file is given).
    #[arg(long, default_value_t = 100)]
    pub jitter_ms: u64,
    /// JSON array of rules, e.g. '[{"model":"deepseek-v3.2","fault":{"kind":"status","status":503},"probability":0.3}]'
    /// (replaces the rules of --options-file when both are given)
    #[arg(long)]
    pub rules: Option<String>,
    /// JSON file with a whole SimOptions
    #[arg(long)]
    pub options_file: Option<std::path::PathBuf>,
}

/// Options from the CLI: the options file if given (else latency/jitter flags), then
/// `--rules` replacing its rules.
pub fn options_from_args(args: &SimArgs) -> Result<SimOptions, SimError> {
    let mut opts = match &args.options_file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|source| SimError::OptionsFileRead {
                    path: path.clone(),
                    source,
                })?;
            serde_json::from_str(&text).map_err(|source| SimError::OptionsFileJson {
                path: path.clone(),
                source,
            })?
        }
        None => SimOptions {
            latency_ms: args.latency_ms,
            jitter_ms: args.jitter_ms,
            ..SimOptions::default()
        },
    };
    if let Some(rules) = &args.rules {
        opts.rules = serde_json::from_str(rules).map_err(SimError::Rules)?;
    }
    Ok(opts)
}

/// Run the `sim-provider` subcommand until `shutdown` is cancelled.
pub async fn run_cli(args: SimArgs, shutdown: CancellationToken) -> Result<(), SimError> {
    let opts = options_from_args(&args)?;
    let bind_err = |source| SimError::Bind {
        addr: args.listen.clone(),
        source,
    };
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(bind_err)?;
    let addr = listener.local_addr().map_err(bind_err)?;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "sim provider listening on a non-loopback address");
    }
    tracing::info!(%addr, rules = opts.rules.len(), "sim provider listening");
    println!("sim-provider listening on http://{addr}/v1");
    Sim::new(opts)
        .serve(listener, shutdown)
        .await
        .map_err(SimError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;

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
