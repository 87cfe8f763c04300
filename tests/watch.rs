//! `status --watch`: the view rendered into a fixed-size buffer and compared with a
//! checked-in snapshot (`tests/snapshots/watch.txt`; `UPDATE_SNAPSHOTS=1` rewrites it
//! after a deliberate change), and the plain-lines mode against a real worker.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use llm_worker::watch::{Rates, draw};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use serde_json::json;
use std::time::Duration;

fn sample_status() -> serde_json::Value {
    json!({
        "redis": "redis://127.0.0.1:6379",
        "maxmemory_policy": "noeviction",
        "stream": "{llm}:jobs",
        "jobs_in_stream": 1520,
        "group": {"name": "workers", "pending": 12, "lag": 1508, "last_delivered": "1-0"},
        "consumers": [
            {"name": "pod-a-1", "pending": 8, "idle_ms": 120},
            {"name": "pod-b-1", "pending": 4, "idle_ms": 3400}
        ],
        "results": 98000,
        "dead_letters": 3,
        "failed_kept": 1,
        "jobs_added": 101520,
        "results_added": 98000,
        "pools": {"default": {"slots": 8, "configured": 8, "waiting_processes": 1, "held": [
            {"slot": 0, "holder": "pod-a-1:1a2b3c4d", "ttl_ms": 28750, "age_ms": 1250},
            {"slot": 3, "holder": "pod-b-1:5e6f7a8b", "ttl_ms": 12000, "age_ms": 61000}
        ]}},
        "cost": {"total_usd": "41.2", "models": {}},
        "budgets": [],
        "spend": {"today": {"window": "2026-12-03", "total_usd": "3.75",
                            "models": {"deepseek-v3.2": "1.25", "gpt-4.1": "2.5"}}},
        "cooldowns": [{"what": "model gpt-4.1", "ms_left": 41000, "reason": "429 Retry-After"}],
        "key_check": {},
        "tenants": []
    })
}

fn render(status: &serde_json::Value, rates: &Rates) -> String {
    let mut t = Terminal::new(TestBackend::new(100, 28)).unwrap();
    t.draw(|f| draw(f, status, rates)).unwrap();
    let buf = t.backend().buffer().clone();
    let mut out = String::new();
    for y in 0..buf.area.height {
        let line: String = (0..buf.area.width)
            .map(|x| buf[(x, y)].symbol().to_string())
            .collect();
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[test]
fn the_watch_view_matches_its_snapshot() {
    let mut rates = Rates::default();
    let t0 = tokio::time::Instant::now();
    let mut v = sample_status();
    for (i, (a, r)) in [
        (100_000u64, 96_000u64),
        (100_400, 96_500),
        (100_900, 97_100),
        (101_520, 98_000),
    ]
    .into_iter()
    .enumerate()
    {
        v["jobs_added"] = json!(a);
        v["results_added"] = json!(r);
        rates.update(&v, t0 + Duration::from_secs(i as u64));
    }
    let got = render(&sample_status(), &rates);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/watch.txt");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, &got).unwrap();
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "no snapshot at {}: run with UPDATE_SNAPSHOTS=1",
            path.display()
        )
    });
    assert!(
        got == want,
        "the view changed; if deliberate, UPDATE_SNAPSHOTS=1.\n--- got\n{got}--- want\n{want}"
    );
    // What the view must show, whatever the layout.
    for needle in [
        "1520 entries",
        "lag 1508",
        "pending 12",
        "dead letters 3",
        "jobs in/s: 620",
        "results out/s: 900",
        "pod-a-1:1a2b3c4d",
        "28750 ms",
        "1.2 s",
        "61.0 s",
        " held ",
        "slots held: default 2/8",
        "pod-b-1",
        "3.4 s",
        "spend today: $3.75",
        "gpt-4.1",
        "$2.5",
        "model gpt-4.1",
        "429 Retry-After",
    ] {
        assert!(got.contains(needle), "{needle:?} not in the view:\n{got}");
    }
    // An empty namespace says so instead of showing nulls.
    let empty = json!({"stream": "{llm}:jobs", "jobs_in_stream": 0, "group": null, "consumers": [],
        "results": 0, "dead_letters": 0, "failed_kept": 0, "pools": {}, "cost": {"total_usd": "0"},
        "spend": {}, "cooldowns": []});
    let view = render(&empty, &Rates::default());
    assert!(view.contains("no worker has started"), "{view}");
    assert!(!view.contains("null"), "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_plain_status_lines_when_stdout_is_not_a_terminal() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "wv", &[]);
    push(&mut conn, "llm", &jobs("v", 5)).await;
    context(
        wait_len(&mut conn, "{llm}:results", 5, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let out = run_bin_async(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "status",
            "--watch",
            "--count",
            "2",
        ],
        &[],
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_eq!(out.stdout.matches("\n---\n").count(), 2, "{}", out.all());
    assert!(
        out.stdout.contains("group           workers"),
        "{}",
        out.all()
    );
    assert!(
        out.stdout
            .contains("rates           jobs in 0/s  results out 0/s"),
        "{}",
        out.all()
    );
    assert!(
        !out.stdout.contains('\u{1b}'),
        "no escape codes off a terminal: {}",
        out.all()
    );
    stop_clean(&mut w, Duration::from_secs(15)).await;
    Ok(())
}

/// `status --json` (what the watch view draws) shows each held slot's holder and how long
/// it has been held, from a real worker's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_slot_shows_its_holder_and_age() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 4000,
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "a.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "aged", &[]);
    push(&mut conn, "llm", &jobs("age", 1)).await;
    assert!(
        in_flight_at_least(&sim, 1, Duration::from_secs(10)).await,
        "{}",
        w.log()
    );
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let out = run_bin_async(
        &["--config", cfg.to_str().unwrap(), "status", "--json"],
        &[],
        Duration::from_secs(20),
    )
    .await;
    let v: serde_json::Value = serde_json::from_str(&out.stdout)?;
    let held = &v["pools"]["default"]["held"][0];
    assert!(
        held["holder"]
            .as_str()
            .is_some_and(|h| h.starts_with("aged:")),
        "{held}"
    );
    let age = held["age_ms"].as_u64().unwrap_or(0);
    assert!((1200..4500).contains(&age), "held for about 1.3 s: {held}");
    stop_clean(&mut w, Duration::from_secs(15)).await;
    Ok(())
}
