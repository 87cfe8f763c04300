//! Routing across the models of one provider, end to end: the real binary, a real
//! redis-server and the simulated provider over real HTTP (issue 8 point 11).
//!
//! Aggregators (HolySheep, LiteLLM, OpenRouter) answer 401/403 for a single model when
//! the key lacks access to it, while every other model on the same provider works. A
//! 401/403 skips that model; only two different models of a provider denied (evidence the
//! key itself is bad) excludes the whole provider.
//!
//! Config used (tests/common `TestConfig`): m1 and m2 on provider p1, m3 on p2; route
//! `default` = m1, m2, m3. Some tests add m4 on p1.

mod common;

use common::*;
use llm_worker::sim::{Fault, Rule, SimOptions, SimStats};
use std::collections::HashMap;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// One redis-server, the sim, one worker; `extra` TOML and `env` overrides for the config.
struct Run {
    _redis: RedisServer,
    sim: SimHandle,
    _dir: tempfile::TempDir,
    conn: redis::aio::MultiplexedConnection,
    worker: WorkerProc,
}

impl Run {
    async fn start(opts: SimOptions, extra: &str, env: &[(&str, &str)]) -> Run {
        let redis = RedisServer::start();
        let sim = SimHandle::start(opts).await;
        let mut tc = TestConfig::new(&redis, &sim);
        tc.extra = extra.to_string();
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = tc.write(dir.path(), "w.toml");
        let conn = redis.conn().await;
        let worker = WorkerProc::spawn(&cfg, "w1", env);
        Run {
            _redis: redis,
            sim,
            _dir: dir,
            conn,
            worker,
        }
    }

    /// Pushes one job and waits for its one result.
    async fn one_result(&mut self, id: &str) -> HashMap<String, String> {
        push(&mut self.conn, "llm", &[job(id, "hello")]).await;
        let waited = wait_len(&mut self.conn, "{llm}:results", 1, T).await;
        if let Err(e) = context(waited, &[&self.worker]) {
            panic!("{e:#}");
        }
        let all = entries(&mut self.conn, "{llm}:results").await;
        assert_eq!(all.len(), 1, "one result: {all:?}");
        all.into_iter().next().expect("one").1
    }

    /// Pushes one payload and waits for one more result; returns the newest.
    async fn result_of(&mut self, payload: serde_json::Value) -> HashMap<String, String> {
        let before = entries(&mut self.conn, "{llm}:results").await.len();
        push(&mut self.conn, "llm", &[payload.to_string()]).await;
        let waited = wait_len(&mut self.conn, "{llm}:results", before as u64 + 1, T).await;
        if let Err(e) = context(waited, &[&self.worker]) {
            panic!("{e:#}");
        }
        let all = entries(&mut self.conn, "{llm}:results").await;
        assert_eq!(all.len(), before + 1, "one more result: {all:?}");
        all.into_iter().last().expect("one").1
    }

    fn stats(&self) -> SimStats {
        self.sim.sim.stats()
    }

    async fn stop(mut self) {
        stop_clean(&mut self.worker, T).await;
    }
}

/// Calls the sim answered for `model` with `status`.
fn calls(st: &SimStats, model: &str, status: u16) -> u64 {
    st.requests
        .get(model)
        .and_then(|m| m.get(&status))
        .copied()
        .unwrap_or(0)
}

fn total_calls(st: &SimStats, model: &str) -> u64 {
    st.requests
        .get(model)
        .map(|m| m.values().sum())
        .unwrap_or(0)
}

