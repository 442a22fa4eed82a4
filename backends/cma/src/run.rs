//! A posted batch: calls run by the endpoint's copy threads, and the [`InFlight`] handle that
//! waits for them, aborts them, or ends them when dropped (docs/in-flight-safety.md).
//!
//! A `process_vm_readv` cannot be interrupted, so a batch ends by closing its gate: no thread
//! starts another call of it, and the ending waits for the calls already running (each at most
//! `piece_bytes`). Threads claim a call as they enter the gate and leave after its last byte is
//! written, so "nothing inside and closed" means nothing of the batch can land.
//!
//! Every such wait (`wait`, `abort`, a dropped handle) is bounded by the no-progress timer
//! (rule 4): when no call has returned for `timeout_ms` since the batch was ended, the calls
//! still inside are quarantined (rule 3). Their job keeps the batch, and with it the peers and
//! the destination blocks, alive until they return, and the endpoint refuses, with a
//! quarantined error, every post that would write the bytes they may still write.

use async_trait::async_trait;
use rayon::ThreadPool;
use reshard_core::contract::span;
use reshard_core::gate::{BatchGate, GateGuard};
use reshard_core::{
    CompletionSink, Countdown, Error, ErrorKind, InFlight, OwnerId, ReadBatch, ReadDesc, Result,
    WireReport,
};
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;

use crate::peer::Peer;
use crate::plan::{self, Seg};
use crate::sys;
use crate::transport::Prepared;
use crate::SCHEME;

/// Most bytes one `process_vm_readv` moves when the batch carries a hash plan: small enough that
/// the block is still in this core's cache when its segments are hashed right after
/// (docs/in-flight-safety.md, "Hashing while copying"). A call of `piece_bytes` then takes
/// several system calls.
pub(crate) const HASH_BLOCK: u64 = 256 << 10;

/// One posted batch, shared by its copy jobs and its handle.
pub(crate) struct Run {
    /// Holds the peers (their pidfds) and the destination blocks alive while any job may run:
    /// a registration dropped meanwhile releases its block only after this (rule 2).
    prepared: Arc<Prepared>,
    batch: Arc<ReadBatch>,
    /// Which calls are running (a call's index is its ticket), whether the batch is closed,
    /// when a call last returned, and the batch's own state, under one lock.
    gate: BatchGate<RunState>,
    /// Signalled after every call (progress, failure) and when the gate empties.
    progress: Notify,
    /// Test-only: the read whose segments are left out (never read nor counted).
    skip: Option<u32>,
    /// Where reads are reported once every segment of theirs has been moved
    /// (`Transport::post_reporting`), with the bytes each still waits for: a read cut over
    /// several calls completes with whichever call moves its last byte.
    completions: Option<(CompletionSink, Countdown)>,
}

/// What the gate keeps besides the calls inside (at most one per copy thread), the close and
/// the time a call last returned (or the batch started), which the no-progress timer reads.
#[derive(Default)]
struct RunState {
    /// Next call to claim.
    next: usize,
    done_calls: usize,
    counted: WireReport,
    error: Option<Error>,
    /// An ending gave up waiting for the calls inside: until they return, the bytes they
    /// write are quarantined.
    quarantined: bool,
}

type Locked<'a> = GateGuard<'a, RunState>;

impl Run {
    pub(crate) fn new(
        prepared: Arc<Prepared>,
        batch: Arc<ReadBatch>,
        skip: Option<u32>,
        sink: Option<CompletionSink>,
    ) -> Self {
        let completions =
            sink.map(|sink| (sink, Countdown::new(batch.reads.iter().map(|r| r.len))));
        Run {
            completions,
            prepared,
            batch,
            gate: BatchGate::default(),
            progress: Notify::new(),
            skip,
        }
    }

    /// Stops the batch: no call starts after this; `why` becomes its error unless it already
    /// failed.
    pub(crate) fn close(&self, why: impl FnOnce() -> Error) {
        let mut st = self.gate.lock();
        // Only the first close names the error, and only if the batch has not failed already.
        if st.close() && st.error.is_none() && st.done_calls < self.prepared.calls.calls.len() {
            st.error = Some(why());
        }
        drop(st);
        self.progress.notify_one();
    }

