//! Fleet-wide rate limits: `rpm` / `tpm` on `[providers.<p>]` and `[models.<m>]`,
//! enforced in Redis for every worker together (`lua/quota_admit.lua`, run by `gate`
//! with the budgets: the last 60 s in one-second buckets, a few O(1) commands per limit
//! and call, no entry per call).
//! governor stays the local per-process limiter (`requests_per_second`).
//!
//! Invariants: a call is admitted in every limit that covers it or in none; a window
//! never holds more than its limit (one call larger than a whole tokens limit is
//! admitted alone into an empty window), so any 60 s sees at most the limit plus one
//! second's bucket; tokens are admitted at an estimate before the call and corrected to
//! the real usage after it, in the bucket they were admitted in (`lua/quota_settle.lua`).

use crate::config::{Config, ModelConfig};
use serde_json::{Map, Value};
use std::time::Duration;

/// The window of every limit (whole seconds: one-second buckets).
pub const WINDOW: Duration = Duration::from_secs(60);

/// Output tokens counted for a call that sets no `max_tokens` on a model without
/// `max_output_tokens` (the tokens estimate only; the real usage corrects it).
pub const DEFAULT_OUTPUT_ESTIMATE: u64 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum RateError {
    #[error(
        "rate: {what} is at its limit of {limit} per minute fleet-wide; room again in {wait:?} (wait, or use another model)"
    )]
    Limited {
        what: String,
        limit: u64,
        wait: Duration,
    },
    #[error("redis: {0} (retry when Redis answers again)")]
    Redis(redis::RedisError),
    #[error("redis pool: {0} (retry when Redis answers again)")]
    Pool(deadpool_redis::PoolError),
}

from_cause!(RateError, RateError::Redis, redis::RedisError);
from_cause!(RateError, RateError::Pool, deadpool_redis::PoolError);

/// One admitted call: its tokens are corrected by `gate::Gate::settle`.
#[derive(Debug, Clone)]
pub struct Admission {
    /// The window of each tokens limit it was admitted in.
    pub(crate) token_keys: Vec<String>,
    /// The tokens admitted (the estimate).
    pub(crate) tokens: u64,
    /// Its admission record: the tokens correction is made once, in its bucket.
    pub(crate) adm_key: String,
}

/// The fleet-wide limits of this config. Cheap to clone.
#[derive(Clone)]
pub struct RateLimits {
    cfg: std::sync::Arc<Config>,
}

/// One limit covering a call: name for messages, key stem, limit, amount.
struct Limit {
    what: String,
    stem: String,
    limit: u64,
    amount: u64,
    tokens: bool,
}

/// The window of one limit (`<stem>:w`; the key names of the earlier sliding log, a
/// sorted set and a total, are left alone so a mixed fleet never meets a wrong type).
fn window_key(stem: &str) -> String {
    format!("{stem}:w")
}

/// Estimated tokens of one call: a quarter of the request body's bytes (about four bytes
/// per token in English text; the real usage corrects it after the call) plus its output
/// cap.
pub fn token_estimate(body: &Map<String, Value>, model: &ModelConfig) -> u64 {
    let prompt = crate::quota::prompt_token_bound(body) / 4;
    let output = crate::quota::requested_output(body)
        .or(model.max_output_tokens)
        .unwrap_or(DEFAULT_OUTPUT_ESTIMATE)
        .saturating_mul(crate::quota::choices(body));
    prompt.saturating_add(output)
}

impl RateLimits {
    pub fn new(cfg: std::sync::Arc<Config>) -> RateLimits {
        RateLimits { cfg }
    }

    fn limits(&self, model: &str, tokens: u64) -> Vec<Limit> {
        let ns = &self.cfg.queue.namespace;
        let mut out = vec![];
        let Some(mc) = self.cfg.models.get(model) else {
            return out;
        };
        let scopes = [
            (
                format!("provider {}", mc.provider),
                format!("{{{ns}}}:rate:p:{}", mc.provider),
                self.cfg.providers.get(&mc.provider).map(|p| (p.rpm, p.tpm)),
            ),
            (
                format!("model {model}"),
                format!("{{{ns}}}:rate:m:{model}"),
                Some((mc.rpm, mc.tpm)),
            ),
        ];
        for (what, stem, limits) in scopes {
            let Some((rpm, tpm)) = limits else { continue };
            if let Some(rpm) = rpm {
                out.push(Limit {
                    what: format!("{what} (requests)"),
                    stem: format!("{stem}:rpm"),
                    limit: rpm.get(),
                    amount: 1,
                    tokens: false,
                });
            }
            if let Some(tpm) = tpm {
                out.push(Limit {
                    what: format!("{what} (tokens)"),
                    stem: format!("{stem}:tpm"),
                    limit: tpm.get(),
                    amount: tokens,
                    tokens: true,
                });
            }
        }
        out
    }

    /// The admission of one call of `model` estimated at `tokens` in every limit
    /// covering it (made by `gate::Gate::admit`); `None` when no limit covers it. `id`:
    /// the same for every try of one call.
    pub fn ask(&self, id: &str, model: &str, tokens: u64) -> Option<RateAsk> {
        let limits = self.limits(model, tokens);
        (!limits.is_empty()).then(|| RateAsk {
            id: id.to_string(),
            adm_key: format!("{{{}}}:rate:adm:{id}", self.cfg.queue.namespace),
            limits,
            tokens,
        })
    }
}

/// An admission to make: the limits covering one call.
pub struct RateAsk {
    pub(crate) id: String,
    /// The admission record (see `lua/quota_admit.lua`).
    pub(crate) adm_key: String,
    limits: Vec<Limit>,
    tokens: u64,
}

impl RateAsk {
    pub(crate) fn keys(&self) -> impl Iterator<Item = String> + '_ {
        self.limits.iter().map(|l| window_key(&l.stem))
    }
    /// Per limit: the limit, the amount this call takes.
    pub(crate) fn args(&self) -> Vec<u64> {
        self.limits
            .iter()
            .flat_map(|l| [l.limit, l.amount])
            .collect()
    }
    /// The error of limit `i` (from 0) having no room for `wait`.
    pub fn limited(&self, i: usize, wait: Duration) -> RateError {
        let l = &self.limits[i.min(self.limits.len() - 1)];
        RateError::Limited {
            what: l.what.clone(),
            limit: l.limit,
            wait,
        }
    }
    /// The admission once the script made it (its bucket is in its record).
    pub fn admission(self) -> Admission {
        Admission {
            adm_key: self.adm_key,
            token_keys: self
                .limits
                .iter()
                .filter(|l| l.tokens)
                .map(|l| window_key(&l.stem))
                .collect(),
            tokens: self.tokens,
        }
    }
}
