//! The provider HTTP client's TLS settings, built once per process and shared
//! (`provider::http_client`): HTTPS still works, and certificates are still verified.
//! Real parts: `openssl` makes a CA and a server certificate, `openssl s_server` serves
//! HTTPS on a free loopback port. One test in this binary: it points the platform root
//! store at the test's CA (`SSL_CERT_FILE`) before the shared settings are first made.

mod common;

use common::*;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Server(Child);
impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `openssl s_server -www` with `<name>`'s certificate; ready once it accepts TCP.
async fn serve(d: &std::path::Path, name: &str) -> (Server, u16) {
    let port = free_port();
    let child = Command::new("openssl")
        .args(["s_server", "-www", "-quiet", "-accept"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["-cert", &format!("{name}.srv.pem")])
        .args(["-key", &format!("{name}.srv.key")])
        .current_dir(d)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("openssl s_server");
    let server = Server(child);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "openssl s_server did not listen on {port}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (server, port)
}

/// GET `https://127.0.0.1:<port>/` with a new client from the shared settings.
async fn get(port: u16) -> reqwest::Result<reqwest::Response> {
    llm_worker::provider::http_client()
        .timeout(Duration::from_secs(10))
        .build()?
        .get(format!("https://127.0.0.1:{port}/"))
        .send()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_tls_settings_verify_the_server_certificate() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    common::certs::certificates(d, "trusted.");
    common::certs::certificates(d, "stranger.");
    // The platform root store (rustls-native-certs) reads SSL_CERT_FILE instead of the
    // system's bundle. Set before the first http_client() of this process, which is
    // the only time the store is read; this binary has this one test, and no other
    // thread reads the environment yet. (STACK.md's rule against set_var is for config
    // overrides, which take a map; rustls-native-certs reads only the environment.)
    unsafe { std::env::set_var("SSL_CERT_FILE", d.join("trusted.ca.pem")) };

    let (_trusted, port) = serve(d, "trusted").await;
    let (_stranger, stranger_port) = serve(d, "stranger").await;

    // Two clients, as a provider and its key check make them: both from the shared
    // settings, both speak HTTPS to a server whose CA the store holds.
    for _ in 0..2 {
        let resp = get(port).await?;
        assert_eq!(resp.status(), 200, "HTTPS through the shared TLS settings");
    }

    // The settings are shared: with the CA file gone, a new client still trusts it (a
    // client that read the store itself would find no CA and fail to build).
    std::fs::remove_file(d.join("trusted.ca.pem"))?;
    let resp = get(port).await?;
    assert_eq!(
        resp.status(),
        200,
        "a client built after the store was read"
    );

    // A certificate from a CA the store does not hold is refused: verification is on.
    let err = get(stranger_port)
        .await
        .expect_err("a server certificate from an unknown CA must be refused");
    let chain = format!("{:?}", anyhow::Error::new(err));
    assert!(
        chain.contains("UnknownIssuer"),
        "refused for its certificate's issuer, not something else: {chain}"
    );
    Ok(())
}
