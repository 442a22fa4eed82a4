//! A fault-injecting transport: wraps any backend and, driven by a [`FaultSchedule`], makes the
//! k-th read of a posted batch (or the k-th post itself) fail, stall, land wrong bytes, land
//! short, or lose its peer, the way a real fabric does.
//!
//! Faults are injected by rewriting the batch the wrapped backend really moves, so every byte
//! still crosses the real transport: a failed read moves nothing, a truncated one moves its head
//! only (the tail keeps whatever the buffer held), a corrupted one moves one byte from the
//! neighbouring source byte. The wrapper counts what callers hold (registrations, prepared
//! batches, posted requests) so a test can assert that nothing leaks.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reshard_core::{
    Error, ErrorKind, InFlight, MemoryBlock, OwnerId, PreparedBatch, ReadBatch, ReadDesc,
    Registration, Result, Transport, WireReport,
};

/// What happens to the targeted read (or post).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The read moves nothing and the batch fails with a retryable `Transport` error naming its
    /// owner and remote byte range (after every other read completed).
    Fail,
    /// The batch completes `Duration` later than it would have.
    Delay(Duration),
    /// One byte of the read (at `at % len`) lands from the neighbouring source byte instead of
    /// its own; the transport reports success. Only digest verification can notice.
    Corrupt {
        /// Byte of the read to misdirect (taken modulo its length).
        at: u64,
    },
    /// Only the first `keep % len` bytes of the read move; the rest of the destination keeps
    /// its old bytes. With `report_error` the batch fails naming the missing range (a transport
    /// that notices); without, it reports full success (a lying short read).
    Truncate {
        /// Bytes that do move (taken modulo the read's length, so always short).
        keep: u64,
        /// Whether the transport reports the short read.
        report_error: bool,
    },
    /// The read's owner disconnects at this read: its later reads in the batch do not move, the
    /// batch is aborted and fails with a `Transport` error; afterwards the owner is unknown
    /// (`prepare`/`post` fail with `PeerUnknown`) until [`FaultyTransport::clear`] or a new
    /// `load_peer` for it.
    DropPeer,
    /// The post itself is refused: nothing is in flight, `Transport` error naming the owner and
    /// range of the targeted read.
    FailPost,
}

impl FaultKind {
    /// True when a transport that injects this fault must not report success.
    pub fn must_fail(self) -> bool {
        matches!(
            self,
            FaultKind::Fail
                | FaultKind::DropPeer
                | FaultKind::FailPost
                | FaultKind::Truncate {
                    report_error: true,
                    ..
                }
        )
    }
}

/// One planned fault: on the `post`-th post after [`FaultyTransport::set_schedule`] (0 = the
/// next), at read `read % reads` of that batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Which post (counted from 0 since the schedule was set).
    pub post: u64,
    /// Which read of the batch (taken modulo the batch's length).
    pub read: usize,
    /// What happens.
    pub kind: FaultKind,
}

/// The faults to inject, in any order; the first fault naming a read wins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultSchedule {
    /// The faults.
    pub faults: Vec<Fault>,
}

/// A fault that was injected, with the read it hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fired {
    /// The fault.
    pub kind: FaultKind,
    /// Owner of the read it hit.
    pub owner: OwnerId,
    /// Remote byte range of that read, in the owner's region.
    pub range: Range<u64>,
}

/// Counts what callers hold; shared with the guards that decrement on release.
#[derive(Debug, Default)]
struct Counts {
    registrations: AtomicU64,
    prepared: AtomicU64,
    in_flight: AtomicU64,
    abandoned: AtomicU64,
}

/// Decrements one counter when dropped.
struct Held {
    counts: Arc<Counts>,
    which: fn(&Counts) -> &AtomicU64,
}

impl Held {
    fn new(counts: &Arc<Counts>, which: fn(&Counts) -> &AtomicU64) -> Self {
        which(counts).fetch_add(1, Ordering::SeqCst);
        Held {
            counts: counts.clone(),
            which,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        (self.which)(&self.counts).fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Default)]
struct State {
    schedule: FaultSchedule,
    posts: u64,
    fired: Vec<Fired>,
    dropped: BTreeSet<OwnerId>,
}

/// Wraps a transport and injects the faults of a [`FaultSchedule`] (see the module docs).
#[derive(Debug)]
pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    state: Mutex<State>,
    counts: Arc<Counts>,
    /// Bumped when a peer drops or comes back, so prepared batches are rebuilt.
    epoch_bumps: AtomicU64,
}

/// What a [`FaultyTransport`] keeps in a [`PreparedBatch`]: the inner backend's batch and a
/// guard counting it.
struct Prepared {
    inner: PreparedBatch,
    _held: Held,
}

