//! Transport wrappers the suite uses: one records every posted batch, one fails an owner's
//! reads mid-batch. Both delegate everything else, so they work over any backend.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::Arc;

use reshard_core::{
    Capability, Error, ErrorKind, ExecutionLog, HostMemory, InFlight, MemoryBlock, OwnerId,
    PreparedBatch, ReadBatch, ReadDesc, Registration, Result, Transport, WireReport,
};

/// Implements `Transport` for a wrapper with an `inner` transport: everything but the methods
/// given passes straight through.
macro_rules! wrapper_transport {
    ($ty:ty, { $($own:tt)* }) => {
        #[async_trait]
        impl Transport for $ty {
            fn name(&self) -> &'static str {
                self.inner.name()
            }
            fn agent(&self) -> &str {
                self.inner.agent()
            }
            fn capabilities(&self) -> Capability {
                self.inner.capabilities()
            }
            fn epoch(&self) -> u64 {
                self.inner.epoch()
            }
            fn incarnation(&self) -> u64 {
                self.inner.incarnation()
            }
            fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
                self.inner.peer_incarnation(owner)
            }
            async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
                self.inner.register(block).await
            }
            async fn export_metadata(&self) -> Result<Bytes> {
                self.inner.export_metadata().await
            }
            async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
                self.inner.load_peer(owner, metadata).await
            }
            async fn allocate_host(&self, len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
                self.inner.allocate_host(len).await
            }
            fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
                self.inner.set_execution_log(log)
            }
            $($own)*
        }
    };
}

/// Records the reads of every posted batch, in posting order.
#[derive(Debug)]
pub struct RecordingTransport {
    inner: Arc<dyn Transport>,
    posted: Mutex<Vec<Arc<ReadBatch>>>,
    prepares: Mutex<u64>,
}

impl RecordingTransport {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Transport>) -> Self {
        RecordingTransport {
            inner,
            posted: Mutex::new(Vec::new()),
            prepares: Mutex::new(0),
        }
    }

    /// Batches posted so far.
    pub fn posted(&self) -> Vec<Arc<ReadBatch>> {
        self.posted.lock().clone()
    }

    /// Number of `prepare` calls (descriptor builds) so far.
    pub fn prepares(&self) -> u64 {
        *self.prepares.lock()
    }
}

wrapper_transport!(RecordingTransport, {
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        *self.prepares.lock() += 1;
        self.inner.prepare(batch).await
    }
    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.posted.lock().push(batch.batch().clone());
        self.inner.post(batch).await
    }
});

/// Lets every read run, then reports that `owner`'s reads failed: a peer dying mid-batch after
/// other owners' bytes (and some of its own) already landed.
#[derive(Debug)]
pub struct FailingTransport {
    inner: Arc<dyn Transport>,
    owner: OwnerId,
}

impl FailingTransport {
    /// Wraps `inner`, failing `owner`'s reads.
    pub fn new(inner: Arc<dyn Transport>, owner: OwnerId) -> Self {
        FailingTransport { inner, owner }
    }
}

struct FailAfter {
    inner: Box<dyn InFlight>,
    error: Error,
}

#[async_trait]
impl InFlight for FailAfter {
    async fn wait(self: Box<Self>) -> Result<WireReport> {
        // Bytes land first, exactly as with a real mid-batch failure.
        self.inner.wait().await?;
        Err(self.error)
    }
    async fn abort(self: Box<Self>) {
        self.inner.abort().await;
    }
}

wrapper_transport!(FailingTransport, {
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        self.inner.prepare(batch).await
    }
    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let first = batch
            .batch()
            .reads
            .iter()
            .find(|r| r.owner == self.owner)
            .copied();
        let inner = self.inner.post(batch).await?;
        let Some(r) = first else {
            return Ok(inner);
        };
        let error = Error::new(ErrorKind::Transport, "peer stopped answering mid-batch")
            .with_owner(self.owner)
            .with_range(r.remote_offset..r.remote_offset + r.len)
            .with_backend(self.inner.name())
            .set_retryable(true);
        Ok(Box::new(FailAfter { inner, error }))
    }
});

/// Which read a [`MisdirectingTransport`] sends elsewhere, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misdirect {
    /// The read of `owner` at `offset` goes to owner `to`, same region and offset: a backend
    /// that confused its peers.
    Owner {
        /// Owner of the misdirected read.
        owner: OwnerId,
        /// Its remote offset.
        offset: u64,
        /// Owner that is read instead.
        to: OwnerId,
    },
    /// The read of `owner` at `offset` reads `by` bytes further on: a backend that miscomputed
    /// an address.
    Offset {
        /// Owner of the misdirected read.
        owner: OwnerId,
        /// Its remote offset.
        offset: u64,
        /// Bytes added to the remote offset.
        by: u64,
    },
}

/// A deliberately wrong backend: hands the inner backend a batch in which one read goes
/// elsewhere ([`Misdirect`]), while the receiver still sees the batch it asked for. The suite
/// must notice (a failed refit, or bytes that differ from the reference).
#[derive(Debug)]
pub struct MisdirectingTransport {
    inner: Arc<dyn Transport>,
    rule: Misdirect,
    misdirected: Mutex<Option<ReadDesc>>,
}

impl MisdirectingTransport {
    /// Wraps `inner`, misdirecting as `rule` says.
    pub fn new(inner: Arc<dyn Transport>, rule: Misdirect) -> Self {
        MisdirectingTransport {
            inner,
            rule,
            misdirected: Mutex::new(None),
        }
    }

    /// The read as it was asked for, once it was misdirected.
    pub fn misdirected(&self) -> Option<ReadDesc> {
        *self.misdirected.lock()
    }
}

wrapper_transport!(MisdirectingTransport, {
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let asked = Arc::new(batch);
        let mut sent = (*asked).clone();
        let (owner, offset) = match self.rule {
            Misdirect::Owner { owner, offset, .. } | Misdirect::Offset { owner, offset, .. } => {
                (owner, offset)
            }
        };
        if let Some(r) = sent
            .reads
            .iter_mut()
            .find(|r| r.owner == owner && r.remote_offset == offset)
        {
            *self.misdirected.lock() = Some(*r);
            match self.rule {
                Misdirect::Owner { to, .. } => r.owner = to,
                Misdirect::Offset { by, .. } => r.remote_offset += by,
            }
        }
        let inner = self.inner.prepare(sent).await?;
        Ok(PreparedBatch::new(asked, self.inner.name(), inner))
    }
    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let inner = batch.state::<PreparedBatch>().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                "batch was not prepared by this misdirecting transport",
            )
        })?;
        self.inner.post(inner).await
    }
});
