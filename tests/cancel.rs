//! Cancel and deadlines (statuses `cancelled` and `expired`): a job that must not start
//! ends with no model call; a running one has its call aborted (the simulated provider
//! sees it end), its slot released, and exactly one result. The real binary, a real
//! redis-server, the simulated provider over HTTP; `cancel` runs as another process.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(20);

fn now_ms() -> u64 {
    llm_worker::cost::unix_now_ms()
}

fn job_with(id: &str, extra: serde_json::Value) -> String {
    let mut v = serde_json::json!({"id": id, "messages": [{"role": "user", "content": "hi"}]});
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    v.to_string()
}

fn by_id(
    results: &[(String, HashMap<String, String>)],
) -> HashMap<String, HashMap<String, String>> {
    results
        .iter()
        .map(|(_, r)| (r["job_id"].clone(), r.clone()))
        .collect()
}

/// Sets job `id`'s cancel marker as `cancel` writes it (a string with a TTL).
async fn set_cancel_marker(
    conn: &mut redis::aio::MultiplexedConnection,
    id: &str,
) -> redis::RedisResult<()> {
    redis::cmd("SET")
        .arg(format!("{{llm}}:cancel:{id}"))
        .arg("1")
        .arg("EX")
        .arg(600)
        .query_async(conn)
        .await
}