impl FaultyTransport {
    /// Wraps `inner` with no faults scheduled.
    pub fn new(inner: Arc<dyn Transport>) -> Self {
        FaultyTransport {
            inner,
            state: Mutex::new(State::default()),
            counts: Arc::new(Counts::default()),
            epoch_bumps: AtomicU64::new(0),
        }
    }

    /// Arms `schedule` (replacing any previous one) and restarts the post count and the log of
    /// fired faults. Dropped peers stay dropped.
    pub fn set_schedule(&self, schedule: FaultSchedule) {
        let mut s = self.state.lock();
        s.schedule = schedule;
        s.posts = 0;
        s.fired.clear();
    }

    /// Disarms every fault and brings dropped peers back.
    pub fn clear(&self) {
        let mut s = self.state.lock();
        s.schedule = FaultSchedule::default();
        s.posts = 0;
        s.fired.clear();
        if !s.dropped.is_empty() {
            s.dropped.clear();
            self.epoch_bumps.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The faults injected since the schedule was set, in order.
    pub fn fired(&self) -> Vec<Fired> {
        self.state.lock().fired.clone()
    }

    /// Owners currently disconnected by a [`FaultKind::DropPeer`].
    pub fn dropped_peers(&self) -> Vec<OwnerId> {
        self.state.lock().dropped.iter().copied().collect()
    }

    /// Registrations made through this wrapper and not yet released.
    pub fn live_registrations(&self) -> u64 {
        self.counts.registrations.load(Ordering::SeqCst)
    }

    /// Prepared batches made through this wrapper and not yet dropped.
    pub fn live_prepared(&self) -> u64 {
        self.counts.prepared.load(Ordering::SeqCst)
    }

    /// Posted batches not yet waited for, aborted or dropped.
    pub fn in_flight(&self) -> u64 {
        self.counts.in_flight.load(Ordering::SeqCst)
    }

    /// Posted batches dropped without `wait` or `abort` (a caller that lets requests leak).
    pub fn abandoned(&self) -> u64 {
        self.counts.abandoned.load(Ordering::SeqCst)
    }

    /// The error for a read of a dropped peer.
    fn unknown_peer(&self, r: &ReadDesc) -> Error {
        Error::new(
            ErrorKind::PeerUnknown,
            format!("peer {} disconnected; its metadata is gone", r.owner),
        )
        .with_owner(r.owner)
        .with_range(r.remote_offset..r.remote_offset + r.len)
        .with_backend(self.inner.name())
    }

    /// First read of a dropped owner in `batch`, if any.
    fn first_dropped<'a>(&self, batch: &'a ReadBatch) -> Option<&'a ReadDesc> {
        let s = self.state.lock();
        if s.dropped.is_empty() {
            return None;
        }
        batch.reads.iter().find(|r| s.dropped.contains(&r.owner))
    }
}

/// How one post goes, decided before anything moves.
struct Decision {
    /// Rewritten reads, when any fault changes what moves.
    rewrite: Option<Vec<ReadDesc>>,
    /// Delay before completion.
    delay: Duration,
    /// The error the batch ends with.
    error: Option<Error>,
    /// Abort instead of waiting (a peer vanished).
    abort: bool,
}

