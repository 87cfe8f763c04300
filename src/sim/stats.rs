//! What the simulated provider saw: counters for assertions in tests and benchmarks.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