    /// Blocks until no job is inside the gate (call after [`Run::close`]), or until no call
    /// has returned for `bound` since the batch was closed: then the calls still inside are
    /// quarantined and the description of what is kept is returned.
    fn drain_blocking(&self, bound: Duration) -> std::result::Result<(), String> {
        self.gate
            .drain(bound)
            .map_err(|mut st| self.quarantine(&mut st))
    }

    /// Marks the calls inside quarantined; returns what is kept, for errors and logs.
    fn quarantine(&self, st: &mut Locked<'_>) -> String {
        st.quarantined = true;
        let ranges: Vec<String> = self
            .segs_of(st.inside())
            .map(|s| format!("{:#x}..{:#x}", s.local, s.local + s.len))
            .collect();
        format!(
            "{} process_vm_readv call(s) of this batch have not returned; the destination \
             bytes they may still write (addresses {}) are quarantined: kept alive, and posts \
             that write them are refused until the calls return",
            st.inside().len(),
            ranges.join(", ")
        )
    }

    fn segs_of<'a>(&'a self, calls: &'a [usize]) -> impl Iterator<Item = &'a Seg> + 'a {
        let c = &self.prepared.calls;
        calls
            .iter()
            .flat_map(move |&i| &c.segs[c.calls[i].segs.clone()])
    }

    /// Destination bytes that quarantined calls of this batch may still write (empty when it
    /// has no quarantined call running any more).
    pub(crate) fn quarantined_ranges(&self) -> Vec<Range<u64>> {
        let st = self.gate.lock();
        if !st.quarantined {
            return Vec::new();
        }
        self.segs_of(st.inside())
            .map(|s| s.local..s.local + s.len)
            .collect()
    }

    /// The owner and remote range of the first read a running call of this batch moves.
    fn running_read(&self, st: &Locked<'_>) -> Option<(OwnerId, Range<u64>)> {
        let seg = self.segs_of(st.inside()).next()?;
        let c = &self.prepared.calls;
        let call = st.inside().first().map(|&i| &c.calls[i])?;
        let owner = self.prepared.peers.get(call.peer as usize)?.0;
        let r = self.batch.reads.get(seg.read as usize)?;
        Some((owner, remote_range(r)))
    }

    /// The loop of one copy job: claim calls until none is left or the gate is closed.
    pub(crate) fn work(&self) {
        let n = self.prepared.calls.calls.len();
        loop {
            let i = {
                let mut st = self.gate.lock();
                if st.next >= n {
                    return;
                }
                let i = st.next;
                if !st.enter(i) {
                    return;
                }
                st.next += 1;
                i
            };
            let r = self.execute(i);
            let mut st = self.gate.lock();
            if r.is_ok() && !st.quarantined {
                // Reported under the state lock and while the call still counts as inside:
                // an ending either waits for these reports or has quarantined the call first
                // (and then nothing of it is reported), so no report follows the batch's end.
                self.report(i);
            }
            // A call that returned is progress, whether it moved its bytes or failed.
            st.leave(i);
            match r {
                Ok(c) => {
                    st.done_calls += 1;
                    st.counted.reads += c.reads;
                    st.counted.bytes += c.bytes;
                }
                Err(e) => {
                    st.close();
                    st.error.get_or_insert(e);
                }
            }
            drop(st);
            self.progress.notify_one();
        }
    }

    /// Reports every read whose last byte call `i` moved (skipped segments moved nothing).
    fn report(&self, i: usize) {
        let Some((sink, left)) = &self.completions else {
            return;
        };
        let c = &self.prepared.calls;
        for s in &c.segs[c.calls[i].segs.clone()] {
            if self.skip != Some(s.read) && left.landed(s.read as usize, s.len) {
                sink.complete(s.read as usize);
            }
        }
    }

    /// Runs call `i`: one `process_vm_readv`, continued after a short transfer until every byte
    /// moved or the kernel refuses, then a check that the process read from is still the one
    /// the metadata named.
    fn execute(&self, i: usize) -> Result<WireReport> {
        let st = &self.prepared;
        let call = &st.calls.calls[i];
        let all = &st.calls.segs[call.segs.clone()];
        let (owner, peer) = (
            &st.peers[call.peer as usize].0,
            &st.peers[call.peer as usize].1,
        );
        let kept;
        let segs: &[Seg] = match self.skip {
            Some(skip) if all.iter().any(|s| s.read == skip) => {
                kept = all
                    .iter()
                    .filter(|s| s.read != skip)
                    .copied()
                    .collect::<Vec<_>>();
                &kept
            }
            _ => all,
        };
        let total: u64 = segs.iter().map(|s| s.len).sum();
        // One hasher per segment (a contiguous part of one read) when the batch carries a
        // hash plan: each system call then moves one block, hashed right after it lands.
        let sink = self
            .completions
            .as_ref()
            .map(|(s, _)| s)
            .filter(|s| s.hashes());
        let mut hashers: Vec<_> = match sink {
            Some(s) => segs
                .iter()
                .map(|g| s.piece_hasher(g.read as usize, g.off))
                .collect(),
            None => Vec::new(),
        };
        let block = if sink.is_some() { HASH_BLOCK } else { u64::MAX };
        let mut done = 0u64;
        while done < total {
            let (remote, local) = plan::spans_upto(segs, done, block);
            // SAFETY: every local span lies inside a destination block registered on this
            // endpoint (checked at prepare, re-checked at post when the epoch moved) and kept
            // alive by `self.prepared`; while the batch is in flight nobody else touches those
            // bytes (MemoryBlock contract), and spans written concurrently by other jobs are
            // disjoint (validated at prepare: destinations of one batch never overlap).
            let n = match unsafe { sys::read_from(peer.pid, &local, &remote) } {
                Ok(0) => Err(io::Error::from_raw_os_error(libc::EFAULT)),
                Ok(n) => Ok(n as u64),
                Err(e) => Err(e),
            };
            match n {
                Ok(n) => {
                    let from = done;
                    done += n;
                    hash_landed(segs, &mut hashers, from, done);
                }
                Err(e) => {
                    let seg = plan::seg_at(segs, done);
                    return Err(self.os_error(*owner, peer, seg, e));
                }
            }
        }
        if !peer.is_same_process() {
            // The bytes may come from a process that reused the pid after the publisher
            // exited: refuse them (the batch fails, so they are never installed).
            let e = Error::new(
                ErrorKind::Transport,
                format!(
                    "publisher process {} of owner {owner} (agent {:?}) exited during the read",
                    peer.pid, peer.agent
                ),
            );
            return Err(self.name_read(e, *owner, segs.first()));
        }
        Ok(WireReport {
            reads: segs.iter().filter(|s| s.last).count() as u64,
            bytes: done,
        })
    }

    /// Names owner, the read's remote byte range and the backend.
    fn name_read(&self, e: Error, owner: OwnerId, seg: Option<&Seg>) -> Error {
        let e = e.with_owner(owner).with_backend(SCHEME);
        match seg.and_then(|s| self.batch.reads.get(s.read as usize)) {
            Some(r) => e.with_range(remote_range(r)),
            None => e,
        }
    }

    fn os_error(&self, owner: OwnerId, peer: &Peer, seg: Option<&Seg>, e: io::Error) -> Error {
        let pid = peer.pid;
        let (kind, msg) = match e.raw_os_error() {
            Some(libc::EPERM) => (ErrorKind::Unsupported, permission_denied(owner, peer)),
            Some(libc::ESRCH) => (
                ErrorKind::Transport,
                format!(
                    "publisher process {pid} of owner {owner} (agent {:?}) is gone",
                    peer.agent
                ),
            ),
            Some(libc::EFAULT) => (
                ErrorKind::Transport,
                format!(
                    "bytes of owner {owner} are not mapped in process {pid} any more (the \
                     publisher deregistered or freed them after exporting its metadata)"
                ),
            ),
            _ => (
                ErrorKind::Transport,
                format!("process_vm_readv from process {pid} of owner {owner} failed"),
            ),
        };
        self.name_read(Error::new(kind, msg).with_source(e), owner, seg)
            .set_retryable(false)
    }
}

