//! `llm-worker demo`: a self-contained run on the simulated provider. Uses the Redis at
//! `redis.url` if one answers (under a fresh namespace, removed afterwards), else starts
//! a temporary `redis-server` on a free loopback port; starts the simulated provider
//! in-process with the first model of the route overloaded part of the time; enqueues
//! varied jobs; runs the worker in-process; prints progress, a table and a summary; and
//! shuts everything down cleanly.

use crate::config::{Config, ConfigError};
use crate::connect::connection_info;
use crate::cost;
use crate::queue::{Keys, ResultEntry, ResultStatus};
use crate::shutdown::Shutdown;
use crate::sim::{Fault, Rule, Sim, SimOptions};
use crate::tools;
use redis::AsyncCommands;
use rust_decimal::Decimal;
use serde_json::json;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const DEMO_CONFIG: &str = include_str!("../config/demo.toml");

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Number of jobs to push.
    #[arg(long, default_value_t = 40)]
    pub jobs: usize,
    /// Simulated model latency (ms); jitter adds up to half of it.
    #[arg(long, default_value_t = 300)]
    pub latency_ms: u64,
    /// Fraction of calls to the first model of the route answered 503 (overloaded).
    #[arg(long, default_value_t = 0.35)]
    pub overload: f64,
    /// Always start a temporary redis-server, even if redis.url answers.
    #[arg(long)]
    pub own_redis: bool,
    /// Give up if the jobs are not all done after this many seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "no Redis answers at {0} and redis-server is not on PATH: install it (apt-get install redis-server) or start one"
    )]
    NoRedis(String),
    #[error("demo: {0}")]
    Other(String),
}

fn other<E: std::fmt::Display>(e: E) -> DemoError {
    DemoError::Other(e.to_string())
}

/// The demo's own throwaway `redis-server` on a free loopback port (`--save ''
/// --appendonly no`, its own directory), for a newcomer with no Redis running; killed and
/// its directory removed on drop. Private to the demo: tests and benchmarks start theirs
/// with the test harness (`tests/common`).
struct TempRedis {
    child: std::process::Child,
    dir: std::path::PathBuf,
    /// `redis://127.0.0.1:<port>`
    url: String,
}

