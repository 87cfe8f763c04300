//! Start-up's pages handed back once the worker is about to take jobs.
//!
//! Why: at concurrency 64 about half of a worker's resident set is file-backed: its own
//! code and read-only data, and libc's. Start-up runs code the job loop never runs again
//! (the config and TOML parsers, clap, the TLS root store, the script loads, the dynamic
//! loader's relocation pass over `.rela.dyn`), and every page it touched stays mapped
//! for the life of the process. Just before the reader starts, [`shed_start_up_pages`]
//! drops this process's mappings of those pages (`MADV_DONTNEED`); the job loop maps
//! back, from the page cache, only the pages it runs (a minor fault each, once). The
//! files stay cached (unless memory pressure reclaims them, as it may any page cache)
//! and other processes are not touched. The heap start-up freed is handed back too
//! (`malloc_trim`).
//!
//! (A binary just written, still dirty in the page cache, shows its pages as
//! `Private_Dirty` and is left resident: no gain until the kernel writes it back.)
//!
//! Invariant: only a mapping whose every page is the file's own is dropped: file-backed,
//! private, not writable, with no anonymous (copied-on-write), dirty or swapped page in
//! it. Such a page, mapped again, reads exactly as before (the kernel's own reclaim may
//! drop it at any time). Relocated read-only data (RELRO: written by the loader, then
//! made read-only, so its pages are private copies), the heap, stacks and anything
//! writable are never touched.
//!
//! And only a mapping that was already there, the same, when the process started
//! ([`remember_start_mappings`], first thing in `main`, before any thread), inside a
//! `PT_LOAD` segment of an object the dynamic loader loaded (the executable, the
//! libraries it was linked with, preloads): such objects are never unloaded, so those
//! mappings live as long as the process. So the address range read from smaps cannot
//! have been handed to another mapping (a freed range reused by an anonymous one, a
//! library `dlopen`ed and closed) by the time `madvise` acts on it: a range that could,
//! is never dropped.

use std::io;
use std::sync::OnceLock;

/// The file mappings of the process at its start (header lines of `/proc/self/maps`:
/// range, perms, offset, device, inode, path), set once by [`remember_start_mappings`].
static AT_START: OnceLock<Vec<String>> = OnceLock::new();

/// Records the process's file mappings as they are at its start, for
/// [`shed_start_up_pages`]: those inside a loadable segment of an object the dynamic
/// loader loaded (the executable, the libraries it was linked with, preloads), as
/// `dl_iterate_phdr` lists them. Such objects are never unloaded; a file some code mapped
/// on its own before `main` (a preloaded profiler reading symbols, say) is left out.
/// Without it nothing is dropped.
///
/// # Safety
///
/// Call it before any other thread exists: every mapping recorded must stay mapped,
/// unchanged, for the life of the process. A mapping recorded that is later unmapped
/// could see its range reused by another (an anonymous one, say), which a drop would
/// then zero.
#[cfg(target_os = "linux")]
pub unsafe fn remember_start_mappings() {
    let segments = loaded_segments();
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        let _ = AT_START.set(within_segments(&maps, &segments));
    }
}

/// Elsewhere nothing is recorded, and nothing dropped.
///
/// # Safety
///
/// None needed here; the same contract as on Linux.
#[cfg(not(target_os = "linux"))]
pub unsafe fn remember_start_mappings() {}

/// The eligible header lines of a maps text whose range lies inside one of `segments`
/// (start, end), trimmed.
fn within_segments(maps: &str, segments: &[(usize, usize)]) -> Vec<String> {
    maps.lines()
        .filter(|l| {
            Pending::header(l).is_some_and(|p| {
                p.eligible
                    && segments
                        .iter()
                        .any(|&(a, b)| a <= p.range.start && p.range.start + p.range.len <= b)
            })
        })
        .map(|l| l.trim_end().to_string())
        .collect()
}

