//! Taking over stalled entries (XAUTOCLAIM) against commits, stalls and producers'
//! deletions: a job without a producer `id` (no idempotency marker) still gets exactly
//! one result and is paid once. Real redis-server; the library's `Queue` where the
//! scripts alone decide, the real binary where the reader and the job path do.

mod common;

use common::*;
use llm_worker::queue::{Commit, CommitOutcome, Queue};
use llm_worker::sim::SimOptions;
use redis::AsyncCommands;
use std::time::Duration;

/// A payload without a producer `id`: its job id is its entry id, it has no marker.
fn idless(text: &str) -> String {
    serde_json::json!({"messages": [{"role": "user", "content": text}]}).to_string()
}

/// A commit of an id-less job (no markers), with one cost total increment.
fn idless_commit(entry: &str, worker: &str) -> Commit {
    Commit {
        entry_id: entry.into(),
        result: vec![
            ("job_id", entry.as_bytes().to_vec()),
            ("job_entry", entry.as_bytes().to_vec()),
            ("status", b"ok".to_vec()),
            ("worker", worker.as_bytes().to_vec()),
        ],
        dead: vec![],
        dead_is_failed_copy: false,
        dedupe_id: None,
        inflight_id: None,
        status: "ok".into(),
        costs: vec![("test_nanos".into(), 5)],
    }
}

/// A queue as consumer `who` with a short `claim_idle_ms` (no provider needed).
fn queue_named(redis: &RedisServer, who: &str, claim_idle_ms: u64) -> Queue {
    let mut cfg =
        TestConfig::with_urls(&redis.url(), "127.0.0.1:9".parse().expect("addr")).parsed();
    cfg.queue.claim_idle_ms = Duration::from_millis(claim_idle_ms);
    cfg.queue.consumer = who.to_string();
    let pool = llm_worker::connect::commands(&cfg).expect("pool");
    Queue::new(&cfg, pool)
}

// ---------------------------------------------------------------------------------------
// Hole 1: a late commit of an id-less entry that another worker committed (and deleted,
// delete_acked) after more than 1000 other results is superseded, not a second result.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_commit_of_an_idless_entry_committed_elsewhere_long_ago_is_superseded()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let qa = queue_named(&redis, "worker-a", 3000);
    let qb = queue_named(&redis, "worker-b", 3000);
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[idless("hi")]).await;
    let e1 = &ids[0];
    read_as(&mut conn, "worker-a").await;
    // A stalls past claim_idle_ms; B takes E1 over and commits it (XDEL: delete_acked).
    xclaim(&mut conn, "worker-a", e1, 100_000, 1).await;
    let r = qb.reclaim(10).await?;
    assert_eq!(r.deliveries.len(), 1, "{r:?}");
    let b = qb.commit(&idless_commit(e1, "worker-b")).await?;
    assert!(matches!(b, CommitOutcome::Written { .. }), "{b:?}");
    // More than 1000 other results are written since.
    let mut pipe = redis::pipe();
    for i in 0..1100 {
        pipe.cmd("XADD")
            .arg("{llm}:results")
            .arg("*")
            .arg("job_entry")
            .arg(format!("0-{}", i + 1))
            .arg("worker")
            .arg("worker-c")
            .ignore();
    }
    let _: () = pipe.query_async(&mut conn).await?;
    // A resumes and commits the result it held.
    let a = qa.commit(&idless_commit(e1, "worker-a")).await?;
    assert_eq!(a, CommitOutcome::Superseded, "a second result for {e1}");
    let mine = entries(&mut conn, "{llm}:results")
        .await
        .into_iter()
        .filter(|(_, f)| f.get("job_entry") == Some(e1))
        .count();
    assert_eq!(mine, 1, "exactly one result for {e1}");
    let total: i64 = conn.hget("{llm}:cost", "test_nanos").await?;
    assert_eq!(total, 5, "cost totals counted once");
    Ok(())
}

