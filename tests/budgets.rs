//! Fleet-wide budgets (issue 10), end to end: the real binary, a real redis-server and
//! the simulated provider. A call's worst case is reserved before it and settled to its
//! real cost after it, in one script per step, so 50 concurrent jobs against a budget of
//! 10 jobs' worst case never spend more than the budget, whatever `on_exhausted` says.

mod common;

use common::*;
use llm_worker::sim::{Fault, SimOptions};
use redis::AsyncCommands;
use rust_decimal::Decimal;
use std::collections::HashMap;
use std::str::FromStr;
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
    assert_eq!(
        h.keys().filter(|f| f.starts_with("r:")).count(),
        0,
        "no reservation is left: {h:?}"
    );
    assert_eq!(
        h.get("h").map(String::as_str),
        Some("0"),
        "the running sum of live reservations is back to 0: {h:?}"
    );
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
    // Today's and this month's spend per model add up to what was billed.
    for w in ["today", "this_month"] {
        let models = st["spend"][w]["models"].as_object().expect("spend models");
        let sum: Decimal = models
            .values()
            .map(|v| Decimal::from_str(v.as_str().expect("usd")).expect("decimal"))
            .sum();
        assert_eq!(sum, spent, "{w}: {st}");
    }
    let mut text = vec![];
    llm_worker::tools::print_status(&st, &mut text).expect("print");
    let text = String::from_utf8(text).expect("utf8");
    assert!(text.contains("budget ten"), "{text}");
    assert!(text.contains("spend today"), "{text}");
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
            // Counted as asserted below: the hash also holds fields that are not
            // reservations ('h', 'x'), so its length alone is not three calls.
            match keys.first() {
                Some(k) => {
                    let h: HashMap<String, String> = c.hgetall(k).await.unwrap_or_default();
                    h.keys().filter(|f| f.starts_with("r:")).count() >= 3
                }
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
    // ttl = 1 s timeout + 2 x 3 s slot ttl + 1 s block life = 8 s: after it, a
    // reservation by anyone sees the whole budget again (the script drops expired
    // reservations as it reads them).
    tokio::time::sleep(Duration::from_millis(8_500)).await;
    whole_budget_is_free(&s.tc, s.limit).await;
    let h: HashMap<String, String> = conn.hgetall(&key).await.expect("HGETALL");
    assert_eq!(
        h.keys().filter(|f| f.starts_with("r:")).count(),
        1,
        "expired ones dropped: {h:?}"
    );
}

/// A reservation of the whole `limit` of m1's budget fits: nothing spent, nothing held.
async fn whole_budget_is_free(tc: &TestConfig, limit: Decimal) {
    let mut cfg = tc.parsed();
    cfg.queue.consumer = "probe".into();
    let budgets = llm_worker::budget::Budgets::new(std::sync::Arc::new(cfg.clone()));
    let gate = llm_worker::gate::Gate::new(llm_worker::connect::commands(&cfg).expect("pool"));
    let ask = budgets
        .ask("probe", "m1", None, limit)
        .expect("fits the limit")
        .expect("covered");
    let r = gate
        .admit(Some(&ask), budgets.ttl_ms(), None)
        .await
        .expect("Redis answers");
    assert!(
        matches!(r, llm_worker::gate::Answer::Admitted { .. }),
        "the whole budget is free again: {r:?}"
    );
}

fn worst_of(cfg: &llm_worker::config::Config, payload: &str, model: &str) -> Decimal {
    let job = llm_worker::job::parse(Some(payload.as_bytes()), "1-0", 1 << 20, cfg).expect("valid");
    llm_worker::quota::worst_case(&job.body, &cfg.models[model]).expect("computable")
}

/// Review finding (tests first): a pause budget whose limit is below one call's worst case can never have room:
/// the job waits forever (no `budget:` failure), and the reader pause it keeps renewing
/// stops the worker taking ANY job, even one on a model the budget does not cover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_budget_never_stalls_jobs_it_does_not_cover_nor_waits_for_a_call_that_can_never_fit()
 {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.extra = "[budgets.m1only]\nusd_per_day = \"0.000001\"\nmodels = [\"m1\"]\non_exhausted = \"pause\"\n".into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let a = r#"{"id":"a","messages":[{"role":"user","content":"hi"}],"max_tokens":16}"#;
    eprintln!(
        "worst(a, m1) = {} > limit 0.000001",
        worst_of(&tc.parsed(), a, "m1")
    );
    push(&mut conn, "llm", &[a.to_string()]).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    // A job on m2, which no budget covers.
    let b =
        r#"{"id":"b","model":"m2","messages":[{"role":"user","content":"hi"}],"max_tokens":16}"#;
    push(&mut conn, "llm", &[b.to_string()]).await;
    let got = wait_len(&mut conn, "{llm}:results", 2, Duration::from_secs(15)).await;
    let results = entries(&mut conn, "{llm}:results").await;
    stop_clean(&mut w, T).await;
    context(got, &[&w]).expect("both jobs have a result");
    let by_id: HashMap<&str, &HashMap<String, String>> = results
        .iter()
        .map(|(_, r)| (r["job_id"].as_str(), r))
        .collect();
    assert_eq!(by_id["b"]["status"], "ok", "{results:?}");
    assert_eq!(by_id["b"]["model"], "m2", "{results:?}");
    // a: a call of m1 can never fit the budget, so waiting cannot help: the route's next
    // model (not covered) runs it, and m1 is never called.
    assert_eq!(by_id["a"]["status"], "ok", "{results:?}");
    assert_eq!(by_id["a"]["model"], "m2", "{results:?}");
    assert_eq!(by_id["a"]["tried"], "m2", "{results:?}");
    assert_eq!(calls_to(&sim, "m1"), 0);
    assert!(
        !w.log().contains("pausing: taking no new jobs"),
        "{}",
        w.log()
    );
}

