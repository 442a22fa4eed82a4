//! Overlapping destinations, handled once above the backends.
//!
//! A backend only ever receives batches whose destinations are disjoint: [`first_overlap`]
//! finds two reads of one batch that write the same local bytes, and
//! [`crate::contract::validate_batch`] refuses such a batch. Callers that do want overlapping
//! reads (the benchmark-only no-dedup arm reads every replica of a byte into one place) split
//! the batch with [`disjoint_waves`] and post the waves one after another, so overlapping reads
//! land in batch order (the last one in the batch wins) without any backend ordering them.
//!
//! Backends compare destinations by address ([`space`], address range), so one memory
//! registered twice is still one destination and a batch writing it through both regions is
//! refused too. Callers above the backends know only region ids and split by
//! `(local region, byte range)`; a batch overlapping only through aliased registrations is
//! refused by the backend, never written concurrently.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use crate::model::MemoryKind;
use crate::transport::{ReadBatch, ReadDesc};

/// The local bytes read `r` writes.
fn dest(r: &ReadDesc) -> Range<u64> {
    r.local_offset..r.local_offset.saturating_add(r.len)
}

/// A destination span: `(space, start, end, read index)`. Reads overlap when they share a
/// space and their `start..end` ranges intersect.
pub type Span = (u64, u64, u64, usize);

/// The address space of memory of `kind`: host addresses are the process's, device addresses
/// are per device, so spans of different spaces never overlap.
pub fn space(kind: MemoryKind) -> u64 {
    match kind {
        MemoryKind::Dram => 0,
        MemoryKind::Vram { device } => 1 + u64::from(device),
    }
}

/// Two spans of `spans` that overlap, as `(earlier, later)` read indices (the pair with the
/// lowest start in sorted order), or `None`. Empty spans overlap nothing. Sorts `spans`.
pub fn first_overlap_of(spans: &mut [Span]) -> Option<(usize, usize)> {
    spans.sort_unstable();
    // Sorted by (space, start): a span overlaps an earlier one exactly when it starts before
    // the furthest end seen so far in its space (that span's read is kept to name it).
    let mut reach: Option<(u64, u64, usize)> = None; // (space, end, read)
    for &(sp, start, end, i) in spans.iter() {
        if start >= end {
            continue;
        }
        match reach {
            Some((g, e, j)) if g == sp && start < e => return Some((i.min(j), i.max(j))),
            // Disjoint from everything before it, so it ends furthest.
            _ => reach = Some((sp, end, i)),
        }
    }
    None
}

/// Two reads of `batch` whose destinations overlap as `(local region, byte range)`, as
/// `(earlier, later)` batch indices, or `None` when every destination is disjoint. Zero-length
/// reads overlap nothing. What a caller above the backends sees (it knows no addresses);
/// backends check addresses too ([`crate::contract::validate_batch`]).
pub fn first_overlap(batch: &ReadBatch) -> Option<(usize, usize)> {
    let mut spans: Vec<Span> = batch
        .reads
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let d = dest(r);
            (r.local_region, d.start, d.end, i)
        })
        .collect();
    first_overlap_of(&mut spans)
}

/// The bytes both reads write (empty when they do not overlap or name different regions).
pub fn overlap_range(a: &ReadDesc, b: &ReadDesc) -> Range<u64> {
    if a.local_region != b.local_region {
        return 0..0;
    }
    let (x, y) = (dest(a), dest(b));
    let start = x.start.max(y.start);
    start..x.end.min(y.end).max(start)
}

