//! Assembling the plan once every copy is planned: staging buffers, full-pull reads,
//! re-slices, coalescing and statistics.

use super::*;

impl<'a> Planner<'a> {
    /// Builds staging buffers, full-pull reads and re-slices, coalesces reads and fills in the
    /// statistics.
    pub(super) fn finish(mut self, layout: &WantedLayout) -> Plan {
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
                pull_whole_offer(&mut pull_reads, &mut self.checks, o, len, acc.state, si, 0);
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
                pull_whole_offer(
                    &mut pull_reads,
                    &mut self.checks,
                    o,
                    len,
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

/// Reads one whole offer (`len` bytes) into staging buffer `si` at `dst_offset`, and checks its
/// digest there: a full pull lands the offer's bytes contiguously, so they are one row.
fn pull_whole_offer(
    reads: &mut Vec<PlannedRead>,
    checks: &mut Vec<DigestCheck>,
    o: &MergedOffer,
    len: u64,
    tensor: u32,
    si: u32,
    dst_offset: u64,
) {
    reads.push(PlannedRead {
        owner: o.owner,
        src_region: o.location.region,
        src_offset: o.location.offset,
        len,
        dst: Dest::Staging(si),
        dst_offset,
        tensor,
    });
    checks.push(DigestCheck {
        tensor,
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
