//! A publisher rank whose weights live in memory someone else owns, one region per tensor: the
//! arrays a trainer already holds (the Python bindings register numpy arrays in place). The
//! geometry is [`ShardPublisher`](crate::ShardPublisher)'s (`rank_geometry`), and so are
//! the digests; only where the bytes live differs.
//!
//! A rank may offer several boxes of one tensor (attention q is offered per KV group); they
//! always tile one dim-0 range of the tensor, so the rank holds one array per tensor, the
//! boxes' bounding box, and each offer points into it.

use std::sync::Arc;

use rayon::prelude::*;

use reshard_core::{
    DType, Error, ErrorKind, HostMemory, MemoryBlock, MemoryKind, OfferLocation, OwnerId,
    Registration, Result, ShardOffer, ShardTable, TensorBox, TensorSpec, Transport,
};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{rank_geometry, PublisherTopology};

use crate::publisher::offer_digests;

/// One tensor this rank holds: the array's box and its offers inside it.
struct Held {
    spec: TensorSpec,
    /// The bounding box of the offers, in global coordinates: the array's shape is its extent.
    bounds: TensorBox,
    /// Each offer's box and byte offset inside the array.
    offers: Vec<(TensorBox, u64)>,
    /// Registration first: it must be released before the memory it names.
    registration: Option<Registration>,
    memory: Option<Arc<dyn HostMemory>>,
}

impl Held {
    fn bytes(&self) -> u64 {
        self.bounds.elements() * self.spec.dtype.size()
    }
}

/// What one tensor of a rank must look like: the shape and dtype of the array to register.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldTensor {
    /// Global tensor name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// The rank's box of the tensor in global coordinates (the array's shape is its extent).
    pub bounds: TensorBox,
}

/// One publisher rank over per-tensor regions registered from caller-owned memory.
pub struct TensorPublisher {
    transport: Arc<dyn Transport>,
    rank: OwnerId,
    held: Vec<Held>,
    table: ShardTable,
}

impl TensorPublisher {
    /// The geometry of rank `rank` of `model` under `topology`, with nothing registered yet.
    pub fn new(
        transport: Arc<dyn Transport>,
        model: &ModelConfig,
        topology: &PublisherTopology,
        rank: OwnerId,
    ) -> Result<Self> {
        let geometry = rank_geometry(model, topology, rank)?;
        let specs = model.tensors();
        let mut held: Vec<Held> = Vec::new();
        for g in geometry.shards {
            match held
                .iter_mut()
                .find(|h| h.spec.name == specs[g.tensor].name)
            {
                Some(h) => h.offers.push((g.tensor_box, 0)),
                None => held.push(Held {
                    spec: specs[g.tensor].clone(),
                    bounds: g.tensor_box.clone(),
                    offers: vec![(g.tensor_box, 0)],
                    registration: None,
                    memory: None,
                }),
            }
        }
        for h in &mut held {
            tile(h, rank)?;
        }
        let table = ShardTable::new(rank, transport.agent(), 0).bound_to(transport.incarnation());
        Ok(TensorPublisher {
            transport,
            rank,
            held,
            table,
        })
    }

    /// Every tensor the rank holds, in geometry order.
    pub fn tensors(&self) -> Vec<HeldTensor> {
        self.held
            .iter()
            .map(|h| HeldTensor {
                name: h.spec.name.clone(),
                dtype: h.spec.dtype,
                bounds: h.bounds.clone(),
            })
            .collect()
    }

