//! The pipeline end to end, on the real binary, a real redis-server and the simulated
//! provider over real HTTP.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use rust_decimal::Decimal;
use std::str::FromStr;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_jobs_all_ok_and_cost_matches_billed_tokens_exactly() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 5,
        jitter_ms: 5,
        cached_fraction: 0.3,
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg_path = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let payloads: Vec<String> = (0..300)
        .map(|i| {
            job(
                &format!("job-{i}"),
                &format!("question number {i} {}", "x".repeat(i % 37)),
            )
        })
        .collect();
    push(&mut conn, "llm", &payloads).await;
    let mut w = WorkerProc::spawn(&cfg_path, "w1", &[]);
    context(
        wait_len(&mut conn, "{llm}:results", 300, Duration::from_secs(60)).await,
        &[&w],
    )?;

    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 300);
    let mut sum = Decimal::ZERO;
    for (_, r) in &results {
        assert_eq!(r["status"], "ok", "{r:?}");
        assert_eq!(r["model"], "m1");
        assert_eq!(r["attempts"], "1");
        assert_eq!(r["tried"], "m1");
        assert_eq!(r["worker"], "w1");
        assert!(!r["content"].is_empty());
        sum += Decimal::from_str(&r["cost_usd"])?;
    }
    let ids: std::collections::HashSet<_> =
        results.iter().map(|(_, r)| r["job_id"].clone()).collect();
    assert_eq!(ids.len(), 300, "every job exactly once");

    let stats = sim.sim.stats();
    let b = &stats.billed["m1"];
    // m1 at 0.14 / 0.028 (cached) / 0.42 USD per Mtok, priced by hand.
    let expected = usd_m1(
        b.prompt_tokens - b.cached_tokens,
        b.cached_tokens,
        b.completion_tokens,
    );
    assert!(b.cached_tokens > 0, "cached pricing is exercised");
    assert_eq!(
        sum, expected,
        "sum of cost_usd equals billed tokens x prices"
    );
    // The Redis running totals agree, in integer pico-dollars.
    let picos: i64 = redis::AsyncCommands::hget(&mut conn, "{llm}:cost", "m1:cost_picos").await?;
    assert_eq!(Decimal::new(picos, 12), expected);
    // Acknowledged and removed: nothing pending, nothing left in the jobs stream.
    assert_eq!(
        pending_count(&mut conn, "{llm}:jobs", "workers").await,
        0,
        "nothing pending"
    );
    assert_eq!(xlen(&mut conn, "{llm}:jobs").await, 0);
    // At most 4 calls at once, and no slot left behind.
    assert!(
        stats.max_in_flight <= 4,
        "max in flight {}",
        stats.max_in_flight
    );
    stop_clean(&mut w, Duration::from_secs(10)).await;
    assert!(slot_keys(&mut conn, "llm").await.is_empty());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Routing, retries, invalid jobs, metadata and slots: one worker, one job set per test.

use llm_worker::sim::{Fault, Rule, SimStats};
use std::collections::HashMap;

/// A redis-server, the simulated provider, a written test config and (once spawned) one
/// worker process.
struct Bench {
    redis: RedisServer,
    sim: SimHandle,
    _dir: tempfile::TempDir,
    cfg_path: std::path::PathBuf,
    conn: redis::aio::MultiplexedConnection,
    worker: Option<WorkerProc>,
}

impl Bench {
    async fn new(opts: SimOptions) -> Bench {
        let redis = RedisServer::start();
        let sim = SimHandle::start(opts).await;
        let tc = TestConfig::new(&redis, &sim);
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg_path = tc.write(dir.path(), "w.toml");
        let conn = redis.conn().await;
        Bench {
            redis,
            sim,
            _dir: dir,
            cfg_path,
            conn,
            worker: None,
        }
    }

    fn spawn_worker(&mut self) {
        self.worker = Some(WorkerProc::spawn(&self.cfg_path, "w1", &[]));
    }

    async fn push(&mut self, payloads: &[String]) -> Vec<String> {
        push(&mut self.conn, "llm", payloads).await
    }

    /// Waits for `n` results in total; returns them keyed by `job_entry`.
    async fn results(&mut self, n: u64) -> HashMap<String, HashMap<String, String>> {
        let workers: Vec<&WorkerProc> = self.worker.iter().collect();
        let waited = wait_len(&mut self.conn, "{llm}:results", n, Duration::from_secs(30)).await;
        if let Err(e) = context(waited, &workers) {
            panic!("{e:#}");
        }
        let all = entries(&mut self.conn, "{llm}:results").await;
        assert_eq!(all.len() as u64, n, "exactly one result per job: {all:?}");
        all.into_iter()
            .map(|(_, r)| (r["job_entry"].clone(), r))
            .collect()
    }