// The path hole 1 must keep: an entry the producer deleted while it was pending, dropped
// from the pending list by a reclaim (XAUTOCLAIM), still gets its (paid) result, once.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_dropped_by_a_reclaim_after_the_producer_deleted_it_gets_one_result()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let qa = queue_named(&redis, "worker-a", 3000);
    let qb = queue_named(&redis, "worker-b", 200);
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[idless("hi")]).await;
    let e1 = &ids[0];
    read_as(&mut conn, "worker-a").await;
    let _: i64 = conn.xdel("{llm}:jobs", &[e1]).await?;
    // (An XCLAIM of a deleted entry would drop it itself: let it grow idle instead.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = qb.reclaim(10).await?;
    assert_eq!(r.deleted, vec![e1.clone()], "{r:?}");
    assert!(r.deliveries.is_empty(), "{r:?}");
    assert_eq!(pending_of(&mut conn, e1).await, None, "dropped");
    let a = qa.commit(&idless_commit(e1, "worker-a")).await?;
    assert!(matches!(a, CommitOutcome::Written { .. }), "{a:?}");
    // A retry after a lost reply is recognised; nobody else can write one.
    let again = qa.commit(&idless_commit(e1, "worker-a")).await?;
    assert!(
        matches!(again, CommitOutcome::AlreadyWritten { .. }),
        "{again:?}"
    );
    let other = qb.commit(&idless_commit(e1, "worker-b")).await?;
    assert_eq!(other, CommitOutcome::Superseded);
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 1);
    let total: i64 = conn.hget("{llm}:cost", "test_nanos").await?;
    assert_eq!(total, 5);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Hole 2: a reclaimed id-less job whose entry is committed by its first worker before the
