//! Redis Cluster (issue 11): a real 3-master cluster on loopback ports of the test's own
//! (`redis-server --cluster-enabled yes` x3, `redis-cli --cluster create`), two
//! namespaces whose hash slots are on different masters, workers that find their
//! namespace's master through seed nodes, and the namespace's slot migrated to another
//! master while jobs run and while a job lands (MOVED / ASK / TRYAGAIN followed).

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use redis::Value;
use std::time::Duration;

/// Three cluster-enabled redis-servers joined into one cluster of three masters (no
/// replicas), every slot served. Panics with redis-cli's output when it cannot.
async fn start_cluster() -> Vec<RedisServer> {
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| {
            RedisServer::start_tcp_args(&[
                "--cluster-enabled",
                "yes",
                "--cluster-node-timeout",
                "5000",
            ])
        })
        .collect();
    let out = std::process::Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())))
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli on PATH");
    assert!(
        out.status.success(),
        "redis-cli --cluster create: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for n in &nodes {
        let port = n.port();
        assert!(
            wait_for(Duration::from_secs(20), || async move {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut tcp_conn(port).await)
                    .await
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
            })
            .await,
            "node {port} never saw the cluster ok"
        );
    }
    nodes
}

async fn slot_of(port: u16, key: &str) -> u16 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut tcp_conn(port).await)
        .await
        .expect("KEYSLOT")
}

/// The port of the master serving `slot`, as node `port` sees it (CLUSTER SLOTS).
async fn owner(port: u16, slot: u16) -> u16 {
    let ranges: Vec<Value> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut tcp_conn(port).await)
        .await
        .expect("SLOTS");
    for r in ranges {
        let Value::Array(p) = r else { continue };
        let (Value::Int(a), Value::Int(b)) = (&p[0], &p[1]) else {
            continue;
        };
        if (*a..=*b).contains(&(slot as i64))
            && let Value::Array(m) = &p[2]
            && let Value::Int(port) = m[1]
        {
            return port as u16;
        }
    }
    panic!("no owner of slot {slot}");
}

async fn my_id(port: u16) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query_async(&mut tcp_conn(port).await)
        .await
        .expect("MYID")
}

/// Keys of `slot` on node `port` (up to 1000).
async fn keys_in_slot(port: u16, slot: u16) -> Vec<String> {
    redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(1000)
        .query_async(&mut tcp_conn(port).await)
        .await
        .expect("GETKEYSINSLOT")
}

/// Moves `slot` from the master on `from` to the master on `to` the way `redis-cli
/// --cluster reshard` does (IMPORTING, MIGRATING, MIGRATE of its keys, SETSLOT NODE on
/// every node); `while_migrating` runs after the slot is marked MIGRATING, before any
/// key moves.
async fn migrate_slot<F: std::future::Future<Output = ()>>(
    nodes: &[u16],
    slot: u16,
    from: u16,
    to: u16,
    while_migrating: F,
) {
    let (from_id, to_id) = (my_id(from).await, my_id(to).await);
    let setslot = |port: u16, args: Vec<String>| async move {
        let mut c = redis::cmd("CLUSTER");
        c.arg("SETSLOT").arg(slot).arg(&args);
        let r: redis::RedisResult<()> = c.query_async(&mut tcp_conn(port).await).await;
        r.unwrap_or_else(|e| panic!("SETSLOT {args:?} on {port}: {e}"));
    };
    setslot(to, vec!["IMPORTING".into(), from_id.clone()]).await;
    setslot(from, vec!["MIGRATING".into(), to_id.clone()]).await;
    while_migrating.await;
    let mut src = tcp_conn(from).await;
    for _ in 0..100 {
        let keys = keys_in_slot(from, slot).await;
        if keys.is_empty() {
            break;
        }
        let mut m = redis::cmd("MIGRATE");
        m.arg("127.0.0.1")
            .arg(to)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS")
            .arg(&keys);
        let r: redis::RedisResult<String> = m.query_async(&mut src).await;
        r.unwrap_or_else(|e| panic!("MIGRATE {} keys: {e}", keys.len()));
    }
    assert!(keys_in_slot(from, slot).await.is_empty(), "keys left");
    for &n in nodes {
        setslot(n, vec!["NODE".into(), to_id.clone()]).await;
    }
}

