//! The [`Transport`] impl of [`NixlTransport`]: the small entry points live here, the
//! others delegate to the files of their concern.

use async_trait::async_trait;
use bytes::Bytes;
use reshard_core::{
    Capability, CompletionSink, ExecutionLog, InFlight, MemoryBlock, OwnerId, PreparedBatch,
    ReadBatch, Registration, Result, Transport,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::NixlTransport;
use crate::meta::{incarnation_of, AgentMeta, RegionMeta};
use crate::SCHEME;

#[async_trait]
impl Transport for NixlTransport {
    fn name(&self) -> &'static str {
        SCHEME
    }

    fn agent(&self) -> &str {
        &self.shared.name
    }

    fn capabilities(&self) -> Capability {
        Capability {
            one_sided_read: true,
            one_sided_write: false,
            // VRAM is registered as VRAM_SEG when asked, but not shown to work on this
            // machine (no GPU), so it is not advertised.
            vram: false,
            cross_process: true,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.shared.epoch.load(Ordering::Acquire)
    }

    fn incarnation(&self) -> u64 {
        incarnation_of(&self.shared.nixl_name)
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.shared
            .state
            .lock()
            .peers
            .get(&owner)
            .map(|p| p.incarnation)
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        self.register_block(block)
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        let s = &self.shared;
        let st = s.state.lock();
        let mut regions: Vec<RegionMeta> = st
            .regions
            .iter()
            .map(|(&id, l)| RegionMeta {
                id,
                addr: l.addr,
                len: l.len,
                kind: l.kind,
            })
            .collect();
        regions.sort_unstable_by_key(|r| r.id);
        // Under the lock: the NIXL metadata matches the region list exactly.
        let nixl_md = s.agent().local_md()?;
        Ok(AgentMeta {
            agent: s.name.clone(),
            nixl_name: s.nixl_name.clone(),
            regions,
            nixl_md,
        }
        .encode())
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        self.load_peer_metadata(owner, metadata)
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        self.prepare_batch(batch)
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.post_batch(prepared, None).await
    }

    async fn post_reporting(
        &self,
        prepared: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        self.post_batch(prepared, Some(sink)).await
    }

    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        *self.shared.log.lock() = log;
        true
    }
}
