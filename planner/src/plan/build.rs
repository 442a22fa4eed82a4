//! The planner's working state and the per-copy work: tensor facts, checks (disjoint offers,
//! dim-0 tiling, coverage), and each copy planned as exact reads or a full pull.

use super::*;
use reshard_core::RemoteRows;

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
    /// True for a dim-0 full pull (a row range of the tensor); false for one whole offer or
    /// a part of one.
    pub(super) rows: bool,
    /// For a staged part: the rows and columns of the offer's matrix view it holds.
    pub(super) part: Option<PartRect>,
}

/// Rows and columns of an offer's [`MatrixView`]: whole row chunks (every column) or whole
/// column blocks (every row) of it, or the whole offer.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct PartRect {
    pub(super) rows: (u64, u64),
    pub(super) cols: (u64, u64),
}

/// How the bytes of one overlap are read and checked.
enum CheckForm {
    /// Read straight into the parameter and checked there: the whole offer, whole row chunks
    /// or whole column blocks of it (`None`: the publisher sent no digest to check with).
    Direct(Option<PartRect>),
    /// Read through staging: this rectangle of the offer (whole parts around what the copy
    /// wants), checked there and re-sliced.
    Stage(PartRect),
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
    /// Bytes of overlaps read through offer or part staging (what those copies want of it).
    pub(super) staged_wanted_bytes: u64,
    /// (MergedTable tensor index, offer index, rectangle) -> its part staging buffer.
    pub(super) part_staging: rustc_hash::FxHashMap<(usize, usize, PartRect), u32>,
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
            staged_wanted_bytes: 0,
            part_staging: Default::default(),
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

        // Count before materialising: runs are products of extents. A gather is one
        // descriptor however many rows it has.
        let (mut total_runs, mut descriptors) = (0u64, 0u64);
        self.runs.clear();
        for k in 0..self.ov.len() {
            let b = &t.offers[self.ov.offers[k]].tensor_box;
            fill_row_major(&b.extent, &mut self.src_strides);
            let rs = run_shape(self.ov.ext(k), &self.src_strides, &c.dst_strides);
            self.runs.push(rs.runs);
            total_runs = total_runs.saturating_add(rs.runs);
            let one = self.opts.gathers(&rs, &c.dst_strides, elem);
            descriptors = descriptors.saturating_add(if one { 1 } else { rs.runs });
        }
        self.exact_descriptors = self.exact_descriptors.saturating_add(total_runs);

