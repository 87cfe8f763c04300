//! Redis connection setup, shared by every room that talks to Redis: the URL (already
//! checked and split at config load), the password from its `Secret`, TLS with a private
//! CA, the command pool and the blocking reader's own connection, and the master's
//! address through Sentinel (`redis.sentinel_master`), asked again at every connect.
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
    #[error("redis sentinel: {0} (retry: the Sentinels may be electing a new master)")]
    Sentinel(String),
    #[error(
        "redis cluster: {0} (retry: the cluster may be moving the namespace's slot or failing over)"
    )]
    Cluster(String),
}

from_cause!(ConnectError, ConnectError::Redis, redis::RedisError);

/// Connection info from config: `redis.url`, with `redis.password` (filled by validation
/// from `redis.password_env`, `redis.password_file` or the URL) and `redis.username` if
/// any.
pub fn connection_info(cfg: &Config) -> Result<ConnectionInfo, ConnectError> {
    info_for_url(cfg, &cfg.redis.url)
}

/// [`connection_info`] for `url` in place of `redis.url` (same password, user and CA).
fn info_for_url(cfg: &Config, url: &str) -> Result<ConnectionInfo, ConnectError> {
    let info = url
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

/// The master's connection info: [`connection_info`], or with `redis.sentinel_master`
/// the address the Sentinels of `redis.urls` give for it now (asked in order, the first
/// that knows it wins), with `redis.url`'s scheme, user, password and db.
///
/// Asked at every (re)connect, never cached: after a failover the next connection goes
/// to the new master.
pub async fn master_info(cfg: &Config) -> Result<ConnectionInfo, ConnectError> {
    if cfg.redis.cluster {
        return cluster_master(cfg).await;
    }
    if cfg.redis.sentinel_master.is_empty() {
        return connection_info(cfg);
    }
    let sentinels: Vec<&str> = cfg.redis.urls.iter().map(String::as_str).collect();
    let (host, port) = first_answer(&sentinels, "no Sentinel answered", |s| async move {
        match ask_sentinel(cfg, s).await {
            Ok(Some(addr)) => Ok(addr),
            Ok(None) => Err(format!(
                "Sentinel {} does not know master {:?}",
                crate::config::redact_url(s),
                cfg.redis.sentinel_master
            )),
            Err(e) => Err(format!("Sentinel {}: {e}", crate::config::redact_url(s))),
        }
    })
    .await
    .map_err(ConnectError::Sentinel)?;
    info_for_url(cfg, &master_url(&cfg.redis.url, &host, port)?)
}

/// Asks every source at once, each bounded by `ask` (one down must not slow a reconnect,
/// which the shutdown's bounded steps may be waiting on); the first in list order that
/// names the master wins. Else the last failure's text (`none` when there is no source).
async fn first_answer<'a, F, Fut>(
    sources: &[&'a str],
    none: &str,
    ask: F,
) -> Result<(String, u16), String>
where
    F: Fn(&'a str) -> Fut,
    Fut: std::future::Future<Output = Result<(String, u16), String>>,
{
    let answers = futures::future::join_all(sources.iter().map(|s| ask(s))).await;
    let mut last = none.to_string();
    for answer in answers {
        match answer {
            Ok(addr) => return Ok(addr),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// With `redis.cluster`: the master serving the namespace's hash slot, as the seed nodes
/// (`redis.url`, then `redis.urls`, all asked at once, each bounded; the first in list
/// order that answers wins) see it now, with `redis.url`'s scheme, user and password.
///
/// Why one node connection and not redis-rs's cluster client: every key of a namespace
/// carries its hash tag `{ns}`, so the whole namespace lives in one slot on one master,
/// and every command the worker sends goes there. A plain connection to that master also
/// serves what a cluster client routes elsewhere or not at all: the blocking
/// XREADGROUP and its `CLIENT UNBLOCK` (same node, same client id), `SCAN` of the
/// namespace's keys, `INFO`. When the slot moves, the old master answers `MOVED`: the
/// connection is dropped and the next one asks the seeds again (see [`CommandConn`]).
/// While the slot migrates, `ASK` / `TRYAGAIN` answers fail the command before it runs
/// (a script never runs with half of its keys); callers retry as after any error that
/// heals, until the slot has moved.
async fn cluster_master(cfg: &Config) -> Result<ConnectionInfo, ConnectError> {
    let seeds: Vec<&str> = std::iter::once(&cfg.redis.url)
        .chain(cfg.redis.urls.iter())
        .map(String::as_str)
        .collect();
    let tag = format!("{{{}}}:jobs", cfg.queue.namespace);
    let tag = tag.as_str();
    let (host, port) = first_answer(&seeds, "no seed node answered", |s| async move {
        ask_seed(cfg, s, tag)
            .await
            .map_err(|e| format!("seed {}: {e}", crate::config::redact_url(s)))
    })
    .await
    .map_err(ConnectError::Cluster)?;
    tracing::debug!(%host, port, "cluster: the namespace's slot is served here");
    info_for_url(cfg, &master_url(&cfg.redis.url, &host, port)?)
}

/// A short-lived connection to a Sentinel or a seed node: 2 s to connect, 2 s per reply.
async fn discovery_connection(info: ConnectionInfo) -> redis::RedisResult<MultiplexedConnection> {
    let conn_cfg = AsyncConnectionConfig::new()
        .set_response_timeout(Some(Duration::from_secs(2)))
        .set_connection_timeout(Some(Duration::from_secs(2)));
    redis::Client::open(info)?
        .get_multiplexed_async_connection_with_config(&conn_cfg)
        .await
}

/// `CLUSTER KEYSLOT` of `key` and the master serving that slot in `CLUSTER SLOTS`, from
/// one seed node, bounded by 3 s.
async fn ask_seed(cfg: &Config, seed: &str, key: &str) -> Result<(String, u16), ConnectError> {
    let info = info_for_url(cfg, seed)?;
    let asked = async {
        let mut c = discovery_connection(info).await?;
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut c)
            .await?;
        let ranges: Vec<redis::Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut c)
            .await?;
        Ok::<_, ConnectError>((slot, ranges))
    };
    let (slot, ranges) = match tokio::time::timeout(Duration::from_secs(3), asked).await {
        Ok(r) => r?,
        Err(_) => return Err(ConnectError::Timeout(Duration::from_secs(3))),
    };
    let seed_host = url::Url::parse(seed)
        .ok()
        .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_string()))
        .unwrap_or_default();
    owner_of(slot, &ranges, &seed_host).ok_or_else(|| {
        ConnectError::Cluster(format!(
            "no master with a known endpoint serves slot {slot} of {key} (is the cluster complete? redis-cli --cluster check; with cluster-preferred-endpoint-type hostname, set cluster-announce-hostname)"
        ))
    })
}

/// The master (host, port) of `slot` in a `CLUSTER SLOTS` reply: ranges of
/// `[start, end, [host, port, id, ...], replicas...]`. An empty or `?` host means the
/// node answering (`seed_host`).
fn owner_of(slot: i64, ranges: &[redis::Value], seed_host: &str) -> Option<(String, u16)> {
    use redis::Value;
    let int = |v: &Value| match v {
        Value::Int(i) => Some(*i),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    for r in ranges {
        let Value::Array(parts) = r else { continue };
        let (Some(start), Some(end)) = (parts.first().and_then(int), parts.get(1).and_then(int))
        else {
            continue;
        };
        if slot < start || slot > end {
            continue;
        }
        let Some(Value::Array(master)) = parts.get(2) else {
            return None;
        };
        let host = master.first().and_then(text).unwrap_or_default();
        let port = master.get(1).and_then(int)?;
        // "" (or NULL): the node that answered; "?": an endpoint it does not know (a
        // hostname endpoint with none announced), so this seed cannot say where.
        if host == "?" {
            return None;
        }
        let host = if host.is_empty() {
            seed_host.to_string()
        } else {
            host
        };
        return Some((host, u16::try_from(port).ok()?));
    }
    None
}

/// `url` with its host and port replaced by the master's (an IPv6 address bracketed).
fn master_url(url: &str, host: &str, port: u16) -> Result<String, ConnectError> {
    let mut u = url::Url::parse(url).map_err(|e| ConnectError::Url(format!("redis.url: {e}")))?;
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    u.set_host(Some(&host))
        .map_err(|e| ConnectError::Url(format!("master address {host}:{port}: {e}")))?;
    u.set_port(Some(port))
        .map_err(|_| ConnectError::Url(format!("master address {host}:{port}: no port")))?;
    Ok(u.into())
}

/// `SENTINEL get-master-addr-by-name` on one Sentinel, bounded by 2 s.
async fn ask_sentinel(cfg: &Config, sentinel: &str) -> Result<Option<(String, u16)>, ConnectError> {
    let mut info = sentinel
        .into_connection_info()
        .map_err(|e| ConnectError::Url(e.to_string()))?;
    if let Some(pw) = &cfg.redis.sentinel_password {
        let settings = info.redis_settings().clone().set_password(pw.expose());
        info = info.set_redis_settings(settings);
    }
    let asked = async {
        let mut c = discovery_connection(info).await?;
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&cfg.redis.sentinel_master)
            .query_async::<Option<(String, u16)>>(&mut c)
            .await
    };
    match tokio::time::timeout(Duration::from_secs(3), asked).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ConnectError::Timeout(Duration::from_secs(3))),
    }
}

