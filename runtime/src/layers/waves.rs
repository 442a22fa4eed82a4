//! [`WavesLayer`]: where overlapping destinations are ordered, once, above every backend.
//!
//! Backends only accept batches whose destinations are disjoint
//! ([`reshard_core::contract::validate_batch`], check 6). A batch with overlapping destinations
//! (the benchmark-only no-dedup arm reads every replica of a byte into one place) is prepared
//! here as waves ([`reshard_core::overlap::disjoint_waves`]): each wave is disjoint and goes to
//! the inner transport as a batch of its own; posting starts the first wave and waiting posts
//! each next wave once the previous one has landed, so overlapping reads land in batch order
//! (the last one wins), never as concurrent writes to the same bytes. A disjoint batch is one
//! wave and passes straight through.
//!
//! Completions are reported as they happen (`post_reporting`) for a batch of one wave only; a
//! batch of several waves reports nothing and its caller learns completion at `wait`.
//!
//! In-flight rules (docs/in-flight-safety.md) hold by construction: at most one wave is posted
//! at a time, `abort` and drop end it by the inner transport's rules, and no later wave is
//! posted once `wait` has failed, `abort` was called or the handle was dropped.

use std::sync::Arc;

use reshard_core::overlap::{disjoint_waves, first_overlap};
use reshard_core::{
    CompletionSink, InFlight, PreparedBatch, ReadBatch, Result, Transport, WireReport,
};

use super::Layer;

/// Posts batches with overlapping destinations as consecutive disjoint waves (see the module
/// doc).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WavesLayer;

impl Layer for WavesLayer {
    fn layer(&self, inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Arc::new(Waves { inner })
    }
}

/// The transport [`WavesLayer`] makes.
#[derive(Debug)]
pub struct Waves {
    inner: Arc<dyn Transport>,
}

/// The inner transport's prepared waves of one batch (two or more), in posting order.
struct Prepared(Arc<Vec<PreparedBatch>>);

/// A batch of waves in flight: the wave posted now, and the waves still to post after it.
struct WavesInFlight {
    inner: Arc<dyn Transport>,
    waves: Arc<Vec<PreparedBatch>>,
    /// The wave in flight (index `next - 1`).
    current: Box<dyn InFlight>,
    /// The next wave to post once `current` has landed.
    next: usize,
}

#[async_trait::async_trait]
impl InFlight for WavesInFlight {
    async fn wait(self: Box<Self>) -> Result<WireReport> {
        let WavesInFlight {
            inner,
            waves,
            mut current,
            mut next,
        } = *self;
        let mut total = WireReport::default();
        loop {
            // On an error the wave in flight has ended (the inner `wait` returned) and no later
            // wave is posted.
            let r = current.wait().await?;
            total.reads += r.reads;
            total.bytes += r.bytes;
            let Some(wave) = waves.get(next) else {
                return Ok(total);
            };
            current = inner.post(wave).await?;
            next += 1;
        }
    }

    async fn abort(self: Box<Self>) {
        self.current.abort().await
    }
}