/// Review finding (tests first): the output bound takes the SMALLER of max_tokens / max_completion_tokens, but
/// providers (and the sim) honour max_completion_tokens: a job's real cost exceeds its
/// max_cost_usd, and 50 concurrent jobs overspend a `fail` budget of 10 worst cases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_completion_tokens_above_max_tokens_keeps_cap_and_budget() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 200,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 50;
    tc.slots = 50;
    let pl = |i: usize, cap: &str| {
        format!(
            r#"{{"id":"c{i:02}","model":"m2","messages":[{{"role":"user","content":"hello there {i:02}"}}],"max_tokens":1,"max_completion_tokens":128,"max_cost_usd":"{cap}"}}"#
        )
    };
    let parsed = tc.parsed();
    // 14-char placeholder, then the real cap formatted to the same width: same bytes.
    let worst = worst_of(&parsed, &pl(0, "0.000000000000"), "m2");
    let cap = format!("{:.12}", worst);
    assert_eq!(cap.len(), 14, "{cap}");
    let limit = worst * Decimal::from(10);
    tc.extra = format!(
        "[budgets.ten]\nusd_per_day = \"{limit}\"\nmodels = [\"m2\"]\non_exhausted = \"fail\"\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let all: Vec<String> = (0..50).map(|i| pl(i, &cap)).collect();
    push(&mut conn, "llm", &all).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    context(wait_len(&mut conn, "{llm}:results", 50, T).await, &[&w]).expect("50 results");
    let results = entries(&mut conn, "{llm}:results").await;
    stop_clean(&mut w, T).await;
    let ok: Vec<_> = results
        .iter()
        .filter(|(_, r)| r["status"] == "ok")
        .collect();
    let spent: Decimal = results
        .iter()
        .map(|(_, r)| r["cost_usd"].parse::<Decimal>().unwrap_or_default())
        .sum();
    let over_cap = ok
        .iter()
        .filter(|(_, r)| r["cost_usd"].parse::<Decimal>().unwrap() > worst)
        .count();
    eprintln!(
        "max_cost_usd {cap}: {} ok, {over_cap} of them cost more than the cap (e.g. {}); budget {limit}: spent {spent}",
        ok.len(),
        ok.first()
            .map(|(_, r)| r["cost_usd"].clone())
            .unwrap_or_default()
    );
    assert_eq!(over_cap, 0, "per-job cap exceeded");
    assert!(spent <= limit, "budget overspent: {spent} > {limit}");
}

/// Review finding (tests first): a call that times out (no usage) is settled at 0 and adds 0 to the job's spent,
/// though the provider may bill it in full: the per-job cap and the budget stop nothing,
/// the job makes max_attempts calls whose worst cases together exceed both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_calls_count_their_worst_case_against_cap_and_budget() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        rules: vec![always("*", Fault::Hang)],
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    let pl = |cap: &str| {
        format!(
            r#"{{"id":"t1","messages":[{{"role":"user","content":"hi"}}],"max_tokens":16,"max_cost_usd":"{cap}"}}"#
        )
    };
    let worst = worst_of(&tc.parsed(), &pl("0.000000000000"), "m1");
    let cap = format!("{:.12}", worst * Decimal::new(15, 1));
    tc.extra = format!(
        "[budgets.m1]\nusd_per_day = \"{cap}\"\nmodels = [\"m1\"]\non_exhausted = \"fail\"\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[pl(&cap)]).await;
    let env = [
        ("LLM_WORKER__PROVIDERS__P1__TIMEOUT_MS", "300"),
        ("LLM_WORKER__PROVIDERS__P2__TIMEOUT_MS", "300"),
    ];
    let mut w = WorkerProc::spawn(&cfg, "w1", &env);
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w]).expect("1 result");
    let results = entries(&mut conn, "{llm}:results").await;
    stop_clean(&mut w, T).await;
    let keys: Vec<String> = conn.keys("{llm}:budget:*").await.unwrap();
    let h: HashMap<String, String> = conn.hgetall(&keys[0]).await.unwrap();
    let n = calls_to(&sim, "m1");
    eprintln!(
        "cap = budget = 1.5 x worst {worst}; m1 calls {n} (worst total {}); result {:?}; window {h:?}",
        worst * Decimal::from(n),
        results[0].1
    );
    assert!(
        n <= 1,
        "{n} calls of worst case {worst} each under a cap/budget of {cap}"
    );
}

/// Review finding (tests first): settle gives up after ~1.5 s of Redis errors (5 tries, 100..800 ms apart); the
/// reservation then expires and the paid call's cost never reaches `spent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_survives_redis_down_for_a_few_seconds() {
    let mut redis = RedisServer::start_opts(true);
    let sim = SimHandle::start(SimOptions {
        latency_ms: 1500,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.ttl_ms = 1000;
    tc.extra = "[budgets.all]\nusd_per_day = \"1\"\non_exhausted = \"fail\"\n".into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let env = [
        ("LLM_WORKER__PROVIDERS__P1__TIMEOUT_MS", "3000"),
        ("LLM_WORKER__PROVIDERS__P2__TIMEOUT_MS", "3000"),
    ];
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job("s1", "hello")]).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &env);
    assert!(in_flight_at_least(&sim, 1, T).await, "{}", w.log());
    tokio::task::block_in_place(|| redis.stop());
    tokio::time::sleep(Duration::from_secs(5)).await;
    tokio::task::block_in_place(|| redis.restart());
    let mut conn = redis.conn().await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w]).expect("1 result");
    let results = entries(&mut conn, "{llm}:results").await;
    // reservation ttl = 3 s timeout + 2 x 1 s slot ttl = 5 s
    tokio::time::sleep(Duration::from_secs(6)).await;
    let keys: Vec<String> = conn.keys("{llm}:budget:*").await.unwrap();
    let h: HashMap<String, String> = match keys.first() {
        Some(k) => conn.hgetall(k).await.unwrap(),
        None => HashMap::new(),
    };
    let log = w.log();
    stop_clean(&mut w, T).await;
    eprintln!(
        "result cost {}; window {h:?}; settle log: {:?}",
        results[0].1["cost_usd"],
        log.lines()
            .filter(|l| l.contains("settle"))
            .collect::<Vec<_>>()
    );
    let spent: i64 = h.get("spent").and_then(|s| s.parse().ok()).unwrap_or(0);
    assert!(
        spent > 0,
        "a paid call ({}) is not counted in the budget",
        results[0].1["cost_usd"]
    );
}

/// Fleet-wide RPM (issue 10): three worker processes share m1's `rpm = 20`: the
/// simulated provider sees at most 20 calls of m1 in the run (well under a minute), all
/// 20 used; the jobs held back past `slots.acquire_timeout_ms` run on the route's next
/// model, and every job ends ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_never_exceed_a_models_rpm_together() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 50,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 12;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = tc.write(dir.path(), "w.toml");
    let env = [("LLM_WORKER__MODELS__M1__RPM", "20")];
    let mut conn = redis.conn().await;
    let all: Vec<String> = (0..90).map(payload).collect();
    push(&mut conn, "llm", &all).await;
    let mut ws: Vec<WorkerProc> = (0..3)
        .map(|i| WorkerProc::spawn(&cfg, &format!("w{i}"), &env))
        .collect();
    let started = tokio::time::Instant::now();
    let waited = wait_len(&mut conn, "{llm}:results", 90, T).await;
    context(waited, &ws.iter().collect::<Vec<_>>()).expect("90 results");
    let took = started.elapsed();
    let results = entries(&mut conn, "{llm}:results").await;
    let m1 = calls_to(&sim, "m1");
    let on_m1 = results.iter().filter(|(_, r)| r["model"] == "m1").count();
    eprintln!(
        "rpm 20 on m1, 3 workers, 90 jobs in {took:?}: m1 called {m1} times ({on_m1} results), the rest on m2"
    );
    assert!(
        took < Duration::from_secs(55),
        "the run fits in one window: {took:?}"
    );
    assert_eq!(m1, 20, "exactly the limit, fleet-wide");
    assert!(
        results.iter().all(|(_, r)| r["status"] == "ok"),
        "{results:?}"
    );
    for w in &mut ws {
        stop_clean(w, T).await;
    }
}