/// The scenario: the route's first model always answers 401, the second, on the
/// same provider, works. The job ends `ok` on the second; the 401 model is not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthorized_model_is_skipped_and_the_next_model_of_the_same_provider_answers() {
    for status in [401, 403] {
        let mut run = Run::start(
            SimOptions {
                rules: vec![always("m1", Fault::Status { status })],
                ..SimOptions::default()
            },
            "",
            &[],
        )
        .await;
        let r = run.one_result("denied-1").await;
        let st = run.stats();
        assert_eq!(r["status"], "ok", "{status}: {r:?}\n{}", run.worker.log());
        assert_eq!(r["model"], "m2", "{status}: {r:?}");
        assert_eq!(r["tried"], "m1,m2", "{status}: {r:?}");
        assert_eq!(r["attempts"], "2", "{status}: {r:?}");
        assert_eq!(calls(&st, "m1", status), 1, "no retry: {:?}", st.requests);
        assert_eq!(calls(&st, "m2", 200), 1, "{:?}", st.requests);
        assert_eq!(total_calls(&st, "m3"), 0, "{:?}", st.requests);
        run.stop().await;
    }
}

/// Two different models of p1 denied: the key itself is bad, so the rest of p1 (m4) is
/// not tried and the job moves on to p2's m3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_of_a_provider_denied_exclude_the_provider() {
    let m4 = "\n[models.m4]\nprovider = \"p1\"\ninput_per_mtok = 1\noutput_per_mtok = 1\ncontext_window = 100000\n";
    let mut run = Run::start(
        SimOptions {
            rules: vec![
                always("m1", Fault::Status { status: 401 }),
                always("m2", Fault::Status { status: 403 }),
            ],
            ..SimOptions::default()
        },
        m4,
        &[("LLM_WORKER__ROUTES__DEFAULT", "m1,m2,m4,m3")],
    )
    .await;
    let r = run.one_result("denied-2").await;
    let st = run.stats();
    assert_eq!(r["status"], "ok", "{r:?}\n{}", run.worker.log());
    assert_eq!(r["model"], "m3", "{r:?}");
    assert_eq!(r["tried"], "m1,m2,m3", "{r:?}");
    assert_eq!(total_calls(&st, "m4"), 0, "p1 excluded: {:?}", st.requests);
    assert_eq!(calls(&st, "m1", 401), 1, "{:?}", st.requests);
    assert_eq!(calls(&st, "m2", 403), 1, "{:?}", st.requests);
    run.stop().await;
}

/// Every model denied: the job fails after one call per model, naming the last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_model_denied_fails_after_one_call_each() {
    let mut run = Run::start(
        SimOptions {
            rules: vec![always("*", Fault::Status { status: 401 })],
            ..SimOptions::default()
        },
        "",
        &[],
    )
    .await;
    let r = run.one_result("denied-3").await;
    let st = run.stats();
    assert_eq!(r["status"], "failed", "{r:?}");
    // m1 and m2 denied exclude p1; m3 on p2 is tried once.
    assert_eq!(r["tried"], "m1,m2,m3", "{r:?}");
    assert_eq!(r["attempts"], "3", "{r:?}");
    assert!(r["error"].contains("401"), "{r:?}");
    for m in ["m1", "m2", "m3"] {
        assert_eq!(calls(&st, m, 401), 1, "{m}: {:?}", st.requests);
    }
    run.stop().await;
}

