//! Validation: every range and cross-reference check, and the derived fields
//! (`api_key`, `redis.password`, `queue.consumer`). Errors name the dotted key.

/// The largest `worker.concurrency` derived from the pools (set it explicitly for more).
pub const MAX_DERIVED_CONCURRENCY: usize = 1024;
/// The largest `worker.read_ahead`.
pub const MAX_READ_AHEAD: usize = 10_000;

use super::prices::check_price;
use super::secret::split_redis_url;
use super::{CLAIM_IDLE_FLOOR, Config, ConfigError, Secret};

/// Largest `queue.dedupe_ttl_s`, in seconds: ten years.
pub const MAX_DEDUPE_TTL_S: u64 = 315_360_000;
/// Largest `queue.results_maxlen`: 10^12 entries.
pub const MAX_RESULTS_MAXLEN: u64 = 1_000_000_000_000;

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
    pub(super) fn validate(
        &mut self,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<(), ConfigError> {
        self.validate_redis(env)?;
        self.validate_queue(env)?;
        self.validate_process()?;
        if self.redis.command_timeout_ms.is_zero() {
            self.redis.command_timeout_ms =
                (self.slots.ttl_ms / 3).min(std::time::Duration::from_millis(1000));
        }
        require(
            self.redis.command_timeout_ms >= std::time::Duration::from_millis(10)
                && self.redis.command_timeout_ms * 3 <= self.slots.ttl_ms,
            "redis.command_timeout_ms",
            format!(
                "must be at least 10 and at most a third of slots.ttl_ms ({} ms), got {}",
                self.slots.ttl_ms.as_millis(),
                self.redis.command_timeout_ms.as_millis()
            ),
        )?;
        require(
            self.context.headroom > 0.0 && self.context.headroom <= 1.0,
            "context.headroom",
            format!(
                "is {}; it must be above 0 and at most 1",
                self.context.headroom
            ),
        )?;
        require(
            self.worker.threads <= 1024,
            "worker.threads",
            format!(
                "is {}; use 1 (one thread, the default), 0 (one per core) or a count up to 1024",
                self.worker.threads
            ),
        )?;
        self.validate_pools_providers_models()?;
        if let Some(r) = self.worker.read_ahead {
            require(
                r <= MAX_READ_AHEAD,
                "worker.read_ahead",
                format!(
                    "is {r}; it must be at most {MAX_READ_AHEAD} (entries read ahead are held by this process, away from the rest of the fleet)"
                ),
            )?;
        }
        self.derive_concurrency();
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
        } else if !self.redis.password_file.is_empty() {
            // Read here, once: a file that cannot be read is a config error at start, not
            // an AUTH failure on every reconnect. The error names the file, never its text.
            let text = std::fs::read_to_string(&self.redis.password_file).map_err(|e| {
                ConfigError::invalid(
                    "redis.password_file",
                    format!("cannot read {:?}: {e}", self.redis.password_file),
                )
            })?;
            let pw = text.strip_suffix('\n').unwrap_or(&text);
            let pw = pw.strip_suffix('\r').unwrap_or(pw);
            require(
                !pw.is_empty() && !pw.contains('\n'),
                "redis.password_file",
                format!(
                    "{:?} must hold the password on one line",
                    self.redis.password_file
                ),
            )?;
            self.redis.password = Some(Secret::new(pw.to_string()));
        }
        require(
            !self.redis.username.chars().any(|c| c.is_whitespace()),
            "redis.username",
            "must not contain whitespace",
        )?;
        self.validate_redis_topology(env)
    }

    /// `redis.urls`, `redis.sentinel_master`, `redis.cluster`: each URL parses and holds
    /// no password (it would be printed; the Sentinels' password comes from
    /// `redis.sentinel_password_env`), and the combination names one topology.
    fn validate_redis_topology(
        &mut self,
        env: &std::collections::HashMap<String, String>,
    ) -> Result<(), ConfigError> {
        let r = &mut self.redis;
        for (i, u) in r.urls.iter().enumerate() {
            let key = format!("redis.urls[{i}]");
            let split = split_redis_url(u).map_err(|m| ConfigError::invalid(&key, m))?;
            require(
                split.password.is_none(),
                &key,
                "must not hold a password (use redis.sentinel_password_env for the Sentinels; the master's password is redis.password_env / password_file)",
            )?;
            require(
                u.starts_with("redis://") || u.starts_with("rediss://"),
                &key,
                "must be redis://host:port or rediss://host:port",
            )?;
        }
        if !r.sentinel_master.is_empty() {
            require(
                !r.urls.is_empty(),
                "redis.urls",
                "must list the Sentinels (redis://host:26379) when redis.sentinel_master is set",
            )?;
            require(
                !r.cluster,
                "redis.cluster",
                "cannot be true with redis.sentinel_master (a Sentinel-managed Redis is not a cluster)",
            )?;
            require(
                !r.url.starts_with("unix") && !r.url.starts_with("redis+unix"),
                "redis.url",
                "must be redis:// or rediss:// with redis.sentinel_master (it gives the master's TLS, user and db)",
            )?;
        } else if !r.urls.is_empty() && !r.cluster {
            return Err(ConfigError::invalid(
                "redis.urls",
                "is only used with redis.sentinel_master (Sentinels) or redis.cluster = true (seed nodes)",
            ));
        }
        if r.cluster {
            let scheme = r.url.split("://").next().unwrap_or("").to_string();
            for (i, u) in r.urls.iter().enumerate() {
                require(
                    u.split("://").next() == Some(scheme.as_str()),
                    &format!("redis.urls[{i}]"),
                    format!(
                        "must use redis.url's scheme ({scheme}://) with redis.cluster = true: every seed gets the same password and TLS"
                    ),
                )?;
            }
            require(
                r.url.starts_with("redis://") || r.url.starts_with("rediss://"),
                "redis.url",
                "must be redis://host:port or rediss://host:port (a seed node) with redis.cluster = true",
            )?;
            let db = split_redis_url(&r.url)
                .ok()
                .and_then(|u| url::Url::parse(&u.url).ok())
                .map(|u| u.path().trim_matches('/').to_string())
                .unwrap_or_default();
            require(
                db.is_empty() || db == "0",
                "redis.url",
                "must name database 0 (or none) with redis.cluster = true: a Redis Cluster has only database 0",
            )?;
        }
        r.sentinel_password = None;
        if !r.sentinel_password_env.is_empty()
            && let Some(pw) = env.get(&r.sentinel_password_env)
            && !pw.is_empty()
        {
            r.sentinel_password = Some(Secret::new(pw.clone()));
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
            !q.consumer_idle_remove_ms.is_zero(),
            "queue.consumer_idle_remove_ms",
            "must be greater than 0",
        )?;
        require(
            q.claim_idle_ms >= CLAIM_IDLE_FLOOR,
            "queue.claim_idle_ms",
            format!(
                "must be at least {} (the keepalive runs every third of it and must beat \
                 the stall gate at half of it), got {}",
                CLAIM_IDLE_FLOOR.as_millis(),
                q.claim_idle_ms.as_millis()
            ),
        )?;
        require(
            !q.dedupe_ttl_s.is_zero(),
            "queue.dedupe_ttl_s",
            "must be at least 1 second, got 0",
        )?;
        // lua/commit.lua passes both as Lua numbers, which Lua writes as "1e+14" from
        // 10^14 on: Redis would refuse the marker's EX or the MAXLEN after the script's
        // first writes. Far beyond any use: ten years, 10^12 entries.
        require(
            q.dedupe_ttl_s.as_secs() <= MAX_DEDUPE_TTL_S,
            "queue.dedupe_ttl_s",
            format!(
                "must be at most {MAX_DEDUPE_TTL_S} (ten years), got {}",
                q.dedupe_ttl_s.as_secs()
            ),
        )?;
        require(
            q.results_maxlen > 0,
            "queue.results_maxlen",
            "must be greater than 0",
        )?;
        require(
            q.results_maxlen <= MAX_RESULTS_MAXLEN,
            "queue.results_maxlen",
            format!(
                "must be at most {MAX_RESULTS_MAXLEN}, got {}",
                q.results_maxlen
            ),
        )?;
        require(
            q.max_payload_bytes > 0,
            "queue.max_payload_bytes",
            "must be greater than 0",
        )?;
        require(
            (1..=10_000).contains(&q.block_ms.as_millis()),
            "queue.block_ms",
            format!(
                "must be between 1 and 10000, got {}",
                q.block_ms.as_millis()
            ),
        )?;
        if q.consumer.is_empty() {
            q.consumer = default_consumer(env);
        }
        Ok(())
    }

    /// `worker.concurrency` when absent: N of every pool, at most
    /// [`MAX_DERIVED_CONCURRENCY`], and then `worker.read_ahead` when absent too: a quarter
    /// of that, at least 1. A `concurrency` set explicitly without a `read_ahead` reads
    /// none ahead: the process holds exactly `concurrency` entries, as it always did (what
    /// KEDA's pending-entries trigger and fleet sizing count on). Per process: a fleet of
    /// P workers holds up to P times the read-ahead (entries read ahead stay pending under
    /// their worker, kept alive by it).
    fn derive_concurrency(&mut self) {
        let derived = self.worker.concurrency.is_none();
        if derived {
            let n: usize = self.pools.values().map(|p| p.slots.get() as usize).sum();
            let n = n.max(1);
            // Capped: a huge pool must not make one process read the whole backlog.
            self.worker.concurrency = std::num::NonZeroUsize::new(n.min(MAX_DERIVED_CONCURRENCY));
        }
        if self.worker.read_ahead.is_none() {
            let r = if derived {
                (self.worker.concurrency() / 4).clamp(1, MAX_READ_AHEAD)
            } else {
                0
            };
            self.worker.read_ahead = Some(r);
        }
    }

    fn validate_process(&self) -> Result<(), ConfigError> {
        // Short TTLs are allowed (tests use 1-2 s), but below 100 ms renewals could not keep up.
        require(
            self.slots.ttl_ms >= std::time::Duration::from_millis(100),
            "slots.ttl_ms",
            format!(
                "must be at least 100, got {}",
                self.slots.ttl_ms.as_millis()
            ),
        )?;
        require(
            !self.slots.acquire_timeout_ms.is_zero(),
            "slots.acquire_timeout_ms",
            "must be greater than 0",
        )?;
        let r = &self.retry;
        require(
            r.base_delay_ms <= r.max_delay_ms,
            "retry.base_delay_ms",
            format!(
                "must not exceed retry.max_delay_ms ({} > {})",
                r.base_delay_ms.as_millis(),
                r.max_delay_ms.as_millis()
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
        for (name, p) in &self.pools {
            require(
                p.max_per_tenant == 0 || !name.contains(':'),
                &format!("pools.{name}.max_per_tenant"),
                "needs a pool name without ':' (it is part of the tenant's Redis keys); rename the pool",
            )?;
        }
        for (name, p) in &self.providers {
            require(
                p.base_url.starts_with("http://") || p.base_url.starts_with("https://"),
                &format!("providers.{name}.base_url"),
                format!("must start with http:// or https://, got {:?}", p.base_url),
            )?;
            // Parsed here as the client will (once, at start): a bad URL is a config error
            // that check-config reports, naming the key.
            let url = format!("{}/chat/completions", p.base_url.trim_end_matches('/'));
            if let Err(e) = url::Url::parse(&url) {
                require(
                    false,
                    &format!("providers.{name}.base_url"),
                    format!("is not a valid URL: {e}"),
                )?;
            }
            require(
                !p.timeout_ms.is_zero(),
                &format!("providers.{name}.timeout_ms"),
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
            if let Some(c) = m.cache_write_per_mtok {
                check_price(format!("models.{name}.cache_write_per_mtok"), c)?;
            }
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
        for (name, models) in &self.tiers {
            let key = format!("tiers.{name}");
            for m in models {
                require(
                    self.models.contains_key(m),
                    &key,
                    format!("unknown model {m:?} (known: {})", known(self.models.keys())),
                )?;
            }
        }
        for (name, b) in &self.budgets {
            let key = format!("budgets.{name}");
            require(
                b.usd_per_day.is_some() || b.usd_per_month.is_some(),
                &key,
                "needs usd_per_day and/or usd_per_month",
            )?;
            for (k, v) in [
                ("usd_per_day", b.usd_per_day),
                ("usd_per_month", b.usd_per_month),
            ] {
                if let Some(v) = v {
                    require(
                        (v.is_zero() || !v.is_sign_negative())
                            && crate::cost::to_picos(v).is_some(),
                        &format!("{key}.{k}"),
                        format!(
                            "is {v}; it must be a non-negative amount of USD with at most 12 decimal places, below 9,000,000"
                        ),
                    )?;
                }
            }
            for m in &b.models {
                require(
                    self.models.contains_key(m),
                    &format!("{key}.models"),
                    format!("unknown model {m:?} (known: {})", known(self.models.keys())),
                )?;
            }
            require(
                !b.tenant.contains(':') && b.tenant.len() <= 256,
                &format!("{key}.tenant"),
                "must be \"\" (the whole fleet), \"*\" (each tenant its own) or a tenant name without ':'",
            )?;
        }
        for (name, m) in &self.models {
            if let Some(cap) = m.max_output_tokens {
                require(
                    cap > 0 && cap <= m.context_window,
                    &format!("models.{name}.max_output_tokens"),
                    format!(
                        "is {cap}; it must be between 1 and the model's context_window ({})",
                        m.context_window
                    ),
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
