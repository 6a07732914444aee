//! The shell's secrets (registration keys, transfer tokens, liveness tags) come from one
//! process-wide generator seeded once from the OS, instead of a `getrandom` system call each.
//!
//! Why: a registration drew two secrets, and those two system calls were half of what
//! registering through BOUNCE cost over UCX (+4 us of 14 on 2 cores, issue 12); each bounced
//! transfer drew one more on the reactor thread.
//!
//! How: BLAKE3 keyed with a 32-byte seed from the OS, over a counter that never repeats (a
//! PRF in counter mode: no output says anything about another, nor about the seed). Each
//! counter value gives [`BLOCK`] bytes at once, handed out in draws and wiped as they go: a
//! keyed hasher set up, run and finalized for every 32-byte draw cost ~880 instructions, the
//! largest part of what a registration through BOUNCE adds to UCX's (two draws of it; issue
//! 12), where a block's 16 outputs come from one SIMD pass. A forked child must not repeat its
//! parent's stream, so every draw checks the process's mark
//! ([`crate::sys::fork::process_mark`], no system call) and a new one means a new seed.

use parking_lot::Mutex;

/// A counter-mode generator (see the module docs).
#[derive(Debug)]
pub(crate) struct Drbg(Mutex<Option<State>>);

/// Bytes one counter value gives (16 BLAKE3 output blocks).
const BLOCK: usize = 1024;

struct State {
    /// The mark of the process the seed was drawn in.
    mark: u64,
    seed: [u8; 32],
    counter: u64,
    /// The current counter's output; its last `left` bytes are not handed out yet (the others
    /// are zero).
    block: [u8; BLOCK],
    left: usize,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").field("mark", &self.mark).field("counter", &self.counter).finish_non_exhaustive()
    }
}

impl State {
    /// Hands out the next `out.len()` bytes of the stream.
    fn draw(&mut self, mut out: &mut [u8]) {
        while !out.is_empty() {
            if self.left == 0 {
                let mut h = blake3::Hasher::new_keyed(&self.seed);
                h.update(&self.counter.to_le_bytes());
                h.finalize_xof().fill(&mut self.block);
                self.counter += 1;
                self.left = BLOCK;
            }
            let n = self.left.min(out.len());
            let unread = &mut self.block[BLOCK - self.left..][..n];
            let (now, rest) = out.split_at_mut(n);
            now.copy_from_slice(unread);
            unread.fill(0);
            self.left -= n;
            out = rest;
        }
    }
}

static PROCESS: Drbg = Drbg::new();

/// Fills `out` with secret bytes from the process-wide generator.
///
/// # Errors
/// The OS had no randomness for the seed (the next call tries again).
pub(crate) fn fill(out: &mut [u8]) -> Result<(), getrandom::Error> {
    PROCESS.fill_in(crate::sys::fork::process_mark(), out, getrandom::fill)
}

impl Drbg {
    const fn new() -> Self {
        Self(parking_lot::const_mutex(None))
    }

    /// Fills `out` for the process marked `mark`, drawing a seed with `seed` first when there
    /// is none yet or it was drawn in another process.
    fn fill_in(
        &self,
        mark: u64,
        out: &mut [u8],
        seed: impl FnOnce(&mut [u8]) -> Result<(), getrandom::Error>,
    ) -> Result<(), getrandom::Error> {
        let mut g = self.0.lock();
        let s = match &mut *g {
            Some(s) if s.mark == mark => s,
            stale => {
                let mut fresh = [0u8; 32];
                seed(&mut fresh)?;
                stale.insert(State { mark, seed: fresh, counter: 0, block: [0; BLOCK], left: 0 })
            }
        };
        s.draw(out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn draws_never_repeat_and_the_seed_is_drawn_once_per_process() {
        let d = Drbg::new();
        let mut seeds = 0;
        let mut seen = HashSet::new();
        for _ in 0..10_000 {
            let mut k = [0u8; 32];
            d.fill_in(7, &mut k, |o| {
                seeds += 1;
                getrandom::fill(o)
            })
            .unwrap();
            assert!(seen.insert(k), "a draw repeated");
        }
        assert_eq!(seeds, 1);
    }

    /// A seed the same every time (an OS that gives ones).
    fn fixed(o: &mut [u8]) -> Result<(), getrandom::Error> {
        o.fill(1);
        Ok(())
    }

    /// A forked child has its parent's generator in memory: it must draw a seed of its own,
    /// not continue the parent's stream.
    #[test]
    fn a_new_process_mark_means_a_new_seed() {
        let (parent, child) = (Drbg::new(), Drbg::new());
        let (mut a, mut b) = ([0u8; 16], [0u8; 16]);
        parent.fill_in(100, &mut a, fixed).unwrap();
        child.fill_in(100, &mut b, fixed).unwrap();
        assert_eq!(a, b, "same seed, same counter: the same stream (the test's premise)");
        // The "child" is now marked 101, and its OS gives a different seed.
        let mut reseeded = false;
        child
            .fill_in(101, &mut b, |o| {
                reseeded = true;
                o.fill(2);
                Ok(())
            })
            .unwrap();
        parent.fill_in(100, &mut a, fixed).unwrap();
        assert!(reseeded);
        assert_ne!(a, b, "the child continued its parent's stream");
    }

    /// The stream is the same however the draws cut it, across block boundaries too: no
    /// byte is handed out twice or skipped.
    #[test]
    fn draws_of_any_size_read_one_stream() {
        let (whole, cut) = (Drbg::new(), Drbg::new());
        let mut all = vec![0u8; 3 * BLOCK + 100];
        whole.fill_in(5, &mut all, fixed).unwrap();
        let mut pieces = Vec::new();
        for n in [1usize, 31, 32, 7, BLOCK, 2 * BLOCK - 50].into_iter().cycle() {
            let n = n.min(all.len() - pieces.len());
            if n == 0 {
                break;
            }
            let mut p = vec![0u8; n];
            cut.fill_in(5, &mut p, fixed).unwrap();
            pieces.extend_from_slice(&p);
        }
        assert_eq!(pieces, all);
        assert_ne!(all[..BLOCK], all[BLOCK..2 * BLOCK], "each block comes from its own counter");
    }

    #[test]
    fn a_failed_seed_is_an_error_and_the_next_draw_tries_again() {
        let d = Drbg::new();
        let mut k = [0u8; 8];
        let failed = d.fill_in(1, &mut k, |_| Err(getrandom::Error::UNSUPPORTED));
        assert!(failed.is_err());
        assert_eq!(k, [0u8; 8], "nothing handed out");
        d.fill_in(1, &mut k, getrandom::fill).unwrap();
        assert_ne!(k, [0u8; 8]);
    }
}
