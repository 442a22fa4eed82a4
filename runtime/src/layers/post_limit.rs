//! [`PostLimitLayer`]: the one place [`Capability::max_reads_per_post`] is enforced. A batch
//! with more reads than the inner transport accepts in one post is prepared as consecutive
//! parts of at most that many reads; posting it posts every part before any wait (the contract's
//! "all owners before any wait" holds across parts), and waiting sums the parts' reports.

use std::sync::Arc;

use reshard_core::{
    Capability, CompletionSink, Error, ErrorKind, InFlight, PreparedBatch, ReadBatch, Result,
    Transport, WireReport,
};

use super::Layer;

/// Splits batches the inner transport would refuse as too long (see the module doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PostLimitLayer;

impl Layer for PostLimitLayer {
    fn layer(&self, inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Arc::new(PostLimit { inner })
    }
}

/// The transport [`PostLimitLayer`] makes.
#[derive(Debug)]
pub struct PostLimit {
    inner: Arc<dyn Transport>,
}

/// The inner transport's prepared parts of one batch, in batch order.
struct Parts(Vec<PreparedBatch>);

/// Every part of a posted batch, in batch order. Dropping it drops each part's handle, which
/// ends each by the inner transport's rules.
struct PartsInFlight(Vec<Box<dyn InFlight>>);

/// Aborts every handle in `parts`, in order.
async fn abort_all(parts: Vec<Box<dyn InFlight>>) {
    for p in parts {
        p.abort().await;
    }
}

#[async_trait::async_trait]
impl InFlight for PartsInFlight {
    async fn wait(self: Box<Self>) -> Result<WireReport> {
        let mut total = WireReport::default();
        let mut parts = self.0.into_iter();
        while let Some(p) = parts.next() {
            match p.wait().await {
                Ok(r) => {
                    total.reads += r.reads;
                    total.bytes += r.bytes;
                }
                Err(e) => {
                    // The batch failed: end the parts still posted before returning, so nothing
                    // of it lands after `wait` returns.
                    abort_all(parts.collect()).await;
                    return Err(e);
                }
            }
        }
        Ok(total)
    }

    async fn abort(self: Box<Self>) {
        abort_all(self.0).await
    }
}

impl PostLimit {
    /// Posts every part of `batch`; with a sink, each part reports through it shifted by the
    /// reads of the parts before it (parts are consecutive chunks of the batch).
    async fn post_parts(
        &self,
        batch: &PreparedBatch,
        sink: Option<CompletionSink>,
    ) -> Result<Box<dyn InFlight>> {
        let Some(Parts(parts)) = batch.state::<Parts>() else {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a batch posted to the post-limit layer was not prepared through it",
            )
            .with_backend(self.inner.name()));
        };
        let mut posted = Vec::with_capacity(parts.len());
        let mut base = 0;
        for p in parts {
            let r = match &sink {
                Some(s) => self.inner.post_reporting(p, s.offset(base)).await,
                None => self.inner.post(p).await,
            };
            base += p.batch().reads.len();
            match r {
                Ok(f) => posted.push(f),
                Err(e) => {
                    abort_all(posted).await;
                    return Err(e);
                }
            }
        }
        Ok(Box::new(PartsInFlight(posted)))
    }

    /// The inner transport's limit, refusing one that can accept nothing.
    fn limit(&self) -> Result<Option<usize>> {
        match self.inner.capabilities() {
            Capability {
                max_reads_per_post: Some(0),
                ..
            } => Err(Error::new(
                ErrorKind::Unsupported,
                "the transport advertises max_reads_per_post = 0: it can post no read",
            )
            .with_backend(self.inner.name())),
            c => Ok(c.max_reads_per_post),
        }
    }
}

