//! The order in which a prepared batch's read pieces are issued: pure and synchronous.
//!
//! Destinations of one batch are disjoint (the contract: `validate_batch` refuses overlapping
//! ones, and overlapping reads reach a backend as separate batches, one after another), so any
//! order lands the same bytes. Pieces are interleaved round-robin across owners, each owner's
//! in batch order, so the first in-flight window already covers every owner.

use std::collections::BTreeMap;

use reshard_core::OwnerId;

/// Issue order of one batch: piece indices (`owners[i]` is piece `i`'s owner), round-robin by
/// owner, each owner's pieces in batch order.
pub(crate) fn issue_order(owners: &[OwnerId]) -> Vec<u32> {
    let mut by_owner: BTreeMap<OwnerId, Vec<u32>> = BTreeMap::new();
    for (i, &o) in owners.iter().enumerate() {
        by_owner.entry(o).or_default().push(i as u32);
    }
    if by_owner.len() <= 1 {
        return (0..owners.len() as u32).collect();
    }
    let lists: Vec<Vec<u32>> = by_owner.into_values().collect();
    let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
    let mut order = Vec::with_capacity(owners.len());
    for k in 0..longest {
        order.extend(lists.iter().filter_map(|l| l.get(k)));
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_interleaved_by_owner_in_batch_order() {
        assert_eq!(issue_order(&[0, 0, 1, 2, 1]), vec![0, 2, 3, 1, 4]);
        assert_eq!(issue_order(&[7, 7, 7]), vec![0, 1, 2]);
        assert!(issue_order(&[]).is_empty());
        let mut all = issue_order(&[3, 1, 2, 1, 3, 3]);
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 4, 5], "every piece once");
    }
}
