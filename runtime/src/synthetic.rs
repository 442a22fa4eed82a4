//! Synthetic publishers: deterministic, seeded weights for any preset and topology, in real
//! registered memory, published as shard tables with digests.
//!
//! Byte-identical replicas (the same box on several DP ranks) share one physical buffer while
//! remaining distinct offers with distinct owners, so a whole EP8/DP8 cluster fits on one machine.

use bytes::Bytes;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

use reshard_core::{
    ChunkDigests, Digest, Error, ErrorKind, HostBuffer, HostMemory, MemoryBlock, MemoryKind,
    OfferLocation, OwnerId, Registration, Result, ShardOffer, ShardTable, TensorBox, TensorSpec,
    Transport, WantedLayout,
};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{publisher_geometry, PublisherTopology};

use crate::content;

/// Dim-0 chunks each offer's digest is also split into.
pub const CHUNKS_PER_OFFER: u64 = 8;

/// One distinct (tensor, box) buffer in the shared arena.
#[derive(Debug, Clone)]
struct Distinct {
    tensor: usize,
    tensor_box: TensorBox,
    offset: u64,
    bytes: u64,
    digest: Option<Digest>,
    chunks: Option<ChunkDigests>,
}

/// One publisher rank: its transport endpoint, its registration and its offers.
struct RankPublisher {
    rank: OwnerId,
    transport: Arc<dyn Transport>,
    region: u64,
    _registration: Registration,
    shards: Vec<usize>,
}

/// Every publisher of a topology, in this process.
pub struct SyntheticCluster {
    model: ModelConfig,
    topology: PublisherTopology,
    specs: Vec<TensorSpec>,
    seed: u64,
    step: u64,
    arena: Arc<dyn HostMemory>,
    distinct: Vec<Distinct>,
    ranks: Vec<RankPublisher>,
    digests: bool,
}

impl SyntheticCluster {
    /// Builds the cluster: creates one transport endpoint per rank with `make_transport(rank)`,
    /// allocates one arena holding every distinct shard (from the first endpoint's
    /// [`Transport::allocate_host`], else a [`HostBuffer`]), and registers the arena on each
    /// endpoint. Bytes are filled for step 0.
    pub async fn new(
        model: ModelConfig,
        topology: PublisherTopology,
        seed: u64,
        make_transport: impl Fn(OwnerId) -> Result<Arc<dyn Transport>>,
    ) -> Result<Self> {
        let specs = model.tensors();
        let geometry = publisher_geometry(&model, &topology)?;
        let mut index: HashMap<(usize, TensorBox), usize> = HashMap::new();
        let mut distinct = Vec::new();
        let mut cursor = 0u64;
        let mut per_rank = Vec::with_capacity(geometry.len());
        for rank in &geometry {
            let mut shards = Vec::with_capacity(rank.shards.len());
            for s in &rank.shards {
                let key = (s.tensor, s.tensor_box.clone());
                let id = *index.entry(key).or_insert_with(|| {
                    let bytes = s.tensor_box.elements() * specs[s.tensor].dtype.size();
                    // 64-byte alignment keeps copies on cache-line boundaries.
                    cursor = cursor.div_ceil(64) * 64;
                    distinct.push(Distinct {
                        tensor: s.tensor,
                        tensor_box: s.tensor_box.clone(),
                        offset: cursor,
                        bytes,
                        digest: None,
                        chunks: None,
                    });
                    cursor += bytes;
                    distinct.len() - 1
                });
                shards.push(id);
            }
            per_rank.push((rank.rank, shards));
        }
        let len = usize::try_from(cursor).map_err(|_| {
            Error::new(
                ErrorKind::InvalidInput,
                "publisher arena does not fit in memory",
            )
        })?;
        crate::memory_check(cursor, "publisher buffers")?;
        let transports = per_rank
            .iter()
            .map(|(rank, _)| make_transport(*rank))
            .collect::<Result<Vec<_>>>()?;
        let len = len.max(1);
        let arena: Arc<dyn HostMemory> = match transports.first() {
            Some(t) => t.allocate_host(len).await?,
            None => None,
        }
        .unwrap_or_else(|| Arc::new(HostBuffer::zeroed(len)));
        let mut ranks = Vec::with_capacity(per_rank.len());
        for ((rank, shards), transport) in per_rank.into_iter().zip(transports) {
            let registration = transport
                .register(arena.clone() as Arc<dyn MemoryBlock>)
                .await?;
            ranks.push(RankPublisher {
                rank,
                transport,
                region: registration.id(),
                _registration: registration,
                shards,
            });
        }
        let mut cluster = SyntheticCluster {
            model,
            topology,
            specs,
            seed,
            step: 0,
            arena,
            distinct,
            ranks,
            digests: true,
        };
        cluster.publish_step(0);
        Ok(cluster)
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
        let mut arena = self.arena.bytes_mut();
        let mut slices = Vec::with_capacity(self.distinct.len());
        let mut rest: &mut [u8] = &mut arena[..];
        let mut consumed = 0u64;
        for d in &self.distinct {
            let (_, tail) = rest.split_at_mut((d.offset - consumed) as usize);
            let (mine, tail) = tail.split_at_mut(d.bytes as usize);
            slices.push((d, mine));
            rest = tail;
            consumed = d.offset + d.bytes;
        }
        let (seed, specs) = (self.seed, &self.specs);
        slices.into_par_iter().for_each(|(d, buf)| {
            let spec = &specs[d.tensor];
            let key = content::tensor_key(seed, step, &spec.name);
            content::fill_box(buf, key, &spec.shape, &d.tensor_box, spec.dtype.size());
        });
        drop(arena);
        self.recompute_digests();
    }

