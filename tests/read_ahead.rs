//! `worker.read_ahead` (issue 9: a job waiting when a place frees), on the real binary,
//! a real redis-server and the simulated provider: a worker holds up to `concurrency +
//! read_ahead` entries but works on (and calls for) at most `concurrency`; the entries
//! read ahead are kept ours while they wait, handed back untouched at a signal, and a
//! cancel set while one waits stops it before any call.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use redis::AsyncCommands;
use std::path::PathBuf;
use std::time::Duration;

type Conn = redis::aio::MultiplexedConnection;

struct Bed {
    conn: Conn,
    cfg: PathBuf,
    sim: SimHandle,
    _dir: tempfile::TempDir,
    _redis: RedisServer,
}

impl Bed {
    /// Calls of `latency_ms`, `concurrency` and `read_ahead` as given, 8 slots.
    async fn new(latency_ms: u64, concurrency: usize, read_ahead: usize) -> anyhow::Result<Bed> {
        let redis = RedisServer::start();
        let sim = SimHandle::start(SimOptions {
            latency_ms,
            ..SimOptions::default()
        })
        .await;
        let mut tc = TestConfig::new(&redis, &sim);
        tc.slots = 8;
        tc.concurrency = concurrency;
        tc.read_ahead = read_ahead;
        tc.grace_ms = 8000;
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

    /// Pushes a keyed job ("first") and then one without an id; the latter's entry id.
    async fn push_first_and_idless(&mut self) -> anyhow::Result<String> {
        push(&mut self.conn, "llm", &[job("first", "hi")]).await;
        let idless =
            serde_json::json!({"messages": [{"role": "user", "content": "later"}]}).to_string();
        Ok(self
            .conn
            .xadd("{llm}:jobs", "*", &[("payload", idless.as_str())])
            .await?)
    }

    /// Starts worker `w1` (concurrency 1, read-ahead 1) and waits until the first job
    /// calls and the id-less one waits, read ahead.
    async fn spawn_with_idless_read_ahead(&self, env: &[(&str, &str)]) -> WorkerProc {
        let w = WorkerProc::spawn(&self.cfg, "w1", env);
        assert!(
            self.wait_held(2, 1).await,
            "the id-less job read ahead while the first calls\n{}",
            w.log()
        );
        w
    }

    fn total_calls(&self) -> u64 {
        self.sim.sim.stats().calls_per_job.values().sum()
    }

    /// Waits until the worker holds `pending` entries with `calling` calls running.
    async fn wait_held(&self, pending: i64, calling: u64) -> bool {
        wait_for(Duration::from_secs(10), || {
            let mut c = self.conn.clone();
            let sim = self.sim.sim.clone();
            async move {
                sim.stats().in_flight == calling
                    && pending_count(&mut c, "{llm}:jobs", "workers").await == pending
            }
        })
        .await
    }
}

/// Concurrency 2, read-ahead 3, 8 slots, calls of 600 ms, 10 jobs: the worker holds 5
/// entries while 2 calls run (never more calls than `concurrency`, though slots are free),
/// and every job ends `ok` once with one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_concurrency_plus_read_ahead_and_calls_at_most_concurrency() -> anyhow::Result<()> {
    let mut bed = Bed::new(600, 2, 3).await?;
    push(&mut bed.conn, "llm", &jobs("job", 10)).await;
    let mut w = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    assert!(
        bed.wait_held(5, 2).await,
        "5 entries held (2 calling, 3 read ahead)\n{}",
        w.log()
    );
    context(
        wait_len(&mut bed.conn, "{llm}:results", 10, Duration::from_secs(20)).await,
        &[&w],
    )?;
    assert_all_ok_once(&entries(&mut bed.conn, "{llm}:results").await, 10);
    let stats = bed.sim.sim.stats();
    assert_eq!(
        stats.max_in_flight, 2,
        "at most `concurrency` calls at once"
    );
    assert_eq!(bed.total_calls(), 10, "one call per job");
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// SIGTERM while 2 calls run and 3 entries wait, read ahead: the 2 calls finish and are
/// written, the 3 waiting jobs are handed back without a call (a delivery that started
/// no call is not counted), nothing stays pending, and a second worker does them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_back_the_entries_read_ahead_without_a_call() -> anyhow::Result<()> {
    // Calls of 3 s: none ends between the wait below and the signal on a loaded machine.
    let mut bed = Bed::new(3000, 2, 3).await?;
    push(&mut bed.conn, "llm", &jobs("job", 8)).await;
    let mut w = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    assert!(
        bed.wait_held(5, 2).await,
        "5 entries held (2 calling, 3 read ahead)\n{}",
        w.log()
    );
    w.signal(libc_sig::TERM);
    let status = wait_exit(&mut w, Duration::from_secs(10)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "clean exit 0: {status:?}\n{}",
        w.log()
    );
    assert_eq!(bed.total_calls(), 2, "no call for the jobs read ahead");
    assert_eq!(ok_results_once(&mut bed.conn).await.len(), 2);
    assert_eq!(
        pending_count(&mut bed.conn, "{llm}:jobs", "workers").await,
        0,
        "nothing left pending"
    );
    assert_eq!(
        xlen(&mut bed.conn, "{llm}:jobs").await,
        6,
        "3 jobs handed back, 3 never read"
    );
    let handed = entries_raw(&mut bed.conn, "{llm}:jobs").await;
    let backs: Vec<_> = handed
        .iter()
        .filter_map(|(_, f)| f.get("_deliveries"))
        .collect();
    assert_eq!(backs.len(), 3, "{handed:?}");
    for d in &backs {
        assert_eq!(
            d.as_slice(),
            b"0",
            "a delivery without a call is not counted: {handed:?}"
        );
    }
    let mut w2 = WorkerProc::spawn(&bed.cfg, "w2", &[]);
    context(
        wait_len(&mut bed.conn, "{llm}:results", 8, Duration::from_secs(20)).await,
        &[&w2],
    )?;
    assert_all_ok_once(&entries(&mut bed.conn, "{llm}:results").await, 8);
    assert_eq!(bed.total_calls(), 8, "one call per job across both workers");
    stop_clean(&mut w2, Duration::from_secs(6)).await;
    Ok(())
}