    /// Registers `memory` as the array of tensor `name` (its bytes, row-major, are the rank's box
    /// of the tensor). The memory is held, and stays registered, until the publisher drops.
    pub async fn register(&mut self, name: &str, memory: Arc<dyn HostMemory>) -> Result<()> {
        let rank = self.rank;
        let h = self
            .held
            .iter_mut()
            .find(|h| h.spec.name == name)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!("publisher rank {rank} holds no tensor {name:?}"),
                )
                .with_tensor(name)
                .with_owner(rank)
            })?;
        if h.memory.is_some() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("tensor {name:?} is already registered on publisher rank {rank}"),
            )
            .with_tensor(name)
            .with_owner(rank));
        }
        let want = h.spec.dtype.size() * h.bounds.elements();
        if memory.len() as u64 != want {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "tensor {name:?} on publisher rank {rank} is {want} bytes (box {:?} of {}), \
                     the array given is {}",
                    h.bounds.extent,
                    h.spec.dtype,
                    memory.len()
                ),
            )
            .with_tensor(name)
            .with_owner(rank));
        }
        let registration = self
            .transport
            .register(memory.clone() as Arc<dyn MemoryBlock>)
            .await?;
        h.registration = Some(registration);
        h.memory = Some(memory);
        Ok(())
    }

    /// Tensors not registered yet.
    pub fn missing(&self) -> Vec<String> {
        self.held
            .iter()
            .filter(|h| h.memory.is_none())
            .map(|h| h.spec.name.clone())
            .collect()
    }

    /// Digests every registered array and makes the table say step `step`. Every tensor must be
    /// registered (otherwise `InvalidInput` naming the first missing one). The arrays must not
    /// change while this runs, nor while receivers may read them after it.
    pub fn digest(&mut self, step: u64) -> Result<&ShardTable> {
        if let Some(name) = self.missing().into_iter().next() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "publisher rank {} has no array registered for tensor {name:?}",
                    self.rank
                ),
            )
            .with_tensor(name)
            .with_owner(self.rank));
        }
        let jobs: Vec<(usize, usize)> = self
            .held
            .iter()
            .enumerate()
            .flat_map(|(t, h)| (0..h.offers.len()).map(move |o| (t, o)))
            .collect();
        let digests: Vec<_> = jobs
            .par_iter()
            .map(|&(t, o)| {
                let h = &self.held[t];
                let (b, offset) = &h.offers[o];
                let bytes = b.elements() * h.spec.dtype.size();
                let memory = h.memory.as_ref().ok_or_else(|| {
                    Error::new(ErrorKind::Internal, "tensor unregistered while digesting")
                })?;
                let memory = memory.bytes();
                let range = *offset as usize..(*offset + bytes) as usize;
                Ok(offer_digests(
                    &memory[range],
                    &b.extent,
                    h.spec.dtype.size(),
                ))
            })
            .collect::<Result<_>>()?;
        let mut t = ShardTable::new(self.rank, self.transport.agent(), step)
            .bound_to(self.transport.incarnation());
        for (&(ti, oi), (digest, parts)) in jobs.iter().zip(digests) {
            let h = &self.held[ti];
            if oi == 0 {
                t.tensors.push(h.spec.clone());
            }
            let region = h.registration.as_ref().map(|r| r.id()).unwrap_or_default();
            let (b, offset) = &h.offers[oi];
            t.offers.push(ShardOffer {
                tensor: h.spec.name.clone(),
                tensor_box: b.clone(),
                location: OfferLocation {
                    region,
                    offset: *offset,
                    memory: MemoryKind::Dram,
                },
                digest: Some(digest),
                parts,
            });
        }
        self.table = t;
        Ok(&self.table)
    }

    /// The shard table of the last [`Self::digest`] (empty before it).
    pub fn table(&self) -> &ShardTable {
        &self.table
    }

    /// The rank's transport endpoint.
    pub fn transport(&self) -> &Arc<dyn Transport> {
        &self.transport
    }

    /// Bytes the rank's arrays hold (registered or not).
    pub fn bytes(&self) -> u64 {
        self.held.iter().map(Held::bytes).sum()
    }
}

