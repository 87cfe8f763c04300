//! The peer: a worker built on `bullmq-official` (the Rust port of BullMQ) doing the
//! same work per job as llm-worker: POST the job's chat request to the simulated model's
//! `/v1/chat/completions` (body: `model`, `messages`, `max_tokens`) and return the
//! assistant's content as the job's result. BullMQ keeps the result with the finished job.

use bullmq::options::RedisConnectionOptions;
use bullmq::{BulkJob, Job, Queue, QueueOptions, Worker, WorkerOptions};
use serde_json::{Value, json};
use std::sync::Arc;

/// The job data the producer enqueues: the same chat request llm-worker's jobs carry.
pub fn job_data(i: u64, max_tokens: u64) -> Value {
    json!({
        "messages": [{"role": "user", "content": format!("Say hello to job {i}")}],
        "max_tokens": max_tokens,
    })
}

fn connection(redis_url: &str, max_connections: usize) -> RedisConnectionOptions {
    RedisConnectionOptions {
        url: redis_url.to_string(),
        max_connections,
        ..RedisConnectionOptions::default()
    }
}

/// Enqueue `count` jobs on `queue` with the peer's own API (`Queue::add_bulk`, in chunks).
pub async fn enqueue(
    redis_url: &str,
    queue: &str,
    count: u64,
    max_tokens: u64,
) -> anyhow::Result<()> {
    let opts = QueueOptions {
        connection: connection(redis_url, 4),
        ..QueueOptions::default()
    };
    let q = Queue::with_options(queue, opts).await?;
    let mut i = 0;
    while i < count {
        let end = (i + 1000).min(count);
        let jobs = (i..end)
            .map(|n| BulkJob::new("chat", job_data(n, max_tokens)))
            .collect();
        q.add_bulk(jobs).await?;
        i = end;
    }
    Ok(())
}

/// Settings of one peer worker process.
#[derive(Clone, Debug)]
pub struct PeerWorker {
    pub redis_url: String,
    pub queue: String,
    pub concurrency: usize,
    /// `http://127.0.0.1:PORT/v1/chat/completions`
    pub model_url: String,
    pub model: String,
}

/// Run a worker until SIGTERM/SIGINT, then close it (waiting up to 5 s for running jobs)
/// and return. Prints `ready` on stdout once the worker runs.
pub async fn run_worker(cfg: PeerWorker) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(cfg.concurrency.max(1))
        .build()?;
    let model_url: Arc<str> = cfg.model_url.into();
    let model: Arc<str> = cfg.model.into();
    let processor = move |job: Job, _token| {
        let http = http.clone();
        let model_url = model_url.clone();
        let model = model.clone();
        async move {
            let data = job.data();
            let body = json!({
                "model": &*model,
                "messages": data.get("messages").cloned().unwrap_or(Value::Null),
                "max_tokens": data.get("max_tokens").cloned().unwrap_or(Value::Null),
            });
            let resp = http
                .post(&*model_url)
                .json(&body)
                .send()
                .await
                .map_err(|e| bullmq::Error::ProcessingError(e.to_string()))?;
            let status = resp.status();
            let v: Value = resp
                .json()
                .await
                .map_err(|e| bullmq::Error::ProcessingError(e.to_string()))?;
            if !status.is_success() {
                return Err(bullmq::Error::ProcessingError(format!("HTTP {status}")));
            }
            let content = v["choices"][0]["message"]["content"].clone();
            Ok(content)
        }
    };
    let opts = WorkerOptions {
        connection: connection(&cfg.redis_url, 4),
        concurrency: cfg.concurrency,
        ..WorkerOptions::default()
    };
    let worker = Arc::new(Worker::with_options(&cfg.queue, processor, opts).await?);
    // Worker events go to an unbounded channel: read them, as an application would, so
    // they do not pile up in memory.
    let events = worker.clone();
    tokio::spawn(async move { while events.next_event().await.is_some() {} });
    println!("ready");
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    worker.close(5000).await?;
    Ok(())
}
