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
        memory_check(&plan, self.opts.verify_digests)?;
        let b0 = self.bank(&plan).await?;
        let b1 = self.bank(&plan).await?;
        let staging = self.staging(&plan).await?;
        make_resident(b0.params.iter().chain(&b1.params));
        Ok(Prepared {
            geometry,
            arm,
            plan,
            banks: [b0, b1],
            staging: staging.buffers,
            _staging_regs: staging.regs,
            staging_ids: staging.ids,
            descriptors: [None, None],
            copy_hashes: None,
            next: 0,
            generation,
        })
    }

    /// The staging buffers of `plan`'s full pulls, registered and resident.
    async fn staging(&self, plan: &Plan) -> Result<Staging> {
        let mut buffers = Vec::with_capacity(plan.staging.len());
        let mut regs = Vec::with_capacity(plan.staging.len());
        for s in &plan.staging {
            let buf = Arc::new(HostBuffer::zeroed(to_usize(s.bytes)?.max(1)));
            regs.push(
                self.stack
                    .register(buf.clone() as Arc<dyn MemoryBlock>)
                    .await?,
            );
            buffers.push(buf);
        }
        let ids = regs.iter().map(|r| r.id()).collect();
        make_resident(buffers.iter());
        Ok(Staging { buffers, regs, ids })
    }

    /// Moves the prepared banks over to `plan`, a plan for the same parameters (the receiver's
    /// layout fixes them, so every new geometry or arm is one): new staging, no descriptors,
    /// the same banks. The step staged in the landing bank and the rollback target stay valid,
    /// and nothing is allocated or registered twice. Everything the new plan needs is
    /// allocated before anything of the old one is dropped, so a failure here changes nothing.
    /// Returns false, changing nothing, when there are no banks for these parameters.
    pub(super) async fn replan(
        &mut self,
        plan: &Arc<Plan>,
        geometry: u64,
        arm: Arm,
    ) -> Result<bool> {
        match &self.prepared {
            Some(p) if p.plan.params == plan.params => {}
            _ => return Ok(false),
        }
        reshard_core::memory_check(
            staging_needed(plan, self.opts.verify_digests),
            "receiver staging and digest bookkeeping",
        )?;
        let staging = self.staging(plan).await?;
        let prep = self
            .prepared
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Internal, "receiver banks vanished"))?;
        prep.geometry = geometry;
        prep.arm = arm;
        prep.plan = plan.clone();
        prep.staging = staging.buffers;
        prep._staging_regs = staging.regs;
        prep.staging_ids = staging.ids;
        prep.descriptors = [None, None];
        prep.copy_hashes = None;
        Ok(true)
    }
}

/// Staging buffers with their registrations and region ids.
struct Staging {
    buffers: Vec<Arc<HostBuffer>>,
    regs: Vec<Registration>,
    ids: Vec<u64>,
}

/// Bytes a receiver of `plan` allocates: two banks of parameters, staging and, when it
/// verifies digests, the bookkeeping of every segment its checks hash
/// ([`super::hashes::BYTES_PER_SEGMENT`]). Saturating, so a plan too large to count is too
/// large for any machine.
pub(super) fn memory_needed(plan: &Plan, verify_digests: bool) -> u64 {
    let params = plan
        .params
        .iter()
        .fold(0u64, |n, p| n.saturating_add(p.bytes));
    params
        .saturating_mul(2)
        .saturating_add(staging_needed(plan, verify_digests))
}

/// The part of [`memory_needed`] that is the plan's and not its parameters': staging and the
/// digest bookkeeping, what a new plan for the same banks allocates.
fn staging_needed(plan: &Plan, verify_digests: bool) -> u64 {
    let staging = plan
        .staging
        .iter()
        .fold(0u64, |n, s| n.saturating_add(s.bytes));
    // Counted whether or not the backend hashes while copying: the verifier folds one hash per
    // segment either way, and a grid fine enough to matter costs the same in both.
    let hashes = if verify_digests {
        super::hashes::plan_segments(plan).saturating_mul(super::hashes::BYTES_PER_SEGMENT)
    } else {
        0
    };
    staging.saturating_add(hashes)
}

/// Refuses a plan whose buffers and digest bookkeeping ([`memory_needed`]) exceed the memory
/// available, before any of it is allocated.
pub(super) fn memory_check(plan: &Plan, verify_digests: bool) -> Result<()> {
    reshard_core::memory_check(
        memory_needed(plan, verify_digests),
        "receiver banks, staging and digest bookkeeping",
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::{CheckedPart, DigestCheck, PlanParam};

    /// A plan of one 4 KiB parameter with one whole-digest check of `rows` rows of
    /// `row_bytes`, cut into segments of `seg_bytes`.
    fn plan_with_check(rows: u64, row_bytes: u64, seg_bytes: u64) -> Plan {
        Plan {
            tensors: vec!["t".into()],
            params: vec![PlanParam {
                name: "p".into(),
                bytes: 4096,
            }],
            checks: vec![DigestCheck {
                tensor: 0,
                owner: 0,
                src_region: 0,
                src_offset: 0,
                part: CheckedPart::Whole,
                dst: Dest::Param(0),
                dst_offset: 0,
                rows,
                row_bytes,
                row_stride: row_bytes,
                seg_bytes,
            }],
            ..Plan::default()
        }
    }

    #[test]
    fn the_memory_check_counts_digest_bookkeeping() {
        // 4 rows of 1 KiB in 2-byte segments: 2048 segments besides two 4 KiB banks.
        let p = plan_with_check(4, 1024, 2);
        assert_eq!(memory_needed(&p, false), 8192);
        assert_eq!(memory_needed(&p, true), 8192 + 2048 * 64);
        // Banks of 8 KiB, but 2^50 one-byte segments to keep (64 PiB of bookkeeping): refused
        // before anything is allocated, on any machine; without verification nothing is kept.
        let huge = plan_with_check(1 << 30, 1 << 20, 1);
        let e = memory_check(&huge, true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert_eq!(memory_needed(&huge, true), 8192 + (1 << 50) * 64);
        memory_check(&huge, false).unwrap();
    }

    #[tokio::test]
    async fn a_receiver_refuses_to_allocate_a_plan_whose_bookkeeping_does_not_fit() {
        use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
        let fabric = LoopbackFabric::new();
        let t: Arc<dyn reshard_core::Transport> =
            Arc::new(LoopbackTransport::new(&fabric, "rx", 2).unwrap());
        let rx = Receiver::new(t.clone(), Default::default(), Default::default()).unwrap();
        // 8 KiB of banks, 64 PiB of segment bookkeeping: refused before any bank exists.
        let huge = Arc::new(plan_with_check(1 << 30, 1 << 20, 1));
        let e = rx
            .allocate(huge.clone(), 0, rx.opts.arm(), 1)
            .await
            .err()
            .expect("refused");
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        // Without verification no segment is kept, and the banks are allocated.
        let opts = crate::ReceiverOptions {
            verify_digests: false,
            ..Default::default()
        };
        let rx = Receiver::new(t, Default::default(), opts).unwrap();
        rx.allocate(huge, 0, rx.opts.arm(), 1).await.unwrap();
    }
}
