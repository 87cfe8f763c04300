//! Tenant caps (`pools.<p>.max_per_tenant`, issue 10): a capped tenant's backlog neither
//! exceeds its cap nor holds up another tenant's jobs; parked jobs are never lost and
//! come back when places free, also when the worker holding them is killed.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use redis::AsyncCommands;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

fn tenant_job(id: &str, tenant: &str, model: &str) -> String {
    serde_json::json!({
        "id": id,
        "tenant": tenant,
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
    })
    .to_string()
}

async fn commands_total(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| l.split("calls=").nth(1))
        .filter_map(|r| r.split(',').next()?.parse::<u64>().ok())
        .sum()
}

fn ok_ids_of(results: &[(String, HashMap<String, String>)], prefix: &str) -> Vec<String> {
    results
        .iter()
        .filter(|(_, f)| f.get("status").map(String::as_str) == Some("ok"))
        .filter_map(|(_, f)| f.get("job_id").filter(|id| id.starts_with(prefix)).cloned())
        .collect()
}

/// The measurement: tenant A's 10,000-job backlog in front of tenant B's 10
/// jobs, cap 4 of N=8, 200 ms model. Without parking, B's jobs wait behind A's backlog
/// (about 10,000 / 4 x 0.2 s = 500 s); with it, they run as soon as the reader has moved
/// past A's backlog. Prints how long B's 10 took and the Redis commands spent per A job
/// parked meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_tenants_backlog_does_not_hold_up_another_tenant() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 200,
        ..Default::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 8;
    tc.concurrency = 9;
    tc.pool_extra = "max_per_tenant = 4".into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let a_n = 10_000usize;
    let a: Vec<String> = (0..a_n)
        .map(|i| tenant_job(&format!("a-{i}"), "A", "m2"))
        .collect();
    for chunk in a.chunks(1000) {
        push(&mut conn, "llm", chunk).await;
    }
    let b: Vec<String> = (0..10)
        .map(|i| tenant_job(&format!("b-{i}"), "B", "m3"))
        .collect();
    push(&mut conn, "llm", &b).await;
    let before = commands_total(&mut conn).await;
    let started = Instant::now();
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    let results = key("llm", "results");
    // Polled every 50 ms, bounded: the time B's last result appeared.
    let mut b_done = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let r = entries(&mut conn, &results).await;
        if ok_ids_of(&r, "b-").len() == 10 {
            b_done = Some((started.elapsed(), ok_ids_of(&r, "a-").len()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let found = b_done.is_some();
    let after = commands_total(&mut conn).await;
    let parked: u64 = conn.xlen(key("llm", "parked:default:A")).await.unwrap();
    assert!(
        found,
        "tenant B's 10 jobs did not all finish within 120 s behind A's backlog\n{}",
        logs_tail(&[&w], 40)
    );
    let (took, a_ok) = b_done.unwrap();
    let stats = sim.sim.stats();
    let a_peak = stats
        .max_in_flight_per_model
        .get("m2")
        .copied()
        .unwrap_or(0);
    let b_peak = stats
        .max_in_flight_per_model
        .get("m3")
        .copied()
        .unwrap_or(0);
    let a_moved = (a_n as u64).saturating_sub(a_ok as u64);
    eprintln!(
        "tenant B's 10 jobs took {:.2} s behind A's {a_n}-job backlog (A finished {a_ok} meanwhile, \
         {parked} parked); Redis commands (incl. inside scripts) {} in all, {:.2} per A job moved \
         past; peak calls in flight: A {a_peak}, B {b_peak}",
        took.as_secs_f64(),
        after - before,
        (after - before) as f64 / a_moved.max(1) as f64,
    );
    // B ran while A's backlog stood in front of it: A finished only a small part of it.
    assert!(
        a_ok < 1000,
        "B finished only after A had finished {a_ok} jobs: A's backlog held it up"
    );
    assert!(a_peak <= 4, "tenant A held {a_peak} calls at once, cap 4");
    // `status` shows the tenant's places and its parked jobs.
    let st = llm_worker::tools::status(&tc.parsed())
        .await
        .expect("status");
    let t = st["tenants"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["tenant"] == "A"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(t["cap"], 4, "{st}");
    assert!(t["parked"].as_u64().is_some_and(|p| p > 0), "{st}");
    assert!(t["places_held"].as_u64().is_some_and(|p| p <= 4), "{st}");
    assert!(b_peak >= 1);
    stop_clean(&mut w, Duration::from_secs(20)).await;

    // Nothing lost: every A job has exactly one place (result, parked stream, or still
    // in the jobs stream), and no place of the stopped worker is left held.
    let r = entries(&mut conn, &results).await;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for id in ok_ids_of(&r, "a-") {
        *seen.entry(id).or_default() += 1;
    }
    for stream in ["parked:default:A", "jobs"] {
        for (_, f) in entries(&mut conn, &key("llm", stream)).await {
            if let Some(p) = f.get("payload")
                && let Ok(v) = serde_json::from_str::<serde_json::Value>(p)
                && let Some(id) = v["id"].as_str()
                && id.starts_with("a-")
            {
                *seen.entry(id.to_string()).or_default() += 1;
            }
        }
    }
    let missing: Vec<_> = (0..a_n)
        .map(|i| format!("a-{i}"))
        .filter(|id| !seen.contains_key(id))
        .take(5)
        .collect();
    assert!(missing.is_empty(), "A jobs lost: {missing:?}");
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).take(5).collect();
    assert!(twice.is_empty(), "A jobs in two places: {twice:?}");
    let holders: Vec<String> = conn
        .zrange(key("llm", "tenant:default:A"), 0, -1)
        .await
        .unwrap();
    let leases: Vec<_> = holders.iter().filter(|m| !m.starts_with("u:")).collect();
    assert!(
        leases.is_empty(),
        "places still held after a clean stop: {leases:?}"
    );
}

/// A worker killed while it holds a tenant's places: they expire (slots.ttl_ms) and the
/// sweep of another worker moves the parked jobs back, with no release event at all.
/// A parked job also keeps its delivery count: with `max_deliveries = 1`, a count raised
/// by parking would dead-letter it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_jobs_come_back_after_the_worker_holding_the_places_is_killed() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 30_000,
        model_latency_ms: HashMap::from([("m3".to_string(), 50)]),
        ..Default::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 8;
    tc.ttl_ms = 1000;
    tc.pool_extra = "max_per_tenant = 2".into();
    tc.queue_extra = "max_deliveries = 1".into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    // Two jobs that hang (m2: 30 s) take A's two places; three more are parked.
    let hang: Vec<String> = (0..2)
        .map(|i| tenant_job(&format!("hang-{i}"), "A", "m2"))
        .collect();
    push(&mut conn, "llm", &hang).await;
    let mut w1 = WorkerProc::spawn(&cfg, "w1", &[]);
    assert!(in_flight_at_least(&sim, 2, Duration::from_secs(20)).await);
    let quick: Vec<String> = (0..3)
        .map(|i| tenant_job(&format!("quick-{i}"), "A", "m3"))
        .collect();
    push(&mut conn, "llm", &quick).await;
    let parked = key("llm", "parked:default:A");
    let mut c = conn.clone();
    assert!(
        wait_for(Duration::from_secs(20), || {
            let mut c = c.clone();
            let parked = parked.clone();
            async move { xlen(&mut c, &parked).await == 3 }
        })
        .await,
        "three jobs were not parked\n{}",
        logs_tail(&[&w1], 30)
    );
    w1.signal("KILL");
    let _ = wait_exit(&mut w1, Duration::from_secs(5)).await;
    let mut w2 = WorkerProc::spawn(&cfg, "w2", &[]);
    let results = key("llm", "results");
    let done = wait_for(Duration::from_secs(30), || {
        let mut c = c.clone();
        let results = results.clone();
        async move { ok_ids_of(&entries(&mut c, &results).await, "quick-").len() == 3 }
    })
    .await;
    let r = entries(&mut c, &results).await;
    assert!(
        done,
        "parked jobs did not come back after the holder was killed: {r:?}\n{}",
        logs_tail(&[&w2], 30)
    );
    let ids: HashSet<_> = ok_ids_of(&r, "quick-").into_iter().collect();
    assert_eq!(ids.len(), 3);
    assert!(
        r.iter()
            .all(|(_, f)| f.get("status").map(String::as_str) != Some("dead")),
        "a parked job was dead-lettered (its delivery count grew): {r:?}"
    );
    stop_clean(&mut w2, Duration::from_secs(20)).await;
    let _ = c.del::<_, ()>(key("llm", "jobs")).await;
}
