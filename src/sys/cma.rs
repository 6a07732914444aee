//! Cross-memory attach: copying between this process and another of the same host with
//! `process_vm_writev` / `process_vm_readv` (the same-host path for host memory, `bounce_cma`),
//! and naming a process so that a reused pid is told apart.
//!
//! The kernel copies each piece once, between the two address spaces, checking both sides'
//! mappings itself (a bad address is `EFAULT`, never a fault in this process). It needs the
//! permission to ptrace the peer (same user; Yama's `ptrace_scope` may forbid it): without, the
//! first copy fails with `EPERM` and the caller goes back to bouncing.

use std::io;

/// Which way the bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CmaDir {
    /// Local -> the peer (`process_vm_writev`).
    Write,
    /// The peer -> local (`process_vm_readv`).
    Read,
}

/// One piece: `len` bytes at `local` here and at `remote` in the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Address in this process.
    pub(crate) local: u64,
    /// Address in the peer.
    pub(crate) remote: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// Most iovecs one call takes (Linux's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Most bytes one call is given. Linux moves at most `MAX_RW_COUNT` (2 GiB less a page) per
/// call and returns a short count beyond it, which [`copy`] must read as a fault: so no call is
/// asked for more, and a larger piece is split across calls.
const CALL_MAX_BYTES: u64 = 1 << 30;

/// Copies every piece between this process and process `pid`, at most `IOV_MAX` iovecs and
/// [`CALL_MAX_BYTES`] a call.
///
/// # Safety
/// For [`CmaDir::Read`], every piece's local range must be memory of this process that nothing
/// else reads or writes during the call (the kernel writes it, as a `memcpy` would). For
/// [`CmaDir::Write`] the local ranges are only read, and an unmapped one fails the call.
///
/// # Errors
/// The kernel's error (`EPERM`, `ESRCH`, `EFAULT`, ...), `InvalidInput` for a piece whose range
/// wraps, or `UnexpectedEof` when a call moved fewer bytes than asked (an unmapped remote page):
/// the copy is then incomplete.
pub(crate) unsafe fn copy(pid: u32, dir: CmaDir, pieces: &[Piece]) -> io::Result<()> {
    let mut local = Vec::with_capacity(pieces.len().min(IOV_MAX));
    let mut remote = Vec::with_capacity(pieces.len().min(IOV_MAX));
    let mut calls = CallPlan { pieces, next: 0, done: 0 };
    while calls.fill(&mut local, &mut remote)? {
        let want: usize = local.iter().map(|v| v.iov_len).sum();
        let pid = pid as libc::pid_t;
        // SAFETY: both iovec arrays are live for the call, at most `IOV_MAX` long, and cover
        // sub-ranges of the caller's pieces. The remote side is the kernel's to check. The
        // local side: read for a write (an unmapped range fails with EFAULT); written for a
        // read, which the caller's contract makes this call's alone.
        let n = unsafe {
            match dir {
                CmaDir::Write => libc::process_vm_writev(
                    pid,
                    local.as_ptr(),
                    local.len() as _,
                    remote.as_ptr(),
                    remote.len() as _,
                    0,
                ),
                CmaDir::Read => {
                    libc::process_vm_readv(pid, local.as_ptr(), local.len() as _, remote.as_ptr(), remote.len() as _, 0)
                }
            }
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != want {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("moved {n} of {want} bytes")));
        }
    }
    Ok(())
}

/// Cuts pieces into calls: each at most `IOV_MAX` iovecs and [`CALL_MAX_BYTES`] bytes, a piece
/// over the byte bound spread over several.
struct CallPlan<'a> {
    pieces: &'a [Piece],
    /// The piece the next call starts in.
    next: usize,
    /// Bytes of that piece given to earlier calls.
    done: u64,
}

