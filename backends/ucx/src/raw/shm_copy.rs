//! The copy behind reads from shared memory a peer's UCX mapped into this process
//! (`ucp_rkey_ptr`): large copies use non-temporal (streaming) stores, unless the receiver
//! asked for digest hashes while copying (a hash plan in the batch's sink): then each block is
//! copied through the cache and its landed bytes hashed right after, while they are still in
//! cache, so verification costs no second pass over memory (docs/in-flight-safety.md,
//! "Hashing while copying").
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

use std::sync::atomic::{AtomicBool, Ordering};

use reshard_core::{CompletionSink, RemoteRows, RemoteRuns};

/// Block of a hashed copy: copied with plain stores, then its landed bytes hashed while they
/// are still in cache (small enough to stay in L2 between the copy and the hash).
const HASH_BLOCK: usize = 256 << 10;

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

/// The source rows of a direct copy that gathers: the destination is contiguous, its bytes
/// come from rows of `row` bytes, `pitch` bytes apart, and the copy's first byte is `head`
/// bytes into its row (so the next row starts `pitch - head` bytes after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rows {
    /// Bytes of each row (at least 1).
    pub(crate) row: usize,
    /// Distance between the starts of consecutive rows (at least `row`).
    pub(crate) pitch: usize,
    /// Offset of the copy's first byte in its row (less than `row`).
    pub(crate) head: usize,
}

impl Rows {
    /// The contiguous source runs of destination bytes `at..at + n`: `(distance from the
    /// first byte's source, bytes)` each, cut by the contract's own row walk
    /// ([`RemoteRuns`], counted from the start of the first byte's row).
    fn runs(self, at: usize, n: usize) -> impl Iterator<Item = (usize, usize)> {
        let rows = RemoteRows {
            row_bytes: self.row as u64,
            pitch: self.pitch as u64,
        };
        let (head, from) = (self.head as u64, (self.head + at) as u64);
        RemoteRuns::new(0, Some(rows), from, from + n as u64)
            .map(move |(src, _, len)| ((src - head) as usize, len as usize))
    }
}

/// One direct copy of `len` bytes from `src` to `dst` (see [`copy_all`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CopyTask {
    /// Destination: registered local memory.
    pub(crate) dst: *mut u8,
    /// Source of the first byte: a peer's shared-memory segment mapped here.
    pub(crate) src: *const u8,
    /// Bytes to copy.
    pub(crate) len: usize,
    /// Where the source bytes after the first come from when the copy gathers rows; `None`:
    /// the source is contiguous.
    pub(crate) rows: Option<Rows>,
    /// The batch read the bytes belong to, and the offset of `dst` in it (for the hasher).
    pub(crate) read: u32,
    /// Offset of this task's first byte in its read.
    pub(crate) off: u64,
}

impl CopyTask {
    /// The task's destination bytes `at..at + n`, as a task of their own.
    ///
    /// # Safety
    /// `at + n <= self.len`, and `self` satisfies [`copy_all`]'s contract.
    unsafe fn part(&self, at: usize, n: usize) -> CopyTask {
        let (src_at, rows) = match self.rows {
            None => (at, None),
            Some(r) => {
                let d = r.runs(at, n).next().map_or(0, |(d, _)| d);
                let head = (r.head + at) % r.row;
                (d, Some(Rows { head, ..r }))
            }
        };
        // SAFETY: destination byte `at` is inside the task, and its source is `src_at` bytes
        // after the first byte's, inside the same source span (the caller's guarantee).
        let (dst, src) = unsafe { (self.dst.add(at), self.src.add(src_at)) };
        CopyTask {
            dst,
            src,
            len: n,
            rows,
            read: self.read,
            off: self.off + at as u64,
        }
    }

