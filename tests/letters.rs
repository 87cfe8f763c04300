//! The tools for jobs that did not end `ok`, against a real worker and Redis: a failed
//! job's copy in `{ns}:failed` and `retry ID`; dead letters listed, shown, replayed on
//! another route, purged by age; `purge` of a namespace (refused while workers run); and
//! the CLI piped into `head` (quiet exit).

mod common;

use common::*;
use llm_worker::sim::{Fault, Rule, SimOptions};
use std::collections::HashMap;
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

fn fail_first(model: &str, n: u64) -> Rule {
    Rule {
        model: model.into(),
        fault: Fault::Status { status: 503 },
        probability: 1.0,
        first_n: Some(n),
    }
}

fn status_of(results: &[(String, HashMap<String, String>)], id: &str) -> Vec<String> {
    results
        .iter()
        .filter(|(_, r)| r["job_id"] == id)
        .map(|(_, r)| r["status"].clone())
        .collect()
}

async fn cli(cfg: &std::path::Path, args: &[&str]) -> BinOutput {
    let mut all = vec!["--config", cfg.to_str().unwrap()];
    all.extend_from_slice(args);
    run_bin_async(&all, &[], T).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_is_kept_and_retry_runs_it_again_under_its_id() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    // Every model fails the first job's 9 calls (3 attempts each), then answers.
    let sim = SimHandle::start(SimOptions {
        rules: vec![
            fail_first("m1", 3),
            fail_first("m2", 3),
            fail_first("m3", 3),
        ],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "l.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "l1", &[]);
    push(&mut conn, "llm", &[job("unlucky", "hello")]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w])?;
    assert_eq!(
        status_of(&entries(&mut conn, "{llm}:results").await, "unlucky"),
        ["failed"]
    );

    let list = cli(&cfg, &["dead", "list", "--failed"]).await;
    assert_eq!(list.code, Some(0), "{}", list.all());
    assert!(
        list.stdout
            .lines()
            .next()
            .is_some_and(|h| h.contains("JOB ID")),
        "{}",
        list.all()
    );
    assert!(
        list.stdout.contains("unlucky") && list.stdout.contains("503"),
        "{}",
        list.all()
    );
    let show = cli(&cfg, &["dead", "show", "unlucky", "--failed"]).await;
    assert_eq!(show.code, Some(0), "{}", show.all());
    let shown: serde_json::Value = serde_json::from_str(&show.stdout)?;
    assert_eq!(shown["fields"]["payload"]["id"], "unlucky", "{shown}");

    let retry = cli(&cfg, &["retry", "unlucky"]).await;
    assert_eq!(retry.code, Some(0), "{}", retry.all());
    assert!(retry.stdout.contains("pushed again"), "{}", retry.all());
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    assert_eq!(
        status_of(&entries(&mut conn, "{llm}:results").await, "unlucky"),
        ["failed", "ok"]
    );
    // The copy was used up; an ok id is not retried again.
    let list = cli(&cfg, &["dead", "list", "--failed"]).await;
    assert!(list.stdout.contains("no failed letters"), "{}", list.all());
    let again = cli(&cfg, &["retry", "unlucky"]).await;
    assert_eq!(again.code, Some(1), "{}", again.all());
    assert!(again.stderr.contains("already ended ok"), "{}", again.all());
    let none = cli(&cfg, &["retry", "never-pushed"]).await;
    assert_eq!(none.code, Some(1), "{}", none.all());
    assert!(none.stderr.contains("no copy of job"), "{}", none.all());
    stop_clean(&mut w, T).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_replayed_on_another_route_and_purged_by_age() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "d.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "d1", &[]);
    let bad_route = serde_json::json!({"id": "lost-route", "route": "nope",
        "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let not_json = "this is not json".to_string();
    push(&mut conn, "llm", &[bad_route, not_json]).await;
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    let list = cli(&cfg, &["dead", "list"]).await;
    assert!(
        list.stdout.contains("lost-route") && list.stdout.contains("unknown route"),
        "{}",
        list.all()
    );

    // A --route that is not configured is refused, naming the routes there are.
    let wrong = cli(&cfg, &["dead", "replay", "lost-route", "--route", "nope"]).await;
    assert_eq!(wrong.code, Some(1), "{}", wrong.all());
    assert!(wrong.stderr.contains("default"), "{}", wrong.all());
    let replay = cli(
        &cfg,
        &["dead", "replay", "lost-route", "--route", "default"],
    )
    .await;
    assert_eq!(replay.code, Some(0), "{}", replay.all());
    assert!(
        replay.stdout.contains("replayed 1 dead letters"),
        "{}",
        replay.all()
    );
    context(wait_len(&mut conn, "{llm}:results", 3, T).await, &[&w])?;
    assert_eq!(
        status_of(&entries(&mut conn, "{llm}:results").await, "lost-route"),
        ["invalid", "ok"]
    );
    // The not-JSON letter stays; --route cannot change it, and says why.
    let (letters, _) = {
        let c = tc.parsed();
        llm_worker::letters::list(&c, llm_worker::letters::Which::Dead, 10).await?
    };
    assert_eq!(letters.len(), 1);
    let odd = cli(
        &cfg,
        &["dead", "replay", &letters[0].entry, "--route", "default"],
    )
    .await;
    assert_eq!(odd.code, Some(1), "{}", odd.all());
    assert!(odd.stderr.contains("not a JSON object"), "{}", odd.all());

    // Purge by age: nothing is older than an hour; everything is older than 1 s.
    let keep = cli(&cfg, &["dead", "purge", "--older-than", "1h"]).await;
    assert!(keep.stdout.contains("deleted 0"), "{}", keep.all());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let gone = cli(&cfg, &["dead", "purge", "--older-than", "1s"]).await;
    assert!(gone.stdout.contains("deleted 1"), "{}", gone.all());
    assert_eq!(xlen(&mut conn, "{llm}:dead").await, 0);
    let bad = cli(&cfg, &["dead", "purge", "--older-than", "-3d"]).await;
    assert_eq!(
        bad.code,
        Some(2),
        "a bad duration is a usage error: {}",
        bad.all()
    );
    assert!(bad.stderr.contains("older-than"), "{}", bad.all());
    stop_clean(&mut w, T).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_refuses_while_workers_run_then_deletes_the_namespace() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "p.toml");
    let mut conn = redis.conn().await;
    // Another namespace's key must survive.
    let _: () = redis::cmd("SET")
        .arg("{other}:keep")
        .arg(1)
        .query_async(&mut conn)
        .await?;
    let mut w = WorkerProc::spawn(&cfg, "p1", &[]);
    push(&mut conn, "llm", &jobs("p", 30)).await;
    context(wait_len(&mut conn, "{llm}:results", 30, T).await, &[&w])?;

    // Piped into `head`: the first line, then a quiet exit (no "Broken pipe").
    let sh = format!(
        "{} --config {} results --count 30 | head -n 1",
        bin().display(),
        cfg.display()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(&sh)
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("Broken pipe"), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1);

    let refused = cli(&cfg, &["purge", "--yes"]).await;
    assert_eq!(refused.code, Some(1), "{}", refused.all());
    assert!(
        refused.stderr.contains("p1"),
        "names the live worker: {}",
        refused.all()
    );
    let no_tty = cli(&cfg, &["purge", "--force"]).await;
    assert_eq!(no_tty.code, Some(1), "{}", no_tty.all());
    assert!(no_tty.stderr.contains("--yes"), "{}", no_tty.all());
    stop_clean(&mut w, T).await;
    let purged = cli(&cfg, &["purge", "--yes"]).await;
    assert_eq!(purged.code, Some(0), "{}", purged.all());
    let left = llm_worker::connect::scan_match(&mut conn, "{llm}:*").await?;
    assert!(left.is_empty(), "{left:?}");
    let other: Option<String> = redis::cmd("GET")
        .arg("{other}:keep")
        .query_async(&mut conn)
        .await?;
    assert_eq!(other.as_deref(), Some("1"));
    let again = cli(&cfg, &["purge", "--yes"]).await;
    assert!(again.stdout.contains("nothing to purge"), "{}", again.all());
    Ok(())
}

/// `n` invalid dead letters (unknown route), written straight into `{llm}:dead` in the
/// shape the worker writes, with ids `<prefix>-<i>`.
async fn seed_letters(conn: &mut redis::aio::MultiplexedConnection, prefix: &str, n: usize) {
    let mut pipe = redis::pipe();
    for i in 0..n {
        let payload = serde_json::json!({"id": format!("{prefix}-{i}"), "route": "nope",
            "messages": [{"role": "user", "content": "hi"}]})
        .to_string();
        pipe.cmd("XADD")
            .arg("{llm}:dead")
            .arg("*")
            .arg("job_entry")
            .arg(format!("1-{i}"))
            .arg("job_id")
            .arg(format!("{prefix}-{i}"))
            .arg("reason")
            .arg("unknown route `nope` (not in [routes])")
            .arg("deliveries")
            .arg(1)
            .arg("payload")
            .arg(payload)
            .ignore();
    }
    let _: () = pipe.query_async(conn).await.unwrap();
}

/// `dead replay --all` replays the letters there were when it started, once each: not the
/// letters its own replays produce while it runs (a worker dead-letters them again), and
/// not a letter another replay running at the same time already took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_all_takes_each_letter_once_even_with_a_worker_and_a_second_replay()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "r.toml");
    let mut conn = redis.conn().await;

    // Two replays at once over 1,000 letters, no worker: 1,000 jobs, not more.
    seed_letters(&mut conn, "c", 1000).await;
    let (a, b) = tokio::join!(
        cli(&cfg, &["dead", "replay", "--all"]),
        cli(&cfg, &["dead", "replay", "--all"])
    );
    assert_eq!(
        (a.code, b.code),
        (Some(0), Some(0)),
        "{}\n{}",
        a.all(),
        b.all()
    );
    assert_eq!(
        xlen(&mut conn, "{llm}:jobs").await,
        1000,
        "{}\n{}",
        a.stdout.lines().last().unwrap_or(""),
        b.stdout.lines().last().unwrap_or("")
    );
    assert_eq!(xlen(&mut conn, "{llm}:dead").await, 0);
    let _: () = redis::cmd("DEL")
        .arg("{llm}:jobs")
        .query_async(&mut conn)
        .await?;

    // With a worker dead-lettering every replayed job again: 300 replayed, exactly.
    seed_letters(&mut conn, "w", 300).await;
    let mut w = WorkerProc::spawn(&cfg, "r1", &[]);
    let out = cli(&cfg, &["dead", "replay", "--all"]).await;
    assert!(
        out.stdout.contains("replayed 300 dead letters"),
        "{}",
        out.all()
    );
    context(wait_len(&mut conn, "{llm}:dead", 300, T).await, &[&w])?;
    stop_clean(&mut w, T).await;
    assert_eq!(xlen(&mut conn, "{llm}:dead").await, 300);

    // One id with two letters: `dead replay ID` pushes it once (its newest letter).
    let _: () = redis::cmd("DEL")
        .arg("{llm}:dead")
        .query_async(&mut conn)
        .await?;
    let _: () = redis::cmd("DEL")
        .arg("{llm}:jobs")
        .query_async(&mut conn)
        .await?;
    seed_letters(&mut conn, "twice", 1).await;
    seed_letters(&mut conn, "twice", 1).await;
    let out = cli(&cfg, &["dead", "replay", "twice-0"]).await;
    assert!(
        out.stdout.contains("replayed 1 dead letters"),
        "{}",
        out.all()
    );
    assert_eq!(xlen(&mut conn, "{llm}:jobs").await, 1);
    Ok(())
}

/// `--new-id` gives the replayed job a fresh id (`<id>.retry-<ms>`), so it runs even
/// though its old id meanwhile ended ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_with_a_new_id_runs_even_when_the_old_id_ended_ok() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "n.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "n1", &[]);
    push(&mut conn, "llm", &[job("same", "hi")]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w])?;
    // A dead letter of the same id (as if an older copy had been poisoned).
    let payload = job("same", "hi");
    let _: String = redis::cmd("XADD")
        .arg("{llm}:dead")
        .arg("*")
        .arg("job_entry")
        .arg("1-1")
        .arg("job_id")
        .arg("same")
        .arg("reason")
        .arg("delivered 6 times")
        .arg("deliveries")
        .arg(6)
        .arg("payload")
        .arg(&payload)
        .query_async(&mut conn)
        .await?;
    let out = cli(&cfg, &["dead", "replay", "same", "--new-id"]).await;
    assert!(
        out.stdout.contains("replayed 1 dead letters"),
        "{}",
        out.all()
    );
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    let results = entries(&mut conn, "{llm}:results").await;
    let fresh = results
        .iter()
        .find(|(_, r)| r["job_id"].starts_with("same.retry-"));
    let fresh = fresh.map(|(_, r)| r.clone()).unwrap_or_default();
    assert_eq!(
        fresh.get("status").map(String::as_str),
        Some("ok"),
        "{results:?}"
    );
    assert!(
        !fresh.contains_key("duplicate_of"),
        "ran, not a duplicate: {fresh:?}"
    );
    stop_clean(&mut w, T).await;
    Ok(())
}
