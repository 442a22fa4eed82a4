//! The [`Transport`] impl of [`CmaTransport`].

use async_trait::async_trait;
use bytes::Bytes;
use reshard_core::regions::{self};
use reshard_core::{
    Capability, CompletionSink, ExecutionLog, InFlight, MemoryBlock, OwnerId, PreparedBatch,
    ReadBatch, Registration, Result, Transport,
};
use std::sync::Arc;

use crate::meta::{Meta, RegionMeta};
use crate::peer::Peer;
use crate::SCHEME;

use super::*;

#[async_trait]
impl Transport for CmaTransport {
    fn name(&self) -> &'static str {
        SCHEME
    }

    fn agent(&self) -> &str {
        &self.agent
    }

    fn capabilities(&self) -> Capability {
        Capability {
            one_sided_read: true,
            one_sided_write: false,
            vram: false,
            cross_process: true,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.local.epoch()
    }

    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.peers.read().get(&owner).map(|p| p.incarnation)
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let how = "reads host memory only (process_vm_readv)";
        regions::check_host_block(SCHEME, how, block.as_ref())?;
        let (len, kind) = (block.len() as u64, block.kind());
        Ok(self.local.register(block, len, kind))
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        let regions = self
            .local
            .read()
            .iter()
            .map(|(&id, b)| RegionMeta {
                id,
                addr: b.addr() as u64,
                len: b.len() as u64,
            })
            .collect();
        Ok(Meta {
            boot_id: self.host.boot_id,
            pid_ns: self.host.pid_ns,
            pid: self.host.pid,
            start_time: self.host.start_time,
            incarnation: self.incarnation,
            agent: self.agent.clone(),
            regions,
        }
        .encode())
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let meta = Meta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        let peer = Peer::open(owner, meta, &self.host)?;
        peer.probe_regions(owner)?;
        let pid = peer.pid;
        // The owner rank is the identity offers use; the process behind it may change (a
        // publisher restarted). The new metadata replaces the old and the epoch bump makes
        // every prepared batch be rebuilt.
        self.peers.write().insert(owner, Arc::new(peer));
        self.local.bump();
        tracing::debug!(agent = %self.agent, owner, pid, "cma peer loaded");
        Ok(())
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let st = self.translate(&batch)?;
        tracing::debug!(
            agent = %self.agent,
            reads = batch.reads.len(),
            bytes = batch.bytes(),
            calls = st.calls.calls.len(),
            lanes = st.lanes,
            "cma prepare"
        );
        Ok(PreparedBatch::new(Arc::new(batch), SCHEME, Arc::new(st)))
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, None)
    }

    async fn post_reporting(
        &self,
        prepared: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, Some(sink))
    }

    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        *self.log.write() = log;
        true
    }
}
