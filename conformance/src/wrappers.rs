//! Transport wrappers the suite uses: one records every posted batch, one fails an owner's
//! reads mid-batch, one sends a read elsewhere. All forward everything else
//! ([`reshard_core::forward_transport!`]), so they work over any backend.

use async_trait::async_trait;
use parking_lot::Mutex;
use std::sync::Arc;

use reshard_core::{
    Error, ErrorKind, InFlight, OwnerId, PreparedBatch, ReadBatch, ReadDesc, Result, Transport,
    WireReport,
};

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

reshard_core::forward_transport!(RecordingTransport => inner {
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

reshard_core::forward_transport!(FailingTransport => inner {
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

/// Runs a publisher-side action once, at the first post, after the batch is handed over and
/// before its bytes are awaited: a trainer rewriting its memory in place while a receiver's
/// wire leg reads it.
pub struct RewritingTransport {
    inner: Arc<dyn Transport>,
    action: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl std::fmt::Debug for RewritingTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewritingTransport").finish_non_exhaustive()
    }
}

impl RewritingTransport {
    /// Wraps `inner`; `action` runs at the first post.
    pub fn new(inner: Arc<dyn Transport>, action: impl FnOnce() + Send + 'static) -> Self {
        RewritingTransport {
            inner,
            action: Mutex::new(Some(Box::new(action))),
        }
    }
}

reshard_core::forward_transport!(RewritingTransport => inner {
    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        // Taken out of the lock first: the action runs without it.
        let action = self.action.lock().take();
        if let Some(action) = action {
            action();
        }
        self.inner.post(batch).await
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

reshard_core::forward_transport!(MisdirectingTransport => inner {
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
