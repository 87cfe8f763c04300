//! One job's lifecycle and the worker's exit (issue 8, points 3, 5, 8, 14, 15), on the real
//! binary, a real redis-server and the simulated provider:
//! - a panicking job task releases its entry, so the job is taken over and finished;
//! - a worker never starts a second paid call for an entry it already runs (self-reclaim);
//! - a copy of a busy job id waits without a job permit and is answered as a duplicate;
//! - after SIGTERM no provider call starts (slot waiters, retry backoffs);
//! - unfinished jobs are handed back at shutdown and another worker does them at once;
//! - a clean exit removes the consumer; idle empty consumers are removed by the reclaimer.

mod common;

use common::*;
use llm_worker::sim::{Fault, SimOptions};
use redis::AsyncCommands;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use tokio::time::Instant;

type Conn = redis::aio::MultiplexedConnection;

/// A redis-server, the sim, and a config written to `cfg`.
struct Bed {
    conn: Conn,
    cfg: PathBuf,
    sim: SimHandle,
    _dir: tempfile::TempDir,
    _redis: RedisServer,
}

impl Bed {
    async fn new(opts: SimOptions, edit: impl FnOnce(&mut TestConfig)) -> anyhow::Result<Bed> {
        let redis = RedisServer::start();
        let sim = SimHandle::start(opts).await;
        let mut tc = TestConfig::new(&redis, &sim);
        edit(&mut tc);
        let dir = tempfile::tempdir()?;
        let cfg = tc.write(dir.path(), "w.toml");
        let conn = redis.conn().await;
        Ok(Bed {
            conn,
            cfg,
            sim,
            _dir: dir,
            _redis: redis,
        })
    }

    fn calls(&self, job: &str) -> u64 {
        self.sim
            .sim
            .stats()
            .calls_per_job
            .get(job)
            .copied()
            .unwrap_or(0)
    }

    fn total_calls(&self) -> u64 {
        self.sim.sim.stats().calls_per_job.values().sum()
    }
}

fn latency(ms: u64) -> SimOptions {
    SimOptions {
        latency_ms: ms,
        ..SimOptions::default()
    }
}

/// Consumer name -> pending count, from XINFO CONSUMERS of group `workers`.
async fn consumers(conn: &mut Conn) -> HashMap<String, i64> {
    let v: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg("{llm}:jobs")
        .arg("workers")
        .query_async(conn)
        .await
        .expect("xinfo consumers");
    v.into_iter()
        .map(|m| {
            let name: String = redis::from_redis_value(m["name"].clone()).expect("name");
            let pending: i64 = redis::from_redis_value(m["pending"].clone()).expect("pending");
            (name, pending)
        })
        .collect()
}

/// The delivery count of one pending entry (0 if not pending).
async fn deliveries_of(conn: &mut Conn, entry: &str) -> u64 {
    pending_of(conn, entry).await.map(|p| p.1).unwrap_or(0)
}

