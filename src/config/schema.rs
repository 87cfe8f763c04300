//! The configuration schema: one struct per TOML table. Every field is documented; the
//! `_ms` keys are read and written as milliseconds but held as [`Duration`]s.

use super::prices::{opt_price, price};
use super::secret::Secret;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
use std::time::Duration;

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
    /// File holding the Redis password (one line; a trailing newline is dropped), e.g. a
    /// systemd credential (`$CREDENTIALS_DIRECTORY/redis-password`) or a mounted
    /// Kubernetes Secret. Used when `password_env` gives none; an unreadable or empty
    /// file is a config error. Empty = none.
    pub password_file: String,
    /// Redis ACL user (`AUTH <user> <password>`). Empty = the user in `url`
    /// (`redis://USER@host`), else `default`.
    pub username: String,
    /// True: `url` (and `urls`) are seed nodes of a Redis Cluster.
    pub cluster: bool,
    /// More seed nodes (with `cluster`), or the Sentinels (with `sentinel_master`), as
    /// `redis://host:port` URLs without a password.
    pub urls: Vec<String>,
    /// Non-empty: the master of this name is found through the Sentinels in `urls`
    /// (`SENTINEL get-master-addr-by-name`), again at every reconnect, so a failover is
    /// followed. `url` then gives only the scheme (TLS), user, password and db of the
    /// master; its host and port are not used.
    pub sentinel_master: String,
    /// Environment variable holding the Sentinels' own password (`requirepass` in
    /// sentinel.conf). Empty or unset = the Sentinels need none.
    pub sentinel_password_env: String,
    /// Filled by validation from `sentinel_password_env`.
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub sentinel_password: Option<Secret>,
    /// PEM file of the CA that signed the server's certificate, for `rediss://` with a
    /// private CA. Empty = the public web roots.
    pub tls_ca_file: String,
    /// Longest wait for the reply of one ordinary command or script, in ms. A connection
    /// on which a command timed out is dropped and a fresh one taken. Keep it well below
    /// `slots.ttl_ms` (validation requires at most a third of it) so a renewal that
    /// times out is retried before the lease runs out. 0 (the default) = a third of
    /// `slots.ttl_ms`, at most 1000 ms (filled in by validation).
    #[serde(with = "super::duration_ms")]
    pub command_timeout_ms: Duration,
    /// Refuse to start (exit 2) unless Redis's `maxmemory-policy` is `noeviction`; off =
    /// a loud warning only (see `daemon::check_eviction`).
    pub require_noeviction: bool,
    /// Filled by validation: from `password_env` when that variable is set and
    /// non-empty, else from `password_file`, else the password that was in `url`.
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub password: Option<Secret>,
}

