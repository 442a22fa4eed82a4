//! Wire-leg policies as [`Transport`] wrappers, composed like tower layers.
//!
//! A [`Layer`] turns a transport into a transport that behaves the same except for one policy.
//! Both layers here override only `prepare` and `post` (everything else is forwarded by
//! [`reshard_core::forward_transport!`]), so memory registered, metadata exported and peers
//! loaded through a stack are those of the innermost transport.
//!
//! - [`RetryLayer`]: a batch whose post or wait fails with a retryable error is posted again,
//!   up to `retries` times, sleeping `backoff` before the first repeat and doubling it for each
//!   further one. Errors that are not retryable (including quarantined ones, after which bytes
//!   may still land) end the batch at once. Repeating reads is safe for a receiver because they
//!   only write buffers that are not live.
//! - [`TimeoutLayer`]: post and wait together are bounded by `limit`; past it the wait is
//!   dropped (which ends the batch by the transport contract) and the error is
//!   [`ErrorKind::Timeout`], retryable, with [`ErrorDetail::WireLegTimedOut`] so that a caller
//!   can tell a wait cut short from an error the backend reported.
//!
//! - [`PostLimitLayer`]: a batch longer than the inner transport's
//!   [`Capability::max_reads_per_post`](reshard_core::Capability) is prepared and posted in
//!   parts (see its module).
//! - [`WavesLayer`]: a batch whose destinations overlap is prepared and posted as consecutive
//!   disjoint waves, so overlapping reads land in batch order and no backend orders them (see
//!   its module).
//!
//! Each layer passes completions reported as they happen (`Transport::post_reporting`) through
//! where its batch is the inner one read for read: the timeout layer always, the post-limit
//! layer shifted to each part, the waves layer for a batch of one wave, the retry layer only
//! with no retries allowed (a repeated read would rewrite bytes already reported and being
//! verified). Otherwise the batch reports nothing, and its caller learns completion at `wait`.
//!
//! Order matters: `Timeout(Retry(t))`, built with `stack(t, &[&timeout, &retry])`, bounds the
//! batch with every retry included (what the receiver composes from
//! [`ReceiverOptions`](crate::ReceiverOptions)); `Retry(Timeout(t))` would bound each attempt
//! and retry attempts that timed out.
//!
//! The retry wrapper keeps the inner transport's prepared batch behind an `Arc` in the state of
//! the batch it returns, so a batch must be prepared through the same kind of stack it is
//! posted to; posting a batch the retry layer did not prepare is an `InvalidInput` error.

use std::sync::Arc;
use std::time::Duration;

use reshard_core::{
    CompletionSink, Error, ErrorDetail, ErrorKind, InFlight, PreparedBatch, ReadBatch, Result,
    Transport, WireReport,
};
use tokio::time::Instant;

mod post_limit;
mod waves;

pub use post_limit::{PostLimit, PostLimitLayer};
pub use waves::{Waves, WavesLayer};

/// Wraps a transport in a policy, giving a transport (the tower `Layer` idea, for
/// `Arc<dyn Transport>`).
pub trait Layer {
    /// The wrapped transport.
    fn layer(&self, inner: Arc<dyn Transport>) -> Arc<dyn Transport>;
}

/// Applies `layers` to `inner`, the first one outermost (as tower's `ServiceBuilder` lists
/// them): `stack(t, &[&a, &b])` is `a(b(t))`.
pub fn stack(inner: Arc<dyn Transport>, layers: &[&dyn Layer]) -> Arc<dyn Transport> {
    layers.iter().rev().fold(inner, |t, l| l.layer(t))
}

/// Posts a batch again after a retryable failure of its post or wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryLayer {
    /// Times a failed batch is posted again (0: never; the layer then only passes through).
    pub retries: u32,
    /// Sleep before the first repeat, doubled for each further one.
    pub backoff: Duration,
}

impl Layer for RetryLayer {
    fn layer(&self, inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Arc::new(Retry {
            inner,
            policy: *self,
        })
    }
}

/// The transport [`RetryLayer`] makes.
#[derive(Debug)]
pub struct Retry {
    inner: Arc<dyn Transport>,
    policy: RetryLayer,
}

/// What the retry wrapper keeps in the batches it prepares: the inner batch, shared with every
/// in-flight handle that may have to post it again.
struct RetryState(Arc<PreparedBatch>);

/// Attempts made so far and the next backoff, carried from `post` into the in-flight handle.
struct Attempts {
    inner: Arc<dyn Transport>,
    batch: Arc<PreparedBatch>,
    policy: RetryLayer,
    made: u32,
    backoff: Duration,
}