/// Point 3: a job task that panics (debug-build hook) must not keep its entry alive: the
/// keepalive stops touching it, it goes idle past `claim_idle_ms`, is taken over and ends
/// `ok`, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_job_task_releases_its_entry_for_takeover() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(50), |_| {}).await?;
    push(&mut bed.conn, "llm", &[job("boom", "hi")]).await;
    let mut w = WorkerProc::spawn(
        &bed.cfg,
        "w1",
        &[
            ("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "500"),
            ("LLM_WORKER_DEBUG_PANIC_ONCE_JOB", "boom"),
        ],
    );
    assert!(
        wait_log(&w, "debug hook: panicking", Duration::from_secs(10)).await,
        "the hook fired\n{}",
        w.log()
    );
    let done = wait_len(&mut bed.conn, "{llm}:results", 1, Duration::from_secs(6)).await;
    context(done, &[&w])?;
    let ids = ok_results_once(&mut bed.conn).await;
    assert!(ids.contains("boom"));
    assert_eq!(bed.calls("boom"), 1, "one paid call");
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Start-up's file pages are dropped just before the first read
/// (`resident::shed_start_up_pages`, the memory target of issue 9), and the worker then
/// runs on the pages it maps back: every job ends ok, once, with one call each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_pages_are_dropped_before_the_first_read_and_jobs_still_run() -> anyhow::Result<()>
{
    let mut bed = Bed::new(latency(0), |_| {}).await?;
    // A binary just linked is dirty in the page cache, and dirty pages are never dropped.
    let _ = std::fs::File::open(bin()).and_then(|f| f.sync_all());
    let mut w = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    let needle = "start-up's file pages dropped";
    assert!(
        wait_log(&w, needle, Duration::from_secs(10)).await,
        "the drop is logged\n{}",
        w.log()
    );
    let log = w.log();
    let line = log.lines().find(|l| l.contains(needle)).unwrap_or_default();
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(name))
            .and_then(|v| v.trim_matches('"').parse().ok())
            .unwrap_or(0)
    };
    assert!(
        field("mappings=") > 0 && field("resident_kb=") > 0,
        "the executable's code was resident and dropped: {line}"
    );
    push(&mut bed.conn, "llm", &jobs("shed", 20)).await;
    let done = wait_len(&mut bed.conn, "{llm}:results", 20, Duration::from_secs(20)).await;
    context(done, &[&w])?;
    let ids = ok_results_once(&mut bed.conn).await;
    assert_eq!(ids.len(), 20, "every job ok, once");
    assert_eq!(bed.total_calls(), 20, "one call each");
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Point 5: the keepalive of a running entry lags (here: the test keeps setting the entry's
/// idle time far above `claim_idle_ms`, as a keepalive failing while reclaim works would let
/// it grow), so the reader XAUTOCLAIMs its own running entry. It must not start a second paid
/// call for it. (A tiny `claim_idle_ms` no longer reproduces this: the fleet heartbeat then
/// reads as a Redis stall and reclaim pauses, which is right for a real stall.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_reclaimed_entry_is_not_called_twice() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(3000), |_| {}).await?;
    let entry = push(&mut bed.conn, "llm", &[job("solo", "hi")])
        .await
        .remove(0);
    let mut w = WorkerProc::spawn(
        &bed.cfg,
        "w1",
        &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "600")],
    );
    assert!(
        in_flight_at_least(&bed.sim, 1, Duration::from_secs(10)).await,
        "the call runs\n{}",
        w.log()
    );
    let reclaimed = wait_for(Duration::from_millis(2500), || {
        let mut c = bed.conn.clone();
        let e = entry.clone();
        async move {
            // Idle time an hour, delivery count untouched (JUSTID): only the reader's
            // XAUTOCLAIM raises the count.
            let _: redis::Value = redis::cmd("XCLAIM")
                .arg("{llm}:jobs")
                .arg("workers")
                .arg("w1")
                .arg(0)
                .arg(&e)
                .arg("IDLE")
                .arg(3_600_000)
                .arg("JUSTID")
                .query_async(&mut c)
                .await
                .expect("xclaim");
            deliveries_of(&mut c, &e).await >= 2
        }
    })
    .await;
    assert!(reclaimed, "the reader reclaimed its own entry\n{}", w.log());
    context(
        wait_len(&mut bed.conn, "{llm}:results", 1, Duration::from_secs(10)).await,
        &[&w],
    )?;
    let idle = wait_for(Duration::from_secs(5), || async {
        bed.sim.sim.stats().in_flight == 0
    })
    .await;
    assert!(idle, "no call left running");
    assert_eq!(
        bed.calls("solo"),
        1,
        "one paid call for one entry\n{}",
        w.log()
    );
    ok_results_once(&mut bed.conn).await;
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Point 8: two entries of one id and a third job, concurrency 2, 4 s calls. The copy of
/// the busy id must not hold a job permit while it waits: the third job's call runs
/// alongside the first copy's. When the first copy ends `ok`, the copy is answered as a
/// duplicate without a model call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_copy_waits_without_a_permit_and_ends_as_duplicate() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(4000), |tc| tc.concurrency = 2).await?;
    push(
        &mut bed.conn,
        "llm",
        &[job("dup", "hi"), job("dup", "hi"), job("other", "hi")],
    )
    .await;
    let mut w = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    assert!(
        in_flight_at_least(&bed.sim, 1, Duration::from_secs(10)).await,
        "first copy runs\n{}",
        w.log()
    );
    // Within the first call (4 s): were the copy holding a permit, the third job's call
    // would start only after the first ends, and two would never run at once.
    let both = in_flight_at_least(&bed.sim, 2, Duration::from_millis(3500)).await;
    assert!(
        both,
        "the third job runs while the copy waits (the copy holds no permit)\n{}",
        w.log()
    );
    context(
        wait_len(&mut bed.conn, "{llm}:results", 3, Duration::from_secs(10)).await,
        &[&w],
    )?;
    let results = entries(&mut bed.conn, "{llm}:results").await;
    let dups: Vec<_> = results
        .iter()
        .filter(|(_, r)| r["job_id"] == "dup")
        .collect();
    assert_eq!(dups.len(), 2, "{results:?}");
    assert!(dups.iter().all(|(_, r)| r["status"] == "ok"), "{results:?}");
    assert_eq!(
        dups.iter()
            .filter(|(_, r)| r.contains_key("duplicate_of"))
            .count(),
        1,
        "the copy is answered as a duplicate: {results:?}"
    );
    assert_eq!(bed.calls("dup"), 1, "one model call for the id");
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Point 14: slots = 2. Two jobs sit in a Retry-After backoff (429 on m3), two calls run
/// on m1 (2 s), two more jobs wait for a slot. SIGTERM: the provider sees no new request
/// after the signal; the two running calls finish and are written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_provider_call_starts_after_sigterm() -> anyhow::Result<()> {
    let opts = SimOptions {
        model_latency_ms: HashMap::from([("m1".to_string(), 2000)]),
        rules: vec![always(
            "m3",
            Fault::RateLimit {
                retry_after: None,
                retry_after_ms: Some(4000),
            },
        )],
        ..SimOptions::default()
    };
    let mut bed = Bed::new(opts, |tc| {
        tc.slots = 2;
        tc.concurrency = 8;
        tc.grace_ms = 8000;
    })
    .await?;
    let backoff_jobs: Vec<String> = (0..2)
        .map(|i| {
            serde_json::json!({"id": format!("b-{i}"), "model": "m3",
                "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
        })
        .collect();
    push(&mut bed.conn, "llm", &backoff_jobs).await;
    let mut w = WorkerProc::spawn(
        &bed.cfg,
        "w1",
        &[("LLM_WORKER__RETRY__MAX_RETRY_AFTER_MS", "10000")],
    );
    let backing_off = wait_for(Duration::from_secs(10), || async {
        bed.calls("b-0") == 1 && bed.calls("b-1") == 1
    })
    .await;
    assert!(backing_off, "two jobs got a 429\n{}", w.log());
    push(&mut bed.conn, "llm", &jobs("run", 4)).await;
    let busy = wait_for(Duration::from_secs(5), || {
        let mut c = bed.conn.clone();
        let sim = bed.sim.sim.clone();
        async move {
            sim.stats().in_flight == 2 && pending_count(&mut c, "{llm}:jobs", "workers").await == 6
        }
    })
    .await;
    assert!(busy, "2 calls run, 6 jobs taken\n{}", w.log());
    let at_signal = bed.total_calls();
    w.signal(libc_sig::TERM);
    let status = wait_exit(&mut w, Duration::from_secs(10)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "exit 0: {status:?}\n{}",
        w.log()
    );
    assert_eq!(
        bed.total_calls(),
        at_signal,
        "no provider request after the signal: {:?}\n{}",
        bed.sim.sim.stats().calls_per_job,
        w.log()
    );
    let ids = ok_results_once(&mut bed.conn).await;
    assert_eq!(
        ids.len(),
        2,
        "the two running calls finished and were written"
    );
    assert!(
        slot_keys(&mut bed.conn, "llm").await.is_empty(),
        "no slot key left"
    );
    Ok(())
}

/// Point 15: w1 runs 4 long calls, w2 waits for work. SIGTERM to w1 with a 500 ms grace:
/// its 4 jobs are handed back (new entries, same fields, `_deliveries`), and w2 finishes
/// them within 2 s of w1's exit, exactly one result each (a job without `id` keeps its
/// first entry id as job id); w1's consumer is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_unfinished_jobs_to_another_worker_within_2s() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(5000), |tc| {
        tc.concurrency = 4;
        tc.slots = 8;
        tc.grace_ms = 500;
    })
    .await?;
    let mut payloads = jobs("job", 3);
    payloads.push(r#"{"messages":[{"role":"user","content":"no id"}]}"#.to_string());
    let entry_ids = push(&mut bed.conn, "llm", &payloads).await;
    let mut w1 = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    assert!(
        in_flight_at_least(&bed.sim, 4, Duration::from_secs(10)).await,
        "4 calls running on w1\n{}",
        w1.log()
    );
    let mut w2 = WorkerProc::spawn(&bed.cfg, "w2", &[]);
    assert!(
        wait_log(&w2, "worker started", Duration::from_secs(10)).await,
        "{}",
        w2.log()
    );
    bed.sim.sim.set_options(latency(100));
    w1.signal(libc_sig::TERM);
    let status = wait_exit(&mut w1, Duration::from_secs(3)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "w1 exit 0: {status:?}\n{}",
        w1.log()
    );
    let exited = Instant::now();
    let done = wait_len(&mut bed.conn, "{llm}:results", 4, Duration::from_secs(2)).await;
    context(done, &[&w1, &w2])?;
    eprintln!(
        "handed-back jobs done by w2 {:?} after w1's exit",
        exited.elapsed()
    );
    let results = entries(&mut bed.conn, "{llm}:results").await;
    assert_all_ok_once(&results, 4);
    for (_, r) in &results {
        assert_eq!(r["worker"], "w2", "{r:?}");
    }
    assert!(
        results.iter().any(|(_, r)| r["job_id"] == entry_ids[3]),
        "the id-less job keeps its first entry id as job id: {results:?}"
    );
    let cs = consumers(&mut bed.conn).await;
    assert!(!cs.contains_key("w1"), "w1 removed its consumer: {cs:?}");
    stop_clean(&mut w2, Duration::from_secs(6)).await;
    let cs = consumers(&mut bed.conn).await;
    assert!(cs.is_empty(), "w2 removed its consumer too: {cs:?}");
    assert_eq!(
        pending_count(&mut bed.conn, "{llm}:jobs", "workers").await,
        0
    );
    Ok(())
}

