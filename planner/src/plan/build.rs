//! The planner's working state and the per-copy work: tensor facts, checks (disjoint offers,
//! dim-0 tiling, coverage), and each copy planned as exact reads or a full pull.

use super::*;

/// Sentinel for "tensor not seen yet" in [`Planner::slot_of`].
pub(super) const UNSEEN: u32 = u32::MAX;

/// Per-tensor facts computed once, on first use.
pub(super) struct TensorState {
    /// Index into `MergedTable::tensors`.
    pub(super) table_index: usize,
    /// Whether the offers tile dimension 0 (full pull possible).
    pub(super) tiles_dim0: bool,
    /// Staging buffer of this tensor, once a copy of it is full-pulled.
    pub(super) staging: Option<u32>,
}

/// A staging buffer under construction: which offers it must hold.
pub(super) struct StagingAcc {
    /// Index into [`Planner::states`] (= plan tensor index).
    pub(super) state: u32,
    /// Offer indices intersecting some full-pulled copy (may repeat; deduplicated at the end).
    pub(super) offers: Vec<usize>,
    /// True for a dim-0 full pull (a row range of the tensor); false for one whole offer.
    pub(super) rows: bool,
}

/// A re-slice whose source offset depends on the staging buffer's final extent, known only
/// after all copies.
pub(super) struct PendingReslice<'a> {
    pub(super) staging: u32,
    pub(super) param: u32,
    pub(super) tensor: u32,
    /// Box of the tensor to move (the copy box, or a whole offer inside it).
    pub(super) src_box: TensorBox,
    /// Byte offset of that box's first element in the parameter.
    pub(super) dst_offset: u64,
    pub(super) dst_strides: &'a [u64],
}

/// The planner's working state for one call of [`plan`].
pub(super) struct Planner<'a> {
    pub(super) table: &'a MergedTable,
    pub(super) opts: &'a PlanOptions,
    /// `MergedTable` tensor index -> index into `states` (= plan tensor index), or [`UNSEEN`].
    pub(super) slot_of: Vec<u32>,
    pub(super) states: Vec<TensorState>,
    pub(super) tensor_names: Vec<String>,
    pub(super) staging: Vec<StagingAcc>,
    /// (MergedTable tensor index, offer index) -> its whole-offer staging buffer.
    pub(super) offer_staging: rustc_hash::FxHashMap<(usize, usize), u32>,
    pub(super) pending: Vec<PendingReslice<'a>>,
    /// Reads of exact copies, in layout order.
    pub(super) reads: Vec<PlannedRead>,
    pub(super) checks: Vec<DigestCheck>,
    pub(super) exact_descriptors: u64,
    pub(super) written_bytes: u64,
    pub(super) full_pulled_bytes: u64,
    // Scratch buffers reused across copies.
    pub(super) ov: Overlaps,
    pub(super) src_strides: Vec<u64>,
    /// Runs of each overlap of the current copy.
    pub(super) runs: Vec<u64>,
    pub(super) idx: Vec<u64>,
    pub(super) order: Vec<usize>,
}

impl<'a> Planner<'a> {
    pub(super) fn new(table: &'a MergedTable, opts: &'a PlanOptions) -> Self {
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
    pub(super) fn state_of(&mut self, table_index: usize) -> Result<u32> {
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
    pub(super) fn copy(&mut self, pi: u32, param: &ParamSpec, c: &'a WantedCopy) -> Result<()> {
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
    pub(super) fn check_disjoint(&mut self, t: &MergedTensor) -> Result<()> {
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
    pub(super) fn check_tiled(&mut self, t: &MergedTensor) -> Result<()> {
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
    pub(super) fn check_coverage(
        &self,
        param: &ParamSpec,
        c: &WantedCopy,
        copy_elems: u64,
    ) -> Result<()> {
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
    pub(super) fn full_pull(&mut self, slot: u32, pi: u32, c: &'a WantedCopy, bytes: u64) {
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
    pub(super) fn stage_offer(
        &mut self,
        slot: u32,
        pi: u32,
        t: &MergedTensor,
        c: &'a WantedCopy,
        k: usize,
    ) {
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
    pub(super) fn exact_overlap(
        &mut self,
        slot: u32,
        pi: u32,
        t: &MergedTensor,
        c: &WantedCopy,
        k: usize,
    ) {
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
    pub(super) fn overlap_checks(
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
}
