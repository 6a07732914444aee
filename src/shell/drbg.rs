//! The shell's secrets (registration keys, transfer tokens, liveness tags) come from one
//! process-wide generator seeded once from the OS, instead of a `getrandom` system call each.
//!
//! Why: a registration drew two secrets, and those two system calls were half of what
//! registering through BOUNCE cost over UCX (+4 us of 14 on 2 cores, issue 12); each bounced
//! transfer drew one more on the reactor thread.
//!
//! How: BLAKE3 keyed with a 32-byte seed from the OS, over a counter that never repeats (a
//! PRF in counter mode: no output says anything about another, nor about the seed). A forked
//! child must not repeat its parent's stream, so every draw checks the process's mark
//! ([`crate::sys::fork::process_mark`], no system call) and a new one means a new seed.

use parking_lot::Mutex;

/// A counter-mode generator (see the module docs).
#[derive(Debug)]
pub(crate) struct Drbg(Mutex<Option<State>>);

#[derive(Debug)]
struct State {
    /// The mark of the process the seed was drawn in.
    mark: u64,
    seed: [u8; 32],
    counter: u64,
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
                stale.insert(State { mark, seed: fresh, counter: 0 })
            }
        };
        let mut h = blake3::Hasher::new_keyed(&s.seed);
        h.update(&s.counter.to_le_bytes());
        s.counter += 1;
        drop(g);
        h.finalize_xof().fill(out);
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

    /// A forked child has its parent's generator in memory: it must draw a seed of its own,
    /// not continue the parent's stream.
    #[test]
    fn a_new_process_mark_means_a_new_seed() {
        let fixed = |o: &mut [u8]| {
            o.fill(1);
            Ok(())
        };
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