/// Makes `h.bounds` the bounding box of its offers and gives each offer its byte offset inside
/// it, after checking they tile one dim-0 range (same extent in every other dimension, rows
/// adjacent): the array of a tensor is then one row-major block.
fn tile(h: &mut Held, rank: OwnerId) -> Result<()> {
    h.offers.sort_by_key(|(b, _)| b.offset.first().copied());
    let first = h.offers[0].0.clone();
    let mut bounds = first.clone();
    let row_elems: u64 = first.extent.iter().skip(1).product();
    let elem = h.spec.dtype.size();
    let mut next_row = first.offset.first().copied().unwrap_or(0);
    for (b, offset) in &mut h.offers {
        let same_cols = b.rank() == first.rank()
            && b.offset[1..] == first.offset[1..]
            && b.extent[1..] == first.extent[1..];
        if b.rank() == 0 || !same_cols || b.offset[0] != next_row {
            return Err(Error::new(
                ErrorKind::Internal,
                format!(
                    "publisher rank {rank}'s boxes of tensor {:?} are not one dim-0 range",
                    h.spec.name
                ),
            )
            .with_tensor(&h.spec.name)
            .with_owner(rank));
        }
        *offset = (b.offset[0] - first.offset[0]) * row_elems * elem;
        next_row = b.end(0);
    }
    if let Some(rows) = bounds.extent.first_mut() {
        *rows = next_row - first.offset[0];
    }
    h.bounds = bounds;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
    use reshard_core::HostBuffer;
    use reshard_planner::presets::preset;

    fn small() -> ModelConfig {
        preset("qwen3-30b-a3b")
            .unwrap()
            .with_overrides(Some(1), Some(8), Some(512))
            .unwrap()
    }

    #[tokio::test]
    async fn offers_point_into_each_tensors_array_with_shard_publisher_digests() {
        let model = small();
        let topo: PublisherTopology = "ep=2,dp=2".parse().unwrap();
        let fabric = LoopbackFabric::new();
        let t: Arc<dyn Transport> = Arc::new(LoopbackTransport::new(&fabric, "p", 2).unwrap());
        let mut shard = crate::ShardPublisher::new(t.clone(), &model, &topo, 1)
            .await
            .unwrap();
        let fill = |spec: &TensorSpec, b: &TensorBox, dst: &mut [u8]| {
            let seed = spec.name.len() as u64 + b.offset[0];
            for (i, x) in dst.iter_mut().enumerate() {
                *x = (seed + i as u64 * 7) as u8;
            }
            Ok(())
        };
        shard.fill(3, fill).unwrap();
        let mut tp = TensorPublisher::new(t.clone(), &model, &topo, 1).unwrap();
        assert!(tp.digest(3).is_err(), "nothing registered yet");
        // Copy each offer of the shard publisher into the tensor's array at its offset.
        let mut arrays: Vec<(String, Vec<u8>)> = tp
            .tensors()
            .iter()
            .map(|h| {
                let n = (h.bounds.elements() * h.dtype.size()) as usize;
                (h.name.clone(), vec![0u8; n])
            })
            .collect();
        let memory = shard.memory().bytes();
        for o in &shard.table().offers {
            let h = tp.held.iter().find(|h| h.spec.name == o.tensor).unwrap();
            let (_, at) = h.offers.iter().find(|(b, _)| *b == o.tensor_box).unwrap();
            let n = (o.tensor_box.elements() * h.spec.dtype.size()) as usize;
            let src = &memory[o.location.offset as usize..o.location.offset as usize + n];
            let a = arrays
                .iter_mut()
                .find(|(name, _)| *name == o.tensor)
                .unwrap();
            a.1[*at as usize..*at as usize + n].copy_from_slice(src);
        }
        drop(memory);
        for (name, bytes) in &arrays {
            let m = Arc::new(HostBuffer::from_bytes(bytes)) as Arc<dyn HostMemory>;
            tp.register(name, m).await.unwrap();
        }
        let table = tp.digest(3).unwrap().clone();
        assert_eq!(table.offers.len(), shard.table().offers.len());
        for o in &table.offers {
            let s = shard
                .table()
                .offers
                .iter()
                .find(|s| s.tensor == o.tensor && s.tensor_box == o.tensor_box)
                .unwrap();
            assert_eq!(o.digest, s.digest, "{}", o.tensor);
            assert_eq!(o.parts, s.parts, "{}", o.tensor);
        }
        // A wrong size names the tensor.
        let mut again = TensorPublisher::new(t, &model, &topo, 1).unwrap();
        let name = again.tensors()[0].name.clone();
        let e = again
            .register(&name, Arc::new(HostBuffer::zeroed(3)))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert_eq!(e.context().tensor.as_deref(), Some(name.as_str()));
        let e = again.digest(1).unwrap_err();
        assert_eq!(e.context().tensor.as_deref(), Some(name.as_str()));
    }
}
