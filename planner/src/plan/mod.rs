//! The fused range planner (docs/design.md §4).
//!
//! Intersects each wanted copy of a receiver's layout with the offers of its source tensor,
//! turns every overlap into runs that are contiguous in both the source buffer and the
//! destination, replaces copies that would need too many runs by dim-0 full pulls re-sliced
//! locally, and coalesces reads for the wire. Pure and synchronous: the same inputs give the same
//! [`Plan`] (and fingerprint) on every backend.
//!
//! Runs are counted as products of extents before anything is materialised; only copies that
//! stay exact are enumerated (prior art spent ~45 s per rank building per-row runs it then threw
//! away for full pulls).
//!
//! One file per stage: `geometry` (overlaps, runs, tiling, uncovered boxes), `build` (the
//! planner's state and each copy), `assemble` (staging, full pulls, re-slices, statistics) and
//! `coalesce` (reads for the wire).

mod assemble;
mod build;
mod coalesce;
mod geometry;

use build::*;
use coalesce::*;
use geometry::*;

use reshard_core::layout::{contiguous_runs, row_major_strides, ContiguousRuns};
use reshard_core::{
    CheckedPart, Dest, DigestCheck, Error, ErrorDetail, ErrorKind, MatrixView, MergedOffer,
    MergedTable, MergedTensor, OwnerId, ParamSpec, Plan, PlanParam, PlanStats, PlannedRead,
    Reslice, Result, StagingBuffer, StagingKind, TensorBox, WantedCopy, WantedLayout,
};

/// Knobs of [`plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanOptions {
    /// A copy needing more than this many exact runs is served by a full pull when its tensor's
    /// offers tile dimension 0 (prior art: 64).
    pub full_pull_threshold: u64,
    /// Benchmark-only no-dedup arm: overlapping offers are all read instead of failing with
    /// `OverlappingOffers` (correct only when they are byte-identical replicas).
    pub allow_overlap: bool,
    /// Read a column block that lands contiguously (each source row's block right after the
    /// previous one's) as one gather read ([`reshard_core::RemoteRows`]) instead of one read
    /// per row: it counts as one descriptor against `full_pull_threshold`, so a row-parallel
    /// copy reads only its own columns instead of a full pull (docs/design.md §4).
    pub gather_reads: bool,
    /// The shortest row a gather read is planned for (bytes): every row is one get, copy or
    /// descriptor for a backend, so below this a full pull (more wire bytes, fewer and longer
    /// reads) is planned instead. BENCHMARKS.md ("Gather reads"): with 768-byte rows, loopback
    /// and cma refit faster by gathering, UCX and NIXL on one host slower.
    pub gather_min_row_bytes: u64,
}

impl PlanOptions {
    /// Whether an overlap of shape `rs` with elements of `elem` bytes, landing at destination
    /// element strides `dst_strides`, is planned as one gather read (see [`build::gathers`]).
    pub(in crate::plan) fn gathers(&self, rs: &RunShape, dst_strides: &[u64], elem: u64) -> bool {
        self.gather_reads
            && rs.block.saturating_mul(elem) >= self.gather_min_row_bytes
            && gathers(rs, dst_strides)
    }
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            full_pull_threshold: 64,
            allow_overlap: false,
            gather_reads: true,
            gather_min_row_bytes: 4096,
        }
    }
}

/// Plans the reads, staging buffers, re-slices and digest checks that fill `layout` from the
/// offers of `table`.
///
/// Errors: `Layout` (bad copy box, dtype mismatch, copy outside its parameter),
/// `MissingCoverage` (with the tensor and an unoffered box), `OverlappingOffers` (two offers
/// overlap inside a wanted box and `allow_overlap` is off), `InvalidTable` (a malformed offer).
pub fn plan(table: &MergedTable, layout: &WantedLayout, opts: &PlanOptions) -> Result<Plan> {
    layout.validate()?;
    if u32::try_from(layout.params.len()).is_err() {
        return Err(Error::new(
            ErrorKind::Layout,
            "layout has more than u32::MAX parameters",
        ));
    }
    let mut p = Planner::new(table, opts);
    for (pi, param) in layout.params.iter().enumerate() {
        for copy in &param.copies {
            p.copy(pi as u32, param, copy)?;
        }
    }
    Ok(p.finish(layout))
}

/// The `MissingCoverage` error for copy `c`, naming its tensor and an unoffered box.
fn missing_coverage(c: &WantedCopy, missing: TensorBox, message: String) -> Error {
    Error::new(ErrorKind::MissingCoverage, message)
        .with_tensor(&c.tensor)
        .with_detail(ErrorDetail::MissingCoverage {
            tensor: c.tensor.clone(),
            missing,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_shape_collapses_while_both_sides_are_row_major() {
        // Whole rows of a [4, 8] offer into a [4, 8] parameter: one run of 32 elements.
        let rs = run_shape(&[4, 8], &[8, 1], &[8, 1]);
        assert_eq!((rs.outer, rs.runs, rs.block), (0, 1, 32));
        // A column half: one run per row.
        let rs = run_shape(&[4, 4], &[8, 1], &[4, 1]);
        assert_eq!((rs.outer, rs.runs, rs.block), (1, 4, 4));
        // Non-unit innermost destination stride: every element is a run.
        let rs = run_shape(&[4, 4], &[4, 1], &[1, 4]);
        assert_eq!((rs.outer, rs.runs, rs.block), (2, 16, 1));
    }

    fn overlaps(boxes: &[(&[u64], &[u64])]) -> Overlaps {
        let mut ov = Overlaps::default();
        ov.reset(boxes[0].0.len());
        let whole = TensorBox::new(vec![0; ov.rank], vec![u64::MAX / 2; ov.rank]);
        for (k, (o, e)) in boxes.iter().enumerate() {
            ov.push_intersection(k, &whole, &TensorBox::new(o.to_vec(), e.to_vec()));
        }
        ov
    }

    #[test]
    fn uncovered_box_is_found_between_overlapping_pieces() {
        let ov = overlaps(&[(&[0, 0], &[4, 4]), (&[2, 0], &[4, 2]), (&[0, 0], &[6, 1])]);
        assert_eq!(find_uncovered(&ov, &[0, 0], &[4, 4]), None);
        let hole = find_uncovered(&ov, &[0, 0], &[6, 4]).unwrap();
        assert_eq!(hole, TensorBox::new(vec![4, 2], vec![2, 2]));
        assert!(ov.intersect(0, 1) && ov.intersect(1, 2));
        let apart = overlaps(&[(&[0, 0], &[2, 4]), (&[2, 0], &[2, 4])]);
        assert!(!apart.intersect(0, 1));
    }

    #[test]
    fn coalescing_needs_contiguity_on_both_sides() {
        let r = |src_offset, dst_offset| PlannedRead {
            owner: 1,
            src_region: 0,
            src_offset,
            len: 8,
            dst: Dest::Param(0),
            dst_offset,
            tensor: 0,
            src_rows: None,
        };
        let out = coalesce(vec![r(8, 8), r(0, 0), r(16, 32)]);
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].src_offset, out[0].len), (0, 16));
    }

    #[test]
    fn reslice_spans_overlap_only_within_one_param() {
        let r = |param, dst_offset| Reslice {
            staging: 0,
            src_offset: 0,
            src_strides: vec![1],
            extent: vec![4],
            elem: 2,
            param,
            dst_offset,
            dst_strides: vec![1],
            tensor: 0,
        };
        assert!(reslices_disjoint(&[r(0, 0), r(0, 8), r(1, 0)]));
        assert!(!reslices_disjoint(&[r(0, 0), r(0, 7)]));
    }
}
