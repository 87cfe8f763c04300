//! The Redis ceiling: `redis-benchmark` on a fresh redis-server for the command shapes
//! the workers send, and the jobs/s Redis could serve for a measured per-job mix.

use crate::redisx::RedisServer;
use anyhow::Context;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Clone, Debug, Default, Serialize)]
pub struct Ceiling {
    /// requests/s by test name.
    pub rps: BTreeMap<String, f64>,
}

/// Script used for "a script call with k inner commands".
const SCRIPT: &str = "for i=1,tonumber(ARGV[1]) do redis.call('SET',KEYS[1],ARGV[2]) end return 1";

async fn bench(port: u16, clients: u32, n: u64, cmd: &[&str]) -> anyhow::Result<f64> {
    let out = tokio::process::Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", &clients.to_string(), "-n", &n.to_string()])
        .args(["-r", "100000", "--csv"])
        .args(cmd)
        .output()
        .await
        .context("run redis-benchmark")?;
    let text = String::from_utf8_lossy(&out.stdout);
    // --csv: a header line, then "test","rps",... (the test name may hold commas).
    for line in text.lines() {
        let f: Vec<&str> = line.trim().trim_matches('"').split("\",\"").collect();
        if f.len() >= 2 {
            if let Ok(rps) = f[1].parse::<f64>() {
                return Ok(rps);
            }
        }
    }
    anyhow::bail!("redis-benchmark printed no rate: {text}")
}

/// PING, SET and scripts of each `k` inner calls, with 64 clients.
pub async fn measure(dir: &Path, n: u64, script_sizes: &[u64]) -> anyhow::Result<Ceiling> {
    let r = RedisServer::start(dir).await?;
    let mut c = Ceiling::default();
    let res: anyhow::Result<()> = async {
        c.rps
            .insert("PING".into(), bench(r.port, 64, n, &["PING"]).await?);
        c.rps.insert(
            "SET".into(),
            bench(r.port, 64, n, &["SET", "k:__rand_int__", "v"]).await?,
        );
        for &k in script_sizes {
            let ks = k.to_string();
            c.rps.insert(
                format!("EVAL({k} inner)"),
                bench(
                    r.port,
                    64,
                    n,
                    &["EVAL", SCRIPT, "1", "k:__rand_int__", &ks, "v"],
                )
                .await?,
            );
        }
        Ok(())
    }
    .await;
    r.stop().await;
    res?;
    Ok(c)
}

/// Jobs/s Redis could serve if it did nothing but `script_calls` script calls of about
/// `k` inner commands each and `plain_calls` plain commands per job.
pub fn jobs_ceiling(c: &Ceiling, script_calls: f64, k: u64, plain_calls: f64) -> Option<f64> {
    let script_rps = c.rps.get(&format!("EVAL({k} inner)"))?;
    let plain_rps = c.rps.get("SET")?;
    let secs_per_job = script_calls / script_rps + plain_calls / plain_rps;
    (secs_per_job > 0.0).then(|| 1.0 / secs_per_job)
}