/// Review finding (issue 10, tests first): a worker SIGKILLed mid-call of a job with
/// `max_cost_usd` left no trace of that call, so the worker that took the job over
/// started from zero and called again: the job could cost up to twice its cap. Each
/// call's worst case is now recorded in Redis before it starts (`{ns}:capspent:<entry>`),
/// and a delivery of a taken-over entry starts from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_taken_over_from_a_killed_worker_keeps_its_cap() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 20_000,
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    // Room for one call of m1 at its worst case, not two (and none of m2 or m3).
    let (job, worst, cap) = capped_k1(&tc, Decimal::new(15, 1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job]).await;
    let w1 = WorkerProc::spawn(&cfg, "w1", &[]);
    assert!(
        in_flight_at_least(&sim, 1, T).await,
        "the first call is on the wire\n{}",
        w1.log()
    );
    w1.signal("KILL");
    let env = [
        ("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "500"),
        ("LLM_WORKER__PROVIDERS__P1__TIMEOUT_MS", "500"),
        ("LLM_WORKER__PROVIDERS__P2__TIMEOUT_MS", "500"),
    ];
    let mut w2 = WorkerProc::spawn(&cfg, "w2", &env);
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w2]).expect("1 result");
    let results = entries(&mut conn, "{llm}:results").await;
    stop_clean(&mut w2, T).await;
    let r = &results[0].1;
    // Counted as each call arrives (a call cut off by a kill or a timeout never ends).
    let n = sim
        .sim
        .stats()
        .calls_per_job
        .get("k1")
        .copied()
        .unwrap_or(0);
    eprintln!("cap {cap} = 1.5 x worst {worst}; calls {n}; result {r:?}");
    assert_eq!(
        n,
        1,
        "the killed delivery's call counts against the cap: no second call\n{}",
        w2.log()
    );
    assert_eq!(r["status"], "failed", "{r:?}");
    assert!(r["error"].starts_with("budget:"), "{r:?}");
    let left: Vec<String> = conn.keys("{llm}:capspent:*").await.unwrap();
    assert!(left.is_empty(), "the record goes with the result: {left:?}");
}

/// Review finding (issue 10, tests first): a delivery that took a killed worker's entry over (its cap record counted) and is
/// handed back by a SIGTERM before its own first call carries nothing (`carry()` is
/// `None` with no attempt) and the record stays under the old entry id: the new entry
/// starts its cap from zero.
/// Fixed: a hand-back carries whatever the cap counts, called or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_back_before_the_first_call_carries_what_a_killed_delivery_recorded() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 20_000,
        model_latency_ms: std::collections::HashMap::from([("m3".to_string(), 15_000)]),
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 1;
    // Room for two calls of m1 at their worst case, not three.
    let (job, worst, cap) = capped_k1(&tc, Decimal::new(25, 1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job]).await;
    let w1 = WorkerProc::spawn(&cfg, "w1", &[]);
    assert!(
        in_flight_at_least(&sim, 1, Duration::from_secs(20)).await,
        "{}",
        w1.log()
    );
    w1.signal("KILL");
    // W0 holds the only slot with a long call of another job on m3.
    let w0 = WorkerProc::spawn(
        &cfg,
        "w0",
        &[("LLM_WORKER__PROVIDERS__P1__TIMEOUT_MS", "500")],
    );
    assert_started(&[&w0]).await;
    push(&mut conn, "llm", &[r#"{"id":"blocker","model":"m3","messages":[{"role":"user","content":"hi"}],"max_tokens":16}"#.to_string()]).await;
    assert!(
        wait_for(Duration::from_secs(20), || async {
            sim.sim.stats().calls_per_job.contains_key("blocker")
        })
        .await,
        "{}",
        w0.log()
    );
    // W2 takes X over (counts W1's call) and waits for the slot; then SIGTERM.
    let mut w2 = WorkerProc::spawn(&cfg, "w2", &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "500")]);
    assert_started(&[&w2]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    w2.signal("TERM");
    wait_exit(&mut w2, Duration::from_secs(15)).await;
    eprintln!("w2:\n{}", logs_tail(&[&w2], 15));
    context(
        wait_len(&mut conn, "{llm}:results", 2, Duration::from_secs(60)).await,
        &[&w0],
    )
    .expect("2 results");
    let n = sim
        .sim
        .stats()
        .calls_per_job
        .get("k1")
        .copied()
        .unwrap_or(0);
    let results = entries(&mut conn, "{llm}:results").await;
    let mut w0 = w0;
    stop_clean(&mut w0, Duration::from_secs(20)).await;
    eprintln!("cap {cap} = 2.5 x worst {worst}; calls of k1: {n}; results {results:?}");
    assert_eq!(
        n,
        2,
        "W1's call and one more fit the cap, not a third\n{}",
        logs_tail(&[&w0], 30)
    );
}

/// Review finding (issue 10, tests first): a cap record refused by a full Redis (EXECABORT: not retried, the call runs
/// unrecorded) is still "corrected" after the call once Redis has memory again: a call
/// not billed (HTTP 500) subtracts its worst case from a record that never got it. The
/// record goes negative, the next call's worst case cancels out, and a worker that takes
/// the job over after a kill mid-call starts from zero.
/// Fixed: a MULTI aborted by OOM heals like the OOM inside it (retried until Redis has
/// memory), and only a record that was written is corrected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_record_refused_by_a_full_redis_is_retried_and_never_goes_negative() {
    use llm_worker::sim::{Fault, Rule};
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 2_000,
        rules: vec![
            Rule {
                model: "m1".into(),
                fault: Fault::Status { status: 500 },
                probability: 1.0,
                first_n: Some(1),
            },
            Rule {
                model: "m1".into(),
                fault: Fault::Hang,
                probability: 1.0,
                first_n: None,
            },
        ],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let pl = |cap: &str| {
        format!(
            r#"{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":16,"max_cost_usd":"{cap}"}}"#
        )
    };
    let worst = worst_of(&tc.parsed(), &pl("0.000000000000"), "m1");
    let cap = format!("{:.12}", worst * Decimal::new(15, 1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    set_maxmemory(&mut conn, 0).await;
    let w1 = WorkerProc::spawn(&cfg, "w1", &[]);
    assert_started(&[&w1]).await;
    // The job must reach the worker before Redis is full (a read under `maxmemory` is
    // refused): send it, and the limit behind it, while the reader is blocked in
    // XREADGROUP, which Redis serves right after the XADD.
    let blocked = wait_for(Duration::from_secs(10), || {
        let mut c = conn.clone();
        async move {
            let list: String = redis::cmd("CLIENT")
                .arg("LIST")
                .query_async(&mut c)
                .await
                .unwrap_or_default();
            list.lines()
                .any(|l| l.contains("cmd=xreadgroup") && l.contains("flags=b"))
        }
    })
    .await;
    assert!(blocked, "the reader blocks in XREADGROUP\n{}", w1.log());
    let _: () = redis::pipe()
        .cmd("XADD")
        .arg("{llm}:jobs")
        .arg("*")
        .arg("payload")
        .arg(pl(&cap))
        .ignore()
        .cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        wait_log(
            &w1,
            "cannot record the call against",
            Duration::from_secs(10)
        )
        .await,
        "{}",
        w1.log()
    );
    set_maxmemory(&mut conn, 0).await;
    assert!(
        wait_for(Duration::from_secs(15), || async {
            calls_to(&sim, "m1") >= 2
        })
        .await,
        "{}",
        w1.log()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("{llm}:capspent:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut vals = vec![];
    for k in &keys {
        let v: Option<String> = redis::cmd("GET")
            .arg(k)
            .query_async(&mut conn)
            .await
            .unwrap();
        vals.push(v);
    }
    eprintln!("worst {worst}: cap records while call 2 is on the wire: {keys:?} = {vals:?}");
    w1.signal("KILL");
    let mut w2 = WorkerProc::spawn(&cfg, "w2", &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "500")]);
    let third = wait_for(Duration::from_secs(10), || async {
        calls_to(&sim, "m1") >= 3
    })
    .await;
    let log = logs_tail(&[&w2], 20);
    w2.signal("KILL");
    let _ = &mut w2;
    assert!(
        !third,
        "the killed delivery's call counts: W + W > 1.5 W, no third call\n{log}"
    );
}