/// Point 15 (hand-back format): jobs waiting for a slot at SIGTERM are handed back as new
/// entries carrying every original field verbatim plus `_deliveries` (0: a delivery that
/// never called a model does not count) and `_entry`; the old entries are acknowledged;
/// the in-progress markers are released; nothing is left pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_back_entries_keep_every_field_and_the_delivery_count() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(10), |tc| {
        tc.slots = 1;
        tc.concurrency = 2;
        tc.grace_ms = 1000;
    })
    .await?;
    // Another process holds the only slot.
    let _: () = redis::cmd("SET")
        .arg("{llm}:slot:default:0")
        .arg("other-host-1:0badc0de")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut bed.conn)
        .await?;
    let payload = job("keep", "hi");
    let old = push_fields(
        &mut bed.conn,
        "llm",
        &[("payload", payload.as_bytes()), ("trace", b"\xff\x00raw")],
    )
    .await;
    let mut w = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    assert!(
        wait_slot_queue(&bed.conn, "w1", Duration::from_secs(10)).await,
        "{}",
        w.log()
    );
    stop_clean(&mut w, Duration::from_secs(4)).await;
    let all = entries_raw(&mut bed.conn, "{llm}:jobs").await;
    assert_eq!(all.len(), 1, "one entry: the hand-back ({all:?})");
    let (new, fields) = &all[0];
    assert_ne!(new, &old);
    assert_eq!(fields["payload"], payload.as_bytes());
    assert_eq!(fields["trace"], b"\xff\x00raw".to_vec());
    assert_eq!(fields["_deliveries"], b"0".to_vec(), "no call, no delivery");
    assert!(!fields.contains_key("_billed"), "nothing spent");
    assert_eq!(
        fields["_entry"],
        old.as_bytes().to_vec(),
        "the first entry id"
    );
    assert_eq!(
        pending_count(&mut bed.conn, "{llm}:jobs", "workers").await,
        0
    );
    let marker: Option<String> = bed.conn.get("{llm}:inflight:keep").await?;
    assert_eq!(marker, None, "the in-progress marker is released");
    assert_eq!(bed.total_calls(), 0);
    Ok(())
}

