//! Synthetic publishers: deterministic, seeded weights for any preset and topology, in real
//! registered memory, published as shard tables with digests.
//!
//! By default every rank owns its own memory with its own layout, so replicas are byte-identical
//! but live at different offsets in different allocations, and a read sent to the wrong owner
//! gets other bytes. [`Placement::SharedReplicas`] instead shares one buffer between replicas
//! (distinct offers, distinct owners, the same bytes), so a whole EP8/DP8 cluster of a large
//! model fits on one machine.

use bytes::Bytes;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

use reshard_core::{
    Digest, Error, ErrorKind, HostBuffer, HostMemory, MemoryBlock, MemoryKind, OfferLocation,
    OwnerId, PartDigests, Registration, Result, ShardOffer, ShardTable, TensorBox, TensorSpec,
    Transport, WantedLayout,
};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{publisher_geometry, PublisherTopology};

use crate::content;

/// Where the publishers' bytes live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Every rank owns its own allocation, registered on its own endpoint only, with its offers
    /// in a rank-dependent order after a rank-dependent pad: replicas are byte-identical but sit
    /// at different offsets in different memory, as on real trainer ranks. A read sent to the
    /// wrong owner or offset gets different bytes.
    #[default]
    PerRank,
    /// One arena holds each distinct box once and is registered on every rank's endpoint at the
    /// same offsets: replicas share bytes, so a large EP x DP cluster fits on one machine
    /// (benchmarks, the CLI's default rig). Wrong-owner reads are invisible here.
    SharedReplicas,
}

impl std::str::FromStr for Placement {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "per-rank" => Ok(Placement::PerRank),
            "shared" | "shared-replicas" => Ok(Placement::SharedReplicas),
            other => Err(Error::new(
                ErrorKind::InvalidInput,
                format!("unknown publisher placement {other:?} (per-rank, shared)"),
            )),
        }
    }
}

/// One distinct (tensor, box): its digests (replicas share them).
#[derive(Debug, Clone)]
struct Distinct {
    tensor: usize,
    tensor_box: TensorBox,
    bytes: u64,
    digest: Option<Digest>,
    parts: Option<PartDigests>,
}

/// One publisher rank: its transport endpoint, its memory, its registration and its offers.
struct RankPublisher {
    rank: OwnerId,
    transport: Arc<dyn Transport>,
    /// Index into `SyntheticCluster::arenas` of the memory this rank registered.
    arena: usize,
    region: u64,
    _registration: Registration,
    /// (distinct id, byte offset in this rank's arena), in the order of the rank's offers.
    shards: Vec<(usize, u64)>,
}

/// Every publisher of a topology, in this process.
pub struct SyntheticCluster {
    model: ModelConfig,
    topology: PublisherTopology,
    specs: Vec<TensorSpec>,
    seed: u64,
    step: u64,
    placement: Placement,
    /// Physical memory: one per rank ([`Placement::PerRank`]) or one shared arena.
    arenas: Vec<Arc<dyn HostMemory>>,
    distinct: Vec<Distinct>,
    ranks: Vec<RankPublisher>,
    digests: bool,
}

/// Lays `shards` out from `start`, each at a 64-byte boundary (copies stay on cache lines);
/// returns the offsets and the end.
fn lay_out(shards: &[usize], distinct: &[Distinct], start: u64) -> (Vec<u64>, u64) {
    let mut cursor = start;
    let offsets = shards
        .iter()
        .map(|&id| {
            cursor = cursor.div_ceil(64) * 64;
            let at = cursor;
            cursor += distinct[id].bytes;
            at
        })
        .collect();
    (offsets, cursor)
}

fn alloc_len(bytes: u64) -> Result<usize> {
    usize::try_from(bytes)
        .map(|n| n.max(1))
        .map_err(|_| Error::new(ErrorKind::InvalidInput, "publisher memory does not fit"))
}

impl SyntheticCluster {
    /// Builds the cluster with [`Placement::PerRank`] memory (see [`Self::with_placement`]).
    pub async fn new(
        model: ModelConfig,
        topology: PublisherTopology,
        seed: u64,
        make_transport: impl Fn(OwnerId) -> Result<Arc<dyn Transport>>,
    ) -> Result<Self> {
        Self::with_placement(model, topology, seed, Placement::PerRank, make_transport).await
    }