impl CallPlan<'_> {
    /// The next call's iovecs into `local` and `remote`; false when every byte was given.
    fn fill(&mut self, local: &mut Vec<libc::iovec>, remote: &mut Vec<libc::iovec>) -> io::Result<bool> {
        local.clear();
        remote.clear();
        let mut budget = CALL_MAX_BYTES;
        while local.len() < IOV_MAX && budget > 0 {
            let Some(p) = self.pieces.get(self.next) else { break };
            let take = (p.len - self.done).min(budget);
            let at = |base: u64| base.checked_add(self.done).filter(|a| a.checked_add(take).is_some());
            let (Some(l), Some(r)) = (at(p.local), at(p.remote)) else {
                return Err(io::Error::from(io::ErrorKind::InvalidInput));
            };
            if take > 0 {
                // `take <= CALL_MAX_BYTES`, which fits a usize on every target we build for.
                local.push(libc::iovec { iov_base: l as usize as *mut libc::c_void, iov_len: take as usize });
                remote.push(libc::iovec { iov_base: r as usize as *mut libc::c_void, iov_len: take as usize });
            }
            budget -= take;
            self.done += take;
            if self.done == p.len {
                self.next += 1;
                self.done = 0;
            }
        }
        Ok(!local.is_empty())
    }
}

/// A process as the kernel names it, with what tells a reused pid apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessId {
    /// The inode of its PID namespace (`/proc/self/ns/pid`).
    pub(crate) pidns: u64,
    /// Its pid in that namespace.
    pub(crate) pid: u32,
    /// Its start time in clock ticks since boot (`/proc/<pid>/stat` field 22).
    pub(crate) start: u64,
}

/// This process, or `None` without a readable `/proc`, or with one of another PID namespace
/// (another's `/proc` mounted here, `unshare -p` without a new one): the checks read `/proc`
/// while the copies name pids in ours, and the two would be different processes (review 60,
/// L4). `/proc/self` names us by the pid of `/proc`'s namespace.
pub(crate) fn this_process() -> Option<ProcessId> {
    let pid = std::process::id();
    let seen: u32 = std::fs::read_link("/proc/self").ok()?.to_str()?.parse().ok()?;
    if seen != pid {
        tracing::info!(pid, proc_pid = seen, "/proc is of another PID namespace: no same-host path for host memory");
        return None;
    }
    Some(ProcessId { pidns: pid_namespace()?, pid, start: start_time(pid)? })
}

/// The inode of this process's PID namespace.
pub(crate) fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// A hold on one process through a pidfd: tells, with one `poll`, whether that very process
/// (never a later one given its pid) has exited. Reading `/proc/<pid>/stat` to compare start
/// times answers the same and cost 7-8 us a post on the 2-core machine; the poll 0.5 us.
#[derive(Debug)]
pub(crate) struct Watch {
    fd: std::os::fd::OwnedFd,
}

impl Watch {
    /// A watch on process `pid` if it is the one that started at `start` (clock ticks since
    /// boot): its start time is read after the pidfd is open, so a match means the pidfd names
    /// that process (a pid reused before the open shows another start time; one reused between
    /// the open and the read leaves a pidfd whose process has exited, which [`Self::alive`]
    /// then says). `None` when it is not, or without pidfds (Linux before 5.3, a seccomp
    /// profile that refuses them): callers then read the start time each time.
    pub(crate) fn open(pid: u32, start: u64) -> Option<Self> {
        let raw = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
        let fd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()?;
        (start_time(pid) == Some(start)).then_some(Self { fd })
    }

    /// Whether the process has not exited (a pidfd becomes readable when it does).
    pub(crate) fn alive(&self) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
        let now = Timespec { tv_sec: 0, tv_nsec: 0 };
        matches!(rustix::event::poll(&mut fds, Some(&now)), Ok(0))
    }
}

/// The process (thread group) that task `pid` belongs to: `Tgid:` in `/proc/<pid>/status`.
/// A thread's id reaches its process's memory as the process's pid does (and `/proc` answers
/// for it), so a record must name a process itself, never one of its threads.
pub(crate) fn thread_group(pid: u32) -> Option<u32> {
    parse_tgid(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

fn parse_tgid(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("Tgid:"))?.trim().parse().ok()
}

/// Runs `f` with the id of a thread of this process, kept alive meanwhile (tests).
#[cfg(test)]
pub(crate) fn with_a_thread<R>(f: impl FnOnce(u32) -> R) -> R {
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tid_tx.send(unsafe { libc::gettid() }.unsigned_abs()).ok();
        done_rx.recv().ok();
    });
    let r = f(tid_rx.recv().expect("the thread says its id"));
    drop(done_tx);
    t.join().expect("the thread ends");
    r
}

