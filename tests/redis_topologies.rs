//! Redis beyond one open local server: an ACL user with a password (from a file or the
//! environment), and master discovery and failover through Sentinel. Real redis-server
//! processes on loopback ports of the test's own.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
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