    /// Builds the cluster: creates one transport endpoint per rank with `make_transport(rank)`,
    /// allocates publisher memory as `placement` says (each allocation from the owning
    /// endpoint's [`Transport::allocate_host`], else a [`HostBuffer`]) and registers it. Bytes
    /// are filled for step 0.
    pub async fn with_placement(
        model: ModelConfig,
        topology: PublisherTopology,
        seed: u64,
        placement: Placement,
        make_transport: impl Fn(OwnerId) -> Result<Arc<dyn Transport>>,
    ) -> Result<Self> {
        let specs = model.tensors();
        let geometry = publisher_geometry(&model, &topology)?;
        let mut index: HashMap<(usize, TensorBox), usize> = HashMap::new();
        let mut distinct = Vec::new();
        let mut per_rank = Vec::with_capacity(geometry.len());
        for rank in &geometry {
            let mut shards = Vec::with_capacity(rank.shards.len());
            for s in &rank.shards {
                let key = (s.tensor, s.tensor_box.clone());
                let id = *index.entry(key).or_insert_with(|| {
                    distinct.push(Distinct {
                        tensor: s.tensor,
                        tensor_box: s.tensor_box.clone(),
                        bytes: s.tensor_box.elements() * specs[s.tensor].dtype.size(),
                        digest: None,
                        parts: None,
                    });
                    distinct.len() - 1
                });
                shards.push(id);
            }
            per_rank.push((rank.rank, shards));
        }
        // Where each rank's offers sit, and how long each allocation is.
        let mut layouts: Vec<(Vec<usize>, Vec<u64>)> = Vec::with_capacity(per_rank.len());
        let mut lens = Vec::new();
        match placement {
            Placement::SharedReplicas => {
                let all: Vec<usize> = (0..distinct.len()).collect();
                let (offsets, end) = lay_out(&all, &distinct, 0);
                for (_, shards) in &per_rank {
                    let o = shards.iter().map(|&id| offsets[id]).collect();
                    layouts.push((shards.clone(), o));
                }
                lens.push(end);
            }
            Placement::PerRank => {
                for (i, (_, shards)) in per_rank.iter().enumerate() {
                    // Rank-dependent order (rotated, reversed on odd ranks) after a
                    // rank-dependent pad, so no two replicas share an offset by construction.
                    let mut order = shards.clone();
                    let n = order.len();
                    if n > 0 {
                        order.rotate_left(i % n);
                    }
                    if i % 2 == 1 {
                        order.reverse();
                    }
                    let (offsets, end) = lay_out(&order, &distinct, 64 * (1 + i as u64 % 7));
                    layouts.push((order, offsets));
                    lens.push(end);
                }
            }
        }
        reshard_core::memory_check(lens.iter().sum(), "publisher buffers")?;
        let transports = per_rank
            .iter()
            .map(|(rank, _)| make_transport(*rank))
            .collect::<Result<Vec<_>>>()?;
        let mut arenas: Vec<Arc<dyn HostMemory>> = Vec::with_capacity(lens.len());
        for (i, &len) in lens.iter().enumerate() {
            let len = alloc_len(len)?;
            let arena = match transports.get(i) {
                Some(t) => t.allocate_host(len).await?,
                None => None,
            };
            arenas.push(arena.unwrap_or_else(|| Arc::new(HostBuffer::zeroed(len))));
        }
        let mut ranks = Vec::with_capacity(per_rank.len());
        for (i, (((rank, _), (order, offsets)), transport)) in per_rank
            .into_iter()
            .zip(layouts)
            .zip(transports)
            .enumerate()
        {
            let arena = if placement == Placement::PerRank {
                i
            } else {
                0
            };
            let registration = transport
                .register(arenas[arena].clone() as Arc<dyn MemoryBlock>)
                .await?;
            ranks.push(RankPublisher {
                rank,
                transport,
                arena,
                region: registration.id(),
                _registration: registration,
                shards: order.into_iter().zip(offsets).collect(),
            });
        }
        let mut cluster = SyntheticCluster {
            model,
            topology,
            specs,
            seed,
            step: 0,
            placement,
            arenas,
            distinct,
            ranks,
            digests: true,
        };
        cluster.publish_step(0);
        Ok(cluster)
    }

