//! The pipeline end to end, on the real binary, a real redis-server and the simulated
//! provider over real HTTP.

mod common;

use common::*;
use llm_worker::cost::{self, Price, Usage};
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
    let price = Price {
        input_per_mtok: Decimal::from_str("0.14")?,
        output_per_mtok: Decimal::from_str("0.42")?,
        cached_input_per_mtok: Some(Decimal::from_str("0.028")?),
    };
    let expected = cost::cost(
        &Usage {
            prompt_tokens: b.prompt_tokens,
            completion_tokens: b.completion_tokens,
            cached_tokens: b.cached_tokens,
        },
        &price,
    );
    assert!(b.cached_tokens > 0, "cached pricing is exercised");
    assert_eq!(
        sum, expected,
        "sum of cost_usd equals billed tokens x prices"
    );
    // The Redis running totals agree, in integer pico-dollars.
    let picos: i64 = redis::AsyncCommands::hget(&mut conn, "{llm}:cost", "m1:cost_picos").await?;
    assert_eq!(cost::from_picos(picos), expected);
    // Acknowledged and removed: nothing pending, nothing left in the jobs stream.
    let pending: redis::Value = redis::cmd("XPENDING")
        .arg("{llm}:jobs")
        .arg("workers")
        .query_async(&mut conn)
        .await?;
    assert!(
        matches!(pending, redis::Value::Array(ref a) if matches!(a[0], redis::Value::Int(0))),
        "{pending:?}"
    );
    assert_eq!(xlen(&mut conn, "{llm}:jobs").await, 0);
    // At most 4 calls at once, and no slot left behind.
    assert!(
        stats.max_in_flight <= 4,
        "max in flight {}",
        stats.max_in_flight
    );
    w.signal(libc_sig::TERM);
    let status = w
        .wait_timeout(Duration::from_secs(10))
        .expect("worker exits");
    assert!(status.success(), "exit {status:?}\n{}", w.log());
    assert!(slot_keys(&mut conn, "llm").await.is_empty());
    Ok(())
}
