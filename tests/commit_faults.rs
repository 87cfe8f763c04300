//! The commit path under faults (issue 8, points 1, 2, 4, 6, 7 and 13): a result is
//! never acknowledged without being written, a paid result is never dropped or paid
//! twice because Redis was away, full or misconfigured, and bad input keeps every byte
//! the producer wrote. Real redis-server, the simulated provider over HTTP, the real
//! binary where faults need processes; every wait bounded.

mod common;

use common::*;
use llm_worker::queue::{Commit, CommitOutcome, Queue};
use llm_worker::sim::SimOptions;
use redis::AsyncCommands;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

fn sim_calls(sim: &SimHandle) -> BTreeMap<String, u64> {
    sim.sim.stats().calls_per_job
}

async fn queue_for(redis: &RedisServer, sim: &SimHandle) -> Queue {
    let cfg = TestConfig::new(redis, sim).parsed();
    let pool = llm_worker::connect::commands(&cfg).expect("pool");
    Queue::new(&cfg, pool)
}

fn result_commit(entry: &str, job_id: &str, status: &str, worker: &str) -> Commit {
    Commit {
        entry_id: entry.into(),
        result: vec![
            ("job_id", job_id.as_bytes().to_vec()),
            ("job_entry", entry.as_bytes().to_vec()),
            ("status", status.as_bytes().to_vec()),
            ("worker", worker.as_bytes().to_vec()),
        ],
        dead: vec![],
        dead_is_failed_copy: false,
        dedupe_id: Some(job_id.into()),
        inflight_id: Some(job_id.into()),
        status: status.into(),
        costs: vec![],
    }
}

// ---------------------------------------------------------------------------------------
// Point 1: nothing is acknowledged unless its result is written.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_key_of_wrong_type_leaves_the_job_pending() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let _: () = conn.set("{llm}:results", "x").await?;
    push(&mut conn, "llm", &[job("wt-1", "hi")]).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    assert!(
        wait_for(Duration::from_secs(15), || async {
            sim_calls(&sim).get("wt-1") == Some(&1)
        })
        .await,
        "the job ran\n{}",
        w.log()
    );
    assert!(
        wait_log(&w, "WRONGTYPE", Duration::from_secs(10)).await,
        "{}",
        w.log()
    );
    // Give a wrong ack time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        pending_count(&mut conn, "{llm}:jobs", "workers").await,
        1,
        "nothing acknowledged without its result\n{}",
        w.log()
    );
    assert!(
        w.log().contains("{llm}:results is a string"),
        "the error names the key\n{}",
        w.log()
    );
    // The refused commits added nothing to the cost totals (the script adds them before
    // the result's XADD and undoes them when the XADD is refused).
    let totals: HashMap<String, String> = conn.hgetall("{llm}:cost").await?;
    assert!(totals.is_empty(), "no cost total while refused: {totals:?}");
    // The operator fixes the key: the held result is written, the job not paid again.
    let _: () = conn.del("{llm}:results").await?;
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].1["status"], "ok", "{results:?}");
    assert_eq!(sim_calls(&sim).get("wt-1"), Some(&1));
    let calls: String = conn.hget("{llm}:cost", "m1:calls").await?;
    assert_eq!(calls, "1", "the call counted once");
    assert!(
        wait_for(Duration::from_secs(5), || {
            let mut c = conn.clone();
            async move { pending_count(&mut c, "{llm}:jobs", "workers").await == 0 }
        })
        .await
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_key_of_wrong_type_writes_a_minimal_failed_result() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let _: () = conn.set("{llm}:cost", "x").await?;
    push(&mut conn, "llm", &[job("wc-1", "hi")]).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 1, "{results:?}");
    let r = &results[0].1;
    assert_eq!(r["status"], "failed", "{r:?}");
    assert!(r["error"].contains("{llm}:cost"), "{r:?}");
    assert_eq!(r["attempts"], "1", "{r:?}");
    assert_ne!(
        r["cost_usd"], "0",
        "the paid call's cost is reported: {r:?}"
    );
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    assert_eq!(sim_calls(&sim).get("wc-1"), Some(&1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_and_marker_keys_of_wrong_type_are_named_and_nothing_is_half_written()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    // A dead-letter stream of the wrong type: the invalid job gets a minimal `failed`
    // result naming the key, and no half-written dead letter.
    let _: () = conn.set("{llm}:dead", "x").await?;
    push_fields(&mut conn, "llm", &[("body", b"{}")]).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    let bad = &results[0].1;
    assert_eq!(bad["status"], "failed", "{bad:?}");
    assert!(bad["error"].contains("{llm}:dead is a string"), "{bad:?}");
    let kind: String = redis::cmd("TYPE")
        .arg("{llm}:dead")
        .query_async(&mut conn)
        .await?;
    assert_eq!(kind, "string");
    // A result marker of the wrong type: the job fails without a model call (a call
    // without the idempotency check could pay for the id twice), naming the key.
    let _: () = conn.del("{llm}:dead").await?;
    let _: () = conn.rpush("{llm}:done:mk-1", "x").await?;
    push(&mut conn, "llm", &[job("mk-1", "hi")]).await;
    context(
        wait_len(&mut conn, "{llm}:results", 2, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results.len(), 2, "{results:?}");
    let marked = &results[1].1;
    assert_eq!(marked["status"], "failed", "{marked:?}");
    assert!(
        marked["error"].contains("{llm}:done:mk-1 is a list"),
        "{marked:?}"
    );
    assert_eq!(sim_calls(&sim).get("mk-1"), None, "no model call");
    assert_eq!(xlen(&mut conn, "{llm}:dead").await, 1);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Point 2: a paid result is held through an outage, never dropped or paid twice.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_full_holds_the_result_then_commits_it_once() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 3000,
        ..SimOptions::default()
    })
    .await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job("oom-1", "hi")]).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "1000")]);
    assert!(
        in_flight_at_least(&sim, 1, Duration::from_secs(15)).await,
        "{}",
        w.log()
    );
    // Fill Redis past maxmemory with noeviction: every write is refused with OOM. The
    // limit sits between the usage without and with the big key, so freeing the key
    // (and nothing else) lets writes in again.
    let used = used_memory(&mut conn).await;
    let big = vec![b'x'; 8 << 20];
    let _: () = conn.set("{llm}:big", big).await?;
    set_maxmemory(&mut conn, used + (4 << 20)).await;
    let full = wait_for(Duration::from_secs(10), || {
        let mut c = conn.clone();
        async move {
            let probe: redis::RedisResult<()> = c.set("{llm}:probe", "x").await;
            probe.is_err_and(|e| e.code() == Some("OOM"))
        }
    })
    .await;
    assert!(full, "Redis refuses writes with OOM");
    assert!(
        wait_log(&w, "OOM", Duration::from_secs(10)).await,
        "the commit met OOM (results: {})\n{}",
        xlen(&mut conn, "{llm}:results").await,
        w.log()
    );
    // Full for 4 x claim_idle_ms.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 0);
    let _: () = conn.del("{llm}:big").await?;
    set_maxmemory(&mut conn, 0).await;
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    // Time for a second (wrong) commit or call to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_all_ok_once(&results, 1);
    assert_eq!(
        sim_calls(&sim).get("oom-1"),
        Some(&1),
        "paid once\n{}",
        w.log()
    );
    let calls: String = conn.hget("{llm}:cost", "m1:calls").await?;
    assert_eq!(calls, "1", "the call counted once in the totals");
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