reshard_core::forward_transport!(Waves => inner {
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        if first_overlap(&batch).is_none() {
            return self.inner.prepare(batch).await;
        }
        let whole = Arc::new(batch.clone());
        let mut waves = Vec::new();
        for wave in disjoint_waves(batch) {
            waves.push(self.inner.prepare(wave).await?);
        }
        Ok(PreparedBatch::new(
            whole,
            self.inner.name(),
            Prepared(Arc::new(waves)),
        ))
    }

    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let Some(Prepared(waves)) = batch.state::<Prepared>() else {
            // One wave: prepared by the inner transport itself.
            return self.inner.post(batch).await;
        };
        let current = self.inner.post(&waves[0]).await?;
        Ok(Box::new(WavesInFlight {
            inner: self.inner.clone(),
            waves: waves.clone(),
            current,
            next: 1,
        }))
    }

    async fn post_reporting(
        &self,
        batch: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        if batch.state::<Prepared>().is_none() {
            // One wave: the inner transport's batch is this batch, read for read.
            return self.inner.post_reporting(batch, sink).await;
        }
        // Waves reorder the batch's reads (and overlap): reported at `wait` only.
        self.post(batch).await
    }
});

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
    use reshard_core::{ErrorKind, HostBuffer, MemoryBlock, ReadDesc};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts the batches the inner transport prepares and posts.
    #[derive(Debug)]
    struct Counted {
        inner: Arc<dyn Transport>,
        prepared: AtomicUsize,
        posts: AtomicUsize,
    }

    reshard_core::forward_transport!(Counted => inner {
        async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
            self.prepared.fetch_add(1, Ordering::SeqCst);
            self.inner.prepare(batch).await
        }

        async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
            self.posts.fetch_add(1, Ordering::SeqCst);
            self.inner.post(batch).await
        }
    });

    /// Three publishers' regions of 64 bytes each, filled with 1s, 2s and 3s, and a receiver
    /// (through `WavesLayer` over a counting loopback) with a registered 128-byte destination.
    struct Rig {
        counted: Arc<Counted>,
        t: Arc<dyn Transport>,
        dst_buf: Arc<HostBuffer>,
        dst: u64,
        srcs: Vec<u64>,
        _keep: Vec<Box<dyn std::any::Any + Send>>,
    }

    async fn rig() -> Rig {
        let fabric = LoopbackFabric::new();
        let counted = Arc::new(Counted {
            inner: Arc::new(LoopbackTransport::new(&fabric, "recv", 9).unwrap()),
            prepared: AtomicUsize::new(0),
            posts: AtomicUsize::new(0),
        });
        let t = WavesLayer.layer(counted.clone());
        let dst_buf = Arc::new(HostBuffer::zeroed(128));
        let dst = t
            .register(dst_buf.clone() as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        let mut keep: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
        let mut srcs = Vec::new();
        for owner in 1..=3u8 {
            let p = LoopbackTransport::new(&fabric, &format!("pub{owner}"), owner.into()).unwrap();
            let reg = p
                .register(Arc::new(HostBuffer::from_bytes(&[owner; 64])))
                .await
                .unwrap();
            srcs.push(reg.id());
            t.load_peer(owner.into(), p.export_metadata().await.unwrap())
                .await
                .unwrap();
            keep.push(Box::new(reg));
            keep.push(Box::new(p));
        }
        Rig {
            counted,
            t,
            dst_buf,
            dst: dst.id(),
            srcs,
            _keep: {
                keep.push(Box::new(dst));
                keep
            },
        }
    }

    impl Rig {
        fn read(&self, owner: u8, local_offset: u64, len: u64) -> ReadDesc {
            ReadDesc {
                owner: owner.into(),
                remote_region: self.srcs[usize::from(owner) - 1],
                remote_offset: 0,
                local_region: self.dst,
                local_offset,
                len,
                remote_rows: None,
            }
        }
    }

    #[tokio::test]
    async fn overlapping_reads_land_in_batch_order_as_waves() {
        let r = rig().await;
        // Owner 1 writes 0..64, owner 2 writes 32..96 over it, owner 3 writes 16..48 over both,
        // and owner 1 again writes 96..128 (disjoint: first wave).
        let reads = vec![
            r.read(1, 0, 64),
            r.read(2, 32, 64),
            r.read(3, 16, 32),
            r.read(1, 96, 32),
        ];
        // The backend refuses the batch as it is...
        let e = r
            .counted
            .inner
            .prepare(ReadBatch {
                reads: reads.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        // ...and gets it as three disjoint waves through the layer.
        let p = r.t.prepare(ReadBatch { reads }).await.unwrap();
        assert_eq!(p.batch().reads.len(), 4, "the whole batch is kept");
        assert_eq!(r.counted.prepared.load(Ordering::SeqCst), 3, "3 waves");
        let report = r.t.post(&p).await.unwrap().wait().await.unwrap();
        assert_eq!((report.reads, report.bytes), (4, 192));
        assert_eq!(r.counted.posts.load(Ordering::SeqCst), 3);
        let got = r.dst_buf.read().to_vec();
        let mut want = vec![1u8; 16];
        want.extend([3u8; 32]);
        want.extend([2u8; 48]);
        want.extend([1u8; 32]);
        assert_eq!(got, want, "the last read in the batch wins");
    }

    #[tokio::test]
    async fn a_disjoint_batch_passes_straight_through() {
        let r = rig().await;
        let p =
            r.t.prepare(ReadBatch {
                reads: vec![r.read(2, 64, 64), r.read(3, 0, 64)],
            })
            .await
            .unwrap();
        assert!(
            p.state::<Prepared>().is_none(),
            "the inner transport's own batch"
        );
        let report = r.t.post(&p).await.unwrap().wait().await.unwrap();
        assert_eq!((report.reads, report.bytes), (2, 128));
        assert_eq!(r.counted.posts.load(Ordering::SeqCst), 1);
        let got = r.dst_buf.read().to_vec();
        assert_eq!(&got[..64], &[3u8; 64][..]);
        assert_eq!(&got[64..], &[2u8; 64][..]);
    }

    #[tokio::test]
    async fn abort_and_drop_post_no_later_wave() {
        let r = rig().await;
        let reads = vec![r.read(1, 0, 64), r.read(2, 0, 64), r.read(3, 0, 64)];
        let p = r.t.prepare(ReadBatch { reads }).await.unwrap();
        r.t.post(&p).await.unwrap().abort().await;
        drop(r.t.post(&p).await.unwrap());
        assert_eq!(
            r.counted.posts.load(Ordering::SeqCst),
            2,
            "only each batch's first wave was posted"
        );
        let got = r.dst_buf.read().to_vec();
        assert!(
            got[..64].iter().all(|&b| b == 0 || b == 1),
            "no byte of a later wave landed"
        );
    }
}