impl Attempts {
    /// Whether `e` is worth another post; if so, sleeps the backoff and counts the attempt.
    async fn again(&mut self, e: &Error) -> bool {
        if !e.is_retryable() || self.made >= self.policy.retries {
            return false;
        }
        tracing::warn!(attempt = self.made, error = %e, "wire leg failed; retrying");
        tokio::time::sleep(self.backoff).await;
        self.backoff = self.backoff.saturating_mul(2);
        self.made += 1;
        true
    }

    /// Posts the inner batch, again after each retryable post failure while attempts last.
    async fn post(&mut self) -> Result<Box<dyn InFlight>> {
        loop {
            match self.inner.post(&self.batch).await {
                Ok(f) => return Ok(f),
                Err(e) => {
                    if !self.again(&e).await {
                        return Err(e);
                    }
                }
            }
        }
    }
}

/// A posted batch of the retry wrapper: the inner batch currently in flight, and what it takes
/// to post it again. Dropping it drops the current inner handle (ending it by the inner's rules).
struct RetryInFlight {
    current: Box<dyn InFlight>,
    attempts: Attempts,
}

#[async_trait::async_trait]
impl InFlight for RetryInFlight {
    async fn wait(self: Box<Self>) -> Result<WireReport> {
        let RetryInFlight {
            mut current,
            mut attempts,
        } = *self;
        loop {
            match current.wait().await {
                Ok(r) => return Ok(r),
                Err(e) => {
                    if !attempts.again(&e).await {
                        return Err(e);
                    }
                    current = attempts.post().await?;
                }
            }
        }
    }

    async fn abort(self: Box<Self>) {
        self.current.abort().await
    }
}

reshard_core::forward_transport!(Retry => inner {
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let inner = self.inner.prepare(batch).await?;
        Ok(PreparedBatch::new(
            inner.batch().clone(),
            inner.backend(),
            RetryState(Arc::new(inner)),
        ))
    }

    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let Some(RetryState(inner_batch)) = batch.state::<RetryState>() else {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a batch posted to the retry layer was not prepared through it",
            )
            .with_backend(self.inner.name()));
        };
        let mut attempts = Attempts {
            inner: self.inner.clone(),
            batch: inner_batch.clone(),
            policy: self.policy,
            made: 0,
            backoff: self.policy.backoff,
        };
        let current = attempts.post().await?;
        Ok(Box::new(RetryInFlight { current, attempts }))
    }

    async fn post_reporting(
        &self,
        batch: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        // A retry posts the batch again: a read reported by the first attempt would be
        // written a second time while its bytes were being verified. With no retries
        // allowed the batch is posted once, and the inner transport's reports are the
        // batch's.
        if self.policy.retries > 0 {
            return self.post(batch).await;
        }
        let Some(RetryState(inner_batch)) = batch.state::<RetryState>() else {
            return self.post(batch).await;
        };
        self.inner.post_reporting(inner_batch, sink).await
    }
});

/// Bounds post and wait of a batch together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeoutLayer {
    /// Longest time from the start of `post` to the end of `wait`.
    pub limit: Duration,
}

impl Layer for TimeoutLayer {
    fn layer(&self, inner: Arc<dyn Transport>) -> Arc<dyn Transport> {
        Arc::new(Timeout {
            inner,
            limit: self.limit,
        })
    }
}

/// The transport [`TimeoutLayer`] makes.
#[derive(Debug)]
pub struct Timeout {
    inner: Arc<dyn Transport>,
    limit: Duration,
}

impl Timeout {
    fn timed_out(&self) -> Error {
        timed_out(self.limit, self.inner.name())
    }
}

/// The error of a batch cut short at `limit`.
fn timed_out(limit: Duration, backend: &str) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!("the wire leg did not complete within {limit:?} (retries included)"),
    )
    .with_backend(backend)
    .with_detail(ErrorDetail::WireLegTimedOut {
        limit_ms: u64::try_from(limit.as_millis()).unwrap_or(u64::MAX),
    })
    .set_retryable(true)
}

/// Whether `e` comes from a [`TimeoutLayer`] that cut a wait short.
pub fn is_cut_short(e: &Error) -> bool {
    matches!(e.detail(), Some(ErrorDetail::WireLegTimedOut { .. }))
}

/// A posted batch of the timeout wrapper: waits for the inner one until the deadline.
struct TimeoutInFlight {
    inner: Box<dyn InFlight>,
    deadline: Instant,
    limit: Duration,
    backend: &'static str,
}

