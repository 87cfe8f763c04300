//! One OpenAI-compatible HTTP client per provider. Every call ends as one [`Outcome`]:
//! a completion with its usage, or an error classified by what to do next
//! ([`ErrorClass`]), carrying the usage a failed response reported (billed too).
//!
//! Invariant: this module never touches Redis, and never logs or formats the API key.

use crate::config::{ProviderConfig, Secret};
use crate::outcome::ErrorClass;
use crate::outcome::Usage;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use reqwest::StatusCode;
use serde_json::{Map, Value};
use std::time::{Duration, SystemTime};

/// Header carrying the job id, so a provider-side log (or the simulated provider) can
/// count calls per job. Contains no secret.
pub const JOB_HEADER: &str = "x-llm-worker-job";

/// Fields of a job payload that are the worker's own and are not sent upstream.
pub const WORKER_FIELDS: [&str; 8] = [
    "route",
    "id",
    "metadata",
    "tier",
    "tenant",
    "max_cost_usd",
    "context_policy",
    "deadline_ms",
];

#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub content: String,
    pub finish_reason: String,
}

/// A failed call: what happened (one line, no secrets) and what to do next.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct CallError {
    pub class: ErrorClass,
    pub status: Option<u16>,
    pub message: String,
}

/// The result of one provider call.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Tokens the response reported, ok or not; `None` when it reported none.
    pub usage: Option<Usage>,
    pub result: Result<Completion, CallError>,
    /// The response's `usage` object exactly as the provider sent it (for the result's
    /// `usage` field, so a cost can be re-priced later).
    pub raw_usage: Option<Value>,
}

/// Prefix of the message of a call that never reached the provider (nothing billed).
const NOT_SENT: &str = "connection failed";

impl Outcome {
    /// The provider may have billed this call but did not say for how much: a success
    /// without usage, a 2xx answer whose usage cannot be read (not JSON, cut off, an
    /// error inside a 200: the provider answered "success" and may have billed it), or a
    /// request sent and then cut off (timeout, reset). Budgets and per-job caps count
    /// such a call at its worst case. An HTTP error answer (4xx, 5xx) without usage, or
    /// a connection never made, is not billed.
    pub fn cost_unknown(&self) -> bool {
        self.usage.is_none()
            && match &self.result {
                Ok(_) => true,
                Err(e) => match e.status {
                    Some(s) => (200..300).contains(&s),
                    None => !e.message.starts_with(NOT_SENT),
                },
            }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// `error` is printed in the message, so it is not also the `source()` (see
    /// `from_cause!`).
    #[error("provider {name}: cannot build HTTP client: {error}")]
    Client { name: String, error: reqwest::Error },
    /// `base_url` + `/chat/completions` is not a URL. Config validation rejects such a
    /// base_url first (naming the key), so this is reached only by a config built in code.
    #[error(
        "provider {name}: base_url does not make a valid URL: {error} (fix providers.{name}.base_url)"
    )]
    Url {
        name: String,
        error: url::ParseError,
    },
}

/// The body sent for a job: the job's payload without the worker's own fields (and
/// without `stream`, `stream_options`), `messages` replaced when trimmed, and `model` set
/// to the upstream name. Serialized straight from the job's payload: nothing is cloned
/// per call (a copy of the payload, messages and all, was a large share of a job's
/// allocations).
pub struct RequestBody<'a> {
    payload: &'a Map<String, Value>,
    messages: Option<&'a [Value]>,
    model: &'a str,
}

impl serde::Serialize for RequestBody<'_> {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let skip = |k: &str| {
            WORKER_FIELDS.contains(&k) || k == "stream" || k == "stream_options" || k == "model"
        };
        let mut map = ser.serialize_map(None)?;
        for (k, v) in self.payload {
            if skip(k) {
                continue;
            }
            match (k.as_str(), self.messages) {
                ("messages", Some(m)) => map.serialize_entry(k, m)?,
                _ => map.serialize_entry(k, v)?,
            }
        }
        if self.messages.is_some() && !self.payload.contains_key("messages") {
            map.serialize_entry("messages", &self.messages)?;
        }
        map.serialize_entry("model", self.model)?;
        map.end()
    }
}

pub struct ProviderClient {
    http: reqwest::Client,
    /// Parsed once: parsing it for every call (IDNA host checks included) was about 1.5%
    /// of a job's CPU at a 0 ms model.
    url: reqwest::Url,
    api_key: Option<Secret>,
    limiter: DefaultDirectRateLimiter,
}

