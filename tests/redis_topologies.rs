//! Redis beyond one open local server: an ACL user with a password (from a file or the
//! environment), and master discovery and failover through Sentinel. Real redis-server
//! processes on loopback ports of the test's own.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use std::collections::HashMap;
use std::time::Duration;

const ACL_PASSWORD: &str = "acl-Pw-7f3e9c1d-never-logged";

/// A redis-server whose `default` user is off and whose only user is `llmw`, with the
/// command categories a managed service typically grants (everything but @dangerous,
/// which holds CONFIG, so the eviction check must say it could not check).
fn acl_server() -> RedisServer {
    let pw = format!(">{ACL_PASSWORD}");
    RedisServer::start_tcp_args(&[
        "--user",
        "default",
        "off",
        "--user",
        "llmw",
        "on",
        &pw,
        "~*",
        "&*",
        "+@all",
        "-@dangerous",
        "+info",
    ])
}

async fn acl_conn(r: &RedisServer) -> redis::aio::MultiplexedConnection {
    let url = format!("redis://llmw:{ACL_PASSWORD}@127.0.0.1:{}", r.port());
    redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect as llmw")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_with_a_password_file_runs_jobs_and_the_password_is_never_shown()
-> anyhow::Result<()> {
    let redis = acl_server();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let pw_file = dir.path().join("redis-password");
    std::fs::write(&pw_file, format!("{ACL_PASSWORD}\n"))?;
    let mut tc = TestConfig::with_urls(&format!("redis://127.0.0.1:{}", redis.port()), sim.addr);
    tc.redis_extra = format!(
        "username = \"llmw\"\npassword_file = \"{}\"",
        pw_file.display()
    );
    let cfg_path = tc.write(dir.path(), "acl.toml");
    let cfg_s = cfg_path.to_str().unwrap();

    let mut w = WorkerProc::spawn(&cfg_path, "acl", &[]);
    let mut conn = acl_conn(&redis).await;
    push(&mut conn, "llm", &jobs("acl", 20)).await;
    let waited = wait_len(
        &mut conn,
        &key("llm", "results"),
        20,
        Duration::from_secs(30),
    )
    .await;
    context(waited, &[&w])?;
    assert_all_ok_once(&entries(&mut conn, &key("llm", "results")).await, 20);

    let status = run_bin_async(&["--config", cfg_s, "status"], &[], Duration::from_secs(20)).await;
    assert!(
        status.code == Some(0),
        "status as the ACL user: {}",
        status.all()
    );
    let check = run_bin_async(
        &["--config", cfg_s, "check-config"],
        &[],
        Duration::from_secs(20),
    )
    .await;
    assert!(check.code == Some(0), "check-config: {}", check.all());
    stop_clean(&mut w, Duration::from_secs(15)).await;
    let log = w.log();
    assert!(
        log.contains("maxmemory-policy") && log.contains("could not"),
        "CONFIG is not granted, so the eviction check says it could not check: {log}"
    );
    for (what, text) in [
        ("worker log", log.as_str()),
        ("status", &status.all()),
        ("check-config", &check.all()),
    ] {
        assert!(
            !text.contains(ACL_PASSWORD),
            "{what} shows the Redis password: {text}"
        );
    }
    // KEYS is @dangerous (not granted): SCAN, as the worker does.
    let left = llm_worker::connect::scan_match(&mut conn, "{llm}:slot:*").await?;
    assert!(left.is_empty(), "slot keys left after shutdown: {left:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_from_the_environment_and_the_user_in_the_url_work_too() -> anyhow::Result<()> {
    let redis = acl_server();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let tc = TestConfig::with_urls(
        &format!("redis://llmw@127.0.0.1:{}", redis.port()),
        sim.addr,
    );
    let cfg_path = tc.write(dir.path(), "acl-env.toml");
    let mut w = WorkerProc::spawn(&cfg_path, "acl-env", &[("REDIS_PASSWORD", ACL_PASSWORD)]);
    let mut conn = acl_conn(&redis).await;
    push(&mut conn, "llm", &jobs("env", 5)).await;
    let waited = wait_len(
        &mut conn,
        &key("llm", "results"),
        5,
        Duration::from_secs(30),
    )
    .await;
    context(waited, &[&w])?;
    assert_all_ok_once(&entries(&mut conn, &key("llm", "results")).await, 5);
    stop_clean(&mut w, Duration::from_secs(15)).await;
    assert!(!w.log().contains(ACL_PASSWORD));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_stop_the_worker_with_exit_2_naming_the_keys() -> anyhow::Result<()> {
    let redis = acl_server();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let tc = TestConfig::with_urls(
        &format!("redis://llmw@127.0.0.1:{}", redis.port()),
        sim.addr,
    );
    let cfg_path = tc.write(dir.path(), "acl-wrong.toml");
    let mut w = WorkerProc::spawn(
        &cfg_path,
        "acl-wrong",
        &[("REDIS_PASSWORD", "not-the-password-5b1e")],
    );
    let status = wait_exit(&mut w, Duration::from_secs(15)).await;
    let log = w.log();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(2),
        "a refused password is a config error: {log}"
    );
    assert!(
        log.contains("redis.password_env") && log.contains("redis.username"),
        "the message names the keys to fix: {log}"
    );
    assert!(!log.contains("not-the-password-5b1e"));

    // An unreadable password file is a config error before any connection.
    let mut tc = tc;
    tc.redis_extra = "password_file = \"/nonexistent/redis-password\"".into();
    let cfg_path = tc.write(dir.path(), "acl-nofile.toml");
    let out = run_bin_async(
        &["--config", cfg_path.to_str().unwrap(), "check-config"],
        &[],
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(out.all().contains("redis.password_file"), "{}", out.all());
    Ok(())
}

/// A Sentinel (`redis-server sentinel.conf --sentinel`) on a free loopback port,
/// monitoring `mymaster` with quorum 1 and a 1 s down-after.
struct Sentinel {
    port: u16,
    _dir: tempfile::TempDir,
    child: std::process::Child,
}

impl Sentinel {
    #[allow(clippy::disallowed_methods)] // a synchronous start, polled with thread sleeps
    fn start(master_port: u16) -> Sentinel {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds mymaster 1000\n\
                 sentinel failover-timeout mymaster 10000\n",
                dir = dir.path().display()
            ),
        )
        .expect("write sentinel.conf");
        let child = std::process::Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server --sentinel");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "sentinel did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Sentinel {
            port,
            _dir: dir,
            child,
        }
    }

    async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port))
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to sentinel")
    }

    async fn master_port(&self) -> Option<u16> {
        let mut c = self.conn().await;
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg("mymaster")
            .query_async(&mut c)
            .await
            .ok()?;
        addr.map(|(_, p)| p)
    }

    /// Whether the Sentinel knows one healthy replica (flags exactly "slave", link ok):
    /// only then will SENTINEL FAILOVER pick it.
    async fn replica_ready(&self) -> bool {
        let mut c = self.conn().await;
        let replicas: Vec<HashMap<String, String>> = match redis::cmd("SENTINEL")
            .arg("replicas")
            .arg("mymaster")
            .query_async(&mut c)
            .await
        {
            Ok(r) => r,
            Err(_) => return false,
        };
        replicas.iter().any(|r| {
            r.get("flags").map(String::as_str) == Some("slave")
                && r.get("master-link-status").map(String::as_str) == Some("ok")
        })
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One master, one replica, one Sentinel, two workers that find the master through the
/// Sentinel (their `redis.url` names a port nothing listens on). Jobs flow; then
/// SENTINEL FAILOVER promotes the replica while calls are in flight; more jobs are
/// pushed to the new master. Every job ends with exactly one `ok` result on the new
/// master, the workers follow it without a restart, and stop with no slot key left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_loses_no_job_and_duplicates_no_result() -> anyhow::Result<()> {
    const BEFORE: usize = 60;
    const AFTER: usize = 40;
    let master = RedisServer::start_tcp();
    let replica_port = master.port().to_string();
    let replica = RedisServer::start_tcp_args(&["--replicaof", "127.0.0.1", &replica_port]);
    let sentinel = Sentinel::start(master.port());
    assert!(
        wait_for(Duration::from_secs(20), || sentinel.replica_ready()).await,
        "the Sentinel never saw a healthy replica"
    );
    let sim = SimHandle::start(SimOptions {
        latency_ms: 100,
        ..SimOptions::default()
    })
    .await;
    let dir = tempfile::tempdir()?;
    // Nothing listens on url's port: the master can only be found through the Sentinel.
    let mut tc = TestConfig::with_urls(&format!("redis://127.0.0.1:{}", free_port()), sim.addr);
    tc.redis_extra = format!(
        "urls = [\"redis://127.0.0.1:{}\"]\nsentinel_master = \"mymaster\"",
        sentinel.port
    );
    tc.slots = 4;
    let cfg = tc.write(dir.path(), "sentinel.toml");
    let mut w1 = WorkerProc::spawn(
        &cfg,
        "sent-w1",
        &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "1000")],
    );
    let mut w2 = WorkerProc::spawn(
        &cfg,
        "sent-w2",
        &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "1000")],
    );

    let mut old = tcp_conn(master.port()).await;
    push(&mut old, "llm", &jobs("before", BEFORE)).await;
    context(
        wait_len(&mut old, "{llm}:results", 10, Duration::from_secs(30)).await,
        &[&w1, &w2],
    )?;
    // The pushes reached the replica before the failover (a producer's own writes lost
    // in a failover are the producer's to retry, not the worker's).
    let offset: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query_async(&mut old)
        .await?;
    assert_eq!(offset, 1, "the replica acknowledged the pushes");

    let done_at_failover = xlen(&mut old, "{llm}:results").await;
    assert!(
        (done_at_failover as usize) < BEFORE,
        "jobs still running when the failover starts"
    );
    let mut s = sentinel.conn().await;
    let _: () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg("mymaster")
        .query_async(&mut s)
        .await?;
    assert!(
        wait_for(Duration::from_secs(20), || async {
            sentinel.master_port().await == Some(replica.port())
        })
        .await,
        "the Sentinel did not promote the replica"
    );
    let mut new = tcp_conn(replica.port()).await;
    assert!(
        wait_for(Duration::from_secs(10), || async {
            let role: Vec<redis::Value> = redis::cmd("ROLE")
                .query_async(&mut tcp_conn(replica.port()).await)
                .await
                .unwrap_or_default();
            matches!(role.first(), Some(redis::Value::BulkString(b)) if b.as_slice() == b"master")
        })
        .await,
        "the replica never became a master"
    );
    push(&mut new, "llm", &jobs("after", AFTER)).await;
    let all = BEFORE + AFTER;
    context(
        wait_len(
            &mut new,
            "{llm}:results",
            all as u64,
            Duration::from_secs(60),
        )
        .await,
        &[&w1, &w2],
    )?;
    // Settled: nothing more arrives (a duplicate would come from a second run).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let results = entries(&mut new, "{llm}:results").await;
    assert_all_ok_once(&results, all);
    for w in [&mut w1, &mut w2] {
        stop_clean(w, Duration::from_secs(15)).await;
    }
    assert!(
        slot_keys(&mut new, "llm").await.is_empty(),
        "slot keys left on the new master"
    );
    for w in [&w1, &w2] {
        let log = w.log();
        assert!(!log.contains("panicked"), "{log}");
    }
    // The workers followed the failover without a restart.
    for w in [&w1, &w2] {
        assert!(
            w.log().matches("Redis reachable; taking jobs").count() >= 2,
            "reconnected after the failover: {}",
            w.log()
        );
    }
    Ok(())
}

