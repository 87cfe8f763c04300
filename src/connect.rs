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

/// Connection info from config: `redis.url`, with the password from `redis.password_env` if set.
pub fn connection_info(cfg: &Config) -> Result<ConnectionInfo, ConnectError> {
    let info = cfg
        .redis
        .url
        .as_str()
        .into_connection_info()
        .map_err(|e| ConnectError::Url(e.to_string()))?;
    let info = match &cfg.redis.password {
        Some(pw) => {
            let settings = info.redis_settings().clone().set_password(pw.expose());
            info.set_redis_settings(settings)
        }
        None => info,
    };
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
