//! Posted batches: posting every owner's request, polling completion with backoff, the
//! timeout, failure and abort paths, and the [`InFlight`] handle.
//!
//! Requests are re-posted every step (NIXL allows re-posting a request once its previous
//! transfer completed). A request whose transfer failed or timed out, or that an abort
//! drained, is released; the next post re-makes it from the prepared descriptor lists.

use async_trait::async_trait;
use reshard_core::{Error, ErrorKind, InFlight, Result, WireReport};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::agent::status_name;
use crate::transport::Prepared;
use crate::BACKEND;

/// Polls answered by yielding before the poller starts sleeping.
const SPIN_POLLS: u32 = 64;
/// First and largest sleep between polls.
const FIRST_SLEEP: Duration = Duration::from_micros(50);
const MAX_SLEEP: Duration = Duration::from_millis(1);

/// Yield a few times (a small read completes in microseconds), then sleep, doubling up to
/// 1 ms, so a long transfer costs no runtime worker.
struct Backoff {
    polls: u32,
    sleep: Duration,
}

impl Backoff {
    fn new() -> Self {
        Backoff {
            polls: 0,
            sleep: FIRST_SLEEP,
        }
    }

    async fn pause(&mut self) {
        if self.polls < SPIN_POLLS {
            self.polls += 1;
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(self.sleep).await;
            self.sleep = (self.sleep * 2).min(MAX_SLEEP);
        }
    }
}

/// A posted NIXL batch: the current segment's requests are in flight.
pub(crate) struct NixlInFlight {
    p: Arc<Prepared>,
    /// Segment whose requests are posted.
    seg: usize,
    /// Groups of `seg` still in flight.
    pending: Vec<usize>,
    deadline: Instant,
    /// Wait or abort ran to its end (the batch is no longer busy).
    finished: bool,
}

enum Poll {
    Done,
    Failed(Error),
    TimedOut,
}