        let too_many = descriptors > self.opts.full_pull_threshold;
        if too_many && self.states[slot as usize].tiles_dim0 {
            self.full_pull(slot, pi, c, copy_elems * elem);
        } else {
            for k in 0..self.ov.len() {
                // An offer that lies wholly inside the copy but lands as many runs (a column
                // block of a row-parallel tensor from a TP>1 publisher): one read of the whole
                // offer into staging and a local re-slice, at no extra wire bytes.
                let offer = &t.offers[self.ov.offers[k]];
                if too_many && self.runs[k] > 1 && self.ov.ext(k) == offer.tensor_box.extent {
                    self.stage_offer(slot, pi, t, c, k);
                    continue;
                }
                match self.check_form(offer, c, k) {
                    CheckForm::Direct(rect) => self.exact_overlap(slot, pi, t, c, k, rect),
                    CheckForm::Stage(rect) => self.stage_part(slot, pi, t, c, k, rect),
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
                    part: None,
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

    /// Records overlap `k` as one read of its whole offer into the offer's own staging buffer
    /// (shared by every copy that stages it) plus a re-slice of the overlap into the parameter.
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
                part: None,
            });
        }
        self.reslice_overlap(staging, slot, pi, t, c, k);
    }

    /// Records overlap `k` as a read of `rect` of its offer (whole row chunks or column blocks
    /// around the overlap) into staging, where the parts are checked, plus a re-slice of the
    /// overlap into the parameter. A rectangle that is the whole offer stages the offer.
    pub(super) fn stage_part(
        &mut self,
        slot: u32,
        pi: u32,
        t: &MergedTensor,
        c: &'a WantedCopy,
        k: usize,
        rect: PartRect,
    ) {
        let oi = self.ov.offers[k];
        let v = MatrixView::of(&t.offers[oi].tensor_box.extent);
        if rect.rows == (0, v.rows) && rect.cols == (0, v.cols) {
            return self.stage_offer(slot, pi, t, c, k);
        }
        let ti = self.states[slot as usize].table_index;
        let next = self.staging.len() as u32;
        let staging = *self.part_staging.entry((ti, oi, rect)).or_insert(next);
        if staging == next {
            self.staging.push(StagingAcc {
                state: slot,
                offers: vec![oi],
                rows: false,
                part: Some(rect),
            });
        }
        self.reslice_overlap(staging, slot, pi, t, c, k);
    }

    /// The re-slice of overlap `k` from `staging` (which holds a box around it) into the
    /// parameter.
    fn reslice_overlap(
        &mut self,
        staging: u32,
        slot: u32,
        pi: u32,
        t: &MergedTensor,
        c: &'a WantedCopy,
        k: usize,
    ) {
        let (o_off, o_ext) = (self.ov.off(k), self.ov.ext(k));
        let elem = t.spec.dtype.size();
        let dst_offset = c.dst_offset
            + elem
                * (0..o_off.len())
                    .map(|d| (o_off[d] - c.src_box.offset[d]) * c.dst_strides[d])
                    .sum::<u64>();
        self.staged_wanted_bytes = self
            .staged_wanted_bytes
            .saturating_add(elem * o_ext.iter().product::<u64>());
        self.pending.push(PendingReslice {
            staging,
            param: pi,
            tensor: slot,
            src_box: TensorBox::new(o_off.to_vec(), o_ext.to_vec()),
            dst_offset,
            dst_strides: &c.dst_strides,
        });
    }

    /// Decides how overlap `k` of copy `c` with `offer` is read and checked (docs/design.md §6:
    /// every byte a receiver installs is covered by a check). Reads land straight in the
    /// parameter when what they bring is the whole offer, whole row chunks (every column) or
    /// whole column blocks (every row) of it, each landing row contiguous; otherwise the
    /// smallest rectangle of whole parts around the overlap is staged and checked there.
    fn check_form(&mut self, offer: &MergedOffer, c: &WantedCopy, k: usize) -> CheckForm {
        let b = &offer.tensor_box;
        let (o_off, o_ext) = (self.ov.off(k), self.ov.ext(k));
        let v = MatrixView::of(&b.extent);
        let rel = |d: usize| (o_off[d] - b.offset[d], o_off[d] - b.offset[d] + o_ext[d]);
        let (rows, cols, inner_full) = match b.rank() {
            0 => ((0, 1), (0, 1), true),
            1 => ((0, 1), rel(0), true),
            _ => (rel(0), rel(1), o_ext[2..] == b.extent[2..]),
        };
        if offer.digest.is_none() && offer.parts.is_none() {
            // Nothing to check against: staging would only cost bytes.
            return CheckForm::Direct(None);
        }
        // Each matrix row of the overlap (dims 1.., or all of a 1-D box) lands contiguously, so
        // it can be hashed where it lands.
        let from = usize::from(b.rank() >= 2);
        let direct = inner_full && lands_contiguous(&o_ext[from..], &c.dst_strides[from..]);
        let all_rows = rows == (0, v.rows);
        let all_cols = cols == (0, v.cols) && inner_full;
        let whole = PartRect {
            rows: (0, v.rows),
            cols: (0, v.cols),
        };
        let Some(p) = &offer.parts else {
            // Only the whole digest: the whole offer where it lands, else through staging.
            return if direct && all_rows && all_cols {
                CheckForm::Direct(Some(whole))
            } else {
                CheckForm::Stage(whole)
            };
        };
        let (cr, bc) = (p.chunk_rows.max(1), p.block_cols.max(1));
        let rows_aligned = rows.0 % cr == 0 && (rows.1 % cr == 0 || rows.1 == v.rows);
        let cols_aligned = cols.0 % bc == 0 && (cols.1 % bc == 0 || cols.1 == v.cols);
        let rect = PartRect { rows, cols };
        if direct && ((all_cols && rows_aligned) || (all_rows && cols_aligned)) {
            return CheckForm::Direct(Some(rect));
        }
        // Whole row chunks around the rows (every column), or whole column blocks around the
        // columns (every row): whichever reads fewer bytes.
        let by_rows = PartRect {
            rows: (rows.0 / cr * cr, (rows.1.div_ceil(cr) * cr).min(v.rows)),
            cols: (0, v.cols),
        };
        let by_cols = PartRect {
            rows: (0, v.rows),
            cols: (cols.0 / bc * bc, (cols.1.div_ceil(bc) * bc).min(v.cols)),
        };
        let area = |r: &PartRect| (r.rows.1 - r.rows.0).saturating_mul(r.cols.1 - r.cols.0);
        CheckForm::Stage(if area(&by_rows) <= area(&by_cols) {
            by_rows
        } else {
            by_cols
        })
    }

    /// Materialises the runs of overlap `k` as reads straight into the parameter, merging runs
    /// that are contiguous on both sides, and adds the digest checks of `rect` (the overlap in
    /// the offer's matrix view, whole parts of it: see [`Planner::check_form`]).
    pub(super) fn exact_overlap(
        &mut self,
        slot: u32,
        pi: u32,
        t: &MergedTensor,
        c: &WantedCopy,
        k: usize,
        rect: Option<PartRect>,
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
        let gather = self.opts.gathers(&rs, ds, elem);
        if gather {
            // Every dim-0 row's block, landing one after another: one gather read.
            self.reads.push(PlannedRead {
                owner: offer.owner,
                src_region: offer.location.region,
                src_offset: offer.location.offset + elem * s,
                len: rs.runs * run_len,
                dst: Dest::Param(pi),
                dst_offset: c.dst_offset + elem * t_pos,
                tensor: slot,
                src_rows: Some(RemoteRows {
                    row_bytes: run_len,
                    pitch: elem * ss[0],
                }),
            });
        }
        // Otherwise each run is a read, merged with the last when contiguous on both sides.
        if !gather {
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
                        src_rows: None,
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
        }
        if let Some(rect) = rect {
            let dst0 = c.dst_offset
                + elem
                    * (0..rank)
                        .map(|d| (o_off[d] - c.src_box.offset[d]) * ds[d])
                        .sum::<u64>();
            // Matrix rows are dim-0 rows (a 1-D or scalar offer is one row).
            let row_stride = if rank >= 2 {
                elem * ds[0]
            } else {
                elem * o_ext.iter().product::<u64>()
            };
            rect_checks(
                &mut self.checks,
                offer,
                slot,
                elem,
                rect,
                (Dest::Param(pi), dst0, row_stride),
            );
        }
    }
}