/// The bytes of the owner's region a read spans, which errors name: a gather's rows from the
/// first to the last, not its length.
pub(crate) fn remote_range(r: &ReadDesc) -> Range<u64> {
    span(r.remote_offset, r.remote_span().unwrap_or(r.len))
}

/// Feeds the hashers of the segments (of one call) that bytes `from..to` of the call's stream
/// reached, each with its segment's destination bytes landed so far.
fn hash_landed(
    segs: &[Seg],
    hashers: &mut [Option<reshard_core::PieceHasher<'_>>],
    from: u64,
    to: u64,
) {
    let mut at = 0u64;
    for (s, h) in segs.iter().zip(hashers.iter_mut()) {
        let (start, end) = (at, at + s.len);
        at = end;
        if end <= from {
            continue;
        }
        if start >= to {
            break;
        }
        if let Some(h) = h {
            let landed = to.min(end) - start;
            // SAFETY: the segment's local bytes lie inside a destination block registered on
            // this endpoint and kept alive by the batch (checked at prepare); the system call
            // that returned just before this wrote its first `landed` bytes, on this thread,
            // and no one else writes them while the batch is in flight (destinations of one
            // batch are disjoint), so a shared view is sound. The hashes are of the bytes as
            // they landed, read back after the copy.
            let bytes = unsafe {
                std::slice::from_raw_parts(s.local as usize as *const u8, landed as usize)
            };
            h.landed(bytes);
        }
    }
}

/// Why the kernel refuses to let this process read `peer`, and what to change.
pub(crate) fn permission_denied(owner: OwnerId, peer: &Peer) -> String {
    let scope = match sys::ptrace_scope() {
        Some(1) => "Yama ptrace_scope is 1: the publisher must allow readers (cma option \
                    allow_any_reader = true) or be a child of this process"
            .to_string(),
        Some(s) if s >= 2 => {
            format!("Yama ptrace_scope is {s}: only CAP_SYS_PTRACE may read other processes")
        }
        _ => "Yama does not restrict it here".to_string(),
    };
    format!(
        "not permitted to read process {} of owner {owner} (agent {:?}): {scope}; other \
         causes are a different user or a setuid publisher, or a container without \
         CAP_SYS_PTRACE or whose seccomp profile forbids process_vm_readv",
        peer.pid, peer.agent
    )
}

/// The handle of a posted batch.
pub(crate) struct CmaInFlight {
    run: Arc<Run>,
    timeout: Duration,
    /// The batch has ended (reported, or quarantined and reported): dropping does nothing.
    finished: bool,
    /// The threads outlive the queued jobs even if the endpoint is dropped meanwhile.
    _pool: Arc<ThreadPool>,
}

impl CmaInFlight {
    pub(crate) fn start(
        run: Arc<Run>,
        pool: Arc<ThreadPool>,
        lanes: usize,
        timeout: Duration,
    ) -> Self {
        let jobs = lanes.min(run.prepared.calls.calls.len());
        for _ in 0..jobs {
            let run = Arc::clone(&run);
            pool.spawn(move || run.work());
        }
        CmaInFlight {
            run,
            timeout,
            finished: false,
            _pool: pool,
        }
    }

    /// Waits until the batch is over: every call done, or closed with nothing inside.
    ///
    /// The no-progress bound closes an open batch when no call returned for `timeout`. Once
    /// the batch is closed (by that, a failure, `abort` or the endpoint's drop), the calls
    /// inside are waited for while they keep returning; when none has returned for another
    /// `timeout` (a read the kernel does not finish, e.g. a remote page that never faults in),
    /// they are quarantined and the batch ends with a quarantined `Timeout`.
    async fn settle(&mut self) -> Result<WireReport> {
        let n = self.run.prepared.calls.calls.len();
        loop {
            let notified = self.run.progress.notified();
            let wait_for = {
                let mut st = self.run.gate.lock();
                if st.done_calls == n && st.inside().is_empty() {
                    self.finished = true;
                    return Ok(st.counted);
                }
                if st.is_closed() && st.inside().is_empty() {
                    self.finished = true;
                    return Err(st.error.take().unwrap_or_else(|| {
                        Error::new(ErrorKind::Aborted, "batch aborted").with_backend(SCHEME)
                    }));
                }
                let idle = st.idle_since_end();
                if idle < self.timeout {
                    self.timeout - idle
                } else if st.close() {
                    let timeout = self.timeout;
                    st.error.get_or_insert_with(|| {
                        Error::new(
                            ErrorKind::Timeout,
                            format!("no read of the batch completed for {timeout:?}"),
                        )
                        .with_backend(SCHEME)
                        .set_retryable(true)
                    });
                    continue;
                } else {
                    self.finished = true;
                    let why = st.error.take().unwrap_or_else(|| {
                        Error::new(ErrorKind::Timeout, "batch stalled").with_backend(SCHEME)
                    });
                    let what = self.run.quarantine(&mut st);
                    let mut e = Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "no process_vm_readv of this batch returned for {:?} after the batch \
                             ended ({why}); {what}",
                            self.timeout
                        ),
                    )
                    .with_backend(SCHEME);
                    if let Some((owner, range)) = self.run.running_read(&st) {
                        e = e.with_owner(owner).with_range(range);
                    }
                    return Err(e.set_quarantined());
                }
            };
            let _ = tokio::time::timeout(wait_for, notified).await;
        }
    }
}