/// The address ranges (page-rounded) of every `PT_LOAD` segment of every object the
/// dynamic loader has loaded, from `dl_iterate_phdr`.
#[cfg(target_os = "linux")]
fn loaded_segments() -> Vec<(usize, usize)> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the `Vec` passed below, alive and not otherwise borrowed for
        // the call; `info` and its `dlpi_phnum` program headers are valid for the call
        // (dl_iterate_phdr's contract).
        unsafe {
            let out = &mut *(data as *mut Vec<(usize, usize)>);
            let info = &*info;
            for i in 0..usize::from(info.dlpi_phnum) {
                let ph = &*info.dlpi_phdr.add(i);
                if ph.p_type == libc::PT_LOAD {
                    let lo = (info.dlpi_addr as usize).wrapping_add(ph.p_vaddr as usize);
                    let hi = lo.wrapping_add(ph.p_memsz as usize);
                    out.push((lo & !0xfff, (hi + 0xfff) & !0xfff));
                }
            }
        }
        0
    }
    let mut out: Vec<(usize, usize)> = Vec::new();
    // SAFETY: the callback only reads the headers it is given and pushes to `out`, which
    // outlives the call.
    unsafe {
        libc::dl_iterate_phdr(Some(each), &mut out as *mut _ as *mut libc::c_void);
    }
    out
}

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
    /// Mappings the kernel refused to drop (`mlockall`, say).
    pub refused: usize,
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

/// The mappings of an smaps text that hold only the file's own pages and some resident,
/// and whose header line is one of `at_start` (the same range, perms, file): the ones
/// [`shed_start_up_pages`] drops, with their resident kB.
pub fn droppable(smaps: &str, at_start: &[String]) -> Vec<(Range, u64)> {
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
        if let Some(mut h) = Pending::header(line) {
            let line = line.trim_end();
            h.eligible &= at_start.iter().any(|l| l == line);
            close(cur.replace(h), &mut out);
        } else if let Some(p) = cur.as_mut() {
            p.field(line);
        }
    }
    close(cur, &mut out);
    out
}

/// Drops this process's mappings of the pages start-up touched in its code and read-only
/// file mappings (see the module's invariants), and trims the heap. Best effort: a
/// mapping the kernel refuses (locked by `mlockall`) is left as it is and counted.
///
/// Never inlined: `scripts/symbol-order` splits a worker's profile where it is entered
/// (callgrind's `--dump-before`), so that what runs after it is laid out first.
#[cfg(target_os = "linux")]
#[inline(never)]
pub fn shed_start_up_pages() -> io::Result<Shed> {
    let at_start = AT_START.get().map(Vec::as_slice).unwrap_or_default();
    // SAFETY: `AT_START` is set only by `remember_start_mappings`, whose contract is
    // this function's.
    unsafe { shed_from(at_start) }
}

