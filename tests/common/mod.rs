//! Test harness: a real `redis-server` per test on a free port (`--save '' --appendonly no`
//! unless a test asks for AOF), the simulated provider in-process on 127.0.0.1:0, and the
//! real `llm-worker` binary as a child process. Every wait is bounded.
#![allow(dead_code)]

pub mod certs;

use anyhow::{Context, Result, bail};
use llm_worker::sim::{Fault, Rule};
use redis::AsyncCommands;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;
use tokio::time::Instant;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A redis-server owned by one test; killed on drop.
///
/// By default it listens only on a unix socket inside its own temp dir (`--port 0
/// --unixsocket DIR/redis.sock --unixsocketperm 700`): no other test, and no port race, can
/// connect a test to the wrong server. [`RedisServer::start_tcp`] listens on a free loopback
/// port instead, for the tests that need TCP (TLS, network faults).
pub struct RedisServer {
    /// The TCP port for servers from [`RedisServer::start_tcp`]; 0 for unix-socket servers
    /// (use [`RedisServer::port`], which says so loudly, rather than this field).
    pub port: u16,
    pub dir: tempfile::TempDir,
    child: Option<Child>,
    aof: bool,
    tcp: bool,
    /// More redis-server arguments (an ACL user, `--replicaof`), kept across restarts.
    args: Vec<String>,
}

impl RedisServer {
    /// A server on a unix socket in its own temp dir, no persistence.
    pub fn start() -> RedisServer {
        Self::start_opts(false)
    }

    /// With `aof`, the queue survives a restart (chaos tests). Unix socket.
    pub fn start_opts(aof: bool) -> RedisServer {
        Self::start_with(aof, false)
    }

    /// A server on a free TCP port of 127.0.0.1, for tests that need TCP.
    pub fn start_tcp() -> RedisServer {
        Self::start_with(false, true)
    }

    /// [`RedisServer::start_tcp`] with a choice of AOF persistence.
    pub fn start_tcp_opts(aof: bool) -> RedisServer {
        Self::start_with(aof, true)
    }

    /// A TCP server started with more arguments, e.g. `["--user", "w", "on", ">pw",
    /// "~*", "+@all"]` or `["--replicaof", "127.0.0.1", "6380"]`.
    pub fn start_tcp_args(args: &[&str]) -> RedisServer {
        Self::start_full(false, true, args)
    }

    fn start_with(aof: bool, tcp: bool) -> RedisServer {
        Self::start_full(aof, tcp, &[])
    }

    fn start_full(aof: bool, tcp: bool, args: &[&str]) -> RedisServer {
        let mut r = RedisServer {
            port: if tcp { free_port() } else { 0 },
            dir: tempfile::tempdir().expect("tempdir"),
            child: None,
            aof,
            tcp,
            args: args.iter().map(|a| a.to_string()).collect(),
        };
        r.spawn();
        r
    }

