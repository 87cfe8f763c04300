//! `llm-bench`: the performance benchmark of llm-worker (issue 9), side by side with a
//! bullmq-official peer on the same simulated model, each run on its own redis-server.
//! Prints one table (markdown) and writes every raw figure to a JSON file. It fails
//! only when something crashes, never on a number.

mod ceiling;
mod procs;
mod redisx;
mod report;
mod run;

use clap::Parser;
use report::{Report, Row};
use run::{Env, Outcome, Spec, Subject};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(about = "Benchmark llm-worker against a bullmq-official peer")]
struct Args {
    /// The daemon binary (release build).
    #[arg(long, default_value = "target/release/llm-worker")]
    daemon: PathBuf,
    /// The peer binary (this crate's `bullmq-peer`).
    #[arg(long, default_value = "bench/target/release/bullmq-peer")]
    peer: PathBuf,
    /// Where to write every figure as JSON.
    #[arg(long, default_value = "bench/results.json")]
    json: PathBuf,
    /// Small job counts (a CI smoke, under a minute).
    #[arg(long)]
    quick: bool,
    /// Run one scenario: a, b, c, d, e, f, g, h, q (quotas configured), rt (round trips
    /// by MONITOR), ceiling.
    #[arg(long)]
    only: Option<String>,
    /// Scenario a as this many llm-worker/peer pairs, each pair in the other order than
    /// the one before (so a machine that slows down over the run weighs on both); the
    /// table shows the pair whose jobs/s ratio is the median, and a row of every ratio.
    #[arg(long, default_value_t = 1)]
    pairs: usize,
    /// Diagnostics: TOML lines added to llm-worker's `[worker]` table in every run (e.g.
    /// "threads = 2"), to compare a variant without a rebuild. Only with `--only` (the
    /// full table is always the defaults), never a key a scenario sets itself
    /// (`concurrency`, `read_ahead`); printed under the table and kept in the JSON.
    #[arg(long, requires = "only")]
    worker_extra: Option<String>,
}

struct Sizes {
    a: u64,
    b: u64,
    c_secs: u64,
    e: u64,
    g_secs: u64,
    h_reps: usize,
    rt: u64,
    bench_n: u64,
}

const FULL: Sizes = Sizes {
    a: 20_000,
    b: 100_000,
    c_secs: 10,
    e: 5_000,
    g_secs: 10,
    h_reps: 5,
    rt: 2_000,
    bench_n: 200_000,
};
const QUICK: Sizes = Sizes {
    a: 2_000,
    b: 5_000,
    c_secs: 2,
    e: 1_000,
    g_secs: 2,
    h_reps: 2,
    rt: 500,
    bench_n: 20_000,
};

fn spec(label: &str, subject: Subject, jobs: u64, latency_ms: u64, n: u32) -> Spec {
    Spec {
        label: label.into(),
        subject,
        jobs,
        latency_ms,
        jitter_ms: 0,
        slots: n,
        concurrency: Some(64),
        // A quarter, as the daemon derives beside a derived concurrency.
        read_ahead: Some(16),
        peer_concurrency: 64,
        processes: 1,
        monitor: false,
        quotas: false,
        exit_grace: Duration::from_secs(30),
    }
}

/// Run a spec, print a one-line progress note on stderr.
async fn go(env: &Env, quick: bool, s: Spec, all: &mut Vec<Outcome>) -> anyhow::Result<Outcome> {
    eprintln!(
        "[bench] {} {}: {} jobs, {} ms model, N={}, {} process(es)",
        s.label,
        s.subject.name(),
        s.jobs,
        s.latency_ms,
        s.slots,
        s.processes
    );
    let mut s = s;
    if quick {
        s.exit_grace = Duration::from_millis(1500);
    }
    let o = run::run(env, &s).await?;
    match &o.error {
        Some(e) => eprintln!("[bench]   error: {e}"),
        None => eprintln!(
            "[bench]   {:.0} jobs/s, {:.2} cmds/job, redis {:.3} ms/job, worker {:.3} ms/job, rss {} kB, failed {}",
            o.jobs_per_s,
            o.commands_per_job,
            o.redis_cpu_ms_per_job,
            o.worker_cpu_ms_per_job,
            o.peak_rss_kb,
            o.failed
        ),
    }
    all.push(o.clone());
    Ok(o)
}

