//! Fleet-wide rate limits: `rpm` / `tpm` on `[providers.<p>]` and `[models.<m>]`,
//! enforced in Redis for every worker together (`lua/rate_admit.lua`: the last 60 s in
//! one-second buckets, a few O(1) commands per limit and call, no entry per call).
//! governor stays the local per-process limiter (`requests_per_second`).
//!
//! Invariants: a call is admitted in every limit that covers it or in none; a window
//! never holds more than its limit (one call larger than a whole tokens limit is
//! admitted alone into an empty window), so any 60 s sees at most the limit plus one
//! second's bucket; tokens are admitted at an estimate before the call and corrected to
//! the real usage after it, in the bucket they were admitted in (`lua/rate_settle.lua`).

use crate::config::{Config, ModelConfig};
use crate::connect::Commands;
use serde_json::{Map, Value};
use std::time::Duration;

/// The sliding window of every limit.
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

/// One admitted call: correct its tokens with [`RateLimits::settle`].
#[derive(Debug, Clone)]
pub struct Admission {
    /// The window of each tokens limit it was admitted in.
    token_keys: Vec<String>,
    tokens: u64,
    /// The server's unix second it was admitted in (its bucket).
    second: i64,
}

/// The fleet-wide limits of this config. Cheap to clone.
#[derive(Clone)]
pub struct RateLimits {
    cfg: std::sync::Arc<Config>,
    conn: Commands,
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
    pub fn new(cfg: std::sync::Arc<Config>, conn: Commands) -> RateLimits {
        RateLimits { cfg, conn }
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

    /// Admits one call of `model` estimated at `tokens` in every limit covering it.
    /// `Ok(None)`: no limit covers it (no round trip). `id`: the same for every try of
    /// one call (a try whose reply was lost is not admitted twice).
    pub async fn admit(
        &self,
        id: &str,
        model: &str,
        tokens: u64,
    ) -> Result<Option<Admission>, RateError> {
        let limits = self.limits(model, tokens);
        if limits.is_empty() {
            return Ok(None);
        }
        let mut inv = crate::scripts::RATE_ADMIT.prepare_invoke();
        inv.arg(id).arg(WINDOW.as_millis() as u64);
        for l in &limits {
            inv.key(window_key(&l.stem));
            inv.arg(l.limit).arg(l.amount);
        }
        let mut conn = self.conn.get().await?;
        let reply: Vec<i64> = inv.invoke_async(&mut conn).await?;
        if reply.first() == Some(&1) {
            return Ok(Some(Admission {
                token_keys: limits
                    .iter()
                    .filter(|l| l.tokens)
                    .map(|l| window_key(&l.stem))
                    .collect(),
                tokens,
                second: reply.get(1).copied().unwrap_or(0),
            }));
        }
        let i = (reply.get(1).copied().unwrap_or(1).max(1) as usize - 1).min(limits.len() - 1);
        let wait = Duration::from_millis(reply.get(2).copied().unwrap_or(1).max(1) as u64);
        metrics::counter!("llm_worker_rate_limited_total", "model" => model.to_string())
            .increment(1);
        Err(RateError::Limited {
            what: limits[i].what.clone(),
            limit: limits[i].limit,
            wait,
        })
    }

    /// Corrects the tokens of `a` to what the call really used.
    pub async fn settle(&self, a: &Admission, used: u64) -> Result<(), RateError> {
        if a.token_keys.is_empty() || used == a.tokens {
            return Ok(());
        }
        let mut inv = crate::scripts::RATE_SETTLE.prepare_invoke();
        for k in &a.token_keys {
            inv.key(k);
        }
        inv.arg(a.tokens).arg(used).arg(a.second);
        let mut conn = self.conn.get().await?;
        let _: i64 = inv.invoke_async(&mut conn).await?;
        Ok(())
    }
}
