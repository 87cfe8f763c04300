//! Process figures from /proc, free ports, signals.

use std::time::Duration;

/// Clock ticks per second of /proc/<pid>/stat times.
fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// User + system CPU time of a process (all its threads, live and exited), in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: split after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the whole line (utime, stime) are 11 and 12 after the name.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clk_tck())
}

/// A `kB` field of /proc/<pid>/status (`VmHWM` = peak RSS, `VmRSS` = current RSS).
pub fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// A free TCP port on 127.0.0.1 (bound and released; the race is harmless here).
pub fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

pub fn sigterm(pid: u32) {
    // SAFETY: kill with a pid we spawned and still own (not yet reaped).
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
}

/// Wait until a TCP port accepts connections.
pub async fn wait_port(port: u16, timeout: Duration) -> anyhow::Result<()> {
    let start = tokio::time::Instant::now();
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if start.elapsed() > timeout {
            anyhow::bail!("port {port} did not open within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
