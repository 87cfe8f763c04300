//! Redis over TLS (`rediss://` with a private CA in `redis.tls_ca_file`): a real
//! redis-server with `--tls-port`, certificates made by `openssl` for this test.

mod common;

use common::*;
use llm_worker::sim::SimOptions;
use std::process::{Command, Stdio};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_flow_over_tls_with_a_private_ca() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    common::certs::certificates(d, "");

    let port = free_port();
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            "srv.pem",
            "--tls-key-file",
            "srv.key",
            "--tls-ca-cert-file",
            "ca.pem",
        ])
        .args([
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .current_dir(d)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let _guard = KillOnDrop(&mut server);
    assert!(
        wait_for(Duration::from_secs(10), || async {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        })
        .await,
        "TLS redis-server did not start"
    );

    let sim = SimHandle::start(SimOptions {
        latency_ms: 5,
        ..SimOptions::default()
    })
    .await;
    let plain = RedisServer::start(); // only to build the config from the harness
    let mut tc = TestConfig::new(&plain, &sim);
    tc.redis_url = format!("rediss://127.0.0.1:{port}");
    let cfg_path = tc.write(d, "w.toml");
    let ca = d.join("ca.pem");
    let ca = ca.to_str().expect("utf-8 path");

    // Without the CA the certificate is refused (the connection really is verified).
    let out = run_bin(
        &["--config", cfg_path.to_str().expect("path"), "status"],
        &[],
        Duration::from_secs(20),
    );
    assert_ne!(
        out.code,
        Some(0),
        "status without the CA must fail: {}",
        out.stdout
    );

    let env = [("LLM_WORKER__REDIS__TLS_CA_FILE", ca)];
    let push = run_bin(
        &[
            "--config",
            cfg_path.to_str().expect("path"),
            "enqueue",
            "--prompt",
            "one",
            "--prompt",
            "two",
            "--prompt",
            "three",
        ],
        &env,
        Duration::from_secs(20),
    );
    assert_eq!(push.code, Some(0), "enqueue over TLS: {}", push.stderr);
    assert_eq!(push.stdout.lines().count(), 3);

    let mut w = WorkerProc::spawn(&cfg_path, "tls-w", &env);
    let done = wait_for(Duration::from_secs(30), || async {
        let out = run_bin(
            &[
                "--config",
                cfg_path.to_str().expect("path"),
                "status",
                "--json",
            ],
            &env,
            Duration::from_secs(10),
        );
        serde_json::from_str::<serde_json::Value>(&out.stdout)
            .map(|v| v["results"] == 3)
            .unwrap_or(false)
    })
    .await;
    assert!(done, "3 results over TLS\n{}", w.log());
    stop_clean(&mut w, Duration::from_secs(10)).await;
    Ok(())
}

struct KillOnDrop<'a>(&'a mut std::process::Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