/// Job `k1` with a `max_cost_usd` of `times` the worst case of one call of m1; returns
/// the job, that worst case and the cap.
fn capped_k1(tc: &TestConfig, times: Decimal) -> (String, Decimal, String) {
    let pl = |cap: &str| {
        format!(
            r#"{{"id":"k1","messages":[{{"role":"user","content":"hi"}}],"max_tokens":16,"max_cost_usd":"{cap}"}}"#
        )
    };
    // Formatted to 12 places: the job's bytes, so its worst case, do not depend on the cap.
    let worst = worst_of(&tc.parsed(), &pl("0.000000000000"), "m1");
    let cap = format!("{:.12}", worst * times);
    (pl(&cap), worst, cap)
}

/// Review finding (issue 10, tests first): a capped job's call cut off at the end of the
/// shutdown grace was handed back as if it cost nothing (the job's future, holding the
/// call on the wire, is dropped by the abort): the next delivery could spend the whole
/// cap again. The hand-back carries it at its worst case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_aborted_at_shutdown_is_carried_at_its_worst_case() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 30_000,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.grace_ms = 500;
    let (job, worst, _cap) = capped_k1(&tc, Decimal::new(15, 1));
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job]).await;
    let mut w1 = WorkerProc::spawn(&cfg, "w1", &[]);
    assert!(
        in_flight_at_least(&sim, 1, T).await,
        "the call is on the wire\n{}",
        w1.log()
    );
    w1.signal("TERM");
    wait_exit(&mut w1, Duration::from_secs(15)).await;
    let jobs = entries(&mut conn, "{llm}:jobs").await;
    let billed = jobs
        .last()
        .and_then(|(_, f)| f.get("_billed").cloned())
        .unwrap_or_else(|| panic!("a handed-back entry with _billed: {jobs:?}\n{}", w1.log()));
    let v: serde_json::Value = serde_json::from_str(&billed).unwrap();
    let unknown = Decimal::from_str(v["unknown_usd"].as_str().unwrap_or("0")).unwrap();
    eprintln!("_billed {billed}; worst {worst}");
    assert!(
        unknown >= worst,
        "the aborted call is carried at {unknown}, its worst case is {worst}"
    );
}

/// Budget blocks (issue 10: "the performance benchmark's figures must still hold with
/// budgets configured"): with a budget far above the load, the calls of a busy model
/// draw on blocks of several worst cases reserved at once, so most calls run no quota
/// script. Nothing is lost by it: once the worker has stopped, the window's `spent` is
/// exactly the sum of the results' costs and no reservation is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_blocks_count_every_calls_real_cost_with_few_scripts() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 0,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 16;
    tc.slots = 16;
    let dir = tempfile::tempdir().unwrap();
    let plain = tc.write(dir.path(), "plain.toml");
    tc.extra = "[budgets.big]\nusd_per_day = \"1000000\"\non_exhausted = \"fail\"\n".into();
    let budgeted = tc.write(dir.path(), "budget.toml");
    let n = 400;
    let jobs = |batch: &str| -> Vec<String> {
        (0..n)
            .map(|i| {
                serde_json::json!({"id": format!("{batch}-{i}"), "model": "m1", "messages": [{"role": "user", "content": format!("hello {i}")}], "max_tokens": 16})
                    .to_string()
            })
            .collect()
    };
    let mut conn = redis.conn().await;
    // The same jobs twice: without a budget (the scripts every job runs anyway), then with.
    let mut scripts = vec![];
    for (batch, cfg) in [("plain", &plain), ("budget", &budgeted)] {
        let before = calls_of(&mut conn, "evalsha").await;
        let have = xlen(&mut conn, "{llm}:results").await;
        push(&mut conn, "llm", &jobs(batch)).await;
        let mut w = WorkerProc::spawn(cfg, batch, &[]);
        let got = wait_len(&mut conn, "{llm}:results", have + n as u64, T).await;
        context(got, &[&w]).expect("results");
        // The last blocks settle as the worker stops.
        stop_clean(&mut w, T).await;
        scripts.push(calls_of(&mut conn, "evalsha").await - before);
    }
    let results = entries(&mut conn, "{llm}:results").await;
    let budget_costs: Decimal = results
        .iter()
        .filter(|(_, r)| r["job_id"].starts_with("budget-"))
        .map(|(_, r)| {
            assert_eq!(r["status"], "ok", "{r:?}");
            cost_of(r)
        })
        .sum();
    let keys: Vec<String> = conn.keys("{llm}:budget:*").await.expect("KEYS");
    assert_eq!(keys.len(), 1, "{keys:?}");
    let h: HashMap<String, String> = conn.hgetall(&keys[0]).await.expect("HGETALL");
    let spent = llm_worker::cost::from_picos(h["spent"].parse().expect("spent"));
    let per_job = (scripts[1] as f64 - scripts[0] as f64) / n as f64;
    eprintln!(
        "{n} jobs per batch: scripts {} without a budget, {} with ({per_job:.2} more per job); window spent {spent}, results' costs {budget_costs}",
        scripts[0], scripts[1]
    );
    assert!(budget_costs > Decimal::ZERO, "the calls cost something");
    assert_eq!(spent, budget_costs, "settled = billed, to the pico-dollar");
    assert_eq!(
        h.keys().filter(|f| f.starts_with("r:")).count(),
        0,
        "no reservation is left: {h:?}"
    );
    assert_eq!(h.get("h").map(String::as_str), Some("0"), "{h:?}");
    // A script before and after every call was 2 more per job.
    assert!(per_job < 0.5, "{per_job:.2} budget scripts per job");
}

