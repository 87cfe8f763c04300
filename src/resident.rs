//! Start-up's pages handed back once the worker is about to take jobs.
//!
//! Why: at concurrency 64 about half of a worker's resident set is file-backed: its own
//! code and read-only data, and libc's. Start-up runs code the job loop never runs again
//! (the config and TOML parsers, clap, the TLS root store, the script loads, the dynamic
//! loader's relocation pass over `.rela.dyn`), and every page it touched stays mapped
//! for the life of the process. Just before the reader starts, [`shed_start_up_pages`]
//! drops this process's mappings of those pages (`MADV_DONTNEED`); the job loop maps
//! back, from the page cache, only the pages it runs (a minor fault each, once). The
//! files stay cached: nothing is read from disk again and other processes are not
//! touched. The heap start-up freed is handed back too (`malloc_trim`).
//!
//! Invariant: only a mapping whose every page is the file's own is dropped: file-backed,
//! private, not writable, with no anonymous (copied-on-write) page and no dirty private
//! page in it. Such a page, mapped again, reads exactly as before. Relocated read-only
//! data (RELRO: written by the loader, then made read-only, so its pages are private
//! copies), the heap, stacks and anything writable are never touched; a mapping that
//! gets a private page between the read of `/proc/self/smaps` and the `madvise` would
//! need a write to a mapping without write permission, which this process never makes.

use std::io;

/// One mapping of `/proc/self/smaps` that may be dropped: its start and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub start: usize,
    pub len: usize,
}

/// What [`shed_start_up_pages`] did, for the start-up log line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    /// Mappings dropped.
    pub mappings: usize,
    /// Their resident size before, in kB.
    pub resident_kb: u64,
}

/// One mapping while `/proc/self/smaps` is read: its header, then its fields.
struct Pending {
    range: Range,
    eligible: bool,
    rss_kb: u64,
    private_kb: u64,
}

impl Pending {
    /// From a header line (`start-end perms offset dev inode [path]`); `None` if the
    /// line is not a header.
    fn header(line: &str) -> Option<Pending> {
        let mut parts = line.split_ascii_whitespace();
        let (start, end) = parts.next()?.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        let perms = parts.next()?.as_bytes();
        if perms.len() != 4 || end <= start {
            return None;
        }
        let _offset = parts.next()?;
        let _dev = parts.next()?;
        let inode: u64 = parts.next()?.parse().ok()?;
        // A path that is a file (not `[heap]`, `[stack]`, `[vdso]`, `[anon:..]`).
        let file = parts.next().is_some_and(|p| p.starts_with('/'));
        let eligible =
            file && inode != 0 && perms[0] == b'r' && perms[1] == b'-' && perms[3] == b'p';
        Some(Pending {
            range: Range {
                start,
                len: end - start,
            },
            eligible,
            rss_kb: 0,
            private_kb: 0,
        })
    }

    /// Reads one `Key: value kB` field of the mapping.
    fn field(&mut self, line: &str) {
        let Some((key, rest)) = line.split_once(':') else {
            return;
        };
        let kb = || {
            rest.split_ascii_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        };
        match key {
            "Rss" => self.rss_kb = kb().unwrap_or(0),
            // Any page of its own (copied on write, or dirty) rules the mapping out;
            // a field that does not parse does too.
            "Private_Dirty" | "Anonymous" | "Swap" => {
                self.private_kb += kb().unwrap_or(u64::MAX / 4);
            }
            _ => {}
        }
    }
}

/// The mappings of an smaps text that hold only the file's own pages and some resident:
/// the ones [`shed_start_up_pages`] drops, with their resident kB.
pub fn droppable(smaps: &str) -> Vec<(Range, u64)> {
    let mut out = Vec::new();
    let mut cur: Option<Pending> = None;
    let close = |p: Option<Pending>, out: &mut Vec<(Range, u64)>| {
        if let Some(p) = p
            && p.eligible
            && p.private_kb == 0
            && p.rss_kb > 0
        {
            out.push((p.range, p.rss_kb));
        }
    };
    for line in smaps.lines() {
        if let Some(h) = Pending::header(line) {
            close(cur.replace(h), &mut out);
        } else if let Some(p) = cur.as_mut() {
            p.field(line);
        }
    }
    close(cur, &mut out);
    out
}

