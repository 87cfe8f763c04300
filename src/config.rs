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

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A secret value (API key, password). Never printed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The only way to read the secret: call sites are easy to audit.
    pub fn expose(&self) -> &str {
        &self.0
    }
}
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}
impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}
impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub redis: RedisConfig,
    pub queue: QueueConfig,
    pub worker: WorkerConfig,
    pub server: ServerConfig,
    pub slots: SlotsConfig,
    pub log: LogConfig,
    /// Concurrency pools by name; every model belongs to one.
    pub pools: BTreeMap<String, PoolConfig>,
    pub providers: BTreeMap<String, ProviderConfig>,
    pub models: BTreeMap<String, ModelConfig>,
    /// Named fallback chains: route name -> model names in order of preference.
    pub routes: BTreeMap<String, Vec<String>>,
    pub retry: RetryConfig,
}

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

/// Prices: TOML floats (or strings) -> exact `Decimal`, via the float's shortest
/// round-trip text, so `0.14` becomes exactly `0.14`.
mod price {
    use rust_decimal::Decimal;
    use serde::{Deserialize, Deserializer, Serializer};
    use std::str::FromStr;

    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum Raw {
        F(f64),
        I(i64),
        S(String),
    }
    pub(super) fn to_decimal(r: Raw) -> Result<Decimal, String> {
        let text = match r {
            Raw::F(f) => format!("{f}"),
            Raw::I(i) => i.to_string(),
            Raw::S(s) => s,
        };
        Decimal::from_str(text.trim()).map_err(|e| format!("not a decimal price {text:?}: {e}"))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Decimal, D::Error> {
        to_decimal(Raw::deserialize(d)?).map_err(serde::de::Error::custom)
    }
    pub fn serialize<S: Serializer>(v: &Decimal, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&v.normalize().to_string())
    }
}

mod opt_price {
    use rust_decimal::Decimal;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Decimal>, D::Error> {
        match Option::<super::price::Raw>::deserialize(d)? {
            None => Ok(None),
            Some(r) => super::price::to_decimal(r)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
    pub fn serialize<S: Serializer>(v: &Option<Decimal>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(&v.normalize().to_string()),
            None => s.serialize_none(),
        }
    }
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

/// Where the config file is: `--config PATH`, else `$LLM_WORKER_CONFIG`, else `config/default.toml`.
pub fn resolve_path(
    cli: Option<&std::path::Path>,
    env: &std::collections::HashMap<String, String>,
) -> std::path::PathBuf {
    if let Some(p) = cli {
        return p.to_path_buf();
    }
    match env.get(CONFIG_PATH_ENV) {
        // An empty variable is "unset" (as `LLM_WORKER_CONFIG= llm-worker` usually means).
        Some(p) if !p.is_empty() => std::path::PathBuf::from(p),
        _ => std::path::PathBuf::from(DEFAULT_CONFIG_PATH),
    }
}

/// Environment variable naming the config file (not an override: it has a single `_`).
const CONFIG_PATH_ENV: &str = "LLM_WORKER_CONFIG";
const DEFAULT_CONFIG_PATH: &str = "config/default.toml";
/// Only variables with this prefix are overrides; the separator between levels is `__`.
const ENV_OVERRIDE_PREFIX: &str = "LLM_WORKER__";

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
        build(&text, &path.display().to_string(), env)
    }