/// Two workers (`claim_idle_ms` 1000, 4 jobs each at once) run `JOBS` calls of 1.5 to
/// 4.5 s; `cut(true)` cuts Redis off from both for 8 x claim_idle_ms (long enough for
/// the pool's connection checks and connects, 2 s each, to fail, so commits fail rather
/// than wait), then `cut(false)` ends the fault. Some calls end while Redis is away
/// (their results wait), some after it is back (their entries look idle for longer than
/// claim_idle_ms by then). Every job ends `ok` exactly once, paid exactly once.
async fn outage_pays_every_job_once(
    redis_url: &str,
    conn: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    cut: impl Fn(bool),
) -> anyhow::Result<()> {
    const JOBS: usize = 16;
    let sim = SimHandle::start(SimOptions {
        latency_ms: 1500,
        jitter_ms: 3000,
        ..SimOptions::default()
    })
    .await;
    let dir = tempfile::tempdir()?;
    let mut tc = TestConfig::with_urls(redis_url, sim.addr);
    tc.concurrency = 4;
    tc.slots = 8;
    let cfg = tc.write(dir.path(), "w.toml");
    let env = [("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "1000")];
    push(conn, "llm", &jobs(prefix, JOBS)).await;
    let w1 = WorkerProc::spawn(&cfg, "w1", &env);
    let w2 = WorkerProc::spawn(&cfg, "w2", &env);
    assert!(
        in_flight_at_least(&sim, 8, Duration::from_secs(15)).await,
        "{}",
        logs_tail(&[&w1, &w2], 20)
    );
    cut(true);
    tokio::time::sleep(Duration::from_secs(8)).await;
    cut(false);
    context(
        wait_len(conn, "{llm}:results", JOBS as u64, Duration::from_secs(60)).await,
        &[&w1, &w2],
    )?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let results = entries(conn, "{llm}:results").await;
    assert_all_ok_once(&results, JOBS);
    let calls = sim_calls(&sim);
    let twice: Vec<_> = calls.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty() && calls.len() == JOBS,
        "every job paid exactly once: {twice:?}\n{}",
        logs_tail(&[&w1, &w2], 30)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_longer_than_claim_idle_pays_every_job_once() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let pid = redis_pid(&mut conn).await;
    let stop = |cut: bool| signal(pid, if cut { libc_sig::STOP } else { libc_sig::CONT });
    outage_pays_every_job_once(&redis.url(), &mut conn, "stop", stop).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_lost_after_the_commit_counts_as_written() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[job("lost-1", "hi")]).await;
    read_as(&mut conn, q.consumer()).await;
    let c = result_commit(&ids[0], "lost-1", "ok", q.consumer());
    let first = format!("{:?}", q.commit(&c).await?);
    assert!(first.contains("Written"), "{first}");
    // The same commit again, as after a reply lost on a dropped connection.
    let again = format!("{:?}", q.commit(&c).await?);
    assert!(again.contains("AlreadyWritten"), "{again}");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 1);
    // Another worker's commit of the same entry is superseded.
    let other = result_commit(&ids[0], "lost-1", "ok", "someone-else");
    let q2 = queue_as(&redis, &sim, "someone-else-2");
    let sup = format!("{:?}", q2.commit(&other).await?);
    assert!(sup.contains("Superseded"), "{sup}");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 1);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Point 4: an entry the producer deletes while it runs still gets its result.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_deleted_by_the_producer_while_running_still_gets_its_result() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 2500,
        ..SimOptions::default()
    })
    .await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let ids = push(&mut conn, "llm", &[job("del-1", "hi")]).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "600")]);
    assert!(
        in_flight_at_least(&sim, 1, Duration::from_secs(15)).await,
        "{}",
        w.log()
    );
    let _: i64 = conn.xdel("{llm}:jobs", &[&ids[0]]).await?;
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_all_ok_once(&results, 1);
    assert_eq!(results[0].1["job_entry"], ids[0]);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    assert!(
        wait_log(
            &w,
            "deleted from the stream by the producer",
            Duration::from_secs(5)
        )
        .await,
        "{}",
        w.log()
    );
    assert_eq!(sim_calls(&sim).get("del-1"), Some(&1));
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Point 6: a `dead` commit never replaces an `ok` result marker.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_copy_of_a_done_id_is_a_duplicate_not_dead() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let env = [
        ("LLM_WORKER__QUEUE__MAX_DELIVERIES", "2"),
        ("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "300"),
    ];
    let mut conn = redis.conn().await;
    push(&mut conn, "llm", &[job("twice-1", "hi")]).await;
    let mut w1 = WorkerProc::spawn(&cfg, "w1", &env);
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(15)).await,
        &[&w1],
    )?;
    stop_clean(&mut w1, Duration::from_secs(10)).await;
    // A second copy of the id, delivered 10 times to a consumer that died.
    let copy = push(&mut conn, "llm", &[job("twice-1", "hi")]).await;
    read_as(&mut conn, "ghost").await;
    xclaim(&mut conn, "ghost", &copy[0], 100_000, 10).await;
    let w2 = WorkerProc::spawn(&cfg, "w2", &env);
    context(
        wait_len(&mut conn, "{llm}:results", 2, Duration::from_secs(15)).await,
        &[&w2],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    let r = &results[1].1;
    assert_eq!(r["status"], "ok", "a duplicate of the ok result: {r:?}");
    assert_eq!(r["duplicate_of"], results[0].0, "{r:?}");
    let marker: String = conn.get("{llm}:done:twice-1").await?;
    assert_eq!(marker, format!("{}|ok", results[0].0));
    assert_eq!(xlen(&mut conn, "{llm}:dead").await, 0);
    assert_eq!(sim_calls(&sim).get("twice-1"), Some(&1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_script_keeps_an_ok_marker() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[job("m-1", "a"), job("m-1", "b")]).await;
    read_as(&mut conn, q.consumer()).await;
    let _ = q
        .commit(&result_commit(&ids[0], "m-1", "ok", q.consumer()))
        .await?;
    let ok: String = conn.get("{llm}:done:m-1").await?;
    assert!(ok.ends_with("|ok"), "{ok}");
    let _ = q
        .commit(&result_commit(&ids[1], "m-1", "dead", q.consumer()))
        .await?;
    let after: String = conn.get("{llm}:done:m-1").await?;
    assert_eq!(after, ok, "the ok marker stays");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 2);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Point 7: delivery counts of exactly the reclaimed entries.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_reports_the_delivery_count_of_every_claimed_entry() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &jobs("dc", 5)).await;
    read_as(&mut conn, "ghost").await;
    // Entries 1 and 3 are this worker's own, recently active: they lie between the
    // stalled ones and must not crowd them out of the delivery-count query.
    for (i, id) in ids.iter().enumerate() {
        if i % 2 == 1 {
            xclaim(&mut conn, q.consumer(), id, 0, 1).await;
        } else {
            xclaim(&mut conn, "ghost", id, 100_000, 6).await;
        }
    }
    let r = q.reclaim(10).await?;
    let got: HashMap<String, u64> = r
        .deliveries
        .iter()
        .map(|d| (d.entry_id.clone(), d.deliveries))
        .collect();
    let want: HashMap<String, u64> = [0, 2, 4].iter().map(|i| (ids[*i].clone(), 7)).collect();
    assert_eq!(got, want);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Point 13 (first half): bad input keeps every field the producer wrote.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_keeps_every_original_field_verbatim() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let body = br#"{"id":"wrong-field","messages":[{"role":"user","content":"hi"}]}"#;
    let odd: &[u8] = b"\xff\x00not utf-8";
    let entry = push_fields(&mut conn, "llm", &[("body", body), ("note", odd)]).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    context(
        wait_len(&mut conn, "{llm}:dead", 1, Duration::from_secs(15)).await,
        &[&w],
    )?;
    let dead = entries_raw(&mut conn, "{llm}:dead").await;
    let d = &dead[0].1;
    assert_eq!(d["job_entry"], entry.as_bytes());
    assert_eq!(d["body"], body.to_vec(), "{d:?}");
    assert_eq!(d["note"], odd.to_vec(), "{d:?}");
    let reason = String::from_utf8_lossy(&d["reason"]).into_owned();
    assert!(
        reason.contains("{llm}:jobs") && !reason.contains("{ns}"),
        "{reason}"
    );
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results[0].1["status"], "invalid", "{results:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Point 2, the real thing: a network partition between the workers and Redis.