impl TempRedis {
    /// Starts one and waits (at most 5 s) until it answers PING.
    async fn start() -> Result<TempRedis, DemoError> {
        let port = free_port()?;
        let dir =
            std::env::temp_dir().join(format!("llm-worker-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(other)?;
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|_| DemoError::NoRedis("(none)".into()))?;
        let r = TempRedis {
            child,
            dir,
            url: format!("redis://127.0.0.1:{port}"),
        };
        let client = redis::Client::open(r.url.as_str()).map_err(other)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let ping = async {
                let mut c = client.get_multiplexed_async_connection().await?;
                redis::cmd("PING").query_async::<String>(&mut c).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(800), ping).await {
                return Ok(r);
            }
            if Instant::now() > deadline {
                return Err(DemoError::NoRedis(r.url.clone()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for TempRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn redis_answers(cfg: &Config) -> bool {
    let Ok(info) = connection_info(cfg) else {
        return false;
    };
    let Ok(client) = redis::Client::open(info) else {
        return false;
    };
    let ping = async {
        let mut c = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut c).await
    };
    matches!(
        tokio::time::timeout(Duration::from_millis(800), ping).await,
        Ok(Ok(_))
    )
}

fn free_port() -> Result<u16, DemoError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(other)?;
    Ok(l.local_addr().map_err(other)?.port())
}

fn sample_jobs(n: usize) -> Vec<serde_json::Value> {
    let topics = [
        "Summarise the plot of Hamlet in two sentences.",
        "Write a haiku about Redis streams.",
        "Explain exponential backoff to a new engineer.",
        "List three uses of a consumer group.",
        "Translate 'good morning' into French, German and Japanese.",
        "What is the capital of Australia?",
        "Give a one-line definition of idempotency.",
        "Suggest a name for a queue-driven LLM worker.",
        "Why do leases need a TTL?",
        "Describe a token bucket rate limiter.",
    ];
    (0..n)
        .map(|i| {
            let prompt = topics[i % topics.len()];
            let mut job = json!({
                "id": format!("demo-{i:03}"),
                "messages": [
                    {"role": "system", "content": "You are concise."},
                    {"role": "user", "content": format!("{prompt} (request {i})")}
                ],
                "metadata": {"batch": "demo", "n": i},
            });
            match i % 8 {
                3 => job["route"] = json!("quality"),
                5 => job["model"] = json!("gemini-2.5-flash"),
                6 => job["max_tokens"] = json!(24),
                _ => {}
            }
            job
        })
        .collect()
}

/// Runs the demo; returns the process exit code.
pub async fn run(
    args: DemoArgs,
    config_path: Option<&Path>,
    env: &HashMap<String, String>,
) -> Result<u8, DemoError> {
    let mut cfg = match config_path {
        Some(p) => Config::load(p, env)?,
        None => Config::from_toml_str(DEMO_CONFIG, env)?,
    };
    // Keep the demo's output readable: only warnings from the worker itself.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();

    // Redis: the configured one if it answers (own namespace), else a temporary one.
    let mut _temp = None;
    if args.own_redis || !redis_answers(&cfg).await {
        let t = TempRedis::start().await?;
        cfg.redis.url = t.url.clone();
        // The temporary server has no password; the configured Redis's is not for it.
        cfg.redis.password = None;
        _temp = Some(t);
        println!("started a temporary redis-server at {}", cfg.redis.url);
    } else {
        println!(
            "using the Redis at {}",
            crate::config::redact_url(&cfg.redis.url)
        );
    }
    let ns = format!(
        "llm-demo-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    cfg.queue.namespace = ns.clone();
    let keys = Keys::new(&ns);

    // The simulated provider: the route's first model is overloaded part of the time.
    let first = cfg
        .routes
        .get("default")
        .and_then(|r| r.first())
        .cloned()
        .unwrap_or_default();
    let sim_stop = CancellationToken::new();
    let opts = SimOptions {
        latency_ms: args.latency_ms,
        jitter_ms: args.latency_ms / 2,
        rules: vec![Rule {
            model: first.clone(),
            fault: Fault::Status { status: 503 },
            probability: args.overload.clamp(0.0, 1.0),
            first_n: None,
        }],
        cached_fraction: 0.25,
        ..SimOptions::default()
    };
    let (sim, addr) = Sim::spawn(opts, sim_stop.clone()).await.map_err(other)?;
    for p in cfg.providers.values_mut() {
        p.base_url = format!("http://{addr}/v1");
    }
    println!(
        "simulated provider at http://{addr}/v1 ({first} answers 503 to {:.0}% of calls)",
        args.overload * 100.0
    );

    // Jobs.
    let payloads: Vec<String> = sample_jobs(args.jobs)
        .iter()
        .map(|j| j.to_string())
        .collect();
    let mut sink = Vec::new();
    tools::enqueue(&cfg, &payloads, &mut sink)
        .await
        .map_err(other)?;
    println!("enqueued {} jobs on {}", payloads.len(), keys.jobs);

    // The worker, in-process.
    let started = Instant::now();
    let shutdown = Shutdown::new();
    let worker_cfg = cfg.clone();
    let sd = shutdown.clone();
    let worker =
        tokio::spawn(async move { crate::daemon::run(worker_cfg, sd, None, None, None).await });

    let client = redis::Client::open(connection_info(&cfg).map_err(other)?).map_err(other)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(other)?;
    let pool_n = cfg.pools.values().map(|p| p.slots.get()).sum::<u32>();
    let deadline = started + Duration::from_secs(args.timeout_s);
    let mut done: u64 = 0;
    let tty = std::io::stdout().is_terminal();
    let mut last_print = Instant::now();
    while done < payloads.len() as u64 && Instant::now() < deadline {
        done = conn.xlen(&keys.results).await.map_err(other)?;
        let st = sim.stats();
        let line = format!(
            "  {done:>3}/{} done   {:>2} calls in flight (most so far {} of {pool_n} slots)   {:>5.1}s ",
            payloads.len(),
            st.in_flight,
            st.max_in_flight,
            started.elapsed().as_secs_f64()
        );
        // A live line on a terminal; one line a second when piped (CI logs, tests).
        if tty {
            print!("\r{line}");
            let _ = std::io::stdout().flush();
        } else if last_print.elapsed() >= Duration::from_secs(1) || done >= payloads.len() as u64 {
            println!("{line}");
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    if tty {
        println!();
    }
    shutdown.begin(cfg.worker.shutdown_grace_ms);
    match tokio::time::timeout(
        cfg.worker.shutdown_grace_ms + Duration::from_secs(3),
        worker,
    )
    .await
    {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Err(other(e)),
        Ok(Err(e)) => return Err(other(e)),
        Err(_) => return Err(other("worker did not stop in time")),
    }

    // Report.
    let r: redis::streams::StreamRangeReply =
        conn.xrange_all(&keys.results).await.map_err(other)?;
    // Every result the demo's own worker wrote decodes; anything else is not ours to show.
    let mut rows: Vec<ResultEntry> = r
        .ids
        .iter()
        .filter_map(|e| ResultEntry::from_redis_map(&e.map).ok())
        .collect();
    rows.sort_by(|a, b| a.job_id.cmp(&b.job_id));
    println!();
    println!(
        "{:<10} {:<7} {:<18} {:<44} {:>6} {:>6} {:>12} {:>8}",
        "job", "status", "model", "models tried", "in", "out", "cost $", "latency"
    );
    let (mut total, mut retries, mut fallbacks, mut ok) = (Decimal::ZERO, 0u64, 0u64, 0u64);
    for f in &rows {
        let tried = f.tried.join(",");
        let n_tried = f.tried.len() as u64;
        let attempts = f.attempts;
        retries += attempts.saturating_sub(n_tried);
        fallbacks += n_tried.saturating_sub(1);
        total += f.cost_usd;
        if f.status == ResultStatus::Ok {
            ok += 1;
        }
        println!(
            "{:<10} {:<7} {:<18} {:<44} {:>6} {:>6} {:>12} {:>6}ms",
            f.job_id,
            f.status.as_str(),
            f.model.as_deref().unwrap_or_default(),
            format!(
                "{tried} ({attempts} call{})",
                if attempts == 1 { "" } else { "s" }
            ),
            f.input_tokens,
            f.output_tokens,
            cost::format_usd(f.cost_usd),
            f.latency_ms
        );
    }
    let st = sim.stats();
    let billed: Decimal = st
        .billed
        .iter()
        .filter_map(|(m, b)| {
            let mc = cfg.models.get(m)?;
            let price = cost::Price {
                input_per_mtok: mc.input_per_mtok,
                output_per_mtok: mc.output_per_mtok,
                cached_input_per_mtok: mc.cached_input_per_mtok,
                cache_write_per_mtok: mc.cache_write_per_mtok,
            };
            let u = cost::Usage {
                prompt_tokens: b.prompt_tokens,
                completion_tokens: b.completion_tokens,
                cached_tokens: b.cached_tokens,
                cache_write_tokens: 0,
            };
            cost::checked_cost(&u, &price).ok()
        })
        .sum();
    let secs = elapsed.as_secs_f64().max(0.001);
    println!();
    println!(
        "summary: {} jobs ({ok} ok) in {secs:.1}s = {:.1} jobs/s | total cost ${} (provider billed ${}) | retries {retries} | fallbacks {fallbacks} | most calls in flight {} of {pool_n} slots",
        rows.len(),
        rows.len() as f64 / secs,
        cost::format_usd(total),
        cost::format_usd(billed),
        st.max_in_flight,
    );

    // Clean up: the demo's keys, the simulated provider, the temporary Redis.
    let mut cursor: u64 = 0;
    loop {
        let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{{{ns}}}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .map_err(other)?;
        if !found.is_empty() {
            let _: () = conn.del(found).await.map_err(other)?;
        }
        cursor = next;
        if cursor == 0 {
            break;
        }
    }
    sim_stop.cancel();
    let complete = rows.len() == payloads.len();
    if !complete {
        eprintln!(
            "demo: only {} of {} jobs finished within {} s",
            rows.len(),
            payloads.len(),
            args.timeout_s
        );
    }
    let consistent = total == billed;
    if !consistent {
        eprintln!("demo: result costs (${total}) differ from what the provider billed (${billed})");
    }
    println!("clean shutdown; demo keys removed");
    Ok(if complete && consistent { 0 } else { 1 })
}