/// A budget of 2,000 worst cases (blocks reserve up to 1/1,000 of it, so here 2 calls at
/// once) and 3,000 jobs, 32 at a time, with `on_exhausted = "fail"`: blocks never let the
/// fleet spend past the limit, what a block reserves but does not use goes back, and the
/// window counts exactly what the results cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_blocks_spend_a_budget_to_its_end_and_never_past_it() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 0,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 32;
    tc.slots = 32;
    let job = |i: usize| {
        serde_json::json!({"id": format!("b-{i:04}"), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
            .to_string()
    };
    // Prompts free (the worker gets the same price below): a call's worst case is its
    // 16 output tokens, what the simulated model mostly answers.
    let mut parsed = tc.parsed();
    parsed.models.get_mut("m1").expect("m1").input_per_mtok = Decimal::ZERO;
    let w1 = worst_of(&parsed, &job(0), "m1");
    let limit = w1 * Decimal::from(2_000);
    tc.extra = format!("[budgets.k]\nusd_per_day = \"{limit}\"\non_exhausted = \"fail\"\n");
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let n = 3_000;
    // Same bytes for every job (ids of equal length): one worst case for all.
    let all: Vec<String> = (0..n).map(job).collect();
    push(&mut conn, "llm", &all).await;
    let mut w = WorkerProc::spawn(
        &cfg,
        "w1",
        &[("LLM_WORKER__MODELS__M1__INPUT_PER_MTOK", "0")],
    );
    let got = wait_len(
        &mut conn,
        "{llm}:results",
        n as u64,
        Duration::from_secs(120),
    )
    .await;
    context(got, &[&w]).expect("results");
    stop_clean(&mut w, T).await;
    let results = entries(&mut conn, "{llm}:results").await;
    let costs: Decimal = results.iter().map(|(_, r)| cost_of(r)).sum();
    let ok = results.iter().filter(|(_, r)| r["status"] == "ok").count();
    let refused = results.len() - ok;
    let keys: Vec<String> = conn.keys("{llm}:budget:*").await.expect("KEYS");
    let h: HashMap<String, String> = conn.hgetall(&keys[0]).await.expect("HGETALL");
    let spent = llm_worker::cost::from_picos(h["spent"].parse().expect("spent"));
    eprintln!(
        "{ok} ok, {refused} refused; spent {spent} of {limit} (left {}, one worst case {w1})",
        limit - spent
    );
    assert!(spent <= limit, "spent {spent} > limit {limit}");
    assert_eq!(spent, costs, "settled = billed");
    assert!(refused > 0, "the budget ran out: {ok} ok");
    for (_, r) in results.iter().filter(|(_, r)| r["status"] != "ok") {
        assert!(r["error"].starts_with("budget: k"), "{r:?}");
    }
    // A job is refused only while the calls in flight (32 at most) hold their worst
    // cases: what a block reserved and did not use went back.
    assert!(
        limit - spent < w1 * Decimal::from(32),
        "refused with {} left, more than 32 worst cases of {w1}",
        limit - spent
    );
    assert_eq!(
        h.keys().filter(|f| f.starts_with("r:")).count(),
        0,
        "no reservation is left: {h:?}"
    );
}

/// A worker killed while its calls draw on a budget block (several calls' worst cases in
/// one reservation) leaves that reservation to expire like a single call's: after the
/// reservation's ttl the whole budget is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_workers_budget_block_expires() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 20_000,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 8;
    tc.slots = 8;
    let limit = Decimal::from(1_000);
    tc.extra = format!("[budgets.big]\nusd_per_day = \"{limit}\"\non_exhausted = \"fail\"\n");
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let env = [
        ("LLM_WORKER__PROVIDERS__P1__TIMEOUT_MS", "5000"),
        ("LLM_WORKER__PROVIDERS__P2__TIMEOUT_MS", "5000"),
    ];
    let mut conn = redis.conn().await;
    let jobs: Vec<String> = (0..6).map(payload).collect();
    push(&mut conn, "llm", &jobs).await;
    let w = WorkerProc::spawn(&cfg, "w1", &env);
    let one = worst(&tc.parsed(), 0, "m1");
    let one = llm_worker::cost::to_picos(one).expect("picos");
    // Six calls on the wire, some of them in a block (a reservation of more than one
    // worst case).
    let on_wire = in_flight_at_least(&sim, 6, Duration::from_secs(4)).await;
    assert!(on_wire, "six calls\n{}", w.log());
    w.signal("KILL");
    let keys: Vec<String> = conn.keys("{llm}:budget:*").await.expect("KEYS");
    let key = keys[0].clone();
    let h: HashMap<String, String> = conn.hgetall(&key).await.expect("HGETALL");
    let amounts: Vec<i64> = h
        .iter()
        .filter(|(f, _)| f.starts_with("r:"))
        .map(|(_, v)| v.split('|').next().unwrap().parse().unwrap())
        .collect();
    eprintln!("reservations at the kill: {amounts:?} (one worst case {one})");
    assert!(
        amounts.iter().any(|a| *a > one),
        "a block reserved several worst cases: {amounts:?}"
    );
    // ttl = 5 s timeout + 2 x 3 s slot ttl + 1 s block life = 12 s.
    tokio::time::sleep(Duration::from_millis(12_500)).await;
    whole_budget_is_free(&tc, limit).await;
}