/// `ip ARGS`; true on success.
fn ip(args: &[&str]) -> bool {
    std::process::Command::new("ip")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A redis-server inside a network namespace this test creates, reached over a veth pair
/// with link-local addresses (a /30 of 169.254.0.0/16 chosen from the process id, so
/// parallel runs do not collide). `partition` takes the host end of the link down.
/// Dropping it kills the server and deletes the namespace (and with it the veth pair).
struct NetnsRedis {
    ns: String,
    host_if: String,
    addr: String,
    port: u16,
    child: Option<std::process::Child>,
    _dir: tempfile::TempDir,
}

impl NetnsRedis {
    /// `None` when network namespaces cannot be made here (not root, no `ip`).
    fn start() -> Option<NetnsRedis> {
        // Several namespaces per test process (tests run in parallel threads): a
        // sequence number joins the process id in every name and address.
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::SeqCst) % 10;
        let pid = std::process::id();
        let tag = (pid % 10_000) * 10 + seq;
        let ns = format!("lwc{tag}");
        if !ip(&["netns", "add", &ns]) {
            return None;
        }
        let (host_if, peer_if) = (format!("lwh{tag}"), format!("lwp{tag}"));
        let third = 100 + (pid % 100);
        let base = 4 * ((pid / 100 + seq) % 63);
        let host_addr = format!("169.254.{third}.{}", base + 1);
        let addr = format!("169.254.{third}.{}", base + 2);
        let dir = tempfile::tempdir().expect("tempdir");
        let mut me = NetnsRedis {
            ns: ns.clone(),
            host_if: host_if.clone(),
            addr: addr.clone(),
            port: free_port(),
            child: None,
            _dir: dir,
        };
        let ok = ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &peer_if, "netns", &ns,
        ]) && ip(&["addr", "add", &format!("{host_addr}/30"), "dev", &host_if])
            && ip(&["link", "set", &host_if, "up"])
            && ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/30"),
                "dev",
                &peer_if,
            ])
            && ip(&["-n", &ns, "link", "set", &peer_if, "up"])
            && ip(&["-n", &ns, "link", "set", "lo", "up"]);
        assert!(ok, "veth setup in namespace {ns} failed");
        let child = std::process::Command::new("ip")
            .args(["netns", "exec", &ns, "redis-server", "--port"])
            .arg(me.port.to_string())
            // Protected mode refuses non-loopback clients of a password-less server; this
            // one is reachable only over the test's own veth pair.
            .args(["--bind", &addr, "--protected-mode", "no"])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(me._dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server in the namespace");
        me.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect((addr.as_str(), me.port)).is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "redis-server in {ns} did not start"
            );
            // A plain poll while redis-server starts: this helper is synchronous.
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(me)
    }

    fn url(&self) -> String {
        format!("redis://{}:{}", self.addr, self.port)
    }

    fn link(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        assert!(ip(&["link", "set", &self.host_if, state]), "link {state}");
    }
}