/// Runs `f` with the pid of a process that shares this one's address space, its own thread
/// group (`clone(CLONE_VM)` without `CLONE_THREAD`, as `vfork` and `posix_spawn` make before
/// their `exec`), kept alive meanwhile and reaped after (tests).
#[cfg(test)]
pub(crate) fn with_a_vm_sharing_child<R>(f: impl FnOnce(u32) -> R) -> R {
    extern "C" fn sleep_for_ever(_: *mut libc::c_void) -> libc::c_int {
        loop {
            // SAFETY: pause has no preconditions; the child touches nothing of the process's
            // memory but its own stack.
            unsafe { libc::pause() };
        }
    }
    let mut stack = vec![0u8; 64 << 10];
    // The stack grows down from its 16-byte aligned top.
    let top = ((stack.as_mut_ptr() as usize + stack.len()) & !15) as *mut libc::c_void;
    // SAFETY: `top` is the aligned top of `stack`, which outlives the child (it is killed and
    // reaped below before `stack` drops); the child runs only `sleep_for_ever`, which uses
    // nothing but that stack.
    let pid = unsafe { libc::clone(sleep_for_ever, top, libc::CLONE_VM | libc::SIGCHLD, std::ptr::null_mut()) };
    assert!(pid > 0, "clone: {}", io::Error::last_os_error());
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(pid.unsigned_abs())));
    // SAFETY: `pid` is our child, not reaped yet; killing and reaping it touches nothing else.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    drop(stack);
    r.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// One liveness word as peers read it with [`copy`]: 24 bytes, three native-endian u64s.
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct SharedWord {
    /// A registration's tag while it lives, 0 otherwise.
    pub(crate) tag: std::sync::atomic::AtomicU64,
    /// Its range's start.
    pub(crate) addr: std::sync::atomic::AtomicU64,
    /// Its range's length.
    pub(crate) len: std::sync::atomic::AtomicU64,
}

/// `count` zeroed words in a shared mapping of a memory file named `name`, mapped for the rest
/// of the process's life: `/proc/<pid>/maps` shows the mapping as `/memfd:<name> (deleted)`,
/// which a peer checks before it trusts a word (memory registered for transfers is never such
/// a mapping, so a word written there by a remote peer is not taken for one).
///
/// # Errors
/// `memfd_create`'s, `ftruncate`'s or `mmap`'s (a seccomp profile may refuse the first).
pub(crate) fn shared_words(name: &std::ffi::CStr, count: usize) -> io::Result<(&'static [SharedWord], u64)> {
    use std::os::fd::FromRawFd;
    let len = count.checked_mul(size_of::<SharedWord>()).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `name` is NUL-terminated and outlives the call; MFD_CLOEXEC is a valid flag.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened by this call and is owned by nothing else.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(len as u64)?;
    let inode = std::os::unix::fs::MetadataExt::ino(&file.metadata()?);
    // SAFETY: memmap2's contract is that the file is not truncated while mapped: this memory
    // file is reachable only through `file`, which is dropped right after without being
    // resized (the mapping keeps the memory).
    let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(&file) }?;
    // Not inherited by a forked child: a child keeping this mapping (same address, same name)
    // would show its parent's live words as its own, and a record naming the child would pass
    // every check (review 55). Without the advice the words are not offered at all.
    // SAFETY: `map` is a mapping of exactly `len` bytes made above and owned here; the advice
    // changes only what a future fork inherits.
    if unsafe { libc::madvise(map.as_ptr() as *mut libc::c_void, len, libc::MADV_DONTFORK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let map: &'static mut memmap2::MmapMut = Box::leak(Box::new(map));
    // SAFETY: the mapping is `len` = `count` * 24 bytes, page-aligned (so aligned for u64),
    // zero-filled by the kernel (a valid `SharedWord`: three zero atomics), and leaked above,
    // so it lives, at the same address, as long as the process. Every access goes through
    // the atomics, so other threads' reads and peers' cross-process reads race with no
    // undefined behaviour on our side.
    Ok((unsafe { std::slice::from_raw_parts(map.as_mut_ptr().cast::<SharedWord>(), count) }, inode))
}

/// One line of `/proc/<pid>/maps`: the range `[start, end)`, the offset in its file that
/// `start` maps, and the path as the file shows it (empty for an anonymous mapping).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mapping<P = String> {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) offset: u64,
    /// The inode of its file (0 for an anonymous mapping).
    pub(crate) inode: u64,
    pub(crate) path: P,
}