#[async_trait::async_trait]
impl InFlight for TimeoutInFlight {
    async fn wait(self: Box<Self>) -> Result<WireReport> {
        match tokio::time::timeout_at(self.deadline, self.inner.wait()).await {
            Ok(r) => r,
            // The inner wait future was dropped part-way, which ends the batch.
            Err(_) => Err(timed_out(self.limit, self.backend)),
        }
    }

    async fn abort(self: Box<Self>) {
        self.inner.abort().await
    }
}

reshard_core::forward_transport!(Timeout => inner {
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        self.inner.prepare(batch).await
    }

    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.post_until(batch, None).await
    }

    async fn post_reporting(
        &self,
        batch: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        self.post_until(batch, Some(sink)).await
    }
});

impl Timeout {
    /// Posts `batch` (reporting to `sink`, if any) and bounds it, waits included, by `limit`.
    async fn post_until(
        &self,
        batch: &PreparedBatch,
        sink: Option<CompletionSink>,
    ) -> Result<Box<dyn InFlight>> {
        let deadline = Instant::now() + self.limit;
        let post = async {
            match sink {
                Some(s) => self.inner.post_reporting(batch, s).await,
                None => self.inner.post(batch).await,
            }
        };
        match tokio::time::timeout_at(deadline, post).await {
            Ok(inner) => Ok(Box::new(TimeoutInFlight {
                inner: inner?,
                deadline,
                limit: self.limit,
                backend: self.inner.name(),
            })),
            Err(_) => Err(self.timed_out()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
    use reshard_core::{HostBuffer, MemoryBlock, ReadDesc, Registration};
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Fails the first `fail` posts (or, with `fail_waits`, waits) with a transport error,
    /// retryable or not; then delegates, each wait delayed by `delay`.
    #[derive(Debug)]
    struct Scripted {
        inner: Arc<dyn Transport>,
        fail: AtomicU32,
        fail_waits: bool,
        retryable: bool,
        delay: Duration,
        posts: AtomicU32,
    }

    fn injected(retryable: bool) -> Error {
        Error::new(ErrorKind::Transport, "injected").set_retryable(retryable)
    }

    struct ScriptedInFlight {
        inner: Box<dyn InFlight>,
        fail: Option<Error>,
        delay: Duration,
    }

    #[async_trait::async_trait]
    impl InFlight for ScriptedInFlight {
        async fn wait(self: Box<Self>) -> Result<WireReport> {
            tokio::time::sleep(self.delay).await;
            let r = self.inner.wait().await?;
            match self.fail {
                Some(e) => Err(e),
                None => Ok(r),
            }
        }
        async fn abort(self: Box<Self>) {
            self.inner.abort().await
        }
    }

    reshard_core::forward_transport!(Scripted => inner {
        async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
            self.posts.fetch_add(1, Ordering::SeqCst);
            let failing = self
                .fail
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if failing && !self.fail_waits {
                return Err(injected(self.retryable));
            }
            let inner = self.inner.post(batch).await?;
            Ok(Box::new(ScriptedInFlight {
                inner,
                fail: failing.then(|| injected(self.retryable)),
                delay: self.delay,
            }))
        }
    });

    /// A publisher endpoint with 4 KiB of known bytes and a receiver endpoint that loaded it.
    struct Pair {
        _publisher: Arc<dyn Transport>,
        _source: Registration,
        rx: Arc<dyn Transport>,
        remote_region: u64,
        len: u64,
    }

    async fn pair() -> Pair {
        let fabric = LoopbackFabric::new();
        let publisher: Arc<dyn Transport> =
            Arc::new(LoopbackTransport::new(&fabric, "pub", 1).unwrap());
        let src = Arc::new(HostBuffer::zeroed(4096));
        for (i, b) in src.write().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let source = publisher
            .register(src as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        let rx: Arc<dyn Transport> = Arc::new(LoopbackTransport::new(&fabric, "rx", 1).unwrap());
        rx.load_peer(0, publisher.export_metadata().await.unwrap())
            .await
            .unwrap();
        Pair {
            remote_region: source.id(),
            len: source.len(),
            _publisher: publisher,
            _source: source,
            rx,
        }
    }

    fn scripted(p: &Pair, fail: u32, fail_waits: bool, retryable: bool) -> Arc<Scripted> {
        Arc::new(Scripted {
            inner: p.rx.clone(),
            fail: fail.into(),
            fail_waits,
            retryable,
            delay: Duration::ZERO,
            posts: 0.into(),
        })
    }

    /// Registers a destination through `t`, prepares one read of every source byte through it,
    /// posts and waits; returns the result and the destination.
    async fn read_all(p: &Pair, t: &Arc<dyn Transport>) -> (Result<WireReport>, Arc<HostBuffer>) {
        let dst = Arc::new(HostBuffer::zeroed(p.len as usize));
        let reg = t
            .register(dst.clone() as Arc<dyn MemoryBlock>)
            .await
            .unwrap();
        let batch = ReadBatch {
            reads: vec![ReadDesc {
                owner: 0,
                remote_region: p.remote_region,
                remote_offset: 0,
                local_region: reg.id(),
                local_offset: 0,
                len: p.len,
                remote_rows: None,
            }],
        };
        let prepared = t.prepare(batch).await.unwrap();
        let r = match t.post(&prepared).await {
            Ok(f) => f.wait().await,
            Err(e) => Err(e),
        };
        (r, dst)
    }

    fn retry(retries: u32) -> RetryLayer {
        RetryLayer {
            retries,
            backoff: Duration::from_millis(1),
        }
    }

    fn assert_copied(dst: &HostBuffer) {
        let got = dst.read();
        assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retry_reposts_failed_posts_and_waits_exactly_up_to_its_budget() {
        let p = pair().await;
        for fail_waits in [false, true] {
            // N failures, N retries: success after N + 1 posts, every byte in place.
            let flaky = scripted(&p, 3, fail_waits, true);
            let t = retry(3).layer(flaky.clone());
            let (r, dst) = read_all(&p, &t).await;
            assert_eq!(r.unwrap().bytes, p.len, "fail_waits {fail_waits}");
            assert_eq!(flaky.posts.load(Ordering::SeqCst), 4);
            assert_copied(&dst);
            // N + 1 failures exhaust N retries: the last error, after N + 1 posts.
            let flaky = scripted(&p, 4, fail_waits, true);
            let t = retry(3).layer(flaky.clone());
            let e = read_all(&p, &t).await.0.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
            assert_eq!(flaky.posts.load(Ordering::SeqCst), 4);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retry_never_reposts_errors_that_are_not_retryable() {
        let p = pair().await;
        for fail_waits in [false, true] {
            let flaky = scripted(&p, 1, fail_waits, false);
            let t = retry(5).layer(flaky.clone());
            let e = read_all(&p, &t).await.0.unwrap_err();
            assert!(!e.is_retryable(), "{e}");
            assert_eq!(flaky.posts.load(Ordering::SeqCst), 1);
        }
        // Zero retries: the layer only passes through.
        let flaky = scripted(&p, 1, true, true);
        let t = retry(0).layer(flaky.clone());
        assert!(read_all(&p, &t).await.0.is_err());
        assert_eq!(flaky.posts.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retry_refuses_batches_it_did_not_prepare() {
        let p = pair().await;
        let t = retry(1).layer(p.rx.clone());
        let raw = p.rx.prepare(ReadBatch::default()).await.unwrap();
        let e = t.post(&raw).await.err().expect("refused");
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timeout_fires_on_a_slow_wait_and_is_recognised_as_cut_short() {
        let p = pair().await;
        let slow = Arc::new(Scripted {
            delay: Duration::from_secs(5),
            ..Arc::into_inner(scripted(&p, 0, false, true)).unwrap()
        });
        let t = TimeoutLayer {
            limit: Duration::from_millis(30),
        }
        .layer(slow);
        let t0 = std::time::Instant::now();
        let e = read_all(&p, &t).await.0.unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(2), "bounded");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.is_retryable() && is_cut_short(&e), "{e}");
        assert_eq!(
            e.detail(),
            Some(&ErrorDetail::WireLegTimedOut { limit_ms: 30 })
        );
        // A fast batch passes, and other errors are not taken for a timeout.
        let t = TimeoutLayer {
            limit: Duration::from_secs(5),
        }
        .layer(scripted(&p, 0, false, true));
        let (r, dst) = read_all(&p, &t).await;
        assert_eq!(r.unwrap().bytes, p.len);
        assert_copied(&dst);
        assert!(!is_cut_short(&injected(true)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timeout_outside_retry_bounds_every_retry() {
        let p = pair().await;
        // Every wait fails, each retry sleeps longer: the outer bound ends it all.
        let flaky = scripted(&p, u32::MAX, true, true);
        let t = stack(
            flaky.clone(),
            &[
                &TimeoutLayer {
                    limit: Duration::from_millis(50),
                },
                &RetryLayer {
                    retries: 1_000,
                    backoff: Duration::from_millis(20),
                },
            ],
        );
        let r = tokio::time::timeout(Duration::from_secs(2), read_all(&p, &t)).await;
        let e = r.expect("bounded by the outer layer").0.unwrap_err();
        assert!(is_cut_short(&e), "{e}");
        let posts = flaky.posts.load(Ordering::SeqCst);
        assert!((1..10).contains(&posts), "{posts} posts");
    }
}
