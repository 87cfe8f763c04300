//! What operators see (issue 11): /metrics as Prometheus scrapes it from a running
//! worker, and log lines as journald or a file receives them.

mod common;

use common::*;
use llm_worker::sim::{Fault, SimOptions};
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// /metrics after a few jobs: latencies are histograms with LLM buckets (100 ms .. 5 min),
/// cost and tokens per model, jobs in flight, queue length, group lag and pending, dead
/// letters, Redis reconnects and build info are there; labels come from closed sets only
/// (no job or entry id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_histograms_and_carry_cost_tokens_and_queue_gauges() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut tc = TestConfig::new(&redis, &sim);
    let port = free_port();
    tc.listen = format!("127.0.0.1:{port}");
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push(&mut conn, "llm", &jobs("m", 3)).await;
    context(wait_len(&mut conn, "{llm}:results", 3, T).await, &[&w]).unwrap();
    // The queue gauges are sampled every 5 s.
    let url = format!("http://127.0.0.1:{port}/metrics");
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(12);
    while tokio::time::Instant::now() < deadline {
        if let Ok(r) = reqwest::get(&url).await {
            text = r.text().await.unwrap_or_default();
            // The in-flight gauge drops just after a result is written: wait for it too.
            if text.contains("llm_worker_group_lag")
                && text.lines().any(|l| l == "llm_worker_jobs_in_flight 0")
            {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let sampled = text.contains("llm_worker_group_lag");
    stop_clean(&mut w, T).await;
    assert!(sampled, "queue gauges sampled:\n{text}");
    for name in [
        "# TYPE llm_worker_provider_call_seconds histogram",
        "# TYPE llm_worker_job_seconds histogram",
        "llm_worker_provider_call_seconds_bucket{model=\"m1\",le=\"0.1\"}",
        "llm_worker_provider_call_seconds_bucket{model=\"m1\",le=\"300\"}",
        "llm_worker_cost_picodollars_total{model=\"m1\"}",
        "llm_worker_tokens_total{model=\"m1\",kind=\"input\"}",
        "llm_worker_tokens_total{model=\"m1\",kind=\"output\"}",
        "llm_worker_tokens_total{model=\"m1\",kind=\"cached\"}",
        "llm_worker_tokens_total{model=\"m1\",kind=\"cache_write\"}",
        "llm_worker_jobs_in_flight",
        "llm_worker_queue_length",
        "llm_worker_group_lag",
        "llm_worker_group_pending",
        "llm_worker_dead_letters",
        "llm_worker_redis_reconnects_total",
        "llm_worker_build_info{version=",
        "# TYPE llm_worker_slot_wait_seconds histogram",
        "llm_worker_slot_wait_seconds_bucket{pool=\"default\",le=\"0.001\"}",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics:\n{text}");
    }
    assert!(!text.contains("quantile="), "no summaries:\n{text}");
    // The job path's series (handles kept by the worker, registered at first use) carry
    // every job once, under its own labels.
    for line in [
        "llm_worker_jobs_total{status=\"ok\"} 3",
        "llm_worker_provider_calls_total{model=\"m1\",outcome=\"ok\"} 3",
        "llm_worker_job_seconds_count 3",
        "llm_worker_jobs_in_flight 0",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from /metrics:\n{text}"
        );
    }
    assert!(
        !text.contains("llm_worker_jobs_total{status=\"failed\"}"),
        "no series for a status no job had:\n{text}"
    );
    // Cost in USD too, as Prometheus counters are (floats): the exact pico-dollar count
    // over 10^12, and the cost totals in Redis agree.
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}{{model=\"m1\"}} ")))
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
            .parse()
            .unwrap()
    };
    assert!(
        text.contains("# TYPE llm_worker_cost_usd_total counter"),
        "{text}"
    );
    let picos = value("llm_worker_cost_picodollars_total");
    let usd = value("llm_worker_cost_usd_total");
    assert!(picos > 0.0, "{text}");
    assert!(
        (usd - picos / 1e12).abs() < 1e-15,
        "usd {usd} vs picos {picos}"
    );
    let billed: String = redis::AsyncCommands::hget(&mut conn, "{llm}:cost", "m1:cost_picos")
        .await
        .unwrap();
    assert_eq!(
        billed.parse::<f64>().unwrap(),
        picos,
        "/metrics and Redis agree"
    );
    assert!(
        text.contains("llm_worker_pool_slots{pool=\"default\"} 4"),
        "N of each pool:\n{text}"
    );
    // The Grafana dashboard uses only metric names the worker really exports.
    let exported: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let dash = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/llm-worker.json"),
    )
    .unwrap();
    let dash_json: serde_json::Value = serde_json::from_str(&dash).expect("dashboard is JSON");
    let mut used = std::collections::BTreeSet::new();
    for panel in dash_json["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().expect("targets") {
            let expr = t["expr"].as_str().expect("expr");
            let mut rest = expr;
            while let Some(i) = rest.find("llm_worker_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                used.insert(name);
            }
        }
    }
    assert!(used.len() >= 10, "{used:?}");
    let missing: Vec<&String> = used
        .iter()
        .filter(|n| !exported.contains(n.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard uses metrics the worker does not export: {missing:?}\nexported: {exported:?}"
    );
    for id in ["m-0", "m-1", "m-2"] {
        assert!(!text.contains(id), "a job id in a label:\n{text}");
    }
}

