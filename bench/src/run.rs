//! One measured run: a fresh redis-server and simulated model, a pre-filled backlog,
//! the worker process(es), and the figures from before/after snapshots.

use crate::procs;
use crate::redisx::{self, MonitorCounts, RedisServer};
use anyhow::{Context, bail};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

pub const MODEL: &str = "sim-model";
pub const MAX_TOKENS: u64 = 16;
pub const PEER_QUEUE: &str = "bench";
const RESULTS: &str = "{llm}:results";
const JOBS: &str = "{llm}:jobs";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Subject {
    #[serde(rename = "llm-worker")]
    Llm,
    #[serde(rename = "bullmq-official")]
    Peer,
}

impl Subject {
    pub fn name(self) -> &'static str {
        match self {
            Subject::Llm => "llm-worker",
            Subject::Peer => "bullmq-official",
        }
    }
}

/// Paths of the binaries under test and the scratch directory.
#[derive(Clone, Debug)]
pub struct Env {
    pub daemon: PathBuf,
    pub peer: PathBuf,
    pub dir: PathBuf,
    /// `--worker-extra`: lines for llm-worker's `[worker]` table (diagnostics).
    pub worker_extra: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Spec {
    pub label: String,
    pub subject: Subject,
    pub jobs: u64,
    pub latency_ms: u64,
    /// Uniform extra latency of the simulated model, 0..=this (0: every call takes
    /// exactly `latency_ms`, so calls that start together end together).
    pub jitter_ms: u64,
    /// llm-worker: `pools.default.slots` (N).
    pub slots: u32,
    /// llm-worker: `worker.concurrency`; None = the daemon's default (key left out).
    pub concurrency: Option<usize>,
    /// llm-worker: `worker.read_ahead`; None = the daemon's default (key left out: a
    /// quarter of the derived concurrency, or none beside an explicit one).
    pub read_ahead: Option<usize>,
    /// bullmq-official: concurrency of each worker process.
    pub peer_concurrency: usize,
    pub processes: usize,
    /// Count client and in-script commands with MONITOR (slows Redis: not for timing).
    pub monitor: bool,
    /// llm-worker: a budget (never exhausted), fleet-wide rpm/tpm on the provider and the
    /// model (never reached) configured, to measure what the quota checks cost.
    pub quotas: bool,
    /// How long to wait for exit after SIGTERM before SIGKILL (short in --quick, where
    /// only scenario h's exit times are used).
    #[serde(skip)]
    pub exit_grace: Duration,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Outcome {
    pub spec: Option<Spec>,
    pub error: Option<String>,
    /// Jobs finished between the "ready" snapshot and the last result.
    pub jobs_timed: u64,
    pub seconds: f64,
    pub jobs_per_s: f64,
    pub failed: u64,
    /// total_commands_processed / job (client commands and commands inside scripts).
    pub commands_per_job: f64,
    /// total_reads_processed / job: socket reads of client input (pipelines count once).
    pub reads_per_job: f64,
    pub redis_cpu_ms_per_job: f64,
    pub worker_cpu_ms_per_job: f64,
    /// The simulated model's CPU per job: a cost both subjects share on the same cores,
    /// so the larger it is, the closer every jobs/s ratio is pressed towards 1.
    pub sim_cpu_ms_per_job: Option<f64>,
    /// Largest VmHWM of the worker processes, kB.
    pub peak_rss_kb: u64,
    /// Spawn to ready, slowest process, ms.
    pub ready_ms: f64,
    /// SIGTERM to exit, slowest process, ms (nothing in flight by then).
    pub exit_ms: f64,
    pub exit_codes: Vec<Option<i32>>,
    pub redis_used_memory_after: u64,
    pub redis_keys_after: u64,
    pub key_classes_after: BTreeMap<String, u64>,
    /// INFO commandstats calls per job (commands inside scripts included).
    pub cmdstats_per_job: BTreeMap<String, f64>,
    /// Redis's usec per job in each command (INFO commandstats; a script's time
    /// includes its inner commands').
    pub cmd_usec_per_job: BTreeMap<String, f64>,
    /// MONITOR counts per job, when `monitor` was set.
    pub monitor_client_per_job: Option<BTreeMap<String, f64>>,
    pub monitor_script_per_job: Option<BTreeMap<String, f64>>,
    /// Client commands per job from MONITOR (the round trips if none were pipelined).
    pub round_trips_per_job: Option<f64>,
}

pub struct Sim {
    pub port: u16,
    child: Child,
}

impl Sim {
    /// The simulator's CPU seconds so far (user + system), when its process can be read.
    pub fn cpu_seconds(&self) -> Option<f64> {
        self.child.id().and_then(procs::cpu_seconds)
    }
}

impl Sim {
    pub async fn start(env: &Env, latency_ms: u64, jitter_ms: u64) -> anyhow::Result<Sim> {
        let port = procs::free_port()?;
        let child = Command::new(&env.daemon)
            .arg("sim-provider")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--latency-ms", &latency_ms.to_string()])
            .args(["--jitter-ms", &jitter_ms.to_string()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("spawn {} sim-provider", env.daemon.display()))?;
        procs::wait_port(port, Duration::from_secs(10)).await?;
        Ok(Sim { port, child })
    }
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// The llm-worker config for a run, written to `path`.
pub fn write_config(
    path: &Path,
    redis_url: &str,
    sim_port: u16,
    http_port: Option<u16>,
    slots: u32,
    // `[worker]`: concurrency, read_ahead (None: the daemon's default, key left out),
    // lines added as they are (`--worker-extra`).
    (concurrency, read_ahead, worker_extra): (Option<usize>, Option<usize>, Option<&str>),
    quotas: bool,
) -> anyhow::Result<()> {
    // Limits far above what a run can reach: every check runs, none holds a job back.
    let (q_provider, q_model, q_budget) = if quotas {
        (
            "rpm = 100000000\ntpm = 100000000000\n",
            "rpm = 100000000\ntpm = 100000000000\n",
            "\n[budgets.bench]\nusd_per_day = \"1000000\"\non_exhausted = \"pause\"\n",
        )
    } else {
        ("", "", "")
    };
    let conc = concurrency
        .map(|c| format!("concurrency = {c}\n"))
        .unwrap_or_default()
        + &read_ahead
            .map(|r| format!("read_ahead = {r}\n"))
            .unwrap_or_default();
    let conc = conc + &worker_extra.map(|e| format!("{e}\n")).unwrap_or_default();
    let listen = http_port
        .map(|p| format!("127.0.0.1:{p}"))
        .unwrap_or_default();
    let text = format!(
        r#"# written by llm-bench
[redis]
url = "{redis_url}"

[queue]
namespace = "llm"

[worker]
{conc}shutdown_grace_ms = 5000

[server]
listen = "{listen}"

[log]
format = "text"
level = "warn"

[pools.default]
slots = {slots}

[providers.sim]
base_url = "http://127.0.0.1:{sim_port}/v1"
api_key_env = ""
timeout_ms = 60000
requests_per_second = 1000000
{q_provider}
[models."{MODEL}"]
provider = "sim"
pool = "default"
input_per_mtok = 0.14
output_per_mtok = 0.42
context_window = 128000
{q_model}
[routes]
default = ["{MODEL}"]
{q_budget}"#
    );
    std::fs::write(path, text)?;
    Ok(())
}

/// The llm-worker job payload: the same chat request the peer's jobs carry.
pub fn llm_payload(i: u64) -> String {
    serde_json::json!({
        "messages": [{"role": "user", "content": format!("Say hello to job {i}")}],
        "max_tokens": MAX_TOKENS,
    })
    .to_string()
}

/// XADD `count` jobs to `{llm}:jobs` (pipelined in chunks).
pub async fn fill_llm(c: &mut redis::aio::MultiplexedConnection, count: u64) -> anyhow::Result<()> {
    let mut i = 0;
    while i < count {
        let end = (i + 1000).min(count);
        let mut p = redis::pipe();
        for n in i..end {
            p.cmd("XADD")
                .arg(JOBS)
                .arg("*")
                .arg("payload")
                .arg(llm_payload(n))
                .ignore();
        }
        p.query_async::<()>(c).await?;
        i = end;
    }
    Ok(())
}

pub struct Proc {
    pub child: Child,
    pub pid: u32,
    pub spawned: Instant,
    pub http_port: Option<u16>,
    pub stdout: Option<tokio::process::ChildStdout>,
}

/// How a worker process is sized: llm-worker's N and concurrency, the peer's concurrency.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub slots: u32,
    pub concurrency: Option<usize>,
    pub read_ahead: Option<usize>,
    pub peer_concurrency: usize,
    /// See [`Spec::quotas`].
    pub quotas: bool,
}

/// Spawn one worker process of `subject`.
pub fn spawn_worker(
    env: &Env,
    subject: Subject,
    idx: usize,
    redis_url: &str,
    sim_port: u16,
    shape: Shape,
) -> anyhow::Result<Proc> {
    let Shape {
        slots: spec_slots,
        concurrency,
        read_ahead,
        peer_concurrency,
        quotas,
    } = shape;
    let log = std::fs::File::create(env.dir.join(format!("{}-{idx}.log", subject.name())))?;
    match subject {
        Subject::Llm => {
            let http_port = procs::free_port()?;
            let cfg = env.dir.join(format!("llm-worker-{idx}.toml"));
            write_config(
                &cfg,
                redis_url,
                sim_port,
                Some(http_port),
                spec_slots,
                (concurrency, read_ahead, env.worker_extra.as_deref()),
                quotas,
            )?;
            let mut cmd = Command::new(&env.daemon);
            cmd.arg("--config").arg(&cfg).arg("run");
            for (k, _) in std::env::vars() {
                if k.starts_with("LLM_WORKER") || k == "RUST_LOG" || k == "REDIS_PASSWORD" {
                    cmd.env_remove(k);
                }
            }
            let spawned = Instant::now();
            let child = cmd
                .stdout(log.try_clone()?)
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("spawn {}", env.daemon.display()))?;
            let pid = child.id().context("pid")?;
            Ok(Proc {
                child,
                pid,
                spawned,
                http_port: Some(http_port),
                stdout: None,
            })
        }
        Subject::Peer => {
            let spawned = Instant::now();
            let mut child = Command::new(&env.peer)
                .arg("worker")
                .args(["--redis", redis_url, "--queue", PEER_QUEUE])
                .args(["--concurrency", &peer_concurrency.to_string()])
                .args([
                    "--model-url",
                    &format!("http://127.0.0.1:{sim_port}/v1/chat/completions"),
                    "--model",
                    MODEL,
                ])
                .env_remove("RUST_LOG")
                .stdout(Stdio::piped())
                .stderr(log)
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("spawn {}", env.peer.display()))?;
            let pid = child.id().context("pid")?;
            let stdout = child.stdout.take();
            Ok(Proc {
                child,
                pid,
                spawned,
                http_port: None,
                stdout,
            })
        }
    }
}

/// Wait until the process is ready (llm-worker: GET /ready is 200; peer: prints
/// `ready`); returns the time since spawn, in ms.
pub async fn wait_ready(p: &mut Proc, http: &reqwest::Client) -> anyhow::Result<f64> {
    let deadline = Duration::from_secs(30);
    if let Some(port) = p.http_port {
        let url = format!("http://127.0.0.1:{port}/ready");
        loop {
            if let Ok(r) = http.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(p.spawned.elapsed().as_secs_f64() * 1e3);
                }
            }
            if let Some(st) = p.child.try_wait()? {
                bail!("worker exited before ready: {st}");
            }
            if p.spawned.elapsed() > deadline {
                bail!("worker not ready within {deadline:?}");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let stdout = p.stdout.take().context("peer stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let r = tokio::time::timeout(deadline, async {
        while let Some(l) = lines.next_line().await? {
            if l.trim() == "ready" {
                return Ok::<_, anyhow::Error>(());
            }
        }
        bail!("peer exited before ready")
    })
    .await;
    let ms = p.spawned.elapsed().as_secs_f64() * 1e3;
    r.context("peer not ready in time")??;
    // Keep reading (and dropping) its stdout so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(ms)
}

/// SIGTERM and wait for exit (at most `grace`, then SIGKILL: exit code None); returns
/// (ms, exit code).
pub async fn terminate(p: &mut Proc, grace: Duration) -> (f64, Option<i32>) {
    let t = Instant::now();
    procs::sigterm(p.pid);
    wait_exit(p, t, grace).await
}

async fn wait_exit(p: &mut Proc, t: Instant, grace: Duration) -> (f64, Option<i32>) {
    match tokio::time::timeout(grace, p.child.wait()).await {
        Ok(Ok(st)) => (t.elapsed().as_secs_f64() * 1e3, st.code()),
        _ => {
            let _ = p.child.kill().await;
            (t.elapsed().as_secs_f64() * 1e3, None)
        }
    }
}

/// Finished jobs so far (one driver command).
async fn done_count(
    subject: Subject,
    c: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<u64> {
    Ok(match subject {
        Subject::Llm => redis::cmd("XLEN").arg(RESULTS).query_async(c).await?,
        Subject::Peer => {
            let (a, b): (u64, u64) = redis::pipe()
                .cmd("ZCARD")
                .arg(format!("bull:{PEER_QUEUE}:completed"))
                .cmd("ZCARD")
                .arg(format!("bull:{PEER_QUEUE}:failed"))
                .query_async(c)
                .await?;
            a + b
        }
    })
}

/// Driver commands sent per done_count poll (subtracted from the Redis figures).
fn poll_commands(subject: Subject) -> u64 {
    match subject {
        Subject::Llm => 1,
        Subject::Peer => 2,
    }
}

async fn failed_count(
    subject: Subject,
    c: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<u64> {
    match subject {
        Subject::Peer => Ok(redis::cmd("ZCARD")
            .arg(format!("bull:{PEER_QUEUE}:failed"))
            .query_async(c)
            .await?),
        Subject::Llm => {
            let mut failed = 0;
            let mut start = "-".to_string();
            loop {
                let r: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                    .arg(RESULTS)
                    .arg(&start)
                    .arg("+")
                    .arg("COUNT")
                    .arg(5000)
                    .query_async(c)
                    .await?;
                if r.ids.is_empty() {
                    break;
                }
                for e in &r.ids {
                    let st: Option<String> = e.get("status");
                    if st.as_deref() != Some("ok") {
                        failed += 1;
                    }
                }
                start = format!(
                    "({}",
                    r.ids.last().map(|e| e.id.clone()).unwrap_or_default()
                );
            }
            Ok(failed)
        }
    }
}

/// Run one spec end to end. Errors of the subject (a crash, a timeout) are returned in
/// `Outcome::error`; only a failure of the bench machinery itself is an `Err`.
pub async fn run(env: &Env, spec: &Spec) -> anyhow::Result<Outcome> {
    let redis = RedisServer::start(&env.dir).await?;
    let sim = Sim::start(env, spec.latency_ms, spec.jitter_ms).await?;
    let mut out = Outcome {
        spec: Some(spec.clone()),
        ..Outcome::default()
    };
    let r = measure(env, spec, &redis, &sim, &mut out).await;
    if let Err(e) = r {
        out.error = Some(format!("{e:#}"));
    }
    sim.stop().await;
    redis.stop().await;
    Ok(out)
}

async fn measure(
    env: &Env,
    spec: &Spec,
    redis: &RedisServer,
    sim: &Sim,
    out: &mut Outcome,
) -> anyhow::Result<()> {
    let mut c = redis.conn().await?;
    match spec.subject {
        Subject::Llm => fill_llm(&mut c, spec.jobs).await?,
        Subject::Peer => {
            llm_bench::peer::enqueue(&redis.url, PEER_QUEUE, spec.jobs, MAX_TOKENS).await?
        }
    }
    let http = reqwest::Client::new();
    let mut procs_: Vec<Proc> = Vec::new();
    for i in 0..spec.processes {
        procs_.push(spawn_worker(
            env,
            spec.subject,
            i,
            &redis.url,
            sim.port,
            Shape {
                slots: spec.slots,
                concurrency: spec.concurrency,
                read_ahead: spec.read_ahead,
                peer_concurrency: spec.peer_concurrency,
                quotas: spec.quotas,
            },
        )?);
    }
    let mut ready_ms: f64 = 0.0;
    for p in procs_.iter_mut() {
        ready_ms = ready_ms.max(wait_ready(p, &http).await?);
    }
    out.ready_ms = ready_ms;

    let mon = if spec.monitor {
        let addr = redisx::client_addr(&mut c).await?;
        Some(redisx::monitor(redis.port, vec![addr]).await?)
    } else {
        None
    };
    let cpu0: f64 = procs_
        .iter()
        .filter_map(|p| procs::cpu_seconds(p.pid))
        .sum();
    let sim_cpu0 = sim.cpu_seconds();
    let s0 = redisx::snap(&mut c).await?;
    let t0 = Instant::now();
    let r0 = done_count(spec.subject, &mut c).await?;
    let mut polls: u64 = 1;
    // Generous: 60 s, plus 2 ms a job, plus 4x the model's ideal time at N slots.
    let timeout = Duration::from_millis(
        60_000 + spec.jobs * 2 + spec.jobs * spec.latency_ms * 4 / spec.slots.max(1) as u64,
    );
    let mut done = r0;
    while done < spec.jobs {
        tokio::time::sleep(Duration::from_millis(5)).await;
        done = done_count(spec.subject, &mut c).await?;
        polls += 1;
        for p in procs_.iter_mut() {
            if let Some(st) = p.child.try_wait()? {
                bail!("worker process {} died: {st}", p.pid);
            }
        }
        if t0.elapsed() > timeout {
            out.error = Some(format!(
                "timeout: {done} of {} jobs done after {timeout:?}",
                spec.jobs
            ));
            break;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu1: f64 = procs_
        .iter()
        .filter_map(|p| procs::cpu_seconds(p.pid))
        .sum();
    let sim_cpu1 = sim.cpu_seconds();
    let s1 = redisx::snap(&mut c).await?;
    let monitor_counts: Option<MonitorCounts> = match mon {
        Some((stop, task)) => {
            let _ = stop.send(());
            Some(task.await?)
        }
        None => None,
    };
    out.peak_rss_kb = procs_
        .iter()
        .filter_map(|p| procs::status_kb(p.pid, "VmHWM"))
        .max()
        .unwrap_or(0);

    let n = done.saturating_sub(r0).max(1) as f64;
    out.jobs_timed = done.saturating_sub(r0);
    out.seconds = secs;
    out.jobs_per_s = out.jobs_timed as f64 / secs;
    // The driver's own commands in the window: the polls, plus the first INFO (a
    // command is counted once it has run, so the first INFO shows in the second).
    let own = polls * poll_commands(spec.subject) + 1;
    out.commands_per_job = (s1.commands - s0.commands).saturating_sub(own) as f64 / n;
    out.reads_per_job = (s1.reads - s0.reads).saturating_sub(polls + 1) as f64 / n;
    out.redis_cpu_ms_per_job = (s1.cpu - s0.cpu) * 1e3 / n;
    out.worker_cpu_ms_per_job = (cpu1 - cpu0) * 1e3 / n;
    if let (Some(a), Some(b)) = (sim_cpu0, sim_cpu1) {
        out.sim_cpu_ms_per_job = Some((b - a) * 1e3 / n);
    }
    let mut per_job: BTreeMap<String, f64> = BTreeMap::new();
    for (k, v) in redisx::delta(&s0.calls, &s1.calls) {
        let own_k = match k.as_str() {
            "xlen" if spec.subject == Subject::Llm => polls,
            "zcard" if spec.subject == Subject::Peer => 2 * polls,
            "info" => 1,
            _ => 0,
        };
        let v = v.saturating_sub(own_k);
        if v > 0 {
            per_job.insert(k, v as f64 / n);
        }
    }
    out.cmdstats_per_job = per_job;
    out.cmd_usec_per_job = redisx::delta(&s0.usec, &s1.usec)
        .into_iter()
        .map(|(k, v)| (k, v as f64 / n))
        .collect();
    if let Some(m) = monitor_counts {
        let pj = |m: &BTreeMap<String, u64>| -> BTreeMap<String, f64> {
            m.iter().map(|(k, v)| (k.clone(), *v as f64 / n)).collect()
        };
        out.round_trips_per_job = Some(m.client.values().sum::<u64>() as f64 / n);
        out.monitor_client_per_job = Some(pj(&m.client));
        out.monitor_script_per_job = Some(pj(&m.script));
    }

    // SIGTERM every process at once, then wait for each.
    let t = Instant::now();
    for p in procs_.iter() {
        procs::sigterm(p.pid);
    }
    let mut exit_ms: f64 = 0.0;
    for p in procs_.iter_mut() {
        let (ms, code) = wait_exit(p, t, spec.exit_grace).await;
        exit_ms = exit_ms.max(ms);
        out.exit_codes.push(code);
    }
    out.exit_ms = exit_ms;
    out.failed = failed_count(spec.subject, &mut c).await.unwrap_or(0);
    let s2 = redisx::snap(&mut c).await?;
    out.redis_used_memory_after = s2.used_memory;
    let (keys, classes) = redisx::key_census(&mut c).await?;
    out.redis_keys_after = keys;
    out.key_classes_after = classes;
    Ok(())
}

/// Start-to-ready and SIGTERM-to-exit with an empty queue, `reps` times; returns the
/// samples (ms).
pub async fn start_stop(
    env: &Env,
    subject: Subject,
    reps: usize,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let redis = RedisServer::start(&env.dir).await?;
    let sim = Sim::start(env, 0, 0).await?;
    let http = reqwest::Client::new();
    let mut ready = Vec::new();
    let mut exit = Vec::new();
    let mut err = None;
    for i in 0..reps {
        let r: anyhow::Result<()> = async {
            let mut p = spawn_worker(
                env,
                subject,
                100 + i,
                &redis.url,
                sim.port,
                Shape {
                    slots: 8,
                    concurrency: Some(8),
                    read_ahead: None,
                    peer_concurrency: 8,
                    quotas: false,
                },
            )?;
            ready.push(wait_ready(&mut p, &http).await?);
            // Let it settle into its idle read loop: nothing in flight.
            tokio::time::sleep(Duration::from_millis(300)).await;
            exit.push(terminate(&mut p, Duration::from_secs(30)).await.0);
            Ok(())
        }
        .await;
        if let Err(e) = r {
            err = Some(e);
            break;
        }
    }
    sim.stop().await;
    redis.stop().await;
    match err {
        Some(e) => Err(e),
        None => Ok((ready, exit)),
    }
}