    /// As [`Config::load`] but from TOML text (tests, demo).
    pub fn from_toml_str(
        text: &str,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<Config, ConfigError> {
        build(text, "<inline config>", env)
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

/// Builds the layered config (file text, then `LLM_WORKER__` overrides), deserializes it
/// into [`Config`] and validates it. `origin` names the text in file-level errors.
fn build(
    text: &str,
    origin: &str,
    env: &std::collections::HashMap<String, String>,
) -> Result<Config, ConfigError> {
    use config::{Environment, File, FileFormat};

    // Only real overrides go to the config crate: `LLM_WORKER_CONFIG` (the file path) and
    // unrelated variables must never become keys.
    let overrides: config::Map<String, String> = env
        .iter()
        .filter(|(k, _)| k.starts_with(ENV_OVERRIDE_PREFIX) && k.len() > ENV_OVERRIDE_PREFIX.len())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();

    let mut environment = Environment::with_prefix("LLM_WORKER")
        .separator("__")
        .try_parsing(true);
    // A route is a list; from the environment it is written comma-separated
    // (`LLM_WORKER__ROUTES__DEFAULT=a,b`). Only those keys are split, so a comma in any
    // other value (a URL, say) stays as written. The config crate lowercases env keys
    // before comparing, hence the lowercase here.
    let route_prefix = format!("{ENV_OVERRIDE_PREFIX}ROUTES__");
    let route_keys: Vec<String> = overrides
        .keys()
        .filter_map(|k| k.strip_prefix(&route_prefix))
        .map(|name| format!("routes.{}", name.to_lowercase()))
        .collect();
    if !route_keys.is_empty() {
        environment = environment.list_separator(",");
        for key in &route_keys {
            environment = environment.with_list_parse_key(key);
        }
    }
    let environment = environment.source(Some(overrides));

    let layered = config::Config::builder()
        .add_source(File::from_str(text, FileFormat::Toml))
        .add_source(environment)
        .build()
        .map_err(|e| from_config_error(e, origin, env))?;
    let mut cfg: Config = layered
        .try_deserialize()
        .map_err(|e| from_config_error(e, origin, env))?;
    cfg.validate(env).map_err(|e| with_env_source(e, env))?;
    Ok(cfg)
}

/// Turns the config crate's error into ours with the dotted key of the offending value.
///
/// The config crate records where a value error happened (`Type`/`At` with `key`), but
/// serde's "unknown field `x`" is raised while reading the *parent* table, so its key is
/// the parent (`queue`) or absent (top level): the field name is appended here so that
/// the key is the one the operator wrote (`queue.bogus`).
fn from_config_error(
    e: config::ConfigError,
    origin: &str,
    env: &std::collections::HashMap<String, String>,
) -> ConfigError {
    let err = match e {
        config::ConfigError::Type {
            unexpected,
            expected,
            key,
            ..
        } => ConfigError::invalid(
            key.unwrap_or_default(),
            format!("invalid type: {unexpected}, expected {expected}"),
        ),
        config::ConfigError::At { error, key, .. } => {
            let (key, message) = key_and_message(key.unwrap_or_default(), &error.to_string());
            ConfigError::invalid(key, message)
        }
        config::ConfigError::Message(m) => {
            let (key, message) = key_and_message(String::new(), &m);
            ConfigError::invalid(key, message)
        }
        config::ConfigError::NotFound(key) => ConfigError::invalid(key, "missing value"),
        config::ConfigError::FileParse { cause, .. } => ConfigError::File {
            path: origin.to_string(),
            message: format!("not valid TOML: {cause}"),
        },
        other => ConfigError::invalid("", other.to_string()),
    };
    with_env_source(err, env)
}

/// Appends "(set by LLM_WORKER__A__B)" when the offending key came from an override, so
/// an operator who never wrote `a.b` in the file knows where to look.
fn with_env_source(
    err: ConfigError,
    env: &std::collections::HashMap<String, String>,
) -> ConfigError {
    let ConfigError::Invalid { key, message } = err else {
        return err;
    };
    let var = env.keys().find(|k| {
        k.strip_prefix(ENV_OVERRIDE_PREFIX)
            .is_some_and(|rest| rest.to_lowercase().replace("__", ".") == key)
    });
    match var {
        Some(var) => ConfigError::invalid(key, format!("{message} (set by {var})")),
        None => ConfigError::Invalid { key, message },
    }
}

/// Splits serde's "unknown field `x`, expected ..." / "missing field `x`" into the full
/// key (`parent.x`) and a message in config terms; other messages keep `parent` as key.
fn key_and_message(parent: String, message: &str) -> (String, String) {
    let join = |field: &str| {
        if parent.is_empty() {
            field.to_string()
        } else {
            format!("{parent}.{field}")
        }
    };
    for (marker, what) in [
        ("unknown field `", "unknown key"),
        ("missing field `", "missing key"),
    ] {
        if let Some(rest) = message.strip_prefix(marker)
            && let Some((field, tail)) = rest.split_once('`')
        {
            // serde: "unknown field `x`, expected one of `a`, `b`" / "..., there are no fields"
            let tail = tail.trim_start_matches(',').trim();
            let message = if tail.is_empty() {
                what.to_string()
            } else {
                format!("{what} ({tail})")
            };
            return (join(field), message);
        }
    }
    (parent, message.to_string())
}

/// A `redis.url` split in two: the URL without its password (safe to print, and what
/// [`Config`] keeps in `redis.url`) and the password, percent-decoded, as a [`Secret`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitRedisUrl {
    /// The URL as written, minus the password (`redis://user@host:6379/0`,
    /// `unix:///run/redis.sock?db=2`). Connecting with it plus `password` is the same as
    /// connecting with the original URL.
    pub url: String,
    /// From `redis://user:PASSWORD@host` or `unix:///path?pass=PASSWORD`.
    pub password: Option<Secret>,
}

/// The URL forms accepted in `redis.url`, for error messages (no values echoed: a URL that
/// does not parse cannot be redacted reliably).
const REDIS_URL_FORMS: &str = "redis://[user[:password]@]host[:port][/db], \
     rediss://...[#insecure], unix:///path/to/redis.sock[?db=N&user=U&pass=P]";

/// Parses a Redis URL with the rules redis-rs applies (`redis::IntoConnectionInfo` for
/// `&str`), so that a URL accepted here fails at connect time only for network reasons,
/// never for its syntax; and splits off the password.
///
/// Rules mirrored: scheme `redis`, `rediss`, `unix` or `redis+unix`; TCP: a host that is
/// not a wildcard address, a numeric port, a numeric database as the path, a UTF-8
/// user and password after percent-decoding, `#insecure` as the only fragment of
/// `rediss://`; unix: a socket path, `db` numeric; both: `protocol` one of 2, resp2, 3,
/// resp3. Stricter than redis-rs where it ignores a password silently (a `?pass=` on a
/// TCP URL, a `user:pass@` on a unix URL): those are errors rather than a connection
/// without the password the operator meant to send.
pub fn split_redis_url(raw: &str) -> Result<SplitRedisUrl, String> {
    let mut u = url::Url::parse(raw)
        .map_err(|e| format!("not a valid Redis URL ({e}); expected {REDIS_URL_FORMS}"))?;
    let query: Vec<(String, String)> = u
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    // redis-rs collects the query into a map: the last value of a name wins.
    let param = |name: &str| {
        query
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    if let Some(p) = param("protocol")
        && !matches!(p, "2" | "resp2" | "3" | "resp3")
    {
        return Err(format!(
            "query parameter protocol={p:?} is not one of 2, resp2, 3, resp3"
        ));
    }
    let decode = |what: &str, s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| format!("the {what} is not valid UTF-8 after percent-decoding"))
    };
    match u.scheme() {
        "redis" | "rediss" => {
            let host = match u.host() {
                Some(url::Host::Domain(d)) => d.to_string(),
                Some(url::Host::Ipv4(a)) => a.to_string(),
                Some(url::Host::Ipv6(a)) => a.to_string(),
                None => return Err(format!("has no host; expected {REDIS_URL_FORMS}")),
            };
            if host == "0.0.0.0" || host == "::" {
                return Err(format!(
                    "host {host} is a wildcard address; name the server to connect to"
                ));
            }
            let db = u.path().trim_matches('/');
            if !db.is_empty() && db.parse::<i64>().is_err() {
                return Err(format!(
                    "database {db:?} (the path) is not a number; write redis://host:port/<db>, e.g. /0"
                ));
            }
            if u.scheme() == "rediss" && !matches!(u.fragment(), None | Some("insecure")) {
                return Err("the only fragment rediss:// accepts is #insecure".into());
            }
            if param("pass").is_some() || param("password").is_some() {
                return Err(
                    "a password in the query is ignored by redis://; write redis://:PASSWORD@host or use redis.password_env"
                        .into(),
                );
            }
            decode("user name", u.username())?;
            let password = match u.password() {
                Some(p) => Some(Secret::new(decode("password", p)?)),
                None => None,
            };
            if password.is_some() && u.set_password(None).is_err() {
                return Err("cannot remove the password from the URL".into());
            }
            Ok(SplitRedisUrl {
                url: u.to_string(),
                password,
            })
        }
        "unix" | "redis+unix" => {
            if u.to_file_path().is_err() {
                return Err(format!(
                    "has no absolute socket path; expected {REDIS_URL_FORMS}"
                ));
            }
            if u.password().is_some() || !u.username().is_empty() {
                return Err(
                    "a unix:// URL takes its user and password as ?user=U&pass=P, not before an @"
                        .into(),
                );
            }
            if let Some(db) = param("db")
                && db.parse::<i64>().is_err()
            {
                return Err(format!(
                    "query parameter db={db:?} is not a number; write ?db=0"
                ));
            }
            let password = param("pass").map(Secret::new);
            let kept: Vec<&(String, String)> = query.iter().filter(|(k, _)| k != "pass").collect();
            if kept.len() != query.len() {
                if kept.is_empty() {
                    u.set_query(None);
                } else {
                    u.query_pairs_mut().clear().extend_pairs(kept);
                }
            }
            Ok(SplitRedisUrl {
                url: u.to_string(),
                password,
            })
        }
        other => Err(format!(
            "scheme {other}:// is not one of redis://, rediss://, unix://, redis+unix://"
        )),
    }
}

/// The one URL redactor: any URL -> the same URL with every password replaced by
/// `[redacted]` (the userinfo password, and `pass`/`password` query parameters as
/// `unix://` URLs carry them). For logs and output (`check-config`, `status`, the
/// start-up error, the demo).
///
/// Invariant: the result never contains a password of `url`. A text that does not parse
/// as a URL is not echoed at all (its password could sit anywhere in it).
pub fn redact_url(url: &str) -> String {
    // A marker that survives URL serialisation unescaped, swapped for `[redacted]` at the
    // end (brackets would be percent-encoded in userinfo and query).
    const MARK: &str = "REDACTEDx9q7MARK";
    let Ok(mut u) = url::Url::parse(url) else {
        return "[a URL that does not parse; not shown]".to_string();
    };
    if u.password().is_some() && u.set_password(Some(MARK)).is_err() {
        return "[a URL whose password cannot be masked; not shown]".to_string();
    }
    let secret_param = |k: &str| {
        let k = k.to_ascii_lowercase();
        k == "pass" || k == "password"
    };
    if u.query_pairs().any(|(k, _)| secret_param(&k)) {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret_param(&k) {
                    MARK.to_string()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string().replace(MARK, "[redacted]")
}

/// `<hostname>-<pid>`: `$HOSTNAME`, else `/etc/hostname`, else `worker`.
fn default_consumer(env: &std::collections::HashMap<String, String>) -> String {
    let host = env
        .get("HOSTNAME")
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "worker".to_string());
    format!("{host}-{}", std::process::id())
}

use crate::cost::{MAX_PRICE_PER_MTOK, MAX_PRICE_SCALE};

fn check_price(key: String, value: Decimal) -> Result<(), ConfigError> {
    if value.is_sign_negative() && !value.is_zero() {
        return Err(ConfigError::invalid(
            key,
            format!("price must not be negative, got {value}"),
        ));
    }
    // The cap keeps every cost computable exactly (see `cost`): no overflow for any
    // token count a provider can report.
    if value > MAX_PRICE_PER_MTOK {
        return Err(ConfigError::invalid(
            key,
            format!(
                "price {value} USD per million tokens is above the maximum {MAX_PRICE_PER_MTOK}; check the unit (USD per million tokens, not per token)"
            ),
        ));
    }
    if value.normalize().scale() > MAX_PRICE_SCALE {
        return Err(ConfigError::invalid(
            key,
            format!(
                "price {value} has more than {MAX_PRICE_SCALE} decimal places (USD per million tokens)"
            ),
        ));
    }
    Ok(())
}

fn require(ok: bool, key: &str, message: impl Into<String>) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError::invalid(key, message))
    }
}

