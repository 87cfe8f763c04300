//! Release builds only: the linker lays out the functions a running worker executes
//! first, together (`link/symbol-order.txt`, written by `scripts/symbol-order`).
//!
//! Why: the kernel maps a file-backed page around every first touch (fault-around, and
//! whole large folios of the page cache), so a binary whose start-up and hot path touch
//! functions spread over its 14 MB of code is resident almost whole: 9-10 MB of `.text`
//! for a worker that executes about 3.5 MB of it. Laid out together, those functions are
//! what is resident (measured: peak RSS at concurrency 64 from 20.8 to 15 MB).
//!
//! Invariant: this never changes what the program does, only where its functions sit.
//! Names in the file that the build does not have (the code changed since the file was
//! written: a function renamed, a generic instance gone, thin LTO's `.llvm.<hash>`
//! suffix of a changed module) are skipped silently; the layout then degrades toward
//! the linker's default, and `scripts/symbol-order --check` counts what still matches.
//!
//! Only with a linker known to take `--symbol-ordering-file`: rustc's own `rust-lld`,
//! the default for x86_64-unknown-linux-gnu since Rust 1.90, and no linker configured
//! instead. `LLM_WORKER_SYMBOL_ORDER=0` turns it off.

use std::path::Path;
use std::process::Command;

const ORDER_FILE: &str = "link/symbol-order.txt";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={ORDER_FILE}");
    println!("cargo:rerun-if-env-changed=LLM_WORKER_SYMBOL_ORDER");
    // Not a warning when skipped: a debug build or another linker is normal.
    if skip_reason().is_some() {
        return;
    }
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let file = Path::new(&dir).join(ORDER_FILE);
    println!(
        "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
        file.display()
    );
    println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
}

/// Why the order is not applied to this build, if it is not.
fn skip_reason() -> Option<&'static str> {
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    if env("LLM_WORKER_SYMBOL_ORDER") == "0" {
        return Some("turned off");
    }
    if env("PROFILE") != "release" {
        return Some("not a release build");
    }
    if env("TARGET") != "x86_64-unknown-linux-gnu" {
        return Some("not x86_64-unknown-linux-gnu (rust-lld is not the default linker)");
    }
    let dir = env("CARGO_MANIFEST_DIR");
    if !Path::new(&dir).join(ORDER_FILE).is_file() {
        return Some("no order file");
    }
    // A linker configured instead of the default (cargo passes it as RUSTC_LINKER), or
    // linker flags of one's own: leave the link alone.
    if !env("RUSTC_LINKER").is_empty() {
        return Some("a linker is configured");
    }
    let flags = env("CARGO_ENCODED_RUSTFLAGS");
    if ["linker", "fuse-ld", "link-self-contained"]
        .iter()
        .any(|f| flags.contains(f))
    {
        return Some("RUSTFLAGS choose the linker");
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("-V")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .unwrap_or_default();
    // "rustc 1.95.0 (59807616e 2026-04-14)"
    let minor = version
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.split('.').nth(1))
        .and_then(|m| m.parse::<u32>().ok());
    match minor {
        Some(m) if m >= 90 => None,
        _ => Some("rustc older than 1.90 links with the system linker"),
    }
}