    /// Where the publishers' bytes live.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Every (distinct id, offset) written into arena `a`, once each, sorted by offset.
    fn spans_of(&self, a: usize) -> Vec<(usize, u64)> {
        let mut spans: Vec<(usize, u64)> = self
            .ranks
            .iter()
            .filter(|r| r.arena == a)
            .flat_map(|r| r.shards.iter().copied())
            .collect();
        spans.sort_unstable_by_key(|&(_, at)| at);
        spans.dedup();
        spans
    }

    /// Turns digest publication on or off (off models publishers that compute none).
    pub fn set_digests(&mut self, on: bool) {
        self.digests = on;
        self.recompute_digests();
    }

    /// Rewrites every buffer with the weights of training step `step` and recomputes digests
    /// (the trainer's optimizer step; not part of a refit's timing).
    pub fn publish_step(&mut self, step: u64) {
        self.step = step;
        let (seed, specs) = (self.seed, &self.specs);
        for a in 0..self.arenas.len() {
            let spans = self.spans_of(a);
            let mut arena = self.arenas[a].bytes_mut();
            let mut slices = Vec::with_capacity(spans.len());
            let mut rest: &mut [u8] = &mut arena[..];
            let mut consumed = 0u64;
            for (id, at) in spans {
                let d = &self.distinct[id];
                let (_, tail) = rest.split_at_mut((at - consumed) as usize);
                let (mine, tail) = tail.split_at_mut(d.bytes as usize);
                slices.push((d, mine));
                rest = tail;
                consumed = at + d.bytes;
            }
            slices.into_par_iter().for_each(|(d, buf)| {
                let spec = &specs[d.tensor];
                let key = content::tensor_key(seed, step, &spec.name);
                content::fill_box(buf, key, &spec.shape, &d.tensor_box, spec.dtype.size());
            });
        }
        self.recompute_digests();
    }

    /// Where one copy of each distinct box lives: (arena, offset) of its first holder.
    fn first_copies(&self) -> Vec<(usize, u64)> {
        let mut at = vec![(usize::MAX, 0u64); self.distinct.len()];
        for r in self.ranks.iter().rev() {
            for &(id, off) in &r.shards {
                at[id] = (r.arena, off);
            }
        }
        at
    }

    fn recompute_digests(&mut self) {
        let on = self.digests;
        let copies = self.first_copies();
        let guards: Vec<_> = self.arenas.iter().map(|a| a.bytes()).collect();
        let arenas: Vec<&[u8]> = guards.iter().map(|g| &g[..]).collect();
        let specs = &self.specs;
        let digests: Vec<(Option<Digest>, Option<PartDigests>)> = self
            .distinct
            .par_iter()
            .zip(copies.par_iter())
            .map(|(d, &(a, at))| {
                if !on || a == usize::MAX {
                    return (None, None);
                }
                let bytes = &arenas[a][at as usize..(at + d.bytes) as usize];
                // Row chunks and column blocks as production publishers make them.
                let (whole, parts) =
                    PartDigests::compute(bytes, &d.tensor_box.extent, specs[d.tensor].dtype.size());
                (Some(whole), Some(parts))
            })
            .collect();
        drop(arenas);
        drop(guards);
        for (d, (g, c)) in self.distinct.iter_mut().zip(digests) {
            d.digest = g;
            d.parts = c;
        }
    }

    /// The current training step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model this cluster publishes.
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The publisher topology.
    pub fn topology(&self) -> &PublisherTopology {
        &self.topology
    }