/// Concurrency 1, read-ahead 1, calls of 1.5 s: a job without an id waits, read ahead
/// (its cancel marker read with it: none). A cancel set while it waits must stop it with
/// no call: the marker is read again when the wait was long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_set_while_a_job_waits_read_ahead_stops_it_before_any_call() -> anyhow::Result<()>
{
    let mut bed = Bed::new(1500, 1, 1).await?;
    let later = bed.push_first_and_idless().await?;
    let mut w = bed.spawn_with_idless_read_ahead(&[]).await;
    let _: () = bed
        .conn
        .set_ex(format!("{{llm}}:cancel:{later}"), 1, 60)
        .await?;
    context(
        wait_len(&mut bed.conn, "{llm}:results", 2, Duration::from_secs(10)).await,
        &[&w],
    )?;
    let results = entries(&mut bed.conn, "{llm}:results").await;
    let r = results
        .iter()
        .map(|(_, r)| r)
        .find(|r| r["job_id"] == later)
        .expect("a result for the id-less job");
    assert_eq!(r["status"], "cancelled", "{r:?}");
    assert_eq!(bed.total_calls(), 1, "no call for the cancelled job");
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Concurrency 1, read-ahead 1, calls of 2 s, `claim_idle_ms` 600: the entry read ahead
/// waits past `claim_idle_ms`; its worker's keepalive keeps it, so a second worker never
/// takes it over, and each job is called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_read_ahead_is_kept_ours_while_it_waits() -> anyhow::Result<()> {
    let mut bed = Bed::new(2000, 1, 1).await?;
    push(&mut bed.conn, "llm", &jobs("job", 2)).await;
    let env = [("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "600")];
    let mut w1 = WorkerProc::spawn(&bed.cfg, "w1", &env);
    assert!(
        bed.wait_held(2, 1).await,
        "one calling, one read ahead\n{}",
        w1.log()
    );
    let mut w2 = WorkerProc::spawn(&bed.cfg, "w2", &env);
    context(
        wait_len(&mut bed.conn, "{llm}:results", 2, Duration::from_secs(15)).await,
        &[&w1, &w2],
    )?;
    assert_all_ok_once(&entries(&mut bed.conn, "{llm}:results").await, 2);
    assert_eq!(bed.total_calls(), 2, "one call per job");
    let stats = bed.sim.sim.stats();
    assert_eq!(
        stats.max_in_flight,
        1,
        "the entry read ahead was not taken over while it waited\n{}",
        logs_tail(&[&w1, &w2], 40)
    );
    stop_clean(&mut w1, Duration::from_secs(6)).await;
    stop_clean(&mut w2, Duration::from_secs(6)).await;
    Ok(())
}

/// Concurrency 1, read-ahead 1, calls of 1.5 s: a job without an id whose cancel marker
/// was set before it was read waits, read ahead, past the re-read threshold; then cancel
/// markers cannot be read any more (an ACL), so the re-read fails.
/// The cancel found with the entry still holds: no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_found_with_the_entry_holds_when_the_re_read_fails() -> anyhow::Result<()> {
    let mut bed = Bed::new(1500, 1, 1).await?;
    let later = bed.push_first_and_idless().await?;
    let _: () = bed
        .conn
        .set_ex(format!("{{llm}}:cancel:{later}"), 1, 60)
        .await?;
    let mut w = bed.spawn_with_idless_read_ahead(&[]).await;
    // From now on every read of a cancel marker is refused (an ACL that allows every key
    // of the namespace but `cancel:*`): the re-read after the wait fails, and so do the
    // cancel watcher's polls.
    refuse_cancel_markers_to_default_user(&mut bed.conn).await?;
    let refused: redis::RedisResult<Option<String>> =
        bed.conn.get(format!("{{llm}}:cancel:{later}")).await;
    assert!(refused.is_err(), "the marker cannot be read any more");
    context(
        wait_len(&mut bed.conn, "{llm}:results", 2, Duration::from_secs(15)).await,
        &[&w],
    )?;
    let results = entries(&mut bed.conn, "{llm}:results").await;
    let r = results
        .iter()
        .map(|(_, r)| r)
        .find(|r| r["job_id"] == later)
        .expect("a result for the id-less job");
    assert_eq!(r["status"], "cancelled", "{r:?}\n{}", w.log());
    assert_eq!(bed.total_calls(), 1, "no call for the cancelled job");
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Concurrency 1, read-ahead 1, calls of 5 s, `claim_idle_ms` 9000 (keepalive every
/// 3 s): a job without an id waits, read ahead, for 5 s; a second before its turn
/// another consumer takes its entry over (XCLAIM), between two keepalives (about 1 s
/// from each, room for a loaded machine). Having waited over a third of `claim_idle_ms`
/// since its read, it checks that its entry is still its worker's before the call: no
/// call here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_held_long_checks_its_entry_is_still_ours_before_its_call() -> anyhow::Result<()> {
    let mut bed = Bed::new(5000, 1, 1).await?;
    let later = bed.push_first_and_idless().await?;
    let env = [("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "9000")];
    let mut w = bed.spawn_with_idless_read_ahead(&env).await;
    tokio::time::sleep(Duration::from_millis(4000)).await;
    xclaim(&mut bed.conn, "thief", &later, 0, 1).await;
    context(
        wait_len(&mut bed.conn, "{llm}:results", 1, Duration::from_secs(10)).await,
        &[&w],
    )?;
    // Its turn came at about 5 s; give a wrong call time to show.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let calls = bed
        .sim
        .sim
        .stats()
        .calls_per_job
        .get(&later)
        .copied()
        .unwrap_or(0);
    assert_eq!(
        calls,
        0,
        "no call for an entry another consumer took\n{}",
        w.log()
    );
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// While half the read-ahead or more waits for a job permit, the reader waits until as
/// many read permits are free and takes that many jobs in one read, instead of a read
/// (and its cancel check) at each job's end: 24 jobs, concurrency 1, read-ahead 4 read
/// in about 12 reads (before: one a job, about 20).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_jobs_in_line_reads_several_at_once() -> anyhow::Result<()> {
    let mut bed = Bed::new(50, 1, 4).await?;
    push(&mut bed.conn, "llm", &jobs("job", 24)).await;
    let before = calls_of(&mut bed.conn, "xreadgroup").await;
    let mut w = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    context(
        wait_len(&mut bed.conn, "{llm}:results", 24, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let reads = calls_of(&mut bed.conn, "xreadgroup").await - before;
    assert_all_ok_once(&entries(&mut bed.conn, "{llm}:results").await, 24);
    assert!(
        reads <= 15,
        "24 jobs read in {reads} reads: two or more at a time while jobs wait in line\n{}",
        w.log()
    );
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}

/// Concurrency 8, read-ahead 8 (8 slots), calls of 700 ms, 16 jobs without an id: 8 wait
/// read ahead past the re-read threshold while the first 8 call. Redis is held (SIGSTOP)
/// while those calls end: a job permit is freed at the job's decision, before its commit,
/// so the 8 waiting tasks start while Redis is held, each to read its own cancel marker.
/// Gathered, the first task's read goes out (and waits on Redis) and the 7 asks that come
/// meanwhile wait to go together in the next: 2 reads. The code before sent 8, one a task.
/// The count also takes the cancel watcher's polls while calls run (one every 500 ms, at
/// most 3 in this window of under a second), so the bound is 5; the code before read 9
/// (in each of 3 runs). A marker set on one of the waiting jobs is still found: that job ends
/// `cancelled` without a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_starting_together_share_their_cancel_marker_reads() -> anyhow::Result<()> {
    let mut bed = Bed::new(700, 8, 8).await?;
    let mut ids = vec![];
    for i in 0..16 {
        let p = serde_json::json!({"messages": [{"role": "user", "content": format!("j{i}")}]})
            .to_string();
        let id: String = bed
            .conn
            .xadd("{llm}:jobs", "*", &[("payload", p.as_str())])
            .await?;
        ids.push(id);
    }
    let redis = redis_pid(&mut bed.conn).await;
    let mut w = WorkerProc::spawn(&bed.cfg, "w1", &[]);
    assert!(
        bed.wait_held(16, 8).await,
        "8 calling, 8 read ahead\n{}",
        w.log()
    );
    // The last job pushed waits read ahead (job permits go first come, first served).
    let cancelled = ids.last().expect("16 ids").clone();
    let _: () = bed
        .conn
        .set_ex(format!("{{llm}}:cancel:{cancelled}"), 1, 60)
        .await?;
    let before = calls_of(&mut bed.conn, "mget").await;
    signal(redis, "STOP");
    let sim = bed.sim.sim.clone();
    let ended = wait_for(Duration::from_secs(5), || {
        let sim = sim.clone();
        async move { sim.stats().in_flight == 0 }
    })
    .await;
    signal(redis, "CONT");
    assert!(ended, "the first 8 calls ended while Redis was held");
    // The 7 jobs not cancelled call: every waiting task has read its marker by now.
    let second = wait_for(Duration::from_secs(10), || {
        let sim = sim.clone();
        async move { sim.stats().in_flight == 7 }
    })
    .await;
    let mgets = calls_of(&mut bed.conn, "mget").await - before;
    assert!(second, "the second round calls\n{}", w.log());
    context(
        wait_len(&mut bed.conn, "{llm}:results", 16, Duration::from_secs(20)).await,
        &[&w],
    )?;
    let results = entries(&mut bed.conn, "{llm}:results").await;
    for (_, r) in &results {
        let want = if r["job_id"] == cancelled {
            "cancelled"
        } else {
            "ok"
        };
        assert_eq!(r["status"], want, "{r:?}");
    }
    assert_eq!(bed.total_calls(), 15, "no call for the cancelled job");
    assert!(
        mgets <= 5,
        "{mgets} MGETs: the 8 tasks starting together read their markers one by one\n{}",
        w.log()
    );
    stop_clean(&mut w, Duration::from_secs(6)).await;
    Ok(())
}
