//! Telling a forked child from its parent without a system call per question: a page the
//! kernel zeroes in every child (`MADV_WIPEONFORK`, Linux 4.14), holding this process's mark.
//! The shell's secret generator asks at every draw; a `getpid` there cost as much as the
//! `getrandom` it replaced on the 2-core VM (issue 12).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The wipe-on-fork word, or `None` where the kernel refused the page or the advice.
static WITNESS: OnceLock<Option<&'static AtomicU64>> = OnceLock::new();

/// A nonzero number for the running process: the same at every call in one process, and
/// different in a child forked from it (the process id plus one, remembered where the kernel
/// wipes it in a child). Without a wipe-on-fork page it asks the kernel for the pid each time.
pub(crate) fn process_mark() -> u64 {
    let fresh = || u64::from(std::process::id()) + 1;
    match WITNESS.get_or_init(witness) {
        Some(w) => match w.load(Ordering::Relaxed) {
            0 => {
                // First call, or the first in a child (the word was wiped): threads racing here
                // all store the same value.
                let m = fresh();
                w.store(m, Ordering::Relaxed);
                m
            }
            m => m,
        },
        None => fresh(),
    }
}

/// Maps the wipe-on-fork page. It is never unmapped: one page for the process's life.
fn witness() -> Option<&'static AtomicU64> {
    const PAGE: usize = 4096;
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
    // existing memory; the result is checked against MAP_FAILED before use.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `p` is the page just mapped, PAGE bytes long, used by nothing else yet.
    if unsafe { libc::madvise(p, PAGE, libc::MADV_WIPEONFORK) } != 0 {
        // Without the advice a child would keep its parent's mark: use the pid instead.
        // SAFETY: unmaps exactly the page mapped above, which nothing references.
        unsafe { libc::munmap(p, PAGE) };
        return None;
    }
    // SAFETY: the page is zero-filled, page-aligned (so aligned for u64), lives until the
    // process ends (never unmapped), and is only ever accessed through this atomic.
    Some(unsafe { &*p.cast::<AtomicU64>() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_is_stable_within_a_process_and_names_it() {
        let m = process_mark();
        assert_eq!(m, u64::from(std::process::id()) + 1);
        assert_eq!(process_mark(), m);
        assert!(WITNESS.get().is_some_and(Option::is_some), "this kernel supports MADV_WIPEONFORK (4.14+)");
    }

    /// A forked child sees a different mark: the kernel wiped the word, and the child's pid is
    /// its own. (The child only reads memory and calls getpid and _exit: safe after a fork of
    /// a threaded process.)
    #[test]
    fn a_forked_child_gets_a_mark_of_its_own() {
        let parent = process_mark();
        let w = WITNESS.get().copied().flatten().expect("wipe-on-fork page");
        // SAFETY: the child below calls only async-signal-safe functions (getpid via
        // process_mark's load/store and std::process::id, then _exit).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let wiped = w.load(Ordering::Relaxed) == 0;
            let mark = process_mark();
            let ok = wiped && mark != parent && mark == u64::from(std::process::id()) + 1;
            // SAFETY: ends the child at once, running nothing of the parent's (no atexit).
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &raw mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child kept its parent's mark");
        assert_eq!(process_mark(), parent, "the parent's mark is untouched");
    }
}
