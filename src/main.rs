//! `llm-worker`: argument parsing and wiring only (business logic lives in the library).
//! Exit codes: 0 clean shutdown, 2 config error (message names the key), 1 anything else.

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use llm_worker::config::{Config, ConfigError, resolve_path};
use llm_worker::shutdown::Shutdown;
use llm_worker::{daemon, demo, sim, tools};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "llm-worker",
    version,
    about = "Queue-driven LLM worker: Redis stream in, results with exact cost out"
)]
struct Cli {
    /// Config file (else $LLM_WORKER_CONFIG, else config/default.toml; `demo` uses its
    /// built-in config/demo.toml unless this is given; `sim-provider` takes none).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The daemon (the default without a subcommand).
    Run,
    /// Push jobs from flags or a JSONL file; prints one entry id per line.
    Enqueue(EnqueueArgs),
    /// Read results (--follow to tail, --job ID for one).
    Results(ResultsArgs),
    /// Queue length, pending, consumers, held slots and holders, dead letters, cost totals.
    Status {
        /// One JSON object (the stable shape README documents), for scripts.
        #[arg(long, conflicts_with = "watch")]
        json: bool,
        /// A live view refreshed every second (q to quit); plain status lines every
        /// second when stdout is not a terminal.
        #[arg(long)]
        watch: bool,
        /// With --watch: stop after this many refreshes (at least 1).
        #[arg(long, requires = "watch", allow_negative_numbers = true,
              value_parser = clap::value_parser!(i64).range(1..))]
        count: Option<i64>,
    },
    /// Cancel a job by id: queued, it ends `cancelled` with no model call; running, its
    /// call is aborted wherever in the fleet it runs (within about a second).
    Cancel {
        /// The job's id (its `id` field, or its entry id when it had none).
        id: String,
    },
    /// Dead letters ({ns}:dead) and copies of failed jobs ({ns}:failed): list, show,
    /// replay, purge.
    #[command(subcommand)]
    Dead(DeadCmd),
    /// Run a failed or dead job again, from its newest copy, keeping its id.
    Retry {
        /// The job's id.
        id: String,
    },
    /// Delete every key of the namespace ({ns}:*): queue, results, letters, slots, totals.
    Purge {
        /// Do not ask; required when stdin is not a terminal.
        #[arg(long)]
        yes: bool,
        /// Purge even while workers of the group were active within the last minute.
        #[arg(long)]
        force: bool,
    },
    /// Validate the config and print it with secrets redacted.
    CheckConfig,
    /// A local OpenAI-compatible model server with settable latency, errors and token counts.
    SimProvider(sim::SimArgs),
    /// A self-contained run: simulated provider, sample jobs, results table, clean shutdown
    /// (on the built-in config/demo.toml unless --config is given).
    Demo(demo::DemoArgs),
}

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
struct EnqueueArgs {
    /// A user message; repeat for several jobs.
    #[arg(long)]
    prompt: Vec<String>,
    /// First-choice model.
    #[arg(long)]
    model: Option<String>,
    /// Route name from [routes].
    #[arg(long)]
    route: Option<String>,
    /// Job id (idempotency key); with several prompts, `-<n>` is appended (from 1).
    #[arg(long)]
    id: Option<String>,
    /// JSON copied to the result.
    #[arg(long)]
    metadata: Option<String>,
    /// Cap on the answer's length, in tokens (the job's `max_tokens`, at least 1).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    max_tokens: Option<i64>,
    /// JSONL file of payloads, one JSON object per line (`-` = stdin).
    #[arg(long)]
    file: Option<PathBuf>,
    /// Wait for every job's result: print the content (one job) or one line per job;
    /// exit 1 if a job did not end ok, 124 if the timeout ran out first.
    #[arg(long)]
    wait: bool,
    /// With --wait: give up after this long (`30s`, `5m`); default: wait as long as it takes.
    #[arg(long, value_parser = humantime::parse_duration, requires = "wait")]
    timeout: Option<Duration>,
    /// With --wait: write every result to this file as JSON lines, in input order.
    #[arg(long, requires = "wait")]
    output: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum DeadCmd {
    /// The newest letters, newest first.
    List {
        /// The copies of failed jobs instead of the dead letters.
        #[arg(long)]
        failed: bool,
        /// How many to show (at least 1).
        #[arg(long, default_value_t = 20, allow_negative_numbers = true,
              value_parser = clap::value_parser!(i64).range(1..))]
        count: i64,
    },
    /// Every field of the letters of one job (a job id, its entry id, or the letter's id).
    Show {
        /// Job id, job entry id or letter entry id.
        id: String,
        /// Look among the copies of failed jobs instead of the dead letters.
        #[arg(long)]
        failed: bool,
    },
    /// Push letters again as jobs (keeping their id) and delete them.
    Replay {
        /// Job id, job entry id or letter entry id (or --all).
        id: Option<String>,
        /// Every letter of the stream.
        #[arg(long, conflicts_with = "id")]
        all: bool,
        /// The copies of failed jobs instead of the dead letters.
        #[arg(long)]
        failed: bool,
        /// Run them on this route of [routes].
        #[arg(long)]
        route: Option<String>,
        /// Give each a new id (`<id>.retry-<unix ms>`), so it runs even if its id has an
        /// ok result meanwhile.
        #[arg(long)]
        new_id: bool,
    },
    /// Delete letters older than a duration (`7d`, `12h`, `30m`).
    Purge {
        /// Age above which letters are deleted.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// The copies of failed jobs instead of the dead letters.
        #[arg(long)]
        failed: bool,
    },
}

