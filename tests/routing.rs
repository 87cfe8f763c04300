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
use llm_worker::sim::{Fault, SimOptions, SimStats};
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
