//! Release builds only: the linker lays out the functions a running worker executes
//! first, together (`link/symbol-order.txt`, written by `scripts/symbol-order`).
//!
//! Why: the kernel maps a file-backed page around every first touch (fault-around, and
//! whole large folios of the page cache), so a binary whose start-up and hot path touch
//! functions spread over its 14 MB of code is resident almost whole: 9.6-10.8 MB of
//! `.text`. Laid out together, about 5 MB is (peak RSS at concurrency 64, 0 ms model:
//! 20.5 -> 15.5-15.7 MB; docs/performance.md, twelfth round).
//!
//! Invariant: this never changes what the program does, only where its functions sit.
//! Names in the file that the build does not have are skipped silently: the code
//! changed since the file was written (a function renamed, a generic instance gone), or
//! the symbol hashes differ (another rustc, another profile: `release-lines`, or any change
//! to the release profile, matches almost none). The release profile's fat LTO promotes
//! no local functions, so an edit renames only what it touches (thin LTO's `.llvm.<hash>`
//! suffixes renamed 290-440 names at each edit). The layout then degrades toward the
//! linker's default; `scripts/symbol-order --check` counts what still matches.
//!
//! Applied only where the link is known to take it: a release build for the host, and a
//! probe link of an empty program with the same rustc, linker and flags that accepts
//! `--symbol-ordering-file` (rustc's own `rust-lld`, the default of rustup's
//! x86_64-unknown-linux-gnu since Rust 1.90, does; GNU ld does not). A probe that fails
//! says so in a cargo warning and the build goes on with the default layout.
//! `LLM_WORKER_SYMBOL_ORDER=0` turns it off.

use std::path::{Path, PathBuf};
use std::process::Command;

const ORDER_FILE: &str = "link/symbol-order.txt";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    // The probe's answer holds only for the linker and flags it was given.
    let host = env("HOST").to_uppercase().replace('-', "_");
    for v in [
        "LLM_WORKER_SYMBOL_ORDER".to_string(),
        "RUSTFLAGS".to_string(),
        "CARGO_BUILD_RUSTFLAGS".to_string(),
        format!("CARGO_TARGET_{host}_LINKER"),
        format!("CARGO_TARGET_{host}_RUSTFLAGS"),
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let file = Path::new(&env("CARGO_MANIFEST_DIR")).join(ORDER_FILE);
    let dir = file.parent().unwrap_or(Path::new("."));
    // Only paths that exist: one that does not would rerun this script (and rebuild the
    // crate) on every build. The folder, so a file written into it later is seen.
    if file.is_file() {
        println!("cargo:rerun-if-changed={ORDER_FILE}");
    } else if dir.is_dir() {
        println!("cargo:rerun-if-changed=link");
    }
    // Not a warning when skipped for these: a debug build or a cross build is normal.
    if env("LLM_WORKER_SYMBOL_ORDER") == "0"
        || env("PROFILE") != "release"
        || env("TARGET") != env("HOST")
        || !file.is_file()
    {
        return;
    }
    let path = file.display().to_string();
    if path.contains(',') {
        // `-Wl,` splits its argument at commas.
        println!("cargo:warning={ORDER_FILE} not applied: its path has a comma");
        return;
    }
    let args = [
        format!("-Wl,--symbol-ordering-file={path}"),
        "-Wl,--no-warn-symbol-ordering".to_string(),
    ];
    match probe(&args) {
        Ok(()) => {
            for a in args {
                println!("cargo:rustc-link-arg-bins={a}");
            }
        }
        Err(why) => println!(
            "cargo:warning={ORDER_FILE} not applied (the default layout: more of the binary resident): {why}"
        ),
    }
}

/// Links an empty program with the build's rustc, linker and flags plus `args`: `Ok` if
/// that link succeeds, so the real one takes them too.
fn probe(args: &[String]) -> Result<(), String> {
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let out = PathBuf::from(env("OUT_DIR"));
    let src = out.join("symbol_order_probe.rs");
    std::fs::write(&src, "fn main() {}\n").map_err(|e| format!("writing the probe: {e}"))?;
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.arg("--crate-name")
        .arg("symbol_order_probe")
        .arg("--edition=2021")
        .arg("--target")
        .arg(env("TARGET"))
        .arg("-o")
        .arg(out.join("symbol_order_probe"))
        .arg(&src);
    let linker = env("RUSTC_LINKER");
    if !linker.is_empty() {
        cmd.arg(format!("-Clinker={linker}"));
    }
    for flag in env("CARGO_ENCODED_RUSTFLAGS")
        .split('\x1f')
        .filter(|f| !f.is_empty())
    {
        cmd.arg(flag);
    }
    for a in args {
        cmd.arg(format!("-Clink-arg={a}"));
    }
    let done = cmd
        .output()
        .map_err(|e| format!("running rustc for the probe: {e}"))?;
    if done.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&done.stderr);
    let first = err
        .lines()
        .find(|l| l.contains("unrecognized") || l.contains("unknown"))
        .or_else(|| err.lines().find(|l| l.contains("error")))
        .unwrap_or("the probe link failed");
    Err(format!(
        "a probe link with --symbol-ordering-file failed ({})",
        first.trim()
    ))
}