/// Drops this process's mappings of the pages start-up touched in its code and read-only
/// file mappings (see the module's invariant), and trims the heap. Best effort: a
/// mapping the kernel refuses (locked by `mlockall`) is left as it is.
///
/// Never inlined: `scripts/symbol-order` splits a worker's profile where it is entered
/// (callgrind's `--dump-before`), so that what runs after it is laid out first.
#[cfg(target_os = "linux")]
#[inline(never)]
pub fn shed_start_up_pages() -> io::Result<Shed> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut shed = Shed::default();
    for (r, kb) in droppable(&smaps) {
        // SAFETY: `r` is a whole mapping of this process that is private, not writable
        // and holds only the file's own pages (no anonymous, dirty or swapped page), so
        // dropping it changes no byte a later read sees: the next access maps the same
        // file page again (the kernel's own reclaim drops such pages at any time under
        // memory pressure; this does the same, once, for this process only). No Rust
        // reference can point into it mutably (it is not writable), and the range is
        // page-aligned (smaps prints mapping bounds).
        let rc = unsafe { libc::madvise(r.start as *mut libc::c_void, r.len, libc::MADV_DONTNEED) };
        if rc == 0 {
            shed.mappings += 1;
            shed.resident_kb += kb;
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the kernel; it is
    // thread-safe (it takes each arena's lock) and touches no memory in use.
    unsafe {
        libc::malloc_trim(0);
    }
    Ok(shed)
}

/// Elsewhere there is no `/proc/self/smaps` to tell the file's pages from private ones:
/// nothing is dropped.
#[cfg(not(target_os = "linux"))]
pub fn shed_start_up_pages() -> io::Result<Shed> {
    Ok(Shed::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
5600000000-5600100000 r--p 00000000 fe:00 11 /usr/bin/llm-worker
Rss:                 400 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
Swap:                  0 kB
5600100000-5600500000 r-xp 00100000 fe:00 11 /usr/bin/llm-worker
Rss:                3000 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
5600500000-5600600000 r--p 00500000 fe:00 11 /usr/bin/llm-worker
Rss:                 580 kB
Private_Dirty:       580 kB
Anonymous:           580 kB
5600600000-5600610000 rw-p 00600000 fe:00 11 /usr/bin/llm-worker
Rss:                  64 kB
Private_Dirty:        64 kB
5600700000-5600800000 rw-p 00000000 00:00 0 [heap]
Rss:                 900 kB
7f00000000-7f00001000 r-xp 00000000 00:00 0 
Rss:                   4 kB
7f00001000-7f00002000 r-xp 00000000 00:00 0 [vdso]
Rss:                   4 kB
7f00010000-7f00020000 r-xs 00000000 fe:00 12 /dev/shm/x
Rss:                  64 kB
7f00020000-7f00030000 r-xp 00000000 fe:00 13 /usr/lib/libc.so.6
Rss:                   0 kB
7f00030000-7f00040000 r-xp 00010000 fe:00 13 /usr/lib/libc.so.6
Rss:                  40 kB
Private_Dirty:         4 kB
7f00040000-7f00050000 r-xp 00020000 fe:00 13 /usr/lib/libm.so.6
Rss:                  16 kB
Private_Dirty:       bad kB
7f00050000-7f00060000 r-xp 00030000 fe:00 13 /usr/lib/libc.so.6
Rss:                1200 kB
Private_Dirty:         0 kB
";

    #[test]
    fn only_private_read_only_file_mappings_without_a_page_of_their_own_are_dropped() {
        let got = droppable(SMAPS);
        assert_eq!(
            got,
            vec![
                // The executable's headers and .rodata, then its code: the file's pages.
                (
                    Range {
                        start: 0x56_0000_0000,
                        len: 0x10_0000
                    },
                    400
                ),
                (
                    Range {
                        start: 0x56_0010_0000,
                        len: 0x40_0000
                    },
                    3000
                ),
                // libc's code, the last mapping (closed at the end of the text).
                (
                    Range {
                        start: 0x7f_0005_0000,
                        len: 0x1_0000
                    },
                    1200
                ),
            ],
            "left out: RELRO (private copies), writable data, the heap, anonymous code, \
             the vdso, a shared mapping, a mapping with nothing resident, one with a \
             dirty page, one whose field does not parse"
        );
    }

    #[test]
    fn dropping_start_up_pages_keeps_every_byte_and_frees_resident_code() {
        // Data in every kind of mapping: relocated (a table of &str), read-only, heap.
        static NAMES: [&str; 3] = ["alpha", "beta", "gamma"];
        let heap: Vec<u64> = (0..10_000).collect();
        let before = droppable(&std::fs::read_to_string("/proc/self/smaps").unwrap());
        let before_kb: u64 = before.iter().map(|(_, kb)| kb).sum();
        assert!(before_kb > 0, "this test binary has resident code");
        let shed = shed_start_up_pages().unwrap();
        assert!(shed.mappings > 0 && shed.resident_kb > 0, "{shed:?}");
        assert_eq!(NAMES.join(","), "alpha,beta,gamma");
        assert_eq!(heap.iter().sum::<u64>(), 49_995_000);
        let after = droppable(&std::fs::read_to_string("/proc/self/smaps").unwrap());
        let after_kb: u64 = after.iter().map(|(_, kb)| kb).sum();
        assert!(
            after_kb < before_kb,
            "resident file pages went down: {before_kb} -> {after_kb} kB"
        );
    }
}
