//! The copy behind reads from shared memory a peer's UCX mapped into this process
//! (`ucp_rkey_ptr`): large copies use non-temporal (streaming) stores.
//!
//! Why not UCX's own `ucp_get_nbx` over sysv/posix: it copies each piece with glibc's
//! `memcpy`, which switches to streaming stores only above its non-temporal threshold (three
//! quarters of the last-level cache per thread, ~99 MiB on a VM that reports a 260 MiB L3).
//! Below it the destination is written through the cache (a read for ownership per line and
//! evictions), which halves the rate of a copy far larger than the cache, as a weight refit
//! is. A refit's destination is not read again soon, so bypassing the cache is right here.

/// Copies shorter than this use `copy_nonoverlapping` (the data may still be cache-resident
/// and is likely read soon; streaming only pays off for copies larger than the caches).
const STREAM_MIN: usize = 1 << 20;

/// Copies `len` bytes from `src` to `dst`, with streaming stores for large copies.
///
/// # Safety
/// `src..src+len` must be readable and `dst..dst+len` writable for the whole call, and the
/// ranges must not overlap.
pub(crate) unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        // SAFETY: forwarded from the caller.
        unsafe { x86::stream_copy(dst, src, len) };
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    const PAGE: usize = 4096;

    /// Copies one 64-byte line with unaligned loads and streaming stores.
    ///
    /// # Safety
    /// `s..s+64` readable, `d..d+64` writable, `d` 16-byte aligned.
    #[inline(always)]
    unsafe fn line(d: *mut u8, s: *const u8) {
        // SAFETY: guaranteed by the caller; loads are unaligned, stores aligned.
        unsafe {
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
        }
    }

    /// SSE2 (part of the x86_64 baseline, so no feature detection) streaming copy, walking
    /// four pages at once as glibc's large-copy path does (fewer DRAM page switches; measured
    /// here at the rate of one big glibc `memcpy`, where a linear streaming loop reaches
    /// ~75% of it and one with software prefetch ~60%). A fence at the end makes the bytes
    /// globally visible before the read is reported complete.
    ///
    /// # Safety
    /// As [`super::stream_copy`].
    pub(super) unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
        // Head: bring `dst` to a 16-byte boundary with a plain copy.
        let head = dst.align_offset(16).min(len);
        // SAFETY: `head <= len`, inside both ranges (caller's guarantee).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        // SAFETY: `head <= len`: still inside (or one past the end of) the ranges.
        let (mut d, mut s) = unsafe { (dst.add(head), src.add(head)) };
        let mut left = len - head;
        while left >= 4 * PAGE {
            let mut off = 0;
            while off < PAGE {
                for p in 0..4 {
                    // SAFETY: `p * PAGE + off + 64 <= 4 * PAGE <= left` bytes remain of each
                    // range; `d` is 16-byte aligned and so are these offsets from it.
                    unsafe { line(d.add(p * PAGE + off), s.add(p * PAGE + off)) };
                }
                off += 64;
            }
            // SAFETY: `4 * PAGE <= left`: still inside (or one past the end of) the ranges.
            unsafe {
                d = d.add(4 * PAGE);
                s = s.add(4 * PAGE);
            }
            left -= 4 * PAGE;
        }
        while left >= 64 {
            // SAFETY: `left >= 64` bytes remain of each range; `d` stays 16-byte aligned.
            unsafe {
                line(d, s);
                d = d.add(64);
                s = s.add(64);
            }
            left -= 64;
        }
        // SAFETY: the last `left < 64` bytes of both ranges; the fence orders the streaming
        // stores before anything this thread does next (reporting the read complete).
        unsafe {
            std::ptr::copy_nonoverlapping(s, d, left);
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_exactly_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..(STREAM_MIN + 8 * 4096))
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        for (soff, doff, len) in [
            (0, 0, STREAM_MIN),
            (1, 3, STREAM_MIN + 17),
            (5, 0, STREAM_MIN + 63),
            (7, 2, STREAM_MIN + 3 * 4096 + 100),
            (0, 9, 100),
            (3, 1, 0),
        ] {
            assert!(soff + len <= src.len());
            let mut dst = vec![0xeeu8; len + 64];
            // SAFETY: both ranges are inside their vectors and the vectors are distinct.
            unsafe { stream_copy(dst.as_mut_ptr().add(doff), src.as_ptr().add(soff), len) };
            assert_eq!(dst[doff..doff + len], src[soff..soff + len]);
            assert!(dst[..doff].iter().all(|&b| b == 0xee));
            assert!(dst[doff + len..].iter().all(|&b| b == 0xee));
        }
    }
}
