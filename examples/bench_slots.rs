//! Slot benchmark (release mode): `cargo run --release --example bench_slots`.
//!
//! Starts its own redis-server (the test harness's `RedisServer`, on a unix socket in a
//! temporary directory) and measures, side by side in one
//! run, the fleet-wide slots (`llm_worker::slots`) against the old way (SET NX on each
//! slot, sleep 100 ms, try again):
//! - uncontended acquire latency p50/p99 (and a PING round trip for scale);
//! - 16 contenders (4 simulated processes x 4) on 4 slots, each holding 50 ms:
//!   wait p50/p99, slot utilisation, acquisitions per contender min..max, and Redis
//!   commands per acquisition (from INFO commandstats: calls made by clients).
//!
//! Each simulated process is its own `Slots` instance: its own token, connections and
//! waiter task, exactly as separate worker processes would have.

use llm_worker::config::Config;
use llm_worker::connect::commands;
#[path = "../tests/common/mod.rs"]
mod common;
use llm_worker::slots::Slots;
use redis::AsyncCommands;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const PROCS: usize = 4;
const PER_PROC: usize = 4;
const SLOTS: u32 = 4;
const HOLD: Duration = Duration::from_millis(50);
const RUN: Duration = Duration::from_secs(8);

fn config(url: &str, consumer: &str) -> Config {
    let text = format!(
        r#"
[redis]
url = "{url}"
[queue]
namespace = "bench"
consumer = "{consumer}"
[slots]
ttl_ms = 10000
acquire_timeout_ms = 60000
[pools.default]
slots = {SLOTS}
[providers.p]
base_url = "http://127.0.0.1:1/v1"
[models.m]
provider = "p"
input_per_mtok = 1
output_per_mtok = 1
context_window = 1000
[routes]
default = ["m"]
"#
    );
    Config::from_toml_str(&text, &HashMap::new()).expect("bench config")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// Calls of the named commands since the last CONFIG RESETSTAT. Redis also lists the
/// commands run inside scripts, which are not round trips: callers name only the
/// commands their clients send.
async fn client_calls(
    c: &mut redis::aio::MultiplexedConnection,
    names: &[&str],
) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(c)
        .await
        .unwrap_or_default();
    let mut total = HashMap::new();
    for line in info.lines() {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim_start_matches("cmdstat_");
        if names.contains(&name)
            && let Some(calls) = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))
        {
            total.insert(name.to_string(), calls.parse::<u64>().unwrap_or(0));
        }
    }
    total
}

type ContenderTask = tokio::task::JoinHandle<(Vec<f64>, Duration)>;

/// Lets the contenders run for `RUN`, stops them, and gathers their waits and busy time.
async fn run_contenders(tasks: Vec<ContenderTask>, stop: &AtomicBool, start: Instant) -> Contended {
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let mut out = Contended {
        waits_ms: vec![],
        per_contender: vec![],
        busy: Duration::ZERO,
        wall: Duration::ZERO,
        acquire_commands: 0,
        release_commands: 0,
    };
    for t in tasks {
        let (w, b) = t.await.expect("task");
        out.per_contender.push(w.len() as u64);
        out.waits_ms.extend(w);
        out.busy += b;
    }
    out.wall = start.elapsed();
    out
}

struct Contended {
    waits_ms: Vec<f64>,
    per_contender: Vec<u64>,
    busy: Duration,
    wall: Duration,
    /// Round trips spent acquiring (all acquisitions) and releasing.
    acquire_commands: u64,
    release_commands: u64,
}

async fn contended_new(url: &str, admin: &mut redis::aio::MultiplexedConnection) -> Contended {
    let _: () = redis::cmd("FLUSHALL")
        .query_async(admin)
        .await
        .expect("flush");
    let mut procs = vec![];
    let bg = CancellationToken::new();
    for p in 0..PROCS {
        let cfg = config(url, &format!("proc{p}"));
        let pool = commands(&cfg).expect("pool");
        let slots = Slots::connect(&cfg, pool).await.expect("slots");
        slots.spawn_background(bg.clone());
        procs.push(slots);
    }
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(admin)
        .await
        .expect("resetstat");
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = vec![];
    for slots in &procs {
        for _ in 0..PER_PROC {
            let slots = slots.clone();
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut waits = vec![];
                let mut busy = Duration::ZERO;
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let lease = slots
                        .acquire("default", Duration::from_secs(60))
                        .await
                        .expect("acquire");
                    waits.push(t.elapsed().as_secs_f64() * 1000.0);
                    let h = Instant::now();
                    tokio::time::sleep(HOLD).await;
                    busy += h.elapsed();
                    lease.release().await.expect("release");
                }
                (waits, busy)
            }));
        }
    }
    let mut out = run_contenders(tasks, &stop, start).await;
    let calls = client_calls(admin, &["evalsha", "eval", "blpop"]).await;
    let total = calls.values().sum::<u64>();
    // Every release is one EVALSHA of the release script (as many as acquisitions).
    let acquisitions: u64 = out.per_contender.iter().sum();
    out.release_commands = acquisitions;
    out.acquire_commands = total.saturating_sub(acquisitions);
    bg.cancel();
    for s in &procs {
        let _ = s.release_all().await;
    }
    out
}