/// The mapping of process `pid` that holds address `addr`; `None` when `addr` is in none or the
/// file cannot be read.
pub(crate) fn mapping_of(pid: u32, addr: u64) -> Option<Mapping> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    find_mapping(&maps, addr).map(|m| Mapping {
        start: m.start,
        end: m.end,
        offset: m.offset,
        inode: m.inode,
        path: m.path.to_owned(),
    })
}

/// [`mapping_of`] on the text of a `maps` file: lines of `start-end perms offset dev inode
/// [path]`, the addresses and the offset in hex.
fn find_mapping(maps: &str, addr: u64) -> Option<Mapping<&str>> {
    maps.lines().find_map(|line| {
        let (range, rest) = line.split_once(' ')?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?);
        if !(a <= addr && addr < b) {
            return None;
        }
        // Four fields (perms, offset, dev, inode), then the path, which may hold spaces.
        let mut fields = rest.trim_start();
        let (mut offset, mut inode) = (None, None);
        for i in 0..4 {
            let (field, more) = fields.split_once(' ').unwrap_or((fields, ""));
            match i {
                1 => offset = u64::from_str_radix(field, 16).ok(),
                3 => inode = field.parse().ok(),
                _ => {}
            }
            fields = more.trim_start();
        }
        Some(Mapping { start: a, end: b, offset: offset?, inode: inode?, path: fields })
    })
}