/// `batch` split into waves: consecutive batches whose destinations are disjoint, such that a
/// read overlapping earlier reads of the batch is in a later wave than all of them. Posting the
/// waves one after another, each waited for before the next, applies overlapping reads in batch
/// order. A batch with disjoint destinations is one wave, returned as it is. Reads keep their
/// batch order inside a wave; zero-length reads join the first wave (validation refuses them).
pub fn disjoint_waves(batch: ReadBatch) -> Vec<ReadBatch> {
    if first_overlap(&batch).is_none() {
        return vec![batch];
    }
    // Per local region, the bytes already written as disjoint painted spans:
    // start -> (end, wave of the last read that wrote them). A read goes one wave after the
    // latest wave among the spans it touches, then paints its own range with its wave (which is
    // the highest in that range, so painting over is exact).
    let mut painted: HashMap<u64, BTreeMap<u64, (u64, usize)>> = HashMap::new();
    let mut wave_of = Vec::with_capacity(batch.reads.len());
    for r in &batch.reads {
        let d = dest(r);
        if d.is_empty() {
            wave_of.push(0);
            continue;
        }
        let spans = painted.entry(r.local_region).or_default();
        // Spans are disjoint and sorted, so those touching `d` are the last ones starting
        // before `d.end`, back to the first that ends after `d.start`.
        let touched: Vec<(u64, u64, usize)> = spans
            .range(..d.end)
            .rev()
            .take_while(|(_, &(end, _))| end > d.start)
            .map(|(&s, &(e, w))| (s, e, w))
            .collect();
        let wave = touched.iter().map(|&(_, _, w)| w + 1).max().unwrap_or(0);
        for &(s, e, w) in &touched {
            spans.remove(&s);
            if s < d.start {
                spans.insert(s, (d.start, w));
            }
            if e > d.end {
                spans.insert(d.end, (e, w));
            }
        }
        spans.insert(d.start, (d.end, wave));
        wave_of.push(wave);
    }
    let waves = wave_of.iter().max().map_or(0, |w| w + 1);
    let mut out: Vec<ReadBatch> = (0..waves)
        .map(|_| ReadBatch { reads: Vec::new() })
        .collect();
    for (r, w) in batch.reads.into_iter().zip(wave_of) {
        out[w].reads.push(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read of `len` bytes into local region `g` at `off` (remote side irrelevant here; the
    /// remote offset tags the read so tests can tell reads apart).
    fn rd(tag: u64, g: u64, off: u64, len: u64) -> ReadDesc {
        ReadDesc {
            owner: 0,
            remote_region: 1,
            remote_offset: tag,
            local_region: g,
            local_offset: off,
            len,
            remote_rows: None,
        }
    }

    fn batch(reads: Vec<ReadDesc>) -> ReadBatch {
        ReadBatch { reads }
    }

    fn tags(waves: &[ReadBatch]) -> Vec<Vec<u64>> {
        waves
            .iter()
            .map(|w| w.reads.iter().map(|r| r.remote_offset).collect())
            .collect()
    }

    #[test]
    fn disjoint_batches_have_no_overlap_sorted_or_not() {
        let sorted = vec![
            rd(0, 1, 0, 4),
            rd(1, 1, 4, 4),
            rd(2, 2, 0, 8),
            rd(3, 2, 8, 1),
        ];
        let mut shuffled = sorted.clone();
        shuffled.reverse();
        let cases = [
            vec![],
            sorted,
            shuffled,
            // The same bytes in different regions do not overlap; zero lengths overlap nothing.
            vec![rd(0, 1, 0, 8), rd(1, 2, 0, 8), rd(2, 1, 3, 0)],
        ];
        for reads in cases {
            assert_eq!(first_overlap(&batch(reads.clone())), None, "{reads:?}");
        }
    }

    #[test]
    fn overlaps_are_found_and_named_in_batch_order() {
        let cases = [
            // Touching ends are not an overlap; one shared byte is.
            (vec![rd(0, 1, 0, 4), rd(1, 1, 3, 4)], (0, 1)),
            (vec![rd(0, 1, 3, 4), rd(1, 1, 0, 4)], (0, 1)),
            // Hidden behind a short read: 0..100 covers 60..70 although 10..20 ends before it.
            (
                vec![rd(0, 1, 0, 100), rd(1, 1, 10, 10), rd(2, 1, 60, 10)],
                (0, 1),
            ),
            (
                vec![rd(0, 1, 200, 8), rd(1, 1, 0, 100), rd(2, 1, 60, 10)],
                (1, 2),
            ),
            // Not sorted, overlap found only through the long read's reach.
            (
                vec![rd(0, 2, 50, 1), rd(1, 2, 0, 40), rd(2, 2, 30, 2)],
                (1, 2),
            ),
        ];
        for (reads, pair) in cases {
            assert_eq!(
                first_overlap(&batch(reads.clone())),
                Some(pair),
                "{reads:?}"
            );
        }
        let a = rd(0, 1, 0, 10);
        assert_eq!(overlap_range(&a, &rd(1, 1, 5, 10)), 5..10);
        assert!(overlap_range(&a, &rd(1, 2, 5, 10)).is_empty());
        assert!(overlap_range(&a, &rd(1, 1, 10, 10)).is_empty());
    }

    #[test]
    fn a_disjoint_batch_is_one_wave_unchanged() {
        let b = batch(vec![rd(0, 1, 8, 8), rd(1, 1, 0, 8)]);
        assert_eq!(disjoint_waves(b.clone()), vec![b]);
    }

    #[test]
    fn overlapping_reads_go_after_every_earlier_read_they_touch() {
        // Per case: the reads as (local region, offset, len), tagged by their index, and the
        // tags of each wave.
        type Case<'a> = (&'a [(u64, u64, u64)], Vec<Vec<u64>>);
        let cases: [Case; 2] = [
            // Replicas: three copies of 0..8 and two of 8..16, interleaved, plus a disjoint read.
            (
                &[
                    (1, 0, 8),
                    (1, 8, 8),
                    (1, 0, 8),
                    (2, 0, 8),
                    (1, 8, 8),
                    (1, 0, 8),
                ],
                vec![vec![0, 1, 3], vec![2, 4], vec![5]],
            ),
            // A read spanning two painted spans goes after the later of them; the parts of a
            // span it does not cover keep their wave: 0:w0 1:w0 2:w1 (touches 1) 3:w2 (touches
            // 0,1,2) 4:w1 (only 0's kept 0..4) 5:w2 (2).
            (
                &[
                    (1, 0, 10),
                    (1, 10, 10),
                    (1, 15, 10),
                    (1, 5, 12),
                    (1, 0, 4),
                    (1, 22, 1),
                ],
                vec![vec![0, 1], vec![2, 4], vec![3, 5]],
            ),
        ];
        for (reads, want) in cases {
            let reads = (0..)
                .zip(reads)
                .map(|(t, &(g, off, len))| rd(t, g, off, len));
            let waves = disjoint_waves(batch(reads.collect()));
            assert_eq!(tags(&waves), want);
            for w in &waves {
                assert_eq!(first_overlap(w), None, "every wave is disjoint");
            }
        }
    }

    #[test]
    fn waves_keep_every_read_once() {
        // Pseudo-random overlapping reads: each wave disjoint, all reads kept, overlapping
        // pairs in batch order across waves.
        let mut x = 12345u64;
        let mut next = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let reads: Vec<ReadDesc> = (0..400)
            .map(|t| rd(t, next(3), next(500), 1 + next(40)))
            .collect();
        let waves = disjoint_waves(batch(reads.clone()));
        let mut wave_of = vec![usize::MAX; reads.len()];
        for (w, b) in waves.iter().enumerate() {
            assert_eq!(first_overlap(b), None, "wave {w} is disjoint");
            for r in &b.reads {
                wave_of[r.remote_offset as usize] = w;
            }
        }
        assert!(wave_of.iter().all(|&w| w != usize::MAX), "every read kept");
        assert_eq!(
            waves.iter().map(|b| b.reads.len()).sum::<usize>(),
            reads.len()
        );
        for i in 0..reads.len() {
            for j in i + 1..reads.len() {
                if !overlap_range(&reads[i], &reads[j]).is_empty() {
                    assert!(wave_of[i] < wave_of[j], "reads {i} and {j} out of order");
                }
            }
        }
    }
}