/// Tiers (issue 10): a job's `tier` keeps routing inside that tier's models, whatever its
/// route; a route with no model of the tier fails with `tier:` and calls nothing; an
/// unknown tier is `invalid`. The job's `tenant` is echoed in its result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_keeps_routing_inside_its_models() {
    let extra = "[tiers]\nfree = [\"m3\"]\nnarrow = [\"m2\"]\n";
    let mut run = Run::start(
        SimOptions {
            // m3, the tier's only model, is last in the route: it must still be the
            // first and only one called, and m1/m2 (faulty here) never.
            rules: vec![always("m1", Fault::Status { status: 503 })],
            ..SimOptions::default()
        },
        extra,
        &[("LLM_WORKER__ROUTES__ONLY1", "m1")],
    )
    .await;
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    let r = run
        .result_of(
            serde_json::json!({"id": "t1", "messages": msgs, "tier": "free", "tenant": "acme"}),
        )
        .await;
    assert_eq!(r["status"], "ok", "{r:?}\n{}", run.worker.log());
    assert_eq!(r["model"], "m3", "{r:?}");
    assert_eq!(r["tried"], "m3", "{r:?}");
    assert_eq!(r.get("tenant").map(String::as_str), Some("acme"), "{r:?}");
    let st = run.stats();
    assert_eq!(
        total_calls(&st, "m1") + total_calls(&st, "m2"),
        0,
        "{:?}",
        st.requests
    );

    // A job naming a model outside its tier: the model is skipped too.
    let r = run
        .result_of(
            serde_json::json!({"id": "t2", "messages": msgs, "tier": "narrow", "model": "m3"}),
        )
        .await;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m2", "{r:?}");
    assert!(
        !r.contains_key("tenant"),
        "no tenant given, none echoed: {r:?}"
    );

    // Route `only1` has m1 alone, outside tier `narrow`: failed with `tier:`, no call.
    let m1_before = total_calls(&run.stats(), "m1");
    let r = run
        .result_of(
            serde_json::json!({"id": "t3", "messages": msgs, "tier": "narrow", "route": "only1"}),
        )
        .await;
    assert_eq!(r["status"], "failed", "{r:?}");
    assert!(r["error"].starts_with("tier: "), "{r:?}");
    assert!(r["error"].contains("`narrow`"), "{r:?}");
    assert_eq!(r["attempts"], "0", "{r:?}");
    assert_eq!(total_calls(&run.stats(), "m1"), m1_before, "no call");

    // An unknown tier is invalid, naming it.
    let r = run
        .result_of(serde_json::json!({"id": "t4", "messages": msgs, "tier": "gold"}))
        .await;
    assert_eq!(r["status"], "invalid", "{r:?}");
    assert!(r["error"].contains("unknown tier `gold`"), "{r:?}");
    run.stop().await;
}

/// The per-job cost cap (issue 10): a model whose worst case does not fit the job's
/// `max_cost_usd` is skipped (m3 here, after m1 and m2 fail), a cap nothing fits fails
/// with `budget:` before any call, and a job within its cap costs at most the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_over_the_jobs_cost_cap_is_skipped() {
    let mut run = Run::start(
        SimOptions {
            rules: vec![
                always("m1", Fault::Status { status: 503 }),
                always("m2", Fault::Status { status: 503 }),
            ],
            ..SimOptions::default()
        },
        "",
        &[],
    )
    .await;
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    // About 80 bytes of body: m1's worst case (0.14/0.42 per M) and m2's (0.10/2.50)
    // are below 0.0001 USD with max_tokens 16; m3's (2.00/8.00) is about 0.0003.
    let r = run
        .result_of(serde_json::json!({"id": "c1", "messages": msgs, "max_tokens": 16, "max_cost_usd": "0.0001"}))
        .await;
    let st = run.stats();
    assert_eq!(r["status"], "failed", "{r:?}\n{}", run.worker.log());
    assert!(
        r["tried"].starts_with("m1,") && !r["tried"].contains("m3"),
        "{r:?}"
    );
    assert_eq!(
        total_calls(&st, "m3"),
        0,
        "m3 is over the cap: {:?}",
        st.requests
    );
    assert!(
        total_calls(&st, "m1") > 0 && total_calls(&st, "m2") > 0,
        "{:?}",
        st.requests
    );

    // Nothing fits: `budget:` at once, no call.
    let calls_before: u64 = ["m1", "m2", "m3"]
        .iter()
        .map(|m| total_calls(&run.stats(), m))
        .sum();
    let r = run
        .result_of(serde_json::json!({"id": "c2", "messages": msgs, "max_tokens": 16, "max_cost_usd": 0.000000001}))
        .await;
    assert_eq!(r["status"], "failed", "{r:?}");
    assert!(r["error"].starts_with("budget: "), "{r:?}");
    assert!(r["error"].contains("max_cost_usd"), "{r:?}");
    assert_eq!(r["attempts"], "0", "{r:?}");
    let calls_after: u64 = ["m1", "m2", "m3"]
        .iter()
        .map(|m| total_calls(&run.stats(), m))
        .sum();
    assert_eq!(calls_after, calls_before, "no call");

    // A bad cap is invalid, naming the field.
    let r = run
        .result_of(serde_json::json!({"id": "c3", "messages": msgs, "max_cost_usd": "lots"}))
        .await;
    assert_eq!(r["status"], "invalid", "{r:?}");
    assert!(r["error"].contains("max_cost_usd"), "{r:?}");
    run.stop().await;
}

