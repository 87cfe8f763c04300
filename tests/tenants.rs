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

/// A config with N = 8 and `max_per_tenant = cap` in pool `default`, written to a temp dir.
fn capped(
    redis: &RedisServer,
    sim: &SimHandle,
    cap: u32,
    ttl_ms: u64,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let mut tc = TestConfig::new(redis, sim);
    tc.slots = 8;
    tc.ttl_ms = ttl_ms;
    tc.pool_extra = format!("max_per_tenant = {cap}");
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    (dir, cfg)
}

/// Waits (bounded) until `n` ok results of job ids starting with `prefix` exist.
async fn wait_ok(
    conn: &redis::aio::MultiplexedConnection,
    prefix: &str,
    n: usize,
    secs: u64,
) -> bool {
    let results = key("llm", "results");
    wait_for(Duration::from_secs(secs), || {
        let mut c = conn.clone();
        let r = results.clone();
        let prefix = prefix.to_string();
        async move { ok_ids_of(&entries(&mut c, &r).await, &prefix).len() == n }
    })
    .await
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
    let done = wait_ok(&c, "quick-", 3, 30).await;
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

fn peak(sim: &SimHandle, model: &str) -> u64 {
    sim.sim
        .stats()
        .max_in_flight_per_model
        .get(model)
        .copied()
        .unwrap_or(0)
}

async fn wait_parked(conn: &redis::aio::MultiplexedConnection, n: u64) -> bool {
    let parked = key("llm", "parked:default:A");
    wait_for(Duration::from_secs(20), || {
        let mut c = conn.clone();
        let parked = parked.clone();
        async move { xlen(&mut c, &parked).await == n }
    })
    .await
}

/// Review finding: the slot fast path (a job whose pool stays busy past
/// `slots.acquire_timeout_ms` takes a free slot of a later model's pool) moved a tenant's
/// job from an uncapped pool into a capped one where it held no place: two calls at once
/// under a cap of 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_fast_path_never_moves_a_tenant_job_into_a_capped_pool_without_a_place() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 8000,
        ..Default::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 8;
    tc.pool_extra = "max_per_tenant = 1".into();
    tc.extra = "[pools.free]\nslots = 1\n".into();
    let toml = tc.toml().replace(
        "[models.m1]\nprovider = \"p1\"",
        "[models.m1]\nprovider = \"p1\"\npool = \"free\"",
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("w.toml");
    std::fs::write(&cfg, toml).unwrap();
    let mut conn = redis.conn().await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    // h holds pool `free`'s only slot; a1 holds A's only place in `default`; a2 (A, m1 in
    // `free`) times out waiting for `free` and looks for a free slot elsewhere (m2, m3).
    push(&mut conn, "llm", &[tenant_job("h", "B", "m1")]).await;
    assert!(in_flight_at_least(&sim, 1, Duration::from_secs(20)).await);
    push(&mut conn, "llm", &[tenant_job("a1", "A", "m2")]).await;
    assert!(in_flight_at_least(&sim, 2, Duration::from_secs(20)).await);
    push(&mut conn, "llm", &[tenant_job("a2", "A", "m1")]).await;
    // a2 waits 1 s (slots.acquire_timeout_ms) for `free`, then takes the fast path.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let a_calls = peak(&sim, "m2") + peak(&sim, "m3");
    let all = sim.sim.stats().max_in_flight;
    w.signal("KILL");
    assert!(
        all <= 2 && a_calls <= 1,
        "tenant A ran a second call in pool default (cap 1): m2 peak {}, m3 peak {}, all {all}\n{}",
        peak(&sim, "m2"),
        peak(&sim, "m3"),
        logs_tail(&[&w], 20)
    );
}

/// Review finding: a Redis stall longer than `slots.ttl_ms` let the running job's place
/// lapse (the sweep after the stall dropped it before its holder renewed it) and a
/// parked job ran beside it. The holder clock now carries live places through a stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_stall_longer_than_the_ttl_keeps_the_tenant_cap() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 25_000,
        ..Default::default()
    })
    .await;
    let (_dir, cfg) = capped(&redis, &sim, 1, 6000);
    let mut conn = redis.conn().await;
    let pid = redis_pid(&mut conn).await;
    let a = WorkerProc::spawn(&cfg, "wa", &[]);
    let b = WorkerProc::spawn(&cfg, "wb", &[]);
    push(&mut conn, "llm", &[tenant_job("a1", "A", "m2")]).await;
    assert!(in_flight_at_least(&sim, 1, Duration::from_secs(20)).await);
    push(&mut conn, "llm", &[tenant_job("a2", "A", "m2")]).await;
    assert!(wait_parked(&conn, 1).await, "a2 was not parked");
    signal(pid, libc_sig::STOP);
    tokio::time::sleep(Duration::from_secs(8)).await;
    signal(pid, libc_sig::CONT);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let p = peak(&sim, "m2");
    let log = logs_tail(&[&a, &b], 20);
    a.signal("KILL");
    b.signal("KILL");
    assert!(
        p <= 1,
        "tenant A ran {p} calls at once after a Redis stall, cap 1\n{log}"
    );
}