fn ok(o: &Outcome) -> bool {
    o.error.is_none()
}
fn val(o: &Outcome, f: impl Fn(&Outcome) -> f64) -> Option<f64> {
    ok(o).then(|| f(o))
}
fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}
fn is_script(cmd: &str) -> bool {
    matches!(
        cmd,
        "eval" | "evalsha" | "eval_ro" | "evalsha_ro" | "fcall" | "fcall_ro"
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let sz = if args.quick { QUICK } else { FULL };
    let want = |name: &str| -> bool {
        match args.only.as_deref() {
            None => true,
            Some(o) => o == name,
        }
    };
    for (what, p) in [("daemon", &args.daemon), ("peer", &args.peer)] {
        anyhow::ensure!(
            p.exists(),
            "{what} binary {} not found: build it first",
            p.display()
        );
        // Written back, as an installed binary is: a binary just linked is dirty in the
        // page cache, and the daemon never drops dirty pages at start (resident.rs), so
        // its memory would read higher right after a build than it runs.
        let _ = std::fs::File::open(p).and_then(|f| f.sync_all());
    }
    let dir = std::env::temp_dir().join(format!("llm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let env = Env {
        daemon: std::fs::canonicalize(&args.daemon)?,
        peer: std::fs::canonicalize(&args.peer)?,
        dir: dir.clone(),
        worker_extra: args.worker_extra.clone(),
    };
    let started = tokio::time::Instant::now();
    let mut all: Vec<Outcome> = Vec::new();
    let mut rep = Report::default();
    if let Some(extra) = &args.worker_extra {
        for line in extra.lines() {
            let key = line.split('=').next().unwrap_or("").trim();
            anyhow::ensure!(
                !["concurrency", "read_ahead"].contains(&key)
                    && !line.trim_start().starts_with('['),
                "--worker-extra line {line:?}: the scenarios set `concurrency` and `read_ahead` themselves, and the lines go into `[worker]` (no table headers)"
            );
        }
        rep.note(format!(
            "llm-worker ran with these lines added to [worker] (--worker-extra, diagnostics): {}",
            extra.lines().collect::<Vec<_>>().join("; ")
        ));
    }
    use Subject::{Llm, Peer};

    // (a) 0 ms model, 1 worker, concurrency 64, N=64.
    let mut a_rss: Option<(Option<f64>, Option<f64>)> = None;
    if want("a") {
        let mut pairs: Vec<(Outcome, Outcome)> = Vec::new();
        for k in 0..args.pairs.max(1) {
            let (l, p) = if k % 2 == 0 {
                let l = go(&env, args.quick, spec("a", Llm, sz.a, 0, 64), &mut all).await?;
                let p = go(&env, args.quick, spec("a", Peer, sz.a, 0, 64), &mut all).await?;
                (l, p)
            } else {
                let p = go(&env, args.quick, spec("a", Peer, sz.a, 0, 64), &mut all).await?;
                let l = go(&env, args.quick, spec("a", Llm, sz.a, 0, 64), &mut all).await?;
                (l, p)
            };
            pairs.push((l, p));
        }
        let ratio = |(l, p): &(Outcome, Outcome)| match (
            val(l, |o| o.jobs_per_s),
            val(p, |o| o.jobs_per_s),
        ) {
            (Some(a), Some(b)) if b > 0.0 => a / b,
            _ => f64::NAN,
        };
        let ratios: Vec<f64> = pairs.iter().map(ratio).collect();
        let (l, p) = if pairs.len() == 1 {
            pairs.swap_remove(0)
        } else {
            // The pair whose ratio is the median (the lower middle one of an even count).
            // Pairs with a failed run have no ratio: left out of the median.
            let mut order: Vec<usize> = (0..pairs.len())
                .filter(|&k| ratios[k].is_finite())
                .collect();
            if order.is_empty() {
                order.push(0);
            }
            order.sort_by(|&x, &y| ratios[x].total_cmp(&ratios[y]));
            let mid = order[(order.len() - 1) / 2];
            let each = ratios
                .iter()
                .map(|r| format!("{r:.2}x"))
                .collect::<Vec<_>>()
                .join(", ");
            rep.note(format!(
                "a: {} pairs, jobs/s ratios in run order {each}; the rows of a show the median pair",
                pairs.len()
            ));
            pairs.swap_remove(mid)
        };
        let t = format!("0 ms, C=64 (+16 read ahead), N=64, {} jobs", sz.a);
        rep.push(
            Row::new("a", &format!("jobs/s, {t}"), ">= 1.25x peer")
                .vals(val(&l, |o| o.jobs_per_s), val(&p, |o| o.jobs_per_s)),
        );
        rep.push(
            Row::new("a", "commands/job (INFO, incl. inside scripts)", "-").vals(
                val(&l, |o| o.commands_per_job),
                val(&p, |o| o.commands_per_job),
            ),
        );
        rep.push(
            Row::new("a", "socket reads/job (INFO total_reads_processed)", "-")
                .vals(val(&l, |o| o.reads_per_job), val(&p, |o| o.reads_per_job)),
        );
        rep.push(Row::new("a", "Redis CPU ms/job", "<= peer").vals(
            val(&l, |o| o.redis_cpu_ms_per_job),
            val(&p, |o| o.redis_cpu_ms_per_job),
        ));
        rep.push(Row::new("a", "worker CPU ms/job", "<= peer").vals(
            val(&l, |o| o.worker_cpu_ms_per_job),
            val(&p, |o| o.worker_cpu_ms_per_job),
        ));
        rep.push(
            Row::new("a", "simulated model's CPU ms/job (shared cost, info)", "-").vals(
                l.sim_cpu_ms_per_job.filter(|_| ok(&l)),
                p.sim_cpu_ms_per_job.filter(|_| ok(&p)),
            ),
        );
        a_rss = Some((
            val(&l, |o| mb(o.peak_rss_kb)),
            val(&p, |o| mb(o.peak_rss_kb)),
        ));
    }

    // (q) Scenario a with a budget and fleet-wide rpm/tpm configured (issue 10: the
    // figures must hold with quotas on), side by side with the plain worker and the peer.
    if want("q") {
        let l = go(
            &env,
            args.quick,
            spec("q-plain", Llm, sz.a, 0, 64),
            &mut all,
        )
        .await?;
        let mut qs = spec("q-quotas", Llm, sz.a, 0, 64);
        qs.quotas = true;
        let q = go(&env, args.quick, qs, &mut all).await?;
        let p = go(
            &env,
            args.quick,
            spec("q-peer", Peer, sz.a, 0, 64),
            &mut all,
        )
        .await?;
        let t = format!("0 ms, C=64 (+16 read ahead), N=64, {} jobs", sz.a);
        for (what, f) in [
            (
                "jobs/s",
                (|o: &Outcome| o.jobs_per_s) as fn(&Outcome) -> f64,
            ),
            ("commands/job", |o: &Outcome| o.commands_per_job),
            ("Redis CPU ms/job", |o: &Outcome| o.redis_cpu_ms_per_job),
            ("worker CPU ms/job", |o: &Outcome| o.worker_cpu_ms_per_job),
        ] {
            rep.push(
                Row::new(
                    "q",
                    &format!("{what}, budget + rpm/tpm on, {t}"),
                    "as without",
                )
                .vals(val(&q, f), val(&p, f)),
            );
            rep.push(
                Row::new("q", &format!("{what}, same run, quotas off"), "-")
                    .vals(val(&l, f), val(&p, f)),
            );
        }
    }

    // Round trips: a MONITOR pass (MONITOR slows Redis, so its timings are not used).
    let mut rt: Option<(Outcome, Outcome)> = None;
    if want("a") || want("rt") || want("ceiling") {
        let mut ls = spec("rt", Llm, sz.rt, 0, 64);
        ls.monitor = true;
        let mut ps = spec("rt", Peer, sz.rt, 0, 64);
        ps.monitor = true;
        let l = go(&env, args.quick, ls, &mut all).await?;
        let p = go(&env, args.quick, ps, &mut all).await?;
        rep.push(
            Row::new("a", "round trips/job (client commands, MONITOR)", "<= 3").vals(
                l.round_trips_per_job.filter(|_| ok(&l)),
                p.round_trips_per_job.filter(|_| ok(&p)),
            ),
        );
        rt = Some((l, p));
    }

    // The Redis ceiling for each subject's client command mix.
    if want("ceiling") || (args.only.is_none() && rt.is_some()) {
        let mix = |o: &Outcome| -> Option<(f64, u64, f64)> {
            let client = o.monitor_client_per_job.as_ref()?;
            let script_calls: f64 = client
                .iter()
                .filter(|(k, _)| is_script(k))
                .map(|(_, v)| v)
                .sum();
            let plain: f64 = client
                .iter()
                .filter(|(k, _)| !is_script(k))
                .map(|(_, v)| v)
                .sum();
            let inner: f64 = o.monitor_script_per_job.as_ref()?.values().sum();
            let k = if script_calls > 0.0 {
                (inner / script_calls).round().max(1.0) as u64
            } else {
                1
            };
            Some((script_calls, k, plain))
        };
        let (lm, pm) = rt
            .as_ref()
            .map(|(l, p)| (mix(l), mix(p)))
            .unwrap_or((None, None));
        let mut sizes: Vec<u64> = [lm, pm].iter().flatten().map(|m| m.1).collect();
        sizes.sort();
        sizes.dedup();
        if sizes.is_empty() {
            sizes.push(1);
        }
        eprintln!("[bench] ceiling: redis-benchmark, 64 clients, script sizes {sizes:?}");
        match ceiling::measure(&dir, sz.bench_n, &sizes).await {
            Ok(c) => {
                for (k, v) in &c.rps {
                    rep.push(
                        Row::new(
                            "ceiling",
                            &format!("redis-benchmark {k} req/s, 64 clients"),
                            "-",
                        )
                        .vals(Some(*v), None),
                    );
                }
                let cl = lm.and_then(|(s, k, p)| ceiling::jobs_ceiling(&c, s, k, p));
                let cp = pm.and_then(|(s, k, p)| ceiling::jobs_ceiling(&c, s, k, p));
                rep.push(
                    Row::new(
                        "ceiling",
                        "Redis ceiling jobs/s for the measured client mix",
                        "-",
                    )
                    .vals(cl, cp),
                );
                rep.json.insert("ceiling".into(), serde_json::to_value(&c)?);
            }
            Err(e) => eprintln!("[bench]   ceiling error: {e:#}"),
        }
    }

    // (b) the same at a 100,000-job backlog; (f) Redis memory and keys after it.
    if want("b") || want("f") {
        let l = go(&env, args.quick, spec("b", Llm, sz.b, 0, 64), &mut all).await?;
        let p = go(&env, args.quick, spec("b", Peer, sz.b, 0, 64), &mut all).await?;
        rep.push(
            Row::new(
                "b",
                &format!(
                    "jobs/s, 0 ms, C=64 (+16 read ahead), N=64, {} backlog",
                    sz.b
                ),
                ">= 1.25x peer",
            )
            .vals(val(&l, |o| o.jobs_per_s), val(&p, |o| o.jobs_per_s)),
        );
        rep.push(
            Row::new("b", "Redis CPU ms/job", "<= peer, flat vs a").vals(
                val(&l, |o| o.redis_cpu_ms_per_job),
                val(&p, |o| o.redis_cpu_ms_per_job),
            ),
        );
        rep.push(Row::new("b", "worker CPU ms/job", "<= peer").vals(
            val(&l, |o| o.worker_cpu_ms_per_job),
            val(&p, |o| o.worker_cpu_ms_per_job),
        ));
        rep.push(
            Row::new(
                "f",
                &format!("Redis used_memory MB after {} jobs", sz.b),
                "bounded by MAXLEN + TTLs",
            )
            .vals(
                val(&l, |o| o.redis_used_memory_after as f64 / 1048576.0),
                val(&p, |o| o.redis_used_memory_after as f64 / 1048576.0),
            ),
        );
        rep.push(
            Row::new("f", "Redis keys after the run", "no key per finished job").vals(
                val(&l, |o| o.redis_keys_after as f64),
                val(&p, |o| o.redis_keys_after as f64),
            ),
        );
        let top = |o: &Outcome| -> String {
            let mut v: Vec<(&String, &u64)> = o.key_classes_after.iter().collect();
            v.sort_by(|a, b| b.1.cmp(a.1));
            v.iter()
                .take(4)
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join("; ")
        };
        rep.note(format!("f: llm-worker keys by shape: {}", top(&l)));
        rep.note(format!("f: bullmq-official keys by shape: {}", top(&p)));
    }

    // (c) 200 ms model, N=8 and N=64, default concurrency; (d) worker CPU/job there.
    let mut c64: Option<Outcome> = None;
    if want("c") || want("d") || want("g") {
        for n in [8u32, 64] {
            // N=8 runs three times as long: its CPU per job is read in clock ticks
            // (10 ms), 0.025 ms per job over 400 jobs, too coarse against 0.15.
            let jobs = n as u64 * 5 * sz.c_secs * if n == 8 { 3 } else { 1 };
            let mut ls = spec(&format!("c-N{n}"), Llm, jobs, 200, n);
            ls.concurrency = None;
            ls.read_ahead = None;
            let mut ps = spec(&format!("c-N{n}"), Peer, jobs, 200, n);
            ps.peer_concurrency = n as usize;
            let l = go(&env, args.quick, ls, &mut all).await?;
            let p = go(&env, args.quick, ps, &mut all).await?;
            let slot = |o: &Outcome| o.jobs_per_s / (n as f64 / 0.2);
            rep.push(
                Row::new(
                    "c",
                    &format!("slot use, 200 ms, N={n}, default concurrency (C = N, read-ahead N/4; peer C={n})"),
                    ">= 0.99",
                )
                .vals(val(&l, slot), val(&p, slot)),
            );
            if n == 64 {
                rep.push(
                    Row::new("d", "worker CPU ms/job at 200 ms (N=64)", "<= 0.15").vals(
                        val(&l, |o| o.worker_cpu_ms_per_job),
                        val(&p, |o| o.worker_cpu_ms_per_job),
                    ),
                );
                rep.push(
                    Row::new("d", "Redis CPU ms/job at 200 ms (N=64)", "<= peer").vals(
                        val(&l, |o| o.redis_cpu_ms_per_job),
                        val(&p, |o| o.redis_cpu_ms_per_job),
                    ),
                );
                c64 = Some(l);
            } else {
                rep.push(
                    Row::new("d", "worker CPU ms/job at 200 ms (N=8)", "<= 0.15").vals(
                        val(&l, |o| o.worker_cpu_ms_per_job),
                        val(&p, |o| o.worker_cpu_ms_per_job),
                    ),
                );
            }
        }
    }
    // (d, jittered) The same N=8 with calls of 175 + 0..50 ms (mean 200): calls that
    // started together no longer end together, so no two jobs share a read, a commit or
    // a wakeup. Not a target of the issue: what a job costs when models vary, as they do.
    if want("d") {
        let n = 8u32;
        let jobs = n as u64 * 5 * sz.c_secs * 3;
        let mut ls = spec("d-jitter", Llm, jobs, 175, n);
        ls.concurrency = None;
        ls.read_ahead = None;
        ls.jitter_ms = 50;
        let mut ps = spec("d-jitter", Peer, jobs, 175, n);
        ps.peer_concurrency = n as usize;
        ps.jitter_ms = 50;
        let l = go(&env, args.quick, ls, &mut all).await?;
        let p = go(&env, args.quick, ps, &mut all).await?;
        rep.push(
            Row::new(
                "d",
                "worker CPU ms/job, 175-225 ms (N=8; jittered)",
                "(info)",
            )
            .vals(
                val(&l, |o| o.worker_cpu_ms_per_job),
                val(&p, |o| o.worker_cpu_ms_per_job),
            ),
        );
        rep.push(
            Row::new(
                "d",
                "Redis CPU ms/job, 175-225 ms (N=8; jittered)",
                "(info)",
            )
            .vals(
                val(&l, |o| o.redis_cpu_ms_per_job),
                val(&p, |o| o.redis_cpu_ms_per_job),
            ),
        );
    }

    // (e) memory: RSS at concurrency 64, and with 1,000 in flight (1 s model).
    if want("e") {
        let (rl, rp) = match a_rss {
            Some(v) => v,
            None => {
                let l = go(
                    &env,
                    args.quick,
                    spec("e-C64", Llm, sz.a / 4, 0, 64),
                    &mut all,
                )
                .await?;
                let p = go(
                    &env,
                    args.quick,
                    spec("e-C64", Peer, sz.a / 4, 0, 64),
                    &mut all,
                )
                .await?;
                (
                    val(&l, |o| mb(o.peak_rss_kb)),
                    val(&p, |o| mb(o.peak_rss_kb)),
                )
            }
        };
        rep.push(Row::new("e", "peak RSS MB, C=64 (+16 read ahead; 0 ms)", "<= 10").vals(rl, rp));
        let mut ls = spec("e-1000", Llm, sz.e, 1000, 1000);
        ls.concurrency = Some(1000);
        ls.read_ahead = None;
        let mut ps = spec("e-1000", Peer, sz.e, 1000, 1000);
        ps.peer_concurrency = 1000;
        let l = go(&env, args.quick, ls, &mut all).await?;
        let p = go(&env, args.quick, ps, &mut all).await?;
        rep.push(
            Row::new("e", "peak RSS MB, 1,000 in flight (N=1000, 1 s)", "<= 64").vals(
                val(&l, |o| mb(o.peak_rss_kb)),
                val(&p, |o| mb(o.peak_rss_kb)),
            ),
        );
        rep.push(Row::new("e", "slot use, N=1000, 1 s model", "-").vals(
            val(&l, |o| o.jobs_per_s / 1000.0),
            val(&p, |o| o.jobs_per_s / 1000.0),
        ));
    }

    // (g) 8 worker processes, N=64, 200 ms.
    if want("g") {
        let jobs = 64 * 5 * sz.g_secs;
        let mut ls = spec("g", Llm, jobs, 200, 64);
        ls.concurrency = None;
        ls.read_ahead = None;
        ls.processes = 8;
        let mut ps = spec("g", Peer, jobs, 200, 64);
        ps.peer_concurrency = 8;
        ps.processes = 8;
        let l = go(&env, args.quick, ls, &mut all).await?;
        let p = go(&env, args.quick, ps, &mut all).await?;
        let slot = |o: &Outcome| o.jobs_per_s / (64.0 / 0.2);
        rep.push(
            Row::new(
                "g",
                "slot use, 8 processes, N=64, 200 ms (peer 8x C=8)",
                ">= 0.98",
            )
            .vals(val(&l, slot), val(&p, slot)),
        );
        rep.push(
            Row::new("g", "Redis CPU ms/job, 8 processes", "flat vs 1 process").vals(
                val(&l, |o| o.redis_cpu_ms_per_job),
                val(&p, |o| o.redis_cpu_ms_per_job),
            ),
        );
        if let Some(c) = c64.as_ref().filter(|c| ok(c) && ok(&l)) {
            rep.note(format!(
                "g: llm-worker Redis CPU/job, 8 processes / 1 process (c, N=64): {:.2}",
                l.redis_cpu_ms_per_job / c.redis_cpu_ms_per_job
            ));
        }
    }

    // (h) start-to-ready and SIGTERM-to-exit, empty queue, median of reps.
    if want("h") {
        let mut med = Vec::new();
        for s in [Llm, Peer] {
            eprintln!("[bench] h {}: start/stop x{}", s.name(), sz.h_reps);
            match run::start_stop(&env, s, sz.h_reps).await {
                Ok((r, e)) => {
                    rep.json.insert(
                        format!("h-{}", s.name()),
                        serde_json::json!({"ready_ms": r, "exit_ms": e}),
                    );
                    med.push((Some(procs::median(r)), Some(procs::median(e))));
                }
                Err(e) => {
                    eprintln!("[bench]   error: {e:#}");
                    med.push((None, None));
                }
            }
        }
        rep.note("h: llm-worker is ready when GET /ready answers 200; the peer when its Worker is created (it prints `ready`)".into());
        rep.push(
            Row::new("h", "start to ready ms, empty queue (median)", "<= 200")
                .vals(med[0].0, med[1].0),
        );
        rep.push(
            Row::new(
                "h",
                "SIGTERM to exit ms, nothing in flight (median)",
                "<= 100",
            )
            .vals(med[0].1, med[1].1),
        );
    }

    let failed: Vec<String> = all
        .iter()
        .filter(|o| o.failed > 0 || o.error.is_some())
        .map(|o| {
            let s = o.spec.as_ref().expect("spec");
            format!(
                "{} {}: {} failed jobs{}",
                s.label,
                s.subject.name(),
                o.failed,
                o.error
                    .as_ref()
                    .map(|e| format!(", error: {e}"))
                    .unwrap_or_default()
            )
        })
        .collect();
    for f in failed {
        rep.note(f);
    }
    rep.json.insert("runs".into(), serde_json::to_value(&all)?);
    rep.json.insert("quick".into(), args.quick.into());
    if let Some(extra) = &args.worker_extra {
        rep.json.insert("worker_extra".into(), extra.clone().into());
    }
    rep.json
        .insert("seconds".into(), started.elapsed().as_secs_f64().into());
    rep.json.insert("machine".into(), report::machine().into());
    rep.print();
    if let Some(parent) = args.json.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&rep.to_json())?)?;
    eprintln!(
        "[bench] wrote {} ({:.0} s)",
        args.json.display(),
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