/// A job within its cap on a working model: ok, and its cost is at most the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_within_its_cap_costs_at_most_the_cap() {
    let mut run = Run::start(SimOptions::default(), "", &[]).await;
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
    let cap = "0.0001";
    let r = run
        .result_of(serde_json::json!({"id": "w1", "messages": msgs, "max_tokens": 16, "max_cost_usd": cap}))
        .await;
    assert_eq!(r["status"], "ok", "{r:?}\n{}", run.worker.log());
    assert_eq!(r["model"], "m1", "{r:?}");
    let cost: rust_decimal::Decimal = r["cost_usd"].parse().expect("a decimal");
    assert!(cost > rust_decimal::Decimal::ZERO, "{r:?}");
    assert!(cost <= cap.parse().expect("cap"), "{r:?}");
    run.stop().await;
}

/// Redis, the sim with `opts`, and a config with key validation on, written to a temp dir.
async fn key_checked(
    opts: SimOptions,
) -> (
    RedisServer,
    SimHandle,
    tempfile::TempDir,
    std::path::PathBuf,
) {
    let redis = RedisServer::start();
    let sim = SimHandle::start(opts).await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.validate_key = true;
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = tc.write(dir.path(), "w.toml");
    (redis, sim, dir, cfg)
}

/// Key validation at start (issue 10): a provider that answers 401 at `GET /models` stops
/// `run` and `check-config` with exit 2 and a message naming the provider and the key's
/// variable (never the key), before any job is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_key_at_get_models_is_exit_2() {
    let (redis, _sim, _dir, cfg) = key_checked(SimOptions {
        api_key: Some("the-right-key".into()),
        ..SimOptions::default()
    })
    .await;
    let env = [
        ("LLM_WORKER__PROVIDERS__P1__API_KEY_ENV", "P1_KEY"),
        ("P1_KEY", "a-wrong-key-1234"),
    ];
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job("k1", "hi")]).await;
    for cmd in ["check-config", "run"] {
        let out = run_bin_async(&["--config", cfg.to_str().expect("utf8"), cmd], &env, T).await;
        assert_eq!(out.code, Some(2), "{cmd}: {}", out.all());
        assert!(out.stderr.contains("providers.p1"), "{cmd}: {}", out.all());
        assert!(out.stderr.contains("P1_KEY"), "{cmd}: {}", out.all());
        assert!(out.stderr.contains("401"), "{cmd}: {}", out.all());
        assert!(
            !out.all().contains("a-wrong-key-1234"),
            "{cmd}: key leaked: {}",
            out.all()
        );
    }
    let results: u64 = redis::AsyncCommands::xlen(&mut conn, "{llm}:results")
        .await
        .expect("XLEN");
    assert_eq!(results, 0, "no job was taken");
    // The right key: check-config passes and says the key is ok.
    let env = [
        ("LLM_WORKER__PROVIDERS__P1__API_KEY_ENV", "P1_KEY"),
        ("P1_KEY", "the-right-key"),
        ("LLM_WORKER__PROVIDERS__P2__VALIDATE_KEY", "false"),
    ];
    let out = run_bin_async(
        &["--config", cfg.to_str().expect("utf8"), "check-config"],
        &env,
        T,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        !out.all().contains("the-right-key"),
        "key leaked: {}",
        out.all()
    );
}