impl NixlInFlight {
    /// Posts the first segment (every owner's request of it) and returns the handle; on a
    /// post failure drains what was posted and returns the error.
    pub(crate) async fn start(p: Arc<Prepared>) -> Result<NixlInFlight> {
        let timeout = p.shared.timeout;
        let mut f = NixlInFlight {
            p,
            seg: 0,
            pending: Vec::new(),
            deadline: Instant::now() + timeout,
            finished: false,
        };
        if f.p.dirty.load(Ordering::Acquire) {
            // A previous handle was dropped unwaited: its requests must be idle before they
            // are re-posted, so wait for them (bounded) here.
            let mut backoff = Backoff::new();
            while f
                .p
                .requests
                .lock()
                .as_ref()
                .is_some_and(|r| any_active(&f.p, r))
            {
                if Instant::now() >= f.deadline {
                    f.finish();
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        "an earlier post of this batch, dropped without wait, is still in flight",
                    )
                    .with_backend(BACKEND)
                    .set_retryable(true));
                }
                backoff.pause().await;
            }
            f.p.dirty.store(false, Ordering::Release);
        }
        let missing = f.p.requests.lock().is_none();
        if missing {
            match f.p.make_requests() {
                Ok(r) => *f.p.requests.lock() = Some(r),
                Err(e) => {
                    f.finish();
                    return Err(e);
                }
            }
        }
        f.p.posts.fetch_add(1, Ordering::Relaxed);
        if f.p.segments.is_empty() {
            return Ok(f);
        }
        if let Err(e) = f.post_segment(0) {
            f.drain().await;
            f.release();
            f.finish();
            return Err(e);
        }
        Ok(f)
    }

    /// Posts every request of segment `seg` before polling any.
    fn post_segment(&mut self, seg: usize) -> Result<()> {
        self.seg = seg;
        self.pending.clear();
        let reqs = self.p.requests.lock();
        let Some(reqs) = reqs.as_ref() else {
            return Err(
                Error::new(ErrorKind::Internal, "nixl requests missing at post")
                    .with_backend(BACKEND),
            );
        };
        for (g, req) in reqs[seg].iter().enumerate() {
            let group = &self.p.segments[seg][g];
            match self.p.shared.agent.post(req) {
                Ok(true) => self.pending.push(g),
                Ok(false) => {}
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::Transport,
                        format!("NIXL postXferReq (READ) failed: {}", status_name(&e)),
                    )
                    .with_owner(group.owner)
                    .with_range(group.range.clone())
                    .with_backend(BACKEND)
                    .with_source(e)
                    .set_retryable(true));
                }
            }
        }
        Ok(())
    }

    /// Polls the pending requests of the current segment once; returns the first failure.
    fn poll_once(&mut self) -> Result<()> {
        let reqs = self.p.requests.lock();
        let Some(reqs) = reqs.as_ref() else {
            self.pending.clear();
            return Ok(());
        };
        let mut first = None;
        let seg = self.seg;
        let p = &self.p;
        self.pending
            .retain(|&g| match p.shared.agent.done(&reqs[seg][g]) {
                Ok(done) => !done,
                Err(e) => {
                    let group = &p.segments[seg][g];
                    if first.is_none() {
                        first = Some(
                            Error::new(
                                ErrorKind::Transport,
                                format!("NIXL READ failed: {}", status_name(&e)),
                            )
                            .with_owner(group.owner)
                            .with_range(group.range.clone())
                            .with_backend(BACKEND)
                            .with_source(e)
                            .set_retryable(true),
                        );
                    }
                    false
                }
            });
        first.map_or(Ok(()), Err)
    }

    /// Polls until the current segment completes, fails or the deadline passes.
    async fn poll_segment(&mut self) -> Poll {
        let mut backoff = Backoff::new();
        loop {
            if let Err(e) = self.poll_once() {
                return Poll::Failed(e);
            }
            if self.pending.is_empty() {
                return Poll::Done;
            }
            if Instant::now() >= self.deadline {
                return Poll::TimedOut;
            }
            backoff.pause().await;
        }
    }

    /// Polls until nothing of the current segment is in flight (errors only end a request's
    /// wait), bounded by the deadline; false when the deadline passed first.
    async fn drain(&mut self) -> bool {
        let mut backoff = Backoff::new();
        while !self.pending.is_empty() {
            let _ = self.poll_once();
            if self.pending.is_empty() {
                break;
            }
            if Instant::now() >= self.deadline {
                return false;
            }
            backoff.pause().await;
        }
        true
    }

    /// Releases every request (NIXL cancels what is still active); the next post re-makes
    /// them from the prepared lists.
    fn release(&mut self) {
        let old = self.p.requests.lock().take();
        self.pending.clear();
        drop(old);
    }

    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.p.busy.store(false, Ordering::Release);
        }
    }

    fn timeout_error(&self) -> Error {
        let g = self.pending.first().map(|&g| &self.p.segments[self.seg][g]);
        let mut e = Error::new(
            ErrorKind::Timeout,
            format!(
                "NIXL READ did not complete within {} ms (status NIXL_IN_PROG); requests \
                 released",
                self.p.shared.timeout.as_millis()
            ),
        )
        .with_backend(BACKEND)
        .set_retryable(true);
        if let Some(g) = g {
            e = e.with_owner(g.owner).with_range(g.range.clone());
        }
        e
    }

    async fn run(&mut self) -> Result<WireReport> {
        loop {
            match self.poll_segment().await {
                Poll::Done => {}
                Poll::Failed(e) => {
                    // Let the other owners' reads finish before the requests go.
                    self.drain().await;
                    self.release();
                    return Err(e);
                }
                Poll::TimedOut => {
                    let e = self.timeout_error();
                    self.release();
                    return Err(e);
                }
            }
            let next = self.seg + 1;
            if next >= self.p.segments.len() {
                return Ok(self.p.report);
            }
            // Overlapping destinations: the next segment starts only after this one landed.
            if let Err(e) = self.post_segment(next) {
                self.drain().await;
                self.release();
                return Err(e);
            }
        }
    }
}

/// True when any request of `reqs` is still moving bytes.
fn any_active(p: &Prepared, reqs: &[Vec<crate::agent::Request>]) -> bool {
    reqs.iter()
        .flatten()
        // A request never posted reports an error here: it is idle.
        .any(|r| matches!(p.shared.agent.done(r), Ok(false)))
}

/// Waits (blocking, bounded by the timeout) until no request of `p` is active; for `Drop`,
/// where nothing can be awaited.
pub(crate) fn drain_blocking(p: &Prepared) {
    let deadline = Instant::now() + p.shared.timeout;
    let mut sleep = FIRST_SLEEP;
    loop {
        let active = p.requests.lock().as_ref().is_some_and(|r| any_active(p, r));
        if !active {
            return;
        }
        if Instant::now() >= deadline {
            tracing::warn!("nixl requests still active when their batch was dropped");
            return;
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(MAX_SLEEP);
    }
}

#[async_trait]
impl InFlight for NixlInFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        let r = self.run().await;
        self.finish();
        r
    }

    async fn abort(mut self: Box<Self>) {
        // NIXL cannot take back a one-sided read already handed to the fabric, so releasing
        // first would return while bytes still land: drain (no further segment is posted),
        // then release.
        let drained = self.drain().await;
        if !drained {
            tracing::warn!("nixl abort: reads still in flight at the timeout; releasing them");
        }
        self.release();
        self.finish();
    }
}

impl Drop for NixlInFlight {
    fn drop(&mut self) {
        if !self.finished {
            // Dropped without wait/abort: the next post (or the batch's drop) checks the
            // requests are idle before reusing or releasing them.
            if !self.pending.is_empty() {
                self.p.dirty.store(true, Ordering::Release);
            }
            self.finish();
        }
    }
}
