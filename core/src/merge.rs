//! Merging many publishers' shard tables, and replica dedup: one owner per byte-identical offer
//! (docs/design.md §3).

use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;

use serde::Serialize;

use crate::digest::{Digest, Fingerprinter};
use crate::error::{Error, ErrorDetail, ErrorKind, Result};
use crate::model::{OfferLocation, OwnerId, PartDigests, ShardTable, TensorBox, TensorSpec};

/// One offer after merge: the owner is explicit because offers of many tables are mixed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergedOffer {
    /// Publisher rank that holds the bytes.
    pub owner: OwnerId,
    /// Box of the tensor.
    pub tensor_box: TensorBox,
    /// Where the bytes live in the owner's memory.
    pub location: OfferLocation,
    /// Digest of the bytes, if published.
    pub digest: Option<Digest>,
    /// Row-chunk and column-block digests, if published (shared: dedup clones offers).
    pub parts: Option<Arc<PartDigests>>,
}

/// A tensor with every offer any publisher made of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergedTensor {
    /// Global spec, identical across publishers.
    pub spec: TensorSpec,
    /// Offers, ordered by owner then publication order.
    pub offers: Vec<MergedOffer>,
}

/// All publishers' offers, grouped per tensor.
#[derive(Debug, Clone, Default)]
pub struct MergedTable {
    /// Tensors in order of first appearance (tables taken in rank order).
    pub tensors: Vec<MergedTensor>,
    index: HashMap<String, usize>,
    /// Distinct training steps seen (normally exactly one).
    pub steps: Vec<u64>,
    /// Number of tables merged.
    pub publishers: usize,
}

impl MergedTable {
    /// Looks a tensor up by name.
    pub fn get(&self, name: &str) -> Option<&MergedTensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// Index of a tensor by name.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// Total number of offers.
    pub fn offer_count(&self) -> usize {
        self.tensors.iter().map(|t| t.offers.len()).sum()
    }

    /// Fingerprint of everything the plan depends on (names, shapes, boxes, owners, locations,
    /// which digests exist and on what grid), and nothing it does not (digest values, step):
    /// equal fingerprints mean the cached plan holds.
    pub fn geometry_fingerprint(&self) -> u64 {
        let mut f = Fingerprinter::new();
        for t in &self.tensors {
            f.str(&t.spec.name).u64(t.spec.dtype.code() as u64);
            f.u64(t.spec.shape.len() as u64);
            for &s in &t.spec.shape {
                f.u64(s);
            }
            f.u64(t.offers.len() as u64);
            for o in &t.offers {
                // The part grid decides which checks the plan holds.
                let (rows, cols) = part_grid(o.parts.as_deref());
                f.u64(o.owner as u64)
                    .u64(o.location.region)
                    .u64(o.location.offset)
                    .u64(o.digest.is_some() as u64)
                    .u64(rows)
                    .u64(cols);
                for d in 0..o.tensor_box.rank() {
                    f.u64(o.tensor_box.offset[d]).u64(o.tensor_box.extent[d]);
                }
            }
        }
        f.finish()
    }

    fn push_tensor(&mut self, t: MergedTensor) {
        self.index.insert(t.spec.name.clone(), self.tensors.len());
        self.tensors.push(t);
    }
}

