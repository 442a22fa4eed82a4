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

use reshard_core::layout::{contiguous_runs, row_major_strides, ContiguousRuns};
use reshard_core::{
    Dest, DigestCheck, Error, ErrorDetail, ErrorKind, MergedOffer, MergedTable, MergedTensor,
    OwnerId, ParamSpec, Plan, PlanParam, PlanStats, PlannedRead, Reslice, Result, StagingBuffer,
    TensorBox, WantedCopy, WantedLayout,
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
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            full_pull_threshold: 64,
            allow_overlap: false,
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

/// Sentinel for "tensor not seen yet" in [`Planner::slot_of`].
const UNSEEN: u32 = u32::MAX;

/// Per-tensor facts computed once, on first use.
struct TensorState {
    /// Index into `MergedTable::tensors`.
    table_index: usize,
    /// Whether the offers tile dimension 0 (full pull possible).
    tiles_dim0: bool,
    /// Staging buffer of this tensor, once a copy of it is full-pulled.
    staging: Option<u32>,
}

/// A staging buffer under construction: which offers it must hold.
struct StagingAcc {
    /// Index into [`Planner::states`] (= plan tensor index).
    state: u32,
    /// Offer indices intersecting some full-pulled copy (may repeat; deduplicated at the end).
    offers: Vec<usize>,
    /// True for a dim-0 full pull (a row range of the tensor); false for one whole offer.
    rows: bool,
}

/// A re-slice whose source offset depends on the staging buffer's final extent, known only
/// after all copies.
struct PendingReslice<'a> {
    staging: u32,
    param: u32,
    tensor: u32,
    /// Box of the tensor to move (the copy box, or a whole offer inside it).
    src_box: TensorBox,
    /// Byte offset of that box's first element in the parameter.
    dst_offset: u64,
    dst_strides: &'a [u64],
}

/// Intersections of one copy with the offers of its tensor, stored flat to avoid an allocation
/// per overlap: overlap k's offsets are `coords[2rk..2rk+r]`, its extents the next `r`.
#[derive(Default)]
struct Overlaps {
    rank: usize,
    offers: Vec<usize>,
    coords: Vec<u64>,
}

impl Overlaps {
    fn reset(&mut self, rank: usize) {
        self.rank = rank;
        self.offers.clear();
        self.coords.clear();
    }

    fn len(&self) -> usize {
        self.offers.len()
    }