impl Config {
    /// Checks every cross-reference and range, and fills the derived fields
    /// (`api_key`, `redis.password`, `queue.consumer`). The first problem found is returned.
    fn validate(
        &mut self,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<(), ConfigError> {
        self.validate_redis(env)?;
        self.validate_queue(env)?;
        self.validate_process()?;
        self.validate_pools_providers_models()?;
        self.validate_routes()?;
        self.resolve_api_keys(env)?;
        Ok(())
    }

    fn validate_redis(
        &mut self,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<(), ConfigError> {
        // The password leaves the URL here, so no later print of `redis.url` can show it.
        let split =
            split_redis_url(&self.redis.url).map_err(|m| ConfigError::invalid("redis.url", m))?;
        self.redis.url = split.url;
        let url = &self.redis.url;
        if !self.redis.tls_ca_file.is_empty() {
            require(
                url.starts_with("rediss://"),
                "redis.tls_ca_file",
                "is only used with a rediss:// url",
            )?;
            require(
                std::fs::metadata(&self.redis.tls_ca_file).is_ok_and(|m| m.is_file()),
                "redis.tls_ca_file",
                format!("cannot read {:?}", self.redis.tls_ca_file),
            )?;
        }
        // The password is optional: a missing variable means "no password" (local Redis).
        // The variable wins over a password in the URL (as it always has: it is the one
        // an operator can change without editing the file).
        self.redis.password = split.password;
        if !self.redis.password_env.is_empty()
            && let Some(pw) = env.get(&self.redis.password_env)
            && !pw.is_empty()
        {
            self.redis.password = Some(Secret::new(pw.clone()));
        }
        Ok(())
    }

    fn validate_queue(
        &mut self,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<(), ConfigError> {
        let q = &mut self.queue;
        require(
            !q.namespace.is_empty(),
            "queue.namespace",
            "must not be empty",
        )?;
        // The namespace becomes the hash tag `{ns}`: a brace would break the tag (and so
        // the one-cluster-slot guarantee), whitespace makes keys awkward to type.
        require(
            !q.namespace
                .chars()
                .any(|c| c == '{' || c == '}' || c.is_whitespace()),
            "queue.namespace",
            format!(
                "must not contain '{{', '}}' or whitespace, got {:?}",
                q.namespace
            ),
        )?;
        require(!q.group.is_empty(), "queue.group", "must not be empty")?;
        require(
            q.consumer_idle_remove_ms > 0,
            "queue.consumer_idle_remove_ms",
            "must be greater than 0",
        )?;
        require(
            q.max_deliveries >= 1,
            "queue.max_deliveries",
            "must be at least 1",
        )?;
        require(
            q.claim_idle_ms > 0,
            "queue.claim_idle_ms",
            "must be greater than 0",
        )?;
        require(
            q.dedupe_ttl_s > 0,
            "queue.dedupe_ttl_s",
            "must be greater than 0",
        )?;
        require(
            q.results_maxlen > 0,
            "queue.results_maxlen",
            "must be greater than 0",
        )?;
        require(
            q.max_payload_bytes > 0,
            "queue.max_payload_bytes",
            "must be greater than 0",
        )?;
        require(
            (1..=10_000).contains(&q.block_ms),
            "queue.block_ms",
            format!("must be between 1 and 10000, got {}", q.block_ms),
        )?;
        if q.consumer.is_empty() {
            q.consumer = default_consumer(env);
        }
        Ok(())
    }

    fn validate_process(&self) -> Result<(), ConfigError> {
        require(
            self.worker.concurrency >= 1,
            "worker.concurrency",
            "must be at least 1",
        )?;
        // Short TTLs are allowed (tests use 1-2 s), but below 100 ms renewals could not keep up.
        require(
            self.slots.ttl_ms >= 100,
            "slots.ttl_ms",
            format!("must be at least 100, got {}", self.slots.ttl_ms),
        )?;
        require(
            self.slots.acquire_timeout_ms > 0,
            "slots.acquire_timeout_ms",
            "must be greater than 0",
        )?;
        let r = &self.retry;
        require(
            r.max_attempts_per_model >= 1,
            "retry.max_attempts_per_model",
            "must be at least 1",
        )?;
        require(
            r.base_delay_ms <= r.max_delay_ms,
            "retry.base_delay_ms",
            format!(
                "must not exceed retry.max_delay_ms ({} > {})",
                r.base_delay_ms, r.max_delay_ms
            ),
        )?;
        require(
            matches!(self.log.format.as_str(), "text" | "json"),
            "log.format",
            format!("must be \"text\" or \"json\", got {:?}", self.log.format),
        )?;
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            return Err(ConfigError::invalid(
                "log.level",
                format!("not a valid filter directive {:?}: {e}", self.log.level),
            ));
        }
        if !self.server.listen.is_empty()
            && let Err(e) = self.server.listen.parse::<std::net::SocketAddr>()
        {
            return Err(ConfigError::invalid(
                "server.listen",
                format!(
                    "must be empty or host:port with an IP address, got {:?}: {e}",
                    self.server.listen
                ),
            ));
        }
        Ok(())
    }

    fn validate_pools_providers_models(&self) -> Result<(), ConfigError> {
        require(
            !self.pools.is_empty(),
            "pools",
            "at least one pool is required, e.g. [pools.default] slots = 8",
        )?;
        for (name, pool) in &self.pools {
            require(
                pool.slots > 0,
                &format!("pools.{name}.slots"),
                "must be at least 1",
            )?;
        }
        for (name, p) in &self.providers {
            require(
                p.base_url.starts_with("http://") || p.base_url.starts_with("https://"),
                &format!("providers.{name}.base_url"),
                format!("must start with http:// or https://, got {:?}", p.base_url),
            )?;
            require(
                p.timeout_ms > 0,
                &format!("providers.{name}.timeout_ms"),
                "must be greater than 0",
            )?;
            require(
                p.requests_per_second > 0,
                &format!("providers.{name}.requests_per_second"),
                "must be greater than 0",
            )?;
        }
        for (name, m) in &self.models {
            require(
                self.providers.contains_key(&m.provider),
                &format!("models.{name}.provider"),
                format!(
                    "unknown provider {:?} (known: {})",
                    m.provider,
                    known(self.providers.keys())
                ),
            )?;
            require(
                self.pools.contains_key(&m.pool),
                &format!("models.{name}.pool"),
                format!(
                    "unknown pool {:?} (known: {})",
                    m.pool,
                    known(self.pools.keys())
                ),
            )?;
            require(
                m.context_window > 0,
                &format!("models.{name}.context_window"),
                "must be greater than 0",
            )?;
            check_price(format!("models.{name}.input_per_mtok"), m.input_per_mtok)?;
            check_price(format!("models.{name}.output_per_mtok"), m.output_per_mtok)?;
            if let Some(c) = m.cached_input_per_mtok {
                check_price(format!("models.{name}.cached_input_per_mtok"), c)?;
            }
        }
        Ok(())
    }

    fn validate_routes(&mut self) -> Result<(), ConfigError> {
        // Entries from `LLM_WORKER__ROUTES__X=a, b` may carry spaces around the commas.
        for models in self.routes.values_mut() {
            for m in models.iter_mut() {
                let trimmed = m.trim();
                if trimmed.len() != m.len() {
                    *m = trimmed.to_string();
                }
            }
        }
        require(
            self.routes.contains_key("default"),
            "routes.default",
            "the route \"default\" is required (used by jobs that name no route)",
        )?;
        for (name, models) in &self.routes {
            let key = format!("routes.{name}");
            require(!models.is_empty(), &key, "must name at least one model")?;
            for (i, m) in models.iter().enumerate() {
                require(
                    self.models.contains_key(m),
                    &key,
                    format!("unknown model {m:?} (known: {})", known(self.models.keys())),
                )?;
                require(
                    !models[..i].contains(m),
                    &key,
                    format!("model {m:?} appears more than once"),
                )?;
            }
        }
        Ok(())
    }

    /// Reads the API key of every provider that at least one model uses. A provider no
    /// model refers to is never called, so a missing key for it is not an error (this
    /// lets one file list providers that only some deployments have keys for).
    fn resolve_api_keys(
        &mut self,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<(), ConfigError> {
        let used: std::collections::BTreeSet<String> =
            self.models.values().map(|m| m.provider.clone()).collect();
        for (name, p) in self.providers.iter_mut() {
            if p.api_key_env.is_empty() || !used.contains(name) {
                continue;
            }
            match env.get(&p.api_key_env) {
                Some(v) if !v.is_empty() => p.api_key = Some(Secret::new(v.clone())),
                _ => {
                    return Err(ConfigError::invalid(
                        format!("providers.{name}.api_key_env"),
                        format!(
                            "environment variable {} is not set (export it, or set api_key_env = \"\" for a local server)",
                            p.api_key_env
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn known<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&str> = names.map(String::as_str).collect();
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::str::FromStr;

    const DEFAULT: &str = include_str!("../config/default.toml");
    const DEMO: &str = include_str!("../config/demo.toml");
    const KEY: &str = "sk-test-SECRET-0123456789";

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn with_key(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        let mut e = env(pairs);
        e.insert("HOLYSHEEP_API_KEY".into(), KEY.into());
        e
    }

    /// The key of an `Invalid` error (panics on success or `File`).
    fn err_key(r: Result<Config, ConfigError>) -> (String, String) {
        match r {
            Err(ConfigError::Invalid { key, message }) => (key, message),
            Err(other) => panic!("expected Invalid, got {other:?}"),
            Ok(_) => panic!("expected an error, got a valid config"),
        }
    }

    /// The demo config with `line` appended to the TOML (later keys in a table must be new).
    fn demo_plus(extra: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(&format!("{DEMO}\n{extra}\n"), &env(&[]))
    }

    /// The demo config with one exact substring replaced.
    fn demo_with(from: &str, to: &str) -> Result<Config, ConfigError> {
        assert!(DEMO.contains(from), "demo.toml lacks {from:?}");
        Config::from_toml_str(&DEMO.replacen(from, to, 1), &env(&[]))
    }

    #[test]
    fn config_default_loads_with_api_key() {
        let c = Config::from_toml_str(DEFAULT, &with_key(&[])).expect("default.toml");
        assert_eq!(c.pools["default"].slots, 8);
        let p = &c.providers["holysheep"];
        assert_eq!(p.base_url, "https://api.holysheep.ai/v1");
        assert_eq!(p.api_key.as_ref().map(Secret::expose), Some(KEY));
        assert_eq!(
            c.routes["default"],
            ["deepseek-v3.2", "gemini-2.5-flash", "gpt-4.1"]
        );
        assert_eq!(c.routes["quality"], ["claude-sonnet-4.5", "gpt-4.1"]);
        assert_eq!(c.models.len(), 4);
        assert_eq!(c.server.listen, "0.0.0.0:8080");
    }

    #[test]
    fn config_default_without_api_key_names_the_key() {
        let (key, message) = err_key(Config::from_toml_str(DEFAULT, &env(&[])));
        assert_eq!(key, "providers.holysheep.api_key_env");
        assert!(message.contains("HOLYSHEEP_API_KEY"), "{message}");
        // An empty variable counts as unset.
        let (key, _) = err_key(Config::from_toml_str(
            DEFAULT,
            &env(&[("HOLYSHEEP_API_KEY", "")]),
        ));
        assert_eq!(key, "providers.holysheep.api_key_env");
    }

    #[test]
    fn config_unused_provider_needs_no_key() {
        let c = demo_plus(
            "[providers.other]\nbase_url = \"https://x.example/v1\"\napi_key_env = \"OTHER_KEY_UNSET\"",
        )
        .expect("unused provider");
        assert!(c.providers["other"].api_key.is_none());
    }

    #[test]
    fn config_demo_loads_with_empty_env() {
        let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo.toml");
        assert_eq!(c.pools["default"].slots, 4);
        assert_eq!(c.models["deepseek-v3.2"].provider, "sim");
        assert_eq!(c.models["gpt-4.1"].provider, "sim-b");
        assert!(c.providers.values().all(|p| p.api_key.is_none()));
        assert_eq!(c.server.listen, "");
        assert_eq!(c.worker.concurrency, 16);
        assert_eq!(c.retry.base_delay_ms, 50);
        assert_eq!(c.slots.acquire_timeout_ms, 2000);
    }

    #[test]
    fn config_prices_are_exact() {
        let c = Config::from_toml_str(DEFAULT, &with_key(&[])).expect("default.toml");
        let d = |s: &str| Decimal::from_str(s).expect("decimal");
        let m = &c.models["deepseek-v3.2"];
        assert_eq!(m.input_per_mtok, d("0.14"));
        assert_eq!(m.output_per_mtok, d("0.42"));
        assert_eq!(m.cached_input_per_mtok, Some(d("0.028")));
        assert_eq!(
            c.models["gemini-2.5-flash"].cached_input_per_mtok,
            Some(d("0.025"))
        );
        assert_eq!(c.models["claude-sonnet-4.5"].output_per_mtok, d("15"));
    }

    #[test]
    fn config_price_precision_and_sign() {
        let (key, _) = err_key(demo_with(
            "input_per_mtok = 0.14 ",
            "input_per_mtok = 0.1400001 ",
        ));
        assert_eq!(key, "models.deepseek-v3.2.input_per_mtok");
        let (key, _) = err_key(demo_with(
            "output_per_mtok = 0.42",
            "output_per_mtok = -0.42",
        ));
        assert_eq!(key, "models.deepseek-v3.2.output_per_mtok");
        // Issue 8 point 3: a price above the cap would let a cost overflow.
        let (key, message) = err_key(demo_with(
            "output_per_mtok = 0.42",
            "output_per_mtok = \"100000000000000000000\"",
        ));
        assert_eq!(key, "models.deepseek-v3.2.output_per_mtok");
        assert!(message.contains("1000000"), "{message}");
        demo_with("output_per_mtok = 0.42", "output_per_mtok = 1000000")
            .expect("the cap itself is allowed");
        // Six places are fine, and strings are accepted too.
        demo_with("input_per_mtok = 0.14 ", "input_per_mtok = \"0.140001\" ")
            .expect("six decimal places");
    }

    #[test]
    fn config_unknown_key_in_file() {
        let (key, message) = err_key(demo_with("[queue]\n", "[queue]\nbogus = 1\n"));
        assert_eq!(key, "queue.bogus");
        assert!(message.starts_with("unknown key"), "{message}");
        let (key, _) = err_key(demo_plus("[bogus]\nx = 1"));
        assert_eq!(key, "bogus");
        let (key, _) = err_key(demo_with(
            "context_window = 128000",
            "context_window = 128000\ncontext_windw = 1",
        ));
        assert_eq!(key, "models.deepseek-v3.2.context_windw");
    }

    #[test]
    fn config_unknown_key_via_env() {
        let e = env(&[("LLM_WORKER__QUEUE__BOGUS", "1")]);
        let (key, message) = err_key(Config::from_toml_str(DEMO, &e));
        assert_eq!(key, "queue.bogus");
        assert!(message.starts_with("unknown key"), "{message}");
        assert!(
            message.ends_with("(set by LLM_WORKER__QUEUE__BOGUS)"),
            "{message}"
        );
        let e = env(&[("LLM_WORKER__BOGUS", "1")]);
        assert_eq!(err_key(Config::from_toml_str(DEMO, &e)).0, "bogus");
    }

    #[test]
    fn config_path_variable_is_not_an_override() {
        let e = env(&[
            ("LLM_WORKER_CONFIG", "/elsewhere.toml"),
            ("LLM_WORKER_SOMETHING", "x"),
            ("PATH", "/usr/bin"),
        ]);
        Config::from_toml_str(DEMO, &e).expect("only LLM_WORKER__ vars are overrides");
    }

    #[test]
    fn config_type_error_names_key() {
        let (key, message) = err_key(demo_with("slots = 4", "slots = \"abc\""));
        assert_eq!(key, "pools.default.slots");
        assert!(message.contains("abc"), "{message}");
        let e = env(&[("LLM_WORKER__WORKER__CONCURRENCY", "lots")]);
        assert_eq!(
            err_key(Config::from_toml_str(DEMO, &e)).0,
            "worker.concurrency"
        );
    }

    #[test]
    fn config_missing_required_key_names_it() {
        let (key, message) = err_key(demo_with("context_window = 128000", ""));
        assert_eq!(key, "models.deepseek-v3.2.context_window");
        assert!(message.contains("missing"), "{message}");
    }

    #[test]
    fn config_route_with_unknown_model() {
        let (key, message) = err_key(demo_with(
            "quality = [\"claude-sonnet-4.5\", \"gpt-4.1\"]",
            "quality = [\"claude-sonnet-4.5\", \"gpt-5\"]",
        ));
        assert_eq!(key, "routes.quality");
        assert!(message.contains("gpt-5"), "{message}");
    }

    #[test]
    fn config_route_rules() {
        let (key, _) = err_key(demo_with(
            "default = [\"deepseek-v3.2\", \"gemini-2.5-flash\", \"gpt-4.1\"]",
            "main = [\"gpt-4.1\"]",
        ));
        assert_eq!(key, "routes.default");
        let (key, _) = err_key(demo_with(
            "quality = [\"claude-sonnet-4.5\", \"gpt-4.1\"]",
            "quality = []",
        ));
        assert_eq!(key, "routes.quality");
        let (key, message) = err_key(demo_with(
            "quality = [\"claude-sonnet-4.5\", \"gpt-4.1\"]",
            "quality = [\"gpt-4.1\", \"claude-sonnet-4.5\", \"gpt-4.1\"]",
        ));
        assert_eq!(key, "routes.quality");
        assert!(message.contains("more than once"), "{message}");
    }

    #[test]
    fn config_route_override_from_env() {
        let e = env(&[("LLM_WORKER__ROUTES__DEFAULT", "gpt-4.1, deepseek-v3.2")]);
        let c = Config::from_toml_str(DEMO, &e).expect("route override");
        assert_eq!(c.routes["default"], ["gpt-4.1", "deepseek-v3.2"]);
        // Other values keep their commas.
        let e = env(&[
            ("LLM_WORKER__ROUTES__DEFAULT", "gpt-4.1"),
            ("LLM_WORKER__QUEUE__GROUP", "a,b"),
        ]);
        let c = Config::from_toml_str(DEMO, &e).expect("single-model route");
        assert_eq!(c.routes["default"], ["gpt-4.1"]);
        assert_eq!(c.queue.group, "a,b");
    }

    #[test]
    fn config_model_with_unknown_provider_or_pool() {
        let (key, message) = err_key(demo_with("provider = \"sim-b\"", "provider = \"nope\""));
        assert_eq!(key, "models.gpt-4.1.provider");
        assert!(message.contains("nope"), "{message}");
        let (key, message) = err_key(demo_with(
            "provider = \"sim\"\npool = \"default\"",
            "provider = \"sim\"\npool = \"gpu\"",
        ));
        assert_eq!(key, "models.gemini-2.5-flash.pool");
        assert!(message.contains("gpu"), "{message}");
    }

    #[test]
    fn config_pools() {
        let (key, _) = err_key(demo_with("slots = 4", "slots = 0"));
        assert_eq!(key, "pools.default.slots");
        let e = env(&[("LLM_WORKER__POOLS__DEFAULT__SLOTS", "16")]);
        let c = Config::from_toml_str(DEMO, &e).expect("slots override");
        assert_eq!(c.pools["default"].slots, 16);
        let e = env(&[("LLM_WORKER__POOLS__DEFAULT__SLOTS", "0")]);
        let (key, message) = err_key(Config::from_toml_str(DEMO, &e));
        assert_eq!(key, "pools.default.slots");
        assert!(
            message.ends_with("(set by LLM_WORKER__POOLS__DEFAULT__SLOTS)"),
            "{message}"
        );
        let (key, _) = err_key(demo_with("[pools.default]\nslots = 4", ""));
        assert_eq!(key, "pools");
    }

    #[test]
    fn config_env_overrides_scalars() {
        let e = env(&[
            ("LLM_WORKER__REDIS__URL", "redis://10.0.0.5:6379"),
            ("LLM_WORKER__QUEUE__NAMESPACE", "jobs2"),
            ("LLM_WORKER__WORKER__CONCURRENCY", "4"),
        ]);
        let c = Config::from_toml_str(DEMO, &e).expect("overrides");
        assert_eq!(c.redis.url, "redis://10.0.0.5:6379");
        assert_eq!(c.queue.namespace, "jobs2");
        assert_eq!(c.worker.concurrency, 4);
    }

    #[test]
    fn config_range_checks_name_keys() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "url = \"redis://127.0.0.1:6379\"",
                "url = \"http://x\"",
                "redis.url",
            ),
            (
                "namespace = \"llm\"",
                "namespace = \"l{m}\"",
                "queue.namespace",
            ),
            ("namespace = \"llm\"", "namespace = \"\"", "queue.namespace"),
            ("group = \"workers\"", "group = \"\"", "queue.group"),
            (
                "max_deliveries = 5",
                "max_deliveries = 0",
                "queue.max_deliveries",
            ),
            ("block_ms = 1000", "block_ms = 20000", "queue.block_ms"),
            ("concurrency = 16", "concurrency = 0", "worker.concurrency"),
            ("ttl_ms = 10000", "ttl_ms = 50", "slots.ttl_ms"),
            ("format = \"text\"", "format = \"xml\"", "log.format"),
            ("listen = \"\"", "listen = \"nowhere\"", "server.listen"),
            (
                "base_delay_ms = 50",
                "base_delay_ms = 5000",
                "retry.base_delay_ms",
            ),
            (
                "base_url = \"http://127.0.0.1:8089/v1\"",
                "base_url = \"127.0.0.1:8089\"",
                "providers.sim.base_url",
            ),
            (
                "context_window = 128000",
                "context_window = 0",
                "models.deepseek-v3.2.context_window",
            ),
        ];
        for (from, to, want) in cases {
            assert_eq!(&err_key(demo_with(from, to)).0, want, "{from} -> {to}");
        }
        demo_with("listen = \"\"", "listen = \"127.0.0.1:0\"").expect("socket address");
    }

    #[test]
    fn config_consumer_default_filled() {
        let c = Config::from_toml_str(DEMO, &env(&[("HOSTNAME", "box7")])).expect("demo");
        assert_eq!(c.queue.consumer, format!("box7-{}", std::process::id()));
        let c = demo_with("consumer = \"\"", "consumer = \"me\"").expect("demo");
        assert_eq!(c.queue.consumer, "me");
    }

    #[test]
    fn config_redis_password_from_env() {
        let c = Config::from_toml_str(DEMO, &env(&[("REDIS_PASSWORD", "pw123")])).expect("demo");
        assert_eq!(c.redis.password.as_ref().map(Secret::expose), Some("pw123"));
        let c = Config::from_toml_str(DEMO, &env(&[])).expect("demo");
        assert!(c.redis.password.is_none());
    }

    #[test]
    fn config_redacted_toml_hides_secrets_and_round_trips() {
        let e = with_key(&[
            (
                "LLM_WORKER__REDIS__URL",
                "redis://user:hunter2@db.example:6380/0",
            ),
            ("REDIS_PASSWORD", "pw-from-env"),
        ]);
        let c = Config::from_toml_str(DEFAULT, &e).expect("default.toml");
        let text = c.redacted_toml();
        assert!(!text.contains(KEY), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(!text.contains("pw-from-env"), "{text}");
        // The password left the URL at load; `password` shows that there is one.
        assert!(
            text.contains("url = \"redis://user@db.example:6380/0\""),
            "{text}"
        );
        assert!(text.contains("password = \"[redacted]\""), "{text}");
        // Valid TOML, and (secrets aside) it loads back into the same config.
        let value: toml::Table = toml::from_str(&text).expect("valid TOML");
        assert!(value.contains_key("models"));
        let stripped: String = text
            .lines()
            .filter(|l| !l.starts_with("api_key =") && !l.starts_with("password ="))
            .map(|l| format!("{l}\n"))
            .collect();
        let back = Config::from_toml_str(&stripped, &with_key(&[])).expect("round trip");
        assert_eq!(
            back.models["deepseek-v3.2"].input_per_mtok,
            c.models["deepseek-v3.2"].input_per_mtok
        );
        assert_eq!(back.routes, c.routes);
        assert_eq!(back.queue.consumer, c.queue.consumer);
    }

    /// Every URL form redis-rs accepts (and a few it refuses), with the password each
    /// carries (`None`: no password; the URL must still parse).
    const URL_FORMS: &[(&str, Option<&str>)] = &[
        ("redis://127.0.0.1:6379", None),
        ("redis://h", None),
        ("redis://user@h:1/3", None),
        ("redis://user:pw1@h:6380/0", Some("pw1")),
        ("redis://:pw2@h:1", Some("pw2")),
        ("redis://u:p%40ss%3Aw0rd@h/2", Some("p@ss:w0rd")),
        ("redis://:pw3@[::1]:6379/1?protocol=resp3", Some("pw3")),
        ("rediss://u:pw4@db.example:6380/0", Some("pw4")),
        ("rediss://:pw5@db.example/#insecure", Some("pw5")),
        ("rediss://db.example:6380/?protocol=3#insecure", None),
        ("unix:///run/redis.sock", None),
        ("unix:///run/redis.sock?db=2&pass=pw6", Some("pw6")),
        ("unix:///run/redis.sock?pass=pw7&db=2&user=bob", Some("pw7")),
        ("redis+unix:///run/redis.sock?pass=pw8", Some("pw8")),
        (
            "redis+unix:///run/redis.sock?protocol=resp3&pass=p%26w9",
            Some("p&w9"),
        ),
    ];

    #[test]
    fn config_split_redis_url_every_form() {
        for (raw, pw) in URL_FORMS {
            let split = split_redis_url(raw).unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(split.password.as_ref().map(Secret::expose), *pw, "{raw}");
            if let Some(pw) = pw {
                assert!(!split.url.contains(pw), "{raw} -> {}", split.url);
            }
            // The split URL plus the password connects exactly as the original would.
            let want = redis::IntoConnectionInfo::into_connection_info(*raw)
                .unwrap_or_else(|e| panic!("redis-rs refuses {raw}: {e}"));
            let got = redis::IntoConnectionInfo::into_connection_info(split.url.as_str())
                .unwrap_or_else(|e| panic!("redis-rs refuses split {}: {e}", split.url));
            assert_eq!(got.addr(), want.addr(), "{raw}");
            let (w, g) = (want.redis_settings(), got.redis_settings());
            assert_eq!(g.db(), w.db(), "{raw}");
            assert_eq!(g.username(), w.username(), "{raw}");
            assert_eq!(g.protocol(), w.protocol(), "{raw}");
            assert_eq!(g.password(), None, "{raw}");
            assert_eq!(w.password(), *pw, "{raw}");
        }
    }

    #[test]
    fn config_split_redis_url_refuses_what_redis_rs_refuses() {
        for raw in [
            "redis://127.0.0.1:notaport",
            "redis://127.0.0.1:6379/abc",
            "redis://127.0.0.1:99999",
            "redis://0.0.0.0:6379",
            "redis://:6379",
            "rediss://h/#bogus",
            "redis://h/?protocol=resp9",
            "unix:///run/redis.sock?db=x",
            "unix://relative.sock",
            "http://h:6379",
            "not a url",
        ] {
            assert!(split_redis_url(raw).is_err(), "{raw} accepted");
            assert!(
                redis::IntoConnectionInfo::into_connection_info(raw).is_err()
                    || raw.starts_with("unix://relative")
                    || raw.starts_with("http://"),
                "redis-rs accepts {raw}: the rule here is wrong"
            );
        }
        // Stricter than redis-rs, which would silently connect without the password.
        for raw in ["redis://h?pass=pw", "unix://:pw@localhost/run/redis.sock"] {
            let e = split_redis_url(raw).expect_err(raw);
            assert!(!e.contains("pw@") && !e.contains("=pw"), "{e}");
        }
        // Errors never echo the URL (it may hold a password).
        let e = split_redis_url("redis://:hunter2@h:notaport").expect_err("bad port");
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn config_redact_url_every_form() {
        for (raw, pw) in URL_FORMS {
            let shown = redact_url(raw);
            if let Some(pw) = pw {
                assert!(!shown.contains(pw), "{raw} -> {shown}");
                // percent-encoded forms too
                assert!(
                    !shown.contains("p%40ss") && !shown.contains("p%26w9"),
                    "{shown}"
                );
                assert!(shown.contains("[redacted]"), "{raw} -> {shown}");
            } else {
                assert!(!shown.contains("[redacted]"), "{raw} -> {shown}");
            }
        }
        assert_eq!(redact_url("redis://:pw@h:1"), "redis://:[redacted]@h:1");
        assert_eq!(
            redact_url("rediss://u:p@w@h/2"),
            "rediss://u:[redacted]@h/2"
        );
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
        assert_eq!(redact_url("redis://user@h"), "redis://user@h");
        assert_eq!(
            redact_url("unix:///run/r.sock?db=2&pass=SECRET&protocol=resp3"),
            "unix:///run/r.sock?db=2&pass=[redacted]&protocol=resp3"
        );
        assert_eq!(
            redact_url("redis://h?PASSWORD=SECRET"),
            "redis://h?PASSWORD=[redacted]"
        );
        let bad = redact_url("redis://:SECRET@h:notaport");
        assert!(!bad.contains("SECRET"), "{bad}");
    }

    #[test]
    fn config_url_password_becomes_a_secret() {
        let e = env(&[(
            "LLM_WORKER__REDIS__URL",
            "unix:///run/r.sock?db=1&pass=SECRET-pw",
        )]);
        let c = Config::from_toml_str(DEMO, &e).expect("unix url");
        assert_eq!(c.redis.url, "unix:///run/r.sock?db=1");
        assert_eq!(
            c.redis.password.as_ref().map(Secret::expose),
            Some("SECRET-pw")
        );
        assert!(!format!("{c:?}").contains("SECRET-pw"));
        assert!(!c.redacted_toml().contains("SECRET-pw"));
        // $REDIS_PASSWORD wins over the URL's.
        let e = env(&[
            ("LLM_WORKER__REDIS__URL", "redis://:from-url@h:1/0"),
            ("REDIS_PASSWORD", "from-env"),
        ]);
        let c = Config::from_toml_str(DEMO, &e).expect("tcp url");
        assert_eq!(c.redis.url, "redis://h:1/0");
        assert_eq!(
            c.redis.password.as_ref().map(Secret::expose),
            Some("from-env")
        );
    }

    #[test]
    fn config_bad_redis_url_names_key_and_variable() {
        let e = env(&[("LLM_WORKER__REDIS__URL", "redis://127.0.0.1:6379/abc")]);
        let (key, message) = err_key(Config::from_toml_str(DEMO, &e));
        assert_eq!(key, "redis.url");
        assert!(message.contains("not a number"), "{message}");
        assert!(
            message.ends_with("(set by LLM_WORKER__REDIS__URL)"),
            "{message}"
        );
        let (key, _) = err_key(demo_with(
            "url = \"redis://127.0.0.1:6379\"",
            "url = \"redis://127.0.0.1:notaport\"",
        ));
        assert_eq!(key, "redis.url");
    }

    #[test]
    fn config_resolve_path_order() {
        use std::path::{Path, PathBuf};
        let e = env(&[("LLM_WORKER_CONFIG", "/etc/w.toml")]);
        assert_eq!(
            resolve_path(Some(Path::new("a.toml")), &e),
            PathBuf::from("a.toml")
        );
        assert_eq!(resolve_path(None, &e), PathBuf::from("/etc/w.toml"));
        assert_eq!(
            resolve_path(None, &env(&[])),
            PathBuf::from("config/default.toml")
        );
    }

    #[test]
    fn config_load_file_and_missing_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w.toml");
        std::fs::write(&path, DEMO).expect("write");
        Config::load(&path, &env(&[])).expect("load from file");
        match Config::load(&dir.path().join("missing.toml"), &env(&[])) {
            Err(ConfigError::File { path, .. }) => assert!(path.ends_with("missing.toml")),
            other => panic!("expected File error, got {other:?}"),
        }
        std::fs::write(&path, "[queue\n").expect("write");
        assert!(matches!(
            Config::load(&path, &env(&[])),
            Err(ConfigError::File { .. })
        ));
    }
}
