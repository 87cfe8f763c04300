//! Test certificates made by `openssl`: a CA and a server certificate it signed for
//! 127.0.0.1 (the TLS tests: `rediss://` and HTTPS to a provider).

use std::path::Path;
use std::process::{Command, Stdio};

pub fn openssl(dir: &Path, args: &[&str]) {
    let ok = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("openssl on PATH (apt-get install openssl)")
        .success();
    assert!(ok, "openssl {args:?}");
}

/// Writes into `d` a self-signed CA (`<name>ca.pem`, `<name>ca.key`) and a server
/// certificate it signed for IP 127.0.0.1 (`<name>srv.pem`, `<name>srv.key`), valid
/// for a day. `name` is a file-name prefix ("" for `ca.pem`, `srv.pem`).
pub fn certificates(d: &Path, name: &str) {
    let f = |s: &str| format!("{name}{s}");
    openssl(
        d,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &f("ca.key"),
            "-out",
            &f("ca.pem"),
            "-days",
            "1",
            "-subj",
            &format!("/CN=llm-worker-test-{name}ca"),
        ],
    );
    openssl(
        d,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &f("srv.key"),
            "-out",
            &f("srv.csr"),
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(d.join("ext"), "subjectAltName=IP:127.0.0.1\n").expect("write ext");
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            &f("srv.csr"),
            "-CA",
            &f("ca.pem"),
            "-CAkey",
            &f("ca.key"),
            "-CAcreateserial",
            "-out",
            &f("srv.pem"),
            "-days",
            "1",
            "-extfile",
            "ext",
        ],
    );
}