    /// Copies destination bytes `at..at + n` with plain stores (`stream`: streaming stores
    /// for runs long enough), one contiguous source run (a row or part of one) at a time.
    ///
    /// # Safety
    /// As [`CopyTask::part`].
    unsafe fn copy(&self, at: usize, n: usize, stream: bool) {
        let plain = |d: *mut u8, s: *const u8, len: usize| {
            // SAFETY: a run of this task's ranges (caller's guarantee), disjoint from others.
            unsafe {
                if stream {
                    stream_copy(d, s, len)
                } else {
                    std::ptr::copy_nonoverlapping(s, d, len)
                }
            }
        };
        let Some(r) = self.rows else {
            // SAFETY: `at + n <= len` (caller's guarantee).
            plain(unsafe { self.dst.add(at) }, unsafe { self.src.add(at) }, n);
            return;
        };
        let mut dst = at;
        for (src, len) in r.runs(at, n) {
            // SAFETY: destination bytes `dst..dst + len` of the task, and one contiguous source
            // run of its rows (inside the source span, the caller's guarantee).
            plain(
                unsafe { self.dst.add(dst) },
                unsafe { self.src.add(src) },
                len,
            );
            dst += len;
        }
    }
}

// SAFETY: a task is two addresses and a length; `copy_all`'s caller guarantees the ranges are
// valid, disjoint from every other task's destination and untouched by anyone else for the
// whole call, so copying them from any thread is sound.
unsafe impl Send for CopyTask {}
// SAFETY: as above; tasks are only read.
unsafe impl Sync for CopyTask {}

/// Pieces a large task is cut into for the pool: several per thread even for one big read, and
/// still far above [`STREAM_MIN`] so every piece streams.
const SPLIT: usize = 4 << 20;