/// The worker exits 2 within 20 s, before any model call; its log.
async fn exits_2_at_start(w: &mut WorkerProc, sim: &SimHandle) -> String {
    let status = wait_exit(w, Duration::from_secs(20)).await;
    let log = w.log();
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{log}");
    assert!(sim.sim.stats().calls_per_job.is_empty(), "no call");
    log
}

/// A server whose `default` user is off and whose user `llmw` (password [`ACL_PASSWORD`])
/// has `rules` (keys and commands), plus a user `admin` with every key and command for
/// the test's own writes; a config for `llmw` written to `dir`.
async fn acl_bed(
    rules: &[&str],
    sim: &SimHandle,
    dir: &std::path::Path,
) -> anyhow::Result<(
    RedisServer,
    std::path::PathBuf,
    redis::aio::MultiplexedConnection,
)> {
    let pw = format!(">{ACL_PASSWORD}");
    let mut args = vec![
        "--user",
        "default",
        "off",
        "--user",
        "admin",
        "on",
        ">admin-pw",
        "~*",
        "&*",
        "+@all",
        "--user",
        "llmw",
        "on",
        &pw,
    ];
    args.extend_from_slice(rules);
    let redis = RedisServer::start_tcp_args(&args);
    let mut tc = TestConfig::with_urls(&format!("redis://127.0.0.1:{}", redis.port()), sim.addr);
    tc.redis_extra = "username = \"llmw\"\npassword_env = \"LLMW_PW\"".into();
    let cfg = tc.write(dir, "acl.toml");
    let url = format!("redis://admin:admin-pw@127.0.0.1:{}", redis.port());
    let admin = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    Ok((redis, cfg, admin))
}