impl Drop for NetnsRedis {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        ip(&["netns", "del", &self.ns]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_partition_longer_than_claim_idle_pays_every_job_once() -> anyhow::Result<()> {
    let Some(redis) = NetnsRedis::start() else {
        eprintln!(
            "SKIPPED network_partition_longer_than_claim_idle_pays_every_job_once: `ip netns add` is unavailable here (needs root and iproute2)"
        );
        return Ok(());
    };
    let client = redis::Client::open(redis.url())?;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await??;
    // Both workers cut off from Redis (the link of its namespace down).
    let partition = |cut: bool| redis.link(!cut);
    outage_pays_every_job_once(&redis.url(), &mut conn, "part", partition).await
}

// ---------------------------------------------------------------------------------------
// Contract: an id whose last result was `failed` or `dead` runs again when pushed again;
// an id with an `ok` result is a duplicate.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_id_pushed_again_runs_again_then_is_a_duplicate() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        rules: vec![always("*", llm_worker::sim::Fault::Status { status: 500 })],
        ..SimOptions::default()
    })
    .await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    push(&mut conn, "llm", &[job("rerun-1", "hi")]).await;
    context(
        wait_len(&mut conn, "{llm}:results", 1, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(results[0].1["status"], "failed", "{:?}", results[0].1);
    let failed_calls = sim_calls(&sim).get("rerun-1").copied().unwrap_or(0);
    assert!(failed_calls >= 1, "{failed_calls}");

    // The provider recovers; the same id pushed again runs again.
    sim.sim.set_options(SimOptions::default());
    push(&mut conn, "llm", &[job("rerun-1", "hi")]).await;
    context(
        wait_len(&mut conn, "{llm}:results", 2, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    let r = &results[1].1;
    assert_eq!(r["status"], "ok", "a failed id runs again: {r:?}");
    assert!(!r.contains_key("duplicate_of"), "{r:?}");
    let attempts: u64 = r["attempts"].parse()?;
    assert!(attempts >= 1, "{r:?}");
    assert_eq!(
        sim_calls(&sim).get("rerun-1").copied().unwrap_or(0),
        failed_calls + attempts,
        "the re-run called a model"
    );
    let marker: String = conn.get("{llm}:done:rerun-1").await?;
    assert_eq!(
        marker,
        format!("{}|ok", results[1].0),
        "the ok result replaced the failed marker"
    );

    // Now the id is ok: a third push is a duplicate, no model call.
    push(&mut conn, "llm", &[job("rerun-1", "hi")]).await;
    context(
        wait_len(&mut conn, "{llm}:results", 3, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut conn, "{llm}:results").await;
    let r = &results[2].1;
    assert_eq!(r["status"], "ok", "{r:?}");
    assert_eq!(r["duplicate_of"], results[1].0, "{r:?}");
    assert_eq!(
        sim_calls(&sim).get("rerun-1").copied().unwrap_or(0),
        failed_calls + attempts,
        "no new call for a duplicate"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// A hand-back then a late commit of the old entry: one result per job.

// Stall gate (review hole): a Redis stall shorter than claim_idle_ms but longer than
// claim_idle_ms minus the keepalive period leaves a running entry idle past claim_idle_ms;
// the gate must close on it, and the keepalive must re-create a lapsed in-progress marker.

/// A queue with `claim_idle_ms` 3000 as consumer `who` (no provider needed).
fn queue_named(redis: &RedisServer, who: &str) -> Queue {
    let mut cfg =
        TestConfig::with_urls(&redis.url(), "127.0.0.1:9".parse().expect("addr")).parsed();
    cfg.queue.claim_idle_ms = Duration::from_millis(3000);
    cfg.queue.consumer = who.to_string();
    let pool = llm_worker::connect::commands(&cfg).expect("pool");
    Queue::new(&cfg, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_commit_of_a_handed_back_entry_is_superseded() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let qa = queue_as(&redis, &sim, "worker-a");
    let qb = queue_as(&redis, &sim, "worker-b");
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[job("hb-1", "hi")]).await;
    read_as(&mut conn, qb.consumer()).await;
    let moved = qb.hand_back(&ids[0], Some("hb-1"), 1, None).await?;
    let new = match moved {
        llm_worker::queue::HandBack::Moved(new) => new,
        other => anyhow::bail!("not moved: {other:?}"),
    };
    // Worker A, cut off while holding a paid result for the old entry, commits it late.
    let late = qa
        .commit(&result_commit(&ids[0], "hb-1", "ok", qa.consumer()))
        .await?;
    assert_eq!(
        late,
        CommitOutcome::Superseded,
        "late commit of the old entry"
    );
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 0, "nothing written");
    // The worker of the new entry commits it: the job's only result.
    read_as(&mut conn, qb.consumer()).await;
    let now = qb
        .commit(&result_commit(&new, "hb-1", "ok", qb.consumer()))
        .await?;
    assert!(matches!(now, CommitOutcome::Written { .. }), "{now:?}");
    let results = entries(&mut conn, "{llm}:results").await;
    assert_eq!(
        results.len(),
        1,
        "exactly one result for the job: {results:?}"
    );
    assert_eq!(results[0].1["job_entry"], new);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_shorter_than_claim_idle_but_past_the_keepalive_margin_gates_reclaim()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &jobs("gate", 1)).await;
    read_as(&mut conn, "A").await;
    // A's last keepalive was 3300 ms ago; the fleet's last heartbeat 2500 ms ago (a stall
    // of 2500 ms, under claim_idle_ms, ended just now).
    xclaim(&mut conn, "A", &ids[0], 3300, 1).await;
    let now = server_ms(&mut conn).await;
    let _: () = conn.set("{llm}:heartbeat", now - 2500).await?;
    let b = queue_named(&redis, "B");
    let r = b.reclaim(10).await?;
    let taken: Vec<&str> = r.deliveries.iter().map(|d| d.entry_id.as_str()).collect();
    assert!(
        taken.is_empty(),
        "reclaim took a running entry right after a Redis stall: {taken:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_recreates_a_lapsed_in_progress_marker() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &jobs("mk", 1)).await;
    read_as(&mut conn, "A").await;
    let a = queue_named(&redis, "A");
    let marker = a.keys.inflight("mk-0");
    let _: () = conn.del(&marker).await?;
    let gone = a.keepalive(&[(ids[0].clone(), "mk-0".to_string())]).await?;
    assert!(gone.is_empty(), "entry still A's: {gone:?}");
    let got: Option<String> = conn.get(&marker).await?;
    assert_eq!(got.as_deref(), Some(ids[0].as_str()), "marker re-created");
    let ttl: i64 = conn.pttl(&marker).await?;
    // Three times claim_idle_ms (3000): a Redis stall must last over 2.6 x claim_idle_ms
    // to lapse a marker whose worker still calls.
    assert!(ttl > 6000 && ttl <= 9000, "marker ttl {ttl}");
    // The same from the id claim itself.
    let fresh = a.keys.inflight("fresh-id");
    assert!(matches!(
        a.claim_id("fresh-id", "9-1").await?,
        llm_worker::queue::IdClaim::Claimed
    ));
    let ttl: i64 = conn.pttl(&fresh).await?;
    assert!(ttl > 6000 && ttl <= 9000, "claimed marker ttl {ttl}");
    // Another entry's marker is never overwritten.
    let _: () = conn.set(&marker, "other-entry").await?;
    a.keepalive(&[(ids[0].clone(), "mk-0".to_string())]).await?;
    let got: Option<String> = conn.get(&marker).await?;
    assert_eq!(got.as_deref(), Some("other-entry"));
    Ok(())
}

/// Issue 9's guard on the shared command connection: a command that timed out during a
/// partition leaves its connection behind; the next command runs on a fresh one (another
/// CLIENT ID), and every answer after the link is back belongs to its own command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_timed_out_in_a_partition_is_never_answered_on_a_reused_connection()
-> anyhow::Result<()> {
    let Some(redis) = NetnsRedis::start() else {
        eprintln!(
            "SKIPPED a_command_timed_out_in_a_partition_is_never_answered_on_a_reused_connection: `ip netns add` is unavailable here (needs root and iproute2)"
        );
        return Ok(());
    };
    let unused: std::net::SocketAddr = "127.0.0.1:9".parse()?;
    let cfg = TestConfig::with_urls(&redis.url(), unused).parsed();
    let timeout = cfg.redis.command_timeout_ms;
    let cmds = llm_worker::connect::commands(&cfg)?;
    let mut c = cmds.get().await?;
    for i in 0..20 {
        let _: () = redis::cmd("SET")
            .arg(format!("k{i}"))
            .arg(format!("v{i}"))
            .query_async(&mut c)
            .await?;
    }
    let before: i64 = redis::cmd("CLIENT").arg("ID").query_async(&mut c).await?;
    redis.link(false);
    let mut timed_out = 0;
    for i in 0..10 {
        let r: redis::RedisResult<String> = redis::cmd("GET")
            .arg(format!("k{i}"))
            .query_async(&mut c)
            .await;
        match r {
            Err(e) if e.is_timeout() => timed_out += 1,
            other => anyhow::bail!("GET during the partition: expected a timeout, got {other:?}"),
        }
    }
    assert_eq!(timed_out, 10);
    redis.link(true);
    // Late replies of the timed-out GETs arrive once TCP retransmits; give them time.
    let mut c2 = None;
    let ok = wait_for(Duration::from_secs(20), || {
        let cmds = cmds.clone();
        async move { cmds.get().await.is_ok() }
    })
    .await;
    assert!(ok, "no connection after the link came back");
    for round in 0..3 {
        let mut fresh = cmds.get().await?;
        let after: redis::RedisResult<i64> =
            redis::cmd("CLIENT").arg("ID").query_async(&mut fresh).await;
        let Ok(after) = after else {
            // The first command after the link is back may still race a reconnect.
            tokio::time::sleep(timeout).await;
            continue;
        };
        assert_ne!(
            after, before,
            "round {round}: the timed-out connection was reused"
        );
        for i in (0..20).rev() {
            let v: String = redis::cmd("GET")
                .arg(format!("k{i}"))
                .query_async(&mut fresh)
                .await?;
            assert_eq!(
                v,
                format!("v{i}"),
                "GET k{i} answered with another command's reply"
            );
        }
        c2 = Some(after);
        break;
    }
    assert!(
        c2.is_some(),
        "no command succeeded after the link came back"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Review holes (issue 8, "every promise holds"): the commit cannot fail after its first
// write.

/// Results of `job_id`, once nothing is pending any more.
async fn results_of(
    conn: &mut redis::aio::MultiplexedConnection,
    job_id: &str,
    w: &WorkerProc,
) -> anyhow::Result<Vec<HashMap<String, String>>> {
    let done = wait_for(Duration::from_secs(20), || {
        let mut c = conn.clone();
        async move {
            // Results first: the group exists only once the worker has started.
            entries(&mut c, "{llm}:results")
                .await
                .iter()
                .any(|(_, r)| r["job_id"] == job_id)
                && pending_count(&mut c, "{llm}:jobs", "workers").await == 0
        }
    })
    .await;
    if !done {
        anyhow::bail!("no result for {job_id}\n{}", w.log());
    }
    // A second result would follow the first at once; give it a moment to show.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(entries(conn, "{llm}:results")
        .await
        .into_iter()
        .filter(|(_, r)| r["job_id"] == job_id)
        .map(|(_, r)| r)
        .collect())
}

/// Hole 1a: a cost-totals field that HINCRBY would refuse (not an integer, or the sum
/// leaves int64) is found before the first write: the job gets one minimal `failed`
/// result naming the key and the field, as for a cost key of the wrong type, never a
/// half-written commit plus a second result. A total past 2^53 is still added exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_cost_total_field_gives_one_failed_result_naming_it() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    for (job_id, field, value) in [
        ("nan-1", "m1:cost_picos", "abc"),
        ("ovf-1", "m1:output_tokens", "9223372036854775800"),
    ] {
        let _: () = conn.hset("{llm}:cost", field, value).await?;
        // A field that holds "0" (older workers wrote zero increments) is added to before
        // the refused one, and must be put back as it was, not deleted.
        let zero = (field != "m1:cost_picos").then_some("m1:cost_picos");
        if let Some(z) = zero {
            let _: () = conn.hset("{llm}:cost", z, "0").await?;
        }
        push(&mut conn, "llm", &[job(job_id, "hi")]).await;
        let rs = results_of(&mut conn, job_id, &w).await?;
        assert_eq!(rs.len(), 1, "one result for {job_id}: {rs:?}");
        let r = &rs[0];
        assert_eq!(r["status"], "failed", "{r:?}");
        assert!(
            r["error"].contains("{llm}:cost") && r["error"].contains(field),
            "the error names the key and the field: {r:?}"
        );
        assert_eq!(r["attempts"], "1", "{r:?}");
        assert_ne!(r["cost_usd"], "0", "the paid call is reported: {r:?}");
        let kept: String = conn.hget("{llm}:cost", field).await?;
        assert_eq!(kept, value, "the bad field is left alone");
        let totals: HashMap<String, String> = conn.hgetall("{llm}:cost").await?;
        let mut want = HashMap::from([(field.to_string(), value.to_string())]);
        if let Some(z) = zero {
            want.insert(z.to_string(), "0".to_string());
        }
        assert_eq!(
            totals, want,
            "no cost total half-written (fields added before the refused one put back as they were)"
        );
        assert_eq!(sim_calls(&sim).get(job_id), Some(&1));
        let _: () = conn.hdel("{llm}:cost", field).await?;
    }
    // Exact past 2^53 (a double would round 2^53 + 1).
    let _: () = conn
        .hset("{llm}:cost", "m1:calls", "9007199254740993")
        .await?;
    push(&mut conn, "llm", &[job("big-1", "hi")]).await;
    let rs = results_of(&mut conn, "big-1", &w).await?;
    assert_eq!(rs.len(), 1, "{rs:?}");
    assert_eq!(rs[0]["status"], "ok", "{rs:?}");
    let calls: String = conn.hget("{llm}:cost", "m1:calls").await?;
    assert_eq!(calls, "9007199254740994");
    Ok(())
}

/// Hole 1b: an entry with thousands of fields (more than Lua can pass to one command)
/// that is dead-lettered: one `invalid` result, one dead letter that keeps every field
/// verbatim (packed into `_packed` past 1000 fields, see README), nothing half-written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_of_an_entry_with_thousands_of_fields_keeps_them_all() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = TestConfig::new(&redis, &sim).write(dir.path(), "w.toml");
    let mut conn = redis.conn().await;
    let names: Vec<String> = (0..5000).map(|i| format!("f{i:04}")).collect();
    let values: Vec<Vec<u8>> = (0..5000u32)
        .map(|i| {
            let mut v = format!("v{i}").into_bytes();
            v.extend_from_slice(b"\xff\x00,:");
            v
        })
        .collect();
    let fields: Vec<(&str, &[u8])> = names
        .iter()
        .zip(&values)
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect();
    let entry = push_fields(&mut conn, "llm", &fields).await;
    let w = WorkerProc::spawn(&cfg, "w1", &[]);
    let rs = results_of(&mut conn, &entry, &w).await?;
    assert_eq!(rs.len(), 1, "one result: {rs:?}");
    assert_eq!(rs[0]["status"], "invalid", "{rs:?}");
    let dead = entries_bytes(&mut conn, "{llm}:dead").await;
    assert_eq!(dead.len(), 1, "one dead letter");
    let d = llm_worker::queue::DeadLetter::from_fields(&dead[0].1)?;
    assert_eq!(d.job_entry, entry);
    let mut want: Vec<(Vec<u8>, Vec<u8>)> = names
        .into_iter()
        .map(String::into_bytes)
        .zip(values)
        .collect();
    want.sort();
    let mut got = d.original().to_vec();
    got.sort();
    assert_eq!(got.len(), want.len());
    assert!(got == want, "every original field verbatim");
    Ok(())
}

/// Hole 1a, the script on its own at the edges of HINCRBY's range: exact to the last unit
/// (doubles would round there), and a refused field writes nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_totals_check_is_exact_at_the_int64_edges() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let cases: [(&str, &str, i64, Option<&str>); 5] = [
        ("a", "9223372036854775806", 1, Some("9223372036854775807")),
        ("b", "9223372036854775807", 1, None),
        ("c", "-9223372036854775808", 5, Some("-9223372036854775803")),
        ("d", "0012", 1, None),
        ("e", "-0", 1, None),
    ];
    for (i, (field, value, inc, want)) in cases.into_iter().enumerate() {
        let _: () = conn.hset("{llm}:cost", field, value).await?;
        let id = format!("edge-{i}");
        let entry = push(&mut conn, "llm", &[job(&id, "hi")]).await.remove(0);
        read_as(&mut conn, q.consumer()).await;
        let mut c = result_commit(&entry, &id, "ok", q.consumer());
        c.costs = vec![("m1:calls".into(), 1), (field.into(), inc)];
        let before = xlen(&mut conn, "{llm}:results").await;
        let r = q.commit(&c).await;
        let now: String = conn.hget("{llm}:cost", field).await?;
        match want {
            Some(w) => {
                assert!(
                    matches!(r, Ok(CommitOutcome::Written { .. })),
                    "{field}: {r:?}"
                );
                assert_eq!(now, w, "{field}");
            }
            None => {
                let e = r.expect_err(field);
                assert!(!e.heals(), "{field}: like a key of the wrong type: {e}");
                assert!(
                    e.to_string().contains("{llm}:cost") && e.to_string().contains(field),
                    "{e}"
                );
                assert_eq!(now, value, "{field} untouched");
                assert_eq!(xlen(&mut conn, "{llm}:results").await, before, "{field}");
                let pending = pending_count(&mut conn, "{llm}:jobs", "workers").await;
                assert_eq!(pending, 1, "{field}: still pending");
                let _: () = conn.hdel("{llm}:cost", field).await?;
                let r = q.commit(&c).await;
                assert!(matches!(r, Ok(CommitOutcome::Written { .. })), "{r:?}");
            }
        }
    }
    let calls: String = conn.hget("{llm}:cost", "m1:calls").await?;
    assert_eq!(calls, "5", "each commit added its calls once");
    Ok(())
}

/// Review finding: a jobs stream deleted under a running job is reported as what it is
/// (no group, NOGROUP), not as "a key of the wrong type".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_jobs_stream_is_not_called_a_wrong_type() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let entry = push(&mut conn, "llm", &[job("gone-1", "hi")])
        .await
        .remove(0);
    read_as(&mut conn, q.consumer()).await;
    let _: () = conn.del("{llm}:jobs").await?;
    let e = q
        .commit(&result_commit(&entry, "gone-1", "ok", q.consumer()))
        .await
        .expect_err("no group");
    assert!(e.to_string().contains("NOGROUP"), "{e}");
    assert!(!e.to_string().contains("WRONGTYPE"), "{e}");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 0, "nothing written");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Commits in batches (issue 9): one call of lua/commit.lua for the jobs that finished
