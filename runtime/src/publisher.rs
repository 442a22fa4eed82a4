//! A publisher rank in production: its Megatron shard of a model in one registered region,
//! filled from any weight source (a checkpoint, a trainer's tensors) and published as a shard
//! table with whole and chunk digests (docs/design.md §2, §6).
//!
//! The geometry (which boxes of which tensors the rank holds, and where in its region) is fixed
//! at construction, so the table a receiver plans against stays the same from step to step: only
//! the step and the digests change, and receivers keep their plan and descriptors.

use std::sync::Arc;

use rayon::prelude::*;

use reshard_core::{
    Digest, Error, ErrorKind, HostBuffer, HostMemory, MemoryBlock, MemoryKind, OfferLocation,
    OwnerId, PartDigests, Registration, Result, ShardOffer, ShardTable, TensorBox, TensorSpec,
    Transport,
};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{rank_geometry, PublisherTopology};

/// The whole digest of one offer's `bytes` (a box of extent `extent`, `elem` bytes per element)
/// and its part digests ([`PartDigests::compute`]: row chunks and column blocks, each byte
/// hashed once): what every publisher puts in its table, whoever owns the memory.
pub(crate) fn offer_digests(
    bytes: &[u8],
    extent: &[u64],
    elem: u64,
) -> (Digest, Option<PartDigests>) {
    let (whole, parts) = PartDigests::compute(bytes, extent, elem);
    (whole, Some(parts))
}

/// One offer of this rank: a box of a tensor at an offset of the rank's region.
#[derive(Debug, Clone)]
struct Shard {
    tensor: usize,
    tensor_box: TensorBox,
    offset: u64,
    bytes: u64,
}

/// One publisher rank: its transport endpoint, its registered memory and its offers.
pub struct ShardPublisher {
    transport: Arc<dyn Transport>,
    memory: Arc<dyn HostMemory>,
    registration: Registration,
    specs: Vec<TensorSpec>,
    shards: Vec<Shard>,
    table: ShardTable,
}

impl ShardPublisher {
    /// Lays out rank `rank`'s shard of `model` under `topology` in one allocation (the
    /// transport's own where it offers one, else plain host memory), registers it and returns
    /// the publisher with zeroed weights and no digests (step 0) until [`Self::fill`].
    pub async fn new(
        transport: Arc<dyn Transport>,
        model: &ModelConfig,
        topology: &PublisherTopology,
        rank: OwnerId,
    ) -> Result<Self> {
        let geometry = rank_geometry(model, topology, rank)?;
        let specs = model.tensors();
        let mut cursor = 0u64;
        let mut shards = Vec::with_capacity(geometry.shards.len());
        for g in geometry.shards {
            // 64-byte boundaries keep every copy on whole cache lines.
            cursor = cursor.div_ceil(64) * 64;
            let bytes = g.tensor_box.elements() * specs[g.tensor].dtype.size();
            shards.push(Shard {
                tensor: g.tensor,
                tensor_box: g.tensor_box,
                offset: cursor,
                bytes,
            });
            cursor = cursor.checked_add(bytes).ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    "publisher rank holds more than u64 bytes",
                )
                .with_owner(rank)
            })?;
        }
        let len = usize::try_from(cursor.max(1)).map_err(|_| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("publisher rank {rank}'s {cursor} bytes do not fit this machine"),
            )
            .with_owner(rank)
        })?;
        // Refused here, with the rank named, rather than left to an allocation that aborts the
        // process when the memory is not there.
        reshard_core::memory_check(cursor, &format!("publisher rank {rank}'s shard"))
            .map_err(|e| e.with_owner(rank))?;
        let memory = match transport.allocate_host(len).await? {
            Some(m) => m,
            None => Arc::new(HostBuffer::zeroed(len)) as Arc<dyn HostMemory>,
        };
        let registration = transport
            .register(memory.clone() as Arc<dyn MemoryBlock>)
            .await?;
        let table = ShardTable::new(rank, transport.agent(), 0).bound_to(transport.incarnation());
        let mut me = Self {
            transport,
            memory,
            registration,
            specs,
            shards,
            table,
        };
        me.table = me.build_table(0, None);
        Ok(me)
    }

    /// Writes every offer through `source` (called once per offer with the tensor, the box in
    /// global coordinates and the offer's bytes in registered memory, row-major), then digests
    /// the memory and makes the table say step `step`. Offers are written in parallel.
    ///
    /// The memory is rewritten in place: announce the publisher not ready before calling this
    /// while receivers may be reading (a read that overlaps it fails its digest check).
    pub fn fill<F>(&mut self, step: u64, source: F) -> Result<()>
    where
        F: Fn(&TensorSpec, &TensorBox, &mut [u8]) -> Result<()> + Sync,
    {
        {
            let mut guard = self.memory.bytes_mut();
            let mut rest: &mut [u8] = &mut guard[..];
            let mut at = 0u64;
            let mut parts = Vec::with_capacity(self.shards.len());
            for s in &self.shards {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut((s.offset - at) as usize);
                let (part, tail) = tail.split_at_mut(s.bytes as usize);
                parts.push((s, part));
                rest = tail;
                at = s.offset + s.bytes;
            }
            let specs = &self.specs;
            parts
                .into_par_iter()
                .try_for_each(|(s, part)| source(&specs[s.tensor], &s.tensor_box, part))?;
        }
        let digests = {
            let guard = self.memory.bytes();
            let memory: &[u8] = &guard;
            self.shards
                .par_iter()
                .map(|s| {
                    offer_digests(
                        &memory[s.offset as usize..(s.offset + s.bytes) as usize],
                        &s.tensor_box.extent,
                        self.specs[s.tensor].dtype.size(),
                    )
                })
                .collect::<Vec<_>>()
        };
        self.table = self.build_table(step, Some(digests));
        Ok(())
    }

    fn build_table(
        &self,
        step: u64,
        digests: Option<Vec<(Digest, Option<PartDigests>)>>,
    ) -> ShardTable {
        let rank = self.table.publisher.rank;
        let mut t = ShardTable::new(rank, self.transport.agent(), step)
            .bound_to(self.transport.incarnation());
        let mut declared = vec![false; self.specs.len()];
        for (i, s) in self.shards.iter().enumerate() {
            let spec = &self.specs[s.tensor];
            if !std::mem::replace(&mut declared[s.tensor], true) {
                t.tensors.push(spec.clone());
            }
            let (digest, parts) = match &digests {
                Some(d) => (Some(d[i].0), d[i].1.clone()),
                None => (None, None),
            };
            t.offers.push(ShardOffer {
                tensor: spec.name.clone(),
                tensor_box: s.tensor_box.clone(),
                location: OfferLocation {
                    region: self.registration.id(),
                    offset: s.offset,
                    memory: MemoryKind::Dram,
                },
                digest,
                parts,
            });
        }
        t
    }

    /// The shard table of the current step.
    pub fn table(&self) -> &ShardTable {
        &self.table
    }

    /// The rank's transport endpoint.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Bytes of registered memory.
    pub fn memory_bytes(&self) -> u64 {
        self.memory.len() as u64
    }

    /// The rank's registered memory (read-only view for tests and dumps).
    pub fn memory(&self) -> &Arc<dyn HostMemory> {
        &self.memory
    }
}