/// `pause` for a budget that covers only some jobs (issue 10: "stop taking jobs covered
/// by the budget (they wait in the stream)"): with 2 permits, ten jobs of a tenant whose
/// budget is spent used to hold both permits while they waited, and the other tenants'
/// jobs behind them never ran. Now each is parked (moved, like a hand-back, to the
/// budget's parked stream, holding no permit), the others run, and once the budget has
/// room again any worker moves them back and each runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_pausing_one_tenant_parks_its_jobs_and_moves_them_back_when_it_has_room() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 50,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 2;
    tc.slots = 4;
    tc.extra =
        "[budgets.acme]\nusd_per_day = \"1\"\ntenant = \"acme\"\non_exhausted = \"pause\"\n".into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    // acme's window is spent already.
    let budgets = llm_worker::budget::Budgets::new(std::sync::Arc::new(tc.parsed()));
    let windows = budgets.windows_now("acme", "t=acme");
    assert_eq!(windows.len(), 1, "{windows:?}");
    let (window, limit) = windows[0].clone();
    let _: () = conn
        .hset_multiple(&window, &[("spent", limit), ("h", 0)])
        .await
        .expect("HSET");
    let acme: Vec<String> = (0..10)
        .map(|i| serde_json::json!({"id": format!("a-{i}"), "tenant": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).to_string())
        .collect();
    let others: Vec<String> = (0..5)
        .map(|i| serde_json::json!({"id": format!("o-{i}"), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).to_string())
        .collect();
    push(&mut conn, "llm", &acme).await;
    push(&mut conn, "llm", &others).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    let got = wait_len(&mut conn, "{llm}:results", 5, Duration::from_secs(20)).await;
    context(got, &[&w]).expect("the other tenants' jobs run");
    let parked = "{llm}:bparked:acme:t=acme";
    let got = wait_len(&mut conn, parked, 10, Duration::from_secs(10)).await;
    context(got, &[&w]).expect("acme's jobs parked");
    let results = entries(&mut conn, "{llm}:results").await;
    assert!(
        results
            .iter()
            .all(|(_, r)| r["job_id"].starts_with("o-") && r["status"] == "ok"),
        "{results:?}"
    );
    assert!(
        w.log().contains("job parked until it has room"),
        "{}",
        w.log()
    );
    stop_clean(&mut w, T).await;
    assert_eq!(
        xlen(&mut conn, parked).await,
        10,
        "still parked with no worker"
    );
    let st = llm_worker::tools::status(&tc.parsed())
        .await
        .expect("status");
    assert_eq!(
        st["budget_parked"],
        serde_json::json!([{"budget": "acme", "who": "t=acme", "parked": 10}]),
        "{st}"
    );
    let calls_before = calls_to(&sim, "m1");
    assert_eq!(calls_before, 5, "no call for a parked job");

    // Room again (a new day, a raised limit): any worker moves them back, each runs once.
    let _: () = conn.hset(&window, "spent", 0).await.expect("HSET");
    let mut w2 = WorkerProc::spawn(&cfg, "w2", &[]);
    let got = wait_len(&mut conn, "{llm}:results", 15, T).await;
    context(got, &[&w2]).expect("all 15");
    stop_clean(&mut w2, T).await;
    let results = entries(&mut conn, "{llm}:results").await;
    let mut ids: Vec<&str> = results.iter().map(|(_, r)| r["job_id"].as_str()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 15, "one result per job: {results:?}");
    assert!(
        results.iter().all(|(_, r)| r["status"] == "ok"),
        "{results:?}"
    );
    let left: bool = conn.exists(parked).await.expect("EXISTS");
    assert!(!left, "the parked stream is gone");
    let index: HashMap<String, String> = conn.hgetall("{llm}:bparked").await.expect("HGETALL");
    assert!(index.is_empty(), "{index:?}");
    assert_eq!(calls_to(&sim, "m1"), 15, "one call per job");
}

/// A key of the wrong type where a budget parks its jobs (`{llm}:bparked` a string): the
/// park script checks every key before its first write, so the job is neither moved nor
/// lost; it waits in the worker (the log names the key), and is parked once the key is
/// fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_park_key_of_the_wrong_type_keeps_the_job_and_names_the_key() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.extra =
        "[budgets.acme]\nusd_per_day = \"1\"\ntenant = \"acme\"\non_exhausted = \"pause\"\n".into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let budgets = llm_worker::budget::Budgets::new(std::sync::Arc::new(tc.parsed()));
    let (window, limit) = budgets.windows_now("acme", "t=acme")[0].clone();
    let _: () = conn
        .hset_multiple(&window, &[("spent", limit), ("h", 0)])
        .await
        .expect("HSET");
    let _: () = conn.set("{llm}:bparked", "x").await.expect("SET");
    let job = serde_json::json!({"id": "a-0", "tenant": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16});
    push(&mut conn, "llm", &[job.to_string()]).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    let named = wait_log(
        &w,
        "cannot park the job paused by its budget",
        Duration::from_secs(15),
    )
    .await;
    assert!(named, "{}", w.log());
    assert!(w.log().contains("{llm}:bparked"), "{}", w.log());
    let parked = "{llm}:bparked:acme:t=acme";
    assert_eq!(xlen(&mut conn, parked).await, 0);
    assert_eq!(
        xlen(&mut conn, "{llm}:jobs").await,
        1,
        "the job is still there"
    );
    let _: () = conn.del("{llm}:bparked").await.expect("DEL");
    let got = wait_len(&mut conn, parked, 1, Duration::from_secs(15)).await;
    context(got, &[&w]).expect("parked once the key is fixed");
    stop_clean(&mut w, T).await;
    assert_eq!(
        xlen(&mut conn, "{llm}:results").await,
        0,
        "no result: it waits"
    );
}

const ACME: &str =
    "[budgets.acme]\nusd_per_day = \"1\"\ntenant = \"acme\"\non_exhausted = \"pause\"\n";
const ACME_PARKED: &str = "{llm}:bparked:acme:t=acme";

fn acme_job(id: &str, max_tokens: u64, extra: serde_json::Value) -> String {
    let mut j = serde_json::json!({"id": id, "tenant": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens});
    if let serde_json::Value::Object(e) = extra {
        for (k, v) in e {
            j[k] = v;
        }
    }
    j.to_string()
}

/// Redis, the simulated model and a config with acme's pause budget.
async fn acme() -> (RedisServer, SimHandle, TestConfig, tempfile::TempDir) {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.extra = ACME.into();
    (redis, sim, tc, tempfile::tempdir().unwrap())
}

/// acme's window with `left` pico-dollars left (no reservation); its key and limit.
async fn spend_acme(
    tc: &TestConfig,
    conn: &mut redis::aio::MultiplexedConnection,
    left: i64,
) -> (String, i64) {
    let budgets = llm_worker::budget::Budgets::new(std::sync::Arc::new(tc.parsed()));
    let (window, limit) = budgets.windows_now("acme", "t=acme")[0].clone();
    let _: () = conn
        .hset_multiple(&window, &[("spent", limit - left), ("h", 0)])
        .await
        .expect("HSET");
    (window, limit)
}

/// Pushes acme job `id` and waits until `w` has parked it (`parked` jobs parked in all).
async fn push_parked(
    conn: &mut redis::aio::MultiplexedConnection,
    w: &WorkerProc,
    id: &str,
    max_tokens: u64,
    parked: u64,
) {
    push(
        conn,
        "llm",
        &[acme_job(id, max_tokens, serde_json::json!({}))],
    )
    .await;
    let got = wait_len(conn, ACME_PARKED, parked, Duration::from_secs(15)).await;
    context(got, &[w]).expect("parked");
}

/// One acme job parked by worker `w1` of `tc`'s config, which is then stopped.
async fn park_one_acme(
    tc: &TestConfig,
    dir: &std::path::Path,
    conn: &mut redis::aio::MultiplexedConnection,
    max_tokens: u64,
) -> String {
    let cfg = tc.write(dir, "w.toml");
    let (window, _) = spend_acme(tc, conn, 0).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push_parked(conn, &w, "a-0", max_tokens, 1).await;
    stop_clean(&mut w, T).await;
    window
}

/// Review finding (tests first): the sweep ran only while some budget was configured, so
/// removing the last budget left its parked jobs parked for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_jobs_go_back_when_the_last_budget_is_removed() {
    let (redis, _sim, mut tc, dir) = acme().await;
    let mut conn = redis.conn().await;
    park_one_acme(&tc, dir.path(), &mut conn, 16).await;
    tc.extra = String::new();
    let cfg2 = tc.write(dir.path(), "w2.toml");
    let mut w2 = WorkerProc::spawn(&cfg2, "w2", &[]);
    let got = wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await;
    context(got, &[&w2]).expect("moved back and run");
    stop_clean(&mut w2, T).await;
    assert_eq!(xlen(&mut conn, ACME_PARKED).await, 0);
}