/// A worker config for namespace `ns` of the cluster on `ports`, seeded first with a node
/// that does not serve it (then the others), `slots` slots, concurrency 4.
fn cluster_config(
    dir: &std::path::Path,
    ports: &[u16],
    ns: &str,
    owner: u16,
    sim: &SimHandle,
    slots: u32,
) -> std::path::PathBuf {
    let seed = *ports.iter().find(|p| **p != owner).expect("seed");
    let mut tc = TestConfig::with_urls(&format!("redis://127.0.0.1:{seed}"), sim.addr);
    let more: Vec<String> = ports
        .iter()
        .filter(|p| **p != seed)
        .map(|p| format!("\"redis://127.0.0.1:{p}\""))
        .collect();
    tc.redis_extra = format!("cluster = true\nurls = [{}]", more.join(", "));
    tc.namespace = ns.to_string();
    tc.slots = slots;
    tc.concurrency = 4;
    tc.write(dir, &format!("{ns}.toml"))
}

/// Review finding: `enqueue --wait` keeps waiting when the namespace's slot moves to
/// another master while it waits (MOVED, ASK, TRYAGAIN on its read), then sees the
/// result written on the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_wait_follows_the_slot_when_it_moves() -> anyhow::Result<()> {
    let nodes = start_cluster().await;
    let ports: Vec<u16> = nodes.iter().map(|n| n.port()).collect();
    let ns = "mv";
    let slot = slot_of(ports[0], "{mv}:jobs").await;
    let from = owner(ports[0], slot).await;
    let to = *ports.iter().find(|p| **p != from).expect("another master");
    let sim = SimHandle::start(SimOptions::default()).await;
    let dir = tempfile::tempdir()?;
    let cfg = cluster_config(dir.path(), &ports, ns, from, &sim, 2);
    let waiting = spawn_enqueue_wait(&cfg, "mv-1", "40s");
    let mut on_from = tcp_conn(from).await;
    assert!(
        wait_for(Duration::from_secs(10), || {
            let mut c = on_from.clone();
            async move { try_xlen(&mut c, "{mv}:jobs").await.unwrap_or(0) == 1 }
        })
        .await,
        "the job was pushed"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    migrate_slot(&ports, slot, from, to, async {}).await;
    let _ = &mut on_from;
    let mut w = WorkerProc::spawn(&cfg, "mv-w", &[]);
    let out = waiting.await?;
    stop_clean(&mut w, Duration::from_secs(15)).await;
    assert_eq!(out.code, Some(0), "the wait saw the result: {}", out.all());
    assert!(out.stderr.starts_with("ok "), "{}", out.all());
    Ok(())
}