#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
struct ResultsArgs {
    /// Keep printing new results as they arrive.
    #[arg(long)]
    follow: bool,
    /// Only the result of this job id (with --follow: wait for it).
    #[arg(long)]
    job: Option<String>,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// How many of the latest results to show (at least 1).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(i64).range(1..))]
    count: i64,
}

fn env_map() -> HashMap<String, String> {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

fn load_config(cli: &Cli, env: &HashMap<String, String>) -> Result<Config, ConfigError> {
    Config::load(&resolve_path(cli.config.as_deref(), env), env)
}

fn init_tracing(format: &str, level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: a redirected stderr (a file, journald) gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    if format == "json" {
        b.json().init();
    } else {
        b.init();
    }
}

fn main() -> ExitCode {
    // SAFETY: first thing, before any thread: the mappings recorded are inside the
    // segments of the objects the loader loaded, which stay mapped for the process's life.
    unsafe { llm_worker::resident::remember_start_mappings() };
    let cli = Cli::parse();
    let env = env_map();
    if matches!(cli.cmd, Some(Cmd::SimProvider(_))) && cli.config.is_some() {
        eprintln!(
            "error: sim-provider takes no --config (it is a model server, not a worker); set it up with its own flags (see sim-provider --help)"
        );
        return ExitCode::from(2);
    }
    let needs_config = !matches!(cli.cmd, Some(Cmd::SimProvider(_)) | Some(Cmd::Demo(_)));
    let cfg = if needs_config {
        match load_config(&cli, &env) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    // `worker.threads`: 1 = a current-thread runtime, 0 = one worker thread per core.
    // The simulated provider and the demo keep the multi-threaded default.
    let mut b = match cfg.as_ref().map(|c| c.worker.threads) {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) if n > 1 => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = match b.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let r = rt.block_on(real_main(cli, cfg, env));
    // Do not wait for stray blocking tasks (e.g. a stdin reader) on the way out.
    rt.shutdown_timeout(Duration::from_millis(200));
    match r {
        Ok(code) => code,
        // Output piped into `head` (or anything that stops reading): stop quietly, as
        // command-line tools do.
        Err(e) if broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

async fn real_main(
    cli: Cli,
    cfg: Option<Config>,
    env: HashMap<String, String>,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout();
    match cli.cmd {
        None | Some(Cmd::Run) => {
            let cfg = cfg.context("config")?;
            init_tracing(&cfg.log.format, &cfg.log.level);
            let prom = llm_worker::server::metrics_builder()
                .install_recorder()
                .context("installing the metrics recorder")?;
            // The exporter keeps every histogram sample until an upkeep (or a scrape)
            // folds it into its buckets: about 32 bytes a job, so at 13,000 jobs/s a 5 s
            // upkeep let 2 MB pile up between two of them. Every second bounds that to a
            // second of samples.
            let upkeep = prom.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    upkeep.run_upkeep();
                }
            });
            let listener = if cfg.server.listen.is_empty() {
                None
            } else {
                Some(
                    tokio::net::TcpListener::bind(&cfg.server.listen)
                        .await
                        .with_context(|| {
                            format!("cannot listen on {} (fix server.listen)", cfg.server.listen)
                        })?,
                )
            };
            if let Some(l) = &listener {
                tracing::info!(addr = %l.local_addr()?, "serving /health /ready /metrics");
            }
            let shutdown = Shutdown::new();
            shutdown
                .listen_for_signals(
                    cfg.worker.shutdown_grace_ms,
                    "stopping: no new jobs; draining in-flight jobs",
                )
                .context("installing signal handlers")?;
            let mut cfg = cfg;
            match llm_worker::keycheck::check(&cfg).await {
                Ok(found) => {
                    cfg.unavailable_models = llm_worker::keycheck::unseen_models(&found);
                    cfg.key_check = found
                        .iter()
                        .map(|(p, f)| (p.clone(), f.summary()))
                        .collect();
                }
                Err(e) => {
                    tracing::error!(error = %e, "stopping: a provider rejected its API key");
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
            }
            match daemon::run(cfg, shutdown, listener, Some(prom), None).await {
                Err(e @ daemon::DaemonError::Eviction(_)) => {
                    tracing::error!(error = %e, "stopping: Redis may evict the worker's keys");
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
                Err(e @ daemon::DaemonError::KeyAccess { .. }) => {
                    tracing::error!(error = %e, "stopping: the Redis user may not touch the worker's keys");
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
                Err(e @ daemon::DaemonError::Access(_)) => {
                    tracing::error!(error = %e, "stopping: Redis refused the worker's credentials");
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
                r => r?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(Cmd::Enqueue(a)) => {
            let cfg = cfg.context("config")?;
            let file_text = match &a.file {
                Some(p) if p.as_os_str() == "-" => Some(std::io::read_to_string(std::io::stdin())?),
                Some(p) => Some(
                    std::fs::read_to_string(p)
                        .with_context(|| format!("cannot read {}", p.display()))?,
                ),
                None => None,
            };
            let payloads = tools::build_payloads(
                &cfg,
                &a.prompt,
                a.model.as_deref(),
                a.route.as_deref(),
                a.id.as_deref(),
                a.metadata.as_deref(),
                a.max_tokens.map(|t| t as u64),
                file_text.as_deref(),
            )?;
            if !a.wait {
                tools::enqueue(&cfg, &payloads, &mut out).await?;
                return Ok(ExitCode::SUCCESS);
            }
            enqueue_wait(&cfg, &payloads, a.timeout, a.output.as_deref(), &mut out).await
        }
        Some(Cmd::Results(a)) => {
            let cfg = cfg.context("config")?;
            let found = tools::results(
                &cfg,
                a.job.as_deref(),
                a.follow,
                a.count as usize,
                a.json,
                &mut out,
            )
            .await?;
            match found {
                tools::Found::NoJob => {
                    eprintln!("no result for job {}", a.job.unwrap_or_default());
                    Ok(ExitCode::from(1))
                }
                // A job that did not end ok: its result is printed, and the exit says so.
                tools::Found::Job(s) if s != Some(llm_worker::queue::ResultStatus::Ok) => {
                    Ok(ExitCode::from(1))
                }
                _ => Ok(ExitCode::SUCCESS),
            }
        }
        Some(Cmd::Status {
            watch: true, count, ..
        }) => {
            let cfg = cfg.context("config")?;
            llm_worker::watch::run(&cfg, count.map(|c| c as u64)).await?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Cmd::Status { json, .. }) => {
            let cfg = cfg.context("config")?;
            let v = tools::status(&cfg).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                tools::print_status(&v, &mut out)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Some(Cmd::Cancel { id }) => {
            let cfg = cfg.context("config")?;
            match tools::cancel(&cfg, &id).await? {
                tools::CancelOutcome::Requested => {
                    println!(
                        "cancel requested for job {id:?}: it ends with status cancelled (queued: when a worker takes it, with no model call; running: within about a second)"
                    );
                    Ok(ExitCode::SUCCESS)
                }
                tools::CancelOutcome::AlreadyOk => {
                    eprintln!("job {id:?} already ended ok: nothing to cancel");
                    Ok(ExitCode::from(1))
                }
            }
        }
        Some(Cmd::Dead(d)) => {
            let cfg = cfg.context("config")?;
            dead_cmd(&cfg, d, &mut out).await
        }
        Some(Cmd::Retry { id }) => {
            let cfg = cfg.context("config")?;
            match llm_worker::letters::retry(&cfg, &id).await? {
                llm_worker::letters::Retried::Pushed { letter, new_entry } => {
                    writeln!(
                        out,
                        "job {id:?} pushed again as entry {new_entry} (from {} letter {}: {})",
                        letter.which.name(),
                        letter.entry,
                        letter.letter.reason
                    )?;
                    Ok(ExitCode::SUCCESS)
                }
                llm_worker::letters::Retried::AlreadyOk => {
                    eprintln!("job {id:?} already ended ok: nothing to retry");
                    Ok(ExitCode::from(1))
                }
                llm_worker::letters::Retried::Running => {
                    eprintln!(
                        "job {id:?} is running now (a copy pushed again): wait for its result, then retry if it fails"
                    );
                    Ok(ExitCode::from(1))
                }
            }
        }
        Some(Cmd::Purge { yes, force }) => {
            let cfg = cfg.context("config")?;
            purge_cmd(&cfg, yes, force).await
        }
        Some(Cmd::CheckConfig) => {
            let cfg = cfg.context("config")?;
            print!("{}", cfg.redacted_toml());
            match llm_worker::keycheck::check(&cfg).await {
                Ok(found) => {
                    for (provider, f) in found {
                        if f != llm_worker::keycheck::Found::Skipped {
                            eprintln!("provider {provider}: key {}", f.summary());
                        }
                    }
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
            }
            eprintln!("config ok");
            Ok(ExitCode::SUCCESS)
        }
        Some(Cmd::SimProvider(a)) => {
            init_tracing("text", "info");
            let shutdown = Shutdown::new();
            shutdown.listen_for_signals(Duration::ZERO, "stopping the simulated provider")?;
            let token = shutdown.stop.clone();
            sim::run_cli(a, token).await?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Cmd::Demo(a)) => match demo::run(a, cli.config.as_deref(), &env).await {
            Ok(code) => Ok(ExitCode::from(code)),
            Err(demo::DemoError::Config(e)) => {
                eprintln!("{e}");
                Ok(ExitCode::from(2))
            }
            Err(e) => Err(e.into()),
        },
    }
}

/// `dead list | show | replay | purge`.
async fn dead_cmd(
    cfg: &Config,
    cmd: DeadCmd,
    out: &mut impl std::io::Write,
) -> anyhow::Result<ExitCode> {
    use llm_worker::letters::{self, Which};
    let which = |failed: bool| if failed { Which::Failed } else { Which::Dead };
    match cmd {
        DeadCmd::List { failed, count } => {
            let w = which(failed);
            let (list, bad) = letters::list(cfg, w, count as usize).await?;
            if list.is_empty() && bad == 0 {
                writeln!(
                    out,
                    "no {} letters in {{{}}}:{}",
                    w.name(),
                    cfg.queue.namespace,
                    w.name()
                )?;
                return Ok(ExitCode::SUCCESS);
            }
            writeln!(
                out,
                "{:<17} {:>8} {:<24} {:>5}  REASON",
                "LETTER", "AGE", "JOB ID", "DELIV"
            )?;
            let now = llm_worker::cost::unix_now_ms();
            for l in &list {
                let age = Duration::from_secs(now.saturating_sub(l.at_ms()) / 1000);
                let id = l
                    .letter
                    .job_id
                    .clone()
                    .unwrap_or_else(|| format!("({})", l.letter.job_entry));
                writeln!(
                    out,
                    "{:<17} {:>8} {:<24} {:>5}  {}",
                    l.entry,
                    humantime::format_duration(age)
                        .to_string()
                        .split(' ')
                        .next()
                        .unwrap_or("0s"),
                    id,
                    l.letter.deliveries,
                    l.letter.reason
                )?;
            }
            if bad > 0 {
                writeln!(out, "({bad} entries not written by llm-worker skipped)")?;
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadCmd::Show { id, failed } => {
            let found = letters::find(cfg, which(failed), &id).await?;
            if found.is_empty() {
                eprintln!("no {} letter for {id:?}", which(failed).name());
                return Ok(ExitCode::from(1));
            }
            for l in found {
                let mut v = serde_json::json!({
                    "letter": l.entry,
                    "stream": l.which.name(),
                    "job_entry": l.letter.job_entry,
                    "job_id": l.letter.job_id,
                    "reason": l.letter.reason,
                    "deliveries": l.letter.deliveries,
                });
                let fields: serde_json::Map<String, serde_json::Value> = l
                    .letter
                    .original()
                    .iter()
                    .map(|(k, val)| {
                        let text = String::from_utf8_lossy(val).into_owned();
                        let parsed =
                            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
                        (String::from_utf8_lossy(k).into_owned(), parsed)
                    })
                    .collect();
                v["fields"] = serde_json::Value::Object(fields);
                writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadCmd::Replay {
            id,
            all,
            failed,
            route,
            new_id,
        } => {
            let w = which(failed);
            let how = letters::Replay { route, new_id };
            let done = match (id, all) {
                (Some(id), false) => {
                    let chosen = letters::newest_per_job(letters::find(cfg, w, &id).await?);
                    if chosen.is_empty() {
                        eprintln!("no {} letter for that id", w.name());
                        return Ok(ExitCode::from(1));
                    }
                    letters::replay(cfg, &chosen, &how).await?
                }
                (None, true) => letters::replay_all(cfg, w, &how).await?,
                _ => anyhow::bail!("dead replay: give a job id or --all"),
            };
            for (letter, new) in &done {
                writeln!(out, "{letter} -> {new}")?;
            }
            writeln!(out, "replayed {} {} letters", done.len(), w.name())?;
            Ok(ExitCode::SUCCESS)
        }
        DeadCmd::Purge { older_than, failed } => {
            let w = which(failed);
            let n = letters::purge_older(cfg, w, older_than).await?;
            writeln!(
                out,
                "deleted {n} {} letters older than {}",
                w.name(),
                humantime::format_duration(older_than)
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `purge`: every key of the namespace, after a check that no worker runs and a
/// confirmation (typing the namespace, or --yes).
async fn purge_cmd(cfg: &Config, yes: bool, force: bool) -> anyhow::Result<ExitCode> {
    let ns = &cfg.queue.namespace;
    let (keys, live) = llm_worker::letters::namespace_keys(cfg).await?;
    if keys.is_empty() {
        println!("namespace {ns:?} has no keys: nothing to purge");
        return Ok(ExitCode::SUCCESS);
    }
    if !live.is_empty() && !force {
        eprintln!(
            "refusing: {} worker(s) of group {:?} were active within the last minute ({}); stop them first, or pass --force",
            live.len(),
            cfg.queue.group,
            live.join(", ")
        );
        return Ok(ExitCode::from(1));
    }
    if !yes {
        if !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
            eprintln!("refusing to purge without --yes (stdin is not a terminal to confirm on)");
            return Ok(ExitCode::from(1));
        }
        eprint!(
            "delete all {} keys of namespace {ns:?} (jobs, results, letters, slots, totals)? type the namespace to confirm: ",
            keys.len()
        );
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        if line.trim() != ns {
            eprintln!("not confirmed; nothing deleted");
            return Ok(ExitCode::from(1));
        }
    }
    let n = llm_worker::letters::delete_keys(cfg, &keys).await?;
    println!("deleted {n} keys of namespace {ns:?}");
    Ok(ExitCode::SUCCESS)
}

/// Whether `e` is a write to a pipe whose reader has gone (`| head`).
fn broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        let io = c
            .downcast_ref::<std::io::Error>()
            .or_else(|| match c.downcast_ref() {
                Some(tools::ToolError::Io(io)) => Some(io),
                _ => None,
            });
        io.is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// `enqueue --wait`: push, wait for each result (a progress bar on a terminal for more
/// than one job), print or write them in input order.
async fn enqueue_wait(
    cfg: &Config,
    payloads: &[String],
    timeout: Option<Duration>,
    output: Option<&std::path::Path>,
    out: &mut impl Write,
) -> anyhow::Result<ExitCode> {
    // Drawn on stderr, and only when it is a terminal (indicatif hides it otherwise).
    let bar = indicatif::ProgressBar::new(payloads.len() as u64);
    if payloads.len() > 1 {
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {pos}/{len} results  {per_sec}  eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let waited = llm_worker::wait::enqueue_and_wait(cfg, payloads, timeout, |done, _| {
        bar.set_position(done as u64)
    })
    .await?;
    bar.finish_and_clear();
    let all_ok = waited.jobs.iter().all(|(_, r)| {
        r.as_ref()
            .is_some_and(|r| r.status == llm_worker::queue::ResultStatus::Ok)
    });
    if let Some(path) = output {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot write {}", path.display()))?,
        );
        for (id, r) in &waited.jobs {
            let line = match r {
                Some(r) => tools::result_json(r),
                None => {
                    serde_json::json!({"job_id": id, "status": null, "error": "no result before the timeout"})
                }
            };
            writeln!(f, "{line}")?;
        }
        f.flush()?;
    }
    if payloads.len() == 1 && output.is_none() {
        match &waited.jobs[0] {
            (_, Some(r)) => {
                if let Some(c) = &r.content {
                    writeln!(out, "{c}")?;
                }
                eprintln!(
                    "{} {} cost_usd={} latency_ms={}{}",
                    r.status,
                    r.model.as_deref().unwrap_or("-"),
                    r.cost_usd,
                    r.latency_ms,
                    r.error
                        .as_ref()
                        .map(|e| format!(" error: {e}"))
                        .unwrap_or_default()
                );
            }
            (id, None) => eprintln!("job {id:?}: no result before the timeout"),
        }
    } else if output.is_none() {
        for (id, r) in &waited.jobs {
            match r {
                Some(r) => writeln!(
                    out,
                    "{id} {} {} {}",
                    r.status,
                    r.model.as_deref().unwrap_or("-"),
                    r.cost_usd
                )?,
                None => writeln!(out, "{id} - - - (no result before the timeout)")?,
            }
        }
    } else {
        let ok = waited
            .jobs
            .iter()
            .filter(|(_, r)| {
                r.as_ref()
                    .is_some_and(|r| r.status == llm_worker::queue::ResultStatus::Ok)
            })
            .count();
        eprintln!(
            "{} results written ({ok} ok)",
            waited.jobs.iter().filter(|(_, r)| r.is_some()).count()
        );
    }
    Ok(if waited.timed_out {
        ExitCode::from(124)
    } else if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