/// Merges tables: validates each, checks every tensor's dtype and shape agree across publishers,
/// and concatenates offers per tensor. Tables are taken in rank order, so the result does not
/// depend on the order they arrived in.
pub fn merge(tables: &[ShardTable]) -> Result<MergedTable> {
    let mut order: Vec<&ShardTable> = tables.iter().collect();
    order.sort_by_key(|t| t.publisher.rank);
    for w in order.windows(2) {
        if w[0].publisher.rank == w[1].publisher.rank {
            return Err(Error::new(
                ErrorKind::InvalidTable,
                format!("two tables claim publisher rank {}", w[0].publisher.rank),
            )
            .with_owner(w[0].publisher.rank));
        }
    }
    let mut merged = MergedTable {
        publishers: tables.len(),
        ..Default::default()
    };
    // First rank that declared each tensor, for error messages.
    let mut first_rank: Vec<OwnerId> = Vec::new();
    for table in order {
        table.validate()?;
        let rank = table.publisher.rank;
        if !merged.steps.contains(&table.step) {
            merged.steps.push(table.step);
        }
        let mut local: HashMap<&str, usize> =
            HashMap::with_capacity_and_hasher(table.tensors.len(), Default::default());
        for spec in &table.tensors {
            let idx = match merged.position(&spec.name) {
                Some(i) => {
                    let have = &merged.tensors[i].spec;
                    if let Some(what) = difference(have, spec) {
                        let rank_a = first_rank[i];
                        return Err(Error::new(
                            ErrorKind::InconsistentTensor,
                            format!("ranks {rank_a} and {rank} disagree: {what}"),
                        )
                        .with_tensor(&spec.name)
                        .with_owner(rank)
                        .with_detail(ErrorDetail::InconsistentTensor {
                            tensor: spec.name.clone(),
                            rank_a,
                            rank_b: rank,
                            what,
                        }));
                    }
                    i
                }
                None => {
                    first_rank.push(rank);
                    merged.push_tensor(MergedTensor {
                        spec: spec.clone(),
                        offers: Vec::new(),
                    });
                    merged.tensors.len() - 1
                }
            };
            local.insert(spec.name.as_str(), idx);
        }
        for offer in &table.offers {
            // validate() guarantees the name is declared.
            let idx = local[offer.tensor.as_str()];
            merged.tensors[idx].offers.push(MergedOffer {
                owner: rank,
                tensor_box: offer.tensor_box.clone(),
                location: offer.location,
                digest: offer.digest,
                parts: offer.parts.clone().map(Arc::new),
            });
        }
    }
    Ok(merged)
}

fn difference(a: &TensorSpec, b: &TensorSpec) -> Option<String> {
    if a.dtype != b.dtype {
        return Some(format!("dtype {} vs {}", a.dtype, b.dtype));
    }
    if a.shape != b.shape {
        return Some(format!("shape {:?} vs {:?}", a.shape, b.shape));
    }
    None
}

/// How dedup picks the owner among replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DedupOptions {
    /// Spread owners across replicas: the receiver rank modulo the replica count picks one.
    /// Off by default (measured slower where single legs saturate the fabric).
    pub spread_receiver_rank: Option<u32>,
}

/// What dedup did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DedupReport {
    /// Offers before dedup.
    pub offers_in: u64,
    /// Offers kept.
    pub kept: u64,
    /// Offers dropped as replicas.
    pub dropped: u64,
    /// Bytes of the dropped offers.
    pub duplicate_bytes: u64,
}

/// Collapses offers of the same tensor with an identical box into one, choosing the owner
/// deterministically (lowest rank, or spread by receiver rank). Offers whose digests are both
/// present and differ are not replicas: that is a naming bug and fails with `ReplicaDivergence`.
pub fn dedup(merged: &MergedTable, opts: DedupOptions) -> Result<(MergedTable, DedupReport)> {
    let mut out = MergedTable {
        publishers: merged.publishers,
        steps: merged.steps.clone(),
        ..Default::default()
    };
    let mut report = DedupReport::default();
    for t in &merged.tensors {
        report.offers_in += t.offers.len() as u64;
        let mut order: Vec<usize> = (0..t.offers.len()).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&t.offers[a], &t.offers[b]);
            x.tensor_box
                .cmp(&y.tensor_box)
                .then(x.owner.cmp(&y.owner))
                .then(a.cmp(&b))
        });
        let mut kept = Vec::new();
        let mut i = 0;
        while i < order.len() {
            let first = &t.offers[order[i]];
            let mut j = i + 1;
            while j < order.len() && t.offers[order[j]].tensor_box == first.tensor_box {
                j += 1;
            }
            let group: Vec<&MergedOffer> = order[i..j].iter().map(|&k| &t.offers[k]).collect();
            let replicas: Vec<Replica<'_>> = group.iter().map(|&o| o.into()).collect();
            check_replicas(&t.spec.name, &first.tensor_box, &replicas)?;
            let pick = match opts.spread_receiver_rank {
                Some(r) => r as usize % group.len(),
                None => 0,
            };
            kept.push((order[i + pick], group[pick].clone()));
            let bytes = first.tensor_box.elements() * t.spec.dtype.size();
            let copies = (group.len() - 1) as u64;
            report.dropped += copies;
            // One box fits u64 bytes (validated), its replicas together need not: a statistic
            // saturates rather than panicking on hostile tables.
            report.duplicate_bytes = report
                .duplicate_bytes
                .saturating_add(bytes.saturating_mul(copies));
            i = j;
        }
        // Keep the published order among survivors, so plans follow publication order.
        kept.sort_by_key(|(k, _)| *k);
        report.kept += kept.len() as u64;
        out.push_tensor(MergedTensor {
            spec: t.spec.clone(),
            offers: kept.into_iter().map(|(_, o)| o).collect(),
        });
    }
    Ok((out, report))
}