// reclaimer's call starts is not called (paid) a second time.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaimed_idless_job_committed_meanwhile_by_its_first_worker_is_not_called_again()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 1;
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[idless("hi")]).await;
    let e1 = ids[0].clone();
    // Worker A (this test) took E1 and looks stalled (its keepalive lags).
    read_as(&mut conn, "A").await;
    xclaim(&mut conn, "A", &e1, 100_000, 1).await;
    // The pool's only slot is busy for a while, so B's call waits after the take-over.
    let _: () = redis::cmd("SET")
        .arg("{llm}:slot:default:0")
        .arg("someone")
        .arg("PX")
        .arg(4000)
        .query_async(&mut conn)
        .await?;
    let b = WorkerProc::spawn(&cfg, "B", &[]);
    assert!(
        wait_for(Duration::from_secs(15), || {
            let mut c = conn.clone();
            let e = e1.clone();
            async move { pending_of(&mut c, &e).await.map(|p| p.0) == Some("B".into()) }
        })
        .await,
        "B took E1 over\n{}",
        b.log()
    );
    // A finishes after all and commits: E1 has its result, acknowledged (and deleted).
    let qa = queue_as(&redis, &sim, "A");
    let a = qa.commit(&idless_commit(&e1, "A")).await?;
    assert!(matches!(a, CommitOutcome::Written { .. }), "{a:?}");
    // The slot frees up; B must not call the model for E1.
    let calls = |sim: &SimHandle| sim.sim.stats().calls_per_job.get(&e1).copied();
    wait_for(Duration::from_secs(10), || async {
        calls(&sim).is_some() || b.log().contains("no longer pending")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        calls(&sim),
        None,
        "B paid for a job A had committed\n{}",
        b.log()
    );
    assert!(
        b.log().contains("no longer pending under this worker"),
        "{}",
        b.log()
    );
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 1);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Hole 3: an XAUTOCLAIM sent just before a Redis stall and run when Redis resumes must be
// gated like any reclaim after a stall: the entry's worker was alive all along.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_queued_across_a_redis_stall_takes_nothing() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[job("st-1", "hi")]).await;
    read_as(&mut conn, "A").await;
    let b = WorkerProc::spawn(
        &cfg,
        "B",
        &[
            ("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "3000"),
            // Commands wait 10 s (ttl / 3): the XAUTOCLAIM outlives the stall.
            ("LLM_WORKER__SLOTS__TTL_MS", "30000"),
            ("LLM_WORKER_DEBUG_RECLAIM_PAUSE_MS", "1500"),
        ],
    );
    assert!(
        wait_log(&b, "debug hook: pausing", Duration::from_secs(15)).await,
        "{}",
        b.log()
    );
    // A is alive: its keepalive just touched E1 and beat the fleet heartbeat. Then Redis
    // stalls for longer than claim_idle_ms while B's XAUTOCLAIM is on its way.
    xclaim(&mut conn, "A", &ids[0], 0, 1).await;
    let now = server_ms(&mut conn).await;
    let _: () = conn.set("{llm}:heartbeat", now).await?;
    let pid = redis_pid(&mut conn).await;
    signal(pid, libc_sig::STOP);
    tokio::time::sleep(Duration::from_millis(4000)).await;
    signal(pid, libc_sig::CONT);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        pending_of(&mut conn, &ids[0]).await.map(|p| p.0),
        Some("A".into()),
        "E1 taken over right after a Redis stall\n{}",
        b.log()
    );
    assert_eq!(sim.sim.stats().calls_per_job.get("st-1"), None);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// A producer-supplied `_deliveries` at the top of the range does not overflow.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_carried_delivery_count_saturates() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let q = queue_named(&redis, "worker-a", 3000);
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let max = u64::MAX.to_string();
    let payload = idless("hi");
    let e1 = push_fields(
        &mut conn,
        "llm",
        &[
            ("payload", payload.as_bytes()),
            ("_deliveries", max.as_bytes()),
        ],
    )
    .await;
    let cfg = TestConfig::with_urls(&redis.url(), "127.0.0.1:9".parse()?).parsed();
    let mut blocking = llm_worker::connect::blocking_connection(&cfg).await?;
    let read = q
        .read_new(&mut blocking, 10, Duration::from_millis(100))
        .await?;
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].deliveries, u64::MAX);
    // And reclaimed (delivery count 2 + carried).
    xclaim(&mut conn, "worker-a", &e1, 100_000, 1).await;
    let r = q.reclaim(10).await?;
    assert_eq!(r.deliveries.len(), 1, "{r:?}");
    assert_eq!(r.deliveries[0].deliveries, u64::MAX);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Review: a worker whose keepalive finds a job no longer pending under it (taken over by
// another worker after a pause, here: XCLAIMed by another consumer) must not call for it
// if it has not called yet. Before the fix it only logged, then called when its slot came.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_taken_over_before_its_call_is_not_called_here() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 4000,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 1; // job b waits for the slot job a holds
    tc.concurrency = 2;
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    // claim_idle_ms 6 s: keepalive every 2 s; nobody reclaims b from "thief" in the run.
    let env = [("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "6000")];
    push(&mut conn, "llm", &[job("take-a", "a")]).await;
    let mut w = WorkerProc::spawn(&cfg, "w1", &env);
    assert!(
        in_flight_at_least(&sim, 1, Duration::from_secs(10)).await,
        "a calls\n{}",
        w.log()
    );
    let ids = push(&mut conn, "llm", &[job("take-b", "b")]).await;
    let b = ids[0].clone();
    // b is read and waits for the slot; then another consumer takes it over.
    let read = wait_for(Duration::from_secs(5), || {
        let mut c = conn.clone();
        async move { pending_count(&mut c, "{llm}:jobs", "workers").await == 2 }
    })
    .await;
    assert!(read, "b read by w1\n{}", w.log());
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg("{llm}:jobs")
        .arg("workers")
        .arg("thief")
        .arg(0)
        .arg(&b)
        .query_async(&mut conn)
        .await?;
    assert!(
        wait_log(&w, "taken over by another worker", Duration::from_secs(5)).await,
        "the keepalive saw it\n{}",
        w.log()
    );
    // a's call ends at about 4 s and its slot goes to b's task: which must not call.
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await,
        &[&w],
    )?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let calls = sim.sim.stats().calls_per_job;
    assert_eq!(calls.get("take-a"), Some(&1), "{calls:?}");
    assert_eq!(
        calls.get("take-b"),
        None,
        "b was not called here\n{}",
        w.log()
    );
    stop_clean(&mut w, Duration::from_secs(20)).await;
    Ok(())
}

/// Review of the above: an entry pending under another consumer, or settled by another
/// worker (acknowledged, no tombstone), counts as taken over: a job not yet calling must
/// not call. One dropped from the pending list by a reclaim after the producer deleted it
/// (a tombstone, written in the same step) is gone but not taken: its worker still calls
/// and writes its result through the tombstone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_tells_taken_over_entries_from_acknowledged_or_dropped_ones() -> anyhow::Result<()>
{
    let redis = RedisServer::start();
    let q = queue_named(&redis, "worker-a", 3000);
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(
        &mut conn,
        "llm",
        &[idless("t"), idless("k"), idless("d"), idless("o")],
    )
    .await;
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("workers")
        .arg("worker-a")
        .arg("COUNT")
        .arg(10)
        .arg("STREAMS")
        .arg("{llm}:jobs")
        .arg(">")
        .query_async(&mut conn)
        .await?;
    // t: taken over by another consumer; k: acknowledged elsewhere; d: deleted by the
    // producer and dropped from the pending list (XACK stands for XAUTOCLAIM's drop);
    // o: still ours.
    let _: redis::Value = redis::cmd("XCLAIM")
        .arg("{llm}:jobs")
        .arg("workers")
        .arg("thief")
        .arg(0)
        .arg(&ids[0])
        .query_async(&mut conn)
        .await?;
    let _: i64 = conn.xack("{llm}:jobs", "workers", &[&ids[1]]).await?;
    let _: i64 = conn.xdel("{llm}:jobs", &[&ids[2]]).await?;
    let _: i64 = conn.xack("{llm}:jobs", "workers", &[&ids[2]]).await?;
    let _: i64 = conn
        .zadd("{llm}:dropped", &ids[2], 9_999_999_999_999i64)
        .await?;
    let entries: Vec<(String, String)> = ids.iter().map(|e| (e.clone(), String::new())).collect();
    let hb = q.keepalive_report(&entries).await?;
    let mut gone = hb.gone.clone();
    gone.sort();
    let mut want = vec![ids[0].clone(), ids[1].clone(), ids[2].clone()];
    want.sort();
    assert_eq!(gone, want, "{hb:?}");
    let mut taken = hb.taken.clone();
    taken.sort();
    let mut want = vec![ids[0].clone(), ids[1].clone()];
    want.sort();
    assert_eq!(taken, want, "{hb:?}");
    // A tombstone past its expiry (its score, server ms) no longer lets a result in
    // (commit.lua): the entry counts as taken.
    let _: i64 = conn.zadd("{llm}:dropped", &ids[2], 1i64).await?;
    let hb = q.keepalive_report(&entries).await?;
    assert!(hb.taken.contains(&ids[2]), "{hb:?}");
    // A `dropped` key of another type (an operator's stray key) does not fail the
    // keepalive (the others' idle reset and markers must go on): not taken, as before.
    let _: () = conn.del("{llm}:dropped").await?;
    let _: () = conn.set("{llm}:dropped", "oops").await?;
    let hb = q.keepalive_report(&entries).await?;
    assert!(!hb.taken.contains(&ids[2]), "{hb:?}");
    assert!(hb.taken.contains(&ids[0]), "{hb:?}");
    Ok(())
}