/// A key that works but cannot see a configured model: the model is left out of routing
/// (logged), so jobs go straight to the next model instead of paying a failed call first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_the_key_cannot_see_is_left_out_of_routing() {
    let (redis, sim, _dir, cfg) = key_checked(SimOptions {
        models: Some(vec!["m2".into(), "m3".into()]),
        ..SimOptions::default()
    })
    .await;
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push(&mut conn, "llm", &[job("v1", "hi")]).await;
    let waited = wait_len(&mut conn, "{llm}:results", 1, T).await;
    context(waited, &[&w]).expect("one result");
    let r = entries(&mut conn, "{llm}:results").await.remove(0).1;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m2", "{r:?}");
    assert_eq!(r["tried"], "m2", "m1 never tried: {r:?}");
    assert_eq!(total_calls(&sim.sim.stats(), "m1"), 0);
    assert!(w.log().contains("cannot see these models"), "{}", w.log());
    // `status` shows what the key check found, and today's spend on m2.
    let out = run_bin_async(&["--config", cfg.to_str().expect("utf8"), "status"], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains("key p1") && out.stdout.contains("cannot see m1"),
        "{}",
        out.stdout
    );
    let m2_line = out
        .stdout
        .lines()
        .skip_while(|l| !l.starts_with("spend today"))
        .find(|l| l.trim_start().starts_with("m2"))
        .unwrap_or_default()
        .to_string();
    assert!(
        m2_line.contains(&format!("${}", r["cost_usd"])),
        "today's spend on m2 is the job's cost {}: {}",
        r["cost_usd"],
        out.stdout
    );
    stop_clean(&mut w, T).await;
}

/// Every result carries `usage` (issue 10): a JSON array of each billed attempt's usage
/// object exactly as the provider sent it, so a cost can be re-priced later; its sums
/// are the result's token counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_carries_the_raw_usage_of_each_billed_attempt() {
    let mut run = Run::start(
        SimOptions {
            cached_fraction: 0.5,
            ..SimOptions::default()
        },
        "",
        &[],
    )
    .await;
    let r = run.one_result("u1").await;
    assert_eq!(r["status"], "ok", "{r:?}");
    let usage: serde_json::Value = serde_json::from_str(&r["usage"]).expect("usage is JSON");
    let list = usage.as_array().expect("an array");
    assert_eq!(list.len(), 1, "{usage}");
    let u = &list[0];
    assert_eq!(
        u["prompt_tokens"].to_string(),
        r["input_tokens"],
        "{usage} {r:?}"
    );
    assert_eq!(
        u["completion_tokens"].to_string(),
        r["output_tokens"],
        "{usage} {r:?}"
    );
    assert_eq!(
        u["prompt_tokens_details"]["cached_tokens"].to_string(),
        r["cached_tokens"],
        "the provider's own object, details and all: {usage}"
    );
    run.stop().await;
}

