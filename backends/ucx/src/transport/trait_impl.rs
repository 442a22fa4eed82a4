//! The [`Transport`] impl of [`UcxTransport`]: each operation is a command to the progress
//! thread, awaited.

use async_trait::async_trait;
use bytes::Bytes;
use reshard_core::{
    Capability, CompletionSink, Error, ExecutionLog, HostMemory, InFlight, MemoryBlock, OwnerId,
    PreparedBatch, ReadBatch, Registration, Result, Transport,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::*;

#[async_trait]
impl Transport for UcxTransport {
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
            vram: self.vram,
            cross_process: true,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.peer_incarnations.lock().get(&owner).copied()
    }

    /// Shared memory allocated by UCX (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`): peers on
    /// this host read it with plain copies through UCX's sysv/posix transports, while memory
    /// the caller allocated is served by emulated reads (see README). Any endpoint of this
    /// process with the same `tls` and `net_devices` can register it.
    async fn allocate_host(&self, len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
        let alloc = Allocation::new(&self.ctx, len).map_err(Error::from)?;
        tracing::debug!(agent = %self.agent, len, addr = alloc.addr, "ucx allocate_host");
        Ok(Some(Arc::new(UcxHostMemory::new(alloc))))
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let (len, kind) = (block.len() as u64, block.kind());
        let id = self.ask(|reply| Cmd::Register { block, reply }).await?;
        let mailbox = self.mailbox.clone();
        Ok(Registration::new(id, len, kind, move || {
            // The thread unmaps once no running read uses the region; a stopped thread has
            // already released everything.
            mailbox.send(Cmd::Deregister { id });
        }))
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        self.ask(|reply| Cmd::Export { reply }).await
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let meta = EndpointMeta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        let incarnation = meta.incarnation;
        // Forget the old incarnation first: while the new one loads, tables of neither are read.
        self.peer_incarnations.lock().remove(&owner);
        self.ask(|reply| Cmd::LoadPeer { owner, meta, reply })
            .await
            .map_err(|e| e.with_owner(owner))?;
        self.peer_incarnations.lock().insert(owner, incarnation);
        Ok(())
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let batch = Arc::new(batch);
        let b = Arc::clone(&batch);
        let pieces = self
            .ask(|reply| Cmd::Prepare {
                id,
                batch: b,
                reply,
            })
            .await?;
        tracing::debug!(
            agent = %self.agent,
            reads = batch.reads.len(),
            bytes = batch.bytes(),
            pieces,
            "ucx prepare"
        );
        let token = PreparedToken {
            uid: self.uid,
            id,
            mailbox: self.mailbox.clone(),
        };
        Ok(PreparedBatch::new(batch, SCHEME, token))
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, None).await
    }

    async fn post_reporting(
        &self,
        prepared: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, Some(sink)).await
    }

    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        *self.log.lock() = log;
        true
    }
}