/// A `reqwest` client builder with this process's shared TLS settings.
///
/// Why: for each client it builds, reqwest reads and parses the platform's root store
/// (`/etc/ssl/certs`, through rustls-platform-verifier): about 19 M instructions, a few
/// milliseconds, per client, at start (callgrind: two loads, 7.3 % of a 2,000-job
/// profile, for one provider: its client and its key check's). Here it is read once, by
/// the first caller, and every client shares the verifier.
///
/// Invariant: the settings are those reqwest builds itself by default (rustls with the
/// installed or the aws-lc-rs crypto provider, TLS 1.2 and 1.3, the platform verifier,
/// SNI on, ALPN `h2` then `http/1.1`); the clients also share one TLS session cache. The
/// root store is the one read at first use. If the platform verifier cannot be made, or
/// this reqwest does not take the settings (a `cargo update` that gives it another
/// rustls than ours), the builder is returned untouched: reqwest builds its own, as
/// before, and reports its own errors.
///
/// With the shared settings, a caller's `tls_*` builder options (roots, versions,
/// `http1_only`'s ALPN) are not applied: no caller sets any.
pub fn http_client() -> reqwest::ClientBuilder {
    static TLS: std::sync::OnceLock<Option<rustls::ClientConfig>> = std::sync::OnceLock::new();
    let builder = reqwest::Client::builder();
    match TLS.get_or_init(shared_tls) {
        Some(tls) => builder.tls_backend_preconfigured(tls.clone()),
        None => builder,
    }
}

fn shared_tls() -> Option<rustls::ClientConfig> {
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider()));
    let verifier = match rustls_platform_verifier::Verifier::new(provider.clone()) {
        Ok(v) => v,
        Err(e) => {
            tracing::debug!(error = %e, "no shared TLS verifier; each HTTP client builds its own");
            return None;
        }
    };
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(rustls::ALL_VERSIONS)
        .ok()?
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(verifier))
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    // reqwest takes a preconfigured backend by its type: with another rustls version it
    // would refuse every client at build time. Try once; without it, each builds its own.
    if let Err(e) = reqwest::Client::builder()
        .tls_backend_preconfigured(tls.clone())
        .build()
    {
        tracing::debug!(error = %e, "reqwest does not take the shared TLS settings; each HTTP client builds its own");
        return None;
    }
    Some(tls)
}

impl ProviderClient {
    pub fn new(name: &str, cfg: &ProviderConfig) -> Result<ProviderClient, ProviderError> {
        let http = http_client()
            .timeout(cfg.timeout_ms)
            .connect_timeout(cfg.timeout_ms.min(Duration::from_secs(10)))
            .pool_max_idle_per_host(256)
            .build()
            .map_err(|error| ProviderError::Client {
                name: name.to_string(),
                error,
            })?;
        let rps = cfg.requests_per_second;
        let url = format!("{}/chat/completions", cfg.base_url.trim_end_matches('/'));
        let url = reqwest::Url::parse(&url).map_err(|error| ProviderError::Url {
            name: name.to_string(),
            error,
        })?;
        Ok(ProviderClient {
            http,
            url,
            api_key: cfg.api_key.clone(),
            limiter: RateLimiter::direct(Quota::per_second(rps)),
        })
    }

    /// The request body for one attempt: the job's payload with the worker's own fields
    /// removed, `model` set to `upstream_model`, and `stream` off (results are whole).
    pub fn request_body<'a>(
        payload: &'a Map<String, Value>,
        messages: Option<&'a [Value]>,
        upstream_model: &'a str,
    ) -> RequestBody<'a> {
        RequestBody {
            payload,
            messages,
            model: upstream_model,
        }
    }

    /// Waits until this process may send one more request to this provider
    /// (`requests_per_second`, governor). Call it *before* taking a slot, so a fleet slot
    /// is never held while waiting on the local limit; each call of it admits one request.
    pub async fn throttle(&self) {
        self.limiter.until_ready().await;
    }

    /// Sends one request (the caller has passed [`ProviderClient::throttle`] and holds a
    /// slot). Dropping the future aborts the HTTP request.
    pub async fn call(&self, body: &RequestBody<'_>, job_id: &str) -> Outcome {
        let mut req = self.http.post(self.url.clone()).json(body);
        // A job id that is not a valid header value (a newline, say) is not sent: the call
        // must not fail for the sake of a tracing header.
        if let Ok(v) = reqwest::header::HeaderValue::from_str(job_id) {
            req = req.header(JOB_HEADER, v);
        }
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key.expose());
        }
        let mut resp = match req.send().await {
            Ok(r) => r,
            Err(e) => return transport_error(&e),
        };
        let status = resp.status();
        // Moved out, not cloned (a clone is four allocations a call): reading the body
        // does not look at the headers again.
        let headers = std::mem::take(resp.headers_mut());
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return transport_error(&e),
        };
        classify(status, &headers, &bytes, SystemTime::now())
    }
}

fn transport_error(e: &reqwest::Error) -> Outcome {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        NOT_SENT
    } else {
        "transport error"
    };
    // Display of a reqwest error includes the URL (no secret in it) and the cause.
    Outcome {
        usage: None,
        raw_usage: None,
        result: Err(CallError {
            class: ErrorClass::Transient,
            status: None,
            message: one_line(&format!("{what}: {e}")),
        }),
    }
}

/// Text fit for one line of a result or log, bounded in length.
pub fn one_line(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            // U+2028/U+2029 end a line in many viewers (and JSON-in-JS) too.
            if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}') {
                ' '
            } else {
                c
            }
        })
        .take(300)
        .collect();
    if s.chars().count() > 300 {
        out.push('…');
    }
    out
}

/// Largest token count one response may report. No model has a window anywhere near
/// this; a larger count is garbage, and pricing it could overflow the decimal cost
/// (found by fuzzing: `prompt_tokens` = 2^64-1 panicked in `cost::cost`).
pub const MAX_REPORTED_TOKENS: u64 = 1_000_000_000;