/// Runs `f`, which blocks, letting a multi-thread tokio runtime move its other tasks off this
/// worker thread meanwhile (`block_in_place`); elsewhere (no runtime, a current-thread
/// runtime) `f` simply runs.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[async_trait]
impl InFlight for CmaInFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        self.settle().await
    }

    async fn abort(mut self: Box<Self>) {
        self.run.close(|| {
            Error::new(ErrorKind::Aborted, "batch aborted")
                .with_backend(SCHEME)
                .set_retryable(true)
        });
        // Bounded like `wait` (rule 4); abort has no error to return, so a quarantine is
        // logged (and reported to every later post into those bytes).
        if let Err(e) = self.settle().await {
            if e.is_quarantined() {
                tracing::warn!("cma abort: {e}");
            }
        }
    }
}

impl Drop for CmaInFlight {
    fn drop(&mut self) {
        // Dropped without wait/abort, or with their future dropped part-way: no call starts
        // any more, and the ones running (at most one per copy thread, each at most
        // piece_bytes) are waited out, so no byte lands after the drop (rule 1). The wait is
        // bounded by the no-progress timer (rule 4): calls that do not return are quarantined
        // (rule 3); a drop has no error to return, so that is logged as an error.
        if !self.finished {
            self.run
                .close(|| Error::new(ErrorKind::Aborted, "batch dropped"));
            let timeout = self.timeout;
            if let Err(what) = blocking(|| self.run.drain_blocking(timeout)) {
                tracing::error!("cma batch dropped in flight: {what}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_core::{HashPlan, SegmentTask};

    /// Blocks landing in steps that cut segments (of one call's two segments, the second a
    /// part of its read from offset 100): every planned segment is hashed once its last byte
    /// landed, from the landed bytes, and one reaching past its segment never is.
    #[test]
    fn blocks_hash_the_segments_they_complete() {
        let dst: Vec<u8> = (0..600u32).map(|i| (i * 13 % 256) as u8).collect();
        let base = dst.as_ptr() as u64;
        let segs = [
            Seg {
                read: 0,
                remote: 0,
                local: base,
                off: 0,
                len: 300,
                last: true,
                src: plan::Source::at(0),
            },
            Seg {
                read: 1,
                remote: 0,
                local: base + 300,
                off: 100,
                len: 300,
                last: false,
                src: plan::Source::at(0),
            },
        ];
        let t = |offset, len, slot| (offset, len, slot);
        let plan = HashPlan::new(
            2,
            6,
            [
                (0, t(0, 120, 0)),
                (0, t(120, 180, 1)),
                (1, t(50, 10, 2)),
                (1, t(100, 250, 3)),
                (1, t(350, 50, 4)),
                (1, t(390, 20, 5)),
            ]
            .map(|(r, (offset, len, slot))| (r, SegmentTask { offset, len, slot })),
        );
        let mut hashers: Vec<_> = segs
            .iter()
            .map(|g| Some(plan.piece(g.read as usize, g.off)))
            .collect();
        for (from, to) in [(0, 100), (100, 350), (350, 500), (500, 600)] {
            hash_landed(&segs, &mut hashers, from, to);
        }
        let h = |r: std::ops::Range<usize>| {
            let mut f = reshard_core::SegmentFold::new();
            f.segment(&dst[r]);
            Some(u64::from_le_bytes(f.hashes().try_into().unwrap()))
        };
        assert_eq!(plan.hash(0, 120), h(0..120));
        assert_eq!(plan.hash(1, 180), h(120..300));
        assert_eq!(plan.hash(2, 10), None, "before this piece");
        // Read 1's offset 100 is the call's byte 300.
        assert_eq!(plan.hash(3, 250), h(300..550));
        assert_eq!(plan.hash(4, 50), h(550..600));
        assert_eq!(plan.hash(5, 20), None, "reaches past the piece");
    }
}