    /// The unix socket this server listens on (servers from `start`/`start_opts`).
    pub fn socket_path(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    /// The TCP port. Panics for a unix-socket server: a test that needs a port must start
    /// its server with [`RedisServer::start_tcp`].
    pub fn port(&self) -> u16 {
        assert!(
            self.tcp,
            "this redis-server listens on a unix socket only; start it with RedisServer::start_tcp()"
        );
        self.port
    }

    // Synchronous on purpose (used from Drop-like paths and `block_in_place`), so it polls
    // with a plain thread sleep.
    #[allow(clippy::disallowed_methods)]
    fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        if self.tcp {
            cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"]);
        } else {
            let sock = self.socket_path();
            // A stale socket file from before a restart would look like a live server.
            let _ = std::fs::remove_file(&sock);
            cmd.args(["--port", "0", "--unixsocketperm", "700", "--unixsocket"])
                .arg(&sock);
        }
        let child = cmd
            .args(["--save", ""])
            .args(["--appendonly", if self.aof { "yes" } else { "no" }])
            .args(["--appendfsync", "everysec"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (apt-get install redis-server)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.accepts() {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!("redis-server exited at start: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the server accepts a connection now.
    fn accepts(&self) -> bool {
        if self.tcp {
            std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
        } else {
            std::os::unix::net::UnixStream::connect(self.socket_path()).is_ok()
        }
    }

    /// `unix:///tmp/.../redis.sock` for unix-socket servers, `redis://127.0.0.1:PORT` for
    /// TCP ones. What every config and client of a test should use.
    pub fn url(&self) -> String {
        if self.tcp {
            format!("redis://127.0.0.1:{}", self.port)
        } else {
            format!("unix://{}", self.socket_path().display())
        }
    }

    /// The redis-server's pid (for SIGSTOP and friends).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops with SHUTDOWN-like semantics (SIGTERM: AOF is flushed) and waits.
    /// Blocking (thread sleep between polls): call it from `block_in_place` in async tests.
    #[allow(clippy::disallowed_methods)]
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), libc_sig::TERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.url()).expect("client");
        tokio::time::timeout(
            Duration::from_secs(5),
            client.get_multiplexed_async_connection(),
        )
        .await
        .expect("redis connect timeout")
        .expect("redis connect")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

pub mod libc_sig {
    pub const TERM: &str = "TERM";
    pub const INT: &str = "INT";
    pub const KILL: &str = "KILL";
    pub const STOP: &str = "STOP";
    pub const CONT: &str = "CONT";
}

/// Sends a signal by name with `kill(1)` (no libc dependency).
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// The simulated provider, in this test process.
pub struct SimHandle {
    pub sim: llm_worker::sim::Sim,
    pub addr: SocketAddr,
    stop: tokio_util::sync::CancellationToken,
}

impl SimHandle {
    pub async fn start(opts: llm_worker::sim::SimOptions) -> SimHandle {
        let stop = tokio_util::sync::CancellationToken::new();
        let (sim, addr) = llm_worker::sim::Sim::spawn(opts, stop.clone())
            .await
            .expect("sim");
        SimHandle { sim, addr, stop }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Parameters of a test config; `extra` is appended verbatim (use env overrides for
/// values of tables already present).
pub struct TestConfig {
    pub redis_url: String,
    /// Lines added to `[redis]` (e.g. `password_file = "..."`).
    pub redis_extra: String,
    pub sim: SocketAddr,
    pub namespace: String,
    pub slots: u32,
    pub concurrency: usize,
    /// `worker.read_ahead`: 0 here (tests count the entries a worker holds), unlike the
    /// daemon's default (a quarter of `concurrency`).
    pub read_ahead: usize,
    pub ttl_ms: u64,
    pub grace_ms: u64,
    pub listen: String,
    pub extra: String,
    /// `providers.*.validate_key` (off by default in tests: the sim lists only the
    /// models it knows of unless told which).
    pub validate_key: bool,
    /// Lines added to `[pools.default]` (e.g. `max_per_tenant = 4`).
    pub pool_extra: String,
    /// Lines added to `[queue]` (e.g. `max_deliveries = 1`).
    pub queue_extra: String,
}

impl TestConfig {
    pub fn new(redis: &RedisServer, sim: &SimHandle) -> TestConfig {
        Self::with_urls(&redis.url(), sim.addr)
    }

    pub fn toml(&self) -> String {
        format!(
            r#"
[redis]
url = "{redis}"
{redis_extra}

[queue]
namespace = "{ns}"
claim_idle_ms = 60000
block_ms = 200
{queue_extra}

[worker]
concurrency = {conc}
read_ahead = {read_ahead}
shutdown_grace_ms = {grace}

[server]
listen = "{listen}"

[slots]
ttl_ms = {ttl}
acquire_timeout_ms = 1000

[log]
level = "info,llm_worker=debug"

[pools.default]
slots = {slots}
{pool_extra}

[providers.p1]
base_url = "http://{sim}/v1"
api_key_env = ""
validate_key = {validate}

[providers.p2]
base_url = "http://{sim}/v1"
api_key_env = ""
validate_key = {validate}

[models.m1]
provider = "p1"
input_per_mtok = 0.14
output_per_mtok = 0.42
cached_input_per_mtok = 0.028
context_window = 1000

[models.m2]
provider = "p1"
input_per_mtok = 0.10
output_per_mtok = 2.50
context_window = 100000

[models.m3]
provider = "p2"
input_per_mtok = 2.00
output_per_mtok = 8.00
cached_input_per_mtok = 0.50
context_window = 1000000

[routes]
default = ["m1", "m2", "m3"]

[retry]
max_attempts_per_model = 3
base_delay_ms = 20
max_delay_ms = 100
max_retry_after_ms = 2000
{extra}
"#,
            redis = self.redis_url,
            redis_extra = self.redis_extra,
            ns = self.namespace,
            conc = self.concurrency,
            read_ahead = self.read_ahead,
            grace = self.grace_ms,
            listen = self.listen,
            ttl = self.ttl_ms,
            slots = self.slots,
            sim = self.sim,
            extra = self.extra,
            validate = self.validate_key,
            pool_extra = self.pool_extra,
            queue_extra = self.queue_extra,
        )
    }

    /// A config for tests that need no running Redis or provider (config errors, CLI):
    /// `redis_url` should point at a port of the test's own (never 6379).
    pub fn with_urls(redis_url: &str, sim: SocketAddr) -> TestConfig {
        TestConfig {
            redis_url: redis_url.to_string(),
            redis_extra: String::new(),
            sim,
            namespace: "llm".into(),
            slots: 4,
            concurrency: 16,
            read_ahead: 0,
            ttl_ms: 3000,
            grace_ms: 3000,
            listen: String::new(),
            extra: String::new(),
            validate_key: false,
            pool_extra: String::new(),
            queue_extra: String::new(),
        }
    }

    pub fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.toml()).expect("write config");
        p
    }

    /// The same config as a parsed, validated [`llm_worker::config::Config`].
    pub fn parsed(&self) -> llm_worker::config::Config {
        llm_worker::config::Config::from_toml_str(&self.toml(), &HashMap::new())
            .expect("test config")
    }
}

/// The built `llm-worker` binary. Cargo names it only to integration tests; the
/// benchmarks (examples) share this harness for Redis and the sim but not the binary.
#[allow(clippy::option_env_unwrap)] // env! would not compile in the examples that share this file
pub fn bin() -> PathBuf {
    PathBuf::from(
        option_env!("CARGO_BIN_EXE_llm-worker")
            .expect("the llm-worker binary is known to integration tests only"),
    )
}

/// A worker process; killed on drop. Its stderr goes to a log file (printed by
/// [`WorkerProc::log`] for diagnosis).
pub struct WorkerProc {
    pub child: Child,
    pub log_path: PathBuf,
}

impl WorkerProc {
    pub fn spawn(config: &Path, name: &str, env: &[(&str, &str)]) -> WorkerProc {
        let log_path = config.with_file_name(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut cmd = Command::new(bin());
        cmd.arg("--config").arg(config).arg("run");
        scrub_env(&mut cmd);
        cmd.env("LLM_WORKER__QUEUE__CONSUMER", name);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn llm-worker");
        WorkerProc { child, log_path }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        signal(self.pid(), sig);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for the process to exit without blocking the runtime (the sim runs in it).
/// `None` if still running after `timeout`.
pub async fn wait_exit(w: &mut WorkerProc, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(s)) = w.child.try_wait() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGTERM, then a clean exit (0) within `timeout`.
pub async fn stop_clean(w: &mut WorkerProc, timeout: Duration) {
    w.signal(libc_sig::TERM);
    let status = wait_exit(w, timeout).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "exit {status:?}\n{}",
        w.log()
    );
}

/// Waits until the worker's log contains `needle`.
pub async fn wait_log(w: &WorkerProc, needle: &str, timeout: Duration) -> bool {
    wait_for(timeout, || async { w.log().contains(needle) }).await
}

/// Waits until at least `n` calls run in the sim at once.
pub async fn in_flight_at_least(sim: &SimHandle, n: u64, timeout: Duration) -> bool {
    wait_for(timeout, || async { sim.sim.stats().in_flight >= n }).await
}

/// Waits until consumer `name` is in the waiter queue of pool `default` (tokens are
/// `<consumer>:<hex>`).
pub async fn wait_slot_queue(
    conn: &redis::aio::MultiplexedConnection,
    name: &str,
    timeout: Duration,
) -> bool {
    let prefix = format!("{name}:");
    wait_for(timeout, || {
        let mut c = conn.clone();
        let prefix = prefix.clone();
        async move {
            let q: Vec<String> = c
                .zrange("{llm}:slotq:default", 0, -1)
                .await
                .unwrap_or_else(|e| panic!("ZRANGE {{llm}}:slotq:default: {e}"));
            q.iter().any(|t| t.starts_with(&prefix))
        }
    })
    .await
}

/// Polls `cond` every 20 ms until it is true or `timeout` passes.
pub async fn wait_for<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn key(ns: &str, name: &str) -> String {
    format!("{{{ns}}}:{name}")
}

/// Pushes payloads (raw strings) as jobs; returns their entry ids.
pub async fn push(
    conn: &mut redis::aio::MultiplexedConnection,
    ns: &str,
    payloads: &[String],
) -> Vec<String> {
    let mut pipe = redis::pipe();
    for p in payloads {
        pipe.cmd("XADD")
            .arg(key(ns, "jobs"))
            .arg("*")
            .arg("payload")
            .arg(p);
    }
    pipe.query_async(conn).await.expect("xadd")
}

pub fn job(id: &str, text: &str) -> String {
    serde_json::json!({"id": id, "messages": [{"role": "user", "content": text}]}).to_string()
}

/// `n` jobs `<prefix>-0` .. `<prefix>-<n-1>`, each saying "hi".
pub fn jobs(prefix: &str, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| job(&format!("{prefix}-{i}"), "hi"))
        .collect()
}

/// A sim rule: `fault` on every call to `model`.
pub fn always(model: &str, fault: Fault) -> Rule {
    Rule {
        model: model.into(),
        fault,
        probability: 1.0,
        first_n: None,
    }
}

/// Every result `ok`, every job id at most once; returns the ids.
pub fn ok_once(results: &[(String, HashMap<String, String>)]) -> HashSet<String> {
    let ids: HashSet<String> = results.iter().map(|(_, r)| r["job_id"].clone()).collect();
    assert_eq!(
        ids.len(),
        results.len(),
        "every job exactly once, nothing acknowledged twice"
    );
    for (_, r) in results {
        assert_eq!(r["status"], "ok", "{r:?}");
    }
    ids
}

/// `n` results, every one `ok`, every job id exactly once.
pub fn assert_all_ok_once(results: &[(String, HashMap<String, String>)], n: usize) {
    assert_eq!(results.len(), n, "one result per job");
    ok_once(results);
}

/// [`ok_once`] on `{llm}:results`.
pub async fn ok_results_once(conn: &mut redis::aio::MultiplexedConnection) -> HashSet<String> {
    ok_once(&entries(conn, "{llm}:results").await)
}

/// Every entry of a stream as (entry id, fields).
pub async fn entries(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> Vec<(String, HashMap<String, String>)> {
    entries_as(conn, stream).await
}

/// Every entry of a stream as (entry id, fields as `T`; a value that does not convert is
/// `T::default()`).
async fn entries_as<T: redis::FromRedisValue + Default>(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> Vec<(String, HashMap<String, T>)> {
    // In pages of 1000: one XRANGE of a 10,000-entry stream can outlast the connection's
    // 500 ms reply timeout on a loaded machine.
    let mut all = vec![];
    let mut start = "-".to_string();
    loop {
        let page: redis::streams::StreamRangeReply = conn
            .xrange_count(stream, &start, "+", 1000)
            .await
            .expect("xrange");
        let n = page.ids.len();
        if let Some(last) = page.ids.last() {
            start = format!("({}", last.id);
        }
        all.extend(page.ids);
        if n < 1000 {
            break;
        }
    }
    all.into_iter()
        .map(|e| {
            let m = e
                .map
                .into_iter()
                .map(|(k, v)| (k, redis::from_redis_value::<T>(v).unwrap_or_default()))
                .collect();
            (e.id, m)
        })
        .collect()
}

/// Length of a stream. Panics when Redis does not answer: an unreachable Redis must never
/// read as "empty".
pub async fn xlen(conn: &mut redis::aio::MultiplexedConnection, stream: &str) -> u64 {
    conn.xlen(stream)
        .await
        .unwrap_or_else(|e| panic!("XLEN {stream}: Redis did not answer ({e})"))
}

/// [`xlen`] that returns Redis errors instead of panicking, for waits across an outage.
pub async fn try_xlen(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> redis::RedisResult<u64> {
    conn.xlen(stream).await
}

/// Slot keys present now. Panics when Redis does not answer, so that "no slot key left"
/// cannot pass against a dead Redis.
pub async fn slot_keys(conn: &mut redis::aio::MultiplexedConnection, ns: &str) -> Vec<String> {
    conn.keys(format!("{{{ns}}}:slot:*"))
        .await
        .unwrap_or_else(|e| panic!("KEYS {{{ns}}}:slot:*: Redis did not answer ({e})"))
}

/// Waits until `stream` has at least `n` entries; fails with the worker logs if not. A
/// Redis error counts as "not yet" (so the wait spans a restart) and is named in the
/// failure, never read as a length.
pub async fn wait_len(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    n: u64,
    timeout: Duration,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let len = try_xlen(conn, stream).await;
        if matches!(len, Ok(len) if len >= n) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            match len {
                Ok(len) => bail!("{stream} has {len} entries, expected {n} within {timeout:?}"),
                Err(e) => bail!(
                    "{stream}: Redis did not answer ({e}), expected {n} entries within {timeout:?}"
                ),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn context<T>(r: Result<T>, workers: &[&WorkerProc]) -> Result<T> {
    r.with_context(|| logs_tail(workers, 40))
}

/// The last `n` log lines of each worker, under a header naming its log file.
pub fn logs_tail(workers: &[&WorkerProc], n: usize) -> String {
    workers
        .iter()
        .map(|w| format!("--- {} ---\n{}", w.log_path.display(), tail(&w.log(), n)))
        .collect::<Vec<_>>()
        .join("\n")
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Removes from a child's environment everything that could change its config or point it
/// at another Redis (`LLM_WORKER__*`, `LLM_WORKER_CONFIG`, API keys, `RUST_LOG`): a child
/// sees only what its test sets.
pub fn scrub_env(cmd: &mut Command) {
    for (k, _) in std::env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        if k.starts_with("LLM_WORKER")
            || k.ends_with("_API_KEY")
            || k == "REDIS_PASSWORD"
            || k == "RUST_LOG"
        {
            cmd.env_remove(k);
        }
    }
}

/// What a finished (or timed-out and killed) run of the binary printed.
#[derive(Debug)]
pub struct BinOutput {
    /// Exit code; `None` if killed by a signal or by the timeout.
    pub code: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
}

impl BinOutput {
    /// stdout and stderr together, for assertion messages.
    pub fn all(&self) -> String {
        format!(
            "exit {:?} (timed out: {})\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.code, self.timed_out, self.stdout, self.stderr
        )
    }
}

/// Runs the real binary with `args` and only the environment `env` on top of a scrubbed
/// one ([`scrub_env`]); killed after `timeout`. Blocking: call it from
/// `tokio::task::spawn_blocking` inside async tests.
#[allow(clippy::disallowed_methods)] // blocking by design, run on its own thread
pub fn run_bin(args: &[&str], env: &[(&str, &str)], timeout: Duration) -> BinOutput {
    let mut cmd = Command::new(bin());
    cmd.args(args);
    scrub_env(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn llm-worker");
    let read = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut s);
            }
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = read(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    );
    let err = read(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let (status, timed_out) = loop {
        if let Ok(Some(s)) = child.try_wait() {
            break (Some(s), false);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            break (child.wait().ok(), true);
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    BinOutput {
        code: if timed_out {
            None
        } else {
            status.and_then(|s| s.code())
        },
        timed_out,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// [`run_bin`] on a blocking thread, for async tests.
pub async fn run_bin_async(args: &[&str], env: &[(&str, &str)], timeout: Duration) -> BinOutput {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        run_bin(&args, &env, timeout)
    })
    .await
    .expect("run_bin thread")
}

/// Appends one job entry with arbitrary fields and raw (possibly non-UTF-8) values.
pub async fn push_fields(
    conn: &mut redis::aio::MultiplexedConnection,
    ns: &str,
    fields: &[(&str, &[u8])],
) -> String {
    let raw: Vec<(&[u8], &[u8])> = fields.iter().map(|(k, v)| (k.as_bytes(), *v)).collect();
    push_raw(conn, ns, &raw).await
}

/// Every entry of a stream as (entry id, fields as raw bytes).
pub async fn entries_raw(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> Vec<(String, HashMap<String, Vec<u8>>)> {
    entries_as(conn, stream).await
}

/// Appends one job entry whose field names may be any bytes (not only UTF-8).
pub async fn push_raw(
    conn: &mut redis::aio::MultiplexedConnection,
    ns: &str,
    fields: &[(&[u8], &[u8])],
) -> String {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(key(ns, "jobs")).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async(conn).await.expect("xadd")
}

/// Every entry of a stream as (entry id, fields in stream order, names and values as
/// bytes): read from the raw reply, so a field name that is not UTF-8 and a repeated name
/// are seen as they are.
pub async fn entries_bytes(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
) -> Vec<(String, Vec<(Vec<u8>, Vec<u8>)>)> {
    let v: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .expect("xrange");
    let bytes = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => b.clone(),
        redis::Value::SimpleString(s) => s.clone().into_bytes(),
        other => panic!("not a string: {other:?}"),
    };
    let redis::Value::Array(es) = v else {
        panic!("XRANGE reply: {v:?}")
    };
    es.iter()
        .map(|e| {
            let redis::Value::Array(pair) = e else {
                panic!("entry: {e:?}")
            };
            let redis::Value::Array(fs) = &pair[1] else {
                panic!("fields: {e:?}")
            };
            let id = String::from_utf8(bytes(&pair[0])).expect("entry id");
            (
                id,
                fs.chunks(2).map(|p| (bytes(&p[0]), bytes(&p[1]))).collect(),
            )
        })
        .collect()
}

/// Number of pending entries of `group` on `stream`.
pub async fn pending_count(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    group: &str,
) -> i64 {
    let v: redis::Value = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async(conn)
        .await
        .expect("xpending");
    match v {
        redis::Value::Array(a) => match a.first() {
            Some(redis::Value::Int(n)) => *n,
            other => panic!("unexpected XPENDING reply {other:?}"),
        },
        other => panic!("unexpected XPENDING reply {other:?}"),
    }
}

/// Names of the consumers of `group` on `stream` (XINFO CONSUMERS). Panics when Redis
/// does not answer; an absent group or stream is no consumer.
pub async fn consumers(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    group: &str,
) -> Vec<String> {
    let r: redis::RedisResult<Vec<HashMap<String, redis::Value>>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(stream)
        .arg(group)
        .query_async(conn)
        .await;
    match r {
        Ok(list) => list
            .into_iter()
            .filter_map(|c| c.get("name").cloned())
            .map(|v| redis::from_redis_value::<String>(v).expect("consumer name"))
            .collect(),
        Err(e) if e.to_string().contains("no such key") || e.to_string().contains("NOGROUP") => {
            vec![]
        }
        Err(e) => panic!("XINFO CONSUMERS {stream} {group}: {e}"),
    }
}

/// Waits until every consumer in `names` is registered in `group` of `stream`. On Redis
/// 7.0 a consumer is registered once a read returned it an entry, so this says "has taken
/// a job", not "is reading" (for that, [`wait_readers`]).
pub async fn wait_consumers(
    conn: &redis::aio::MultiplexedConnection,
    stream: &str,
    group: &str,
    names: &[&str],
    timeout: Duration,
) -> bool {
    wait_for(timeout, || {
        let mut c = conn.clone();
        async move {
            let have = consumers(&mut c, stream, group).await;
            names.iter().all(|n| have.iter().any(|h| h == n))
        }
    })
    .await
}

/// Waits until at least `n` client connections have XREADGROUP as their last command
/// (CLIENT LIST): that many workers are in their read loop. (XINFO CONSUMERS is no such
/// signal: Redis 7.0 registers a consumer only once a read returns an entry.)
pub async fn wait_readers(
    conn: &redis::aio::MultiplexedConnection,
    n: usize,
    timeout: Duration,
) -> bool {
    wait_for(timeout, || {
        let mut c = conn.clone();
        async move {
            let list: String = redis::cmd("CLIENT")
                .arg("LIST")
                .query_async(&mut c)
                .await
                .unwrap_or_else(|e| panic!("CLIENT LIST: {e}"));
            list.lines()
                .filter(|l| l.contains("cmd=xreadgroup"))
                .count()
                >= n
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------
// Redis introspection and faults, and fleet members, shared by the fault tests.

/// A numeric field of `INFO <section>`; panics when Redis does not answer or lacks it
/// (so a dead server never reads as "0").
pub async fn info_u64(
    conn: &mut redis::aio::MultiplexedConnection,
    section: &str,
    field: &str,
) -> u64 {
    let info: String = tokio::time::timeout(
        Duration::from_secs(5),
        redis::cmd("INFO").arg(section).query_async(conn),
    )
    .await
    .expect("INFO in time")
    .expect("INFO");
    let prefix = format!("{field}:");
    info.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in INFO {section}"))
}

/// The redis-server's own pid, to stop (SIGSTOP) and continue it.
pub async fn redis_pid(conn: &mut redis::aio::MultiplexedConnection) -> u32 {
    let pid = info_u64(conn, "server", "process_id").await;
    u32::try_from(pid).expect("pid fits u32")
}

/// Bytes Redis uses now (`used_memory`).
pub async fn used_memory(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    info_u64(conn, "memory", "used_memory").await
}

/// `maxmemory` = `bytes` under `noeviction`: past it every memory-growing write is
/// refused with OOM. 0 lifts the limit.
pub async fn set_maxmemory(conn: &mut redis::aio::MultiplexedConnection, bytes: u64) {
    for (k, v) in [
        ("maxmemory-policy", "noeviction".to_string()),
        ("maxmemory", bytes.to_string()),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(k)
            .arg(v)
            .query_async(conn)
            .await
            .unwrap_or_else(|e| panic!("CONFIG SET {k}: {e}"));
    }
}

/// A `Slots` of the library under its own consumer name behaves as one more process of
/// the fleet: its own token, driver task and connections (stopped by `cancel`).
pub async fn slots_for(
    tc: &TestConfig,
    consumer: &str,
    cancel: &tokio_util::sync::CancellationToken,
) -> llm_worker::slots::Slots {
    let mut cfg = tc.parsed();
    cfg.queue.consumer = consumer.to_string();
    let pool = llm_worker::connect::commands(&cfg).expect("pool");
    let s = tokio::time::timeout(
        Duration::from_secs(5),
        llm_worker::slots::Slots::connect(&cfg, pool),
    )
    .await
    .expect("connect in time")
    .expect("connect");
    s.spawn_background(cancel.clone());
    s
}

/// Every worker logs "worker started" within 10 s (its log is shown if not).
pub async fn assert_started(workers: &[&WorkerProc]) {
    for w in workers {
        assert!(
            wait_log(w, "worker started", Duration::from_secs(10)).await,
            "{}",
            w.log()
        );
    }
}

/// Consumer-group setup as the worker does it, for tests that place entries by hand.
pub async fn create_group(conn: &mut redis::aio::MultiplexedConnection) {
    let r: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("{llm}:jobs")
        .arg("workers")
        .arg("0")
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    if let Err(e) = r {
        assert_eq!(e.code(), Some("BUSYGROUP"), "{e}");
    }
}

/// Reads every new entry as consumer `who`.
pub async fn read_as(conn: &mut redis::aio::MultiplexedConnection, who: &str) {
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("workers")
        .arg(who)
        .arg("STREAMS")
        .arg("{llm}:jobs")
        .arg(">")
        .query_async(conn)
        .await
        .expect("xreadgroup");
}

/// Gives `entry` to `who`, idle for `idle_ms`, delivered `count` times so far.
pub async fn xclaim(
    conn: &mut redis::aio::MultiplexedConnection,
    who: &str,
    entry: &str,
    idle_ms: u64,
    count: u64,
) {
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg("{llm}:jobs")
        .arg("workers")
        .arg(who)
        .arg(0)
        .arg(entry)
        .arg("IDLE")
        .arg(idle_ms)
        .arg("RETRYCOUNT")
        .arg(count)
        .arg("JUSTID")
        .query_async(conn)
        .await
        .expect("xclaim");
}

/// A queue with its own consumer name.
pub fn queue_as(redis: &RedisServer, sim: &SimHandle, consumer: &str) -> llm_worker::queue::Queue {
    let mut cfg = TestConfig::new(redis, sim).parsed();
    cfg.queue.consumer = consumer.into();
    let pool = llm_worker::connect::commands(&cfg).expect("pool");
    llm_worker::queue::Queue::new(&cfg, pool)
}

/// (consumer, delivery count) of a pending entry, None when it is not pending.
pub async fn pending_of(
    conn: &mut redis::aio::MultiplexedConnection,
    entry: &str,
) -> Option<(String, u64)> {
    let p: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg("{llm}:jobs")
        .arg("workers")
        .arg(entry)
        .arg(entry)
        .arg(1)
        .query_async(conn)
        .await
        .expect("xpending");
    p.into_iter().next().map(|(_, c, _, n)| (c, n))
}

/// Redis server time in ms.
pub async fn server_ms(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(conn).await.expect("time");
    s * 1000 + us / 1000
}

/// Calls the sim has answered for `model`, whatever the status.
pub fn calls_to(sim: &SimHandle, model: &str) -> u64 {
    sim.sim
        .stats()
        .requests
        .get(model)
        .map(|m| m.values().sum())
        .unwrap_or(0)
}

/// A plain connection to a loopback redis-server on `port` (a cluster node, a Sentinel's
/// master or replica).
pub async fn tcp_conn(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// `enqueue --prompt hi --id ID --wait --timeout TIMEOUT` with `config`, running in a task
/// (bounded by 60 s), so the test can act on Redis while it waits.
pub fn spawn_enqueue_wait(
    config: &Path,
    id: &str,
    timeout: &str,
) -> tokio::task::JoinHandle<BinOutput> {
    let (cfg, id, timeout) = (
        config.to_str().expect("utf-8 path").to_string(),
        id.to_string(),
        timeout.to_string(),
    );
    tokio::spawn(async move {
        run_bin_async(
            &[
                "--config",
                &cfg,
                "enqueue",
                "--prompt",
                "hi",
                "--id",
                &id,
                "--wait",
                "--timeout",
                &timeout,
            ],
            &[],
            Duration::from_secs(60),
        )
        .await
    })
}

/// Calls of `cmd` Redis has run so far (INFO commandstats counts commands inside
/// scripts too).
pub async fn calls_of(conn: &mut redis::aio::MultiplexedConnection, cmd: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("INFO commandstats: {e}"));
    let key = format!("cmdstat_{cmd}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// An ACL for the `default` user that allows every key of the `llm` namespace but the
/// cancel markers (`{llm}:cancel:*`): a Redis user refused those keys.
pub async fn refuse_cancel_markers_to_default_user(
    conn: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<()> {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg("resetkeys")
        .arg("~{llm}:[^c]*")
        .arg("~{llm}:c[^a]*")
        .arg("~{llm}:ca[^n]*")
        .query_async(conn)
        .await?;
    Ok(())
}