/// Usage as an OpenAI-compatible body reports it, if it does. A body reporting more than
/// [`MAX_REPORTED_TOKENS`] prompt or completion tokens is treated as reporting no usage
/// (the worker then warns that the call's cost is unknown).
///
/// Two shapes: OpenAI's (`prompt_tokens` includes every input token; cache reads in
/// `prompt_tokens_details.cached_tokens`, or `cache_read_input_tokens` as aggregators
/// relaying Anthropic put it; cache writes in `cache_creation_input_tokens`, also
/// included in `prompt_tokens`; reasoning tokens are inside `completion_tokens`) and
/// Anthropic's (`input_tokens` excludes the cache: the prompt is `input_tokens +
/// cache_read_input_tokens + cache_creation_input_tokens`, the completion
/// `output_tokens`). Either way every token is priced once.
pub fn parse_usage(v: &Value) -> Option<Usage> {
    usage_of(v.get("usage")?)
}

/// [`parse_usage`] of the `usage` object itself.
///
/// A count that is absent or null reads as none; one that is present but not a whole
/// number >= 0 that fits u64 (a float, a negative, a string, 1e20) makes the whole usage
/// unreadable (`None`: the call's cost is unknown), never 0, which would bill the call
/// for less than the provider did.
fn usage_of(u: &Value) -> Option<Usage> {
    let u = u.as_object()?;
    /// Ok(None) absent or null, Ok(Some(n)) a count, Err(()) present but unreadable.
    fn count(v: Option<&Value>) -> Result<Option<u64>, ()> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or(()),
        }
    }
    let num = |k: &str| count(u.get(k));
    let read = num("cache_read_input_tokens").ok()?;
    let written = num("cache_creation_input_tokens").ok()?.unwrap_or(0);
    let (prompt, completion, cached) = match num("prompt_tokens").ok()? {
        Some(prompt) => {
            let details = match u.get("prompt_tokens_details") {
                None | Some(Value::Null) => None,
                Some(d) => count(d.get("cached_tokens")).ok()?,
            };
            let cached = details.or(read).unwrap_or(0);
            (prompt, num("completion_tokens").ok()?.unwrap_or(0), cached)
        }
        None => {
            let input = num("input_tokens").ok()??;
            let read = read.unwrap_or(0);
            let prompt = input.checked_add(read)?.checked_add(written)?;
            (prompt, num("output_tokens").ok()?.unwrap_or(0), read)
        }
    };
    if prompt > MAX_REPORTED_TOKENS || completion > MAX_REPORTED_TOKENS {
        return None;
    }
    let cached = cached.min(prompt);
    Some(Usage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
        cache_write_tokens: written.min(prompt - cached),
    })
}

/// `retry-after-ms` (milliseconds, as OpenAI sends) or `Retry-After` (seconds or an HTTP date).
pub fn parse_retry_after(
    headers: &reqwest::header::HeaderMap,
    now: SystemTime,
) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
    {
        return Some(Duration::from_micros((ms * 1000.0) as u64));
    }
    let v = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = v.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Some(Duration::from_micros((secs * 1e6) as u64));
        }
        return None;
    }
    let when = httpdate::parse_http_date(v).ok()?;
    Some(when.duration_since(now).unwrap_or(Duration::ZERO))
}

fn error_code(v: &Value) -> (String, String) {
    let e = v.get("error");
    let field = |k: &str| {
        e.and_then(|e| e.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let msg = match e {
        Some(Value::String(s)) => s.clone(),
        _ => field("message"),
    };
    let code = format!("{} {}", field("code"), field("type"));
    (code, msg)
}

/// A JSON value read as [`Value`] reads one (nesting depth, numbers in range, escapes
/// that make characters), keeping nothing. Not `serde::de::IgnoredAny`: serde_json skips
/// that without those checks.
struct Checked;

impl<'de> serde::Deserialize<'de> for Checked {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Checked, D::Error> {
        d.deserialize_any(CheckedVisitor)
    }
}

struct CheckedVisitor;

impl<'de> serde::de::Visitor<'de> for CheckedVisitor {
    type Value = Checked;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Checked, A::Error> {
        while a.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> Result<Checked, A::Error> {
        // `Value` reads an object whose first key is serde_json's raw-value marker as a
        // raw value (a string of JSON, and no other member), refusing anything else: such
        // a body is left to the full read.
        match a.next_key::<FirstKey>()? {
            None => return Ok(Checked),
            Some(FirstKey(true)) => {
                return Err(serde::de::Error::custom("serde_json's raw-value marker"));
            }
            Some(FirstKey(false)) => {
                a.next_value::<Checked>()?;
            }
        }
        while a.next_entry::<Checked, Checked>()?.is_some() {}
        Ok(Checked)
    }
}

/// An object's first key, decoded: whether it is serde_json's raw-value marker (with the
/// `raw_value` feature, `Value` treats an object starting with it as a raw value).
struct FirstKey(bool);

impl<'de> serde::Deserialize<'de> for FirstKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<FirstKey, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = FirstKey;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E>(self, k: &str) -> Result<FirstKey, E> {
                Ok(FirstKey(k == "$serde_json::private::RawValue"))
            }
        }
        d.deserialize_any(V)
    }
}

