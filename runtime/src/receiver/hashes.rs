//! The receiver's [`HashPlan`]: which destination segments of each read the backend hashes
//! while copying (docs/in-flight-safety.md, "Hashing while copying"), and which slots hold the
//! segments of each digest check.
//!
//! Every segment of every check (one row's bytes of one column block, in the check's fold
//! order) gets a slot; a segment lying wholly inside one read becomes a task of that read, at
//! its offset in the read. A segment straddling two reads is no task: the verifier hashes it
//! from the destination once both reads landed, as it hashes every slot the backend left
//! unstored.

use std::sync::Arc;

use reshard_core::{Dest, DigestCheck, HashPlan, Plan, SegmentTask};

/// The hash plan of one receiver plan, and where each check's slots start.
pub(super) struct CopyHashes {
    /// What the backend hashes, handed with every post of the plan's batch.
    pub(super) plan: Arc<HashPlan>,
    /// Per check of the plan: its first slot (its segments follow in fold order: row by row,
    /// each row's segments left to right).
    pub(super) first_slot: Vec<usize>,
}

/// Segments per row of check `c`, as [`reshard_core::SegmentFold::row`] cuts them (an empty row
/// is one empty segment).
pub(super) fn segments_per_row(c: &DigestCheck) -> u64 {
    if c.row_bytes == 0 {
        1
    } else {
        c.row_bytes.div_ceil(c.seg_bytes.max(1))
    }
}

/// Bytes a receiver may hold per segment of a digest check: its [`HashPlan`] slot (16), its
/// [`SegmentTask`] (16) and, while the tasks are sorted, the task with its read index (24); and
/// the verifier's fold of the check (8 per segment).
pub(super) const BYTES_PER_SEGMENT: u64 = 64;

/// Segments of every digest check of `plan`, saturating at `u64::MAX`: the slots
/// [`CopyHashes::of`] allocates, and the hashes the verifier folds.
pub(super) fn plan_segments(plan: &Plan) -> u64 {
    plan.checks.iter().fold(0u64, |n, c| {
        n.saturating_add(c.rows.saturating_mul(segments_per_row(c)))
    })
}

impl CopyHashes {
    /// The hash plan of `plan`'s checks over its reads (indexed as the batch built from them).
    pub(super) fn of(plan: &Plan) -> Self {
        let n_params = plan.params.len();
        let key = |d: Dest| match d {
            Dest::Param(i) => i as usize,
            Dest::Staging(i) => n_params + i as usize,
        };
        // Per buffer: its reads as (destination offset, length, read index), by offset.
        let mut by_buf: Vec<Vec<(u64, u64, usize)>> =
            vec![Vec::new(); n_params + plan.staging.len()];
        for (i, r) in plan.reads.iter().enumerate() {
            if let Some(v) = by_buf.get_mut(key(r.dst)) {
                v.push((r.dst_offset, r.len, i));
            }
        }
        for v in &mut by_buf {
            v.sort_unstable();
        }
        let mut first_slot = Vec::with_capacity(plan.checks.len());
        let mut tasks = Vec::new();
        let mut slot = 0usize;
        for c in &plan.checks {
            first_slot.push(slot);
            let per_row = segments_per_row(c);
            let reads = by_buf.get(key(c.dst)).map_or(&[][..], |v| v.as_slice());
            let seg = c.seg_bytes.max(1);
            for row in 0..c.rows {
                for j in 0..per_row {
                    let here = slot;
                    slot += 1;
                    let len = c.row_bytes.saturating_sub(j * seg).min(seg);
                    let at = row
                        .checked_mul(c.row_stride)
                        .and_then(|o| o.checked_add(c.dst_offset))
                        .and_then(|o| o.checked_add(j * seg));
                    let (Some(at), Ok(len32), Ok(slot32)) =
                        (at, u32::try_from(len), u32::try_from(here))
                    else {
                        continue;
                    };
                    if len == 0 {
                        continue;
                    }
                    // The read whose destination starts last at or before `at`.
                    let k = reads.partition_point(|&(off, _, _)| off <= at);
                    let Some(&(off, rlen, read)) = k.checked_sub(1).map(|k| &reads[k]) else {
                        continue;
                    };
                    if at + len <= off + rlen {
                        tasks.push((
                            read,
                            SegmentTask {
                                offset: at - off,
                                len: len32,
                                slot: slot32,
                            },
                        ));
                    }
                }
            }
        }
        CopyHashes {
            plan: Arc::new(HashPlan::new(plan.reads.len(), slot, tasks)),
            first_slot,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::{CheckedPart, PlanParam, PlannedRead};

    #[test]
    fn segments_inside_one_read_become_its_tasks_and_straddling_ones_do_not() {
        let read = |dst_offset, len| PlannedRead {
            owner: 0,
            src_region: 1,
            src_offset: 0,
            len,
            dst: Dest::Param(0),
            dst_offset,
            tensor: 0,
            src_rows: None,
        };
        // Reads 0..100 and 100..300 of parameter 0; a check of 3 rows of 60 bytes every 100
        // bytes from 20, segments of 25 (25, 25, 10 per row).
        let plan = Plan {
            tensors: vec!["t".into()],
            params: vec![PlanParam {
                name: "p".into(),
                bytes: 300,
            }],
            reads: vec![read(0, 100), read(100, 200)],
            checks: vec![DigestCheck {
                tensor: 0,
                owner: 0,
                src_region: 1,
                src_offset: 0,
                part: CheckedPart::Whole,
                dst: Dest::Param(0),
                dst_offset: 20,
                rows: 3,
                row_bytes: 60,
                row_stride: 100,
                seg_bytes: 25,
            }],
            ..Plan::default()
        };
        let h = CopyHashes::of(&plan);
        assert_eq!(h.first_slot, [0]);
        assert_eq!(h.plan.slots(), 9);
        let t = |offset, len, slot| SegmentTask { offset, len, slot };
        // Row 0: 20..45, 45..70, 70..80 in read 0. Row 1: 120..145, 145..170, 170..180 in
        // read 1 at 20.. . Row 2: 220.. likewise.
        assert_eq!(h.plan.tasks(0), [t(20, 25, 0), t(45, 25, 1), t(70, 10, 2)]);
        assert_eq!(
            h.plan.tasks(1),
            [
                t(20, 25, 3),
                t(45, 25, 4),
                t(70, 10, 5),
                t(120, 25, 6),
                t(145, 25, 7),
                t(170, 10, 8)
            ]
        );
        // A check whose row crosses from read 0 into read 1: the segment 90..115 is no task.
        let mut p2 = plan.clone();
        p2.checks[0].dst_offset = 65;
        p2.checks[0].rows = 1;
        let h = CopyHashes::of(&p2);
        assert_eq!(h.plan.tasks(0), [t(65, 25, 0)]);
        assert_eq!(h.plan.tasks(1), [t(15, 10, 2)]);
    }
}