// while the previous call ran. Each job is still committed, or refused, on its own.

/// Cost fields of one call of model m1 costing `picos`.
fn m1_costs(picos: i64) -> Vec<(String, i64)> {
    vec![
        ("m1:cost_picos".into(), picos),
        ("m1:input_tokens".into(), 10),
        ("m1:calls".into(), 1),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_commits_each_job_on_its_own() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let other = queue_as(&redis, &sim, "worker-b");
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(
        &mut conn,
        "llm",
        &[
            job("b-1", "a"),
            job("b-2", "b"),
            job("b-3", "c"),
            job("b-4", "d"),
        ],
    )
    .await;
    read_as(&mut conn, q.consumer()).await;
    // b-2's copy for retries goes to a key of the wrong type; b-3 was committed by
    // another worker meanwhile (a take-over).
    let _: () = conn.set("{llm}:failed", "x").await?;
    let taken = other
        .commit(&result_commit(&ids[2], "b-3", "ok", other.consumer()))
        .await?;
    assert!(matches!(taken, CommitOutcome::Written { .. }), "{taken:?}");
    let mut cs = vec![];
    for (i, id) in ids.iter().enumerate() {
        let mut c = result_commit(id, &format!("b-{}", i + 1), "ok", q.consumer());
        c.costs = m1_costs(1000 * (i as i64 + 1));
        cs.push(c);
    }
    cs[1].status = "failed".into();
    cs[1].dead = vec![(b"job_entry".to_vec(), ids[1].as_bytes().to_vec())];
    cs[1].dead_is_failed_copy = true;
    let refs: Vec<&Commit> = cs.iter().collect();
    let out = q.commit_batch(&refs).await?;
    assert_eq!(out.len(), 4, "{out:?}");
    assert!(
        matches!(out[0], Ok(CommitOutcome::Written { .. })),
        "{out:?}"
    );
    let e = out[1].as_ref().expect_err("b-2 refused");
    assert!(!e.heals() && e.to_string().contains("{llm}:failed"), "{e}");
    assert_eq!(
        out[2].as_ref().ok(),
        Some(&CommitOutcome::Superseded),
        "{out:?}"
    );
    assert!(
        matches!(out[3], Ok(CommitOutcome::Written { .. })),
        "{out:?}"
    );
    // Two results of this batch (plus the other worker's), b-2 still pending, and the
    // cost totals hold exactly b-1's and b-4's.
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 3);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 1);
    let totals: HashMap<String, String> = conn.hgetall("{llm}:cost").await?;
    assert_eq!(
        totals.get("m1:cost_picos").map(String::as_str),
        Some("5000")
    );
    assert_eq!(totals.get("m1:calls").map(String::as_str), Some("2"));
    assert_eq!(
        totals.get("m1:input_tokens").map(String::as_str),
        Some("20")
    );
    let done: Option<String> = conn.get("{llm}:done:b-2").await?;
    assert_eq!(done, None, "nothing written for the refused job");
    // The same batch again: each written job is recognised, nothing is written twice.
    let _: () = conn.del("{llm}:failed").await?;
    let again = q.commit_batch(&refs).await?;
    assert!(
        matches!(again[0], Ok(CommitOutcome::AlreadyWritten { .. })),
        "{again:?}"
    );
    assert!(
        matches!(again[1], Ok(CommitOutcome::Written { .. })),
        "{again:?}"
    );
    assert_eq!(again[2].as_ref().ok(), Some(&CommitOutcome::Superseded));
    assert!(
        matches!(again[3], Ok(CommitOutcome::AlreadyWritten { .. })),
        "{again:?}"
    );
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 4);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    let picos: String = conn.hget("{llm}:cost", "m1:cost_picos").await?;
    assert_eq!(picos, "7000", "b-2's cost added once, when it was written");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batchs_cost_sums_are_exact_and_an_overflow_of_the_sum_sends_each_job_alone()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    // Increments past 2^53 (Lua's numbers are doubles): the sum is exact.
    let ids = push(&mut conn, "llm", &[job("s-1", "a"), job("s-2", "b")]).await;
    read_as(&mut conn, q.consumer()).await;
    let mut a = result_commit(&ids[0], "s-1", "ok", q.consumer());
    a.costs = vec![("big".into(), 4503599627370497)];
    let mut b = result_commit(&ids[1], "s-2", "ok", q.consumer());
    b.costs = vec![("big".into(), 4503599627370498)];
    let out = q.commit_batch(&[&a, &b]).await?;
    assert!(
        out.iter()
            .all(|r| matches!(r, Ok(CommitOutcome::Written { .. }))),
        "{out:?}"
    );
    let big: String = conn.hget("{llm}:cost", "big").await?;
    assert_eq!(big, "9007199254740995");
    // Two jobs that each fit alone but whose sum leaves the 64-bit range: the batch
    // refuses both and changes nothing; sent through `commit_shared` each goes alone,
    // so the first is written and only the second is refused, naming the field.
    let _: () = conn
        .hset("{llm}:cost", "edge", "9223372036854775800")
        .await?;
    let ids = push(&mut conn, "llm", &[job("s-3", "a"), job("s-4", "b")]).await;
    read_as(&mut conn, q.consumer()).await;
    let mut c = result_commit(&ids[0], "s-3", "ok", q.consumer());
    c.costs = vec![("edge".into(), 5), ("m1:calls".into(), 1)];
    let mut d = result_commit(&ids[1], "s-4", "ok", q.consumer());
    d.costs = vec![("edge".into(), 5), ("m1:calls".into(), 1)];
    let out = q.commit_batch(&[&c, &d]).await?;
    assert!(out.iter().all(|r| r.is_err()), "{out:?}");
    let edge: String = conn.hget("{llm}:cost", "edge").await?;
    assert_eq!(edge, "9223372036854775800", "untouched");
    let calls: Option<String> = conn.hget("{llm}:cost", "m1:calls").await?;
    assert_eq!(calls, None, "the undo puts back exactly what was there");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 2);
    let (rc, rd) = tokio::join!(
        q.commit_shared(std::sync::Arc::new(c)),
        q.commit_shared(std::sync::Arc::new(d))
    );
    let (ok, refused) = match (&rc, &rd) {
        (Ok(_), Err(e)) | (Err(e), Ok(_)) => (if rc.is_ok() { &rc } else { &rd }, e),
        _ => panic!("one written, one refused: {rc:?} {rd:?}"),
    };
    assert!(matches!(ok, Ok(CommitOutcome::Written { .. })), "{ok:?}");
    assert!(
        refused.to_string().contains("field edge") && !refused.heals(),
        "{refused}"
    );
    let edge: String = conn.hget("{llm}:cost", "edge").await?;
    assert_eq!(edge, "9223372036854775805");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 3);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_made_together_share_calls_and_each_gets_its_own_answer() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let jobs: Vec<_> = (0..200).map(|i| job(&format!("t-{i}"), "x")).collect();
    let ids = push(&mut conn, "llm", &jobs).await;
    read_as(&mut conn, q.consumer()).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await?;
    let calls = ids.iter().enumerate().map(|(i, id)| {
        let mut c = result_commit(id, &format!("t-{i}"), "ok", q.consumer());
        c.costs = m1_costs(7);
        let q = q.clone();
        async move { q.commit_shared(std::sync::Arc::new(c)).await }
    });
    let out = futures::future::join_all(calls).await;
    assert!(
        out.iter()
            .all(|r| matches!(r, Ok(CommitOutcome::Written { .. })))
    );
    let ids_written: std::collections::HashSet<_> = out
        .iter()
        .map(|r| match r {
            Ok(CommitOutcome::Written { result_id }) => result_id.clone(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(ids_written.len(), 200, "each job its own result");
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 200);
    assert_eq!(pending_count(&mut conn, "{llm}:jobs", "workers").await, 0);
    let picos: String = conn.hget("{llm}:cost", "m1:cost_picos").await?;
    assert_eq!(picos, "1400");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    let evalsha: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        (1..200).contains(&evalsha),
        "200 commits made together share calls: {evalsha} calls"
    );
    Ok(())
}