/// Review finding: a Redis user refused EVALSHA (the command, not a key) stops the worker
/// at start with exit 2 and says so (redis-rs prints that code as `NoPerm`, which the
/// check for a refused user did not match: the worker waited for Redis forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_refused_evalsha_stops_the_worker_at_start() -> anyhow::Result<()> {
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let rules = ["~*", "&*", "+@all", "-evalsha", "-eval"];
    let (_redis, cfg, mut admin) = acl_bed(&rules, &sim, dir.path()).await?;
    push(&mut admin, "llm", &jobs("noeval", 1)).await;
    let mut w = WorkerProc::spawn(&cfg, "noeval", &[("LLMW_PW", ACL_PASSWORD)]);
    let log = exits_2_at_start(&mut w, &sim).await;
    assert!(
        log.contains("'evalsha' command"),
        "Redis's own refusal: {log}"
    );
    assert!(!log.contains(ACL_PASSWORD), "{log}");
    Ok(())
}

/// Review finding: the slots' keys are a job's path too. A user refused `{llm}:slot*`
/// stops the worker at start with exit 2 naming them, the job left queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_refused_the_slot_keys_stops_the_worker_at_start() -> anyhow::Result<()> {
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    // Every key of the namespace but those starting `{llm}:sl`.
    let rules = ["~{llm}:[^s]*", "~{llm}:s[^l]*", "&*", "+@all"];
    let (_redis, cfg, mut admin) = acl_bed(&rules, &sim, dir.path()).await?;
    push(&mut admin, "llm", &jobs("noslot", 1)).await;
    let mut w = WorkerProc::spawn(&cfg, "noslot", &[("LLMW_PW", ACL_PASSWORD)]);
    let log = exits_2_at_start(&mut w, &sim).await;
    assert!(log.contains("{llm}:slot"), "names the slot keys: {log}");
    assert_eq!(
        entries(&mut admin, &key("llm", "jobs")).await.len(),
        1,
        "still queued"
    );
    Ok(())
}