fn decide(batch: &ReadBatch, faults: &[Fault], backend: &'static str) -> (Decision, Vec<Fired>) {
    let n = batch.reads.len();
    let mut d = Decision {
        rewrite: None,
        delay: Duration::ZERO,
        error: None,
        abort: false,
    };
    let mut fired = Vec::new();
    if n == 0 {
        return (d, fired);
    }
    // One fault per read: the first one naming it.
    let mut per_read: Vec<Option<FaultKind>> = vec![None; n];
    for f in faults {
        let k = f.read % n;
        if per_read[k].is_none() {
            per_read[k] = Some(f.kind);
        }
    }
    let range = |r: &ReadDesc| r.remote_offset..r.remote_offset + r.len;
    let set_error = |d: &mut Decision, e: Error| {
        if d.error.is_none() {
            d.error = Some(e.with_backend(backend));
        }
    };
    // A post refused outright moves nothing; nothing else applies.
    if let Some(k) = per_read
        .iter()
        .position(|f| matches!(f, Some(FaultKind::FailPost)))
    {
        let r = &batch.reads[k];
        fired.push(Fired {
            kind: FaultKind::FailPost,
            owner: r.owner,
            range: range(r),
        });
        set_error(
            &mut d,
            Error::new(ErrorKind::Transport, "the post was refused; nothing moved")
                .with_owner(r.owner)
                .with_range(range(r))
                .set_retryable(true),
        );
        return (d, fired);
    }
    let mut reads = Vec::with_capacity(n + 2);
    let mut rewritten = false;
    // Owners that vanished at an earlier read of this batch: their later reads do not move.
    let mut gone: BTreeSet<OwnerId> = BTreeSet::new();
    for (r, fault) in batch.reads.iter().zip(&per_read) {
        if gone.contains(&r.owner) {
            rewritten = true;
            continue;
        }
        let Some(kind) = *fault else {
            reads.push(*r);
            continue;
        };
        fired.push(Fired {
            kind,
            owner: r.owner,
            range: range(r),
        });
        match kind {
            FaultKind::Fail => {
                rewritten = true;
                set_error(
                    &mut d,
                    Error::new(ErrorKind::Transport, "read failed on the wire")
                        .with_owner(r.owner)
                        .with_range(range(r))
                        .set_retryable(true),
                );
            }
            FaultKind::Delay(t) => {
                d.delay = d.delay.max(t);
                reads.push(*r);
            }
            FaultKind::Corrupt { at } => {
                rewritten = true;
                let j = at % r.len;
                // The neighbouring source byte, inside the read when it has two bytes or more.
                let from = if j + 1 < r.len {
                    r.remote_offset + j + 1
                } else if j > 0 {
                    r.remote_offset + j - 1
                } else if r.remote_offset > 0 {
                    r.remote_offset - 1
                } else {
                    r.remote_offset + 1
                };
                if j > 0 {
                    reads.push(ReadDesc { len: j, ..*r });
                }
                reads.push(ReadDesc {
                    remote_offset: from,
                    local_offset: r.local_offset + j,
                    len: 1,
                    ..*r
                });
                if j + 1 < r.len {
                    reads.push(ReadDesc {
                        remote_offset: r.remote_offset + j + 1,
                        local_offset: r.local_offset + j + 1,
                        len: r.len - j - 1,
                        ..*r
                    });
                }
            }
            FaultKind::Truncate { keep, report_error } => {
                rewritten = true;
                let keep = keep % r.len;
                if keep > 0 {
                    reads.push(ReadDesc { len: keep, ..*r });
                }
                if report_error {
                    set_error(
                        &mut d,
                        Error::new(
                            ErrorKind::Transport,
                            format!("short read: {keep} of {} bytes moved", r.len),
                        )
                        .with_owner(r.owner)
                        .with_range(r.remote_offset + keep..r.remote_offset + r.len)
                        .set_retryable(true),
                    );
                }
            }
            FaultKind::DropPeer => {
                rewritten = true;
                gone.insert(r.owner);
                d.abort = true;
                set_error(
                    &mut d,
                    Error::new(ErrorKind::Transport, "peer disconnected mid-batch")
                        .with_owner(r.owner)
                        .with_range(range(r))
                        .set_retryable(true),
                );
            }
            // Refused posts returned above; nothing more to do for one here.
            FaultKind::FailPost => reads.push(*r),
        }
    }
    if rewritten {
        d.rewrite = Some(reads);
    }
    (d, fired)
}

/// A posted batch under fault injection.
struct FaultyFlight {
    inner: Option<Box<dyn InFlight>>,
    /// A rewritten batch must outlive its transfer.
    _rewritten: Option<PreparedBatch>,
    decision: Decision,
    /// Bytes the caller's batch asked for (a lying short read reports them all).
    asked: WireReport,
    /// Set once `wait` or `abort` ran to the end.
    finished: bool,
    counts: Arc<Counts>,
    _held: Held,
}