/// The no-dedup arm (benchmarks only): every offer kept, with the report dedup would give.
pub fn keep_all(merged: MergedTable) -> (MergedTable, DedupReport) {
    let n = merged.offer_count() as u64;
    let report = DedupReport {
        offers_in: n,
        kept: n,
        ..DedupReport::default()
    };
    (merged, report)
}

/// One replica's owner and digests, as the divergence check sees it.
struct Replica<'a> {
    owner: OwnerId,
    digest: Option<Digest>,
    parts: Option<&'a PartDigests>,
}

impl<'a> From<&'a MergedOffer> for Replica<'a> {
    fn from(o: &'a MergedOffer) -> Self {
        Replica {
            owner: o.owner,
            digest: o.digest,
            parts: o.parts.as_deref(),
        }
    }
}

/// The part grid of an offer's digests (rows per chunk, columns per block), 0 without any:
/// it decides which checks a plan holds, so it is part of the geometry.
fn part_grid(p: Option<&PartDigests>) -> (u64, u64) {
    p.map_or((0, 0), |p| (p.chunk_rows, p.block_cols))
}

/// Offers with one box are replicas only if their digests agree: whole digests decide, and
/// part digests on the same grid must agree too.
fn check_replicas(tensor: &str, tensor_box: &TensorBox, group: &[Replica<'_>]) -> Result<()> {
    let parts = group.iter().filter_map(|o| o.parts.map(|p| (o.owner, p)));
    let mut pairs = parts.clone().zip(parts.skip(1));
    if let Some(((owner_a, a), (owner_b, b))) = pairs.find(|((_, a), (_, b))| {
        part_grid(Some(a)) == part_grid(Some(b)) && (a.chunks != b.chunks || a.blocks != b.blocks)
    }) {
        let (x, y) = a
            .chunks
            .iter()
            .chain(&a.blocks)
            .zip(b.chunks.iter().chain(&b.blocks))
            .find(|(x, y)| x != y)
            .map(|(x, y)| {
                (
                    format!("{x:016x}")[..12].to_string(),
                    format!("{y:016x}")[..12].to_string(),
                )
            })
            .unwrap_or_default();
        return Err(divergence(tensor, tensor_box, (owner_a, owner_b), (x, y)));
    }
    let mut with_digest = group.iter().filter_map(|o| o.digest.map(|d| (o.owner, d)));
    let Some((owner_a, da)) = with_digest.next() else {
        return Ok(());
    };
    for (owner_b, db) in with_digest {
        if db != da {
            return Err(divergence(
                tensor,
                tensor_box,
                (owner_a, owner_b),
                (da.prefix(12), db.prefix(12)),
            ));
        }
    }
    Ok(())
}

fn divergence(
    tensor: &str,
    b: &TensorBox,
    owners: (OwnerId, OwnerId),
    prefixes: (String, String),
) -> Error {
    Error::new(
        ErrorKind::ReplicaDivergence,
        format!(
            "offers of box {b} by owners {} and {} have different digests ({}.. vs {}..): \
             they are not replicas (two publishers using one name?)",
            owners.0, owners.1, prefixes.0, prefixes.1
        ),
    )
    .with_tensor(tensor)
    .with_owner(owners.1)
    .with_detail(ErrorDetail::ReplicaDivergence {
        tensor: tensor.to_owned(),
        tensor_box: b.clone(),
        owners,
        digest_prefixes: prefixes,
    })
}

/// Fingerprint of one table's geometry (identity, tensors, boxes, locations, which digests exist
/// and their part grid) and nothing that changes every step (digest values, step): equal keys
/// for every publisher mean the previous merge, dedup and plan still hold.
pub fn table_geometry_key(t: &ShardTable) -> u64 {
    let mut f = Fingerprinter::new();
    f.u64(t.publisher.rank as u64).str(&t.publisher.agent);
    f.u64(t.tensors.len() as u64);
    for s in &t.tensors {
        f.str(&s.name)
            .u64(s.dtype.code() as u64)
            .u64(s.shape.len() as u64);
        for &d in &s.shape {
            f.u64(d);
        }
    }
    f.u64(t.offers.len() as u64);
    for o in &t.offers {
        f.str(&o.tensor)
            .u64(o.location.region)
            .u64(o.location.offset)
            .u64(match o.location.memory {
                crate::model::MemoryKind::Dram => u64::MAX,
                crate::model::MemoryKind::Vram { device } => device as u64,
            })
            .u64(o.digest.is_some() as u64)
            .u64(part_grid(o.parts.as_ref()).0)
            .u64(part_grid(o.parts.as_ref()).1)
            .u64(o.tensor_box.rank() as u64);
        for d in 0..o.tensor_box.rank() {
            f.u64(o.tensor_box.offset[d]).u64(o.tensor_box.extent[d]);
        }
    }
    f.finish()
}

/// Which offers of which tables are replicas of each other (same tensor, same box). Built once
/// per stable geometry; [`ReplicaGroups::check`] re-runs dedup's divergence check on each new
/// step's digests without merging again.
#[derive(Debug, Clone, Default)]
pub struct ReplicaGroups {
    /// (table index, offer index) of each group with two or more members.
    groups: Vec<Vec<(u32, u32)>>,
}

impl ReplicaGroups {
    /// Groups the offers of `tables` (in the order they will be passed to `check`).
    pub fn of(tables: &[ShardTable]) -> Self {
        let mut by_box: HashMap<(&str, &TensorBox), Vec<(u32, u32)>> = HashMap::default();
        for (ti, t) in tables.iter().enumerate() {
            for (oi, o) in t.offers.iter().enumerate() {
                by_box
                    .entry((o.tensor.as_str(), &o.tensor_box))
                    .or_default()
                    .push((ti as u32, oi as u32));
            }
        }
        let mut groups: Vec<_> = by_box.into_values().filter(|g| g.len() > 1).collect();
        groups.sort_unstable();
        ReplicaGroups { groups }
    }

    /// Fails with `ReplicaDivergence` when replicas' digests disagree in `tables`, which must
    /// have the geometry the groups were built from.
    pub fn check(&self, tables: &[ShardTable]) -> Result<()> {
        let mut members = Vec::new();
        for g in &self.groups {
            members.clear();
            let mut first = None;
            for &(ti, oi) in g {
                let t = tables.get(ti as usize).ok_or_else(stale)?;
                let o = t.offers.get(oi as usize).ok_or_else(stale)?;
                first.get_or_insert(o);
                members.push(Replica {
                    owner: t.publisher.rank,
                    digest: o.digest,
                    parts: o.parts.as_ref(),
                });
            }
            if let Some(o) = first {
                check_replicas(&o.tensor, &o.tensor_box, &members)?;
            }
        }
        Ok(())
    }
}

fn stale() -> Error {
    Error::new(
        ErrorKind::Internal,
        "replica groups used with tables of another geometry",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, MemoryKind, ShardOffer};

    fn table(
        rank: u32,
        shape: Vec<u64>,
        boxes: &[(u64, u64)],
        digest: Option<Digest>,
    ) -> ShardTable {
        let mut t = ShardTable::new(rank, format!("agent{rank}"), 7);
        t.tensors
            .push(TensorSpec::new("w", DType::Bf16, shape.clone()));
        for (k, &(off, ext)) in boxes.iter().enumerate() {
            let mut o = vec![0; shape.len()];
            let mut e = shape.clone();
            o[0] = off;
            e[0] = ext;
            t.offers.push(ShardOffer {
                tensor: "w".into(),
                tensor_box: TensorBox::new(o, e),
                location: OfferLocation {
                    region: 1,
                    offset: k as u64 * 1024,
                    memory: MemoryKind::Dram,
                },
                digest,
                parts: None,
            });
        }
        t
    }

    #[test]
    fn merge_rejects_inconsistent_shapes_naming_both_ranks() {
        let e = merge(&[
            table(0, vec![4, 4], &[(0, 4)], None),
            table(3, vec![4, 8], &[(0, 4)], None),
        ])
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InconsistentTensor);
        match e.detail() {
            Some(ErrorDetail::InconsistentTensor {
                tensor,
                rank_a,
                rank_b,
                ..
            }) => {
                assert_eq!((tensor.as_str(), *rank_a, *rank_b), ("w", 0, 3));
            }
            other => panic!("unexpected detail {other:?}"),
        }
    }

    #[test]
    fn dedup_keeps_lowest_owner_and_reports() {
        let tables: Vec<_> = (0..8)
            .rev()
            .map(|r| table(r, vec![4, 4], &[(0, 2), (2, 2)], None))
            .collect();
        let m = merge(&tables).unwrap();
        let (d, rep) = dedup(&m, DedupOptions::default()).unwrap();
        assert_eq!(rep.offers_in, 16);
        assert_eq!(rep.kept, 2);
        assert_eq!(rep.dropped, 14);
        assert_eq!(rep.duplicate_bytes, 14 * 2 * 4 * 2);
        assert!(d.get("w").unwrap().offers.iter().all(|o| o.owner == 0));
    }

    #[test]
    fn duplicate_bytes_of_huge_replicas_saturate_instead_of_overflowing() {
        // Three replicas of a 2^63-byte box: each is valid, the dropped bytes exceed u64.
        let tables: Vec<_> = (0..3)
            .map(|r| {
                let mut t = table(r, vec![1 << 60], &[(0, 1 << 60)], None);
                t.tensors[0].dtype = DType::F64;
                t
            })
            .collect();
        let (_, rep) = dedup(&merge(&tables).unwrap(), DedupOptions::default()).unwrap();
        assert_eq!((rep.kept, rep.dropped), (1, 2));
        assert_eq!(rep.duplicate_bytes, u64::MAX);
    }

    #[test]
    fn dedup_spreading_is_deterministic_by_receiver_rank() {
        let tables: Vec<_> = (0..4).map(|r| table(r, vec![4], &[(0, 4)], None)).collect();
        let m = merge(&tables).unwrap();
        let opts = DedupOptions {
            spread_receiver_rank: Some(6),
        };
        let (d, _) = dedup(&m, opts).unwrap();
        assert_eq!(d.get("w").unwrap().offers[0].owner, 2);
    }

    #[test]
    fn divergent_replicas_fail_naming_tensor_box_and_owners() {
        let a = table(0, vec![4], &[(0, 4)], Some(Digest::of(b"a")));
        let b = table(5, vec![4], &[(0, 4)], Some(Digest::of(b"b")));
        let e = dedup(&merge(&[a, b]).unwrap(), DedupOptions::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ReplicaDivergence);
        match e.detail() {
            Some(ErrorDetail::ReplicaDivergence { tensor, owners, .. }) => {
                assert_eq!(tensor, "w");
                assert_eq!(*owners, (0, 5));
            }
            other => panic!("unexpected detail {other:?}"),
        }
    }

    #[test]
    fn partial_overlaps_are_not_duplicates() {
        let a = table(0, vec![8], &[(0, 4)], None);
        let b = table(1, vec![8], &[(2, 6)], None);
        let (d, rep) = dedup(&merge(&[a, b]).unwrap(), DedupOptions::default()).unwrap();
        assert_eq!(rep.dropped, 0);
        assert_eq!(d.get("w").unwrap().offers.len(), 2);
    }

    #[test]
    fn geometry_fingerprint_ignores_digests() {
        let a = merge(&[table(0, vec![8], &[(0, 8)], Some(Digest::of(b"x")))]).unwrap();
        let b = merge(&[table(0, vec![8], &[(0, 8)], Some(Digest::of(b"y")))]).unwrap();
        let c = merge(&[table(0, vec![8], &[(0, 4)], None)]).unwrap();
        assert_eq!(a.geometry_fingerprint(), b.geometry_fingerprint());
        assert_ne!(a.geometry_fingerprint(), c.geometry_fingerprint());
    }

    #[test]
    fn table_geometry_key_ignores_digests_and_step() {
        let a = table(0, vec![8], &[(0, 8)], Some(Digest::of(b"x")));
        let mut b = table(0, vec![8], &[(0, 8)], Some(Digest::of(b"y")));
        b.step = 99;
        assert_eq!(table_geometry_key(&a), table_geometry_key(&b));
        b.offers[0].location.offset += 64;
        assert_ne!(table_geometry_key(&a), table_geometry_key(&b));
    }

    #[test]
    fn replica_groups_recheck_digests_like_dedup() {
        let d = Some(Digest::of(b"same"));
        let mut tables: Vec<_> = (0..3).map(|r| table(r, vec![4], &[(0, 4)], d)).collect();
        let groups = ReplicaGroups::of(&tables);
        groups.check(&tables).unwrap();
        tables[2].offers[0].digest = Some(Digest::of(b"other"));
        let e = groups.check(&tables).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ReplicaDivergence);
        assert_eq!(e.context().owner, Some(2));
        // Dedup over the same tables agrees.
        let e2 = dedup(&merge(&tables).unwrap(), DedupOptions::default()).unwrap_err();
        assert_eq!(e2.detail(), e.detail());
    }
}