    fn recompute_digests(&mut self) {
        let guard = self.arena.bytes();
        let arena: &[u8] = &guard;
        let on = self.digests;
        let digests: Vec<(Option<Digest>, Option<ChunkDigests>)> = self
            .distinct
            .par_iter()
            .map(|d| {
                if !on {
                    return (None, None);
                }
                let bytes = &arena[d.offset as usize..(d.offset + d.bytes) as usize];
                let rows = d.tensor_box.extent[0];
                // Eight chunks per offer: every TP1/2/4/8 dim-0 slice of an offer whose rows
                // divide by 8 is a whole number of chunks, so receivers can check it.
                if rows < 2 {
                    return (Some(Digest::of(bytes)), None);
                }
                let (whole, chunks) =
                    ChunkDigests::with_whole(bytes, rows, rows.div_ceil(CHUNKS_PER_OFFER));
                (Some(whole), Some(chunks))
            })
            .collect();
        drop(guard);
        for (d, (g, c)) in self.distinct.iter_mut().zip(digests) {
            d.digest = g;
            d.chunks = c;
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

    /// Bytes of physical publisher memory (replicas shared).
    pub fn arena_bytes(&self) -> u64 {
        self.arena.len() as u64
    }

    /// One shard table per rank, for the current step.
    pub fn tables(&self) -> Vec<ShardTable> {
        self.ranks
            .iter()
            .map(|r| {
                let mut t = ShardTable::new(r.rank, r.transport.agent(), self.step);
                let mut seen = HashMap::new();
                for &id in &r.shards {
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
                            offset: d.offset,
                            memory: MemoryKind::Dram,
                        },
                        digest: d.digest,
                        chunks: d.chunks.clone(),
                    });
                }
                t
            })
            .collect()
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

    /// Flips one byte of the buffer holding `tensor` (first offer), after digests were
    /// published: models silent corruption in publisher memory. Returns the owner-visible
    /// arena offset that was flipped.
    pub fn corrupt(&self, tensor: &str, byte: u64) -> Result<u64> {
        let d = self
            .distinct
            .iter()
            .find(|d| self.specs[d.tensor].name == tensor)
            .ok_or_else(|| {
                Error::new(ErrorKind::InvalidInput, "no publisher holds this tensor")
                    .with_tensor(tensor)
            })?;
        let at = d.offset + byte.min(d.bytes - 1);
        self.arena.bytes_mut()[at as usize] ^= 0x5a;
        Ok(at)
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