/// The smallest accepted `queue.claim_idle_ms`. Two things run on fractions of it: the
/// keepalive every `claim_idle_ms / 3` (`worker::keepalive`), and the stall gate, set
/// when the fleet heartbeat is older than `claim_idle_ms / 2` (`lua/keepalive.lua`). The
/// keepalive plus its round trip must come round before the gate's gap, so the margin is
/// `claim_idle_ms / 6` for the round trip: 33 ms at this floor, none at all below
/// 100 ms (where the reclaimer's own 100 ms floor also stops following it). Tests run
/// at the floor; production wants minutes.
pub const CLAIM_IDLE_FLOOR: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    /// Hash tag of every key (`{ns}:jobs`, `{ns}:results`, ...): one Cluster slot.
    pub namespace: String,
    /// Consumer group shared by the fleet on `{ns}:jobs`.
    pub group: String,
    /// Empty = `<hostname>-<pid>` (resolved by validation).
    pub consumer: String,
    /// A pending entry idle this long (its worker stopped refreshing it) is taken over
    /// by another worker. At least [`CLAIM_IDLE_FLOOR`] (checked by validation).
    #[serde(with = "super::duration_ms")]
    pub claim_idle_ms: Duration,
    /// Deliveries after which a job is dead-lettered instead of run again (>= 1).
    pub max_deliveries: NonZeroU64,
    /// How long a result marker keeps a job id from running again; whole seconds in
    /// TOML (the contract's unit), at least 1.
    #[serde(with = "super::duration_ms::seconds")]
    pub dedupe_ttl_s: Duration,
    /// Approximate MAXLEN of `{ns}:results`.
    pub results_maxlen: u64,
    /// Largest accepted `payload` field, in bytes.
    pub max_payload_bytes: usize,
    /// XREADGROUP BLOCK, in ms (kept short so cancellation is noticed quickly).
    #[serde(with = "super::duration_ms")]
    pub block_ms: Duration,
    /// XDEL a job entry when it is acknowledged, so `{ns}:jobs` holds only the backlog.
    pub delete_acked: bool,
    /// The reclaimer removes other consumers of the group that own no pending entry and
    /// have been idle this long (stopped pods that did not exit cleanly), in ms.
    #[serde(with = "super::duration_ms")]
    pub consumer_idle_remove_ms: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Jobs worked on at once in this process, from the parse to the decision (a result
    /// to commit, or a hand-back). Absent = every pool's slots (N) summed (filled in by
    /// validation; see [`WorkerConfig::concurrency`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<NonZeroUsize>,
    /// Entries this process may hold beyond `concurrency`: read ahead and waiting for a
    /// job to end (so the next job starts the moment one ends, without a read on the
    /// way), or decided and committing. Absent = a quarter of `concurrency`, at least 1,
    /// when `concurrency` is absent too; 0 when it is set (filled in by validation). 0 =
    /// read only for a free place (and a job's place frees only at its commit's reply).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_ahead: Option<usize>,
    /// After the first signal, running calls get this long before they are cancelled
    /// (and their jobs handed back).
    #[serde(with = "super::duration_ms")]
    pub shutdown_grace_ms: Duration,
    /// Threads of the async runtime. 1 (the default) = one thread: the work per job is
    /// a few Redis round trips and one HTTP call, so one thread serves far more jobs
    /// than any provider quota allows (about 12,000 jobs/s on 2 cores with a 0 ms model,
    /// see docs/performance.md) and spends about half the CPU per job of a
    /// multi-threaded runtime (no cross-thread wake-ups). 0 = one per core.
    pub threads: usize,
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
    #[serde(with = "super::duration_ms")]
    pub ttl_ms: Duration,
    /// How long one job waits for a slot of one model before looking at the other
    /// models of its route (it then waits again; it never fails for lack of a slot).
    #[serde(with = "super::duration_ms")]
    pub acquire_timeout_ms: Duration,
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
    pub slots: NonZeroU32,
    /// Slots one tenant (a job's `tenant`) may hold at once, fleet-wide; 0 = no cap.
    /// A job of a tenant at its cap is parked, not held (see `tenants`).
    #[serde(default)]
    pub max_per_tenant: u32,
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
    #[serde(default = "default_provider_timeout", with = "super::duration_ms")]
    pub timeout_ms: Duration,
    /// Local limit of this process (governor).
    #[serde(default = "default_rps")]
    pub requests_per_second: NonZeroU32,
    /// Check the key at start with `GET {base_url}/models` (see `keycheck`): a 401/403
    /// stops the worker (exit 2), models it cannot see are left out of routing.
    #[serde(default = "yes")]
    pub validate_key: bool,
    /// Fleet-wide requests per minute through this provider (all workers together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<NonZeroU64>,
    /// Fleet-wide tokens per minute through this provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<NonZeroU64>,
    /// Filled by validation from `api_key_env`.
    #[serde(skip_deserializing, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Secret>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Key of the `[providers.*]` table this model is called through.
    pub provider: String,
    /// Key of the `[pools.*]` table whose slots bound this model's concurrent calls.
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
    /// USD per million input tokens written to the prompt cache (Anthropic-style cache
    /// creation); absent = they cost `input_per_mtok`.
    #[serde(default, with = "opt_price", skip_serializing_if = "Option::is_none")]
    pub cache_write_per_mtok: Option<Decimal>,
    /// Largest prompt plus completion, in tokens, the model accepts (> 0).
    pub context_window: u64,
    /// The model's output cap when a job sets no `max_tokens`: bounds the worst-case
    /// cost checked against a job's `max_cost_usd`. Absent = the whole context window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u64>,
    /// The most prompt tokens one media part (an image, audio, a file) of a request can
    /// be billed by this model: bounds the worst-case cost (budgets, `max_cost_usd`).
    /// Absent = `quota::MEDIA_PART_TOKEN_BOUND`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_media_tokens: Option<NonZeroU64>,
    /// Fleet-wide requests per minute of this model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<NonZeroU64>,
    /// Fleet-wide tokens per minute of this model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<NonZeroU64>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts on one model before the route moves to its next model (>= 1).
    pub max_attempts_per_model: NonZeroU32,
    /// First backoff delay; doubled per attempt with jitter.
    #[serde(with = "super::duration_ms")]
    pub base_delay_ms: Duration,
    /// Cap of the backoff delay.
    #[serde(with = "super::duration_ms")]
    pub max_delay_ms: Duration,
    /// Longest provider `Retry-After` honoured on the same model; longer moves on.
    #[serde(with = "super::duration_ms")]
    pub max_retry_after_ms: Duration,
}

