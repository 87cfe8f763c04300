//! `bullmq-peer`: the bullmq-official peer of the benchmark. `worker` runs one worker
//! process until SIGTERM; `enqueue` pushes N jobs with the peer's own API.

use clap::{Parser, Subcommand};
use llm_bench::peer;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one worker until SIGTERM or SIGINT; prints `ready` once it runs.
    Worker {
        #[arg(long)]
        redis: String,
        #[arg(long, default_value = "bench")]
        queue: String,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// e.g. http://127.0.0.1:8089/v1/chat/completions
        #[arg(long)]
        model_url: String,
        #[arg(long, default_value = "sim-model")]
        model: String,
    },
    /// Enqueue N jobs (the same chat request llm-worker's jobs carry).
    Enqueue {
        #[arg(long)]
        redis: String,
        #[arg(long, default_value = "bench")]
        queue: String,
        #[arg(long)]
        count: u64,
        #[arg(long, default_value_t = 16)]
        max_tokens: u64,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Worker {
            redis,
            queue,
            concurrency,
            model_url,
            model,
        } => {
            peer::run_worker(peer::PeerWorker {
                redis_url: redis,
                queue,
                concurrency,
                model_url,
                model,
            })
            .await
        }
        Cmd::Enqueue {
            redis,
            queue,
            count,
            max_tokens,
        } => peer::enqueue(&redis, &queue, count, max_tokens).await,
    }
}