    /// Bytes of physical publisher memory, every allocation summed (at least the length of
    /// any one rank's region).
    pub fn arena_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.len() as u64).sum()
    }

    /// One shard table per rank, for the current step.
    pub fn tables(&self) -> Vec<ShardTable> {
        self.ranks
            .iter()
            .map(|r| {
                let mut t = ShardTable::new(r.rank, r.transport.agent(), self.step)
                    .bound_to(r.transport.incarnation());
                let mut seen = HashMap::new();
                for &(id, offset) in &r.shards {
                    let d = &self.distinct[id];
                    let spec = &self.specs[d.tensor];
                    if seen.insert(d.tensor, ()).is_none() {
                        t.tensors.push(spec.clone());
                    }
                    t.offers.push(ShardOffer {
                        tensor: spec.name.clone(),
                        tensor_box: d.tensor_box.clone(),
                        location: OfferLocation {
                            region: r.region,
                            offset,
                            memory: MemoryKind::Dram,
                        },
                        digest: d.digest,
                        parts: d.parts.clone(),
                    });
                }
                t
            })
            .collect()
    }

    /// The name of the transport the publishers serve reads over.
    pub fn transport_name(&self) -> &'static str {
        self.ranks.first().map_or("", |r| r.transport.name())
    }

    /// Every rank's transport metadata, for receivers to load.
    pub async fn metadata(&self) -> Result<Vec<(OwnerId, Bytes)>> {
        let mut out = Vec::with_capacity(self.ranks.len());
        for r in &self.ranks {
            out.push((r.rank, r.transport.export_metadata().await?));
        }
        Ok(out)
    }

    /// Loads every rank's metadata into a receiver's transport.
    pub async fn connect(&self, receiver: &dyn Transport) -> Result<()> {
        for (rank, md) in self.metadata().await? {
            receiver.load_peer(rank, md).await?;
        }
        Ok(())
    }

    /// Flips one byte of the first box of `tensor` in every publisher memory holding it (all
    /// replicas, so whichever owner a receiver reads from sees it), after digests were
    /// published: models silent corruption in publisher memory. `byte` is the position inside
    /// the box (clamped to its last byte); returns the offset flipped in the first holder's
    /// region.
    pub fn corrupt(&self, tensor: &str, byte: u64) -> Result<u64> {
        let id = self
            .distinct
            .iter()
            .position(|d| self.specs[d.tensor].name == tensor)
            .ok_or_else(|| {
                Error::new(ErrorKind::InvalidInput, "no publisher holds this tensor")
                    .with_tensor(tensor)
            })?;
        let byte = byte.min(self.distinct[id].bytes - 1);
        let mut flipped: Vec<(usize, u64)> = Vec::new();
        for r in &self.ranks {
            for &(d, off) in &r.shards {
                let at = (r.arena, off + byte);
                if d == id && !flipped.contains(&at) {
                    self.arenas[r.arena].bytes_mut()[at.1 as usize] ^= 0x5a;
                    flipped.push(at);
                }
            }
        }
        Ok(flipped[0].1)
    }

    /// The bytes every parameter of `layout` must hold after a refit of the current step,
    /// built from the generator (not from any publisher buffer).
    pub fn expected_params(&self, layout: &WantedLayout) -> Result<Vec<Vec<u8>>> {
        reference_params(&self.specs, self.seed, self.step, layout)
    }

    /// The generator seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
}

/// The bytes every parameter of `layout` must hold after a refit of training step `step` of a
/// cluster seeded with `seed` over tensors `specs`: computed from the generator alone, so a
/// process that holds no publisher memory can check what it received.
pub fn reference_params(
    specs: &[TensorSpec],
    seed: u64,
    step: u64,
    layout: &WantedLayout,
) -> Result<Vec<Vec<u8>>> {
    let by_name: HashMap<&str, &TensorSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
    layout
        .params
        .par_iter()
        .map(|p| {
            let mut buf = vec![0u8; p.bytes() as usize];
            for c in &p.copies {
                let spec = by_name.get(c.tensor.as_str()).ok_or_else(|| {
                    Error::new(ErrorKind::MissingCoverage, "tensor not in the model")
                        .with_tensor(&c.tensor)
                })?;
                let key = content::tensor_key(seed, step, &spec.name);
                content::fill_strided(
                    &mut buf,
                    key,
                    &spec.shape,
                    &c.src_box,
                    spec.dtype.size(),
                    c.dst_offset,
                    &c.dst_strides,
                );
            }
            Ok(buf)
        })
        .collect()
}