/// Point 15 (consumer removal): the reclaimer removes consumers idle longer than
/// `queue.consumer_idle_remove_ms` that own no pending entry, and never one that does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaimer_removes_idle_empty_consumers_only() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(10), |_| {}).await?;
    create_group(&mut bed.conn).await;
    let _: i64 = redis::cmd("XGROUP")
        .arg("CREATECONSUMER")
        .arg("{llm}:jobs")
        .arg("workers")
        .arg("ghost-empty")
        .query_async(&mut bed.conn)
        .await?;
    push(&mut bed.conn, "llm", &[job("held", "hi")]).await;
    read_as(&mut bed.conn, "ghost-busy").await;
    let mut w = WorkerProc::spawn(
        &bed.cfg,
        "w1",
        &[("LLM_WORKER__QUEUE__CONSUMER_IDLE_REMOVE_MS", "500")],
    );
    let removed = wait_for(Duration::from_secs(8), || {
        let mut c = bed.conn.clone();
        async move { !consumers(&mut c).await.contains_key("ghost-empty") }
    })
    .await;
    assert!(removed, "idle empty consumer removed\n{}", w.log());
    // The worker's own consumer exists once it has read a job; the sweep skips it, however
    // idle it looks (Redis 7.0 does not refresh a consumer's idle time on empty reads).
    push(&mut bed.conn, "llm", &[job("mine", "hi")]).await;
    context(
        wait_len(&mut bed.conn, "{llm}:results", 1, Duration::from_secs(10)).await,
        &[&w],
    )?;
    let swept_self = wait_for(Duration::from_millis(1500), || {
        let mut c = bed.conn.clone();
        async move { !consumers(&mut c).await.contains_key("w1") }
    })
    .await;
    let cs = consumers(&mut bed.conn).await;
    assert!(
        !swept_self,
        "the sweep never removes its own worker: {cs:?}\n{}",
        w.log()
    );
    assert_eq!(
        cs.get("ghost-busy"),
        Some(&1),
        "a consumer with pending entries stays: {cs:?}"
    );
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// The hand-back script on its own: it moves only an entry pending under this consumer
/// (one owned by another consumer is left alone), releases the id's in-progress marker
/// only if it is the entry's, and acknowledges an entry deleted while pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_back_moves_only_entries_this_consumer_owns() -> anyhow::Result<()> {
    use llm_worker::connect::commands;
    use llm_worker::queue::{HandBack, Queue};
    let bed = Bed::new(latency(10), |_| {}).await?;
    let mut conn = bed.conn.clone();
    let mut cfg = TestConfig::with_urls(&bed._redis.url(), bed.sim.addr).parsed();
    cfg.queue.consumer = "w1".into();
    let queue = Queue::new(&cfg, commands(&cfg)?);
    queue.ensure_group().await?;
    let reader = conn.clone();
    let read_as = |consumer: &'static str| {
        let mut c = reader.clone();
        async move {
            let r: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("workers")
                .arg(consumer)
                .arg("COUNT")
                .arg(1)
                .arg("STREAMS")
                .arg("{llm}:jobs")
                .arg(">")
                .query_async(&mut c)
                .await
                .expect("xreadgroup");
            r.keys[0].ids[0].id.clone()
        }
    };
    // Owned by another consumer: untouched.
    push(&mut conn, "llm", &[job("theirs", "hi")]).await;
    let theirs = read_as("other").await;
    assert_eq!(
        queue.hand_back(&theirs, Some("theirs"), 1, None).await?,
        HandBack::NotOurs
    );
    assert_eq!(deliveries_of(&mut conn, &theirs).await, 1, "still pending");
    // Ours, with a marker held by another copy of the id: moved, marker kept.
    push(&mut conn, "llm", &[job("mine", "hi")]).await;
    let mine = read_as("w1").await;
    let _: () = conn.set("{llm}:inflight:mine", "9-9").await?;
    let HandBack::Moved(new) = queue.hand_back(&mine, Some("mine"), 3, None).await? else {
        panic!("not moved");
    };
    assert_eq!(
        deliveries_of(&mut conn, &mine).await,
        0,
        "old entry acknowledged"
    );
    let marker: Option<String> = conn.get("{llm}:inflight:mine").await?;
    assert_eq!(
        marker.as_deref(),
        Some("9-9"),
        "another copy's marker is kept"
    );
    let all = entries_raw(&mut conn, "{llm}:jobs").await;
    let moved = &all.iter().find(|(id, _)| id == &new).expect("new entry").1;
    assert_eq!(moved["_deliveries"], b"3".to_vec());
    assert!(
        all.iter().all(|(id, _)| id != &mine),
        "old entry deleted (queue.delete_acked)"
    );
    // Ours but deleted by the producer while pending: acknowledged, nothing re-queued.
    let before = xlen(&mut conn, "{llm}:jobs").await;
    let _ = read_as("w1").await; // the moved entry, now pending under w1
    let _: i64 = conn.xdel("{llm}:jobs", &[&new]).await?;
    assert_eq!(
        queue.hand_back(&new, Some("mine"), 4, None).await?,
        HandBack::Deleted
    );
    assert_eq!(deliveries_of(&mut conn, &new).await, 0);
    assert_eq!(xlen(&mut conn, "{llm}:jobs").await, before - 1);
    Ok(())
}