    /// Records `a ∩ b` (for offer `offer`) when it is non-empty.
    fn push_intersection(&mut self, offer: usize, a: &TensorBox, b: &TensorBox) {
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

    fn off(&self, k: usize) -> &[u64] {
        let s = 2 * self.rank * k;
        &self.coords[s..s + self.rank]
    }

    fn ext(&self, k: usize) -> &[u64] {
        let s = 2 * self.rank * k + self.rank;
        &self.coords[s..s + self.rank]
    }

    /// True when overlaps `i` and `j` share at least one element.
    fn intersect(&self, i: usize, j: usize) -> bool {
        let (oi, ei, oj, ej) = (self.off(i), self.ext(i), self.off(j), self.ext(j));
        (0..self.rank).all(|d| oi[d].max(oj[d]) < (oi[d] + ei[d]).min(oj[d] + ej[d]))
    }
}

/// How the runs of one overlap look: the trailing dims collapse into one contiguous block.
struct RunShape {
    /// Number of leading dims that are not collapsed (runs are enumerated over them).
    outer: usize,
    /// Number of runs (product of the outer extents).
    runs: u64,
    /// Elements per run.
    block: u64,
}

/// The runs of an overlap contiguous in both the offer (source) and the parameter
/// ([`contiguous_runs`]; the offer side is row-major, so its innermost stride is 1).
fn run_shape(ext: &[u64], src_strides: &[u64], dst_strides: &[u64]) -> RunShape {
    let ContiguousRuns { outer, block } = contiguous_runs(ext, src_strides, dst_strides);
    RunShape {
        outer,
        runs: ext[..outer].iter().product(),
        block,
    }
}

/// Fills `out` with the row-major element strides of `shape`.
fn fill_row_major(shape: &[u64], out: &mut Vec<u64>) {
    out.clear();
    out.resize(shape.len(), 1);
    for d in (0..shape.len().saturating_sub(1)).rev() {
        out[d] = out[d + 1] * shape[d + 1];
    }
}

/// Whether the offers tile dimension 0: each spans the whole tensor in dims 1.., and sorted by
/// dim-0 offset they cover `[0, shape[0])` with no gap and no overlap.
fn tiles_dim0(t: &MergedTensor) -> bool {
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
fn find_uncovered(ov: &Overlaps, lo: &[u64], hi: &[u64]) -> Option<TensorBox> {
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
fn uncovered_from(ov: &Overlaps, d: usize, cand: &[usize], lo: &mut [u64], hi: &mut [u64]) -> bool {
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

/// The planner's working state for one call of [`plan`].
struct Planner<'a> {
    table: &'a MergedTable,
    opts: &'a PlanOptions,
    /// `MergedTable` tensor index -> index into `states` (= plan tensor index), or [`UNSEEN`].
    slot_of: Vec<u32>,
    states: Vec<TensorState>,
    tensor_names: Vec<String>,
    staging: Vec<StagingAcc>,
    /// (MergedTable tensor index, offer index) -> its whole-offer staging buffer.
    offer_staging: rustc_hash::FxHashMap<(usize, usize), u32>,
    pending: Vec<PendingReslice<'a>>,
    /// Reads of exact copies, in layout order.
    reads: Vec<PlannedRead>,
    checks: Vec<DigestCheck>,
    exact_descriptors: u64,
    written_bytes: u64,
    full_pulled_bytes: u64,
    // Scratch buffers reused across copies.
    ov: Overlaps,
    src_strides: Vec<u64>,
    /// Runs of each overlap of the current copy.
    runs: Vec<u64>,
    idx: Vec<u64>,
    order: Vec<usize>,
}

impl<'a> Planner<'a> {
    fn new(table: &'a MergedTable, opts: &'a PlanOptions) -> Self {
        Planner {
            table,
            opts,
            slot_of: vec![UNSEEN; table.tensors.len()],
            states: Vec::new(),
            tensor_names: Vec::new(),
            staging: Vec::new(),
            offer_staging: Default::default(),
            pending: Vec::new(),
            reads: Vec::new(),
            checks: Vec::new(),
            exact_descriptors: 0,
            written_bytes: 0,
            full_pulled_bytes: 0,
            ov: Overlaps::default(),
            src_strides: Vec::new(),
            runs: Vec::new(),
            idx: Vec::new(),
            order: Vec::new(),
        }
    }

    /// The plan tensor index of a table tensor, validating its offers on first use (the table's
    /// fields are public, so a hand-built one must not make the planner index out of bounds).
    fn state_of(&mut self, table_index: usize) -> Result<u32> {
        let slot = self.slot_of[table_index];
        if slot != UNSEEN {
            return Ok(slot);
        }
        let t = &self.table.tensors[table_index];
        t.spec.validate()?;
        let elem = t.spec.dtype.size();
        for o in &t.offers {
            o.tensor_box
                .validate_in(&t.spec)
                .map_err(|e| e.with_owner(o.owner))?;
            let bytes = o.tensor_box.elements() * elem;
            if o.location.offset.checked_add(bytes).is_none() {
                return Err(Error::new(
                    ErrorKind::InvalidTable,
                    format!("offer of box {} overflows u64 bytes", o.tensor_box),
                )
                .with_tensor(&t.spec.name)
                .with_owner(o.owner));
            }
        }
        self.check_tiled(t)?;
        let slot = u32::try_from(self.states.len())
            .ok()
            .filter(|&s| s != UNSEEN)
            .ok_or_else(|| Error::new(ErrorKind::Layout, "more than u32::MAX - 1 tensors"))?;
        self.states.push(TensorState {
            table_index,
            tiles_dim0: tiles_dim0(t),
            staging: None,
        });
        self.tensor_names.push(t.spec.name.clone());
        self.slot_of[table_index] = slot;
        Ok(slot)
    }

    /// Plans one copy: either exact reads now, or a full pull finished in [`Planner::finish`].
    fn copy(&mut self, pi: u32, param: &ParamSpec, c: &'a WantedCopy) -> Result<()> {
        let table = self.table;
        let Some(ti) = table.position(&c.tensor) else {
            return Err(missing_coverage(
                c,
                c.src_box.clone(),
                format!(
                    "parameter {} wants box {} of a tensor no publisher offers",
                    param.name, c.src_box
                ),
            ));
        };
        let slot = self.state_of(ti)?;
        let t = &table.tensors[ti];
        let spec = &t.spec;
        c.src_box.validate_in(spec).map_err(|e| {
            Error::new(
                ErrorKind::Layout,
                format!("copy into parameter {}: {}", param.name, e.message()),
            )
            .with_tensor(&c.tensor)
        })?;
        if spec.dtype != param.dtype {
            return Err(Error::new(
                ErrorKind::Layout,
                format!(
                    "tensor dtype {} does not match parameter {} dtype {} (no conversions)",
                    spec.dtype, param.name, param.dtype
                ),
            )
            .with_tensor(&c.tensor));
        }
        let elem = spec.dtype.size();
        let rank = spec.shape.len();
        let copy_elems = c.src_box.elements();
        // Statistics sum over copies: valid boxes each fit u64 bytes, their sum need not.
        self.written_bytes = self.written_bytes.saturating_add(copy_elems * elem);

        self.ov.reset(rank);
        for (k, o) in t.offers.iter().enumerate() {
            self.ov.push_intersection(k, &c.src_box, &o.tensor_box);
        }
        if !self.opts.allow_overlap {
            self.check_disjoint(t)?;
        }
        self.check_coverage(param, c, copy_elems)?;

        // Count before materialising: runs are products of extents.
        let mut total_runs = 0u64;
        self.runs.clear();
        for k in 0..self.ov.len() {
            let b = &t.offers[self.ov.offers[k]].tensor_box;
            fill_row_major(&b.extent, &mut self.src_strides);
            let rs = run_shape(self.ov.ext(k), &self.src_strides, &c.dst_strides);
            self.runs.push(rs.runs);
            total_runs = total_runs.saturating_add(rs.runs);
        }
        self.exact_descriptors = self.exact_descriptors.saturating_add(total_runs);

        let too_many = total_runs > self.opts.full_pull_threshold;
        if too_many && self.states[slot as usize].tiles_dim0 {
            self.full_pull(slot, pi, c, copy_elems * elem);
        } else {
            for k in 0..self.ov.len() {
                // An offer that lies wholly inside the copy but lands as many runs (a column
                // block of a row-parallel tensor from a TP>1 publisher): one read of the whole
                // offer into staging and a local re-slice, at no extra wire bytes.
                if too_many
                    && self.runs[k] > 1
                    && self.ov.ext(k) == t.offers[self.ov.offers[k]].tensor_box.extent
                {
                    self.stage_offer(slot, pi, t, c, k);
                } else {
                    self.exact_overlap(slot, pi, t, c, k);
                }
            }
        }
        Ok(())
    }

    /// Fails when two overlaps of one copy share elements: reading both would write those bytes
    /// twice (docs/design.md §3: never a silent double read). Sweeps over dim 0 so disjoint row
    /// blocks cost O(n log n).
    fn check_disjoint(&mut self, t: &MergedTensor) -> Result<()> {
        let n = self.ov.len();
        if n < 2 {
            return Ok(());
        }
        self.order.clear();
        self.order.extend(0..n);
        let ov = &self.ov;
        self.order.sort_by_key(|&k| (ov.off(k)[0], k));
        let mut active: Vec<usize> = Vec::new();
        for &k in &self.order {
            let start = ov.off(k)[0];
            active.retain(|&j| ov.off(j)[0] + ov.ext(j)[0] > start);
            if let Some(&j) = active.iter().find(|&&j| ov.intersect(j, k)) {
                let (a, b) = (&t.offers[ov.offers[j]], &t.offers[ov.offers[k]]);
                return Err(Error::new(
                    ErrorKind::OverlappingOffers,
                    format!(
                        "offers {} (owner {}) and {} (owner {}) overlap inside a wanted box; \
                         dedup only collapses identical boxes",
                        a.tensor_box, a.owner, b.tensor_box, b.owner
                    ),
                )
                .with_tensor(&t.spec.name)
                .with_owner(a.owner));
            }
            active.push(k);
        }
        Ok(())
    }

    /// Fails with `MissingCoverage` naming an unoffered sub-box when the offers of a tensor the
    /// receiver reads do not cover the whole tensor. Publishers jointly hold every byte of the
    /// model, so a hole means a missing publisher or a garbled box. Checking only the wanted
    /// part is not enough: a box whose extent was garbled can still cover the rows and columns
    /// a receiver wants while describing its memory with the wrong strides, and a sub-box read
    /// of it matches no digest, so the wrong bytes would install unverified.
    fn check_tiled(&mut self, t: &MergedTensor) -> Result<()> {
        let whole = TensorBox::new(vec![0; t.spec.shape.len()], t.spec.shape.clone());
        self.ov.reset(whole.rank());
        for (k, o) in t.offers.iter().enumerate() {
            self.ov.push_intersection(k, &whole, &o.tensor_box);
        }
        // No volume shortcut: offers may overlap outside every wanted box (not an error), so
        // a volume sum can hide a hole.
        match find_uncovered(&self.ov, &whole.offset, &t.spec.shape) {
            None => Ok(()),
            Some(missing) => Err(Error::new(
                ErrorKind::MissingCoverage,
                format!(
                    "box {missing} of tensor {} (shape {:?}) is offered by no publisher: the \
                     offers must tile every tensor a receiver reads (a missing publisher or a \
                     garbled box)",
                    t.spec.name, t.spec.shape
                ),
            )
            .with_tensor(&t.spec.name)
            .with_detail(ErrorDetail::MissingCoverage {
                tensor: t.spec.name.clone(),
                missing,
            })),
        }
    }

    /// Fails with `MissingCoverage` naming an unoffered sub-box when the overlaps do not cover
    /// the copy. With disjoint overlaps a volume sum decides, so the search runs only on error.
    fn check_coverage(&self, param: &ParamSpec, c: &WantedCopy, copy_elems: u64) -> Result<()> {
        let ov = &self.ov;
        if !self.opts.allow_overlap {
            let covered = (0..ov.len()).fold(0u64, |a, k| {
                a.saturating_add(ov.ext(k).iter().product::<u64>())
            });
            if covered == copy_elems {
                return Ok(());
            }
        }
        let hi: Vec<u64> = (0..c.src_box.rank()).map(|d| c.src_box.end(d)).collect();
        match find_uncovered(ov, &c.src_box.offset, &hi) {
            None => Ok(()),
            Some(missing) => Err(missing_coverage(
                c,
                missing.clone(),
                format!(
                    "parameter {} wants box {}, but box {missing} is not offered by any publisher",
                    param.name, c.src_box
                ),
            )),
        }
    }

    /// Records a full-pulled copy: its tensor gets (or reuses) one staging buffer that must hold
    /// every offer the copy intersects.
    fn full_pull(&mut self, slot: u32, pi: u32, c: &'a WantedCopy, bytes: u64) {
        let staging = match self.states[slot as usize].staging {
            Some(s) => s,
            None => {
                let s = self.staging.len() as u32;
                self.staging.push(StagingAcc {
                    state: slot,
                    offers: Vec::new(),
                    rows: true,
                });
                self.states[slot as usize].staging = Some(s);
                s
            }
        };
        self.staging[staging as usize]
            .offers
            .extend_from_slice(&self.ov.offers);
        self.full_pulled_bytes = self.full_pulled_bytes.saturating_add(bytes);
        self.pending.push(PendingReslice {
            staging,
            param: pi,
            tensor: slot,
            src_box: c.src_box.clone(),
            dst_offset: c.dst_offset,
            dst_strides: &c.dst_strides,
        });
    }

    /// Records overlap `k`, a whole offer inside the copy, as one read of the offer into its own
    /// staging buffer (shared by every copy that stages it) plus a re-slice into the parameter.
    fn stage_offer(&mut self, slot: u32, pi: u32, t: &MergedTensor, c: &'a WantedCopy, k: usize) {
        let oi = self.ov.offers[k];
        let ti = self.states[slot as usize].table_index;
        let next = self.staging.len() as u32;
        let staging = *self.offer_staging.entry((ti, oi)).or_insert(next);
        if staging == next {
            self.staging.push(StagingAcc {
                state: slot,
                offers: vec![oi],
                rows: false,
            });
        }
        let b = &t.offers[oi].tensor_box;
        let elem = t.spec.dtype.size();
        let dst_offset = c.dst_offset
            + elem
                * (0..b.rank())
                    .map(|d| (b.offset[d] - c.src_box.offset[d]) * c.dst_strides[d])
                    .sum::<u64>();
        self.pending.push(PendingReslice {
            staging,
            param: pi,
            tensor: slot,
            src_box: b.clone(),
            dst_offset,
            dst_strides: &c.dst_strides,
        });
    }

    /// Materialises the runs of overlap `k` as reads straight into the parameter, merging runs
    /// that are contiguous on both sides, and adds a digest check when the whole offer lands
    /// contiguously.
    fn exact_overlap(&mut self, slot: u32, pi: u32, t: &MergedTensor, c: &WantedCopy, k: usize) {
        let offer = &t.offers[self.ov.offers[k]];
        let b = &offer.tensor_box;
        let elem = t.spec.dtype.size();
        fill_row_major(&b.extent, &mut self.src_strides);
        let (o_off, o_ext) = (self.ov.off(k), self.ov.ext(k));
        let ss = &self.src_strides;
        let ds = &c.dst_strides;
        let rs = run_shape(o_ext, ss, ds);
        let rank = o_ext.len();
        let mut s: u64 = (0..rank).map(|d| (o_off[d] - b.offset[d]) * ss[d]).sum();
        let mut t_pos: u64 = (0..rank)
            .map(|d| (o_off[d] - c.src_box.offset[d]) * ds[d])
            .sum();
        let run_len = rs.block * elem;
        self.idx.clear();
        self.idx.resize(rs.outer, 0);
        let first = self.reads.len();
        loop {
            let src = offer.location.offset + elem * s;
            let dst = c.dst_offset + elem * t_pos;
            let merged = self.reads.len() > first
                && self.reads.last_mut().is_some_and(|last| {
                    let contiguous =
                        last.src_offset + last.len == src && last.dst_offset + last.len == dst;
                    if contiguous {
                        last.len += run_len;
                    }
                    contiguous
                });
            if !merged {
                self.reads.push(PlannedRead {
                    owner: offer.owner,
                    src_region: offer.location.region,
                    src_offset: src,
                    len: run_len,
                    dst: Dest::Param(pi),
                    dst_offset: dst,
                    tensor: slot,
                });
            }
            // Odometer over the outer dims, innermost fastest (row-major run order).
            let mut d = rs.outer;
            let more = loop {
                if d == 0 {
                    break false;
                }
                d -= 1;
                self.idx[d] += 1;
                s += ss[d];
                t_pos += ds[d];
                if self.idx[d] < o_ext[d] {
                    break true;
                }
                s -= o_ext[d] * ss[d];
                t_pos -= o_ext[d] * ds[d];
                self.idx[d] = 0;
            };
            if !more {
                break;
            }
        }
        self.overlap_checks(slot, pi, offer, c, k, elem, rs.outer);
    }

    /// Digest checks for overlap `k`: the whole offer when all of it is read, else every dim-0
    /// chunk (when the publisher sent chunk digests) whose rows are all read. Only overlaps made
    /// of whole offer rows landing at one destination stride per row can be gathered for hashing.
    #[allow(clippy::too_many_arguments)]
    fn overlap_checks(
        &mut self,
        slot: u32,
        pi: u32,
        offer: &MergedOffer,
        c: &WantedCopy,
        k: usize,
        elem: u64,
        outer: usize,
    ) {
        let b = &offer.tensor_box;
        let (o_off, o_ext) = (self.ov.off(k), self.ov.ext(k));
        if outer > 1 || o_ext[1..] != b.extent[1..] {
            return;
        }
        let ds = &c.dst_strides;
        let row_bytes = elem * o_ext[1..].iter().product::<u64>();
        let row_stride = elem * ds[0];
        let dst0 = c.dst_offset
            + elem
                * (0..o_ext.len())
                    .map(|d| (o_off[d] - c.src_box.offset[d]) * ds[d])
                    .sum::<u64>();
        let (r0, r1) = (o_off[0] - b.offset[0], o_off[0] - b.offset[0] + o_ext[0]);
        let check = |chunk: Option<u32>, first_row: u64, rows: u64| DigestCheck {
            tensor: slot,
            owner: offer.owner,
            src_region: offer.location.region,
            src_offset: offer.location.offset,
            chunk,
            dst: Dest::Param(pi),
            dst_offset: dst0 + (first_row - r0) * row_stride,
            rows,
            row_bytes,
            row_stride,
        };
        if r0 == 0 && r1 == b.extent[0] {
            self.checks.push(check(None, 0, r1));
            return;
        }
        let Some(chunks) = &offer.chunks else {
            return;
        };
        let per = chunks.rows.max(1);
        let first = r0.div_ceil(per);
        for ci in first..chunks.digests.len() as u64 {
            let (a, z) = (ci * per, ((ci + 1) * per).min(b.extent[0]));
            if z > r1 {
                break;
            }
            self.checks.push(check(Some(ci as u32), a, z - a));
        }
    }

    /// Builds staging buffers, full-pull reads and re-slices, coalesces reads and fills in the
    /// statistics.
    fn finish(mut self, layout: &WantedLayout) -> Plan {
        let table = self.table;
        let mut staging = Vec::with_capacity(self.staging.len());
        let mut pull_reads = Vec::new();
        let mut staging_read_bytes = 0u64;
        let mut staged_offers = 0u64;
        for (si, acc) in self.staging.iter_mut().enumerate() {
            let si = si as u32;
            let state = &self.states[acc.state as usize];
            let t = &table.tensors[state.table_index];
            let elem = t.spec.dtype.size();
            if !acc.rows {
                // One whole offer, row-major over its own box.
                let o = &t.offers[acc.offers[0]];
                let len = o.tensor_box.elements() * elem;
                staged_offers += 1;
                pull_reads.push(PlannedRead {
                    owner: o.owner,
                    src_region: o.location.region,
                    src_offset: o.location.offset,
                    len,
                    dst: Dest::Staging(si),
                    dst_offset: 0,
                    tensor: acc.state,
                });
                self.checks.push(DigestCheck {
                    tensor: acc.state,
                    owner: o.owner,
                    src_region: o.location.region,
                    src_offset: o.location.offset,
                    chunk: None,
                    dst: Dest::Staging(si),
                    dst_offset: 0,
                    rows: 1,
                    row_bytes: len,
                    row_stride: len,
                });
                staging.push(StagingBuffer {
                    tensor: acc.state,
                    tensor_box: o.tensor_box.clone(),
                    whole_offer: true,
                    bytes: len,
                });
                continue;
            }
            let row_bytes = t.spec.shape[1..].iter().product::<u64>() * elem;
            // Only offers some full-pulled copy intersects are read: rows of the staging buffer
            // between them are never re-sliced, so pulling them would only add wire bytes.
            acc.offers
                .sort_unstable_by_key(|&k| (t.offers[k].tensor_box.offset[0], k));
            acc.offers.dedup();
            let row_start = acc
                .offers
                .iter()
                .map(|&k| t.offers[k].tensor_box.offset[0])
                .min()
                .unwrap_or(0);
            let row_end = acc
                .offers
                .iter()
                .map(|&k| t.offers[k].tensor_box.end(0))
                .max()
                .unwrap_or(0);
            for &k in &acc.offers {
                let o = &t.offers[k];
                let len = o.tensor_box.elements() * elem;
                let dst_offset = (o.tensor_box.offset[0] - row_start) * row_bytes;
                staging_read_bytes = staging_read_bytes.saturating_add(len);
                pull_reads.push(PlannedRead {
                    owner: o.owner,
                    src_region: o.location.region,
                    src_offset: o.location.offset,
                    len,
                    dst: Dest::Staging(si),
                    dst_offset,
                    tensor: acc.state,
                });
                self.checks.push(DigestCheck {
                    tensor: acc.state,
                    owner: o.owner,
                    src_region: o.location.region,
                    src_offset: o.location.offset,
                    chunk: None,
                    dst: Dest::Staging(si),
                    dst_offset,
                    rows: 1,
                    row_bytes: len,
                    row_stride: len,
                });
            }
            let mut offset = vec![0; t.spec.shape.len()];
            let mut extent = t.spec.shape.clone();
            offset[0] = row_start;
            extent[0] = row_end - row_start;
            staging.push(StagingBuffer {
                tensor: acc.state,
                tensor_box: TensorBox::new(offset, extent),
                whole_offer: false,
                bytes: (row_end - row_start) * row_bytes,
            });
        }

        let mut reslices = Vec::with_capacity(self.pending.len());
        for pr in &self.pending {
            // Staging holds its box row-major.
            let sb = &staging[pr.staging as usize].tensor_box;
            let t = &table.tensors[self.states[pr.tensor as usize].table_index];
            let elem = t.spec.dtype.size();
            let strides = row_major_strides(&sb.extent);
            let within: u64 = (0..strides.len())
                .map(|d| (pr.src_box.offset[d] - sb.offset[d]) * strides[d])
                .sum();
            reslices.push(Reslice {
                staging: pr.staging,
                src_offset: elem * within,
                src_strides: strides,
                extent: pr.src_box.extent.clone(),
                elem,
                param: pr.param,
                dst_offset: pr.dst_offset,
                dst_strides: pr.dst_strides.to_vec(),
                tensor: pr.tensor,
            });
        }

        let mut reads = std::mem::take(&mut self.reads);
        reads.extend(pull_reads);
        let read_count = reads.len() as u64;
        let wire_bytes = reads.iter().fold(0u64, |a, r| a.saturating_add(r.len));
        let mut owners: Vec<OwnerId> = reads.iter().map(|r| r.owner).collect();
        owners.sort_unstable();
        owners.dedup();
        let reads = coalesce(reads);
        let checked_bytes = self
            .checks
            .iter()
            .fold(0u64, |a, c| a.saturating_add(c.bytes()));

        let stats = PlanStats {
            copies: layout.copies() as u64,
            reads: read_count,
            coalesced_reads: reads.len() as u64,
            wire_bytes,
            exact_descriptors: self.exact_descriptors,
            descriptors_saved: self.exact_descriptors.saturating_sub(read_count),
            extra_wire_bytes: staging_read_bytes.saturating_sub(self.full_pulled_bytes),
            full_pull_sources: staging.len() as u64 - staged_offers,
            staged_offers,
            owners: owners.len() as u64,
            written_bytes: self.written_bytes,
            param_bytes: layout.bytes(),
            checked_bytes,
        };
        let mut plan = Plan {
            tensors: self.tensor_names,
            params: layout
                .params
                .iter()
                .map(|p| PlanParam {
                    name: p.name.clone(),
                    bytes: p.bytes(),
                })
                .collect(),
            staging,
            reads,
            reslice_disjoint: reslices_disjoint(&reslices),
            reslices,
            checks: self.checks,
            stats,
            fingerprint: 0,
        };
        plan.fingerprint = plan.compute_fingerprint();
        plan
    }
}

/// Orders reads by (owner, region, source offset, destination buffer) and merges neighbours
/// that are contiguous in both source and destination: what actually goes on the wire.
/// The sort is stable, so equal keys keep plan order and the result is deterministic.
fn coalesce(mut reads: Vec<PlannedRead>) -> Vec<PlannedRead> {
    reads.sort_by_key(|r| (r.owner, r.src_region, r.src_offset, r.dst));
    let mut out: Vec<PlannedRead> = Vec::with_capacity(reads.len());
    for r in reads {
        if let Some(last) = out.last_mut() {
            if last.owner == r.owner
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
fn reslices_disjoint(reslices: &[Reslice]) -> bool {
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