reshard_core::forward_transport!(PostLimit => inner {
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        match self.limit()? {
            Some(max) if batch.reads.len() > max => {
                let whole = Arc::new(batch);
                let mut parts = Vec::with_capacity(whole.reads.len().div_ceil(max));
                for chunk in whole.reads.chunks(max) {
                    let part = ReadBatch {
                        reads: chunk.to_vec(),
                    };
                    parts.push(self.inner.prepare(part).await?);
                }
                Ok(PreparedBatch::new(whole, self.inner.name(), Parts(parts)))
            }
            _ => {
                let one = self.inner.prepare(batch).await?;
                Ok(PreparedBatch::new(
                    one.batch().clone(),
                    one.backend(),
                    Parts(vec![one]),
                ))
            }
        }
    }

    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.post_parts(batch, None).await
    }

    async fn post_reporting(
        &self,
        batch: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        self.post_parts(batch, Some(sink)).await
    }
});

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
    use reshard_core::{HostBuffer, MemoryBlock, ReadDesc};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Loopback that advertises `max` reads per post and refuses longer batches in `prepare`,
    /// counting the batches it prepares and posts.
    #[derive(Debug)]
    struct Limited {
        inner: Arc<dyn Transport>,
        max: usize,
        prepared: AtomicUsize,
        posts: AtomicUsize,
    }

    reshard_core::forward_transport!(Limited => inner {
        fn capabilities(&self) -> Capability {
            Capability {
                max_reads_per_post: Some(self.max),
                ..self.inner.capabilities()
            }
        }

        async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
            if batch.reads.len() > self.max {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("{} reads in one batch, at most {}", batch.reads.len(), self.max),
                ));
            }
            self.prepared.fetch_add(1, Ordering::SeqCst);
            self.inner.prepare(batch).await
        }

        async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
            self.posts.fetch_add(1, Ordering::SeqCst);
            self.inner.post(batch).await
        }
    });

    #[tokio::test]
    async fn a_batch_longer_than_the_limit_is_posted_in_parts_and_lands_whole() {
        let fabric = LoopbackFabric::new();
        let publisher = LoopbackTransport::new(&fabric, "pub", 1).unwrap();
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let src = publisher
            .register(Arc::new(HostBuffer::from_bytes(&bytes)))
            .await
            .unwrap();
        let limited = Arc::new(Limited {
            inner: Arc::new(LoopbackTransport::new(&fabric, "recv", 2).unwrap()),
            max: 3,
            prepared: AtomicUsize::new(0),
            posts: AtomicUsize::new(0),
        });
        let t = PostLimitLayer.layer(limited.clone());
        let dst_buf = Arc::new(HostBuffer::zeroed(4096));
        let dst = t
            .register(dst_buf.clone() as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        t.load_peer(0, publisher.export_metadata().await.unwrap())
            .await
            .unwrap();
        // Ten reads of 400 bytes (the last 496), in reverse order of their offsets.
        let mut reads: Vec<ReadDesc> = (0..10u64)
            .map(|i| ReadDesc {
                owner: 0,
                remote_region: src.id(),
                remote_offset: i * 400,
                local_region: dst.id(),
                local_offset: i * 400,
                len: if i == 9 { 496 } else { 400 },
                remote_rows: None,
            })
            .collect();
        reads.reverse();
        let prepared = t.prepare(ReadBatch { reads }).await.unwrap();
        assert_eq!(prepared.batch().reads.len(), 10, "the whole batch is kept");
        assert_eq!(
            limited.prepared.load(Ordering::SeqCst),
            4,
            "parts of 3, 3, 3, 1"
        );
        let report = t.post(&prepared).await.unwrap().wait().await.unwrap();
        assert_eq!((report.reads, report.bytes), (10, 4096));
        assert_eq!(limited.posts.load(Ordering::SeqCst), 4);
        assert!(dst_buf.read()[..] == bytes[..]);
        // Within the limit: one part, one post.
        let small = ReadBatch {
            reads: prepared.batch().reads[..2].to_vec(),
        };
        let p = t.prepare(small).await.unwrap();
        t.post(&p).await.unwrap().wait().await.unwrap();
        assert_eq!(limited.posts.load(Ordering::SeqCst), 5);
    }
}