/// The common answer's shape, read in one pass: an `error` member (any value but null
/// sends the body to the full read), the first choice's `message.content` (a string)
/// and `finish_reason` (a string or null), and `usage`. Other members and choices are
/// skipped (the [`Checked`] pass read them as the full read does). A repeated member is
/// an error here (serde's derive refuses it), so such a body takes the full read, which
/// keeps the last one.
#[derive(serde::Deserialize)]
struct FastBody<'a> {
    #[serde(borrow, default)]
    error: Option<&'a serde_json::value::RawValue>,
    choices: FirstChoice,
    #[serde(default)]
    usage: Option<Value>,
}

#[derive(serde::Deserialize)]
struct FastChoice {
    message: MapOnly<FastMessage>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(serde::Deserialize)]
struct FastMessage {
    content: String,
}

/// A JSON array's first element as a [`FastChoice`], the rest skipped; an empty array
/// is an error (the full read decides).
struct FirstChoice(FastChoice);

impl<'de> serde::Deserialize<'de> for FirstChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<FirstChoice, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = FirstChoice;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a non-empty array of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<FirstChoice, A::Error> {
                let MapOnly(first) = a
                    .next_element::<MapOnly<FastChoice>>()?
                    .ok_or_else(|| serde::de::Error::custom("no choice"))?;
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(FirstChoice(first))
            }
        }
        d.deserialize_seq(V)
    }
}

/// `T` read from a JSON object only: serde's derived structs also read an array
/// (fields by position), which the full read would not take for an object.
struct MapOnly<T>(T);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for MapOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<MapOnly<T>, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
            type Value = MapOnly<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, a: A) -> Result<MapOnly<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(a)).map(MapOnly)
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// The common answer, a success with `choices[0].message.content` a string, read without
/// building a [`Value`] of the whole body (that was about a tenth of the worker's
/// instructions per job at a 0 ms model): only the `usage` object becomes one. `None`
/// for anything else (an `error` member, no choices, a content that is not a string, a
/// repeated member, not an object at all, a body the full read refuses): the caller then
/// reads the body in full, so the outcome of every body is the one the full read gives.
fn classify_ok_fast(body: &[u8]) -> Option<Outcome> {
    // First the whole body as the full read checks it (nesting depth, numbers in range,
    // escapes that make characters), with nothing built: the typed read below skips
    // members, and would let through what the full read refuses in a member it skips.
    // Both reads from text checked once as UTF-8: from bytes, serde_json checks each
    // string on its own, in each read (about 40 checks a job). A body that is not UTF-8
    // is not the common answer; the full read decides what it is.
    let text = std::str::from_utf8(body).ok()?;
    serde_json::from_str::<Checked>(text).ok()?;
    let MapOnly(fast) = serde_json::from_str::<MapOnly<FastBody>>(text).ok()?;
    if fast.error.is_some() {
        return None;
    }
    let FirstChoice(choice) = fast.choices;
    let raw = fast.usage.filter(|u| !u.is_null());
    let usage = raw.as_ref().and_then(usage_of);
    Some(Outcome {
        usage,
        raw_usage: usage.and(raw),
        result: Ok(Completion {
            content: choice.message.0.content,
            finish_reason: choice.finish_reason.unwrap_or_default(),
        }),
    })
}

/// Turns one HTTP response into an [`Outcome`]. Pure, so every branch is unit-tested.
pub fn classify(
    status: StatusCode,
    headers: &reqwest::header::HeaderMap,
    body: &[u8],
    now: SystemTime,
) -> Outcome {
    if status.is_success()
        && let Some(fast) = classify_ok_fast(body)
    {
        return fast;
    }
    classify_full(status, headers, body, now)
}

