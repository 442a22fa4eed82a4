//! The [`Transport`] impl of [`LoopbackTransport`].

use async_trait::async_trait;
use bytes::Bytes;
use reshard_core::regions;
use reshard_core::{
    Capability, CompletionSink, Error, ErrorKind, ExecutionLog, InFlight, MemoryBlock, OwnerId,
    PreparedBatch, ReadBatch, Registration, Result, Transport,
};
use std::sync::Arc;

use super::{oob, LoopbackTransport, Peer};
use crate::fabric::Region;
use crate::meta::AgentMeta;
use crate::SCHEME;

#[async_trait]
impl Transport for LoopbackTransport {
    fn name(&self) -> &'static str {
        SCHEME
    }

    fn agent(&self) -> &str {
        &self.agent.name
    }

    fn capabilities(&self) -> Capability {
        Capability {
            one_sided_read: true,
            one_sided_write: false,
            vram: false,
            cross_process: false,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.agent.regions.epoch()
    }

    fn incarnation(&self) -> u64 {
        // Agent uids are never reused within a fabric (which is one process), and start at 1.
        self.agent.uid
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.peers.read().get(&owner).map(|p| p.uid)
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        regions::check_host_block(SCHEME, "moves host memory only", block.as_ref())?;
        let (len, kind) = (block.len() as u64, block.kind());
        let registration = self
            .agent
            .regions
            .register(Region { block, len }, len, kind);
        let region = registration.id();
        tracing::debug!(agent = %self.agent.name, region, len, "loopback register");
        Ok(registration)
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        // Ascending by id: the table is ordered.
        let regions: Vec<(u64, u64)> = self
            .agent
            .regions
            .read()
            .iter()
            .map(|(&id, r)| (id, r.len))
            .collect();
        Ok(AgentMeta {
            fabric: self.fabric.id(),
            agent_uid: self.agent.uid,
            agent: self.agent.name.clone(),
            regions,
        }
        .encode())
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let meta = AgentMeta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        if meta.fabric != self.fabric.id() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "metadata of agent {:?} comes from another loopback fabric (another process \
                     or LoopbackFabric); cross-process transfers need the ucx or nixl transport",
                    meta.agent
                ),
            )
            .with_owner(owner)
            .with_backend(SCHEME));
        }
        let agent = self
            .fabric
            .inner
            .agents
            .lock()
            .get(&meta.agent)
            .filter(|a| a.uid == meta.agent_uid)
            .map(Arc::downgrade)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::PeerUnknown,
                    format!(
                        "agent {:?} that exported this metadata is no longer on the fabric",
                        meta.agent
                    ),
                )
                .with_owner(owner)
                .with_backend(SCHEME)
            })?;
        // The metadata's region lengths are the publisher's claim; the fabric has the real
        // registrations. A region advertised larger than the block registered under its id
        // is refused before any read can be prepared against it. (A region no longer
        // registered is not: stale metadata fails the post that would read it.)
        if let Some(a) = agent.upgrade() {
            let real = a.regions.read();
            for &(id, len) in &meta.regions {
                if let Some(r) = real.get(&id).filter(|r| len > r.len) {
                    return Err(oob(
                        owner,
                        r.len..len,
                        format!(
                            "metadata of agent {:?} advertises region {id} as {len} bytes, but \
                             it registered {} bytes",
                            meta.agent, r.len
                        ),
                    ));
                }
            }
        }
        let peer = Peer {
            uid: meta.agent_uid,
            agent,
            regions: meta.regions.into_iter().collect(),
        };
        // The owner rank is the identity offers use; the agent behind it may change (a
        // publisher restarted, possibly under another name). The new metadata replaces the old
        // and the epoch bump makes every prepared batch re-resolve against it.
        let old = self.peers.write().insert(owner, Arc::new(peer));
        if let Some(old_agent) = old.and_then(|p| p.agent.upgrade()) {
            if old_agent.name != meta.agent {
                tracing::info!(
                    agent = %self.agent.name,
                    owner,
                    old = %old_agent.name,
                    new = %meta.agent,
                    "loopback peer replaced by another agent"
                );
            }
        }
        self.agent.regions.bump();
        tracing::debug!(agent = %self.agent.name, owner, peer = %meta.agent, "loopback peer");
        Ok(())
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let st = self.translate(&batch)?;
        tracing::debug!(
            agent = %self.agent.name,
            reads = batch.reads.len(),
            bytes = batch.bytes(),
            lists = st.work.len(),
            "loopback prepare"
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