/// Another process holds the only slot of pool `default` for a minute.
async fn hold_the_slot(conn: &mut Conn) -> anyhow::Result<()> {
    let _: () = redis::cmd("SET")
        .arg("{llm}:slot:default:0")
        .arg("other-host-1:0badc0de")
        .arg("PX")
        .arg(60_000)
        .query_async(conn)
        .await?;
    Ok(())
}

/// Starts worker `name`, waits until it queues for the slot, then stops it cleanly: the
/// job it holds is handed back.
async fn take_and_hand_back(bed: &Bed, name: &str, env: &[(&str, &str)]) {
    let mut w = WorkerProc::spawn(&bed.cfg, name, env);
    assert!(
        wait_slot_queue(&bed.conn, name, Duration::from_secs(10)).await,
        "{name} waits for the slot\n{}",
        w.log()
    );
    stop_clean(&mut w, Duration::from_secs(4)).await;
}

/// Review hole 1b (hand-back): a job entry with more fields than Lua can pass to one
/// XADD is handed back whole (packed into `_packed`, see README) and then runs normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_back_entry_with_thousands_of_fields_keeps_them_all() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(10), |tc| {
        tc.slots = 1;
        tc.concurrency = 2;
    })
    .await?;
    hold_the_slot(&mut bed.conn).await?;
    let payload = job("wide", "hi");
    let names: Vec<String> = (0..5000).map(|i| format!("f{i:04}")).collect();
    let mut fields: Vec<(&str, &[u8])> = vec![("payload", payload.as_bytes())];
    fields.extend(names.iter().map(|n| (n.as_str(), b"\xff,1:x" as &[u8])));
    let old = push_fields(&mut bed.conn, "llm", &fields).await;
    take_and_hand_back(&bed, "w1", &[]).await;
    let all = entries_raw(&mut bed.conn, "{llm}:jobs").await;
    assert_eq!(
        all.len(),
        1,
        "one entry: the hand-back ({:?})",
        all.iter().map(|e| &e.0).collect::<Vec<_>>()
    );
    assert_ne!(all[0].0, old, "handed back as a new entry");
    let packed = all[0].1.get("_packed").expect("the fields, packed");
    let mut got = llm_worker::queue::unpack_fields(packed).expect("a packing");
    got.sort();
    let mut want: Vec<(Vec<u8>, Vec<u8>)> = names
        .iter()
        .map(|n| (n.clone().into_bytes(), b"\xff,1:x".to_vec()))
        .collect();
    want.push((b"payload".to_vec(), payload.clone().into_bytes()));
    want.sort();
    assert!(got == want, "every field verbatim in the hand-back");
    assert_eq!(
        all[0].1["_entry"],
        old.as_bytes().to_vec(),
        "bookkeeping fields stay outside the packing"
    );
    assert_eq!(
        pending_count(&mut bed.conn, "{llm}:jobs", "workers").await,
        0
    );
    let _: () = bed.conn.del("{llm}:slot:default:0").await?;
    let mut w2 = WorkerProc::spawn(&bed.cfg, "w2", &[]);
    let done = wait_len(&mut bed.conn, "{llm}:results", 1, Duration::from_secs(10)).await;
    context(done, &[&w2])?;
    let results = entries(&mut bed.conn, "{llm}:results").await;
    assert_all_ok_once(&results, 1);
    let warning = &results[0].1["warning"];
    assert!(
        warning.contains("ignored stream fields other than payload: f0000, f0001"),
        "the unpacked fields reached the job: {}",
        &warning[..200.min(warning.len())]
    );
    assert_eq!(bed.calls("wide"), 1);
    stop_clean(&mut w2, Duration::from_secs(6)).await;
    Ok(())
}

