//! Translating a validated batch into work lists balanced by bytes (about [`LIST_BYTES`] each,
//! at least one per worker; the pool's workers take them in order as they free up).
//!
//! Lists are contiguous stretches of the batch in plan order (so each copies neighbouring
//! destination bytes), cut at byte boundaries `k * total / lists`. A read is split at such a
//! boundary only when both parts are at least [`MIN_SPLIT`] bytes; otherwise it stays whole with
//! one worker, and the next boundary, being absolute, corrects the drift.

use reshard_core::{RemoteRows, RemoteRuns};

/// Bytes of one work list when a batch is cut into more lists than workers: the pool's workers
/// take lists in order as each finishes its last, so a worker slowed by anything else on the
/// machine (the verifier, another process) takes fewer, and both end together.
pub(crate) const LIST_BYTES: u64 = 8 << 20;

/// Smallest piece a read is cut into when it is split between workers.
pub(crate) const MIN_SPLIT: u64 = 256 * 1024;

/// One copy: part (or all) of one read, contiguous at the destination (and at the source
/// unless the read is a gather).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Index of the read in the batch.
    pub(crate) read: u32,
    /// Index of the source region in the prepared state.
    pub(crate) src: u32,
    /// Index of the destination region in the prepared state.
    pub(crate) dst: u32,
    /// Byte offset in the source region: of the piece's first byte, or for a gather of its
    /// read's first row (the piece's own bytes are found through `off` and `rows`).
    pub(crate) src_off: u64,
    /// Byte offset in the destination region.
    pub(crate) dst_off: u64,
    /// Offset of the piece's first byte in its read.
    pub(crate) off: u64,
    /// Bytes to copy.
    pub(crate) len: u64,
    /// This piece ends its read: its completion completes the read (counted once).
    pub(crate) last: bool,
    /// The read's source rows when it is a gather (see [`reshard_core::RemoteRows`]).
    pub(crate) rows: Option<RemoteRows>,
}

impl Piece {
    /// The contiguous source runs of the piece's bytes `from..to` (offsets in the piece):
    /// `(source offset in the region, offset in the piece, bytes)`.
    pub(crate) fn src_runs(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, u64, u64)> {
        // The read's first source byte: a plain piece's `src_off` is its own first byte.
        let base = if self.rows.is_some() {
            self.src_off
        } else {
            self.src_off - self.off
        };
        let off = self.off;
        RemoteRuns::new(base, self.rows, off + from, off + to)
            .map(move |(src, at, n)| (src, at - off, n))
    }
}

/// Splits `reads` (each a whole read as a piece) into at most `workers` lists balanced by bytes.
/// Empty lists are dropped.
pub(crate) fn split(reads: &[Piece], workers: usize) -> Vec<Vec<Piece>> {
    let workers = workers.max(1);
    let total: u64 = reads.iter().map(|p| p.len).sum();
    let boundary = |w: usize| -> u64 {
        if w + 1 >= workers {
            total
        } else {
            ((w as u128 + 1) * total as u128 / workers as u128) as u64
        }
    };
    let per = reads.len() / workers + 2;
    let mut lists: Vec<Vec<Piece>> = (0..workers).map(|_| Vec::with_capacity(per)).collect();
    let mut w = 0usize;
    let mut consumed = 0u64;
    for r in reads {
        let mut off = 0u64;
        while off < r.len {
            let remaining = r.len - off;
            let room = boundary(w).saturating_sub(consumed);
            let mut take = remaining.min(room);
            if take < remaining {
                if remaining - take < MIN_SPLIT {
                    // The tail would be too small to be worth a separate piece: overfill.
                    take = remaining;
                } else if take < MIN_SPLIT {
                    // The head would be too small: leave this worker a little short.
                    take = 0;
                }
            }
            if take > 0 {
                lists[w].push(Piece {
                    // A gather's pieces keep their read's first row (see `Piece::src_off`).
                    src_off: if r.rows.is_some() {
                        r.src_off
                    } else {
                        r.src_off + off
                    },
                    dst_off: r.dst_off + off,
                    off: r.off + off,
                    len: take,
                    last: r.last && off + take == r.len,
                    ..*r
                });
                off += take;
                consumed += take;
            }
            if (take == 0 || consumed >= boundary(w)) && w + 1 < workers {
                w += 1;
            }
        }
    }
    lists.retain(|l| !l.is_empty());
    lists
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reads(lens: &[u64]) -> Vec<Piece> {
        let mut at = 0;
        lens.iter()
            .enumerate()
            .map(|(i, &len)| {
                let p = Piece {
                    read: i as u32,
                    src: (i % 3) as u32,
                    dst: 0,
                    src_off: 1000 + at,
                    dst_off: at,
                    off: 0,
                    len,
                    last: true,
                    rows: None,
                };
                at += len;
                p
            })
            .collect()
    }

    /// Every byte of every read lands in exactly one piece, in order, with matching offsets.
    fn check_cover(input: &[Piece], lists: &[Vec<Piece>]) {
        let flat: Vec<Piece> = lists.iter().flatten().copied().collect();
        let mut k = 0;
        for r in input {
            let mut off = 0;
            while off < r.len {
                let p = flat[k];
                assert_eq!((p.read, p.src, p.dst), (r.read, r.src, r.dst));
                assert_eq!(p.src_off, r.src_off + off);
                assert_eq!(p.dst_off, r.dst_off + off);
                assert_eq!(p.off, off, "the piece's offset in its read");
                assert!(p.len > 0);
                off += p.len;
                assert_eq!(
                    p.last,
                    off == r.len,
                    "exactly the final piece ends its read"
                );
                k += 1;
            }
            assert_eq!(off, r.len);
        }
        assert_eq!(k, flat.len());
    }

    #[test]
    fn one_big_read_is_split_evenly() {
        let input = reads(&[64 << 20]);
        for workers in [1, 2, 3, 4, 7, 16] {
            let lists = split(&input, workers);
            check_cover(&input, &lists);
            assert_eq!(lists.len(), workers);
            for l in &lists {
                let b: u64 = l.iter().map(|p| p.len).sum();
                assert!(
                    b.abs_diff((64 << 20) / workers as u64) <= 1,
                    "{workers}: {b}"
                );
            }
        }
    }

    #[test]
    fn many_mixed_reads_balance_within_a_split_unit() {
        let mut x = 12345u64;
        let lens: Vec<u64> = (0..5000)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                match x >> 60 {
                    0 => 3 << 20,
                    1..=3 => 300_000,
                    _ => 1 + (x >> 40) % 20_000,
                }
            })
            .collect();
        let input = reads(&lens);
        let total: u64 = lens.iter().sum();
        for workers in [1, 2, 5, 8] {
            let lists = split(&input, workers);
            check_cover(&input, &lists);
            for l in &lists {
                let b: u64 = l.iter().map(|p| p.len).sum();
                assert!(
                    b.abs_diff(total / workers as u64) <= 2 * MIN_SPLIT,
                    "{workers}: {b}"
                );
                for p in l {
                    let whole = lens[p.read as usize];
                    assert!(p.len == whole || p.len >= MIN_SPLIT, "small split piece");
                }
            }
        }
    }

    #[test]
    fn small_batches_use_few_workers_and_empty_is_empty() {
        assert!(split(&[], 4).is_empty());
        let input = reads(&[10, 20, 30]);
        let lists = split(&input, 8);
        check_cover(&input, &lists);
        assert!(lists.len() <= 3);
    }
}