/// Review of the batches: two copies of id X end in one call, the one that ran (`ok`) and
/// one a cancel marker stopped before any model call (`cancelled`). Committed one after
/// the other, the `ok` marker stays; in one call the later job must not act on a read of
/// the marker made before the earlier job set it (a third copy would run, and be paid,
/// again). Failed before the fix: the third copy was `Claimed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ok_marker_is_not_replaced_by_a_later_job_of_the_same_batch() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[job("X", "a"), job("X", "b")]).await;
    read_as(&mut conn, q.consumer()).await;
    let a = result_commit(&ids[0], "X", "ok", q.consumer());
    let b = result_commit(&ids[1], "X", "cancelled", q.consumer());
    let out = q.commit_batch(&[&a, &b]).await?;
    assert!(
        matches!(out[0], Ok(CommitOutcome::Written { .. })),
        "{out:?}"
    );
    let e = out[1]
        .as_ref()
        .expect_err("the second copy is refused in this call");
    assert!(!e.heals() && e.to_string().contains("send it alone"), "{e}");
    // Sent alone (as `commit_shared` does), it is written and the ok marker stays.
    let alone = q.commit_shared(std::sync::Arc::new(b)).await?;
    assert!(matches!(alone, CommitOutcome::Written { .. }), "{alone:?}");
    let marker: String = conn.get("{llm}:done:X").await?;
    assert!(marker.ends_with("|ok"), "{marker}");
    let claim = q.claim_id("X", "9999999999999-0").await?;
    assert!(
        matches!(claim, llm_worker::queue::IdClaim::Done { .. }),
        "marker {marker}: a third copy gets {claim:?}"
    );
    // Two commits of one id made together are never put in one call.
    let ids = push(&mut conn, "llm", &[job("Y", "a"), job("Y", "b")]).await;
    read_as(&mut conn, q.consumer()).await;
    let (ra, rb) = tokio::join!(
        q.commit_shared(std::sync::Arc::new(result_commit(
            &ids[0],
            "Y",
            "ok",
            q.consumer()
        ))),
        q.commit_shared(std::sync::Arc::new(result_commit(
            &ids[1],
            "Y",
            "cancelled",
            q.consumer()
        )))
    );
    assert!(matches!(ra, Ok(CommitOutcome::Written { .. })), "{ra:?}");
    assert!(matches!(rb, Ok(CommitOutcome::Written { .. })), "{rb:?}");
    let marker: String = conn.get("{llm}:done:Y").await?;
    assert!(marker.ends_with("|ok"), "{marker}");
    Ok(())
}

/// Review of the batches: the same entry twice in one call gets one result (the second
/// is refused in the call, and alone it is recognised as already written).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_entry_twice_in_one_call_gets_one_result() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let q = queue_for(&redis, &sim).await;
    let mut conn = redis.conn().await;
    create_group(&mut conn).await;
    let ids = push(&mut conn, "llm", &[job("twice", "a")]).await;
    read_as(&mut conn, q.consumer()).await;
    let mut c = result_commit(&ids[0], "twice", "ok", q.consumer());
    c.dedupe_id = None;
    c.inflight_id = None;
    let out = q.commit_batch(&[&c, &c]).await?;
    assert!(
        matches!(out[0], Ok(CommitOutcome::Written { .. })),
        "{out:?}"
    );
    assert!(out[1].is_err(), "{out:?}");
    let again = q.commit(&c).await?;
    assert!(
        matches!(again, CommitOutcome::AlreadyWritten { .. }),
        "{again:?}"
    );
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 1);
    Ok(())
}
