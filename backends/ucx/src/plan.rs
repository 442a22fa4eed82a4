//! The order in which a prepared batch's reads are issued: pure and synchronous.
//!
//! Reads are cut into *generations* in batch order: a read whose destination overlaps a read
//! already in the current generation starts a new one, and a generation is only issued once
//! the previous one has completed. Overlapping destinations (the benchmark-only no-dedup arm)
//! are therefore applied in batch order, while a batch with disjoint destinations (every real
//! plan) is a single generation with no barrier. Inside a generation reads are interleaved
//! round-robin across owners, so the first in-flight window already covers every owner.

use std::collections::BTreeMap;

use reshard_core::{OwnerId, ReadDesc};

/// Issue order of one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IssuePlan {
    /// Read indices in issue order.
    pub(crate) order: Vec<u32>,
    /// End position (in `order`) of each generation; the last equals `order.len()`.
    pub(crate) gen_ends: Vec<usize>,
}

impl IssuePlan {
    /// Number of generations (barriers + 1; 0 for an empty batch).
    pub(crate) fn generations(&self) -> usize {
        self.gen_ends.len()
    }
}

/// Builds the issue plan of `reads` (already validated: `len > 0`, no overflow).
pub(crate) fn issue_plan(reads: &[ReadDesc]) -> IssuePlan {
    let mut order = Vec::with_capacity(reads.len());
    let mut gen_ends = Vec::new();
    // Destinations of the current generation: (region, start) -> end; pairwise disjoint.
    let mut current: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let mut members: Vec<u32> = Vec::new();
    for (i, r) in reads.iter().enumerate() {
        let (s, e) = (r.local_offset, r.local_offset.saturating_add(r.len));
        // Among disjoint intervals starting before `e`, the last one ends latest.
        let overlaps = current
            .range((r.local_region, 0)..(r.local_region, e))
            .next_back()
            .is_some_and(|(_, &end)| end > s);
        if overlaps {
            interleave(reads, &members, &mut order);
            gen_ends.push(order.len());
            members.clear();
            current.clear();
        }
        current.insert((r.local_region, s), e);
        members.push(i as u32);
    }
    if !members.is_empty() {
        interleave(reads, &members, &mut order);
        gen_ends.push(order.len());
    }
    IssuePlan { order, gen_ends }
}

/// Appends `members` to `order` round-robin by owner, each owner's reads in batch order.
fn interleave(reads: &[ReadDesc], members: &[u32], order: &mut Vec<u32>) {
    let mut by_owner: BTreeMap<OwnerId, Vec<u32>> = BTreeMap::new();
    for &m in members {
        by_owner.entry(reads[m as usize].owner).or_default().push(m);
    }
    if by_owner.len() == 1 {
        order.extend_from_slice(members);
        return;
    }
    let lists: Vec<Vec<u32>> = by_owner.into_values().collect();
    let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
    for k in 0..longest {
        order.extend(lists.iter().filter_map(|l| l.get(k)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(owner: OwnerId, region: u64, off: u64, len: u64) -> ReadDesc {
        ReadDesc {
            owner,
            remote_region: 1,
            remote_offset: 0,
            local_region: region,
            local_offset: off,
            len,
        }
    }

    #[test]
    fn disjoint_batch_is_one_generation_interleaved_by_owner() {
        let reads = vec![
            read(0, 1, 0, 10),
            read(0, 1, 10, 10),
            read(1, 1, 20, 10),
            read(2, 2, 0, 10),
            read(1, 1, 30, 5),
        ];
        let p = issue_plan(&reads);
        assert_eq!(p.gen_ends, vec![5]);
        assert_eq!(p.order, vec![0, 2, 3, 1, 4]);
    }

    #[test]
    fn overlapping_destinations_are_separated_in_batch_order() {
        // Same bytes of region 1 written three times (replicas), plus one disjoint read.
        let reads = vec![
            read(0, 1, 0, 100),
            read(1, 2, 0, 100),
            read(1, 1, 50, 10),
            read(2, 1, 55, 1),
            read(2, 1, 100, 1),
        ];
        let p = issue_plan(&reads);
        assert_eq!(p.generations(), 3);
        assert_eq!(p.gen_ends, vec![2, 3, 5]);
        // Each overlapping pair ends up in increasing generations, in batch order.
        let gen_of = |i: u32| {
            let pos = p.order.iter().position(|&x| x == i).unwrap();
            p.gen_ends.iter().position(|&e| pos < e).unwrap()
        };
        assert!(gen_of(0) < gen_of(2) && gen_of(2) < gen_of(3));
        let mut sorted = p.order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn touching_ranges_do_not_overlap_and_empty_batch_is_empty() {
        let reads = vec![read(0, 1, 10, 10), read(0, 1, 0, 10), read(0, 1, 20, 10)];
        assert_eq!(issue_plan(&reads).gen_ends, vec![3]);
        let p = issue_plan(&[]);
        assert_eq!((p.order.len(), p.generations()), (0, 0));
    }
}