/// The old way: SET NX on each slot in turn, sleep 100 ms between rounds.
async fn contended_polling(url: &str, admin: &mut redis::aio::MultiplexedConnection) -> Contended {
    let _: () = redis::cmd("FLUSHALL")
        .query_async(admin)
        .await
        .expect("flush");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(admin)
        .await
        .expect("resetstat");
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = vec![];
    for p in 0..PROCS {
        let client = redis::Client::open(url).expect("client");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("conn");
        for c in 0..PER_PROC {
            let mut conn = conn.clone();
            let stop = stop.clone();
            let token = format!("p{p}c{c}");
            tasks.push(tokio::spawn(async move {
                let mut waits = vec![];
                let mut busy = Duration::ZERO;
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let key = 'outer: loop {
                        for i in 0..SLOTS {
                            let k = format!("{{bench}}:slot:default:{i}");
                            let ok: Option<String> = redis::cmd("SET")
                                .arg(&k)
                                .arg(&token)
                                .arg("NX")
                                .arg("PX")
                                .arg(10_000)
                                .query_async(&mut conn)
                                .await
                                .expect("set");
                            if ok.is_some() {
                                break 'outer k;
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    };
                    waits.push(t.elapsed().as_secs_f64() * 1000.0);
                    let h = Instant::now();
                    tokio::time::sleep(HOLD).await;
                    busy += h.elapsed();
                    let _: () = conn.del(&key).await.expect("del");
                }
                (waits, busy)
            }));
        }
    }
    let mut out = run_contenders(tasks, &stop, start).await;
    let calls = client_calls(admin, &["set", "del"]).await;
    out.acquire_commands = calls.get("set").copied().unwrap_or(0);
    out.release_commands = calls.get("del").copied().unwrap_or(0);
    out
}

fn report(name: &str, mut c: Contended) {
    let acquisitions: u64 = c.per_contender.iter().sum();
    let util = c.busy.as_secs_f64() / (SLOTS as f64 * c.wall.as_secs_f64());
    let min = c.per_contender.iter().min().copied().unwrap_or(0);
    let max = c.per_contender.iter().max().copied().unwrap_or(0);
    println!(
        "{name:<22} wait p50 {:>7.2} ms  p99 {:>7.2} ms | utilisation {:.3} | acquisitions {acquisitions} ({min}..{max} per contender) | Redis commands per acquisition {:.2} (+{:.2} to release)",
        pct(&mut c.waits_ms, 0.5),
        pct(&mut c.waits_ms, 0.99),
        util,
        c.acquire_commands as f64 / acquisitions.max(1) as f64,
        c.release_commands as f64 / acquisitions.max(1) as f64,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let redis = common::RedisServer::start();
    let url = redis.url();
    let client = redis::Client::open(url.as_str()).expect("client");
    // RedisServer::start has waited until it answers.
    let mut admin = client
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection");

    // Uncontended.
    let cfg = config(&url, "solo");
    let slots = Slots::connect(&cfg, commands(&cfg).expect("pool"))
        .await
        .expect("slots");
    let bg = CancellationToken::new();
    slots.spawn_background(bg.clone());
    let mut ping = vec![];
    let mut acq = vec![];
    for i in 0..2200 {
        let t = Instant::now();
        let _: String = redis::cmd("PING")
            .query_async(&mut admin)
            .await
            .expect("ping");
        let p = t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        let lease = slots
            .acquire("default", Duration::from_secs(5))
            .await
            .expect("acquire");
        let a = t.elapsed().as_secs_f64() * 1000.0;
        lease.release().await.expect("release");
        if i >= 200 {
            ping.push(p);
            acq.push(a);
        }
    }
    bg.cancel();
    println!(
        "slots benchmark: redis-server {url}, {PROCS} processes x {PER_PROC} contenders on {SLOTS} slots, hold {} ms, {} s per variant",
        HOLD.as_millis(),
        RUN.as_secs()
    );
    println!(
        "uncontended acquire    p50 {:>7.3} ms  p99 {:>7.3} ms   (PING round trip p50 {:.3} ms, p99 {:.3} ms)",
        pct(&mut acq, 0.5),
        pct(&mut acq, 0.99),
        pct(&mut ping, 0.5),
        pct(&mut ping, 0.99)
    );
    let new = contended_new(&url, &mut admin).await;
    let old = contended_polling(&url, &mut admin).await;
    report("slots (hand-off)", new);
    report("old: poll every 100ms", old);
    drop(redis);
}