impl Drop for FaultyFlight {
    fn drop(&mut self) {
        if !self.finished {
            self.counts.abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl InFlight for FaultyFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        if !self.decision.delay.is_zero() {
            tokio::time::sleep(self.decision.delay).await;
        }
        let inner = self.inner.take();
        if self.decision.abort {
            if let Some(i) = inner {
                i.abort().await;
            }
        } else if let Some(i) = inner {
            // Everything that does move lands before the injected error is reported.
            let done = i.wait().await;
            self.finished = true;
            done?;
        }
        self.finished = true;
        match self.decision.error.take() {
            Some(e) => Err(e),
            None => Ok(self.asked),
        }
    }

    async fn abort(mut self: Box<Self>) {
        if let Some(i) = self.inner.take() {
            i.abort().await;
        }
        self.finished = true;
    }
}

// Forwards what no fault touches; the rest counts, drops peers and injects the faults.
reshard_core::forward_transport!(FaultyTransport => inner {
    fn epoch(&self) -> u64 {
        self.inner
            .epoch()
            .wrapping_add(self.epoch_bumps.load(Ordering::SeqCst))
    }
    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let inner = self.inner.register(block).await?;
        let (id, len, kind) = (inner.id(), inner.len(), inner.kind());
        let held = Held::new(&self.counts, |c| &c.registrations);
        Ok(Registration::new(id, len, kind, move || {
            drop(inner);
            drop(held);
        }))
    }
    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        self.inner.load_peer(owner, metadata).await?;
        if self.state.lock().dropped.remove(&owner) {
            self.epoch_bumps.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        if let Some(r) = self.first_dropped(&batch) {
            return Err(self.unknown_peer(r));
        }
        let batch = Arc::new(batch);
        let inner = self.inner.prepare((*batch).clone()).await?;
        let held = Held::new(&self.counts, |c| &c.prepared);
        Ok(PreparedBatch::new(
            batch,
            self.inner.name(),
            Prepared { inner, _held: held },
        ))
    }
    async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let prepared = batch.state::<Prepared>().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidInput,
                "batch was not prepared by this fault-injecting transport",
            )
            .with_backend(self.inner.name())
        })?;
        let reads = batch.batch();
        if let Some(r) = self.first_dropped(reads) {
            return Err(self.unknown_peer(r));
        }
        let (decision, fired) = {
            let mut s = self.state.lock();
            let post = s.posts;
            s.posts += 1;
            let now: Vec<Fault> = s
                .schedule
                .faults
                .iter()
                .filter(|f| f.post == post)
                .copied()
                .collect();
            let (decision, fired) = decide(reads, &now, self.inner.name());
            for f in &fired {
                if f.kind == FaultKind::DropPeer {
                    s.dropped.insert(f.owner);
                }
            }
            s.fired.extend(fired.iter().cloned());
            (decision, fired)
        };
        if fired.iter().any(|f| f.kind == FaultKind::DropPeer) {
            self.epoch_bumps.fetch_add(1, Ordering::SeqCst);
        }
        let asked = WireReport {
            reads: reads.reads.len() as u64,
            bytes: reads.bytes(),
        };
        if fired.iter().any(|f| f.kind == FaultKind::FailPost) {
            return Err(decision.error.unwrap_or_else(|| {
                Error::new(ErrorKind::Internal, "refused post lost its error")
            }));
        }
        let (inner, rewritten) = match &decision.rewrite {
            None => (Some(self.inner.post(&prepared.inner).await?), None),
            Some(r) if r.is_empty() => (None, None),
            Some(r) => {
                let p = self.inner.prepare(ReadBatch { reads: r.clone() }).await?;
                (Some(self.inner.post(&p).await?), Some(p))
            }
        };
        Ok(Box::new(FaultyFlight {
            inner,
            _rewritten: rewritten,
            decision,
            asked,
            finished: false,
            counts: self.counts.clone(),
            _held: Held::new(&self.counts, |c| &c.in_flight),
        }))
    }
});

/// Schedules of one to three faults. The first always lands on the next post (the one every
/// update makes) and is never a mere delay, so every schedule injects a fault that changes what
/// the update sees; the other zero to two are of any kind, one in five on the post after (which
/// an update with a single post never reaches). Every kind of fault is represented.
pub fn schedule_strategy() -> impl Strategy<Value = FaultSchedule> {
    let delay = (0u64..1500).prop_map(|us| FaultKind::Delay(Duration::from_micros(us)));
    let effective = || {
        prop_oneof![
            3 => Just(FaultKind::Fail),
            4 => any::<u64>().prop_map(|at| FaultKind::Corrupt { at }),
            4 => (any::<u64>(), any::<bool>())
                .prop_map(|(keep, report_error)| FaultKind::Truncate { keep, report_error }),
            2 => Just(FaultKind::DropPeer),
            1 => Just(FaultKind::FailPost),
        ]
    };
    let kind = prop_oneof![12 => effective(), 2 => delay];
    let post = prop_oneof![4 => Just(0u64), 1 => Just(1u64)];
    let first = (any::<usize>(), effective()).prop_map(|(read, kind)| Fault {
        post: 0,
        read,
        kind,
    });
    let extra =
        (post, any::<usize>(), kind).prop_map(|(post, read, kind)| Fault { post, read, kind });
    (first, prop::collection::vec(extra, 0..=2)).prop_map(|(first, mut rest)| {
        rest.insert(0, first);
        FaultSchedule { faults: rest }
    })
}

/// True when the faults that fired could not have changed anything the update sees: none fired,
/// or only delays did. The fault property keeps such cases rare (see [`schedule_strategy`]).
pub fn is_no_op(fired: &[Fired]) -> bool {
    fired.iter().all(|f| matches!(f.kind, FaultKind::Delay(_)))
}
