//! `schema/job.schema.json` and `schema/result.schema.json` checked against the code:
//! the job schema accepts exactly the payloads the worker's own validation accepts (over
//! a corpus of good and bad ones), and every result a real worker writes (ok, failed,
//! invalid, cancelled, expired, duplicate) validates against the result schema. Also
//! `enqueue --wait`: one job, a JSONL file with `--output`, a failure and a timeout.

mod common;

use common::*;
use llm_worker::sim::{Fault, SimOptions};
use serde_json::{Value, json};
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

fn schema(name: &str) -> jsonschema::Validator {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("schema")
        .join(name);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    jsonschema::validator_for(&v).unwrap_or_else(|e| panic!("{name} is not a schema: {e}"))
}

#[test]
fn the_job_schema_accepts_what_the_worker_accepts() {
    let validator = schema("job.schema.json");
    let redis_url = "redis://127.0.0.1:1";
    let cfg = TestConfig::with_urls(redis_url, "127.0.0.1:1".parse().unwrap()).parsed();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let corpus: Vec<Value> = vec![
        json!({"messages": msgs}),
        json!({"messages": msgs, "id": "a", "model": "m1", "route": "default"}),
        json!({"messages": msgs, "id": 42, "metadata": {"k": [1, 2]}, "top_p": 0.5}),
        json!({"messages": msgs, "max_tokens": 10, "temperature": 0.2}),
        json!({"messages": msgs, "tenant": "acme", "max_cost_usd": "0.01"}),
        json!({"messages": msgs, "max_cost_usd": 0.5, "context_policy": "trim"}),
        json!({"messages": msgs, "deadline_ms": 1_900_000_000_000u64}),
        json!({"messages": [{"role": "user", "content": null}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        // Bad ones.
        json!({}),
        json!({"messages": []}),
        json!({"messages": "hi"}),
        json!({"messages": [{"content": "no role"}]}),
        json!({"messages": [{"role": "", "content": "x"}]}),
        json!({"messages": msgs, "id": ""}),
        json!({"messages": msgs, "id": "x".repeat(513)}),
        json!({"messages": msgs, "max_tokens": 0}),
        json!({"messages": msgs, "max_tokens": "10"}),
        json!({"messages": msgs, "temperature": "hot"}),
        json!({"messages": msgs, "tenant": ""}),
        json!({"messages": msgs, "tenant": "t".repeat(257)}),
        json!({"messages": msgs, "max_cost_usd": -1}),
        json!({"messages": msgs, "max_cost_usd": "lots"}),
        json!({"messages": msgs, "context_policy": "shrink"}),
        json!({"messages": msgs, "deadline_ms": -5}),
        json!({"messages": msgs, "deadline_ms": "soon"}),
        json!({"messages": msgs, "deadline_ms": 1.5}),
        json!({"messages": msgs, "metadata": null, "model": 7}),
        json!([1, 2]),
        // What producers really send: nulls for absent fields, ms and token counts as
        // floats, ids in non-ASCII text, costs with exponents.
        json!({"messages": msgs, "deadline_ms": null, "model": null, "max_tokens": null, "tenant": null, "id": null}),
        json!({"messages": msgs, "deadline_ms": 1_900_000_000_000.0, "max_tokens": 10.0}),
        json!({"messages": msgs, "deadline_ms": 1.9e12}),
        json!({"messages": msgs, "max_tokens": 10.5}),
        json!({"messages": msgs, "id": "é".repeat(300)}),
        json!({"messages": msgs, "id": "é".repeat(513)}),
        json!({"messages": msgs, "max_cost_usd": "1e-2"}),
        json!({"messages": msgs, "max_cost_usd": ".5"}),
        json!({"messages": msgs, "max_cost_usd": "1e"}),
    ];
    for p in &corpus {
        let text = p.to_string();
        let code = llm_worker::job::parse(Some(text.as_bytes()), "1-0", 1 << 20, &cfg);
        assert_eq!(
            validator.is_valid(p),
            code.is_ok(),
            "schema and worker disagree on {p}: worker says {code:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_result_a_worker_writes_matches_the_result_schema() -> anyhow::Result<()> {
    let validator = schema("result.schema.json");
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 30,
        rules: vec![always("m3", Fault::Status { status: 400 })],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "s.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;
    // Route `solo` = m3 only, which answers 400 (not retryable): a failed result.
    let solo = [("LLM_WORKER__ROUTES__SOLO", "m3")];
    let mut w = WorkerProc::spawn(&cfg, "s1", &solo);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let now = llm_worker::cost::unix_now_ms();
    let payloads = [
        json!({"id": "ok-1", "messages": msgs, "metadata": {"a": 1}, "tenant": "t"}),
        json!({"id": "fails", "model": "m3", "route": "solo", "messages": msgs}),
        json!({"id": "bad", "messages": "nope"}),
        json!({"id": "late", "messages": msgs, "deadline_ms": now - 1}),
        json!({"id": "ok-1", "messages": msgs}),
    ];
    let _ = run_bin_async(&["--config", cfg_s, "cancel", "cx"], &[], T).await;
    let mut all: Vec<String> = payloads.iter().map(|p| p.to_string()).collect();
    all.push(json!({"id": "cx", "messages": msgs}).to_string());
    push(&mut conn, "llm", &all[..1]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w])?;
    push(&mut conn, "llm", &all[1..]).await;
    context(wait_len(&mut conn, "{llm}:results", 6, T).await, &[&w])?;
    stop_clean(&mut w, T).await;
    let results = entries(&mut conn, "{llm}:results").await;
    let mut statuses = std::collections::BTreeSet::new();
    for (id, r) in &results {
        let v = Value::Object(r.iter().map(|(k, v)| (k.clone(), json!(v))).collect());
        let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
        assert!(
            errors.is_empty(),
            "result {id} does not match the schema: {errors:?}\n{v}"
        );
        statuses.insert(r["status"].clone());
    }
    for s in ["ok", "failed", "invalid", "expired", "cancelled"] {
        assert!(statuses.contains(s), "no {s} result among {statuses:?}");
    }
    assert!(
        results.iter().any(|(_, r)| r.contains_key("duplicate_of")),
        "a duplicate result was checked too"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_wait_prints_the_answer_and_exits_by_how_the_jobs_ended() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 20,
        rules: vec![always("m3", Fault::Status { status: 400 })],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "e.toml");
    let cfg_s = cfg.to_str().unwrap();

    // No worker yet: the timeout runs out (exit 124), naming the job.
    let out = run_bin_async(
        &[
            "--config",
            cfg_s,
            "enqueue",
            "--prompt",
            "hi",
            "--id",
            "w0",
            "--wait",
            "--timeout",
            "1s",
        ],
        &[],
        T,
    )
    .await;
    assert_eq!(out.code, Some(124), "{}", out.all());
    assert!(
        out.stderr.contains("w0") && out.stderr.contains("timeout"),
        "{}",
        out.all()
    );

    let mut w = WorkerProc::spawn(&cfg, "e1", &[("LLM_WORKER__ROUTES__SOLO", "m3")]);
    let out = run_bin_async(
        &[
            "--config",
            cfg_s,
            "enqueue",
            "--prompt",
            "Say hi",
            "--id",
            "w1",
            "--wait",
            "--timeout",
            "15s",
        ],
        &[],
        T,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains("Say hi"),
        "the answer on stdout: {}",
        out.all()
    );
    assert!(out.stderr.starts_with("ok m1 cost_usd="), "{}", out.all());

    // A job that fails (route `solo` = m3 only, which answers 400): its error, exit 1.
    let out = run_bin_async(
        &[
            "--config", cfg_s, "enqueue", "--prompt", "x", "--route", "solo", "--id", "w2",
            "--wait",
        ],
        &[("LLM_WORKER__ROUTES__SOLO", "m3")],
        T,
    )
    .await;
    assert_eq!(out.code, Some(1), "{}", out.all());
    assert!(
        out.stderr.starts_with("failed ") && out.stderr.contains("error:"),
        "{}",
        out.all()
    );

    // A JSONL file of 20 jobs (some without an id): every result, in input order.
    let mut lines = vec![];
    for i in 0..20 {
        let mut j = json!({"messages": [{"role": "user", "content": format!("n{i}")}]});
        if i % 2 == 0 {
            j["id"] = json!(format!("f{i}"));
        }
        lines.push(j.to_string());
    }
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, lines.join("\n") + "\n")?;
    let output = dir.path().join("out.jsonl");
    let out = run_bin_async(
        &[
            "--config",
            cfg_s,
            "enqueue",
            "--file",
            input.to_str().unwrap(),
            "--wait",
            "--output",
            output.to_str().unwrap(),
        ],
        &[],
        T,
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let written = std::fs::read_to_string(&output)?;
    let rows: Vec<Value> = written
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 20, "{written}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["status"], "ok", "{r}");
        assert!(
            r["content"].as_str().unwrap().contains(&format!("n{i}")),
            "input order: {r}"
        );
        if i % 2 == 0 {
            assert_eq!(r["job_id"], format!("f{i}"));
        }
    }
    stop_clean(&mut w, T).await;
    Ok(())
}

/// A Redis that stops answering (SIGSTOP: a hung server, or a partition) while
/// `enqueue --wait --timeout` waits: the wait still ends by its timeout (exit 124), not
/// when TCP gives up. The results read is bounded and made again on a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_wait_ends_by_its_timeout_when_redis_hangs() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "e.toml");
    let conn = redis.conn().await;
    // No worker: the job is never answered.
    let waiting = spawn_enqueue_wait(&cfg, "hang-1", "4s");
    assert!(
        wait_for(Duration::from_secs(10), || {
            let mut c = conn.clone();
            async move { try_xlen(&mut c, "{llm}:jobs").await.unwrap_or(0) == 1 }
        })
        .await,
        "the job was pushed"
    );
    // Into its blocking read, then Redis hangs.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = redis.pid().expect("redis pid");
    signal(pid, "STOP");
    let began = tokio::time::Instant::now();
    let out = waiting.await?;
    signal(pid, "CONT");
    let took = began.elapsed();
    assert_eq!(out.code, Some(124), "timed out, not hung: {}", out.all());
    assert!(
        took < Duration::from_secs(12),
        "ended by its 4 s timeout, not by TCP ({took:?}): {}",
        out.all()
    );
    assert!(out.stderr.contains("hang-1"), "{}", out.all());
    Ok(())
}
