//! Coalescing reads for the wire and the disjointness test of re-slices.

use super::*;

/// Orders reads by (owner, region, source offset, destination buffer) and merges neighbours
/// that are contiguous in both source and destination: what actually goes on the wire.
/// The sort is stable, so equal keys keep plan order and the result is deterministic.
pub(super) fn coalesce(mut reads: Vec<PlannedRead>) -> Vec<PlannedRead> {
    reads.sort_by_key(|r| (r.owner, r.src_region, r.src_offset, r.dst));
    let mut out: Vec<PlannedRead> = Vec::with_capacity(reads.len());
    for r in reads {
        if let Some(last) = out.last_mut() {
            // A gather is one descriptor of its own: never merged.
            if last.src_rows.is_none()
                && r.src_rows.is_none()
                && last.owner == r.owner
                && last.src_region == r.src_region
                && last.src_offset + last.len == r.src_offset
                && last.dst == r.dst
                && last.dst_offset + last.len == r.dst_offset
            {
                last.len += r.len;
                continue;
            }
        }
        out.push(r);
    }
    out
}

/// Conservative disjointness of re-slice destinations: the byte span `[first, last]` of each
/// re-slice, compared per parameter. Interleaved but disjoint strided copies count as
/// overlapping; that only costs the runtime its parallel pass, never correctness.
pub(super) fn reslices_disjoint(reslices: &[Reslice]) -> bool {
    let mut spans: Vec<(u32, u64, u64)> = reslices
        .iter()
        .map(|r| {
            let reach: u64 = r
                .extent
                .iter()
                .zip(&r.dst_strides)
                .map(|(&e, &s)| (e - 1) * s)
                .sum();
            (
                r.param,
                r.dst_offset,
                r.dst_offset + (reach + 1) * r.elem - 1,
            )
        })
        .collect();
    spans.sort_unstable();
    spans
        .windows(2)
        .all(|w| w[0].0 != w[1].0 || w[1].1 > w[0].2)
}