/// With Sentinel: a connection must be to a master (`ROLE`), since a Sentinel's answer can
/// lag a failover and a demoted master still answers reads. Without Sentinel: no check.
async fn check_master(cfg: &Config, c: &mut MultiplexedConnection) -> Result<(), ConnectError> {
    if cfg.redis.sentinel_master.is_empty() {
        return Ok(());
    }
    let role: Vec<redis::Value> = match redis::cmd("ROLE").query_async(c).await {
        Ok(r) => r,
        // ROLE is in @dangerous: an ACL user without it cannot check; the Sentinel's answer
        // is taken as it is (a demoted master still answers READONLY, which reconnects).
        Err(e) if e.code() == Some("NOPERM") => {
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    "ROLE not allowed for this Redis user: the master the Sentinels name is used unchecked (grant +role to check it)"
                );
            }
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    match role.first() {
        Some(redis::Value::BulkString(b)) if b.as_slice() == b"master" => Ok(()),
        _ => Err(ConnectError::Sentinel(
            "the address the Sentinels gave is not a master (a failover is under way)".into(),
        )),
    }
}

/// The shared connection for ordinary (non-blocking) commands (see [`Commands`]).
pub fn commands(cfg: &Config) -> Result<Commands, ConnectError> {
    let source = if cfg.redis.sentinel_master.is_empty() && !cfg.redis.cluster {
        Source::Pool(command_pool(cfg, 4)?)
    } else {
        Source::Discovered(std::sync::Arc::new(cfg.clone()))
    };
    Ok(Commands::new(source, cfg.redis.command_timeout_ms))
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

/// The id of `stream`'s newest entry, or `0-0` if it is empty or absent: reading on from
/// it (XREAD) sees exactly the entries added after this call.
pub async fn stream_end<C: redis::aio::ConnectionLike>(
    c: &mut C,
    stream: &str,
) -> redis::RedisResult<String> {
    let newest: Vec<(String, redis::Value)> = redis::cmd("XREVRANGE")
        .arg(stream)
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query_async(c)
        .await?;
    Ok(newest
        .into_iter()
        .next()
        .map_or_else(|| "0-0".to_string(), |e| e.0))
}

/// A connection of its own for blocking commands (XREADGROUP BLOCK, XREAD BLOCK): no response
/// timeout (redis 1.x's default 500 ms would cut a BLOCK short), and nothing else queued
/// behind it. Callers bound each blocking call themselves.
pub async fn blocking_connection(cfg: &Config) -> Result<MultiplexedConnection, ConnectError> {
    master_connection(cfg, None).await
}

/// A fresh connection to the master (through the Sentinels when configured), with
/// `timeout` on each reply (None = none, for blocking commands). Bounded by 3 s.
pub async fn master_connection(
    cfg: &Config,
    timeout: Option<Duration>,
) -> Result<MultiplexedConnection, ConnectError> {
    let client = redis::Client::open(master_info(cfg).await?)?;
    let conn_cfg = AsyncConnectionConfig::new()
        .set_response_timeout(timeout)
        .set_connection_timeout(Some(Duration::from_secs(2)));
    let fut = async {
        let mut c = client
            .get_multiplexed_async_connection_with_config(&conn_cfg)
            .await?;
        check_master(cfg, &mut c).await?;
        Ok::<_, ConnectError>(c)
    };
    match tokio::time::timeout(Duration::from_secs(3), fut).await {
        Ok(r) => r,
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

/// Where [`Commands`] takes a fresh connection from.
pub enum Source {
    /// A fixed address: the deadpool-redis pool.
    Pool(deadpool_redis::Pool),
    /// `redis.sentinel_master` or `redis.cluster`: the master asked of the Sentinels or
    /// the seed nodes at every connect (a pool's fixed address would keep going to a
    /// demoted master after a failover, or to the old owner of a moved slot).
    Discovered(std::sync::Arc<Config>),
}

struct CommandsInner {
    source: Source,
    timeout: Duration,
    /// The connection in use and its generation (bumped each time one is dropped).
    current: std::sync::Mutex<(u64, Option<MultiplexedConnection>)>,
}

impl Commands {
    /// Commands on connections from `source`, each command bounded by `timeout`.
    pub fn new(source: Source, timeout: Duration) -> Commands {
        Commands {
            inner: std::sync::Arc::new(CommandsInner {
                source,
                timeout,
                current: std::sync::Mutex::new((0, None)),
            }),
        }
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
        // Boxed: connecting (a pool checkout that may dial, or a master lookup) is a
        // state machine of about 7 KB. Inline, it would sit in the future of every command
        // and of every job awaiting one (measured: a job's future was 17 KB, most of it
        // this); boxed, only a reconnect pays for it.
        Box::pin(self.connect()).await
    }

    /// [`Commands::get`]'s slow path: a new connection, kept unless another task connected
    /// meanwhile.
    async fn connect(&self) -> Result<CommandConn, deadpool_redis::PoolError> {
        let fresh = match &self.inner.source {
            Source::Pool(pool) => {
                let mut c = deadpool_redis::Connection::take(pool.get().await?);
                c.set_response_timeout(self.inner.timeout);
                c
            }
            Source::Discovered(cfg) => master_connection(cfg, Some(self.inner.timeout))
                .await
                .map_err(|e| match e {
                    ConnectError::Redis(e) => deadpool_redis::PoolError::Backend(e),
                    other => deadpool_redis::PoolError::Backend(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "cannot connect to the master",
                        other.to_string(),
                    ))),
                })?,
        };
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
                "redis command connection dropped after a timeout, an IO error or a reply from the wrong node (READONLY, MOVED)"
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
        // READONLY: the master was demoted under this connection (a failover); MOVED:
        // the namespace's cluster slot is served elsewhere now. A fresh connection asks
        // the Sentinels or the seed nodes again.
        if let Err(e) = &r
            && (e.is_timeout()
                || e.is_io_error()
                || e.is_connection_dropped()
                || wrong_node(e.code()))
        {
            self.owner.discard(self.generation);
        }
        r
    }
}

/// Whether a server error says the connection is to the wrong node now: READONLY (a
/// demoted master), MOVED (the namespace's cluster slot is served elsewhere) or
/// CLUSTERDOWN (this node lost the cluster; a replica may be promoted elsewhere).
fn wrong_node(code: Option<&str>) -> bool {
    matches!(code, Some("READONLY" | "MOVED" | "CLUSTERDOWN"))
}

/// Whether a reply carries such a server error (redis-rs hands server errors back as
/// `Value::ServerError` in an `Ok`, converted to an `Err` only by the caller's parse).
fn replies_wrong_node(v: &redis::Value) -> bool {
    match v {
        redis::Value::ServerError(e) => wrong_node(Some(e.code())),
        _ => false,
    }
}

impl redis::aio::ConnectionLike for CommandConn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let r = self.conn.req_packed_command(cmd).await;
            if r.as_ref().is_ok_and(replies_wrong_node) {
                self.owner.discard(self.generation);
            }
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
            if r.as_ref().is_ok_and(|vs| vs.iter().any(replies_wrong_node)) {
                self.owner.discard(self.generation);
            }
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
    // The codes as Redis and redis-rs spell them (redis-rs prints NOPERM as `NoPerm:`);
    // case-sensitive, so a host or master name like `redis-noauth-0` in a connect
    // error is not taken for a refusal.
    [
        "WRONGPASS",
        "NOAUTH",
        "NOPERM",
        "NoPerm:",
        "authentication failed",
    ]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_master_address_replaces_the_url_host_ipv6_bracketed() {
        let u = master_url("rediss://worker@placeholder:6379/2", "10.0.0.5", 6380).unwrap();
        assert_eq!(u, "rediss://worker@10.0.0.5:6380/2");
        let u = master_url("redis://placeholder:6379", "fd00::5", 6379).unwrap();
        assert_eq!(u, "redis://[fd00::5]:6379");
        let u = master_url("redis://placeholder:6379", "::1", 7000).unwrap();
        assert_eq!(u, "redis://[::1]:7000");
        assert!(u.as_str().into_connection_info().is_ok());
    }

    /// Every command's future, and every job's, holds a `get` future: connecting must
    /// stay out of it (boxed), or each job's state machine grows by kilobytes (issue 9:
    /// 17 KB a job, most of the RSS at 1,000 jobs in flight).
    #[test]
    fn a_commands_get_future_is_small_connecting_is_boxed() {
        let pool = deadpool_redis::Config::from_url("redis://127.0.0.1:1")
            .create_pool(Some(deadpool_redis::Runtime::Tokio1))
            .unwrap();
        let cmds = Commands::new(Source::Pool(pool), Duration::from_secs(1));
        let fut = cmds.get();
        let size = std::mem::size_of_val(&fut);
        assert!(size <= 512, "Commands::get's future is {size} bytes");
    }

    #[test]
    fn refused_credentials_are_told_from_an_absent_redis() {
        assert!(refused_access("WRONGPASS invalid username-password pair"));
        assert!(refused_access("NOPERM this user has no permissions"));
        // redis-rs's own spelling of the code, and Redis 7.2's message.
        assert!(refused_access(
            "NoPerm: this user has no permissions to run the 'evalsha' command"
        ));
        assert!(refused_access("NoPerm: No permissions to access a key"));
        // A name an operator chose is not a refusal.
        assert!(!refused_access(
            "redis sentinel: Sentinel redis://redis-noauth-0:26379: Connection refused (os error 111)"
        ));
        assert!(!refused_access("master \"noperm-primary\" unknown"));
        assert!(!refused_access("Connection refused (os error 111)"));
    }
}

#[cfg(test)]
mod cluster_tests {
    use super::owner_of;
    use redis::Value;

    fn range(start: i64, end: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])
    }

    #[test]
    fn the_slot_owner_is_read_from_cluster_slots() {
        let reply = [
            range(0, 5460, "10.0.0.1", 7000),
            range(5461, 10922, "", 7001),
            range(10923, 16383, "?", 7002),
        ];
        assert_eq!(
            owner_of(42, &reply, "seed"),
            Some(("10.0.0.1".into(), 7000))
        );
        // An empty host is the node that answered.
        assert_eq!(owner_of(6000, &reply, "seed"), Some(("seed".into(), 7001)));
        // `?`: an endpoint the node does not know; not the seed's host.
        assert_eq!(owner_of(12000, &reply, "seed"), None);
        assert_eq!(owner_of(16384, &reply, "seed"), None);
    }
}