/// Review finding: ACL selectors (Redis 7) may grant key families in separate selectors,
/// each command within one of them. The probe's combined call is then refused while
/// every family alone passes; the worker's own commands never combine those families, so
/// the worker starts and runs the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_whose_selectors_split_the_key_families_still_runs_jobs() -> anyhow::Result<()>
{
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let rules = [
        "~{llm}:[^c]*",
        "~{llm}:c[^a]*",
        "~{llm}:ca[^n]*",
        "&*",
        "+@all",
        "(~{llm}:cancel:* ~{llm}:done:* ~{llm}:inflight:* +@all)",
    ];
    let (_redis, cfg, mut admin) = acl_bed(&rules, &sim, dir.path()).await?;
    let idless = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
    push(&mut admin, "llm", &[jobs("sel", 1).remove(0), idless]).await;
    let mut w = WorkerProc::spawn(&cfg, "sel", &[("LLMW_PW", ACL_PASSWORD)]);
    let waited = wait_len(
        &mut admin,
        &key("llm", "results"),
        2,
        Duration::from_secs(20),
    )
    .await;
    context(waited, &[&w])?;
    assert_all_ok_once(&entries(&mut admin, &key("llm", "results")).await, 2);
    stop_clean(&mut w, Duration::from_secs(10)).await;
    Ok(())
}

/// Second review: families granted apart (ACL selectors) that one script call declares
/// together fail that call; here `{llm}:results` only in a selector of its own, so the
/// commit (jobs, results, markers in one call) could never write a result. Exit 2 at
/// start naming them, the job left queued (before: the worker started, and the job never
/// got a result).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn families_a_script_declares_together_but_granted_apart_stop_the_worker_at_start()
-> anyhow::Result<()> {
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let rules = ["~{llm}:[^r]*", "&*", "+@all", "(~{llm}:results +@all)"];
    let (_redis, cfg, mut admin) = acl_bed(&rules, &sim, dir.path()).await?;
    push(&mut admin, "llm", &jobs("apart", 1)).await;
    let mut w = WorkerProc::spawn(&cfg, "apart", &[("LLMW_PW", ACL_PASSWORD)]);
    let log = exits_2_at_start(&mut w, &sim).await;
    assert!(
        log.contains("{llm}:results") && log.contains("together"),
        "{log}"
    );
    assert_eq!(
        entries(&mut admin, &key("llm", "jobs")).await.len(),
        1,
        "still queued"
    );
    Ok(())
}

/// Second review: the fleet heartbeat and the stall gate are a job's path too (the
/// keepalive that keeps running entries from being taken over). A user refused
/// `{llm}:h*` stops at start naming `{llm}:heartbeat`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_refused_the_heartbeat_stops_the_worker_at_start() -> anyhow::Result<()> {
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let rules = ["~{llm}:[^h]*", "&*", "+@all"];
    let (_redis, cfg, mut admin) = acl_bed(&rules, &sim, dir.path()).await?;
    push(&mut admin, "llm", &jobs("nohb", 1)).await;
    let mut w = WorkerProc::spawn(&cfg, "nohb", &[("LLMW_PW", ACL_PASSWORD)]);
    let log = exits_2_at_start(&mut w, &sim).await;
    assert!(log.contains("{llm}:heartbeat"), "{log}");
    Ok(())
}