/// Shared cooldowns (issue 10): worker A's call of m1 gets a 429 with a Retry-After of a
/// year (beyond `retry.max_retry_after_ms`, so A moves on to m2) and records the
/// cooldown in Redis, capped at 10 minutes; worker B, another process started
/// afterwards, routes around m1 at once: m1 is called once in all, and `status` shows
/// the cooldown. Ended early in Redis (`HDEL`), it ends for B within a refresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooldown_found_by_one_worker_is_honoured_by_another() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        rules: vec![Rule {
            first_n: Some(1),
            ..always(
                "m1",
                Fault::RateLimit {
                    retry_after: Some("31536000".into()),
                    retry_after_ms: None,
                },
            )
        }],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let mut a = WorkerProc::spawn(&cfg, "wa", &[]);
    push(&mut conn, "llm", &[job("c1", "hi")]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&a]).expect("A's result");
    stop_clean(&mut a, T).await;
    let st = llm_worker::tools::status(&tc.parsed())
        .await
        .expect("status");
    let cds = st["cooldowns"].as_array().cloned().unwrap_or_default();
    assert_eq!(cds.len(), 1, "{st}");
    assert_eq!(cds[0]["what"], "m:m1", "{st}");
    assert!(
        cds[0]["ms_left"]
            .as_u64()
            .is_some_and(|ms| ms > 500_000 && ms <= 600_000),
        "capped at 10 minutes: {st}"
    );
    let mut b = WorkerProc::spawn(&cfg, "wb", &[]);
    push(&mut conn, "llm", &[job("c2", "hi"), job("c3", "hi")]).await;
    context(wait_len(&mut conn, "{llm}:results", 3, T).await, &[&b]).expect("B's results");
    let results = entries(&mut conn, "{llm}:results").await;
    for (_, r) in &results[1..] {
        assert_eq!(r["status"], "ok", "{r:?}");
        assert_eq!(r["model"], "m2", "{r:?}");
        assert_eq!(r["tried"], "m2", "B never tried m1: {r:?}");
    }
    assert_eq!(
        total_calls(&sim.sim.stats(), "m1"),
        1,
        "m1 called once in all"
    );
    let _: i64 = redis::AsyncCommands::hdel(&mut conn, "{llm}:cooldowns", "m:m1")
        .await
        .expect("HDEL");
    // B rereads the cooldowns every second (`cooldown::REFRESH`): 3 s is room for a
    // loaded machine.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    push(&mut conn, "llm", &[job("c4", "hi")]).await;
    context(wait_len(&mut conn, "{llm}:results", 4, T).await, &[&b]).expect("c4's result");
    let last = entries(&mut conn, "{llm}:results").await.remove(3).1;
    assert_eq!(
        last["model"], "m1",
        "the cooldown ended early for B too: {last:?}"
    );
    stop_clean(&mut b, T).await;
}

/// Context windows (issue 10): m1's window is 1,000 tokens (the sim rejects more), and the
/// job's old turn alone is about 1,000 tokens. `trim` (the default) drops the oldest turn
/// and the answer to it (a conversation never opens on an assistant turn), keeping the
/// system prompt and the last user turn, and the call on m1 succeeds
/// (`trimmed_messages = 2`); `fallback` goes to m2 (a 100,000-token window) untrimmed;
/// `fail` fails with `context:` and no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_too_long_for_the_window_is_trimmed_moved_or_failed_by_policy() {
    let mut run = Run::start(
        SimOptions {
            context_windows: [("m1".to_string(), 1000u64)].into_iter().collect(),
            ..SimOptions::default()
        },
        "",
        &[],
    )
    .await;
    let long = "lorem ipsum ".repeat(330);
    let messages = serde_json::json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": long},
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": "and now?"}
    ]);
    let r = run
        .result_of(serde_json::json!({"id": "x1", "messages": messages, "max_tokens": 16}))
        .await;
    assert_eq!(r["status"], "ok", "{r:?}\n{}", run.worker.log());
    assert_eq!(r["model"], "m1", "{r:?}");
    assert_eq!(
        r.get("trimmed_messages").map(String::as_str),
        Some("2"),
        "{r:?}"
    );
    assert_eq!(
        calls(&run.stats(), "m1", 400),
        0,
        "never sent too long: {:?}",
        run.stats().requests
    );

    let r = run
        .result_of(serde_json::json!({"id": "x2", "messages": messages, "max_tokens": 16, "context_policy": "fallback"}))
        .await;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["model"], "m2", "{r:?}");
    assert_eq!(r["tried"], "m2", "{r:?}");
    assert!(!r.contains_key("trimmed_messages"), "{r:?}");

    let before = total_calls(&run.stats(), "m1") + total_calls(&run.stats(), "m2");
    let r = run
        .result_of(serde_json::json!({"id": "x3", "messages": messages, "max_tokens": 16, "context_policy": "fail"}))
        .await;
    assert_eq!(r["status"], "failed", "{r:?}");
    assert!(r["error"].starts_with("context: "), "{r:?}");
    assert_eq!(
        total_calls(&run.stats(), "m1") + total_calls(&run.stats(), "m2"),
        before
    );
    run.stop().await;
}