    fn stats(&self) -> SimStats {
        self.sim.sim.stats()
    }

    fn log(&self) -> String {
        self.worker.as_ref().map(|w| w.log()).unwrap_or_default()
    }

    /// SIGTERM; the worker exits 0, nothing is left pending and no slot key remains.
    async fn shutdown(mut self) {
        let mut w = self.worker.take().expect("a worker was spawned");
        stop_clean(&mut w, Duration::from_secs(10)).await;
        assert_eq!(
            pending_count(&mut self.conn, "{llm}:jobs", "workers").await,
            0,
            "nothing left pending"
        );
        assert_eq!(slot_keys(&mut self.conn, "llm").await, Vec::<String>::new());
        drop(self.redis);
    }
}

/// Calls the sim answered for `model` with `status`.
fn calls(stats: &SimStats, model: &str, status: u16) -> u64 {
    stats
        .requests
        .get(model)
        .and_then(|m| m.get(&status))
        .copied()
        .unwrap_or(0)
}

fn total_calls(stats: &SimStats, model: &str) -> u64 {
    stats
        .requests
        .get(model)
        .map(|m| m.values().sum())
        .unwrap_or(0)
}

/// USD for m1 tokens, priced by hand from the test config (0.14 USD/Mtok input, 0.028
/// cached input, 0.42 output = 140 / 28 / 420 nano-USD per token); not the crate's
/// `cost::cost`, so a pricing bug there cannot cancel out.
fn usd_m1(uncached_in: u64, cached_in: u64, out: u64) -> Decimal {
    Decimal::new((140 * uncached_in + 28 * cached_in + 420 * out) as i64, 9)
}

