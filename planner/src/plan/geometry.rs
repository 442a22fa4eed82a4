//! Box geometry the planner needs: the overlaps of one copy with its offers, runs that are
//! contiguous on both sides, dim-0 tiling, and the search for an uncovered box.

use super::*;

/// Intersections of one copy with the offers of its tensor, stored flat to avoid an allocation
/// per overlap: overlap k's offsets are `coords[2rk..2rk+r]`, its extents the next `r`.
#[derive(Default)]
pub(super) struct Overlaps {
    pub(super) rank: usize,
    pub(super) offers: Vec<usize>,
    pub(super) coords: Vec<u64>,
}

impl Overlaps {
    pub(super) fn reset(&mut self, rank: usize) {
        self.rank = rank;
        self.offers.clear();
        self.coords.clear();
    }

    pub(super) fn len(&self) -> usize {
        self.offers.len()
    }

    /// Records `a ∩ b` (for offer `offer`) when it is non-empty.
    pub(super) fn push_intersection(&mut self, offer: usize, a: &TensorBox, b: &TensorBox) {
        let r = self.rank;
        if b.rank() != r || b.offset.len() != r {
            return;
        }
        let start = self.coords.len();
        self.coords.resize(start + 2 * r, 0);
        for d in 0..r {
            let lo = a.offset[d].max(b.offset[d]);
            let hi = a.end(d).min(b.end(d));
            if hi <= lo {
                self.coords.truncate(start);
                return;
            }
            self.coords[start + d] = lo;
            self.coords[start + r + d] = hi - lo;
        }
        self.offers.push(offer);
    }

    pub(super) fn off(&self, k: usize) -> &[u64] {
        let s = 2 * self.rank * k;
        &self.coords[s..s + self.rank]
    }

    pub(super) fn ext(&self, k: usize) -> &[u64] {
        let s = 2 * self.rank * k + self.rank;
        &self.coords[s..s + self.rank]
    }

    /// True when overlaps `i` and `j` share at least one element.
    pub(super) fn intersect(&self, i: usize, j: usize) -> bool {
        let (oi, ei, oj, ej) = (self.off(i), self.ext(i), self.off(j), self.ext(j));
        (0..self.rank).all(|d| oi[d].max(oj[d]) < (oi[d] + ei[d]).min(oj[d] + ej[d]))
    }
}

/// How the runs of one overlap look: the trailing dims collapse into one contiguous block.
pub(super) struct RunShape {
    /// Number of leading dims that are not collapsed (runs are enumerated over them).
    pub(super) outer: usize,
    /// Number of runs (product of the outer extents).
    pub(super) runs: u64,
    /// Elements per run.
    pub(super) block: u64,
}

/// The runs of an overlap contiguous in both the offer (source) and the parameter
/// ([`contiguous_runs`]; the offer side is row-major, so its innermost stride is 1).
pub(super) fn run_shape(ext: &[u64], src_strides: &[u64], dst_strides: &[u64]) -> RunShape {
    let ContiguousRuns { outer, block } = contiguous_runs(ext, src_strides, dst_strides);
    RunShape {
        outer,
        runs: ext[..outer].iter().product(),
        block,
    }
}

/// Fills `out` with the row-major element strides of `shape`.
pub(super) fn fill_row_major(shape: &[u64], out: &mut Vec<u64>) {
    out.clear();
    out.resize(shape.len(), 1);
    for d in (0..shape.len().saturating_sub(1)).rev() {
        out[d] = out[d + 1] * shape[d + 1];
    }
}

/// Whether the offers tile dimension 0: each spans the whole tensor in dims 1.., and sorted by
/// dim-0 offset they cover `[0, shape[0])` with no gap and no overlap.
pub(super) fn tiles_dim0(t: &MergedTensor) -> bool {
    let shape = &t.spec.shape;
    if t.offers.is_empty() {
        return false;
    }
    let spans_rows = |o: &MergedOffer| {
        let b = &o.tensor_box;
        b.rank() == shape.len()
            && (1..shape.len()).all(|d| b.offset[d] == 0 && b.extent[d] == shape[d])
    };
    if !t.offers.iter().all(spans_rows) {
        return false;
    }
    if let [only] = t.offers.as_slice() {
        // The common case (one whole replica after dedup) needs no sort.
        return only.tensor_box.offset[0] == 0 && only.tensor_box.extent[0] == shape[0];
    }
    let mut rows: Vec<(u64, u64)> = t
        .offers
        .iter()
        .map(|o| (o.tensor_box.offset[0], o.tensor_box.end(0)))
        .collect();
    rows.sort_unstable();
    let mut next = 0;
    for (lo, hi) in rows {
        if lo != next {
            return false;
        }
        next = hi;
    }
    next == shape[0]
}

/// Finds a sub-box of the copy box `(lo, hi)` that no overlap covers, or `None` when the
/// overlaps cover it. Recurses one dim at a time over the slabs between overlap boundaries;
/// every candidate either contains a slab or misses it, so a slab with no candidate is a
/// genuinely uncovered box.
pub(super) fn find_uncovered(ov: &Overlaps, lo: &[u64], hi: &[u64]) -> Option<TensorBox> {
    let mut cur_lo = lo.to_vec();
    let mut cur_hi = hi.to_vec();
    let cand: Vec<usize> = (0..ov.len()).collect();
    if uncovered_from(ov, 0, &cand, &mut cur_lo, &mut cur_hi) {
        let extent = cur_hi.iter().zip(&cur_lo).map(|(h, l)| h - l).collect();
        Some(TensorBox::new(cur_lo, extent))
    } else {
        None
    }
}

/// Step of [`find_uncovered`]: `cand` contain the current slab in dims `< d`. On success `lo`
/// and `hi` describe the uncovered box.
pub(super) fn uncovered_from(
    ov: &Overlaps,
    d: usize,
    cand: &[usize],
    lo: &mut [u64],
    hi: &mut [u64],
) -> bool {
    if cand.is_empty() {
        return true;
    }
    let r = ov.rank;
    if d == r {
        return false;
    }
    let contains_rest = |k: usize| {
        let (o, e) = (ov.off(k), ov.ext(k));
        (d..r).all(|x| o[x] <= lo[x] && o[x] + e[x] >= hi[x])
    };
    if cand.iter().any(|&k| contains_rest(k)) {
        return false;
    }
    let (a, b) = (lo[d], hi[d]);
    let mut cuts = vec![a, b];
    for &k in cand {
        let (o, e) = (ov.off(k)[d], ov.ext(k)[d]);
        cuts.push(o.clamp(a, b));
        cuts.push((o + e).clamp(a, b));
    }
    cuts.sort_unstable();
    cuts.dedup();
    for w in cuts.windows(2) {
        let (s, t) = (w[0], w[1]);
        let sub: Vec<usize> = cand
            .iter()
            .copied()
            .filter(|&k| {
                let (o, e) = (ov.off(k)[d], ov.ext(k)[d]);
                o <= s && o + e >= t
            })
            .collect();
        lo[d] = s;
        hi[d] = t;
        if uncovered_from(ov, d + 1, &sub, lo, hi) {
            return true;
        }
    }
    lo[d] = a;
    hi[d] = b;
    false
}