fn default_provider_timeout() -> Duration {
    Duration::from_millis(60_000)
}
fn default_rps() -> NonZeroU32 {
    NonZeroU32::new(50).expect("50 > 0")
}
fn default_pool() -> String {
    "default".into()
}

impl WorkerConfig {
    /// Jobs in flight in this process (after validation, always the configured or the
    /// derived value; 32 only for a config that skipped validation).
    pub fn concurrency(&self) -> usize {
        self.concurrency.map_or(32, NonZeroUsize::get)
    }

    /// Entries held beyond `concurrency` (after validation, the configured or the derived
    /// value; 0 for a config that skipped validation).
    pub fn read_ahead(&self) -> usize {
        self.read_ahead.unwrap_or(0)
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            password_env: "REDIS_PASSWORD".into(),
            password_file: String::new(),
            username: String::new(),
            cluster: false,
            urls: vec![],
            sentinel_master: String::new(),
            sentinel_password_env: String::new(),
            sentinel_password: None,
            tls_ca_file: String::new(),
            command_timeout_ms: Duration::ZERO,
            require_noeviction: false,
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
            claim_idle_ms: Duration::from_millis(120_000),
            max_deliveries: NonZeroU64::new(5).expect("5 > 0"),
            dedupe_ttl_s: Duration::from_secs(86_400),
            results_maxlen: 1_000_000,
            max_payload_bytes: 1 << 20,
            block_ms: Duration::from_millis(1000),
            delete_acked: true,
            consumer_idle_remove_ms: Duration::from_millis(3_600_000),
        }
    }
}
impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: None,
            read_ahead: None,
            shutdown_grace_ms: Duration::from_millis(25_000),
            threads: 1,
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
            ttl_ms: Duration::from_millis(30_000),
            acquire_timeout_ms: Duration::from_millis(10_000),
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
            max_attempts_per_model: NonZeroU32::new(3).expect("3 > 0"),
            base_delay_ms: Duration::from_millis(500),
            max_delay_ms: Duration::from_millis(8000),
            max_retry_after_ms: Duration::from_millis(60_000),
        }
    }
}

/// What a worker does with a call a budget has no room for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnExhausted {
    /// Jobs the budget covers wait (in the stream) until it has room or its window ends.
    #[default]
    Pause,
    /// Only models whose worst case fits what is left are used.
    Cheaper,
    /// The job fails with `budget: ...`.
    Fail,
}

/// One `[budgets.<name>]` table: a fleet-wide spending limit per UTC day and/or month.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    /// USD per UTC day (a number or a decimal string).
    #[serde(default, with = "opt_price", skip_serializing_if = "Option::is_none")]
    pub usd_per_day: Option<Decimal>,
    /// USD per UTC calendar month.
    #[serde(default, with = "opt_price", skip_serializing_if = "Option::is_none")]
    pub usd_per_month: Option<Decimal>,
    /// Models it covers; empty = every model.
    #[serde(default)]
    pub models: Vec<String>,
    /// "" = the whole fleet, "*" = each tenant its own, or one tenant's name.
    #[serde(default)]
    pub tenant: String,
    #[serde(default)]
    pub on_exhausted: OnExhausted,
}

fn yes() -> bool {
    true
}

/// What a worker does with a prompt too long for a model's window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ContextPolicy {
    /// Drop the oldest non-system messages (never the system prompt, the last user turn,
    /// or half of a tool call / result pair) until it fits.
    #[default]
    Trim,
    /// A later model of the route with a larger window.
    Fallback,
    /// The job fails with `context: ...`.
    Fail,
}

impl ContextPolicy {
    /// The policy named by a job's `context_policy`.
    pub fn parse(s: &str) -> Option<ContextPolicy> {
        match s {
            "trim" => Some(ContextPolicy::Trim),
            "fallback" => Some(ContextPolicy::Fallback),
            "fail" => Some(ContextPolicy::Fail),
            _ => None,
        }
    }
}

/// `[context]`: prompts that do not fit a model's window.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContextConfig {
    pub policy: ContextPolicy,
    /// Act when prompt + requested output tokens exceed this share of the window (0..1].
    pub headroom: f64,
}

impl Default for ContextConfig {
    fn default() -> Self {
        ContextConfig {
            policy: ContextPolicy::Trim,
            headroom: 0.9,
        }
    }
}