/// Review finding: under maxmemory + noeviction the renewal script was refused (its first
/// write is a ZADD) while admission and release went on: a running job's place lapsed and
/// a parked job ran beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_keeps_the_tenant_cap() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 15_000,
        ..Default::default()
    })
    .await;
    let (_dir, cfg) = capped(&redis, &sim, 1, 1000);
    let mut conn = redis.conn().await;
    let a = WorkerProc::spawn(&cfg, "wa", &[]);
    push(&mut conn, "llm", &[tenant_job("a1", "A", "m2")]).await;
    assert!(in_flight_at_least(&sim, 1, Duration::from_secs(20)).await);
    push(&mut conn, "llm", &[tenant_job("a2", "A", "m2")]).await;
    assert!(wait_parked(&conn, 1).await, "a2 was not parked");
    set_maxmemory(&mut conn, 1).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    set_maxmemory(&mut conn, 0).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = peak(&sim, "m2");
    let log = logs_tail(&[&a], 20);
    a.signal("KILL");
    assert!(
        p <= 1,
        "tenant A ran {p} calls at once around a full Redis, cap 1\n{log}"
    );
}

/// Review finding: a pool whose cap is removed (or renamed away) while jobs are parked
/// left them parked for good: the sweep only looked at pools capped in its own config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_jobs_come_back_when_the_cap_is_removed() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 30_000,
        model_latency_ms: HashMap::from([("m3".to_string(), 50)]),
        ..Default::default()
    })
    .await;
    let (dir, cfg) = capped(&redis, &sim, 1, 1000);
    let uncapped = dir.path().join("w2.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&uncapped, text.replace("max_per_tenant = 1", "")).unwrap();
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[tenant_job("hang", "A", "m2")]).await;
    let mut w1 = WorkerProc::spawn(&cfg, "w1", &[]);
    assert!(in_flight_at_least(&sim, 1, Duration::from_secs(20)).await);
    push(&mut conn, "llm", &[tenant_job("quick", "A", "m3")]).await;
    assert!(wait_parked(&conn, 1).await, "quick was not parked");
    w1.signal("KILL");
    let _ = wait_exit(&mut w1, Duration::from_secs(5)).await;
    let w2 = WorkerProc::spawn(&uncapped, "w2", &[]);
    let done = wait_ok(&conn, "quick", 1, 20).await;
    let still = xlen(&mut conn, &key("llm", "parked:default:A")).await;
    let log = logs_tail(&[&w2], 20);
    w2.signal("KILL");
    assert!(
        done,
        "the parked job never came back after the cap was removed (still parked: {still})\n{log}"
    );
}

/// Review finding: a place kept for an entry moved back lapsed after 60 s whatever became
/// of the entry. Behind a backlog longer than that, the entry found its place gone and
/// was parked again, while the sweep moved the next one back: the tenant parked and
/// unparked without running. Now a kept place lasts while its entry is in the stream.
/// (`LLM_WORKER_DEBUG_TENANT_TRANSIT_MS` = 500 stands for the 60 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_place_outlasts_a_backlog_in_front_of_its_entry() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 1500,
        ..Default::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 2;
    tc.concurrency = 2;
    tc.pool_extra = "max_per_tenant = 1".into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let env = [("LLM_WORKER_DEBUG_TENANT_TRANSIT_MS", "500")];
    let mut w = WorkerProc::spawn(&cfg, "w1", &env);
    push(&mut conn, "llm", &[tenant_job("a-0", "A", "m2")]).await;
    assert!(in_flight_at_least(&sim, 1, Duration::from_secs(20)).await);
    let more: Vec<String> = (1..3)
        .map(|i| tenant_job(&format!("a-{i}"), "A", "m2"))
        .collect();
    push(&mut conn, "llm", &more).await;
    assert!(wait_parked(&conn, 2).await, "a-1 and a-2 were not parked");
    // A backlog of jobs without a tenant (uncapped; about 6 s at 2 slots) in front of
    // whatever is moved back next.
    let b: Vec<String> = (0..8).map(|i| job(&format!("b-{i}"), "hi")).collect();
    push(&mut conn, "llm", &b).await;
    let done = wait_ok(&conn, "a-", 3, 40).await;
    let log = w.log();
    let parks = log.matches("job parked until a place frees").count();
    stop_clean(&mut w, Duration::from_secs(20)).await;
    assert!(
        done,
        "tenant A's three jobs did not finish\n{}",
        logs_tail(&[&w], 20)
    );
    assert!(
        parks <= 2,
        "A's jobs were parked {parks} times for 2 parked jobs: moved back only to be parked again"
    );
}

