//! Diagnostics: the simulated model's ceiling for one HTTP client alone (no Redis, no
//! worker), to tell whether the model is what bounds scenario a: `sim-load URL
//! [CONCURRENCY] [REQUESTS] [THREADS]` posts REQUESTS chat completions from CONCURRENCY
//! tasks over keep-alive connections (reqwest, as the worker and the peer) and prints
//! requests per second. Start the model with `llm-worker sim-provider --latency-ms 0
//! --jitter-ms 0` (its default jitter is 100 ms).
use anyhow::Context;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let usage = "usage: sim-load URL [CONCURRENCY=64] [REQUESTS=20000] [THREADS=1] (URL: the simulated model's /v1/chat/completions)";
    let url: Arc<str> = a.get(1).context(usage)?.as_str().into();
    let arg = |i: usize, name: &str, default: usize| -> anyhow::Result<usize> {
        a.get(i).map_or(Ok(default), |s| {
            s.parse()
                .with_context(|| format!("{name} {s:?} is not a whole number; {usage}"))
        })
    };
    let conc = arg(2, "CONCURRENCY", 64)?.max(1);
    let jobs = arg(3, "REQUESTS", 20000)?;
    let threads = arg(4, "THREADS", 1)?.max(1);
    let rt = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?
    };
    rt.block_on(async move {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(conc)
            .build()?;
        let left = Arc::new(AtomicUsize::new(jobs));
        let t0 = tokio::time::Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..conc {
            let (http, url, left) = (http.clone(), url.clone(), left.clone());
            set.spawn(async move {
                while left
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok()
                {
                    let body = serde_json::json!({"model": "sim-model",
                        "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16});
                    let r = http.post(&*url).json(&body).send().await?;
                    let _v: serde_json::Value = r.json().await?;
                }
                anyhow::Ok(())
            });
        }
        while let Some(r) = set.join_next().await {
            r??;
        }
        let s = t0.elapsed().as_secs_f64();
        println!("{jobs} requests in {s:.3} s: {:.0} req/s", jobs as f64 / s);
        anyhow::Ok(())
    })
}
