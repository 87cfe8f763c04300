//! The configuration schema: one struct per TOML table. Every field is documented; the
//! `_ms` keys are read and written as milliseconds but held as [`Duration`]s.

use super::prices::{opt_price, price};
use super::secret::Secret;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `redis://`, `rediss://` (TLS), `unix://` or `redis+unix://`, parsed at load the way
    /// redis-rs parses it. Validation moves a password in it (`user:PASSWORD@`,
    /// `?pass=PASSWORD`) into `password` and leaves the URL without it, so printing
    /// `redis.url` can never show a password.
    pub url: String,
    /// Environment variable holding the Redis password (used when set and non-empty).
    pub password_env: String,
    /// PEM file of the CA that signed the server's certificate, for `rediss://` with a
    /// private CA. Empty = the public web roots.
    pub tls_ca_file: String,
    /// Filled by validation: from `password_env` when that variable is set and
    /// non-empty, else the password that was in `url`.
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    pub namespace: String,
    pub group: String,
    /// Empty = `<hostname>-<pid>` (resolved by validation).
    pub consumer: String,
    pub claim_idle_ms: u64,
    pub max_deliveries: u64,
    pub dedupe_ttl_s: u64,
    pub results_maxlen: u64,
    /// Largest accepted `payload` field, in bytes.
    pub max_payload_bytes: usize,
    /// XREADGROUP BLOCK, in ms (kept short so cancellation is noticed quickly).
    pub block_ms: u64,
    /// XDEL a job entry when it is acknowledged, so `{ns}:jobs` holds only the backlog.
    pub delete_acked: bool,
    /// The reclaimer removes other consumers of the group that own no pending entry and
    /// have been idle this long (stopped pods that did not exit cleanly), in ms.
    pub consumer_idle_remove_ms: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Jobs in flight in this process.
    pub concurrency: usize,
    pub shutdown_grace_ms: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// `host:port` for /health, /ready, /metrics. Empty = no HTTP server.
    pub listen: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlotsConfig {
    /// A slot's lease; renewed while its call runs.
    pub ttl_ms: u64,
    /// How long one job waits for a slot of one model before looking at the other
    /// models of its route (it then waits again; it never fails for lack of a slot).
    pub acquire_timeout_ms: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: String,
    /// tracing EnvFilter directive; `RUST_LOG` overrides it.
    pub level: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// N: fleet-wide concurrent calls of this pool.
    pub slots: u32,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// e.g. `https://api.holysheep.ai/v1`; requests go to `{base_url}/chat/completions`.
    pub base_url: String,
    /// Environment variable holding the API key. Empty = no key (local servers).
    #[serde(default)]
    pub api_key_env: String,
    /// Per-attempt timeout.
    #[serde(default = "default_provider_timeout_ms")]
    pub timeout_ms: u64,
    /// Local limit of this process (governor).
    #[serde(default = "default_rps")]
    pub requests_per_second: u32,
    /// Filled by validation from `api_key_env`.
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Secret>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub provider: String,
    #[serde(default = "default_pool")]
    pub pool: String,
    /// The model id sent to the provider; empty = the table key.
    #[serde(default)]
    pub upstream: String,
    /// USD per million input tokens.
    #[serde(with = "price")]
    pub input_per_mtok: Decimal,
    /// USD per million output tokens.
    #[serde(with = "price")]
    pub output_per_mtok: Decimal,
    /// USD per million cached input tokens; absent = cached tokens cost `input_per_mtok`.
    #[serde(default, with = "opt_price", skip_serializing_if = "Option::is_none")]
    pub cached_input_per_mtok: Option<Decimal>,
    pub context_window: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    pub max_attempts_per_model: u32,
    pub base_delay_ms: u64,
    pub max_delay_ms: u64,
    pub max_retry_after_ms: u64,
}

fn default_provider_timeout_ms() -> u64 {
    60_000
}
fn default_rps() -> u32 {
    50
}
fn default_pool() -> String {
    "default".into()
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            password_env: "REDIS_PASSWORD".into(),
            tls_ca_file: String::new(),
            password: None,
        }
    }
}
impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            namespace: "llm".into(),
            group: "workers".into(),
            consumer: String::new(),
            claim_idle_ms: 120_000,
            max_deliveries: 5,
            dedupe_ttl_s: 86_400,
            results_maxlen: 1_000_000,
            max_payload_bytes: 1 << 20,
            block_ms: 1000,
            delete_acked: true,
            consumer_idle_remove_ms: 3_600_000,
        }
    }
}
impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 32,
            shutdown_grace_ms: 25_000,
        }
    }
}
impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "0.0.0.0:8080".into(),
        }
    }
}
impl Default for SlotsConfig {
    fn default() -> Self {
        SlotsConfig {
            ttl_ms: 30_000,
            acquire_timeout_ms: 10_000,
        }
    }
}
impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: "text".into(),
            level: "info".into(),
        }
    }
}
impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts_per_model: 3,
            base_delay_ms: 500,
            max_delay_ms: 8000,
            max_retry_after_ms: 60_000,
        }
    }
}