/// Two namespaces on different masters, three workers (two on the first namespace, one
/// on the second), each finding its master through seed nodes that are not it. While
/// the first namespace's jobs run, its slot moves to the third master, and a job is
/// pushed while the slot is MIGRATING. Every job of both namespaces ends with exactly
/// one `ok` result, the pools' slot limits hold across the fleet (each namespace has its
/// own simulated model), and the workers stop (exit 0) with no slot key left, on the
/// new master of the moved namespace and on the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_runs_two_namespaces_and_follows_a_slot_migration() -> anyhow::Result<()> {
    let nodes = start_cluster().await;
    let ports: Vec<u16> = nodes.iter().map(|n| n.port()).collect();
    // Two namespaces whose hash slots are served by different masters.
    let mut picked: Vec<(String, u16, u16)> = vec![];
    for i in 0..200 {
        let ns = format!("q{i}");
        let slot = slot_of(ports[0], &format!("{{{ns}}}:jobs")).await;
        let at = owner(ports[0], slot).await;
        if picked.iter().all(|(_, _, o)| *o != at) {
            picked.push((ns, slot, at));
        }
        if picked.len() == 2 {
            break;
        }
    }
    assert_eq!(picked.len(), 2, "two namespaces on two masters");
    let (ns_a, slot_a, owner_a) = picked[0].clone();
    let (ns_b, _, owner_b) = picked[1].clone();
    let third = *ports
        .iter()
        .find(|p| **p != owner_a && **p != owner_b)
        .expect("a third master");

    let sim_a = SimHandle::start(SimOptions {
        latency_ms: 200,
        ..SimOptions::default()
    })
    .await;
    let sim_b = SimHandle::start(SimOptions {
        latency_ms: 50,
        ..SimOptions::default()
    })
    .await;
    let dir = tempfile::tempdir()?;
    let cfg_a = cluster_config(dir.path(), &ports, &ns_a, owner_a, &sim_a, 3);
    let cfg_b = cluster_config(dir.path(), &ports, &ns_b, owner_b, &sim_b, 2);
    let env = [("LLM_WORKER__QUEUE__CLAIM_IDLE_MS", "2000")];
    let mut wa1 = WorkerProc::spawn(&cfg_a, "cl-a1", &env);
    let mut wa2 = WorkerProc::spawn(&cfg_a, "cl-a2", &env);
    let mut wb = WorkerProc::spawn(&cfg_b, "cl-b", &env);

    let mut on_a = tcp_conn(owner_a).await;
    let mut on_b = tcp_conn(owner_b).await;
    push(&mut on_a, &ns_a, &jobs("before", 30)).await;
    push(&mut on_b, &ns_b, &jobs("b", 20)).await;
    let results_a = format!("{{{ns_a}}}:results");
    let results_b = format!("{{{ns_b}}}:results");
    context(
        wait_len(&mut on_a, &results_a, 4, Duration::from_secs(30)).await,
        &[&wa1, &wa2],
    )?;
    assert!(
        xlen(&mut on_a, &results_a).await < 30,
        "jobs still running when the slot starts to move"
    );

    // Move the first namespace's slot to the third master; a job lands meanwhile (on
    // the old master, which still holds the stream while the slot is MIGRATING).
    let ns_mid = ns_a.clone();
    let landing = async move {
        push(&mut tcp_conn(owner_a).await, &ns_mid, &jobs("mid", 1)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    migrate_slot(&ports, slot_a, owner_a, third, landing).await;
    assert_eq!(owner(ports[0], slot_a).await, third, "the slot moved");
    let mut on_new = tcp_conn(third).await;
    push(&mut on_new, &ns_a, &jobs("after", 15)).await;

    let all_a = 30 + 1 + 15;
    context(
        wait_len(&mut on_new, &results_a, all_a, Duration::from_secs(60)).await,
        &[&wa1, &wa2],
    )?;
    context(
        wait_len(&mut on_b, &results_b, 20, Duration::from_secs(30)).await,
        &[&wb],
    )?;
    // Settled: a duplicate would come from a second run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_all_ok_once(&entries(&mut on_new, &results_a).await, all_a as usize);
    assert_all_ok_once(&entries(&mut on_b, &results_b).await, 20);
    let (max_a, max_b) = (
        sim_a.sim.stats().max_in_flight,
        sim_b.sim.stats().max_in_flight,
    );
    assert!(
        max_a <= 3,
        "namespace A's pool (3 slots) held across two workers: {max_a}"
    );
    assert!(max_b <= 2, "namespace B's pool (2 slots): {max_b}");
    assert!(max_a >= 2, "both of A's workers ran calls at once: {max_a}");

    for w in [&mut wa1, &mut wa2, &mut wb] {
        stop_clean(w, Duration::from_secs(15)).await;
    }
    assert!(
        slot_keys(&mut on_new, &ns_a).await.is_empty(),
        "slot keys left on the new master"
    );
    assert!(
        slot_keys(&mut on_b, &ns_b).await.is_empty(),
        "slot keys left on B's master"
    );
    assert!(
        keys_in_slot(owner_a, slot_a).await.is_empty(),
        "nothing of the moved namespace written on its old master after the move"
    );
    for w in [&wa1, &wa2, &wb] {
        let log = w.log();
        assert!(!log.contains("panicked"), "{log}");
    }
    Ok(())
}