/// Process `pid`'s start time (`/proc/<pid>/stat` field 22), `None` when there is no such
/// process.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    parse_start_time(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 22 of a `/proc/<pid>/stat` line. The command name (field 2, in parentheses) may hold
/// spaces and parentheses itself, so the fields are counted after its last `)`.
fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name come field 3 (state) onward: field 22 is the 20th of them.
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapping_is_found_by_address_with_its_path_spaces_kept() {
        let maps = "7f00-7f10 rw-s 00000000 00:01 1234                       /memfd:nixl-bounce-live (deleted)\n\
                    7f10-7f20 rw-p 00000000 00:00 0 \n\
                    7f20-7f30 r--p 00001000 fd:01 99                         /usr/lib/my lib.so\n";
        let m = |start, end, offset, inode, path| Some(Mapping { start, end, offset, inode, path });
        assert_eq!(find_mapping(maps, 0x7f00), m(0x7f00, 0x7f10, 0, 1234, "/memfd:nixl-bounce-live (deleted)"));
        assert_eq!(find_mapping(maps, 0x7f0f), m(0x7f00, 0x7f10, 0, 1234, "/memfd:nixl-bounce-live (deleted)"));
        assert_eq!(find_mapping(maps, 0x7f10), m(0x7f10, 0x7f20, 0, 0, ""), "anonymous: no path");
        assert_eq!(find_mapping(maps, 0x7f2a), m(0x7f20, 0x7f30, 0x1000, 99, "/usr/lib/my lib.so"), "its file offset");
        assert_eq!(find_mapping(maps, 0x7f30), None, "the end is outside");
        assert_eq!(find_mapping(maps, 0x10), None);
        assert_eq!(find_mapping("garbage\nzz-yy x\n", 0x10), None);
    }

    /// The words live in a mapping this process's maps show under the memory file's name, and
    /// are zero to begin with.
    #[test]
    fn shared_words_are_zero_and_shown_under_their_name() {
        let (words, inode) =
            shared_words(c"nixl-bounce-test-words", 1000).expect("memfd_create works on Linux >= 3.17");
        assert_eq!(words.len(), 1000);
        assert!(words.iter().all(|w| w.tag.load(std::sync::atomic::Ordering::Relaxed) == 0));
        let at = std::ptr::from_ref(&words[999]) as u64;
        let m = mapping_of(std::process::id(), at).expect("the mapping is in /proc/self/maps");
        assert!(m.start <= at && at + 24 <= m.end);
        assert_eq!((m.path.as_str(), m.offset, m.inode), ("/memfd:nixl-bounce-test-words (deleted)", 0, inode));
        assert_eq!((at - m.start) % 24, 0, "the words lie on a grid of 24 bytes from the file's start");
        let heap = Box::new(0u64);
        let heap = mapping_of(std::process::id(), std::ptr::from_ref(&*heap) as u64).expect("the heap is mapped");
        assert!(!heap.path.starts_with("/memfd:"), "{}", heap.path);
    }

    #[test]
    fn the_start_time_is_field_22_even_when_the_name_has_spaces_and_parentheses() {
        let line = "4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_time(line), Some(987654));
        assert_eq!(parse_start_time("4242 (x) S 1"), None);
        let me = this_process().expect("Linux has /proc");
        assert_eq!(me.pid, std::process::id());
        assert_eq!(start_time(me.pid), Some(me.start), "stable for a live process");
    }

    /// A watch names one process: refused for a start time that is not the process's, alive
    /// while it runs, and not alive once it has exited (its pid may be anyone's then).
    #[test]
    fn a_threads_id_names_its_process_as_thread_group() {
        assert_eq!(parse_tgid("Name:\tx y\nUmask:\t0022\nTgid:\t4242\nNgid:\t0\nPid:\t4250\n"), Some(4242));
        assert_eq!(parse_tgid("Name:\tx\nPid:\t4250\n"), None);
        let me = std::process::id();
        assert_eq!(thread_group(me), Some(me));
        // A thread kept alive while asked about: its id is not its process's.
        with_a_thread(|tid| {
            assert_ne!(tid, me);
            assert_eq!(thread_group(tid), Some(me), "the thread's id names this process as its group");
        });
    }

    #[test]
    fn a_watch_tells_whether_that_very_process_is_alive() {
        let me = this_process().expect("Linux has /proc");
        let Some(w) = Watch::open(me.pid, me.start) else {
            assert!(std::env::var_os("CI").is_none(), "pidfd_open must work on CI (Linux >= 5.3)");
            eprintln!("LOUD: no pidfds here (Linux before 5.3 or seccomp): the watch is untested");
            return;
        };
        assert!(w.alive());
        assert!(Watch::open(me.pid, me.start + 1).is_none(), "another start time is another process");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep runs");
        let pid = child.id();
        let start = start_time(pid).expect("the child's start time");
        let w = Watch::open(pid, start).expect("a watch on the child");
        assert!(w.alive());
        child.kill().expect("kill the child");
        child.wait().expect("reap the child");
        assert!(!w.alive(), "the child has exited");
        assert!(Watch::open(pid, start).is_none(), "nor is a new watch given");
    }

    #[test]
    fn copies_into_and_out_of_a_process_piece_by_piece_across_batches() {
        // This very process as the peer: the kernel path is the same.
        let pid = std::process::id();
        let src: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 3000 * 2];
        // 1500 two-byte pieces, every other pair of destination bytes: two batches of calls.
        let pieces: Vec<Piece> = (0..1500u64)
            .map(|i| Piece { local: src.as_ptr() as u64 + 2 * i, remote: dst.as_mut_ptr() as u64 + 4 * i, len: 2 })
            .collect();
        // SAFETY: a write only reads the local ranges (inside `src`).
        unsafe { copy(pid, CmaDir::Write, &pieces) }.expect("process_vm_writev to itself");
        for i in 0..1500 {
            assert_eq!(&dst[4 * i..4 * i + 2], &src[2 * i..2 * i + 2]);
            assert_eq!(&dst[4 * i + 2..4 * i + 4], &[0, 0], "between pieces untouched");
        }
        let mut back = vec![0u8; 3000];
        let pieces: Vec<Piece> = (0..1500u64)
            .map(|i| Piece { local: back.as_mut_ptr() as u64 + 2 * i, remote: dst.as_ptr() as u64 + 4 * i, len: 2 })
            .collect();
        // SAFETY: the local ranges are inside `back`, which nothing else touches meanwhile.
        unsafe { copy(pid, CmaDir::Read, &pieces) }.expect("process_vm_readv from itself");
        assert_eq!(back, src);
        // An unmapped remote address: an error, not a fault.
        let bad = [Piece { local: src.as_ptr() as u64, remote: 8, len: 2 }];
        // SAFETY: as above.
        assert!(unsafe { copy(pid, CmaDir::Write, &bad) }.is_err());
    }

    /// Calls are cut at `IOV_MAX` iovecs and at `CALL_MAX_BYTES`, a larger piece spread over
    /// several calls without a byte lost or repeated, and empty pieces skipped.
    #[test]
    fn calls_stay_under_the_kernels_bounds_and_cover_every_byte_once() {
        const G: u64 = 1 << 30;
        let pieces = [
            Piece { local: 0x1000, remote: 0x9000_0000_0000, len: 5 * G / 2 },
            Piece { local: 0, remote: 0, len: 0 },
            Piece { local: 0x7000_0000_0000, remote: 0x10, len: 3 },
        ];
        let mut plan = CallPlan { pieces: &pieces, next: 0, done: 0 };
        let (mut local, mut remote) = (Vec::new(), Vec::new());
        let mut calls = Vec::new();
        while plan.fill(&mut local, &mut remote).unwrap() {
            let span = |v: &libc::iovec| (v.iov_base as u64, v.iov_len as u64);
            calls.push((local.iter().map(span).collect::<Vec<_>>(), remote.iter().map(span).collect::<Vec<_>>()));
        }
        let r = 0x9000_0000_0000;
        assert_eq!(
            calls,
            vec![
                (vec![(0x1000, G)], vec![(r, G)]),
                (vec![(0x1000 + G, G)], vec![(r + G, G)]),
                (vec![(0x1000 + 2 * G, G / 2), (0x7000_0000_0000, 3)], vec![(r + 2 * G, G / 2), (0x10, 3)]),
            ]
        );
        // 1500 small pieces: 1024 iovecs, then 476.
        let small: Vec<Piece> = (0..1500).map(|i| Piece { local: 8 * i, remote: 16 * i, len: 8 }).collect();
        let mut plan = CallPlan { pieces: &small, next: 0, done: 0 };
        let mut sizes = Vec::new();
        while plan.fill(&mut local, &mut remote).unwrap() {
            sizes.push(local.len());
        }
        assert_eq!(sizes, vec![1024, 476]);
        // A piece whose range wraps the address space is refused, not cut.
        let wraps = [Piece { local: u64::MAX - 4, remote: 0, len: 8 }];
        assert!(CallPlan { pieces: &wraps, next: 0, done: 0 }.fill(&mut local, &mut remote).is_err());
    }

    /// More than the kernel moves in one call (2 GiB less a page) in one batch of pieces:
    /// copied whole, where one call per 1024 pieces came back short and failed.
    #[test]
    fn a_batch_of_more_than_two_gib_is_copied_whole() {
        let pid = std::process::id();
        let src: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 4 << 20];
        // 600 pieces of 4 MiB (2.3 GiB) over the same two buffers: little memory, many bytes.
        let pieces: Vec<Piece> = (0..600)
            .map(|_| Piece { local: src.as_ptr() as u64, remote: dst.as_mut_ptr() as u64, len: 4 << 20 })
            .collect();
        // SAFETY: a write only reads the local ranges (inside `src`).
        unsafe { copy(pid, CmaDir::Write, &pieces) }.expect("2.3 GiB through process_vm_writev");
        assert!(dst == src);
    }
}
