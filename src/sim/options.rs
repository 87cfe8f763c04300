//! What the simulated provider does: latency and fault-injection rules.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

pub(super) fn one() -> f64 {
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
    /// When set, `GET /v1/models` lists exactly these (else the models the sim has
    /// rules, windows or calls for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// When set, `GET /v1/models` answers 401 unless `Authorization: Bearer <it>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
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
