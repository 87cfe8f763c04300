//! Redis connection setup, shared by every room that talks to Redis: the URL (already
//! checked and split at config load), the password from its `Secret`, TLS with a private
//! CA, the command pool and the blocking reader's own connection.
//!
//! Invariant: knows no jobs and no slots; nothing here logs or formats a password.

use crate::config::Config;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo};
use std::time::Duration;

/// Why a connection could not be set up, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("redis: {0} (retry when Redis answers again)")]
    Redis(redis::RedisError),
    #[error("redis url: {0} (fix redis.url)")]
    Url(String),
    #[error("redis did not answer within {0:?} (retry when Redis answers again)")]
    Timeout(Duration),
}

from_cause!(ConnectError, ConnectError::Redis, redis::RedisError);

/// Connection info from config: `redis.url`, with `redis.password` (filled by validation
/// from `redis.password_env`, `redis.password_file` or the URL) and `redis.username` if
/// any.
pub fn connection_info(cfg: &Config) -> Result<ConnectionInfo, ConnectError> {
    let info = cfg
        .redis
        .url
        .as_str()
        .into_connection_info()
        .map_err(|e| ConnectError::Url(e.to_string()))?;
    let mut settings = info.redis_settings().clone();
    if let Some(pw) = &cfg.redis.password {
        settings = settings.set_password(pw.expose());
    }
    if !cfg.redis.username.is_empty() {
        settings = settings.set_username(&cfg.redis.username);
    }
    let info = info.set_redis_settings(settings);
    if cfg.redis.tls_ca_file.is_empty() {
        return Ok(info);
    }
    // A private CA: the TLS parameters travel inside the connection info, so every
    // connection (pool, blocking, tools) trusts it.
    let ca = std::fs::read(&cfg.redis.tls_ca_file).map_err(|e| {
        ConnectError::Url(format!(
            "redis.tls_ca_file {:?}: {e}",
            cfg.redis.tls_ca_file
        ))
    })?;
    let client = redis::Client::build_with_tls(
        info,
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )?;
    Ok(client.get_connection_info().clone())
}

/// The shared connection for ordinary (non-blocking) commands (see [`Commands`]).
pub fn commands(cfg: &Config) -> Result<Commands, ConnectError> {
    Ok(Commands::new(
        command_pool(cfg, 4)?,
        cfg.redis.command_timeout_ms,
    ))
}

/// A pool for ordinary (non-blocking) commands.
pub fn command_pool(cfg: &Config, size: usize) -> Result<deadpool_redis::Pool, ConnectError> {
    // The manager is built from our ConnectionInfo directly (not deadpool's serialisable
    // config), so TLS parameters (a private CA) reach every pooled connection.
    let manager = deadpool_redis::Manager::new(connection_info(cfg)?)?;
    let mut pool_cfg = deadpool_redis::PoolConfig::new(size.max(4));
    pool_cfg.timeouts.wait = Some(Duration::from_secs(5));
    pool_cfg.timeouts.create = Some(Duration::from_secs(2));
    pool_cfg.timeouts.recycle = Some(Duration::from_secs(2));
    deadpool_redis::Pool::builder(manager)
        .config(pool_cfg)
        .runtime(deadpool_redis::Runtime::Tokio1)
        .build()
        .map_err(|e| ConnectError::Url(e.to_string()))
}

/// A connection of its own for blocking commands (XREADGROUP BLOCK, BLPOP): no response
/// timeout (redis 1.x's default 500 ms would cut a BLOCK short), and nothing else queued
/// behind it. Callers bound each blocking call themselves.
pub async fn blocking_connection(cfg: &Config) -> Result<MultiplexedConnection, ConnectError> {
    let client = redis::Client::open(connection_info(cfg)?)?;
    let conn_cfg = AsyncConnectionConfig::new()
        .set_response_timeout(None)
        .set_connection_timeout(Some(Duration::from_secs(2)));
    let fut = client.get_multiplexed_async_connection_with_config(&conn_cfg);
    match tokio::time::timeout(Duration::from_secs(3), fut).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ConnectError::Timeout(Duration::from_secs(3))),
    }
}