/// Review finding (tests first): a budget whose limit was lowered below a parked job's
/// worst case never had room for it again: the job stayed parked forever instead of
/// being decided again (here: it can never fit, so it fails with `budget:`, as the
/// routes' other models are acme's too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_changed_below_a_parked_jobs_worst_case_sends_it_back_to_be_decided() {
    let (redis, sim, mut tc, dir) = acme().await;
    let mut conn = redis.conn().await;
    let window = park_one_acme(&tc, dir.path(), &mut conn, 500).await;
    // A new, empty window (the next day), and a limit below the job's worst case.
    let _: () = conn.del(&window).await.expect("DEL");
    tc.extra = ACME.replace("usd_per_day = \"1\"", "usd_per_day = \"0.00001\"");
    let cfg2 = tc.write(dir.path(), "w2.toml");
    let mut w2 = WorkerProc::spawn(&cfg2, "w2", &[]);
    let got = wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await;
    context(got, &[&w2]).expect("decided again");
    stop_clean(&mut w2, T).await;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results[0].1["status"], "failed", "{results:?}");
    assert!(results[0].1["error"].starts_with("budget: "), "{results:?}");
    assert_eq!(calls_to(&sim, "m1"), 0);
}

/// Review finding (tests first): the index kept the LAST parked job's worst case, so a
/// small job parked before a large one waited while the budget had room for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_parked_job_is_not_held_back_by_a_large_one() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 1;
    tc.extra = ACME.into();
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let (window, limit) = spend_acme(&tc, &mut conn, 0).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push_parked(&mut conn, &w, "small", 16, 1).await;
    push_parked(&mut conn, &w, "large", 800, 2).await;
    // Room for a few small jobs (each below 1e7 pico-dollars), not for the large one.
    let _: () = conn
        .hset(&window, "spent", limit - 50_000_000)
        .await
        .expect("HSET");
    let got = wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await;
    context(got, &[&w]).expect("the small job ran");
    stop_clean(&mut w, T).await;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results[0].1["job_id"], "small", "{results:?}");
}

/// Review finding (tests first): a window with no settled spend yet (a fresh day) whose
/// only reservation was a killed worker's kept its jobs parked after that reservation
/// expired (the stale rule asked for `spent`), until the window ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_reservation_does_not_keep_jobs_parked() {
    let (redis, _sim, tc, dir) = acme().await;
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let budgets = llm_worker::budget::Budgets::new(std::sync::Arc::new(tc.parsed()));
    let (window, limit) = budgets.windows_now("acme", "t=acme")[0].clone();
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let exp = s * 1000 + us / 1000 + 4000;
    // A killed worker's reservation of the whole limit, live for 4 more seconds.
    let _: () = redis::cmd("HSET")
        .arg(&window)
        .arg("r:ghost")
        .arg(format!("{limit}|{exp}|{s}"))
        .arg("h")
        .arg(limit)
        .arg("x")
        .arg(exp)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push_parked(&mut conn, &w, "a-0", 16, 1).await;
    let got = wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await;
    context(got, &[&w]).expect("run once the reservation expired");
    stop_clean(&mut w, T).await;
}

/// Review findings (tests first): a job with a deadline is not parked (a parked job is
/// not watched: it ended only once the budget had room, long past its deadline); it
/// waits in the worker and expires on time. And a job that called a model in this
/// delivery is not parked either (moved back, it started its route again: its calls again
/// and a delivery counted per cycle, until it was dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_a_deadline_or_calls_made_wait_in_the_worker_instead_of_parking() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        rules: vec![always("m1", Fault::ContextLength)],
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.extra = format!(
        "{ACME}[budgets.m2]\nusd_per_day = \"1\"\nmodels = [\"m2\"]\non_exhausted = \"pause\"\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let (acme_window, _) = spend_acme(&tc, &mut conn, 0).await;
    let budgets = llm_worker::budget::Budgets::new(std::sync::Arc::new(tc.parsed()));
    let (m2_window, limit) = budgets.windows_now("m2", "*")[0].clone();
    let _: () = conn
        .hset_multiple(&m2_window, &[("spent", limit), ("h", 0)])
        .await
        .expect("HSET");
    let deadline = llm_worker::cost::unix_now_ms() + 3000;
    push(
        &mut conn,
        "llm",
        &[
            acme_job("a-dl", 16, serde_json::json!({"deadline_ms": deadline})),
            // m1 refuses it (context length): m2, whose budget is spent, is next.
            serde_json::json!({"id": "j", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).to_string(),
        ],
    )
    .await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    let got = wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await;
    context(got, &[&w]).expect("the deadline job ends");
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results[0].1["job_id"], "a-dl", "{results:?}");
    assert_eq!(results[0].1["status"], "expired", "{results:?}");
    let m1 = calls_to(&sim, "m1");
    // The stale rule (room for one) would move a parked job back every 2 s.
    for _ in 0..4 {
        let _: () = conn.hset(&m2_window, "x", 1).await.expect("HSET x");
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    assert_eq!(calls_to(&sim, "m1"), m1, "m1 not called again");
    assert_eq!(xlen(&mut conn, "{llm}:bparked:m2:*").await, 0, "not parked");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 1, "j still waits");
    let _: () = conn.del(&acme_window).await.expect("DEL");
    stop_clean(&mut w, T).await;
}

/// A job of budget block tests.
fn bjob(id: &str, max_tokens: u64) -> String {
    serde_json::json!({"id": id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})
        .to_string()
}

fn picos(d: Decimal) -> i64 {
    llm_worker::cost::to_picos(d).expect("picos")
}

/// Today's window of budget `k`.
fn day_key_k(tc: &TestConfig) -> String {
    let budgets = llm_worker::budget::Budgets::new(std::sync::Arc::new(tc.parsed()));
    budgets.windows_now("k", "*")[0].0.clone()
}

