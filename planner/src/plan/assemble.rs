//! Assembling the plan once every copy is planned: staging buffers, full-pull reads,
//! re-slices, coalescing and statistics.

use super::*;
use reshard_core::RemoteRows;

impl<'a> Planner<'a> {
    /// Builds staging buffers, full-pull reads and re-slices, coalesces reads and fills in the
    /// statistics.
    pub(super) fn finish(mut self, layout: &WantedLayout) -> Plan {
        let table = self.table;
        let mut staging = Vec::with_capacity(self.staging.len());
        let mut pull_reads = Vec::new();
        let mut staging_read_bytes = 0u64;
        let mut staged_read_bytes = 0u64;
        let mut staged_offers = 0u64;
        let mut staged_parts = 0u64;
        for (si, acc) in self.staging.iter_mut().enumerate() {
            let si = si as u32;
            let state = &self.states[acc.state as usize];
            let t = &table.tensors[state.table_index];
            let elem = t.spec.dtype.size();
            if let Some(rect) = acc.part {
                let o = &t.offers[acc.offers[0]];
                let buffer = pull_part(
                    &mut pull_reads,
                    &mut self.checks,
                    o,
                    elem,
                    (acc.state, si),
                    rect,
                    self.opts
                        .gather_reads
                        .then_some(self.opts.gather_min_row_bytes),
                );
                staged_parts += 1;
                staged_read_bytes = staged_read_bytes.saturating_add(buffer.bytes);
                staging.push(buffer);
                continue;
            }
            if !acc.rows {
                // One whole offer, row-major over its own box.
                let o = &t.offers[acc.offers[0]];
                let len = o.tensor_box.elements() * elem;
                staged_offers += 1;
                staged_read_bytes = staged_read_bytes.saturating_add(len);
                pull_whole_offer(&mut pull_reads, &mut self.checks, o, elem, acc.state, si, 0);
                staging.push(StagingBuffer {
                    tensor: acc.state,
                    tensor_box: o.tensor_box.clone(),
                    kind: StagingKind::Offer,
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
                pull_whole_offer(
                    &mut pull_reads,
                    &mut self.checks,
                    o,
                    elem,
                    acc.state,
                    si,
                    dst_offset,
                );
            }
            let mut offset = vec![0; t.spec.shape.len()];
            let mut extent = t.spec.shape.clone();
            offset[0] = row_start;
            extent[0] = row_end - row_start;
            staging.push(StagingBuffer {
                tensor: acc.state,
                tensor_box: TensorBox::new(offset, extent),
                kind: StagingKind::FullPull,
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
            extra_wire_bytes: staging_read_bytes
                .saturating_sub(self.full_pulled_bytes)
                .saturating_add(staged_read_bytes.saturating_sub(self.staged_wanted_bytes)),
            full_pull_sources: staging.len() as u64 - staged_offers - staged_parts,
            staged_offers,
            staged_parts,
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

/// Reads one whole offer into staging buffer `si` at `dst_offset`, and checks it there: a
/// staged offer lands contiguously, row after row.
fn pull_whole_offer(
    reads: &mut Vec<PlannedRead>,
    checks: &mut Vec<DigestCheck>,
    o: &MergedOffer,
    elem: u64,
    tensor: u32,
    si: u32,
    dst_offset: u64,
) {
    let v = MatrixView::of(&o.tensor_box.extent);
    let row_bytes = v.cols * v.inner * elem;
    reads.push(PlannedRead {
        owner: o.owner,
        src_region: o.location.region,
        src_offset: o.location.offset,
        len: v.rows * row_bytes,
        dst: Dest::Staging(si),
        dst_offset,
        tensor,
        src_rows: None,
    });
    let whole = PartRect {
        rows: (0, v.rows),
        cols: (0, v.cols),
    };
    rect_checks(
        checks,
        o,
        tensor,
        elem,
        whole,
        (Dest::Staging(si), dst_offset, row_bytes),
    );
}

/// Reads `rect` of offer `o` (whole row chunks with every column, or whole column blocks with
/// every row) into staging buffer `si` for tensor `tensor`, row-major, and checks its parts
/// there; returns the buffer. Column blocks are one gather read when `gather` is the shortest
/// row to gather and theirs are no shorter, else a read per row.
fn pull_part(
    reads: &mut Vec<PlannedRead>,
    checks: &mut Vec<DigestCheck>,
    o: &MergedOffer,
    elem: u64,
    (tensor, si): (u32, u32),
    rect: PartRect,
    gather: Option<u64>,
) -> StagingBuffer {
    let b = &o.tensor_box;
    let v = MatrixView::of(&b.extent);
    let cell = v.inner * elem;
    let row_bytes = v.cols * cell;
    let (rows, cols) = (rect.rows.1 - rect.rows.0, rect.cols.1 - rect.cols.0);
    let width = cols * cell;
    let read = |src: u64, len: u64, dst_offset: u64| PlannedRead {
        owner: o.owner,
        src_region: o.location.region,
        src_offset: o.location.offset + src,
        len,
        dst: Dest::Staging(si),
        dst_offset,
        tensor,
        src_rows: None,
    };
    if width == row_bytes {
        reads.push(read(rect.rows.0 * row_bytes, rows * row_bytes, 0));
    } else if gather.is_some_and(|min| width >= min) && rows > 1 {
        reads.push(PlannedRead {
            src_rows: Some(RemoteRows {
                row_bytes: width,
                pitch: row_bytes,
            }),
            ..read(
                rect.rows.0 * row_bytes + rect.cols.0 * cell,
                rows * width,
                0,
            )
        });
    } else {
        for r in 0..rows {
            let src = (rect.rows.0 + r) * row_bytes + rect.cols.0 * cell;
            reads.push(read(src, width, r * width));
        }
    }
    rect_checks(checks, o, tensor, elem, rect, (Dest::Staging(si), 0, width));
    // The rectangle as a box of the tensor.
    let (mut offset, mut extent) = (b.offset.clone(), b.extent.clone());
    match b.rank() {
        0 => {}
        1 => {
            offset[0] += rect.cols.0;
            extent[0] = cols;
        }
        _ => {
            offset[0] += rect.rows.0;
            extent[0] = rows;
            offset[1] += rect.cols.0;
            extent[1] = cols;
        }
    }
    StagingBuffer {
        tensor,
        tensor_box: TensorBox::new(offset, extent),
        kind: StagingKind::Part,
        bytes: rows * width,
    }
}