/// The connection for ordinary (non-blocking) commands, shared by every task of the
/// process: one multiplexed connection on which concurrent commands pipeline, taken from
/// the deadpool-redis pool once and kept, so no command pays the pool's per-checkout
/// `UNWATCH` + `PING` round trip.
///
/// Invariant: a connection on which a command failed with a timeout, an IO error or a
/// dropped connection is never used again: the next [`Commands::get`] takes a fresh one
/// from the pool. (redis-rs discards the late reply of a timed-out command rather than
/// handing it to the next one, but a socket cut off by a partition would make every
/// later command wait out its own timeout too.)
#[derive(Clone)]
pub struct Commands {
    inner: std::sync::Arc<CommandsInner>,
}

struct CommandsInner {
    pool: deadpool_redis::Pool,
    timeout: Duration,
    /// The connection in use and its generation (bumped each time one is dropped).
    current: std::sync::Mutex<(u64, Option<MultiplexedConnection>)>,
}

impl Commands {
    /// Commands on connections from `pool`, each command bounded by `timeout`.
    pub fn new(pool: deadpool_redis::Pool, timeout: Duration) -> Commands {
        Commands {
            inner: std::sync::Arc::new(CommandsInner {
                pool,
                timeout,
                current: std::sync::Mutex::new((0, None)),
            }),
        }
    }

    /// The pool behind it (tools and tests that want a connection of their own).
    pub fn pool(&self) -> &deadpool_redis::Pool {
        &self.inner.pool
    }

    /// The shared connection (a cheap clone), connecting first if there is none.
    pub async fn get(&self) -> Result<CommandConn, deadpool_redis::PoolError> {
        {
            let cur = crate::sync::lock(&self.inner.current);
            if let Some(c) = &cur.1 {
                return Ok(CommandConn {
                    conn: c.clone(),
                    generation: cur.0,
                    owner: self.clone(),
                });
            }
        }
        let mut fresh = deadpool_redis::Connection::take(self.inner.pool.get().await?);
        fresh.set_response_timeout(self.inner.timeout);
        let mut cur = crate::sync::lock(&self.inner.current);
        // Another task may have connected meanwhile: keep one connection.
        let conn = cur.1.get_or_insert(fresh).clone();
        Ok(CommandConn {
            conn,
            generation: cur.0,
            owner: self.clone(),
        })
    }

    /// Drops the connection of `generation` (if still the current one).
    fn discard(&self, generation: u64) {
        let mut cur = crate::sync::lock(&self.inner.current);
        if cur.0 == generation && cur.1.is_some() {
            cur.1 = None;
            cur.0 += 1;
            metrics::counter!("llm_worker_redis_reconnects_total").increment(1);
            tracing::debug!(
                generation,
                "redis command connection dropped after a timeout or IO error"
            );
        }
    }
}

/// One use of the shared command connection: a [`redis::aio::ConnectionLike`] that drops
/// the connection for everyone after a timeout or IO error (see [`Commands`]).
pub struct CommandConn {
    conn: MultiplexedConnection,
    generation: u64,
    owner: Commands,
}

impl CommandConn {
    fn check<T>(&self, r: redis::RedisResult<T>) -> redis::RedisResult<T> {
        if let Err(e) = &r
            && (e.is_timeout() || e.is_io_error() || e.is_connection_dropped())
        {
            self.owner.discard(self.generation);
        }
        r
    }
}

impl redis::aio::ConnectionLike for CommandConn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let r = self.conn.req_packed_command(cmd).await;
            self.check(r)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let r = self.conn.req_packed_commands(pipeline, offset, count).await;
            self.check(r)
        })
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

/// Whether an error's text says Redis refused this client's credentials (`WRONGPASS`,
/// `NOAUTH`, redis-rs's "authentication failed") or a command to its ACL user
/// (`NOPERM`): a config problem no retry can fix, unlike a Redis that is away.
pub fn refused_access(msg: &str) -> bool {
    ["WRONGPASS", "NOAUTH", "NOPERM", "authentication failed"]
        .iter()
        .any(|m| msg.contains(m))
}

/// Every key matching `pattern` (SCAN, 1000 at a time; a key may show up twice if the
/// keyspace is rehashed meanwhile, so callers sort and dedup).
pub async fn scan_match<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    pattern: &str,
) -> Result<Vec<String>, redis::RedisError> {
    let mut keys: Vec<String> = vec![];
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    keys.sort();
    keys.dedup();
    Ok(keys)
}