/// Copies every task, spread over `pool`'s threads when there is one, in pieces of at most
/// [`SPLIT`] bytes; once `stop` is set no further piece starts (pieces already running finish).
/// With `sink` carrying a hash plan, each piece is copied in [`HASH_BLOCK`]s whose planned
/// digest segments are hashed from the landed bytes right after the copy, on the copying
/// thread, before the piece counts as copied (so before its read is reported).
/// Returns whether every piece was copied.
///
/// Why a pool: one thread's streaming copy reaches about half of what the machine's memory
/// system gives several (measured on the bench: 0.58x of a one-thread glibc memcpy of the same
/// bytes, which itself uses two memory channels' worth of prefetch); loopback's copy engine
/// gets 1.1x with two workers.
///
/// # Safety
/// For every task, `src..src+len` must be readable and `dst..dst+len` writable for the whole
/// call, no destination may overlap another task's destination or any source, and nothing
/// else may touch the destinations meanwhile.
pub(crate) unsafe fn copy_all(
    pool: Option<&rayon::ThreadPool>,
    tasks: &[CopyTask],
    stop: &AtomicBool,
    sink: Option<&CompletionSink>,
) -> bool {
    let mut parts = Vec::with_capacity(tasks.len());
    for t in tasks {
        let mut off = 0;
        while off < t.len {
            let n = (t.len - off).min(SPLIT);
            // SAFETY: `off + n <= len`: inside the task.
            parts.push(unsafe { t.part(off, n) });
            off += n;
        }
    }
    let copy = |t: &CopyTask| {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        match sink.and_then(|s| s.piece_hasher(t.read as usize, t.off)) {
            Some(mut hasher) => {
                let mut done = 0;
                while done < t.len {
                    let n = (t.len - done).min(HASH_BLOCK);
                    // SAFETY: a sub-range of one caller task (disjoint destinations); plain
                    // stores, so the block is still in cache for the hash below.
                    unsafe { t.copy(done, n, false) };
                    done += n;
                    // SAFETY: the part's first `done` destination bytes were just written by
                    // this thread and no one else writes them while the batch runs (the
                    // caller's guarantee), so a shared view of them is sound. The hashes are
                    // of the bytes as they landed, read back after the copy.
                    let landed = unsafe { std::slice::from_raw_parts(t.dst as *const u8, done) };
                    hasher.landed(landed);
                }
            }
            // SAFETY: each part is a sub-range of one caller task (disjoint destinations).
            None => unsafe { t.copy(0, t.len, true) },
        }
        true
    };
    let Some(pool) = pool else {
        return parts.iter().all(copy);
    };
    use rayon::prelude::*;
    let copied = pool.install(|| parts.par_iter().map(copy).filter(|&c| c).count());
    copied == parts.len()
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
    fn pool_copies_split_tasks_exactly() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let src: Vec<u8> = (0..3 * SPLIT + 4099).map(|i| (i * 13 + 1) as u8).collect();
        let mut dst = vec![0u8; src.len() + 2 * 64];
        // Three tasks: a large one split into pieces (odd offsets), a small one, a tail.
        let layout = [
            (1, 0, 2 * SPLIT + 5),
            (2 * SPLIT + 5, 2 * SPLIT + 70, 100),
            (2 * SPLIT + 105, 2 * SPLIT + 300, SPLIT),
        ];
        let tasks: Vec<CopyTask> = layout
            .iter()
            .map(|&(s, d, len)| CopyTask {
                // SAFETY: offsets and lengths stay inside both vectors (asserted below).
                dst: unsafe { dst.as_mut_ptr().add(d) },
                src: unsafe { src.as_ptr().add(s) },
                len,
                rows: None,
                read: 0,
                off: 0,
            })
            .collect();
        for &(s, d, len) in &layout {
            assert!(s + len <= src.len() && d + len <= dst.len());
        }
        for pool in [Some(&pool), None] {
            dst.iter_mut().for_each(|b| *b = 0);
            // SAFETY: destinations are disjoint ranges of `dst`, sources ranges of `src`.
            assert!(unsafe { copy_all(pool, &tasks, &AtomicBool::new(false), None) });
            for &(s, d, len) in &layout {
                assert_eq!(dst[d..d + len], src[s..s + len]);
            }
            assert_eq!(dst[2 * SPLIT + 5..2 * SPLIT + 70], [0; 65]);
        }
        // A set stop flag starts no piece.
        dst.iter_mut().for_each(|b| *b = 0);
        // SAFETY: as above.
        assert!(!unsafe { copy_all(Some(&pool), &tasks, &AtomicBool::new(true), None) });
        assert!(dst.iter().all(|&b| b == 0));
    }

    /// A gather task starting `head` bytes into its first row, longer than [`SPLIT`] so the
    /// pool cuts it mid-row: every destination byte comes from its row, in order.
    #[test]
    fn gather_tasks_copy_their_rows_in_order_across_splits() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let (row, pitch, head, len) = (1000, 1536, 337, SPLIT + 12_345);
        let rows = (head + len).div_ceil(row);
        let src: Vec<u8> = (0..rows * pitch)
            .map(|i| (i * 31 + i / 251) as u8)
            .collect();
        let want: Vec<u8> = (0..len)
            .map(|at| {
                let k = head + at;
                src[(k / row) * pitch + k % row]
            })
            .collect();
        let mut dst = vec![0u8; len];
        let task = CopyTask {
            dst: dst.as_mut_ptr(),
            // SAFETY: `head < row <= src.len()`.
            src: unsafe { src.as_ptr().add(head) },
            len,
            rows: Some(Rows { row, pitch, head }),
            read: 0,
            off: 0,
        };
        for pool in [Some(&pool), None] {
            dst.iter_mut().for_each(|b| *b = 0);
            // SAFETY: every row of the task lies inside `src`, its destination is `dst`.
            assert!(unsafe { copy_all(pool, &[task], &AtomicBool::new(false), None) });
            assert!(dst == want, "gathered rows land in order");
        }
        // A part taken mid-row starts at its own row's byte.
        // SAFETY: inside the task.
        let part = unsafe { task.part(row * 3 + 5, 10) };
        assert_eq!(part.src, src[3 * pitch + head + 5..].as_ptr());
        assert_eq!(part.rows.map(|r| r.head), Some(head + 5));
    }

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