/// USD for m2 tokens, by hand (0.10 USD/Mtok input, 2.50 output = 100 / 2,500 nano-USD
/// per token; no cached price, so cached tokens cost the input price).
fn usd_m2(input: u64, out: u64) -> Decimal {
    Decimal::new((100 * input + 2500 * out) as i64, 9)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_when_first_model_always_503_results_come_from_second() {
    let mut b = Bench::new(SimOptions {
        rules: vec![always("m1", Fault::Status { status: 503 })],
        ..SimOptions::default()
    })
    .await;
    let payloads: Vec<String> = (0..3)
        .map(|i| job(&format!("fb-{i}"), &format!("fallback {i}")))
        .collect();
    b.push(&payloads).await;
    b.spawn_worker();
    let results = b.results(3).await;
    let mut sum = Decimal::ZERO;
    for r in results.values() {
        assert_eq!(r["status"], "ok", "{r:?}");
        assert_eq!(r["model"], "m2", "{r:?}");
        assert_eq!(r["tried"], "m1,m2", "{r:?}");
        // retry.max_attempts_per_model = 3 on m1, then one successful call on m2.
        assert_eq!(r["attempts"], "4", "{r:?}");
        assert!(r["content"].contains("[sim m2]"), "{r:?}");
        assert!(!r.contains_key("error"), "{r:?}");
        sum += Decimal::from_str(&r["cost_usd"]).unwrap();
    }
    let st = b.stats();
    assert_eq!(calls(&st, "m1", 503), 9, "{:?}", st.requests);
    assert_eq!(total_calls(&st, "m1"), 9, "{:?}", st.requests);
    assert_eq!(calls(&st, "m2", 200), 3, "{:?}", st.requests);
    for i in 0..3 {
        assert_eq!(st.calls_per_job[&format!("fb-{i}")], 4, "{st:?}");
    }
    // The 503s reported no usage: only m2's answers are billed.
    let billed = &st.billed["m2"];
    assert_eq!(sum, usd_m2(billed.prompt_tokens, billed.completion_tokens));
    assert!(sum > Decimal::ZERO);
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_with_retry_after_1s_waits_then_succeeds_on_same_model() {
    let mut b = Bench::new(SimOptions {
        rules: vec![Rule {
            model: "m1".into(),
            fault: Fault::RateLimit {
                retry_after: Some("1".into()),
                retry_after_ms: None,
            },
            probability: 1.0,
            first_n: Some(1),
        }],
        ..SimOptions::default()
    })
    .await;
    let entry = b.push(&[job("rl-1", "rate limited once")]).await;
    b.spawn_worker();
    let results = b.results(1).await;
    let r = &results[&entry[0]];
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m1", "{r:?}");
    assert_eq!(r["tried"], "m1", "{r:?}");
    assert_eq!(r["attempts"], "2", "{r:?}");
    let latency: u64 = r["latency_ms"].parse().unwrap();
    assert!(
        latency >= 1000,
        "Retry-After: 1 honoured, latency {latency} ms"
    );
    let st = b.stats();
    assert_eq!(calls(&st, "m1", 429), 1, "{:?}", st.requests);
    assert_eq!(calls(&st, "m1", 200), 1, "{:?}", st.requests);
    assert_eq!(total_calls(&st, "m2"), 0, "{:?}", st.requests);
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_with_retry_after_above_cap_moves_to_next_model_at_once() {
    // max_retry_after_ms = 2000 in the test config; 30 s is above it.
    let mut b = Bench::new(SimOptions {
        rules: vec![always(
            "m1",
            Fault::RateLimit {
                retry_after: Some("30".into()),
                retry_after_ms: None,
            },
        )],
        ..SimOptions::default()
    })
    .await;
    let entry = b.push(&[job("rl-cap", "rate limited for long")]).await;
    b.spawn_worker();
    let results = b.results(1).await;
    let r = &results[&entry[0]];
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m2", "{r:?}");
    assert_eq!(r["tried"], "m1,m2", "{r:?}");
    assert_eq!(r["attempts"], "2", "{r:?}");
    let latency: u64 = r["latency_ms"].parse().unwrap();
    assert!(latency < 1500, "no wait on m1, latency {latency} ms");
    let st = b.stats();
    assert_eq!(calls(&st, "m1", 429), 1, "{:?}", st.requests);
    assert_eq!(total_calls(&st, "m1"), 1, "{:?}", st.requests);
    assert_eq!(calls(&st, "m2", 200), 1, "{:?}", st.requests);
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_model_is_skipped_and_its_provider_stays_usable() {
    // m1 and m2 are on provider p1, m3 on p2. A 401 for one model (an aggregator refusing
    // that model to this key) skips the model, not the provider: m2 answers.
    let mut b = Bench::new(SimOptions {
        rules: vec![always("m1", Fault::Status { status: 401 })],
        ..SimOptions::default()
    })
    .await;
    let entry = b.push(&[job("auth-1", "who am i")]).await;
    b.spawn_worker();
    let results = b.results(1).await;
    let r = &results[&entry[0]];
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m2", "{r:?}");
    assert_eq!(r["tried"], "m1,m2", "{r:?}");
    assert_eq!(r["attempts"], "2", "{r:?}");
    let st = b.stats();
    assert_eq!(
        calls(&st, "m1", 401),
        1,
        "no retry of m1: {:?}",
        st.requests
    );
    assert_eq!(total_calls(&st, "m1"), 1, "{:?}", st.requests);
    assert_eq!(calls(&st, "m2", 200), 1, "{:?}", st.requests);
    assert_eq!(total_calls(&st, "m3"), 0, "{:?}", st.requests);
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_400_fails_the_job_after_exactly_one_attempt() {
    let mut b = Bench::new(SimOptions {
        rules: vec![always("m1", Fault::Status { status: 400 })],
        ..SimOptions::default()
    })
    .await;
    let entries_ = b
        .push(&[
            job("bad-req-1", "rejected"),
            job("bad-req-2", "rejected too"),
        ])
        .await;
    b.spawn_worker();
    let results = b.results(2).await;
    for e in &entries_ {
        let r = &results[e];
        assert_eq!(r["status"], "failed", "{r:?}");
        assert_eq!(r["attempts"], "1", "{r:?}");
        assert_eq!(r["tried"], "m1", "{r:?}");
        assert_eq!(r["cost_usd"], "0", "{r:?}");
        assert_eq!(r["input_tokens"], "0", "{r:?}");
        assert_eq!(r["output_tokens"], "0", "{r:?}");
        assert!(!r.contains_key("model"), "{r:?}");
        let err = &r["error"];
        assert!(!err.trim().is_empty(), "{r:?}");
        assert!(!err.contains('\n'), "one line: {err:?}");
    }
    let st = b.stats();
    assert_eq!(calls(&st, "m1", 400), 2, "{:?}", st.requests);
    assert_eq!(total_calls(&st, "m2") + total_calls(&st, "m3"), 0);
    // A failed job is not a dead letter.
    assert_eq!(xlen(&mut b.conn, "{llm}:dead").await, 0);
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length_exceeded_moves_to_a_model_with_a_larger_window() {
    // Config windows: m1 1000, m2 100000, m3 1000000. The sim is stricter for m1 and m2.
    let mut b = Bench::new(SimOptions {
        context_windows: HashMap::from([("m1".to_string(), 50), ("m2".to_string(), 50)]),
        ..SimOptions::default()
    })
    .await;
    let long = "y".repeat(400); // 104 prompt tokens > 50
    let payloads = vec![
        job("ctx-route", &long),
        serde_json::json!({"id": "ctx-m2", "model": "m2",
            "messages": [{"role": "user", "content": long}]})
        .to_string(),
        job("ctx-short", "short"),
    ];
    let e = b.push(&payloads).await;
    b.spawn_worker();
    let results = b.results(3).await;
    let (a, m2first, short) = (&results[&e[0]], &results[&e[1]], &results[&e[2]]);
    assert_eq!(a["status"], "ok", "{a:?}");
    assert_eq!(a["tried"], "m1,m2,m3", "{a:?}");
    assert_eq!(a["attempts"], "3", "no retry of the same model: {a:?}");
    assert_eq!(a["model"], "m3", "{a:?}");
    // m2 (100000) failed, so m1 (1000) is skipped: only a larger window can help.
    assert_eq!(m2first["status"], "ok", "{m2first:?}");
    assert_eq!(m2first["tried"], "m2,m3", "{m2first:?}");
    assert_eq!(m2first["attempts"], "2", "{m2first:?}");
    assert_eq!(m2first["model"], "m3", "{m2first:?}");
    assert_eq!(short["model"], "m1", "{short:?}");
    assert_eq!(short["attempts"], "1", "{short:?}");
    let st = b.stats();
    assert_eq!(st.calls_per_job["ctx-route"], 3, "{st:?}");
    assert_eq!(st.calls_per_job["ctx-m2"], 2, "{st:?}");
    assert_eq!(calls(&st, "m1", 400), 1, "{:?}", st.requests);
    assert_eq!(calls(&st, "m2", 400), 2, "{:?}", st.requests);
    assert_eq!(calls(&st, "m3", 200), 2, "{:?}", st.requests);
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_payloads_are_dead_lettered_verbatim_and_later_good_jobs_succeed() {
    let mut b = Bench::new(SimOptions::default()).await;
    b.spawn_worker();
    // (fields of the entry, what the error must name)
    type Fields = Vec<(&'static str, Vec<u8>)>;
    let cases: Vec<(Fields, &str)> = vec![
        (vec![("payload", b"{not json".to_vec())], "not JSON"),
        (vec![("payload", b"[1,2]".to_vec())], "JSON object"),
        (
            vec![("payload", br#"{"model":"m1"}"#.to_vec())],
            "`messages` is missing",
        ),
        (
            vec![("payload", br#"{"messages":[]}"#.to_vec())],
            "`messages` must be a non-empty array",
        ),
        (
            vec![("payload", br#"{"messages":"hello"}"#.to_vec())],
            "`messages` must be an array",
        ),
        (
            vec![("payload", br#"{"messages":[{"content":"hi"}]}"#.to_vec())],
            "messages[0].role",
        ),
        (
            vec![(
                "payload",
                br#"{"messages":[{"role":"user","content":"hi"}],"model":5}"#.to_vec(),
            )],
            "`model` must be a string",
        ),
        (
            vec![(
                "payload",
                br#"{"messages":[{"role":"user","content":"hi"}],"model":"ghost"}"#.to_vec(),
            )],
            "unknown model `ghost`",
        ),
        (
            vec![("payload", b"{\"messages\":\"\xff\xfe\"}".to_vec())],
            "UTF-8",
        ),
        (vec![("data", b"no payload here".to_vec())], "`payload`"),
    ];
    let mut ids = vec![];
    for (fields, _) in &cases {
        let f: Vec<(&str, &[u8])> = fields.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        ids.push(push_fields(&mut b.conn, "llm", &f).await);
    }
    let n_bad = cases.len() as u64;
    let results = b.results(n_bad).await;
    let dead: HashMap<String, HashMap<String, Vec<u8>>> = entries_raw(&mut b.conn, "{llm}:dead")
        .await
        .into_iter()
        .map(|(_, d)| (String::from_utf8_lossy(&d["job_entry"]).into_owned(), d))
        .collect();
    assert_eq!(dead.len() as u64, n_bad, "one dead letter per bad job");
    for ((fields, needle), id) in cases.iter().zip(&ids) {
        let r = &results[id];
        assert_eq!(r["status"], "invalid", "{r:?}");
        assert_eq!(r["job_id"], *id, "no id: the entry id: {r:?}");
        assert_eq!(r["attempts"], "0", "{r:?}");
        assert_eq!(r["cost_usd"], "0", "{r:?}");
        assert!(
            r["error"].contains(needle),
            "error {:?} should name {needle:?}",
            r["error"]
        );
        let d = &dead[id];
        let original = fields
            .iter()
            .find(|(k, _)| *k == "payload")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        assert_eq!(
            d.get("payload").cloned().unwrap_or_default(),
            original,
            "dead letter keeps the payload byte for byte ({needle})"
        );
        assert_eq!(String::from_utf8_lossy(&d["reason"]), r["error"]);
        assert_eq!(String::from_utf8_lossy(&d["deliveries"]), "1");
    }
    assert_eq!(b.stats().requests, Default::default(), "no provider call");

    // The worker is still taking jobs.
    let good: Vec<String> = (0..3)
        .map(|i| job(&format!("after-{i}"), &format!("good job {i}")))
        .collect();
    let good_ids = b.push(&good).await;
    let results = b.results(n_bad + 3).await;
    for id in &good_ids {
        let r = &results[id];
        assert_eq!(r["status"], "ok", "{r:?}\n{}", b.log());
        assert_eq!(r["model"], "m1");
    }
    assert_eq!(xlen(&mut b.conn, "{llm}:dead").await, n_bad);
    b.shutdown().await;
}

/// The fields of a job entry with a field name that is not UTF-8, a repeated name, and a
/// good payload of id `id`: the entry is bad input whatever its payload says.
fn bad_name_entry(id: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
    vec![
        (b"\xffx".to_vec(), b"v\xfe".to_vec()),
        (b"payload".to_vec(), job(id, "never run").into_bytes()),
        (b"note".to_vec(), b"first".to_vec()),
        (b"note".to_vec(), b"second".to_vec()),
    ]
}

/// Redis, the sim and a config `w.toml` (concurrency 8) in the returned directory.
async fn bad_name_bench() -> (RedisServer, SimHandle, tempfile::TempDir) {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 8;
    let dir = tempfile::tempdir().expect("tempdir");
    tc.write(dir.path(), "w.toml");
    (redis, sim, dir)
}

async fn push_bad_name(
    conn: &mut redis::aio::MultiplexedConnection,
    original: &[(Vec<u8>, Vec<u8>)],
) -> String {
    let f: Vec<(&[u8], &[u8])> = original.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    push_raw(conn, "llm", &f).await
}

/// Waits for the results of `good` and `bad_entry`, checks them (see
/// [`assert_bad_name_dead_lettered`]) and that no model was called for the bad one.
async fn finish_bad_name(
    conn: &mut redis::aio::MultiplexedConnection,
    mut w: WorkerProc,
    sim: &SimHandle,
    bad_entry: &str,
    original: &[(Vec<u8>, Vec<u8>)],
    good: &[String],
    deliveries: &str,
) {
    let n = good.len() as u64 + 1;
    let waited = wait_len(conn, "{llm}:results", n, Duration::from_secs(20)).await;
    if let Err(e) = context(waited, &[&w]) {
        panic!("{e:#}");
    }
    assert_bad_name_dead_lettered(conn, &w, bad_entry, original, good, deliveries).await;
    assert_eq!(sim.sim.stats().calls_per_job.get("bad-name"), None);
    stop_clean(&mut w, Duration::from_secs(10)).await;
}

/// Checks the one `invalid` result of `bad_entry` and its dead letter (every field of the
/// original, byte for byte and in order), the `ok` results of `good`, and that the worker
/// never took the entry for a Redis outage.
async fn assert_bad_name_dead_lettered(
    conn: &mut redis::aio::MultiplexedConnection,
    w: &WorkerProc,
    bad_entry: &str,
    original: &[(Vec<u8>, Vec<u8>)],
    good: &[String],
    deliveries: &str,
) {
    let results = entries(conn, "{llm}:results").await;
    assert_eq!(results.len(), good.len() + 1, "{results:?}\n{}", w.log());
    let by_entry: HashMap<_, _> = results
        .iter()
        .map(|(_, r)| (r["job_entry"].clone(), r))
        .collect();
    for id in good {
        assert_eq!(by_entry[id]["status"], "ok", "{:?}", by_entry[id]);
    }
    let r = by_entry[bad_entry];
    assert_eq!(r["status"], "invalid", "{r:?}");
    assert_eq!(r["job_id"], "bad-name", "the producer's id is kept: {r:?}");
    assert!(r["error"].contains("not UTF-8"), "{r:?}");
    assert!(r["error"].contains("\\xffx"), "names the field: {r:?}");
    let dead = entries_bytes(conn, "{llm}:dead").await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0].1;
    let field = |k: &[u8]| d.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(field(b"job_entry"), Some(bad_entry.as_bytes().to_vec()));
    assert_eq!(field(b"reason"), Some(r["error"].clone().into_bytes()));
    assert_eq!(field(b"deliveries"), Some(deliveries.as_bytes().to_vec()));
    assert_eq!(
        &d[d.len() - original.len()..],
        original,
        "the dead letter keeps every field, names included, byte for byte and in order"
    );
    let log = w.log();
    assert!(!log.contains("Redis unreachable"), "{log}");
    assert_eq!(pending_count(conn, "{llm}:jobs", "workers").await, 0);
}

/// One entry whose field name is not UTF-8 used to fail the whole XREADGROUP reply (the
/// typed reply keys fields by `String`): the worker took it for an outage and the batch
/// stayed pending with no task. Now that entry alone is dead-lettered, verbatim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_with_a_non_utf8_field_name_is_dead_lettered_and_its_batch_runs() {
    let (redis, sim, dir) = bad_name_bench().await;
    let mut conn = redis.conn().await;
    let original = bad_name_entry("bad-name");
    let bad = push_bad_name(&mut conn, &original).await;
    let good = push(&mut conn, "llm", &jobs("fine", 5)).await;
    let w = WorkerProc::spawn(&dir.path().join("w.toml"), "w1", &[]);
    finish_bad_name(&mut conn, w, &sim, &bad, &original, &good, "1").await;
}

/// The same entry pending under a dead consumer: XAUTOCLAIM's reply failed the same way,
/// so every later reclaim failed and no entry of any dead worker was taken over again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_entry_with_a_non_utf8_field_name_is_reclaimed_and_dead_lettered() {
    let (redis, sim, dir) = bad_name_bench().await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let good_before = push(&mut conn, "llm", &jobs("before", 2)).await;
    let original = bad_name_entry("bad-name");
    let bad = push_bad_name(&mut conn, &original).await;
    let good_after = push(&mut conn, "llm", &jobs("after", 2)).await;
    // A consumer that died holding all five.
    read_as(&mut conn, "ghost").await;
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 5);
    let w = WorkerProc::spawn(
        &dir.path().join("w.toml"),
        "w1",
        &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "200")],
    );
    let good: Vec<String> = good_before.into_iter().chain(good_after).collect();
    finish_bad_name(&mut conn, w, &sim, &bad, &original, &good, "2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_is_copied_job_id_defaults_to_the_entry_id_and_only_a_producer_id_leaves_a_marker()
{
    let mut b = Bench::new(SimOptions::default()).await;
    let meta =
        serde_json::json!({"user": "u-17", "tags": ["a", "b"], "n": 3, "nested": {"x": null}});
    let payloads = vec![
        serde_json::json!({"id": "meta-1", "metadata": meta,
            "messages": [{"role": "user", "content": "with metadata"}]})
        .to_string(),
        serde_json::json!({"metadata": "just a string",
            "messages": [{"role": "user", "content": "no id"}]})
        .to_string(),
        serde_json::json!({"messages": [{"role": "user", "content": "nothing extra"}]}).to_string(),
    ];
    let e = b.push(&payloads).await;
    b.spawn_worker();
    let results = b.results(3).await;
    let (r1, r2, r3) = (&results[&e[0]], &results[&e[1]], &results[&e[2]]);
    for r in [r1, r2, r3] {
        assert_eq!(r["status"], "ok", "{r:?}");
    }
    assert_eq!(r1["job_id"], "meta-1");
    let m1: serde_json::Value = serde_json::from_str(&r1["metadata"]).unwrap();
    assert_eq!(m1, meta);
    assert_eq!(r2["job_id"], e[1], "job id defaults to the entry id");
    let m2: serde_json::Value = serde_json::from_str(&r2["metadata"]).unwrap();
    assert_eq!(m2, serde_json::json!("just a string"));
    assert_eq!(r3["job_id"], e[2]);
    assert!(!r3.contains_key("metadata"), "{r3:?}");
    // Issue 9: a producer's id leaves its result marker; a job without one leaves no
    // marker at all (no key per finished job).
    let markers: Vec<String> = redis::cmd("KEYS")
        .arg("{llm}:*done:*")
        .query_async(&mut b.conn)
        .await
        .expect("KEYS");
    assert_eq!(markers, vec!["{llm}:done:meta-1".to_string()]);
    let inflight: Vec<String> = redis::cmd("KEYS")
        .arg("{llm}:inflight:*")
        .query_async(&mut b.conn)
        .await
        .expect("KEYS");
    assert!(inflight.is_empty(), "{inflight:?}");
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_is_held_during_every_call_and_none_is_left_after_the_run() {
    const SLOTS: usize = 4; // TestConfig default
    let latency = Duration::from_millis(300);
    let mut b = Bench::new(SimOptions {
        latency_ms: latency.as_millis() as u64,
        ..SimOptions::default()
    })
    .await;
    let payloads: Vec<String> = (0..6)
        .map(|i| job(&format!("slot-{i}"), &format!("slot job {i}")))
        .collect();
    b.push(&payloads).await;
    b.spawn_worker();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let (mut checked, mut max_keys) = (0u32, 0usize);
    loop {
        // keys, then the sim's in-flight count, then keys again: a call in flight at the
        // middle sample lasts `latency`, and its slot is held from before it started
        // until after it ended, so one of the two key samples must see it when both are
        // less than `latency` apart.
        let t0 = tokio::time::Instant::now();
        let before = slot_keys(&mut b.conn, "llm").await;
        let in_flight = b.stats().in_flight;
        let after = slot_keys(&mut b.conn, "llm").await;
        let span = t0.elapsed();
        for keys in [&before, &after] {
            assert!(keys.len() <= SLOTS, "more slots held than exist: {keys:?}");
            max_keys = max_keys.max(keys.len());
            for k in keys.iter() {
                let i: usize = k
                    .strip_prefix("{llm}:slot:default:")
                    .and_then(|i| i.parse().ok())
                    .unwrap_or_else(|| panic!("unexpected slot key {k}"));
                assert!(i < SLOTS, "slot index out of range: {k}");
            }
        }
        if in_flight > 0 && span < latency - Duration::from_millis(50) {
            checked += 1;
            assert!(
                !before.is_empty() || !after.is_empty(),
                "{in_flight} calls in flight but no slot held"
            );
        }
        if xlen(&mut b.conn, "{llm}:results").await >= 6 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "6 results within 30 s\n{}",
            b.log()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        checked > 0,
        "sampled at least once while a call was in flight"
    );
    assert!(max_keys >= 1);
    let results = b.results(6).await;
    assert!(results.values().all(|r| r["status"] == "ok"), "{results:?}");
    let st = b.stats();
    assert!(
        st.max_in_flight as usize <= SLOTS,
        "max in flight {}",
        st.max_in_flight
    );
    assert!(
        st.max_in_flight >= 2,
        "calls ran concurrently: {}",
        st.max_in_flight
    );
    // Released after each call, not only at shutdown.
    let conn = &mut b.conn;
    assert!(
        wait_for(Duration::from_secs(2), || {
            let mut c = conn.clone();
            async move { slot_keys(&mut c, "llm").await.is_empty() }
        })
        .await,
        "slots released once the calls ended"
    );
    b.shutdown().await;
}

/// `requests_per_second` is a local limit per provider (governor): 20 calls at 5/s take
/// at least (20 - 5 burst) / 5 = 3 s, however many slots and job tasks are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_requests_per_second_limit_holds() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg_path = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &jobs("rps", 20)).await;
    let started = tokio::time::Instant::now();
    let mut w = WorkerProc::spawn(
        &cfg_path,
        "w1",
        &[("LLM_WORKER__PROVIDERS__P1__REQUESTS_PER_SECOND", "5")],
    );
    context(
        wait_len(&mut conn, "{llm}:results", 20, Duration::from_secs(30)).await,
        &[&w],
    )?;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(2800),
        "20 calls at 5/s took only {took:?}"
    );
    let results = entries(&mut conn, "{llm}:results").await;
    assert!(
        results
            .iter()
            .all(|(_, r)| r["status"] == "ok" && r["attempts"] == "1")
    );
    stop_clean(&mut w, Duration::from_secs(10)).await;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The harness itself: tests are only as good as the helpers they assert with.

/// Test Redis listens on a unix socket in the test's own temp dir (mode 0700), so no port
/// race can connect a test to another test's server; the worker takes the `unix://` URL
/// end to end (one job through the real binary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_redis_is_on_a_private_unix_socket_and_the_worker_uses_it() -> anyhow::Result<()> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let redis = RedisServer::start();
    let url = redis.url();
    let sock = redis.dir.path().join("redis.sock");
    assert_eq!(
        url,
        format!("unix://{}", sock.display()),
        "test Redis must be on a unix socket in its temp dir"
    );
    let meta = std::fs::metadata(&sock)?;
    assert!(meta.file_type().is_socket(), "{sock:?} is not a socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o700, "socket mode");

    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job("unix-1", "hi")]).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    ok_results_once(&mut conn).await;
    stop_clean(&mut w, Duration::from_secs(10)).await;
    assert!(slot_keys(&mut conn, "llm").await.is_empty());
    Ok(())
}

/// The TCP variant keeps a port for the tests that need one.
#[tokio::test]
async fn harness_tcp_redis_has_a_port() {
    let redis = RedisServer::start_tcp();
    assert_eq!(redis.url(), format!("redis://127.0.0.1:{}", redis.port()));
    let mut conn = redis.conn().await;
    assert_eq!(xlen(&mut conn, "{llm}:jobs").await, 0);
}

/// "No slot key left" and "stream empty" must not pass because Redis is gone: the helpers
/// panic on a Redis error instead of answering empty / 0.
#[tokio::test]
async fn harness_helpers_fail_loudly_when_redis_is_down() {
    let mut redis = RedisServer::start();
    let conn = redis.conn().await;
    redis.kill();
    let mut c = conn.clone();
    let keys = tokio::spawn(async move { slot_keys(&mut c, "llm").await });
    let r = tokio::time::timeout(Duration::from_secs(10), keys)
        .await
        .expect("slot_keys returned within 10 s");
    assert!(
        r.as_ref().is_err_and(|e| e.is_panic()),
        "slot_keys on a dead Redis answered {r:?} instead of failing"
    );
    let mut c = conn.clone();
    let len = tokio::spawn(async move { xlen(&mut c, "{llm}:results").await });
    let r = tokio::time::timeout(Duration::from_secs(10), len)
        .await
        .expect("xlen returned within 10 s");
    assert!(
        r.as_ref().is_err_and(|e| e.is_panic()),
        "xlen on a dead Redis answered {r:?} instead of failing"
    );
}

/// One job whose cost is known in advance, as a literal: 3,184 characters are
/// 4 + 3184 / 4 = 800 prompt tokens (the sim's rule; within m1's 1,000-token window),
/// `max_tokens: 1` caps the completion at 1 token; m1 costs 800 x 0.14 / 1e6 = 0.000112
/// plus 1 x 0.42 / 1e6 = 0.00000042, together 0.00011242 USD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_job_costs_a_hand_computed_literal() {
    let mut b = Bench::new(SimOptions::default()).await;
    let payload = serde_json::json!({
        "id": "priced",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x".repeat(3184)}],
    })
    .to_string();
    b.push(&[payload]).await;
    b.spawn_worker();
    let results = b.results(1).await;
    let r = results.values().next().expect("one result");
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m1", "{r:?}");
    assert_eq!(r["input_tokens"], "800", "{r:?}");
    assert_eq!(r["output_tokens"], "1", "{r:?}");
    assert_eq!(
        Decimal::from_str(&r["cost_usd"]).unwrap(),
        Decimal::from_str("0.00011242").unwrap(),
        "{r:?}"
    );
    b.shutdown().await;
}

/// Issue 9 review: CLIENT ID / CLIENT UNBLOCK (the fast exit at a signal) are best
/// effort. A least-privilege Redis user without them still reads and answers jobs, and
/// still exits cleanly at SIGTERM (waiting out its blocking read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_without_client_commands_still_processes_jobs() -> anyhow::Result<()> {
    let redis = RedisServer::start_tcp();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "w",
            "on",
            ">pw",
            "~*",
            "&*",
            "+@all",
            "-client|id",
            "-client|unblock",
        ])
        .query_async(&mut conn)
        .await?;
    let url = format!("redis://w:pw@127.0.0.1:{}", redis.port());
    let tc = TestConfig::with_urls(&url, sim.addr);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "w.toml");
    push(&mut conn, "llm", &[job("acl-1", "hi")]).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results[0].1["status"], "ok", "{:?}", results[0].1);
    assert!(w.log().contains("CLIENT ID refused"), "{}", w.log());
    stop_clean(&mut w, Duration::from_secs(10)).await;
    Ok(())
}
