//! The CPU copy kernels of the copy engine: a plain copy, and a streaming copy whose stores
//! bypass the cache.
//!
//! Why streaming stores for the scatter: a scatter writes each destination once and nobody on
//! this core reads it soon after, but an ordinary store first reads the destination's cache line
//! from memory (read-for-ownership). With destinations spread over a large buffer, that read is a
//! miss every time and the scatter moves three bytes over the memory bus per byte copied.
//! Non-temporal stores skip the read: on the 2-core benchmark machine a 64 MiB scatter of 4 KiB
//! pieces took 5.3-6.9 ms instead of 9.1-11.4 ms (BENCHMARKS.md). The gather keeps ordinary
//! stores: its region is read by the write right after, so it should stay in cache.
//!
//! Streaming stores are weakly ordered: [`fence`] must run after a job's last copy and before
//! its completion is published.

/// Pieces shorter than this are copied plainly: they are mostly partial cache lines, which
/// streaming stores handle badly.
const STREAM_MIN: usize = 256;
/// Cache line size; the streaming body is made of whole, aligned lines.
const LINE: usize = 64;

/// Copies `len` bytes from `src` to `dst` with ordinary stores.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes, and the two ranges must
/// not overlap.
pub(super) unsafe fn copy_cached(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Copies `len` bytes from `src` to `dst`, writing the cache-line-aligned body of `dst` with
/// non-temporal stores where the CPU has them (x86-64) and ordinary stores elsewhere. Call
/// [`fence`] before another thread may rely on the bytes. Returns the bytes written with
/// non-temporal stores (`stats.scatter_streamed_bytes`: what shows the option took effect).
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes, and the two ranges must
/// not overlap.
pub(super) unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        // Bytes until `dst` reaches a line boundary; `len >= STREAM_MIN > LINE` so they fit.
        let head = dst.align_offset(LINE).min(len);
        let body = (len - head) & !(LINE - 1);
        // SAFETY: head, body and tail partition `[0, len)`, which the caller made valid on both
        // sides and non-overlapping; `dst + head` is LINE-aligned, as `stream_lines` requires.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            stream_lines(src.add(head), dst.add(head), body);
            let done = head + body;
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
        }
        return body;
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    0
}

/// How much of a piece [`prefetch`] asks for: four lines, enough for the hardware prefetcher
/// to take up the rest of the piece (more measured the same).
const PREFETCH_BYTES: usize = 256;

/// Asks the CPU to bring the first lines of `[addr, addr + len)` into the cache, ahead of a
/// copy from there. A hint only: it reads nothing the program sees and never faults.
pub(super) fn prefetch(addr: *const u8, len: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let mut off = 0;
        while off < len.min(PREFETCH_BYTES) {
            // SAFETY: a prefetch is a hint that neither faults nor changes memory, whatever the
            // address (`wrapping_add`: the address is never dereferenced); SSE is part of the
            // x86-64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(addr.wrapping_add(off).cast::<i8>()) };
            off += LINE;
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = (addr, len);
}

/// Orders every streaming store issued by this thread before any later store, such as the one
/// that publishes a job's completion.
pub(super) fn fence() {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: `sfence` only orders stores; SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// Streams `len` bytes (a multiple of [`LINE`]) from `src` to the line-aligned `dst`.
///
/// # Safety
/// As for [`copy_streaming`], plus: `dst` is aligned to [`LINE`] and `len` is a multiple of it.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(not(miri))]
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let mut off = 0;
    while off < len {
        // Miri cannot run the streaming store (inline assembly); under it each line is copied
        // plainly, so the bounds of every line access are still checked.
        #[cfg(miri)]
        // SAFETY: `off + LINE <= len`: the line lies inside the caller's ranges.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), LINE);
        }
        // SAFETY: `off + LINE <= len`, so the four 16-byte loads and stores stay inside the
        // caller's ranges; the loads are unaligned-tolerant and every store address is 16-byte
        // aligned because `dst` is line-aligned and `off` a multiple of LINE. SSE2 is part of
        // the x86-64 baseline.
        #[cfg(not(miri))]
        unsafe {
            let s = src.add(off).cast::<__m128i>();
            let d = dst.add(off).cast::<__m128i>();
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        off += LINE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    proptest! {
        /// Whatever the alignment of either side and the length, the streaming copy writes
        /// exactly the destination range with exactly the source bytes, and streams every whole
        /// line of a piece of at least STREAM_MIN bytes (on x86-64; nothing elsewhere).
        #[test]
        fn streaming_copy_moves_exact_bytes_and_nothing_else(
            src_off in 0usize..128, dst_off in 0usize..128, len in 0usize..5000, seed in any::<u8>(),
        ) {
            let src = pattern(src_off + len, seed);
            let mut dst = vec![0xA5u8; dst_off + len + 128];
            // SAFETY: both ranges lie inside their own vectors.
            let streamed = unsafe { copy_streaming(src.as_ptr().add(src_off), dst.as_mut_ptr().add(dst_off), len) };
            fence();
            if cfg!(target_arch = "x86_64") && len >= STREAM_MIN {
                // Only the partial lines at either end go through ordinary stores.
                prop_assert_eq!(streamed % LINE, 0);
                prop_assert!(streamed <= len && len - streamed < 2 * LINE, "{} of {}", streamed, len);
            } else {
                prop_assert_eq!(streamed, 0);
            }
            prop_assert!(dst[..dst_off].iter().all(|&b| b == 0xA5));
            prop_assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
            prop_assert!(dst[dst_off + len..].iter().all(|&b| b == 0xA5));
        }
    }

    #[test]
    fn cached_copy_moves_exact_bytes() {
        let src = pattern(300, 7);
        let mut dst = vec![0u8; 302];
        // SAFETY: both ranges lie inside their own vectors.
        unsafe { copy_cached(src.as_ptr(), dst.as_mut_ptr().add(1), 300) };
        assert_eq!(dst[0], 0);
        assert_eq!(&dst[1..301], &src[..]);
        assert_eq!(dst[301], 0);
    }
}
