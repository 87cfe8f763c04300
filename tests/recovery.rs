//! Nothing lost, nothing paid twice: crash recovery, dead letters, Redis outages and bad
//! input, on the real binary, a real redis-server and the simulated provider over HTTP.
//!
//! Every wait is bounded; waits for a worker's exit are async and blocking process control
//! (redis-server stop and restart) runs in `block_in_place`, so the in-process sim keeps
//! answering meanwhile.

mod common;

use common::*;
use llm_worker::sim::{Fault, Rule, SimOptions};
use rust_decimal::Decimal;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::str::FromStr;
use std::time::Duration;
use tokio::time::Instant;

type Entries = Vec<(String, HashMap<String, String>)>;

/// SIGKILL and reap (bounded); panics if the process does not die.
async fn kill9(w: &mut WorkerProc) {
    w.signal(libc_sig::KILL);
    assert!(
        wait_exit(w, Duration::from_secs(5)).await.is_some(),
        "worker did not die on SIGKILL"
    );
}

fn running(w: &mut WorkerProc) -> bool {
    matches!(w.child.try_wait(), Ok(None))
}

fn sim_calls(sim: &SimHandle, job_id: &str) -> u64 {
    sim.sim
        .stats()
        .calls_per_job
        .get(job_id)
        .copied()
        .unwrap_or(0)
}

/// Results grouped by `job_id`.
fn by_job(results: &Entries) -> BTreeMap<String, Vec<&HashMap<String, String>>> {
    let mut m: BTreeMap<String, Vec<&HashMap<String, String>>> = BTreeMap::new();
    for (_, r) in results {
        m.entry(r.get("job_id").cloned().unwrap_or_default())
            .or_default()
            .push(r);
    }
    m
}

/// Entry ids pending in the group, optionally only those of one consumer. Panics when
/// Redis does not answer (an outage must not read as "nothing pending").
async fn pending_entries(
    conn: &mut redis::aio::MultiplexedConnection,
    consumer: Option<&str>,
) -> Vec<String> {
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg("{llm}:jobs")
        .arg("workers")
        .arg("-")
        .arg("+")
        .arg(100_000);
    if let Some(c) = consumer {
        cmd.arg(c);
    }
    let r: Result<Vec<(String, String, u64, u64)>, _> = cmd.query_async(conn).await;
    r.map(|v| v.into_iter().map(|(id, ..)| id).collect())
        .unwrap_or_else(|e| panic!("XPENDING {{llm}}:jobs: Redis did not answer ({e})"))
}

// ---------------------------------------------------------------------------------------
// Chaos: 4 workers, 1,000 jobs, a SIGKILL every 2 s, one Redis restart.

const CHAOS_JOBS: usize = 1000;
const CHAOS_WORKERS: usize = 4;
const CHAOS_CONCURRENCY: usize = 4;
/// N of pool `default` in the chaos run.
const CHAOS_SLOTS: u32 = 8;

/// USD for tokens of model m1, priced by hand from the test config (0.14 USD/Mtok input,
/// 0.028 cached input, 0.42 output): in units of 1e-9 USD, 140 / 28 / 420 per token. Not the
/// crate's `cost::cost`, so a pricing bug there cannot cancel out.
fn chaos_usd(uncached_in: u64, cached_in: u64, out: u64) -> Decimal {
    let nano = 140 * uncached_in + 28 * cached_in + 420 * out;
    Decimal::new(i64::try_from(nano).expect("fits"), 9)
}

/// The price of one call for a job payload, from the sim's published token rules
/// (prompt: 4 + ceil(chars / 4) per message; completion: its deterministic hash).
fn chaos_call_usd(payload: &str) -> Decimal {
    let body: serde_json::Value = serde_json::from_str(payload).expect("job json");
    chaos_usd(
        llm_worker::sim::estimate_prompt_tokens(&body),
        0,
        llm_worker::sim::completion_tokens_for(&body),
    )
}