/// Live reservations (expiry after the server's TIME) in a window, pico-dollars.
async fn live(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> (i64, HashMap<String, String>) {
    let (s, us): (u64, u64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    let now = s * 1000 + us / 1000;
    let h: HashMap<String, String> = conn.hgetall(key).await.expect("HGETALL");
    let mut sum = 0i64;
    for (f, v) in &h {
        if f.starts_with("r:") {
            let mut p = v.split('|');
            let a: i64 = p.next().unwrap().parse().unwrap();
            let e: u64 = p.next().unwrap().parse().unwrap();
            if e > now {
                sum += a;
            }
        }
    }
    (sum, h)
}

/// Review finding (tests first): a block's unused room (held in Redis until its running call ends) makes a
/// one-call reservation fail with `budget:` although one call fits what is really left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocks_unused_room_never_fails_a_call_that_fits_alone() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 3000,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 8;
    tc.slots = 8;
    let mut parsed = tc.parsed();
    parsed.models.get_mut("m1").unwrap().input_per_mtok = Decimal::ZERO;
    let w = worst_of(&parsed, &bjob("s-1", 16), "m1");
    let wb = worst_of(&parsed, &bjob("b-1", 64), "m1");
    eprintln!("w {w} wb {wb}");
    let limit = w * Decimal::from(4000);
    tc.extra = format!("[budgets.k]\nusd_per_day = \"{limit}\"\non_exhausted = \"fail\"\n");
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let key = day_key_k(&tc);
    // Left: the big job's worst case plus two small ones (the two that will run).
    let _: () = conn
        .hset(&key, "spent", picos(limit) - picos(wb) - 2 * picos(w))
        .await
        .unwrap();
    push(&mut conn, "llm", &[bjob("s-1", 16), bjob("s-2", 16)]).await;
    let wk = WorkerProc::spawn(
        &cfg,
        "w1",
        &[("LLM_WORKER__MODELS__M1__INPUT_PER_MTOK", "0")],
    );
    assert!(
        in_flight_at_least(&sim, 2, Duration::from_secs(5)).await,
        "{}",
        wk.log()
    );
    let (held, h) = live(&mut conn, &key).await;
    eprintln!(
        "held while s-1, s-2 run: {} worst cases: {h:?}",
        held as f64 / picos(w) as f64
    );
    // Real room for one call: 6w - 2 running = 4w = the big job's worst case.
    push(&mut conn, "llm", &[bjob("b-1", 64)]).await;
    let got = wait_len(&mut conn, "{llm}:results", 3, T).await;
    context(got, &[&wk]).expect("3 results");
    let results = entries(&mut conn, "{llm}:results").await;
    let b = results.iter().find(|(_, r)| r["job_id"] == "b-1").unwrap();
    assert_eq!(b.1["status"], "ok", "one call fits what is left: {:?}", b.1);
}

/// Review finding (tests first): a budget draw held while the rate-limit admission retries (Redis errors) is
/// sent after its block's reservation expired: a call on the wire with no live reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_draw_is_never_sent_after_its_blocks_reservation_expired() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 1000,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 8;
    tc.slots = 8;
    tc.ttl_ms = 1000;
    let mut parsed = tc.parsed();
    parsed.models.get_mut("m1").unwrap().input_per_mtok = Decimal::ZERO;
    let w = worst_of(&parsed, &bjob("w-1", 16), "m1");
    let limit = w * Decimal::from(4000);
    tc.extra = format!("[budgets.k]\nusd_per_day = \"{limit}\"\non_exhausted = \"fail\"\n");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("w.toml");
    std::fs::write(
        &cfg,
        tc.toml()
            .replace("[models.m1]\n", "[models.m1]\nrpm = 600\n"),
    )
    .unwrap();
    let env = [
        ("LLM_WORKER__MODELS__M1__INPUT_PER_MTOK", "0"),
        ("LLM_WORKER__MODELS__M1__RPM", "600"),
        ("LLM_WORKER__PROVIDERS__P1__TIMEOUT_MS", "1500"),
        ("LLM_WORKER__PROVIDERS__P2__TIMEOUT_MS", "1500"),
    ];
    // ttl = 1.5 s + 2 x 1 s + 1 s = 4.5 s
    let mut conn = redis.conn().await;
    let key = day_key_k(&tc);
    let _: () = conn
        .hset(&key, "spent", picos(limit) - 3 * picos(w))
        .await
        .unwrap();
    let wk = WorkerProc::spawn(&cfg, "w1", &env);
    push(&mut conn, "llm", &[bjob("w-1", 16)]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&wk]).expect("w-1");
    // w-2 opens a block of 2 (the size grew) and draws one; one worst case is left in it.
    push(&mut conn, "llm", &[bjob("w-2", 16)]).await;
    assert!(in_flight_at_least(&sim, 1, Duration::from_secs(5)).await);
    let (held, h) = live(&mut conn, &key).await;
    eprintln!(
        "after w-2 started: live {} worst cases {h:?}",
        held as f64 / picos(w) as f64
    );
    let rk: Vec<String> = conn.keys("{llm}:rate:*").await.unwrap();
    eprintln!("rate keys {rk:?}");
    // The model's rate window now errors (any Redis error would do).
    let _: () = conn.set("{llm}:rate:m:m1:rpm:w", "x").await.unwrap();
    push(&mut conn, "llm", &[bjob("j-1", 16)]).await;
    tokio::time::sleep(Duration::from_millis(5500)).await;
    let (held, h) = live(&mut conn, &key).await;
    eprintln!(
        "after 5.5 s: live {} worst cases {h:?}",
        held as f64 / picos(w) as f64
    );
    let _: () = conn.del("{llm}:rate:m:m1:rpm:w").await.unwrap();
    // j-1 goes on the wire.
    let sent = in_flight_at_least(&sim, 1, Duration::from_secs(12)).await;
    assert!(sent, "{}", wk.log());
    eprintln!("{}", wk.log());
    let (held_j, h) = live(&mut conn, &key).await;
    eprintln!(
        "j-1 on the wire: live {} worst cases {h:?}",
        held_j as f64 / picos(w) as f64
    );
    // Others reserve what is left now, while j-1 runs.
    push(&mut conn, "llm", &[bjob("k-1", 16), bjob("k-2", 16)]).await;
    context(wait_len(&mut conn, "{llm}:results", 5, T).await, &[&wk]).expect("results");
    let mut wk = wk;
    stop_clean(&mut wk, T).await;
    let results = entries(&mut conn, "{llm}:results").await;
    for (_, r) in &results {
        eprintln!(
            "{} {} {}",
            r["job_id"],
            r["status"],
            r.get("cost_usd").cloned().unwrap_or_default()
        );
    }
    let h: HashMap<String, String> = conn.hgetall(&key).await.unwrap();
    let spent = llm_worker::cost::from_picos(h["spent"].parse().unwrap());
    eprintln!(
        "spent {spent} limit {limit} over by {} worst cases",
        (spent - limit) / w
    );
    assert!(
        held_j >= picos(w),
        "a call on the wire holds no live reservation"
    );
    assert!(spent <= limit, "spent {spent} > limit {limit}");
}

/// Review finding (tests first): the 2 s gate between moves trusted any future value, so
/// a clock that went back (or a bad value) kept parked jobs parked for that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_far_in_the_future_does_not_keep_jobs_parked() {
    let (redis, _sim, tc, dir) = acme().await;
    let mut conn = redis.conn().await;
    let window = park_one_acme(&tc, dir.path(), &mut conn, 16).await;
    let v: String = conn.hget("{llm}:bparked", ACME_PARKED).await.expect("HGET");
    let mut parts = v.splitn(3, '|');
    let (need, _, json) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let (s, _): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let far = s * 1000 + 3_600_000;
    let _: () = conn
        .hset("{llm}:bparked", ACME_PARKED, format!("{need}|{far}|{json}"))
        .await
        .expect("HSET");
    let _: () = conn.hset(&window, "spent", 0).await.expect("HSET");
    let cfg = tc.write(dir.path(), "w2.toml");
    let mut w2 = WorkerProc::spawn(&cfg, "w2", &[]);
    let got = wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(10)).await;
    context(got, &[&w2]).expect("moved back");
    stop_clean(&mut w2, T).await;
}