/// Logs to a file or journald: no ANSI colour codes; a failed job says which models were
/// tried and the error class at the default level; every line of a job carries its
/// entry id and job id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_off_a_terminal_are_plain_and_a_failed_job_says_what_was_tried() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        rules: vec![
            always("m1", Fault::Status { status: 503 }),
            always("m2", Fault::Status { status: 503 }),
            always("m3", Fault::Status { status: 503 }),
        ],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    // The default level (info), as an operator runs it.
    let mut w = WorkerProc::spawn(&cfg, "w1", &[("RUST_LOG", "info")]);
    // A job id is producer text: one with a newline must not forge a log line.
    push(
        &mut conn,
        "llm",
        &[job("doomed", "hi"), job("x\nFORGED ERROR line", "hi")],
    )
    .await;
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w]).unwrap();
    // That id is not a valid HTTP header value: the job still reaches the provider (it is
    // answered 503 like the other, not failed before any call by the tracing header).
    let results = entries(&mut conn, "{llm}:results").await;
    let odd = results
        .iter()
        .find(|(_, r)| r["job_id"].starts_with("x\n"))
        .map(|(_, r)| r.clone())
        .unwrap_or_default();
    assert!(odd["error"].contains("503"), "{odd:?}");
    stop_clean(&mut w, T).await;
    let log = w.log();
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escapes in a log file:\n{log}"
    );
    assert!(
        log.lines()
            .all(|l| l.starts_with("20") || l.starts_with(' ')),
        "a line not written by the logger (a forged one?):\n{log}"
    );
    let failed = log
        .lines()
        .find(|l| l.contains("job failed") && l.contains("doomed"))
        .unwrap_or_else(|| panic!("no `job failed` line at the default level:\n{log}"));
    assert!(failed.contains("tried=m1,m2,m3"), "{failed}");
    assert!(failed.contains("class=transient"), "{failed}");
    assert!(
        failed.contains("id=\"doomed\"") && failed.contains("entry="),
        "{failed}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("falling back") && l.contains("id=\"doomed\"")),
        "fallbacks logged at the default level:\n{log}"
    );
}

