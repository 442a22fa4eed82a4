//! The receiver's buffers: two banks of parameters (the live one and the one the next update
//! lands in), staging for full pulls, their registrations with the transport, and the read
//! batch of one bank.

use rayon::prelude::*;
use std::sync::Arc;

use reshard_core::{
    Dest, Error, ErrorKind, HostBuffer, MemoryBlock, Plan, PreparedBatch, ReadBatch, ReadDesc,
    Registration, Result,
};

use super::hashes::CopyHashes;
use super::options::Arm;
use super::Receiver;

pub(super) struct Bank {
    pub(super) params: Vec<Arc<HostBuffer>>,
    pub(super) regs: Vec<Registration>,
}

pub(super) struct Cached {
    pub(super) batch: PreparedBatch,
    pub(super) epoch: u64,
}

pub(super) struct Prepared {
    pub(super) geometry: u64,
    pub(super) arm: Arm,
    pub(super) plan: Arc<Plan>,
    pub(super) banks: [Bank; 2],
    pub(super) staging: Vec<Arc<HostBuffer>>,
    pub(super) _staging_regs: Vec<Registration>,
    pub(super) staging_ids: Vec<u64>,
    pub(super) descriptors: [Option<Cached>; 2],
    /// The plan's segments for the backend to hash while copying, built at the first update
    /// that hands them over ([`super::ReceiverOptions::hash_while_copying`]).
    pub(super) copy_hashes: Option<Arc<CopyHashes>>,
    /// Bank that receives the next update.
    pub(super) next: usize,
    /// Which allocation of banks this is (a stage, the live step and a rollback target name
    /// their bank by generation and index, valid only while these banks are the receiver's).
    pub(super) generation: u64,
}

impl Receiver {
    pub(super) async fn bank(&self, plan: &Plan) -> Result<Bank> {
        let mut params = Vec::with_capacity(plan.params.len());
        let mut regs = Vec::with_capacity(plan.params.len());
        for p in &plan.params {
            let buf = Arc::new(HostBuffer::zeroed(to_usize(p.bytes)?.max(1)));
            regs.push(
                self.stack
                    .register(buf.clone() as Arc<dyn MemoryBlock>)
                    .await?,
            );
            params.push(buf);
        }
        Ok(Bank { params, regs })
    }

    pub(super) async fn allocate(
        &self,
        plan: Arc<Plan>,
        geometry: u64,
        arm: Arm,
        generation: u64,
    ) -> Result<Prepared> {
        let params: u64 = plan.params.iter().map(|p| p.bytes).sum();
        let staging: u64 = plan.staging.iter().map(|s| s.bytes).sum();
        reshard_core::memory_check(2 * params + staging, "receiver banks and staging")?;
        let b0 = self.bank(&plan).await?;
        let b1 = self.bank(&plan).await?;
        let mut staging = Vec::with_capacity(plan.staging.len());
        let mut staging_regs = Vec::with_capacity(plan.staging.len());
        for s in &plan.staging {
            let buf = Arc::new(HostBuffer::zeroed(to_usize(s.bytes)?.max(1)));
            staging_regs.push(
                self.stack
                    .register(buf.clone() as Arc<dyn MemoryBlock>)
                    .await?,
            );
            staging.push(buf);
        }
        let staging_ids = staging_regs.iter().map(|r| r.id()).collect();
        make_resident(b0.params.iter().chain(&b1.params).chain(&staging));
        Ok(Prepared {
            geometry,
            arm,
            plan,
            banks: [b0, b1],
            staging,
            _staging_regs: staging_regs,
            staging_ids,
            descriptors: [None, None],
            copy_hashes: None,
            next: 0,
            generation,
        })
    }
}

/// Touches every page of freshly zeroed buffers, in parallel, so they are resident before any
/// timed transfer (registration with a NIC pins them just the same). Otherwise first-touch
/// page faults land in whichever wire leg writes a buffer first.
pub(super) fn make_resident<'a>(bufs: impl Iterator<Item = &'a Arc<HostBuffer>>) {
    let bufs: Vec<&Arc<HostBuffer>> = bufs.collect();
    bufs.par_iter().for_each(|b| {
        let mut bytes = b.write();
        bytes.par_chunks_mut(1 << 20).for_each(|c| {
            // Writing the zero a fresh page already holds faults it in.
            for page in c.chunks_mut(4096) {
                page[0] = 0;
            }
        });
    });
}

pub(super) fn to_usize(v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::new(ErrorKind::InvalidInput, "buffer larger than memory"))
}

pub(super) fn build_batch(plan: &Plan, bank: &Bank, staging_ids: &[u64]) -> ReadBatch {
    let reads = plan
        .reads
        .iter()
        .map(|r| ReadDesc {
            owner: r.owner,
            remote_region: r.src_region,
            remote_offset: r.src_offset,
            local_region: match r.dst {
                Dest::Param(i) => bank.regs[i as usize].id(),
                Dest::Staging(i) => staging_ids[i as usize],
            },
            local_offset: r.dst_offset,
            len: r.len,
            remote_rows: r.src_rows,
        })
        .collect();
    ReadBatch { reads }
}