fn calls_of(sim: &SimHandle, id: &str) -> u64 {
    sim.sim.stats().calls_per_job.get(id).copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_cancelled_before_a_worker_takes_it_makes_no_call() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "c.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;
    push(
        &mut conn,
        "llm",
        &[job("q-cancel", "hi"), job("q-keep", "hi")],
    )
    .await;
    let out = run_bin_async(&["--config", cfg_s, "cancel", "q-cancel"], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(out.stdout.contains("cancel requested"), "{}", out.all());

    let mut w = WorkerProc::spawn(&cfg, "c1", &[]);
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r["q-cancel"]["status"], "cancelled", "{:?}", r["q-cancel"]);
    assert!(
        r["q-cancel"]["error"].starts_with("cancelled:"),
        "{:?}",
        r["q-cancel"]
    );
    assert_eq!(r["q-cancel"]["attempts"], "0");
    assert_eq!(r["q-cancel"]["cost_usd"], "0");
    assert_eq!(r["q-keep"]["status"], "ok");
    assert_eq!(
        calls_of(&sim, "q-cancel"),
        0,
        "no model call for a cancelled job"
    );

    // An id that already ended ok cannot be cancelled: the CLI says so and exits 1.
    let out = run_bin_async(&["--config", cfg_s, "cancel", "q-keep"], &[], T).await;
    assert_eq!(out.code, Some(1), "{}", out.all());
    assert!(out.stderr.contains("already ended ok"), "{}", out.all());
    stop_clean(&mut w, T).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_call_is_aborted_by_a_cancel_from_another_process() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 60_000,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.slots = 1;
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "c.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "c-run", &[]);
    push(&mut conn, "llm", &[job("long-1", "hi")]).await;
    assert!(
        in_flight_at_least(&sim, 1, T).await,
        "the call never started\n{}",
        w.log()
    );
    assert_eq!(
        slot_keys(&mut conn, "llm").await.len(),
        1,
        "the call holds the slot"
    );

    let asked = Instant::now();
    let out = run_bin_async(&["--config", cfg_s, "cancel", "long-1"], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w])?;
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "cancel reached the running job in {took:?}"
    );
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    let res = &r["long-1"];
    assert_eq!(res["status"], "cancelled", "{res:?}");
    assert!(res["error"].contains("aborted"), "{res:?}");
    assert_eq!(res["attempts"], "1", "{res:?}");
    // The call ended at the provider, and the slot is free again.
    assert!(
        wait_for(Duration::from_secs(5), || async {
            sim.sim.stats().in_flight == 0
        })
        .await,
        "the provider still sees the call"
    );
    assert!(
        wait_for(Duration::from_secs(5), || async {
            slot_keys(&mut redis.conn().await, "llm").await.is_empty()
        })
        .await,
        "the slot was not released"
    );
    // Settled: no second result arrives later.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(xlen(&mut conn, "{llm}:results").await, 1);
    stop_clean(&mut w, T).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_expire_a_job_not_started_and_abort_one_running_past_it() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 60_000,
        ..SimOptions::default()
    })
    .await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "d.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "d1", &[]);
    // Started first, so the deadline measures the job, not the process's start.
    assert_started(&[&w]).await;
    let pushed = Instant::now();
    push(
        &mut conn,
        "llm",
        &[
            job_with("late", serde_json::json!({"deadline_ms": now_ms() - 1000})),
            job_with(
                "runs-over",
                serde_json::json!({"deadline_ms": now_ms() + 3000}),
            ),
        ],
    )
    .await;
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    let took = pushed.elapsed();
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r["late"]["status"], "expired", "{:?}", r["late"]);
    assert!(
        r["late"]["error"].contains("before any model call"),
        "{:?}",
        r["late"]
    );
    assert_eq!(calls_of(&sim, "late"), 0);
    let over = &r["runs-over"];
    assert_eq!(over["status"], "expired", "{over:?}");
    assert!(over["error"].contains("aborted"), "{over:?}");
    assert_eq!(calls_of(&sim, "runs-over"), 1);
    assert!(
        took >= Duration::from_millis(2800) && took < Duration::from_secs(8),
        "expired at its deadline, not before nor much after: {took:?}"
    );
    assert!(
        wait_for(Duration::from_secs(5), || async {
            sim.sim.stats().in_flight == 0
        })
        .await,
        "the provider still sees the aborted call"
    );

    // A deadline that is not a Unix time in ms is a clear `invalid`, not a silent default.
    push(
        &mut conn,
        "llm",
        &[job_with(
            "bad-deadline",
            serde_json::json!({"deadline_ms": "soon"}),
        )],
    )
    .await;
    context(wait_len(&mut conn, "{llm}:results", 3, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r["bad-deadline"]["status"], "invalid");
    assert!(
        r["bad-deadline"]["error"].contains("deadline_ms"),
        "{:?}",
        r["bad-deadline"]
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// A call cut off by a deadline (or a cancel) may still be billed by the provider: like a
/// call cut off by its timeout, its worst case stays counted in the budgets (settled,
/// not left to lapse with its reservation), and the result says the cost is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_call_stays_counted_at_its_worst_case_in_the_budget() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms: 60_000,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.extra = "[budgets.day]\nusd_per_day = \"100\"\n".into();
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "b.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "b1", &[]);
    assert_started(&[&w]).await;
    push(
        &mut conn,
        "llm",
        &[job_with(
            "cut",
            serde_json::json!({"deadline_ms": now_ms() + 2000}),
        )],
    )
    .await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r["cut"]["status"], "expired", "{:?}", r["cut"]);
    assert_eq!(calls_of(&sim, "cut"), 1);
    assert!(
        r["cut"].get("warning").is_some_and(|w| w.contains("cost")),
        "the result says the aborted call's cost is unknown: {:?}",
        r["cut"]
    );
    let keys = llm_worker::connect::scan_match(&mut conn, "{llm}:budget:day:*").await?;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let spent_now = || {
        let k = keys[0].clone();
        let r = &redis;
        async move {
            let mut c = r.conn().await;
            let s: Option<i64> = redis::cmd("HGET")
                .arg(&k)
                .arg("spent")
                .query_async(&mut c)
                .await
                .unwrap_or(None);
            s.unwrap_or(0)
        }
    };
    assert!(
        wait_for(Duration::from_secs(5), || async { spent_now().await > 0 }).await,
        "the aborted call's worst case is not settled in the budget"
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// A job stopped while its slot acquisition is on the wire (the acquire script ran in
/// Redis, its reply not yet read) does not strand the slot until its TTL: the slot it
/// took is released as soon as the reply arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_stopped_during_its_slot_acquisition_strands_no_slot() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.ttl_ms = 30_000; // a stranded slot would stay 30 s
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "s.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(
        &cfg,
        "s1",
        &[("LLM_WORKER_DEBUG_SLOW_ACQUIRE_REPLY_MS", "3000")],
    );
    // Started first, so the deadline (1.5 s) falls within the slowed reply (3 s) even
    // on a loaded machine.
    assert_started(&[&w]).await;
    push(
        &mut conn,
        "llm",
        &[job_with(
            "mid-acquire",
            serde_json::json!({"deadline_ms": now_ms() + 1500}),
        )],
    )
    .await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(
        r["mid-acquire"]["status"], "expired",
        "{:?}",
        r["mid-acquire"]
    );
    assert!(
        w.log().contains("debug hook: slowing an acquire reply"),
        "the hook ran: {}",
        w.log()
    );
    assert!(
        wait_for(Duration::from_secs(5), || async {
            slot_keys(&mut redis.conn().await, "llm").await.is_empty()
        })
        .await,
        "the slot taken by the stopped acquisition is stranded: {:?}",
        slot_keys(&mut conn, "llm").await
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// A job without an `id` is cancelled by its entry id (its job id); queued, it ends with
/// no model call, like a job with one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_without_an_id_is_cancelled_by_its_entry_id_without_a_call()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "n.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;
    let idless = |text: &str| {
        serde_json::json!({"messages": [{"role": "user", "content": text}],
            "metadata": {"note": "no id here"}})
        .to_string()
    };
    let entries_pushed = push(&mut conn, "llm", &[idless("cancel me"), idless("keep me")]).await;
    let out = run_bin_async(&["--config", cfg_s, "cancel", &entries_pushed[0]], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let mut w = WorkerProc::spawn(&cfg, "n1", &[]);
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    let c = &r[&entries_pushed[0]];
    assert_eq!(c["status"], "cancelled", "{c:?}");
    assert_eq!(c["attempts"], "0", "no model call: {c:?}");
    assert_eq!(r[&entries_pushed[1]]["status"], "ok");
    assert_eq!(
        sim.sim.stats().calls_per_job.values().sum::<u64>(),
        1,
        "one call, for the other job"
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// Review finding: a cancel marker is a string (what `cancel` and the README's `SET`
/// write), read the same way wherever it is checked: a key of another type at that name
/// cancels neither a job with an id (checked by its claim) nor one without (checked by
/// the reader's batch MGET); both run and end ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_key_that_is_not_a_string_is_read_alike_for_every_job() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "c.toml");
    let mut conn = redis.conn().await;
    let _: () = redis::AsyncCommands::hset(&mut conn, "{llm}:cancel:odd-1", "x", 1).await?;
    let idless = push(
        &mut conn,
        "llm",
        &[
            job("odd-1", "hi"),
            r#"{"messages":[{"role":"user","content":"hi"}]}"#.into(),
        ],
    )
    .await;
    let key = format!("{{llm}}:cancel:{}", idless[1]);
    let _: () = redis::AsyncCommands::hset(&mut conn, &key, "x", 1).await?;
    let mut w = WorkerProc::spawn(&cfg, "c1", &[]);
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r["odd-1"]["status"], "ok", "{:?}", r["odd-1"]);
    assert_eq!(r[&idless[1]]["status"], "ok", "{:?}", r[&idless[1]]);
    stop_clean(&mut w, T).await;
    Ok(())
}

/// Every key of the namespace but `cancel:*` for the default user (what the tests below
/// give a worker), full access for a user `admin` (the test's own writes).
async fn refuse_cancel_markers(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<()> {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("admin")
        .arg("on")
        .arg(">admin-pw")
        .arg("~*")
        .arg("+@all")
        .query_async(conn)
        .await?;
    refuse_cancel_markers_to_default_user(conn).await
}

async fn admin_conn(redis: &RedisServer) -> anyhow::Result<redis::aio::MultiplexedConnection> {
    // The test's server listens on a unix socket: the user goes in the query.
    let url = format!("{}?user=admin&pass=admin-pw", redis.url());
    Ok(redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?)
}

/// A Redis user that may not touch the cancel markers (an ACL without `{llm}:cancel:*`)
/// stops the worker at start with exit 2 and a message naming the keys, before any job
/// is read: the queued job stays in the stream, unread, no call, no result, no letter.
/// (Before the start probe, every job without an id failed `cancel check impossible`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_user_that_may_not_touch_cancel_markers_stops_the_worker_at_start()
-> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "s.toml");
    let mut conn = redis.conn().await;
    let idless =
        serde_json::json!({"messages": [{"role": "user", "content": "keep me"}]}).to_string();
    let pushed = push(&mut conn, "llm", &[idless]).await;
    refuse_cancel_markers(&mut conn).await?;
    let mut admin = admin_conn(&redis).await?;
    let mut w = WorkerProc::spawn(&cfg, "s1", &[]);
    let status = wait_exit(&mut w, T).await;
    assert_eq!(status.and_then(|s| s.code()), Some(2), "{}", w.log());
    let log = w.log();
    assert!(log.contains("{llm}:cancel:*"), "names the keys: {log}");
    assert_eq!(calls_of(&sim, &pushed[0]), 0);
    assert!(entries(&mut admin, "{llm}:results").await.is_empty());
    assert!(entries(&mut admin, "{llm}:dead").await.is_empty());
    assert_eq!(
        entries(&mut admin, "{llm}:jobs").await.len(),
        1,
        "still queued"
    );
    // Stopped before its reader made the group: nothing was read.
    let groups: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg("{llm}:jobs")
        .query_async(&mut admin)
        .await?;
    assert!(groups.is_empty(), "unread: {groups:?}");
    Ok(())
}

/// Review finding: a job without an id whose cancel marker cannot be read at all (an ACL
/// that refuses `{llm}:cancel:*`, set while the worker runs, after its start probe: the
/// reader's batch check and the job's own check both fail) is not called as if it had no
/// marker: it fails with no model call, its error naming the check, and nothing of it is
/// lost (its result, and a dead letter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_without_an_id_whose_cancel_marker_cannot_be_read_is_not_called() -> anyhow::Result<()>
{
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "p.toml");
    let mut conn = redis.conn().await;
    let mut w = WorkerProc::spawn(&cfg, "p1", &[]);
    // Taking jobs (past its start probe) before the ACL changes.
    push(&mut conn, "llm", &[job("p-first", "hi")]).await;
    context(wait_len(&mut conn, "{llm}:results", 1, T).await, &[&w])?;
    refuse_cancel_markers(&mut conn).await?;
    let mut admin = admin_conn(&redis).await?;
    let idless =
        serde_json::json!({"messages": [{"role": "user", "content": "cancel me"}]}).to_string();
    let pushed = push(&mut admin, "llm", &[idless]).await;
    set_cancel_marker(&mut admin, &pushed[0]).await?;
    context(wait_len(&mut admin, "{llm}:results", 2, T).await, &[&w])?;
    let r = by_id(&entries(&mut admin, "{llm}:results").await);
    let x = &r[&pushed[0]];
    assert_eq!(calls_of(&sim, &pushed[0]), 0, "no call: {x:?}\n{}", w.log());
    assert_eq!(x["status"], "failed", "{x:?}");
    assert!(x["error"].contains("cancel check"), "{x:?}");
    assert_eq!(x["attempts"], "0", "{x:?}");
    // Kept whole, as every job that fails without a call is: a dead letter with the
    // producer's fields.
    let dead = entries(&mut admin, "{llm}:dead").await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].1["reason"].contains("cancel check"), "{dead:?}");
    assert_eq!(
        pending_count(&mut admin, "{llm}:jobs", "workers").await,
        0,
        "settled"
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// Review finding: the reader's one cancel check for a batch answers each id-less entry
/// its own flag, whatever entries of the batch it skips (a job with an id, checked by its
/// claim). A batch of a job with an id, then two without, the last cancelled: only the
/// last ends cancelled; the one between runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_cancel_check_gives_each_job_without_an_id_its_own_flag() -> anyhow::Result<()> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions::default()).await;
    let tc = TestConfig::new(&redis, &sim);
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "b.toml");
    let cfg_s = cfg.to_str().unwrap();
    let mut conn = redis.conn().await;
    let idless = |text: &str| {
        serde_json::json!({"messages": [{"role": "user", "content": text}]}).to_string()
    };
    let pushed = push(
        &mut conn,
        "llm",
        &[job("b-keyed", "hi"), idless("run me"), idless("cancel me")],
    )
    .await;
    let out = run_bin_async(&["--config", cfg_s, "cancel", &pushed[2]], &[], T).await;
    assert_eq!(out.code, Some(0), "{}", out.all());
    let mut w = WorkerProc::spawn(&cfg, "b1", &[]);
    context(wait_len(&mut conn, "{llm}:results", 3, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r["b-keyed"]["status"], "ok", "{:?}", r["b-keyed"]);
    assert_eq!(r[&pushed[1]]["status"], "ok", "{:?}", r[&pushed[1]]);
    assert_eq!(r[&pushed[2]]["status"], "cancelled", "{:?}", r[&pushed[2]]);
    assert_eq!(calls_of(&sim, &pushed[1]), 1);
    assert_eq!(
        calls_of(&sim, &pushed[2]),
        0,
        "no call for the cancelled job"
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// A job without an id, as a producer pushes one.
fn idless(t: &str) -> String {
    serde_json::json!({"messages": [{"role": "user", "content": t}]}).to_string()
}

/// Waits until the group's pending list holds `n` entries.
async fn pending_reaches(conn: &redis::aio::MultiplexedConnection, n: i64) -> bool {
    wait_for(T, || {
        let mut c = conn.clone();
        async move { pending_count(&mut c, "{llm}:jobs", "workers").await == n }
    })
    .await
}

/// After 300 ms (a cancel read sent just before is answered by then), stops Redis
/// (SIGSTOP) and waits until no call runs: redis-server's pid, how many calls ran when it
/// stopped, and whether they all ended. The caller sends SIGCONT.
async fn stop_redis_until_the_call_ends(redis: &RedisServer, sim: &SimHandle) -> (u32, u64, bool) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rpid = redis.pid().expect("redis-server's pid");
    signal(rpid, "STOP");
    let calling = sim.sim.stats().in_flight;
    let ended = wait_for(T, || async { sim.sim.stats().in_flight == 0 }).await;
    (rpid, calling, ended)
}

/// Whether the job of `entry` read its cancel marker itself and the read failed (the
/// log line of that check).
fn checked_itself(w: &WorkerProc, entry: &str) -> bool {
    let needle = format!("entry={entry} ");
    w.log()
        .lines()
        .any(|l| l.contains("cancel check failed") && l.contains(&needle))
}

/// What [`one_calling_others_waiting`] set up.
struct Bed {
    redis: RedisServer,
    sim: SimHandle,
    _dir: tempfile::TempDir,
    conn: redis::aio::MultiplexedConnection,
    pushed: Vec<String>,
    w: WorkerProc,
}

/// One worker (concurrency 1, `read_ahead`) on a model of `latency_ms`, `jobs` jobs
/// without an id: the first calling, the others read ahead and waiting for their turn;
/// the cancel marker of the job at `cancel` set now.
async fn one_calling_others_waiting(
    latency_ms: u64,
    read_ahead: usize,
    jobs: usize,
    cancel: usize,
) -> anyhow::Result<Bed> {
    let redis = RedisServer::start();
    let sim = SimHandle::start(SimOptions {
        latency_ms,
        ..SimOptions::default()
    })
    .await;
    let mut tc = TestConfig::new(&redis, &sim);
    tc.concurrency = 1;
    tc.read_ahead = read_ahead;
    let dir = tempfile::tempdir()?;
    let cfg = tc.write(dir.path(), "o.toml");
    let mut conn = redis.conn().await;
    let payloads: Vec<String> = (0..jobs).map(|i| idless(&format!("job {i}"))).collect();
    let pushed = push(&mut conn, "llm", &payloads).await;
    let w = WorkerProc::spawn(&cfg, "o1", &[]);
    assert!(in_flight_at_least(&sim, 1, T).await, "{}", w.log());
    let read = pending_reaches(&conn, jobs as i64).await;
    assert!(read, "the jobs after the first read ahead\n{}", w.log());
    set_cancel_marker(&mut conn, &pushed[cancel]).await?;
    Ok(Bed {
        redis,
        sim,
        _dir: dir,
        conn,
        pushed,
        w,
    })
}

/// Review finding: a job without an id read ahead (checked with its entry, then waiting
/// over 100 ms for its turn) whose cancel marker is set meanwhile, and whose own check
/// before its call meets Redis stopped (SIGSTOP, longer than the check's 1 s bound):
/// it asks again until Redis answers, then ends `cancelled` with no call (it was called
/// unchecked before). The job ahead of it, whose commit waited out the same outage,
/// ends ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_check_that_meets_a_stopped_redis_asks_again_and_makes_no_call()
-> anyhow::Result<()> {
    let Bed {
        redis,
        sim,
        _dir,
        pushed,
        mut w,
        ..
    } = one_calling_others_waiting(2000, 1, 2, 1).await?;
    let rpid = redis.pid().expect("redis-server's pid");
    signal(rpid, "STOP");
    let saw = wait_log(
        &w,
        "cancel check failed; retrying until Redis answers",
        Duration::from_secs(10),
    )
    .await;
    signal(rpid, "CONT");
    let mut conn = redis.conn().await;
    context(wait_len(&mut conn, "{llm}:results", 2, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r[&pushed[0]]["status"], "ok", "{:?}", r[&pushed[0]]);
    assert_eq!(r[&pushed[1]]["status"], "cancelled", "{:?}", r[&pushed[1]]);
    assert_eq!(calls_of(&sim, &pushed[1]), 0, "no call\n{}", w.log());
    assert!(
        saw,
        "the second job's own check met the outage\n{}",
        w.log()
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// A job without an id read ahead has its cancel marker read again with each later read
/// while it waits for its turn (one command with the new entries' markers), so a marker
/// set while it waits is known when its turn comes without a round trip of its own:
/// here Redis is stopped (SIGSTOP) from just after such a read until after the job's
/// turn, and the job still ends `cancelled`, with no call and no check of its own that
/// meets the outage (before, it read its marker itself once it had waited over 100 ms,
/// one round trip a job for every job read ahead).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_read_ahead_is_checked_again_by_the_next_read() -> anyhow::Result<()> {
    let Bed {
        redis,
        sim,
        _dir,
        mut conn,
        pushed,
        mut w,
    } = one_calling_others_waiting(2500, 2, 2, 1).await?;
    // A third job: read at once (a read permit is free), and with it the waiting
    // job's marker.
    let third = push(&mut conn, "llm", &[idless("third")]).await;
    assert!(
        pending_reaches(&conn, 3).await,
        "the third job read\n{}",
        w.log()
    );
    // The read's check is sent right after the read and answered within milliseconds.
    // The first call ends while Redis is stopped: the second job's turn comes then.
    let (rpid, calling, ended) = stop_redis_until_the_call_ends(&redis, &sim).await;
    // Its own check, had it sent one, would have given up after 1 s and said so.
    let said = wait_for(Duration::from_secs(3), || async {
        checked_itself(&w, &pushed[1])
    })
    .await;
    // The third job, read after the second's recheck, has no later read: its own check
    // meets the outage (the log line this test looks for is the one it would print).
    let third_said = wait_for(Duration::from_secs(5), || async {
        checked_itself(&w, &third[0])
    })
    .await;
    signal(rpid, "CONT");
    assert_eq!(
        calling,
        1,
        "the first call still ran when Redis stopped\n{}",
        w.log()
    );
    assert!(ended, "the first call ended\n{}", w.log());
    assert!(
        third_said,
        "the third job's own check met the outage\n{}",
        w.log()
    );
    let mut conn = redis.conn().await;
    context(wait_len(&mut conn, "{llm}:results", 3, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    assert_eq!(r[&pushed[0]]["status"], "ok", "{:?}", r[&pushed[0]]);
    assert_eq!(r[&pushed[1]]["status"], "cancelled", "{:?}", r[&pushed[1]]);
    assert_eq!(calls_of(&sim, &pushed[1]), 0, "no call\n{}", w.log());
    assert_eq!(r[&third[0]]["status"], "ok", "{:?}", r[&third[0]]);
    assert!(
        !said,
        "the waiting job's marker was known from the third job's read, not read again\n{}",
        w.log()
    );
    stop_clean(&mut w, T).await;
    Ok(())
}

/// The same when the job whose turn comes first reads its own marker (it waited over
/// 100 ms, and no read came meanwhile): the jobs waiting behind it are read in the same
/// command, so a marker set for one of them is known at its turn without a round trip of
/// its own. Redis is stopped (SIGSTOP) from while the second job calls until after the
/// third's turn: the third ends `cancelled` with no call and no check of its own; the
/// fourth, whose read is stale by then, checks itself and meets the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_reading_its_own_marker_reads_those_waiting_behind_it_too() -> anyhow::Result<()> {
    let Bed {
        redis,
        sim,
        _dir,
        pushed,
        mut w,
        ..
    } = one_calling_others_waiting(2000, 3, 4, 2).await?;
    // The first call ends; the second job's own check reads the third's marker too.
    let second = wait_for(T, || async { calls_of(&sim, &pushed[1]) == 1 }).await;
    assert!(second, "the second job calls\n{}", w.log());
    let (rpid, calling, ended) = stop_redis_until_the_call_ends(&redis, &sim).await;
    let own = |i: usize| checked_itself(&w, &pushed[i]);
    // Whichever checks itself first (the third, had its marker not come with the
    // second's read, would keep retrying and hold the fourth back).
    wait_for(Duration::from_secs(5), || async { own(2) || own(3) }).await;
    let (third_said, fourth_said) = (own(2), own(3));
    signal(rpid, "CONT");
    assert_eq!(
        calling,
        1,
        "the second call still ran when Redis stopped\n{}",
        w.log()
    );
    assert!(ended, "the second call ended\n{}", w.log());
    assert!(
        !third_said,
        "the third job's marker was known from the second job's read, not read again\n{}",
        w.log()
    );
    assert!(
        fourth_said,
        "the fourth job's own check met the outage\n{}",
        w.log()
    );
    let mut conn = redis.conn().await;
    context(wait_len(&mut conn, "{llm}:results", 4, T).await, &[&w])?;
    let r = by_id(&entries(&mut conn, "{llm}:results").await);
    for i in [0, 1, 3] {
        assert_eq!(r[&pushed[i]]["status"], "ok", "{:?}", r[&pushed[i]]);
    }
    assert_eq!(r[&pushed[2]]["status"], "cancelled", "{:?}", r[&pushed[2]]);
    assert_eq!(calls_of(&sim, &pushed[2]), 0, "no call\n{}", w.log());
    stop_clean(&mut w, T).await;
    Ok(())
}