/// [`classify`] from a [`Value`] of the whole body: every answer the fast read leaves.
fn classify_full(
    status: StatusCode,
    headers: &reqwest::header::HeaderMap,
    body: &[u8],
    now: SystemTime,
) -> Outcome {
    let json: Option<Value> = serde_json::from_slice(body).ok();
    let usage = json.as_ref().and_then(parse_usage);
    let raw_usage = usage
        .and(json.as_ref())
        .and_then(|v| v.get("usage"))
        .cloned();
    let fail = |class: ErrorClass, message: String| Outcome {
        usage,
        raw_usage: raw_usage.clone(),
        result: Err(CallError {
            class,
            status: Some(status.as_u16()),
            message: one_line(&message),
        }),
    };
    let (code, msg) = json.as_ref().map(error_code).unwrap_or_default();
    let detail = if msg.is_empty() {
        String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned()
    } else {
        msg
    };
    let s = status.as_u16();
    if status.is_success() {
        let Some(v) = json else {
            return fail(
                ErrorClass::Transient,
                format!(
                    "HTTP {s} with a body that is not JSON ({} bytes)",
                    body.len()
                ),
            );
        };
        if v.get("error").is_some_and(|e| !e.is_null()) {
            return fail(
                ErrorClass::Transient,
                format!("HTTP {s} with an error body: {detail}"),
            );
        }
        let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return fail(ErrorClass::Transient, format!("HTTP {s} with no choices"));
        };
        let message = choice.get("message");
        let content = match message.and_then(|m| m.get("content")) {
            Some(Value::String(c)) => c.clone(),
            // No text (e.g. tool calls): keep the whole message so nothing is lost.
            _ => message.map(|m| m.to_string()).unwrap_or_default(),
        };
        let finish_reason = choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        return Outcome {
            usage,
            raw_usage: raw_usage.clone(),
            result: Ok(Completion {
                content,
                finish_reason,
            }),
        };
    }
    let class = match s {
        429 if code.contains("insufficient_quota") => ErrorClass::ProviderRejected,
        429 => ErrorClass::RateLimited {
            retry_after: parse_retry_after(headers, now),
        },
        // Often about this model only (an aggregator's key without access to it): the
        // router skips the model, and excludes the provider only on more evidence.
        401 | 403 => ErrorClass::AccessDenied,
        400 if code.contains("context_length_exceeded")
            || detail.contains("maximum context length") =>
        {
            ErrorClass::ContextTooLong
        }
        408 | 409 | 500..=599 => ErrorClass::Transient,
        _ if status.is_client_error() => ErrorClass::Fatal,
        // 1xx/3xx (a redirect we did not follow) and anything else odd: try again.
        _ => ErrorClass::Transient,
    };
    fail(class, format!("HTTP {s}: {detail}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderMap, HeaderValue};

    fn c(status: u16, body: &str) -> Outcome {
        classify(
            StatusCode::from_u16(status).unwrap(),
            &HeaderMap::new(),
            body.as_bytes(),
            SystemTime::now(),
        )
    }
    fn class(o: &Outcome) -> ErrorClass {
        o.result.as_ref().unwrap_err().class.clone()
    }

    fn full(body: &str) -> Outcome {
        classify_full(
            StatusCode::OK,
            &HeaderMap::new(),
            body.as_bytes(),
            SystemTime::UNIX_EPOCH,
        )
    }

    /// The fast read answers the common body, and exactly as the full read does.
    #[test]
    fn a_token_count_present_but_unreadable_is_no_usage_not_zero() {
        // Read as 0, these under-billed the call and counted its usage as known.
        for bad in [
            serde_json::json!(1e20),
            serde_json::json!(50.5),
            serde_json::json!(-3),
            serde_json::json!("7"),
            serde_json::json!([1]),
        ] {
            for (shape, field) in [
                (
                    serde_json::json!({"prompt_tokens": 10, "completion_tokens": 1}),
                    "completion_tokens",
                ),
                (
                    serde_json::json!({"input_tokens": 10, "output_tokens": 1}),
                    "output_tokens",
                ),
                (
                    serde_json::json!({"input_tokens": 10, "output_tokens": 1}),
                    "cache_read_input_tokens",
                ),
                (
                    serde_json::json!({"prompt_tokens": 10, "completion_tokens": 1}),
                    "cache_creation_input_tokens",
                ),
                (
                    serde_json::json!({"prompt_tokens": 10, "completion_tokens": 1}),
                    "cache_read_input_tokens",
                ),
            ] {
                let mut u = shape.clone();
                u[field] = bad.clone();
                assert_eq!(
                    parse_usage(&serde_json::json!({ "usage": u })),
                    None,
                    "{field} = {bad} in {shape}"
                );
            }
            let u = serde_json::json!({"prompt_tokens": 10, "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": bad.clone()}});
            assert_eq!(
                parse_usage(&serde_json::json!({ "usage": u })),
                None,
                "cached_tokens = {bad}"
            );
        }
        // Absent or null stays 0 (providers leave out what they did not use).
        let u = parse_usage(&serde_json::json!({"usage": {"prompt_tokens": 10,
            "completion_tokens": null, "cache_read_input_tokens": null,
            "prompt_tokens_details": {"cached_tokens": null}}}))
        .expect("nulls read as absent");
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (10, 0, 0)
        );
        let u = parse_usage(&serde_json::json!({"usage": {"prompt_tokens": 10,
            "prompt_tokens_details": null}}))
        .expect("no completion count, no details");
        assert_eq!((u.prompt_tokens, u.completion_tokens), (10, 0));
    }

    #[test]
    fn a_success_status_whose_usage_cannot_be_read_is_cost_unknown() {
        // The provider answered 2xx: it may have billed the call. A body the worker cannot
        // read (cut mid-emoji, not JSON, an error inside a 200) must not count as free.
        for body in [
            r#"{"choices":[{"message":{"content":"hi \ud83d"},"finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":2}}"#,
            "<html>502 Bad Gateway</html>",
            r#"{"choices":[{"message":{"content":"cut"#,
            r#"{"error":{"message":"upstream failed mid-answer"}}"#,
            r#"{"choices":[]}"#,
        ] {
            let o = c(200, body);
            assert!(o.result.is_err(), "{body}");
            assert!(o.cost_unknown(), "a 2xx without readable usage: {body}");
        }
        // An HTTP error answer without usage is still not billed; a success with usage
        // is known; a connection never made is not billed.
        assert!(!c(500, "oops").cost_unknown());
        assert!(!c(429, r#"{"error":{"message":"slow down"}}"#).cost_unknown());
        let ok = c(
            200,
            r#"{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
        );
        assert!(!ok.cost_unknown());
    }

    #[test]
    fn the_fast_read_answers_the_common_body_as_the_full_read_does() {
        let body = r#"{"choices":[{"finish_reason":"stop","index":0,"message":{"content":"[sim] You said: \"hi\"\n","role":"assistant"}}],"created":1,"id":"x","model":"m","object":"chat.completion","usage":{"completion_tokens":16,"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0},"total_tokens":25}}"#;
        let fast = classify_ok_fast(body.as_bytes()).expect("the common body is read fast");
        assert_eq!(fast, full(body));
        assert_eq!(
            fast.result.as_ref().unwrap().content,
            "[sim] You said: \"hi\"\n"
        );
        assert_eq!(fast.usage.unwrap().prompt_tokens, 9);
        assert!(fast.raw_usage.is_some());
    }

    /// Bodies at every edge the fast read must leave to the full read, or read the same.
    #[test]
    fn the_fast_read_never_answers_differently_from_the_full_read() {
        let bodies = [
            r#"{"choices":[{"message":{"content":"a"}}]}"#,
            r#"{"choices":[{"message":{"content":"a"},"finish_reason":null}],"usage":null}"#,
            r#"{"choices":[{"message":{"content":"a"},"finish_reason":7}]}"#,
            r#"{"choices":[{"message":{"content":null,"tool_calls":[]}}]}"#,
            r#"{"choices":[{"message":{"tool_calls":[{"id":"t"}]}}]}"#,
            r#"{"choices":[{"message":"text"}]}"#,
            r#"{"choices":[[{"content":"a"}]]}"#,
            r#"[[{"message":{"content":"a"}}]]"#,
            r#"{"choices":[]}"#,
            r#"{"choices":{}}"#,
            r#"{"error":null,"choices":[{"message":{"content":"a"}}]}"#,
            r#"{"error":{"message":"boom"},"choices":[{"message":{"content":"a"}}]}"#,
            r#"{"error":"x","choices":[{"message":{"content":"a"}}]}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"choices":[{"message":{"content":"b"}}]}"#,
            r#"{"choices":[{"message":{"content":"a","content":"b"}}]}"#,
            r#"{"ch\u006fices":[{"message":{"content":"a"}}]}"#,
            r#"{"choices":[{"message":{"content":"caf\u00e9 \ud83d\ude00"}}]}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":"9"}}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":9,"completion_tokens":2}}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"input_tokens":9,"output_tokens":2,"cache_read_input_tokens":3}}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":99999999999999999999}}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":[1,2]}"#,
            r#"{"choices":[{"message":{"content":"a"}}]} trailing"#,
            r#"{"choices":[{"message":{"content":"a"}}],}"#,
            r#"  {"choices":[{"message":{"content":"a"}}]}  "#,
            "",
            "null",
            "not json",
        ];
        for b in bodies {
            if let Some(fast) = classify_ok_fast(b.as_bytes()) {
                assert_eq!(fast, full(b), "body {b}");
            }
        }
        // And the ones it must read itself, so the test above compares something.
        for b in [
            bodies[0], bodies[1], bodies[10], bodies[16], bodies[19], bodies[24],
        ] {
            assert!(classify_ok_fast(b.as_bytes()).is_some(), "body {b}");
        }
    }

    /// A body that is not UTF-8, in the content or in a member the fast read skips: the
    /// fast read leaves it to the full read, which refuses it as JSON (no usage billed).
    #[test]
    fn a_body_that_is_not_utf8_is_left_to_the_full_read() {
        let bodies: [&[u8]; 3] = [
            b"{\"choices\":[{\"message\":{\"content\":\"a\xff\"}}],\"usage\":{\"prompt_tokens\":9}}",
            b"{\"id\":\"\xc0\x80\",\"choices\":[{\"message\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":9}}",
            b"{\"choices\":[{\"message\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":9},\"x\":\"\xed\xa0\x80\"}",
        ];
        for b in bodies {
            assert!(
                classify_ok_fast(b).is_none(),
                "{}",
                String::from_utf8_lossy(b)
            );
            let out = classify(StatusCode::OK, &HeaderMap::new(), b, SystemTime::UNIX_EPOCH);
            assert!(out.result.is_err() && out.usage.is_none(), "{out:?}");
        }
    }

    /// Bodies the full read refuses in a member the fast read does not open (nesting
    /// past serde_json's 128 levels, a number out of range, a lone surrogate): the fast
    /// read must refuse them too, or a body the full read calls "not JSON" (no bill, a
    /// retry) would become a success with its usage billed.
    #[test]
    fn the_fast_read_refuses_what_the_full_read_refuses_in_members_it_skips() {
        let ok = r#""choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":9,"completion_tokens":2}"#;
        let deep = format!(r#"{{{ok},"x":{}{}}}"#, "[".repeat(130), "]".repeat(130));
        let bodies = [
            deep,
            format!(r#"{{"id":1e400,{ok}}}"#),
            format!(r#"{{"id":"\ud800",{ok}}}"#),
            format!(r#"{{"id":"\udc00x",{ok}}}"#),
            format!(r#"{{{ok},"choices_extra":[{{"message":{{"content":"b","n":-1e999}}}}]}}"#),
            r#"{"choices":[{"message":{"content":"a","refusal":"\ud83d"}}],"usage":{"prompt_tokens":9}}"#
                .to_string(),
            // serde_json's raw-value marker as an object's first key: `Value` reads the
            // object as a raw value (a string of JSON, and nothing else) or refuses it.
            format!(r#"{{{ok},"x":{{"$serde_json::private::RawValue":0}}}}"#),
            format!(r#"{{"$serde_json::private::RawValue":"1",{ok}}}"#),
            format!(r#"{{{ok},"x":{{"$serde_json::private::Raw\u0056alue":"[1]","y":2}}}}"#),
        ];
        for b in &bodies {
            let f = full(b);
            assert!(f.result.is_err(), "the full read refuses {b}");
            assert_eq!(classify_ok_fast(b.as_bytes()), None, "body {b}");
            assert_eq!(c(200, b), f, "body {b}");
        }
    }

    /// The first choice is the answer, and only a success status is read fast.
    #[test]
    fn the_fast_read_takes_the_first_choice_and_only_a_success() {
        let b = r#"{"choices":[{"message":{"content":"first"}},{"message":{"content":"second"}}]}"#;
        assert_eq!(c(200, b).result.unwrap().content, "first");
        let o = c(500, b);
        assert_eq!(
            o,
            classify_full(
                StatusCode::INTERNAL_SERVER_ERROR,
                &HeaderMap::new(),
                b.as_bytes(),
                SystemTime::UNIX_EPOCH
            )
        );
        assert!(
            o.result.is_err(),
            "a 500 is an error whatever its body says"
        );
    }

    proptest::proptest! {
        /// Generated bodies from the pieces a chat answer is made of: wherever the fast
        /// read answers, the full read answers the same.
        #[test]
        fn generated_bodies_read_fast_as_in_full(
            parts in proptest::collection::vec(proptest::sample::select(vec![
                r#""error":null"#, r#""error":{"message":"m"}"#, r#""choices":[]"#,
                r#""choices":[{"message":{"content":"x"},"finish_reason":"stop"}]"#,
                r#""choices":[{"message":{"content":"y\n"}},{"message":{"content":1}}]"#,
                r#""choices":[{"message":{"content":null}}]"#,
                r#""choices":[{"finish_reason":"length","message":{"role":"assistant","content":"z"}}]"#,
                r#""usage":{"prompt_tokens":5,"completion_tokens":1}"#,
                r#""usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":9}}"#,
                r#""usage":null"#, r#""usage":{}"#, r#""id":"chatcmpl-1""#, r#""created":12"#,
                r#""big":1e400"#, r#""half":"\ud800""#, r#""raw":{"$serde_json::private::RawValue":"1"}"#, r#""deep":[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]"#,
            ]), 0..6)
        ) {
            let body = format!("{{{}}}", parts.join(","));
            if let Some(fast) = classify_ok_fast(body.as_bytes()) {
                proptest::prop_assert_eq!(fast, full(&body), "body {}", body);
            }
        }
    }

    #[test]
    fn ok_answer() {
        let o = c(
            200,
            r#"{"choices":[{"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],
               "usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}"#,
        );
        assert_eq!(
            o.result.unwrap(),
            Completion {
                content: "hi".into(),
                finish_reason: "stop".into()
            }
        );
        assert_eq!(
            o.usage,
            Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                cached_tokens: 4,
                cache_write_tokens: 0,
            })
        );
    }

    #[test]
    fn classes() {
        assert_eq!(class(&c(503, "")), ErrorClass::Transient);
        assert_eq!(class(&c(529, "{}")), ErrorClass::Transient);
        assert_eq!(class(&c(408, "")), ErrorClass::Transient);
        assert_eq!(class(&c(409, "")), ErrorClass::Transient);
        assert_eq!(class(&c(401, "")), ErrorClass::AccessDenied);
        assert_eq!(class(&c(403, "")), ErrorClass::AccessDenied);
        assert_eq!(
            class(&c(
                429,
                r#"{"error":{"code":"insufficient_quota","message":"pay"}}"#
            )),
            ErrorClass::ProviderRejected
        );
        assert_eq!(
            class(&c(429, "")),
            ErrorClass::RateLimited { retry_after: None }
        );
        assert_eq!(
            class(&c(
                400,
                r#"{"error":{"code":"context_length_exceeded","message":"x"}}"#
            )),
            ErrorClass::ContextTooLong
        );
        assert_eq!(
            class(&c(400, r#"{"error":{"message":"bad"}}"#)),
            ErrorClass::Fatal
        );
        assert_eq!(class(&c(404, "")), ErrorClass::Fatal);
        assert_eq!(class(&c(200, "not json")), ErrorClass::Transient);
        assert_eq!(class(&c(200, r#"{"choices":[]}"#)), ErrorClass::Transient);
        assert_eq!(
            class(&c(200, r#"{"error":{"message":"boom"}}"#)),
            ErrorClass::Transient
        );
        assert_eq!(
            class(&c(200, r#"{"choices":[{"message":"#)),
            ErrorClass::Transient
        );
    }

    #[test]
    fn failed_attempt_keeps_its_usage() {
        let o = c(
            500,
            r#"{"error":{"message":"x"},"usage":{"prompt_tokens":7,"completion_tokens":0}}"#,
        );
        assert_eq!(o.usage.unwrap().prompt_tokens, 7);
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(2)));
        h.insert("retry-after-ms", HeaderValue::from_static("150"));
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_millis(150)));
        let mut h = HeaderMap::new();
        let date = httpdate::fmt_http_date(now + Duration::from_secs(30));
        h.insert("retry-after", HeaderValue::from_str(&date).unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(30)));
        h.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(parse_retry_after(&h, now), None);
    }

    #[test]
    fn request_body_strips_worker_fields() {
        let payload: Map<String, Value> = serde_json::from_str(
            r#"{"messages":[],"model":"x","route":"r","id":"1","metadata":{},"top_p":0.5,"stream":true,"tier":"free","tenant":"acme","max_cost_usd":"0.01","deadline_ms":1,"context_policy":"trim"}"#,
        )
        .unwrap();
        let b = serde_json::to_value(ProviderClient::request_body(&payload, None, "up")).unwrap();
        assert_eq!(
            b,
            serde_json::json!({"messages":[],"model":"up","top_p":0.5})
        );
        let trimmed = [serde_json::json!({"role": "user", "content": "hi"})];
        let b = serde_json::to_value(ProviderClient::request_body(&payload, Some(&trimmed), "up"))
            .unwrap();
        assert_eq!(
            b,
            serde_json::json!({"messages":[{"role":"user","content":"hi"}],"model":"up","top_p":0.5})
        );
    }
}

#[cfg(test)]
mod usage_pricing_tests {
    use super::*;
    use crate::cost::{Price, checked_cost};
    use rust_decimal::Decimal;
    use std::str::FromStr;

    fn priced(body: &str, price: &Price) -> (Usage, Decimal) {
        let v: Value = serde_json::from_str(body).expect("json");
        let u = parse_usage(&v).expect("usage");
        (u, checked_cost(&u, price).expect("cost"))
    }

    fn d(s: &str) -> Decimal {
        Decimal::from_str(s).expect("decimal")
    }

    /// Each prompt token at exactly one price, against figures computed by hand.
    #[test]
    fn cache_reads_writes_and_reasoning_are_priced_once() {
        let claude = Price {
            input_per_mtok: d("3"),
            output_per_mtok: d("15"),
            cached_input_per_mtok: Some(d("0.30")),
            cache_write_per_mtok: Some(d("3.75")),
        };
        // Anthropic's shape: input_tokens excludes the cache.
        // 100 x 3 + 1000 x 0.30 + 2000 x 3.75 + 50 x 15 = 8850 per million = 0.00885
        let (u, c) = priced(
            r#"{"usage":{"input_tokens":100,"cache_read_input_tokens":1000,"cache_creation_input_tokens":2000,"output_tokens":50}}"#,
            &claude,
        );
        assert_eq!(
            (u.prompt_tokens, u.cached_tokens, u.cache_write_tokens),
            (3100, 1000, 2000)
        );
        assert_eq!(c, d("0.00885"));
        // An aggregator relaying it in OpenAI's shape (prompt_tokens includes both): same.
        let (_, c) = priced(
            r#"{"usage":{"prompt_tokens":3100,"completion_tokens":50,"cache_read_input_tokens":1000,"cache_creation_input_tokens":2000}}"#,
            &claude,
        );
        assert_eq!(c, d("0.00885"));
        // OpenAI's shape, reasoning inside completion_tokens (billed once, as output):
        // 600 x 2 + 400 x 0.5 + 200 x 8 = 3000 per million = 0.003
        let gpt = Price {
            input_per_mtok: d("2"),
            output_per_mtok: d("8"),
            cached_input_per_mtok: Some(d("0.5")),
            cache_write_per_mtok: None,
        };
        let (u, c) = priced(
            r#"{"usage":{"prompt_tokens":1000,"completion_tokens":200,"prompt_tokens_details":{"cached_tokens":400},"completion_tokens_details":{"reasoning_tokens":150}}}"#,
            &gpt,
        );
        assert_eq!((u.cached_tokens, u.cache_write_tokens), (400, 0));
        assert_eq!(c, d("0.003"));
        // No cache-write price: written tokens cost the input price, never twice.
        // 100 x 2 + 2000 x 2 + 50 x 8 = 4600 per million
        let (_, c) = priced(
            r#"{"usage":{"input_tokens":100,"cache_creation_input_tokens":2000,"output_tokens":50}}"#,
            &gpt,
        );
        assert_eq!(c, d("0.0046"));
        // Nonsense (more cached + written than the prompt) is capped, never negative.
        let (u, _) = priced(
            r#"{"usage":{"prompt_tokens":10,"completion_tokens":1,"cache_read_input_tokens":8,"cache_creation_input_tokens":8}}"#,
            &claude,
        );
        assert_eq!((u.cached_tokens, u.cache_write_tokens), (8, 2));
    }
}
