//! Fleet-wide budgets (issue 10), end to end: the real binary, a real redis-server and
//! the simulated provider. A call's worst case is reserved before it and settled to its
//! real cost after it, in one script per step, so 50 concurrent jobs against a budget of
//! 10 jobs' worst case never spend more than the budget, whatever `on_exhausted` says.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use redis::AsyncCommands;
use rust_decimal::Decimal;
use std::collections::HashMap;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// The payload of budget job `i`.
fn payload(i: usize) -> String {
    serde_json::json!({"id": format!("b-{i}"), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
        .to_string()
}

/// The worst case the worker reserves for job `i` on `model` (the same rule, from the
/// library: bytes of the body x input price + max_tokens x output price).
fn worst(cfg: &llm_worker::config::Config, i: usize, model: &str) -> Decimal {
    let p = payload(i);
    let job = llm_worker::job::parse(Some(p.as_bytes()), "1-0", 1 << 20, cfg).expect("valid");
    llm_worker::quota::worst_case(&job.body, &cfg.models[model]).expect("computable")
}

fn cost_of(r: &HashMap<String, String>) -> Decimal {
    r["cost_usd"].parse().expect("cost_usd is a decimal")
}

struct Setup {
    redis: RedisServer,
    sim: SimHandle,
    dir: tempfile::TempDir,
    tc: TestConfig,
    limit: Decimal,
}

/// A budget of ten jobs' worst case on m1, with `on_exhausted` and `models`.
async fn setup(on: &str, models: &str, latency_ms: u64) -> Setup {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 50;
    tc.slots = 50;
    let limit = worst(&tc.parsed(), 10, "m1") * Decimal::from(10);
    tc.extra = format!(
        "[budgets.ten]\nusd_per_day = \"{limit}\"\nmodels = {models}\non_exhausted = \"{on}\"\n"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    Setup {
        redis,
        sim,
        dir,
        tc,
        limit,
    }
}

async fn push_fifty(conn: &mut redis::aio::MultiplexedConnection) {
    let all: Vec<String> = (0..50).map(payload).collect();
    push(conn, "llm", &all).await;
}

/// Pushes the 50 jobs, starts a worker and waits for 50 results.
async fn run_fifty(
    s: &Setup,
) -> (
    WorkerProc,
    redis::aio::MultiplexedConnection,
    Vec<(String, HashMap<String, String>)>,
) {
    let cfg = s.tc.write(s.dir.path(), "w.toml");
    let mut conn = s.redis.conn().await;
    push_fifty(&mut conn).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    let waited = wait_len(&mut conn, "{llm}:results", 50, T).await;
    context(waited, &[&w]).expect("50 results");
    let results = entries(&mut conn, "{llm}:results").await;
    (w, conn, results)
}

/// `fail`: 50 jobs at once, a budget of 10 worst cases: the money spent never exceeds
/// the budget, every job has one result, and the ones refused say `budget:`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_jobs_never_overspend_a_budget_that_fails() {
    let s = setup("fail", "[]", 100).await;
    let (mut w, mut conn, results) = run_fifty(&s).await;
    let spent: Decimal = results.iter().map(|(_, r)| cost_of(r)).sum();
    let ok = results.iter().filter(|(_, r)| r["status"] == "ok").count();
    let refused: Vec<_> = results
        .iter()
        .filter(|(_, r)| r["status"] != "ok")
        .collect();
    eprintln!(
        "fail: {ok} ok, {} refused, spent {spent} of {} (overshoot {})",
        refused.len(),
        s.limit,
        spent - s.limit
    );
    assert!(spent <= s.limit, "spent {spent} > budget {}", s.limit);
    assert!(ok >= 10, "at least the budget's worth ran: {ok}");
    assert!(!refused.is_empty(), "the budget refused some: {ok} ok");
    for (_, r) in &refused {
        assert_eq!(r["status"], "failed", "{r:?}");
        assert!(r["error"].starts_with("budget: ten"), "{r:?}");
        assert_eq!(r["attempts"], "0", "refused before any call: {r:?}");
    }
    let calls = s
        .sim
        .sim
        .stats()
        .requests
        .values()
        .flat_map(|m| m.values())
        .sum::<u64>();
    assert_eq!(
        calls as usize, ok,
        "one call per ok job, none for the refused"
    );
    // The window holds the settled spend and no reservation left.
    let keys: Vec<String> = conn.keys("{llm}:budget:*").await.expect("KEYS");
    assert_eq!(keys.len(), 1, "{keys:?}");
    let h: HashMap<String, String> = conn.hgetall(&keys[0]).await.expect("HGETALL");
    assert_eq!(h.len(), 1, "only `spent` is left: {h:?}");
    let picos: i64 = h["spent"].parse().expect("spent");
    assert_eq!(
        llm_worker::cost::from_picos(picos),
        spent,
        "settled = billed"
    );
    // `status` shows the window: spent, nothing running, the limit.
    let st = llm_worker::tools::status(&s.tc.parsed())
        .await
        .expect("status");
    let b = &st["budgets"][0];
    assert_eq!(b["budget"], "ten", "{st}");
    assert_eq!(b["who"], "*", "{st}");
    assert!(
        b["window"].as_str().is_some_and(|w| w.starts_with("d:")),
        "{st}"
    );
    assert_eq!(b["spent_usd"], llm_worker::cost::format_usd(spent), "{st}");
    assert_eq!(b["reserved_usd"], "0", "{st}");
    assert_eq!(
        b["limit_usd"],
        llm_worker::cost::format_usd(s.limit),
        "{st}"
    );
    let mut text = vec![];
    llm_worker::tools::print_status(&st, &mut text).expect("print");
    let text = String::from_utf8(text).expect("utf8");
    assert!(text.contains("budget ten"), "{text}");
    stop_clean(&mut w, T).await;
}

/// `cheaper`: the budget covers m1 only; when it is spent, jobs go on to m2. All 50 ok,
/// m1's spend within the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_that_goes_cheaper_moves_jobs_to_the_next_model() {
    let s = setup("cheaper", "[\"m1\"]", 100).await;
    let (mut w, _conn, results) = run_fifty(&s).await;
    assert!(
        results.iter().all(|(_, r)| r["status"] == "ok"),
        "{results:?}"
    );
    let on_m1: Vec<_> = results.iter().filter(|(_, r)| r["model"] == "m1").collect();
    let spent_m1: Decimal = on_m1.iter().map(|(_, r)| cost_of(r)).sum();
    eprintln!(
        "cheaper: {} on m1 (spent {spent_m1} of {}), {} on m2",
        on_m1.len(),
        s.limit,
        50 - on_m1.len()
    );
    assert!(
        spent_m1 <= s.limit,
        "m1 spent {spent_m1} > budget {}",
        s.limit
    );
    assert!(on_m1.len() >= 10 && on_m1.len() < 50, "{}", on_m1.len());
    assert!(results.iter().any(|(_, r)| r["model"] == "m2"));
    stop_clean(&mut w, T).await;
}

/// `pause`: once the budget is spent the worker takes no more jobs; they wait in the
/// stream (no result, no call, no loss) and /ready stays 200, and a worker started with
/// a larger budget finishes them: exactly one result per job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_budget_leaves_jobs_waiting_and_loses_none() {
    let mut s = setup("pause", "[]", 100).await;
    s.tc.listen = format!("127.0.0.1:{}", free_port());
    let cfg = s.tc.write(s.dir.path(), "w.toml");
    let mut conn = s.redis.conn().await;
    push_fifty(&mut conn).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    // Results stop coming: wait until the count is the same for 3 s.
    let mut last = 0;
    let mut stable_since = tokio::time::Instant::now();
    let deadline = tokio::time::Instant::now() + T;
    while tokio::time::Instant::now() < deadline {
        let n: usize = conn.xlen("{llm}:results").await.expect("XLEN");
        if n != last {
            last = n;
            stable_since = tokio::time::Instant::now();
        } else if stable_since.elapsed() > Duration::from_secs(3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let results = entries(&mut conn, "{llm}:results").await;
    let spent: Decimal = results.iter().map(|(_, r)| cost_of(r)).sum();
    eprintln!(
        "pause: {} results before the pause, spent {spent} of {}",
        results.len(),
        s.limit
    );
    assert!(
        results.len() >= 10 && results.len() < 50,
        "{}",
        results.len()
    );
    assert!(
        results.iter().all(|(_, r)| r["status"] == "ok"),
        "none failed: {results:?}"
    );
    assert!(spent <= s.limit);
    let ready = reqwest::get(format!("http://{}/ready", s.tc.listen))
        .await
        .map(|r| r.status().as_u16());
    assert_eq!(ready.ok(), Some(200), "/ready stays 200 while paused");
    assert!(
        w.log().contains("pausing: taking no new jobs"),
        "{}",
        w.log()
    );
    stop_clean(&mut w, T).await;

    // A bigger budget: the rest run, each once.
    s.tc.extra = s.tc.extra.replace(&format!("\"{}\"", s.limit), "\"1\"");
    let cfg = s.tc.write(s.dir.path(), "w2.toml");
    let mut w2 = WorkerProc::spawn(&cfg, "w2", &[]);
    let waited = wait_len(&mut conn, "{llm}:results", 50, T).await;
    context(waited, &[&w2]).expect("all 50");
    let results = entries(&mut conn, "{llm}:results").await;
    let mut ids: Vec<&str> = results.iter().map(|(_, r)| r["job_id"].as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 50, "one result per job");
    stop_clean(&mut w2, T).await;
}

/// A worker SIGKILLed mid-call leaves reservations; they expire (provider timeout + two
/// slot TTLs) and the budget is whole again for another worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_of_a_killed_worker_expire() {
    let s = setup("fail", "[]", 20_000).await;
    let cfg = s.tc.write(s.dir.path(), "w.toml");
    let env = [
        ("LLM_WORKER__PROVIDERS__P1__TIMEOUT_MS", "1000"),
        ("LLM_WORKER__PROVIDERS__P2__TIMEOUT_MS", "1000"),
    ];
    let mut conn = s.redis.conn().await;
    push(&mut conn, "llm", &[payload(0), payload(1), payload(2)]).await;
    let w = WorkerProc::spawn(&cfg, "w1", &env);
    let reserved = wait_for(Duration::from_secs(10), || {
        let mut c = conn.clone();
        async move {
            let keys: Vec<String> = c.keys("{llm}:budget:*").await.unwrap_or_default();
            match keys.first() {
                Some(k) => c.hlen::<_, usize>(k).await.unwrap_or(0) >= 3,
                None => false,
            }
        }
    })
    .await;
    assert!(reserved, "three calls reserved\n{}", w.log());
    w.signal("KILL");
    let keys: Vec<String> = conn.keys("{llm}:budget:*").await.expect("KEYS");
    let key = keys[0].clone();
    let h: HashMap<String, String> = conn.hgetall(&key).await.expect("HGETALL");
    assert_eq!(h.keys().filter(|f| f.starts_with("r:")).count(), 3, "{h:?}");
    // ttl = 1 s timeout + 2 x 3 s slot ttl = 7 s: after it, a reservation by anyone sees
    // the whole budget again (the script drops expired reservations as it reads them).
    tokio::time::sleep(Duration::from_millis(7_500)).await;
    let mut cfg2 = s.tc.parsed();
    cfg2.queue.consumer = "probe".into();
    let budgets = llm_worker::budget::Budgets::new(
        std::sync::Arc::new(cfg2.clone()),
        llm_worker::connect::commands(&cfg2).expect("pool"),
    );
    // The whole budget minus nothing: a reservation of the full limit fits.
    let r = budgets
        .reserve("m1", None, s.limit)
        .await
        .expect("the whole budget is free again");
    assert!(r.is_some());
    let h: HashMap<String, String> = conn.hgetall(&key).await.expect("HGETALL");
    assert_eq!(
        h.keys().filter(|f| f.starts_with("r:")).count(),
        1,
        "expired ones dropped: {h:?}"
    );
}