/// Review finding: a place kept for an entry moved back stayed taken when the job ended
/// without asking for it (here a duplicate of an id answered meanwhile), so the tenant
/// could not run anything until it lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_place_is_given_back_when_its_job_ends_without_it() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 3000,
        model_latency_ms: HashMap::from([("m3".to_string(), 50)]),
        ..Default::default()
    })
    .await;
    let (_dir, cfg) = capped(&redis, &sim, 1, 3000);
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push(&mut conn, "llm", &[tenant_job("a1", "A", "m2")]).await;
    assert!(in_flight_at_least(&sim, 1, Duration::from_secs(20)).await);
    push(&mut conn, "llm", &[tenant_job("dup", "A", "m3")]).await;
    assert!(wait_parked(&conn, 1).await, "dup was not parked");
    // The same id from another tenant runs at once and answers the id.
    push(&mut conn, "llm", &[tenant_job("dup", "B", "m3")]).await;
    let results = key("llm", "results");
    let c = conn.clone();
    let answered = wait_ok(&c, "dup", 1, 20).await;
    assert!(answered);
    // a1 ends: the parked copy of dup is moved back with a kept place, read, and answered
    // as a duplicate without asking for the place. Then a3 must run at once.
    assert!(wait_ok(&c, "a1", 1, 20).await);
    let dup_copies = wait_for(Duration::from_secs(10), || {
        let mut c = c.clone();
        let r = results.clone();
        async move {
            entries(&mut c, &r)
                .await
                .iter()
                .filter(|(_, f)| f.get("job_id").map(String::as_str) == Some("dup"))
                .count()
                == 2
        }
    })
    .await;
    assert!(dup_copies, "the parked copy of dup was not answered");
    push(&mut conn, "llm", &[tenant_job("a3", "A", "m3")]).await;
    let ran = wait_ok(&c, "a3", 1, 8).await;
    let holders: Vec<String> = conn
        .zrange(key("llm", "tenant:default:A"), 0, -1)
        .await
        .unwrap();
    stop_clean(&mut w, Duration::from_secs(20)).await;
    assert!(
        ran,
        "a3 did not run within 8 s: A's only place is still kept ({holders:?})"
    );
}

/// Review finding: a parked-stream index of the wrong type failed the park after the
/// entry had been moved (no rollback in Redis): the entry sat in a parked stream nobody
/// indexed, and the job got no result. Every key is now checked before the first write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_key_of_the_wrong_type_fails_the_job_before_anything_moves() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 3000,
        ..Default::default()
    })
    .await;
    let (_dir, cfg) = capped(&redis, &sim, 1, 3000);
    let mut conn = redis.conn().await;
    let _: () = conn.set(key("llm", "parked"), "not a hash").await.unwrap();
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push(&mut conn, "llm", &[tenant_job("a1", "A", "m2")]).await;
    let results = key("llm", "results");
    let waited = wait_len(&mut conn, &results, 1, Duration::from_secs(20)).await;
    let r = entries(&mut conn, &results).await;
    let parked = xlen(&mut conn, &key("llm", "parked:default:A")).await;
    stop_clean(&mut w, Duration::from_secs(20)).await;
    assert!(waited.is_ok(), "no result: {r:?}");
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0].1["status"], "failed", "{r:?}");
    assert!(r[0].1["error"].contains("{llm}:parked"), "{r:?}");
    assert_eq!(parked, 0, "the entry moved although the job failed");
}