/// `log.format = "json"`: every line is one JSON object (a log collector parses it
/// without rules), a job's lines carry its entry id and job id in the span, and a failed
/// job's line has the models tried and the error class as fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line_with_the_job_in_the_span() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        rules: vec![
            always("m1", Fault::Status { status: 503 }),
            always("m2", Fault::Status { status: 503 }),
            always("m3", Fault::Status { status: 503 }),
        ],
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(
        &cfg,
        "wj",
        &[("RUST_LOG", "info"), ("LLM_WORKER__LOG__FORMAT", "json")],
    );
    push(&mut conn, "llm", &[job("doomed-json", "hi")]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w]).unwrap();
    stop_clean(&mut w, T).await;
    let log = w.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.starts_with("--- "))
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}\n{log}"))
        })
        .collect();
    assert!(lines.len() >= 3, "{log}");
    for l in &lines {
        assert!(l["timestamp"].is_string() && l["level"].is_string(), "{l}");
        assert!(l["fields"]["message"].is_string(), "{l}");
    }
    let failed = lines
        .iter()
        .find(|l| l["fields"]["message"] == "job failed")
        .unwrap_or_else(|| panic!("no `job failed` object:\n{log}"));
    assert_eq!(failed["level"], "WARN", "{failed}");
    assert_eq!(failed["fields"]["tried"], "m1,m2,m3", "{failed}");
    assert_eq!(failed["fields"]["class"], "transient", "{failed}");
    let span = &failed["span"];
    assert!(
        span["id"]
            .as_str()
            .is_some_and(|id| id.contains("doomed-json")),
        "job id in the span: {failed}"
    );
    assert!(
        span["entry"].as_str().is_some_and(|e| e.contains('-')),
        "entry id in the span: {failed}"
    );
}

/// systemd `Type=notify` (issue 11): with a `NOTIFY_SOCKET` of the test's own, READY=1
/// arrives once the consumer group exists, WATCHDOG=1 pings arrive while the worker runs
/// (`WATCHDOG_USEC` set, as `WatchdogSec` does), and STOPPING=1 arrives on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_socket_gets_ready_after_the_group_exists_watchdog_pings_and_stopping() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let sock_path = dir.path().join("notify.sock");
    let sock = tokio::net::UnixDatagram::bind(&sock_path).unwrap();
    let mut conn = redis.conn().await;
    let env = [
        ("NOTIFY_SOCKET", sock_path.to_str().unwrap()),
        ("WATCHDOG_USEC", "1000000"),
    ];
    let mut w = WorkerProc::spawn(&cfg, "w1", &env);
    let mut buf = vec![0u8; 4096];
    let mut seen: Vec<String> = vec![];
    let mut group_at_ready = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while tokio::time::Instant::now() < deadline {
        let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(1), sock.recv(&mut buf)).await
        else {
            continue;
        };
        let msg = String::from_utf8_lossy(&buf[..n]).to_string();
        if msg.lines().any(|l| l == "READY=1") && group_at_ready.is_none() {
            let groups: redis::Value = redis::cmd("XINFO")
                .arg("GROUPS")
                .arg("{llm}:jobs")
                .query_async(&mut conn)
                .await
                .unwrap_or(redis::Value::Nil);
            group_at_ready = Some(matches!(groups, redis::Value::Array(ref g) if !g.is_empty()));
        }
        seen.push(msg);
        if group_at_ready.is_some() && seen.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 2
        {
            break;
        }
    }
    assert_eq!(
        group_at_ready,
        Some(true),
        "READY=1 after the group exists: {seen:?}\n{}",
        w.log()
    );
    assert!(
        seen.iter().filter(|m| m.contains("WATCHDOG=1")).count() >= 2,
        "watchdog pings: {seen:?}"
    );
    w.signal(libc_sig::TERM);
    let mut stopping = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline && !stopping {
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(1), sock.recv(&mut buf)).await {
            let msg = String::from_utf8_lossy(&buf[..n]).to_string();
            stopping = msg.lines().any(|l| l == "STOPPING=1");
            seen.push(msg);
        }
    }
    let status = wait_exit(&mut w, Duration::from_secs(10)).await;
    assert!(stopping, "STOPPING=1 on SIGTERM: {seen:?}");
    assert!(
        seen.iter().any(|m| m.contains("STATUS=draining")),
        "a draining status line: {seen:?}"
    );
    assert_eq!(status.and_then(|s| s.code()), Some(0));
}

