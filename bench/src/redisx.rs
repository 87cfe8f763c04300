//! A private redis-server per run, INFO snapshots, MONITOR counting, key census.

use crate::procs;
use anyhow::Context;
use redis::aio::MultiplexedConnection;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

pub struct RedisServer {
    pub port: u16,
    pub url: String,
    child: Child,
}

impl RedisServer {
    /// `redis-server` on a free loopback port, no persistence.
    pub async fn start(dir: &Path) -> anyhow::Result<RedisServer> {
        let port = procs::free_port()?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("spawn redis-server (is it installed?)")?;
        procs::wait_port(port, Duration::from_secs(10)).await?;
        Ok(RedisServer {
            port,
            url: format!("redis://127.0.0.1:{port}"),
            child,
        })
    }

    pub async fn conn(&self) -> anyhow::Result<MultiplexedConnection> {
        let c = redis::Client::open(self.url.as_str())?;
        Ok(c.get_multiplexed_async_connection().await?)
    }

    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// One `INFO everything` reading.
#[derive(Clone, Debug, Default)]
pub struct Snap {
    /// used_cpu_sys + used_cpu_user, seconds.
    pub cpu: f64,
    /// total_commands_processed (counts commands run inside scripts too).
    pub commands: u64,
    /// total_reads_processed: read events on client sockets (network round trips;
    /// a pipelined batch is one).
    pub reads: u64,
    /// cmdstat_<name> calls.
    pub calls: BTreeMap<String, u64>,
    /// cmdstat_<name> usec (Redis's own time in the command; a script's includes the
    /// commands it ran, which are also counted under their own names).
    pub usec: BTreeMap<String, u64>,
    pub used_memory: u64,
}

pub async fn snap(c: &mut MultiplexedConnection) -> anyhow::Result<Snap> {
    let text: String = redis::cmd("INFO").arg("everything").query_async(c).await?;
    let mut s = Snap::default();
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        match k {
            "used_cpu_sys" | "used_cpu_user" => s.cpu += v.trim().parse::<f64>().unwrap_or(0.0),
            "total_commands_processed" => s.commands = v.trim().parse().unwrap_or(0),
            "total_reads_processed" => s.reads = v.trim().parse().unwrap_or(0),
            "used_memory" => s.used_memory = v.trim().parse().unwrap_or(0),
            _ => {
                if let Some(name) = k.strip_prefix("cmdstat_") {
                    // `calls=N,usec=N,...`: one field of it, 0 if absent.
                    let field = |f: &str| -> u64 {
                        v.split(',')
                            .find_map(|kv| kv.strip_prefix(f))
                            .and_then(|n| n.parse().ok())
                            .unwrap_or(0)
                    };
                    s.calls.insert(name.to_string(), field("calls="));
                    s.usec.insert(name.to_string(), field("usec="));
                }
            }
        }
    }
    Ok(s)
}

/// Per-command deltas between two snapshots' counts (`Snap::calls` or `Snap::usec`);
/// commands that did not move are left out.
pub fn delta(a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    b.iter()
        .map(|(k, v)| (k.clone(), v - a.get(k).copied().unwrap_or(0)))
        .filter(|(_, d)| *d > 0)
        .collect()
}

/// Commands seen by MONITOR: from clients (round trips as commands) and from inside
/// scripts (`[0 lua]`), by command name.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MonitorCounts {
    pub client: BTreeMap<String, u64>,
    pub script: BTreeMap<String, u64>,
}

/// Start a MONITOR connection counting every command except those of `exclude_addrs`
/// (the driver's own connections). Stop it by dropping/aborting the task after
/// `stop` is sent; the task returns the counts.
pub async fn monitor(
    port: u16,
    exclude_addrs: Vec<String>,
) -> anyhow::Result<(
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<MonitorCounts>,
)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream.write_all(b"MONITOR\r\n").await?;
    let mut reader = BufReader::new(stream);
    let mut first = String::new();
    reader.read_line(&mut first).await?; // +OK
    let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut counts = MonitorCounts::default();
        let mut line = String::new();
        loop {
            line.clear();
            tokio::select! {
                biased;
                r = reader.read_line(&mut line) => {
                    match r { Ok(0) | Err(_) => break, Ok(_) => {} }
                    let Some(open) = line.find('[') else { continue };
                    let Some(close) = line[open..].find(']') else { continue };
                    let inside = &line[open + 1..open + close];
                    let addr = inside.split_once(' ').map(|(_, a)| a).unwrap_or("");
                    let rest = &line[open + close + 1..];
                    let name = rest
                        .trim_start()
                        .trim_start_matches('"')
                        .split('"')
                        .next()
                        .unwrap_or("")
                        .to_ascii_lowercase();
                    if addr == "lua" {
                        *counts.script.entry(name).or_default() += 1;
                    } else if !exclude_addrs.iter().any(|a| a == addr) {
                        *counts.client.entry(name).or_default() += 1;
                    }
                }
                _ = &mut rx => break,
            }
        }
        counts
    });
    Ok((tx, task))
}

/// The `addr=` of a connection (to exclude the driver's own commands from MONITOR).
pub async fn client_addr(c: &mut MultiplexedConnection) -> anyhow::Result<String> {
    let info: String = redis::cmd("CLIENT").arg("INFO").query_async(c).await?;
    Ok(info
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("addr="))
        .unwrap_or("")
        .to_string())
}

/// DBSIZE and the keys grouped by shape (each `:`-separated segment holding a digit
/// shown as `*`), so that a key per job shows as one big class.
pub async fn key_census(
    c: &mut MultiplexedConnection,
) -> anyhow::Result<(u64, BTreeMap<String, u64>)> {
    let dbsize: u64 = redis::cmd("DBSIZE").query_async(c).await?;
    let mut classes = BTreeMap::new();
    let mut cursor: u64 = 0;
    let mut seen = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await?;
        for k in keys {
            let shape: Vec<String> = k
                .split(':')
                .map(|seg| {
                    if seg.chars().any(|ch| ch.is_ascii_digit()) {
                        "*".to_string()
                    } else {
                        seg.to_string()
                    }
                })
                .collect();
            *classes.entry(shape.join(":")).or_default() += 1;
            seen += 1;
        }
        cursor = next;
        if cursor == 0 || seen > 500_000 {
            break;
        }
    }
    Ok((dbsize, classes))
}
