//! Configuration: TOML file + `LLM_WORKER__SECTION__KEY` environment overrides,
//! validated into typed values before anything starts.
//!
//! Invariants:
//! - every struct is `deny_unknown_fields`, so a typo in a key is an error naming the key;
//! - API keys are read from the environment variable a provider names and live only in
//!   [`Secret`], whose `Debug`/`Display`/`Serialize` print `[redacted]`;
//! - a validated [`Config`] has: at least one slot per pool, every route naming known
//!   models, every model naming a known provider and pool, prices between 0 and
//!   1,000,000 USD per million tokens with at most 6 decimal places (so costs are exact
//!   in pico-dollars and cannot overflow, see [`crate::cost`]);
//! - `redis.url` parses the way redis-rs parses it and holds no password (that moved
//!   into `redis.password`); [`redact_url`] is the one URL redactor.

mod duration_ms;
mod load;
mod prices;
mod schema;
mod secret;
mod validate;

pub use load::resolve_path;
pub use schema::{
    BudgetConfig, CLAIM_IDLE_FLOOR, ContextConfig, ContextPolicy, LogConfig, ModelConfig,
    OnExhausted, PoolConfig, ProviderConfig, QueueConfig, RedisConfig, RetryConfig, ServerConfig,
    SlotsConfig, WorkerConfig,
};
pub use secret::{Secret, SplitRedisUrl, redact_url, split_redis_url};

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The root of the configuration: one field per TOML table. A `Config` obtained from
/// [`Config::load`] or [`Config::from_toml_str`] is validated (see the module invariants).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where Redis is and how to authenticate.
    pub redis: RedisConfig,
    /// Stream names, consumer group and the reclaim / dead-letter rules.
    pub queue: QueueConfig,
    /// This process: jobs in flight, shutdown grace.
    pub worker: WorkerConfig,
    /// HTTP endpoint for health, readiness and metrics.
    pub server: ServerConfig,
    /// Fleet-wide slot leases.
    pub slots: SlotsConfig,
    /// Log format and filter.
    pub log: LogConfig,
    /// Concurrency pools by name; every model belongs to one.
    pub pools: BTreeMap<String, PoolConfig>,
    /// OpenAI-compatible endpoints by name.
    pub providers: BTreeMap<String, ProviderConfig>,
    /// Models by the name jobs use: provider, pool, prices.
    pub models: BTreeMap<String, ModelConfig>,
    /// Named fallback chains: route name -> model names in order of preference.
    pub routes: BTreeMap<String, Vec<String>>,
    /// Retry and backoff policy per model.
    pub retry: RetryConfig,
    /// Tier name -> the models a job of that tier may run on (its `tier` field).
    pub tiers: BTreeMap<String, Vec<String>>,
    /// Fleet-wide spending limits by name.
    pub budgets: BTreeMap<String, BudgetConfig>,
    /// Prompts too long for a model's window.
    pub context: ContextConfig,
    /// Models the provider's key cannot see (found at start by `keycheck`): left out of
    /// routing. Never read from or written to a file.
    #[serde(skip)]
    pub unavailable_models: std::collections::BTreeSet<String>,
    /// What the key check found per provider (one line each, no secret), recorded in
    /// Redis at start for `status`. Never read from or written to a file.
    #[serde(skip)]
    pub key_check: std::collections::BTreeMap<String, String>,
}

/// A configuration problem. `key` is the dotted path of the offending key
/// (e.g. `routes.default`, `providers.holysheep.api_key_env`); the process exits 2.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config error: {key}: {message}")]
    Invalid { key: String, message: String },
    #[error("config error: cannot read {path}: {message}")]
    File { path: String, message: String },
}

impl ConfigError {
    pub fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.into(),
        }
    }
}

impl Config {
    /// Reads the TOML file at `path`, applies `LLM_WORKER__...` overrides from `env`
    /// (the process environment, passed in so tests need no `set_var`), then validates.
    pub fn load(
        path: &std::path::Path,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<Config, ConfigError> {
        // Read the file ourselves (rather than `config::File::from(path)`) so that a missing
        // or unreadable file is a `ConfigError::File` with the OS reason, not a generic message.
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        load::build(&text, &path.display().to_string(), env)
    }

    /// As [`Config::load`] but from TOML text (tests, demo).
    pub fn from_toml_str(
        text: &str,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<Config, ConfigError> {
        load::build(text, "<inline config>", env)
    }

    /// The effective config as TOML, with secrets and URL passwords redacted.
    pub fn redacted_toml(&self) -> String {
        let mut shown = self.clone();
        // Validation already took the password out of the URL; redacting again keeps
        // this true for a `Config` changed after validation (the demo sets the URL).
        shown.redis.url = redact_url(&shown.redis.url);
        match toml::to_string(&shown) {
            Ok(s) => s,
            // Cannot happen for this shape (all maps keyed by strings, no bare `None`),
            // but a diagnostic line beats a panic in `check-config`.
            Err(e) => format!("# cannot render config as TOML: {e}\n"),
        }
    }

    /// The model name sent upstream for the model keyed `name`.
    pub fn upstream_name<'a>(&'a self, name: &'a str) -> &'a str {
        match self.models.get(name) {
            Some(m) if !m.upstream.is_empty() => &m.upstream,
            _ => name,
        }
    }
}

#[cfg(test)]
mod tests;

/// A validated config for unit tests: pool `default` (2 slots), provider `p` on a closed
/// loopback port, then `rest` (models, routes, tiers...).
#[cfg(test)]
pub(crate) fn test_config(rest: &str) -> Config {
    let text = format!(
        "[pools.default]\nslots = 2\n[providers.p]\nbase_url = \"http://127.0.0.1:1/v1\"\n{rest}"
    );
    Config::from_toml_str(&text, &std::collections::HashMap::new())
        .unwrap_or_else(|e| panic!("test config: {e}"))
}

/// Models `a` and `b` (1 USD per M tokens in and out, a 100-token window) on provider
/// `p`, and route `default` = a, b: a [`test_config`] body for unit tests.
#[cfg(test)]
pub(crate) const TEST_MODELS_AB: &str = r#"
[models.a]
provider = "p"
input_per_mtok = 1
output_per_mtok = 1
context_window = 100
[models.b]
provider = "p"
input_per_mtok = 1
output_per_mtok = 1
context_window = 100
[routes]
default = ["a", "b"]
"#;