/// Eviction (issue 11): a Redis whose `maxmemory-policy` may evict keys is a loud warning
/// at start (jobs still run), or, with `redis.require_noeviction = true`, a refusal with
/// exit 2 naming the setting; a Redis that is full at start is logged as out of memory,
/// not as unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_or_full_redis_is_named_at_start() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut conn)
        .await
        .unwrap();
    // Refused when required.
    let out = run_bin_async(
        &["--config", cfg.to_str().unwrap(), "run"],
        &[("LLM_WORKER__REDIS__REQUIRE_NOEVICTION", "true")],
        T,
    )
    .await;
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(
        out.stderr.contains("redis.require_noeviction") && out.stderr.contains("allkeys-lru"),
        "{}",
        out.all()
    );
    // Warned, and jobs still run, otherwise.
    let mut w = WorkerProc::spawn(&cfg, "w1", &[]);
    push(&mut conn, "llm", &[job("e1", "hi")]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w]).unwrap();
    stop_clean(&mut w, T).await;
    assert!(
        w.log().contains("maxmemory-policy is not noeviction"),
        "{}",
        w.log()
    );
    let st = run_bin_async(&["--config", cfg.to_str().unwrap(), "status"], &[], T).await;
    assert!(
        st.stdout.contains("maxmemory-policy is allkeys-lru"),
        "{}",
        st.all()
    );
    // Full at start: "out of memory", not "cannot reach Redis".
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    set_maxmemory(&mut conn, 1).await;
    let mut full = WorkerProc::spawn(&cfg, "w2", &[]);
    let said = wait_log(&full, "Redis is out of memory", Duration::from_secs(10)).await;
    set_maxmemory(&mut conn, 0).await;
    let log = full.log();
    stop_clean(&mut full, T).await;
    assert!(said, "{log}");
    assert!(!log.contains("cannot reach Redis"), "{log}");
}

/// The watchdog keeps getting pinged while the reader holds its next read back for jobs
/// in line (read-ahead 16: it reads once 8 read permits are free) and jobs end less than
/// a second apart: every pass of that wait counts as the reader's round, not only a full
/// second without a job ending (before, 8 job ends 0.5 s apart went 4 s without one,
/// and systemd, `WatchdogSec=2`, would have killed a healthy worker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_is_pinged_while_the_reader_waits_for_a_batch_of_permits() {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 500,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 1;
    tc.read_ahead = 16;
    let dir = tempfile::tempdir().unwrap();
    let cfg = tc.write(dir.path(), "w.toml");
    let sock_path = dir.path().join("notify.sock");
    let sock = tokio::net::UnixDatagram::bind(&sock_path).unwrap();
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &jobs("job", 40)).await;
    let env = [
        ("NOTIFY_SOCKET", sock_path.to_str().unwrap()),
        ("WATCHDOG_USEC", "2000000"),
    ];
    let mut w = WorkerProc::spawn(&cfg, "w1", &env);
    let mut buf = vec![0u8; 4096];
    let mut pings = vec![];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(9);
    while tokio::time::Instant::now() < deadline {
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(1), sock.recv(&mut buf)).await
            && String::from_utf8_lossy(&buf[..n]).contains("WATCHDOG=1")
        {
            pings.push(tokio::time::Instant::now());
        }
    }
    let longest = pings
        .windows(2)
        .map(|p| p[1] - p[0])
        .max()
        .unwrap_or(Duration::MAX);
    assert!(
        pings.len() >= 5 && longest < Duration::from_millis(1900),
        "a ping at least every 2 s (the watchdog's time): {} pings, longest gap {longest:?}\n{}",
        pings.len(),
        w.log()
    );
    stop_clean(&mut w, Duration::from_secs(10)).await;
}