/// Adds the digest checks of `rect` of offer `o` (the whole offer, whole row chunks with every
/// column, or whole column blocks with every row), which lands at `dst` = (buffer, byte offset
/// of its first byte, bytes from one matrix row to the next), each row contiguous. The whole
/// digest covers a whole offer; row chunks or column blocks cover the rest, or a whole offer
/// whose publisher sent no whole digest. Nothing is added without digests.
pub(super) fn rect_checks(
    checks: &mut Vec<DigestCheck>,
    o: &MergedOffer,
    tensor: u32,
    elem: u64,
    rect: PartRect,
    dst: (Dest, u64, u64),
) {
    let (dst, dst_offset, row_stride) = dst;
    let v = MatrixView::of(&o.tensor_box.extent);
    let cell = v.inner * elem;
    let grid = o.parts.as_deref().map_or_else(
        || v.grid(elem),
        |p| (p.chunk_rows.max(1), p.block_cols.max(1)),
    );
    let (cr, bc) = grid;
    // `check_grid` keeps a validated table's block inside its row, so this never saturates;
    // were it to, each row would be one segment and its check would fail, never install.
    let seg_bytes = bc.saturating_mul(cell);
    let check = |part, first_row: u64, rows: u64, first_col: u64, cols: u64| DigestCheck {
        tensor,
        owner: o.owner,
        src_region: o.location.region,
        src_offset: o.location.offset,
        part,
        dst,
        dst_offset: dst_offset
            + (first_row - rect.rows.0) * row_stride
            + (first_col - rect.cols.0) * cell,
        rows,
        row_bytes: cols * cell,
        row_stride,
        seg_bytes,
    };
    let whole = rect.rows == (0, v.rows) && rect.cols == (0, v.cols);
    if whole && o.digest.is_some() {
        checks.push(check(CheckedPart::Whole, 0, v.rows, 0, v.cols));
        return;
    }
    if o.parts.is_none() {
        return;
    }
    if rect.cols == (0, v.cols) {
        for k in rect.rows.0 / cr..rect.rows.1.div_ceil(cr) {
            let (a, z) = (k * cr, ((k + 1) * cr).min(v.rows));
            checks.push(check(CheckedPart::Chunk(k as u32), a, z - a, 0, v.cols));
        }
    } else {
        for j in rect.cols.0 / bc..rect.cols.1.div_ceil(bc) {
            let (a, z) = (j * bc, ((j + 1) * bc).min(v.cols));
            checks.push(check(CheckedPart::Block(j as u32), 0, v.rows, a, z - a));
        }
    }
}

/// True when the runs of an overlap of shape `rs` are the blocks of its dim-0 rows (one outer
/// dim, several runs) and land one right after another at destination element strides
/// `dst_strides`: one gather read ([`RemoteRows`]) moves them all. The source rows lie at the
/// offer's dim-0 stride, at least a block apart since offers are row-major.
pub(super) fn gathers(rs: &RunShape, dst_strides: &[u64]) -> bool {
    rs.outer == 1 && rs.runs > 1 && dst_strides.first() == Some(&rs.block)
}

/// True when a box of extent `ext` lands contiguously at destination element strides `strides`
/// (dims of extent 1 take any stride). Its source side is a contiguous part of a row-major
/// offer whenever [`Planner::check_form`] asks.
fn lands_contiguous(ext: &[u64], strides: &[u64]) -> bool {
    let mut next = 1u64;
    for (&e, &s) in ext.iter().zip(strides).rev() {
        if e > 1 && s != next {
            return false;
        }
        next = next.saturating_mul(e);
    }
    true
}