/// The last 30 lines of a worker's log, for assertion messages.
fn tail_of(w: &WorkerProc) -> String {
    logs_tail(&[w], 30)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kills_and_a_redis_restart_lose_nothing() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut redis = RedisServer::start_opts(true);
    let sim = SimHandle::start(SimOptions {
        latency_ms: 50,
        jitter_ms: 250,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = CHAOS_SLOTS;
    tc.ttl_ms = 2000;
    tc.concurrency = CHAOS_CONCURRENCY;
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "chaos.toml");
    let env = [
        ("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "1500"),
        ("LLM_WORKER__QUEUE__MAX_DELIVERIES", "10"),
    ];
    let mut conn = redis.conn().await;
    let ids: Vec<String> = (0..CHAOS_JOBS).map(|i| format!("chaos-{i}")).collect();
    let payloads: Vec<String> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| job(id, &format!("chaos question {i} {}", "y".repeat(i % 13))))
        .collect();
    let entry_ids = push(&mut conn, "llm", &payloads).await;
    let job_of: HashMap<String, String> = entry_ids.into_iter().zip(ids.clone()).collect();

    let mut next = 0usize;
    let spawn = |next: &mut usize| {
        let name = format!("chaos-w{next}");
        *next += 1;
        let w = WorkerProc::spawn(&cfg, &name, &env);
        (name, w)
    };
    let mut workers: Vec<(String, WorkerProc)> =
        (0..CHAOS_WORKERS).map(|_| spawn(&mut next)).collect();
    let mut dead_workers: Vec<WorkerProc> = vec![];
    // Job ids a kill or the Redis restart may legitimately make us pay twice for: those
    // pending under the victim when it died (frozen with SIGSTOP first, so the snapshot is
    // exact), and everything pending when Redis went away.
    let mut at_risk: BTreeSet<String> = BTreeSet::new();
    let mut kills = 0usize;
    let mut redis_down_for = None;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last_kill = Instant::now();
    loop {
        if xlen(&mut conn, "{llm}:results").await >= CHAOS_JOBS as u64 || Instant::now() >= deadline
        {
            break;
        }
        if last_kill.elapsed() >= Duration::from_secs(2) {
            last_kill = Instant::now();
            let i = rand::random_range(0..workers.len());
            let (name, mut w) = workers.swap_remove(i);
            w.signal(libc_sig::STOP);
            for e in pending_entries(&mut conn, Some(&name)).await {
                at_risk.extend(job_of.get(&e).cloned());
            }
            kill9(&mut w).await;
            kills += 1;
            dead_workers.push(w);
            workers.push(spawn(&mut next));
            if kills == 3 && redis_down_for.is_none() {
                // Once, mid-run: SIGTERM redis-server (AOF flushed), keep it away for 1 s,
                // start it again on the same port; queue, pending entries and results survive.
                let before = xlen(&mut conn, "{llm}:results").await;
                for e in pending_entries(&mut conn, None).await {
                    at_risk.extend(job_of.get(&e).cloned());
                }
                let t = Instant::now();
                tokio::task::block_in_place(|| redis.stop());
                tokio::time::sleep(Duration::from_secs(1)).await;
                tokio::task::block_in_place(|| redis.restart());
                redis_down_for = Some(t.elapsed());
                conn = redis.conn().await;
                // Until the AOF is loaded Redis answers LOADING: wait for a real answer.
                let mut after = None;
                let mut last_err = None;
                let until = Instant::now() + Duration::from_secs(10);
                while after.is_none() && Instant::now() < until {
                    let r: redis::RedisResult<u64> = redis::cmd("XLEN")
                        .arg("{llm}:results")
                        .query_async(&mut conn)
                        .await;
                    match r {
                        Ok(n) => after = Some(n),
                        Err(e) => {
                            last_err = Some(e.to_string());
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                let after = after.unwrap_or_else(|| panic!("Redis did not answer: {last_err:?}"));
                println!("chaos: Redis restarted: {before} results before, {after} after");
                assert!(
                    after >= before,
                    "results survived the restart ({before} before, {after} after)"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let run_time = started.elapsed();
    // Stop the survivors cleanly: after their exit nothing more can arrive, so a second
    // result or a late call would show up below.
    for (_, w) in workers.iter_mut() {
        w.signal(libc_sig::TERM);
    }
    for (name, w) in workers.iter_mut() {
        let status = wait_exit(w, Duration::from_secs(20)).await;
        assert!(
            status.is_some_and(|s| s.success()),
            "{name} did not exit 0 after SIGTERM: {status:?}\n{}",
            tail_of(w)
        );
    }

    let results = entries(&mut conn, "{llm}:results").await;
    let dead = entries(&mut conn, "{llm}:dead").await;
    let grouped = by_job(&results);
    let dead_grouped = by_job(&dead);
    let stats = sim.sim.stats();
    let mut lost = vec![];
    let mut doubled = vec![];
    let mut bad_status = vec![];
    let mut wrong_cost = vec![];
    let mut attempts_sum = 0u64;
    // Calls the provider saw beyond the ones results account for, per job.
    let mut unrecorded: BTreeMap<String, u64> = BTreeMap::new();
    let mut results_usd = Decimal::ZERO;
    let mut unrecorded_usd = Decimal::ZERO;
    for (id, payload) in ids.iter().zip(&payloads) {
        let per_call = chaos_call_usd(payload);
        let calls = stats.calls_per_job.get(id).copied().unwrap_or(0);
        match grouped.get(id).map(Vec::as_slice) {
            None | Some([]) => lost.push(id.clone()),
            Some([r]) => {
                let attempts: u64 = r["attempts"].parse()?;
                attempts_sum += attempts;
                let cost = Decimal::from_str(&r["cost_usd"])?;
                results_usd += cost;
                match r["status"].as_str() {
                    "ok" if attempts >= 1 => {}
                    "dead" if dead_grouped.get(id).map(Vec::len) == Some(1) => {}
                    _ => bad_status.push((*r).clone()),
                }
                // Every attempt of a job is the same request, so its price is known.
                if cost != per_call * Decimal::from(attempts) {
                    wrong_cost.push((id.clone(), attempts, cost, per_call));
                }
                assert!(
                    calls >= attempts,
                    "{id}: the result counts {attempts} attempts, the provider saw {calls} calls"
                );
                if calls > attempts {
                    unrecorded.insert(id.clone(), calls - attempts);
                    unrecorded_usd += per_call * Decimal::from(calls - attempts);
                }
            }
            Some(_) => doubled.push(id.clone()),
        }
    }
    let calls_total: u64 = stats.calls_per_job.values().sum();
    let billed = stats.billed.get("m1").cloned().unwrap_or_default();
    let billed_usd = chaos_usd(
        billed.prompt_tokens - billed.cached_tokens,
        billed.cached_tokens,
        billed.completion_tokens,
    );
    let dead_count = grouped
        .values()
        .filter(|v| v.iter().any(|r| r["status"] == "dead"))
        .count();
    let pending = pending_count(&mut conn, "{llm}:jobs", "workers").await;
    // Killed workers' leases end by their TTL (2 s); clean exits released their own.
    let slots_free = wait_for(Duration::from_secs(10), || {
        let mut c = conn.clone();
        async move { slot_keys(&mut c, "llm").await.is_empty() }
    })
    .await;
    let extra_calls: u64 = unrecorded.values().sum();
    // A killed worker can have paid for at most `concurrency` calls it never committed; the
    // one Redis restart can at worst make every worker's in-flight jobs look stalled once.
    let bound = kills * CHAOS_CONCURRENCY + CHAOS_WORKERS * CHAOS_CONCURRENCY;
    println!(
        "chaos: jobs {CHAOS_JOBS}, kills {kills}, redis restarts 1 (down {:?}), results {}, \
         dead letters {} ({dead_count} dead results), paid but unrecorded: {} jobs / \
         {extra_calls} calls (bound {bound}; {} jobs were at risk), provider calls \
         {calls_total} = attempts in results {attempts_sum} + {extra_calls}, most in flight \
         {} (N = {CHAOS_SLOTS}), billed answers {} ({} calls cut off unbilled), billed \
         {billed_usd} USD (results {results_usd}, unrecorded calls at most {unrecorded_usd}), \
         lost {}, doubled {}, run {:.1?}",
        redis_down_for.unwrap_or_default(),
        results.len(),
        dead.len(),
        unrecorded.len(),
        at_risk.len(),
        stats.max_in_flight,
        billed.responses,
        calls_total.saturating_sub(billed.responses),
        lost.len(),
        doubled.len(),
        run_time,
    );
    let live: Vec<&WorkerProc> = workers.iter().map(|(_, w)| w).collect();
    assert!(
        redis_down_for.is_some(),
        "the run ended before the Redis restart (kills {kills})"
    );
    assert!(
        lost.is_empty(),
        "lost {} jobs, e.g. {:?}\n{}",
        lost.len(),
        &lost[..lost.len().min(10)],
        logs_tail(&live, 30)
    );
    assert!(doubled.is_empty(), "jobs with two results: {doubled:?}");
    assert!(bad_status.is_empty(), "unexpected results: {bad_status:?}");
    assert_eq!(results.len(), CHAOS_JOBS, "one result per job");
    assert_eq!(pending, 0, "nothing left pending");
    assert!(
        slots_free,
        "slot keys left: {:?}",
        slot_keys(&mut conn, "llm").await
    );
    assert!(
        stats.max_in_flight <= CHAOS_SLOTS as u64,
        "the provider saw {} calls at once, more than N = {CHAOS_SLOTS}",
        stats.max_in_flight
    );
    assert!(
        wrong_cost.is_empty(),
        "results whose cost is not attempts x the job's price (id, attempts, cost, per call): \
         {:?}",
        &wrong_cost[..wrong_cost.len().min(10)]
    );
    let unexplained: Vec<(&String, &u64)> = unrecorded
        .iter()
        .filter(|(id, _)| !at_risk.contains(*id))
        .collect();
    assert!(
        unexplained.is_empty(),
        "calls no result accounts for and no kill or restart explains: {unexplained:?}"
    );
    assert_eq!(
        attempts_sum + extra_calls,
        calls_total,
        "provider calls = attempts in results + calls of killed workers"
    );
    assert!(
        unrecorded.len() <= bound,
        "{} jobs paid without a result, more than {kills} kills x {CHAOS_CONCURRENCY} + one \
         restart explain: {unrecorded:?}",
        unrecorded.len()
    );
    // Money: every result is billed, and what the provider billed beyond the results is
    // paid-but-unrecorded calls of killed workers (a call cut off by SIGKILL before its
    // answer is not billed, so this is a bound, not an equality).
    assert!(
        billed.responses >= attempts_sum,
        "{attempts_sum} attempts in results but only {} billed answers",
        billed.responses
    );
    assert!(
        results_usd <= billed_usd && billed_usd <= results_usd + unrecorded_usd,
        "billed {billed_usd} USD is not within results {results_usd} .. results + unrecorded \
         calls {}",
        results_usd + unrecorded_usd
    );
    assert!(kills >= 5, "the run saw only {kills} kills");
    drop(dead_workers);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Redis away for 10 s while calls are in flight.

async fn ready_status(client: &reqwest::Client, port: u16) -> Option<u16> {
    client
        .get(format!("http://127.0.0.1:{port}/ready"))
        .send()
        .await
        .ok()
        .map(|r| r.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_10s_workers_survive_and_finish_every_job() -> anyhow::Result<()> {
    const JOBS: usize = 12;
    let started = Instant::now();
    let mut redis = RedisServer::start_opts(true);
    let sim = SimHandle::start(SimOptions {
        latency_ms: 1000,
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "down.toml");
    let ports = [free_port(), free_port()];
    let listens: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let mut workers: Vec<WorkerProc> = (0..2)
        .map(|i| {
            WorkerProc::spawn(
                &cfg,
                &format!("down-w{i}"),
                &[("LLM_WORKER__SERVER__LISTEN", listens[i].as_str())],
            )
        })
        .collect();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()?;
    for &p in &ports {
        assert!(
            wait_for(Duration::from_secs(15), || async {
                ready_status(&client, p).await == Some(200)
            })
            .await,
            "/ready on {p} never 200 before the outage\n{}",
            logs_tail(&workers.iter().collect::<Vec<_>>(), 30)
        );
    }
    let mut conn = redis.conn().await;
    let ids: Vec<String> = (0..JOBS).map(|i| format!("down-{i}")).collect();
    let payloads: Vec<String> = ids.iter().map(|id| job(id, id)).collect();
    push(&mut conn, "llm", &payloads).await;
    assert!(
        in_flight_at_least(&sim, 2, Duration::from_secs(10)).await,
        "no calls in flight"
    );

    tokio::task::block_in_place(|| redis.stop());
    let down_at = Instant::now();
    let mut saw_503 = [false, false];
    while down_at.elapsed() < Duration::from_secs(10) {
        for (i, &p) in ports.iter().enumerate() {
            match ready_status(&client, p).await {
                Some(503) => saw_503[i] = true,
                Some(200) if down_at.elapsed() > Duration::from_secs(3) => {
                    panic!(
                        "/ready on {p} says 200 {:?} into the outage",
                        down_at.elapsed()
                    )
                }
                _ => {}
            }
        }
        for w in workers.iter_mut() {
            assert!(
                running(w),
                "a worker exited while Redis was down\n{}",
                w.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let in_flight_at_return = sim.sim.stats().in_flight;
    tokio::task::block_in_place(|| redis.restart());
    assert_eq!(saw_503, [true, true], "/ready was 503 while Redis was down");

    let mut conn = redis.conn().await;
    let waited = wait_len(
        &mut conn,
        "{llm}:results",
        JOBS as u64,
        Duration::from_secs(60),
    )
    .await;
    context(waited, &workers.iter().collect::<Vec<_>>())?;
    for &p in &ports {
        assert!(
            wait_for(Duration::from_secs(15), || async {
                ready_status(&client, p).await == Some(200)
            })
            .await,
            "/ready on {p} not 200 after Redis returned"
        );
    }
    for w in workers.iter_mut() {
        assert!(running(w), "a worker exited\n{}", w.log());
    }
    let results = entries(&mut conn, "{llm}:results").await;
    let grouped = by_job(&results);
    assert_eq!(results.len(), JOBS, "{results:?}");
    let stats = sim.sim.stats();
    for id in &ids {
        let rs = &grouped[id];
        assert_eq!(rs.len(), 1, "{id}: {rs:?}");
        assert_eq!(rs[0]["status"], "ok", "{rs:?}");
        // Results finished during the outage were held in memory and written afterwards:
        // nobody called the model a second time.
        assert_eq!(stats.calls_per_job.get(id), Some(&1), "{id}: {stats:?}");
    }
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    // One line per state change, not one per retry.
    for w in &workers {
        let log = w.log();
        let warn_lines = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .count();
        println!(
            "redis_down_10s: {}: {} log lines, {warn_lines} WARN/ERROR",
            w.log_path.display(),
            log.lines().count()
        );
        let n = log.matches("Redis unreachable").count();
        assert!(
            (1..=3).contains(&n),
            "{n} 'Redis unreachable' lines\n{}",
            w.log()
        );
    }
    println!(
        "redis_down_10s: {JOBS} jobs ok, {in_flight_at_return} calls still in flight when \
         Redis returned, run {:.1?}",
        started.elapsed()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Poison: a job whose call hangs, its worker SIGKILLed every time.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_job_lands_in_dead_after_max_deliveries() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        rules: vec![always("m3", Fault::Hang)],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "poison.toml");
    let env = [
        ("LLM_WORKER__QUEUE__MAX_DELIVERIES", "2"),
        ("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "500"),
    ];
    let mut conn = redis.conn().await;
    let payload = serde_json::json!({
        "id": "poison-1",
        "model": "m3",
        "messages": [{"role": "user", "content": "this call never ends"}],
    })
    .to_string();
    let entry = push(&mut conn, "llm", std::slice::from_ref(&payload)).await;

    let mut killed = vec![];
    for delivery in 1..=2u64 {
        let mut w = WorkerProc::spawn(&cfg, &format!("poison-w{delivery}"), &env);
        assert!(
            wait_for(Duration::from_secs(15), || async {
                sim_calls(&sim, "poison-1") >= delivery
            })
            .await,
            "delivery {delivery}: no call started\n{}",
            w.log()
        );
        kill9(&mut w).await;
        killed.push(w);
    }
    let mut last = WorkerProc::spawn(&cfg, "poison-w3", &env);
    let waited = wait_len(&mut conn, "{llm}:dead", 1, Duration::from_secs(15)).await;
    context(waited, &[&last])?;

    let dead = entries_raw(&mut conn, "{llm}:dead").await;
    assert_eq!(dead.len(), 1);
    let d = &dead[0].1;
    let s =
        |k: &str| String::from_utf8_lossy(d.get(k).map(Vec::as_slice).unwrap_or(b"")).into_owned();
    assert_eq!(s("job_entry"), entry[0]);
    assert_eq!(s("job_id"), "poison-1");
    assert_eq!(s("deliveries"), "3");
    assert!(s("reason").contains("max_deliveries"), "{}", s("reason"));
    assert_eq!(d["payload"], payload.as_bytes(), "payload kept verbatim");
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 1, "{results:?}");
    let r = &results[0].1;
    assert_eq!(r["status"], "dead", "{r:?}");
    assert_eq!(r["job_id"], "poison-1");
    assert_eq!(r["job_entry"], entry[0]);
    assert!(r["error"].contains("max_deliveries"), "{r:?}");
    assert_eq!(r["cost_usd"], "0");
    assert_eq!(r["worker"], "poison-w3");
    // The last worker did not call the model again.
    assert_eq!(sim_calls(&sim, "poison-1"), 2);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);

    // The worker goes on: an ordinary job afterwards is processed.
    push(&mut conn, "llm", &[job("after-poison", "hello")]).await;
    let waited = wait_len(&mut conn, "{llm}:results", 2, Duration::from_secs(15)).await;
    context(waited, &[&last])?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results[1].1["status"], "ok", "{results:?}");
    assert!(running(&mut last));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Duplicate ids: one model call, five acknowledged entries.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_ids_make_one_model_call_and_five_results() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 1000, // long enough that the last copies surely arrive while it runs
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "dup.toml");
    let mut w1 = WorkerProc::spawn(&cfg, "dup-w1", &[]);
    let mut w2 = WorkerProc::spawn(&cfg, "dup-w2", &[]);
    let mut conn = redis.conn().await;
    // Both workers in their read loop (blocked in XREADGROUP), so the copies spread over
    // both.
    assert!(
        wait_readers(&conn, 2, Duration::from_secs(15)).await,
        "both workers reading\n{}",
        logs_tail(&[&w1, &w2], 30)
    );
    let p = job("same-id", "say it once");
    // Three copies in one pipeline (concurrent), then two more while the call runs.
    let mut entry_ids = push(&mut conn, "llm", &[p.clone(), p.clone(), p.clone()]).await;
    assert!(
        in_flight_at_least(&sim, 1, Duration::from_secs(10)).await,
        "the call did not start"
    );
    entry_ids.extend(push(&mut conn, "llm", std::slice::from_ref(&p)).await);
    entry_ids.extend(push(&mut conn, "llm", std::slice::from_ref(&p)).await);
    assert_eq!(
        sim.sim.stats().in_flight,
        1,
        "the last copies were pushed while the call ran"
    );
    let waited = wait_len(&mut conn, "{llm}:results", 5, Duration::from_secs(20)).await;
    context(waited, &[&w1, &w2])?;
    // After both exit cleanly nothing more can arrive: a sixth result or a second call
    // would show below.
    stop_clean(&mut w1, Duration::from_secs(15)).await;
    stop_clean(&mut w2, Duration::from_secs(15)).await;

    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 5, "{results:?}");
    assert_eq!(sim_calls(&sim, "same-id"), 1, "one model call");
    let mut entries_seen: Vec<String> = results
        .iter()
        .map(|(_, r)| r["job_entry"].clone())
        .collect();
    entries_seen.sort();
    entry_ids.sort();
    assert_eq!(entries_seen, entry_ids, "one result per pushed entry");
    let (originals, dups): (Vec<_>, Vec<_>) = results
        .iter()
        .partition(|(_, r)| !r.contains_key("duplicate_of"));
    assert_eq!(originals.len(), 1, "{results:?}");
    assert_eq!(dups.len(), 4, "{results:?}");
    let (orig_id, orig) = originals[0];
    assert_eq!(orig["status"], "ok");
    assert!(
        Decimal::from_str(&orig["cost_usd"])? > Decimal::ZERO,
        "{orig:?}"
    );
    assert_eq!(orig["attempts"], "1");
    for (_, r) in &dups {
        assert_eq!(&r["duplicate_of"], orig_id, "{r:?}");
        assert_eq!(r["cost_usd"], "0", "{r:?}");
        assert_eq!(r["attempts"], "0", "{r:?}");
        assert_eq!(r["status"], "ok", "{r:?}");
        assert_eq!(r["job_id"], "same-id");
        assert_eq!(
            r["content"], orig["content"],
            "duplicates repeat the answer"
        );
    }
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    assert_eq!(
        xlen(&mut conn, "{llm}:jobs").await,
        0,
        "every copy acknowledged"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// A call longer than claim_idle_ms is not taken over by the idle worker.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_call_is_not_stolen_by_an_idle_worker() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 3000,
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "long.toml");
    let env = [("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "1000")];
    let mut w1 = WorkerProc::spawn(&cfg, "long-w1", &env);
    let mut w2 = WorkerProc::spawn(&cfg, "long-w2", &env);
    let mut conn = redis.conn().await;
    let entry = push(&mut conn, "llm", &[job("long-1", "take your time")]).await;
    let waited = wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await;
    context(waited, &[&w1, &w2])?;
    // A takeover would have started a second call while the first ran (claim_idle 1 s,
    // call 3 s); a clean stop lets any such call finish, so it is counted below.
    stop_clean(&mut w1, Duration::from_secs(15)).await;
    stop_clean(&mut w2, Duration::from_secs(15)).await;
    assert_eq!(sim.sim.stats().in_flight, 0);
    assert_eq!(sim_calls(&sim, "long-1"), 1, "one model call, not two");
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 1, "{results:?}");
    let r = &results[0].1;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["job_entry"], entry[0]);
    assert_eq!(r["attempts"], "1");
    let latency: u64 = r["latency_ms"].parse()?;
    assert!(
        latency >= 3000,
        "the call really outlived claim_idle_ms: {latency} ms"
    );
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Bad input from the provider and from producers.

async fn next_result(
    conn: &mut redis::aio::MultiplexedConnection,
    n: u64,
    w: &WorkerProc,
) -> HashMap<String, String> {
    let waited = wait_len(conn, "{llm}:results", n, Duration::from_secs(20)).await;
    if let Err(e) = context(waited, &[w]) {
        panic!("{e:#}");
    }
    let all = entries(conn, "{llm}:results").await;
    assert_eq!(all.len() as u64, n, "{all:?}");
    all[n as usize - 1].1.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_garbage_truncated_and_no_usage_answers() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "bad.toml");
    let w = WorkerProc::spawn(&cfg, "bad-w1", &[]);
    let mut conn = redis.conn().await;

    // 1. Garbage once on m1: retried on m1.
    sim.sim.set_options(SimOptions {
        rules: vec![Rule {
            first_n: Some(1),
            ..always("m1", Fault::Garbage)
        }],
        ..SimOptions::default()
    });
    push(&mut conn, "llm", &[job("garbage-once", "a")]).await;
    let r = next_result(&mut conn, 1, &w).await;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m1", "{r:?}");
    assert_eq!(r["attempts"], "2", "{r:?}");
    assert_eq!(sim_calls(&sim, "garbage-once"), 2);

    // 2. Garbage always on m1, truncated bodies always on m2: falls back to m3.
    sim.sim.set_options(SimOptions {
        rules: vec![always("m1", Fault::Garbage), always("m2", Fault::Truncated)],
        ..SimOptions::default()
    });
    push(&mut conn, "llm", &[job("garbage-truncated", "b")]).await;
    let r = next_result(&mut conn, 2, &w).await;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m3", "{r:?}");
    assert_eq!(r["tried"], "m1,m2,m3", "{r:?}");
    assert_eq!(r["attempts"], "7", "3 on m1, 3 on m2, 1 on m3: {r:?}");
    assert_eq!(sim_calls(&sim, "garbage-truncated"), 7);

    // 3. Garbage from every model: failed, with a reason saying so.
    sim.sim.set_options(SimOptions {
        rules: vec![always("*", Fault::Garbage)],
        ..SimOptions::default()
    });
    push(&mut conn, "llm", &[job("all-garbage", "c")]).await;
    let r = next_result(&mut conn, 3, &w).await;
    assert_eq!(r["status"], "failed", "{r:?}");
    assert!(r["error"].contains("not JSON"), "{r:?}");
    // CONTRACT.md: reasons of failed results start with a class word.
    assert!(r["error"].starts_with("provider: m"), "{r:?}");
    assert!(!r["error"].contains('\n'), "one-line reason: {r:?}");
    assert_eq!(r["tried"], "m1,m2,m3", "{r:?}");
    assert_eq!(r["cost_usd"], "0", "{r:?}");
    assert!(!r.contains_key("content"), "{r:?}");
    // Each was a 200: the provider may have billed it, so its cost is unknown, not 0.
    let warning = r.get("warning").cloned().unwrap_or_default();
    assert!(warning.contains("usage"), "{r:?}");

    // 4. A 200 without usage: ok, with a warning about the unknown cost.
    sim.sim.set_options(SimOptions {
        rules: vec![always("*", Fault::NoUsage)],
        ..SimOptions::default()
    });
    push(&mut conn, "llm", &[job("no-usage", "d")]).await;
    let r = next_result(&mut conn, 4, &w).await;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m1", "{r:?}");
    let warning = r.get("warning").cloned().unwrap_or_default();
    assert!(warning.contains("usage"), "{r:?}");
    assert_eq!(r["cost_usd"], "0", "{r:?}");
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_payload_is_invalid_and_extra_field_is_a_warning() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "input.toml");
    let w = WorkerProc::spawn(
        &cfg,
        "input-w1",
        &[("LLM_WORKER__QUEUE__MAX_PAYLOAD_BYTES", "1000")],
    );
    let mut conn = redis.conn().await;

    let big = job("too-big", &"z".repeat(2000 - job("too-big", "").len()));
    assert_eq!(big.len(), 2000);
    let entry = push(&mut conn, "llm", std::slice::from_ref(&big)).await;
    let r = next_result(&mut conn, 1, &w).await;
    assert_eq!(r["status"], "invalid", "{r:?}");
    assert_eq!(r["job_entry"], entry[0]);
    assert!(
        r["error"].contains("1000") && r["error"].contains("max_payload_bytes"),
        "{r:?}"
    );
    assert!(r["error"].contains("2000"), "{r:?}");
    let dead = entries_raw(&mut conn, "{llm}:dead").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].1["payload"],
        big.as_bytes(),
        "payload kept verbatim"
    );
    let reason = String::from_utf8_lossy(&dead[0].1["reason"]).into_owned();
    assert!(reason.contains("max_payload_bytes"), "{reason}");
    assert_eq!(sim.sim.stats().calls_per_job.len(), 0, "no model call");

    let ok = job("extra-field", "hello");
    push_fields(
        &mut conn,
        "llm",
        &[("payload", ok.as_bytes()), ("priority", b"high")],
    )
    .await;
    let r = next_result(&mut conn, 2, &w).await;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["job_id"], "extra-field");
    let warning = r.get("warning").cloned().unwrap_or_default();
    assert!(warning.contains("priority"), "{r:?}");
    assert_eq!(sim_calls(&sim, "extra-field"), 1);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

/// A job deleted from the stream while pending (XDEL by an operator, or a producer's
/// MAXLEN trim) has nothing left to process: XAUTOCLAIM reports it, the worker
/// acknowledges it and logs it instead of retrying it forever; other jobs go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_deleted_while_pending_is_acknowledged_and_logged() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[job("ghost-1", "lost")]).await;
    // A consumer that died holding it.
    read_as(&mut conn, "ghost").await;
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 1);
    let _: i64 = redis::cmd("XDEL")
        .arg("{llm}:jobs")
        .arg(&ids[0])
        .query_async(&mut conn)
        .await?;
    push(&mut conn, "llm", &[job("alive-1", "fine")]).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "200")]);
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let gone = wait_for(Duration::from_secs(10), || {
        let mut c = conn.clone();
        async move { pending_count(&mut c, "{llm}:jobs", "workers").await == 0 }
    })
    .await;
    assert!(gone, "the deleted entry is acknowledged\n{}", w.log());
    assert!(
        wait_log(&w, "deleted from the stream", Duration::from_secs(5)).await,
        "{}",
        w.log()
    );
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].1["job_id"], "alive-1");
    assert_eq!(sim.sim.stats().calls_per_job.get("ghost-1"), None);
    stop_clean(&mut w, Duration::from_secs(10)).await;
    Ok(())
}

/// A commit Redis acknowledged and then lost (a Sentinel failover promoting a replica
/// that had not received it yet, or a restart from an older snapshot) leaves the entry
/// pending under this worker's own consumer, with no result. The worker remembers it
/// as finished, but that memory only guards the race of a reclaim with a commit in
/// flight: well after the finish, the entry is run again, so the job still gets its one
/// result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_lost_by_redis_is_run_again_by_the_same_worker() -> anyhow::Result<()> {
    let mut redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 1500,
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "lost.toml");
    let mut w = WorkerProc::spawn(
        &cfg,
        "lost",
        &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "1000")],
    );
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job("lost-1", "hello")]).await;
    assert!(
        in_flight_at_least(&sim, 1, Duration::from_secs(10)).await,
        "the call never started\n{}",
        w.log()
    );
    // The snapshot holds the entry pending (read, call in flight) and no result.
    let _: () = redis::cmd("SAVE").query_async(&mut conn).await?;
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(10)).await,
        &[&w],
    )?;
    // Redis dies and comes back from the snapshot: the commit is gone.
    tokio::task::block_in_place(|| {
        redis.kill();
        redis.restart();
    });
    let mut conn = redis.conn().await;
    assert_eq!(
        xlen(&mut conn, "{llm}:results").await,
        0,
        "snapshot restored"
    );
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_all_ok_once(&results, 1);
    stop_clean(&mut w, Duration::from_secs(15)).await;
    Ok(())
}