/// [`shed_start_up_pages`] with the start-time mappings given.
///
/// # Safety
///
/// Every mapping of `at_start` stays mapped, unchanged, for the life of the process
/// (see [`remember_start_mappings`]).
#[cfg(target_os = "linux")]
pub unsafe fn shed_from(at_start: &[String]) -> io::Result<Shed> {
    let mut shed = Shed::default();
    let smaps = if at_start.is_empty() {
        Ok(String::new())
    } else {
        std::fs::read_to_string("/proc/self/smaps")
    };
    if let Ok(smaps) = &smaps {
        for (r, kb) in droppable(smaps, at_start) {
            // SAFETY: `r` is a whole mapping that was mapped at the process's start and
            // still is, the same (its header line is unchanged), and such a mapping is
            // never unmapped while the process lives (`remember_start_mappings`'s
            // contract), so no other mapping can hold this range now. It is private, not
            // writable and holds only the file's own pages (no anonymous, dirty or swapped
            // page), so dropping it changes no byte a later read sees: the next access
            // maps the same file page again (the kernel's own reclaim drops such pages at
            // any time under memory pressure; this does the same, once, for this process
            // only). No Rust reference can point into it mutably (it is not writable), and
            // the range is page-aligned (smaps prints mapping bounds).
            let rc =
                unsafe { libc::madvise(r.start as *mut libc::c_void, r.len, libc::MADV_DONTNEED) };
            if rc == 0 {
                shed.mappings += 1;
                shed.resident_kb += kb;
            } else {
                shed.refused += 1;
            }
        }
    }
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free heap memory to the kernel; it is
    // thread-safe (it takes each arena's lock) and touches no memory in use.
    unsafe {
        libc::malloc_trim(0);
    }
    smaps.map(|_| shed)
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
7f00060000-7f00070000 r--p 00040000 fe:00 13 /usr/lib/libc.so.6
Rss:                   8 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
Swap:                  8 kB
7f00070000-7f00080000 r--p 00050000 fe:00 13 /usr/lib/libc.so.6
Rss:                   8 kB
Private_Dirty:         0 kB
Anonymous:             8 kB
7f00080000-7f00090000 rw-p 00060000 fe:00 13 /usr/lib/libc.so.6
Rss:                   8 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f00090000-7f000a0000 r--p 00000000 00:0e 77 anon_inode:x
Rss:                   8 kB
7f000a0000-7f000b0000 ---p 00070000 fe:00 13 /usr/lib/libc.so.6
Rss:                   8 kB
7f000b0000-7f000c0000 r--p 00000000 00:00 0 /memfd:gone
Rss:                   8 kB
7f000c0000-7f000d0000 r-xp 00000000 fe:00 14 /usr/lib/dlopened.so
Rss:                   8 kB
";

    /// Every header line of `SMAPS` but the last (a library loaded after the start).
    fn at_start() -> Vec<String> {
        let all: Vec<String> = SMAPS
            .lines()
            .filter(|l| Pending::header(l).is_some())
            .map(|l| l.trim_end().to_string())
            .collect();
        all[..all.len() - 1].to_vec()
    }

    #[test]
    fn only_private_read_only_file_mappings_without_a_page_of_their_own_are_dropped() {
        let got = droppable(SMAPS, &at_start());
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
                (
                    Range {
                        start: 0x7f_0005_0000,
                        len: 0x1_0000
                    },
                    1200
                ),
            ],
            "left out, each for one reason: RELRO (private copies), writable data, the \
             heap, anonymous code, the vdso, a shared mapping, nothing resident, a dirty \
             page, a field that does not parse, a swapped page only, an anonymous page \
             only, writable with nothing private yet, an anon_inode, no access, an inode \
             0 path, a mapping made after the start"
        );
    }

    #[test]
    fn a_mapping_not_there_the_same_at_the_start_is_never_dropped() {
        // The executable's code only, but as it was: another range, other perms.
        let moved = vec![
            "5600100000-5600400000 r-xp 00100000 fe:00 11 /usr/bin/llm-worker".to_string(),
            "5600000000-5600100000 r-xp 00000000 fe:00 11 /usr/bin/llm-worker".to_string(),
        ];
        assert_eq!(droppable(SMAPS, &moved), vec![]);
        // The same range and perms, another file (inode) or offset.
        let other = vec![
            "5600100000-5600500000 r-xp 00100000 fe:00 12 /usr/bin/llm-worker".to_string(),
            "5600100000-5600500000 r-xp 00200000 fe:00 11 /usr/bin/llm-worker".to_string(),
        ];
        assert_eq!(droppable(SMAPS, &other), vec![]);
        assert_eq!(droppable(SMAPS, &[]), vec![], "no start snapshot: nothing");
    }

    /// The mappings of the objects the loader loaded (never unloaded), as
    /// `remember_start_mappings` records them.
    #[cfg(target_os = "linux")]
    fn loaded_now() -> Vec<String> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        within_segments(&maps, &loaded_segments())
    }

    #[test]
    fn only_mappings_inside_a_loaded_segment_are_recorded() {
        let maps = "\
5600000000-5600100000 r--p 00000000 fe:00 11 /usr/bin/llm-worker
5600100000-5600500000 r-xp 00100000 fe:00 11 /usr/bin/llm-worker
5600600000-5600610000 rw-p 00600000 fe:00 11 /usr/bin/llm-worker
7f00000000-7f00010000 r--p 00000000 fe:00 11 /usr/bin/llm-worker
7f00020000-7f00030000 r-xp 00000000 fe:00 13 /usr/lib/libc.so.6
7f00030000-7f00050000 r-xp 00010000 fe:00 13 /usr/lib/libc.so.6
";
        let segments = [
            (0x56_0000_0000, 0x56_0050_0000),
            (0x7f_0002_0000, 0x7f_0004_0000),
        ];
        assert_eq!(
            within_segments(maps, &segments),
            vec![
                "5600000000-5600100000 r--p 00000000 fe:00 11 /usr/bin/llm-worker",
                "5600100000-5600500000 r-xp 00100000 fe:00 11 /usr/bin/llm-worker",
                "7f00020000-7f00030000 r-xp 00000000 fe:00 13 /usr/lib/libc.so.6",
            ],
            "left out: writable, the executable mapped again elsewhere (a symbolizer), a \
             mapping reaching past its segment"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_loaded_objects_are_found_and_their_code_recorded() {
        let got = loaded_now();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let exe = exe.to_string_lossy().into_owned();
        assert!(
            got.iter()
                .any(|l| l.contains(" r-xp ") && l.ends_with(&exe)),
            "this executable's code: {got:?}"
        );
        assert!(
            got.iter()
                .any(|l| l.contains(" r-xp ") && l.contains("libc")),
            "libc's code: {got:?}"
        );
    }

    /// Rss and Anonymous kB of the mapping of smaps starting at `start`.
    #[cfg(target_os = "linux")]
    fn rss_anon(start: usize) -> (u64, u64) {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{start:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head)).skip(1);
        let (mut rss, mut anon) = (0, 0);
        for l in lines.by_ref() {
            if Pending::header(l).is_some() {
                break;
            }
            let kb = || l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap();
            if l.starts_with("Rss:") {
                rss = kb();
            } else if l.starts_with("Anonymous:") {
                anon = kb();
            }
        }
        (rss, anon)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn dropping_start_up_pages_keeps_every_byte_and_frees_resident_code() {
        use std::hint::black_box;
        // Data in every kind of mapping: relocated (a table of &str), read-only, heap.
        static NAMES: [&str; 3] = ["alpha", "beta", "gamma"];
        let heap: Vec<u64> = (0..10_000).collect();
        // A binary just linked is still dirty in the page cache (shown as Private_Dirty),
        // and a dirty page is never dropped: written back first.
        std::fs::File::open("/proc/self/exe")
            .unwrap()
            .sync_all()
            .unwrap();
        let start = loaded_now();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let before: u64 = droppable(&smaps, &start).iter().map(|(_, kb)| kb).sum();
        assert!(before > 0, "this test binary and libc have resident code");
        // The read-only mappings with pages of their own (RELRO): kept as they are.
        let own: Vec<usize> = start
            .iter()
            .filter_map(|l| Pending::header(l).map(|p| p.range.start))
            .filter(|&a| rss_anon(a).1 > 0)
            .collect();
        assert!(!own.is_empty(), "relocated read-only data");
        let own_before: Vec<(u64, u64)> = own.iter().map(|&a| rss_anon(a)).collect();
        // SAFETY: only mappings of objects the loader loaded, never unloaded.
        let shed = unsafe { shed_from(&start) }.unwrap();
        assert!(shed.mappings > 0 && shed.resident_kb > 0, "{shed:?}");
        let own_after: Vec<(u64, u64)> = own.iter().map(|&a| rss_anon(a)).collect();
        assert_eq!(
            own_before.iter().map(|x| x.1).collect::<Vec<_>>(),
            own_after.iter().map(|x| x.1).collect::<Vec<_>>(),
            "no private page of the executable was dropped"
        );
        assert_eq!(black_box(&NAMES).join(","), "alpha,beta,gamma");
        assert_eq!(black_box(&heap).iter().sum::<u64>(), 49_995_000);
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let after: u64 = droppable(&smaps, &start).iter().map(|(_, kb)| kb).sum();
        assert!(
            after < before,
            "resident file pages went down: {before} -> {after} kB"
        );
    }

    /// A range recorded at the start that now holds another mapping (the file unmapped,
    /// an anonymous mapping in its place) is left alone: its bytes survive.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_range_reused_by_another_mapping_since_the_start_keeps_its_bytes() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 65536]).unwrap();
        let len = 65536;
        // SAFETY: a fresh private read-only mapping of our own file; only this test uses it.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        // SAFETY: `at` maps `len` readable bytes.
        assert_eq!(unsafe { *(at as *const u8) }, 7);
        let start: Vec<String> = std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| l.starts_with(&format!("{:x}-", at as usize)))
            .map(|l| l.trim_end().to_string())
            .collect();
        assert_eq!(start.len(), 1, "the file mapping was listed");
        // SAFETY: our own mapping, replaced in one step (no hole another thread could
        // take) by an anonymous one at the same place.
        let anon = unsafe {
            libc::mmap(
                at,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        assert_eq!(anon, at, "the range reused");
        // SAFETY: `anon` maps `len` writable bytes that nothing else uses.
        let bytes = unsafe { std::slice::from_raw_parts_mut(anon as *mut u8, len) };
        bytes.fill(0xAA);
        // SAFETY: the contract is broken on purpose here (the recorded mapping is gone):
        // the header check is what must keep the new mapping's bytes.
        let shed = unsafe { shed_from(&start) }.unwrap();
        assert_eq!(shed.mappings, 0);
        assert!(
            bytes.iter().all(|&b| b == 0xAA),
            "the new mapping kept its bytes"
        );
        // SAFETY: our own anonymous mapping.
        unsafe { libc::munmap(anon, len) };
    }
}