/// Review hole 3: a rolling restart hands a job that never got a slot back on every
/// restart; those hand-backs are not deliveries (no provider call started), so with
/// `queue.max_deliveries = 2` the job is not dead-lettered after 3 restarts, and ends `ok`
/// once a slot is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restarts_do_not_count_hand_backs_of_jobs_never_called() -> anyhow::Result<()> {
    let mut bed = Bed::new(latency(10), |tc| {
        tc.slots = 1;
        tc.concurrency = 2;
        tc.grace_ms = 1000;
    })
    .await?;
    hold_the_slot(&mut bed.conn).await?;
    push(&mut bed.conn, "llm", &[job("roll", "hi")]).await;
    let env = [("LLM_WORKER__QUEUE__MAX_DELIVERIES", "2")];
    for name in ["w1", "w2", "w3", "w4"] {
        take_and_hand_back(&bed, name, &env).await;
        assert_eq!(xlen(&mut bed.conn, "{llm}:dead").await, 0, "after {name}");
        assert_eq!(xlen(&mut bed.conn, "{llm}:jobs").await, 1, "after {name}");
    }
    let _: () = bed.conn.del("{llm}:slot:default:0").await?;
    let mut w = WorkerProc::spawn(&bed.cfg, "w5", &env);
    let done = wait_len(&mut bed.conn, "{llm}:results", 1, Duration::from_secs(10)).await;
    context(done, &[&w])?;
    let results = entries(&mut bed.conn, "{llm}:results").await;
    assert_all_ok_once(&results, 1);
    assert_eq!(results[0].1["attempts"], "1", "{results:?}");
    assert_eq!(xlen(&mut bed.conn, "{llm}:dead").await, 0);
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Review hole 4: a job handed back while in retry backoff after a billed failed attempt
/// (a 200 without choices, its prompt billed) carries that attempt: the final result's
/// attempts, tokens and cost include it, and the cost totals count each paid call once.
/// The started call counts as a delivery (`_deliveries` 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_back_carries_the_billed_attempts_of_a_job_in_backoff() -> anyhow::Result<()> {
    let opts = SimOptions {
        latency_ms: 10,
        rules: vec![llm_worker::sim::Rule {
            model: "m1".into(),
            fault: Fault::EmptyChoices,
            probability: 1.0,
            first_n: Some(1),
        }],
        ..SimOptions::default()
    };
    let mut bed = Bed::new(opts, |tc| tc.grace_ms = 1000).await?;
    push(&mut bed.conn, "llm", &[job("paid", "hello there")]).await;
    let slow_retry = [
        ("LLM_WORKER__RETRY__BASE_DELAY_MS", "20000"),
        ("LLM_WORKER__RETRY__MAX_DELAY_MS", "20000"),
    ];
    let mut w1 = WorkerProc::spawn(&bed.cfg, "w1", &slow_retry);
    let called = wait_for(Duration::from_secs(10), || async { bed.calls("paid") == 1 }).await;
    assert!(called, "the first, billed, call\n{}", w1.log());
    tokio::time::sleep(Duration::from_millis(200)).await; // into the backoff
    stop_clean(&mut w1, Duration::from_secs(5)).await;
    let all = entries_raw(&mut bed.conn, "{llm}:jobs").await;
    assert_eq!(all.len(), 1, "handed back\n{}", w1.log());
    assert_eq!(
        all[0].1["_deliveries"],
        b"1".to_vec(),
        "a started call counts"
    );
    let mut w2 = WorkerProc::spawn(&bed.cfg, "w2", &[]);
    let done = wait_len(&mut bed.conn, "{llm}:results", 1, Duration::from_secs(10)).await;
    context(done, &[&w1, &w2])?;
    stop_clean(&mut w2, Duration::from_secs(6)).await;
    let results = entries(&mut bed.conn, "{llm}:results").await;
    assert_all_ok_once(&results, 1);
    let r = &results[0].1;
    let stats = bed.sim.sim.stats();
    let billed = &stats.billed["m1"];
    assert_eq!(billed.responses, 2, "{stats:?}");
    assert_eq!(bed.calls("paid"), 2);
    assert_eq!(r["attempts"], "2", "{r:?}");
    assert_eq!(r["tried"], "m1", "{r:?}");
    assert_eq!(r["input_tokens"], billed.prompt_tokens.to_string(), "{r:?}");
    assert_eq!(
        r["output_tokens"],
        billed.completion_tokens.to_string(),
        "{r:?}"
    );
    // m1: 0.14 $/Mtok in, 0.42 $/Mtok out, no cache: picos = tokens x 140000 / 420000.
    let picos = billed.prompt_tokens * 140_000 + billed.completion_tokens * 420_000;
    let totals: HashMap<String, String> = bed.conn.hgetall("{llm}:cost").await?;
    assert_eq!(totals["m1:calls"], "2", "{totals:?}");
    assert_eq!(totals["m1:cost_picos"], picos.to_string(), "{totals:?}");
    assert_eq!(
        totals["m1:input_tokens"],
        billed.prompt_tokens.to_string(),
        "{totals:?}"
    );
    let usd = rust_decimal::Decimal::new(picos as i64, 12).normalize();
    assert_eq!(r["cost_usd"], usd.to_string(), "{r:?}");
    Ok(())
}
