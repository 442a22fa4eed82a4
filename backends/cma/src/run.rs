//! A posted batch: calls run by the endpoint's copy threads, and the [`InFlight`] handle that
//! waits for them, aborts them, or ends them when dropped (docs/in-flight-safety.md).
//!
//! A `process_vm_readv` cannot be interrupted, so a batch ends by closing its gate: no thread
//! starts another call of it, and the ending waits for the calls already running (each at most
//! `piece_bytes`). Threads enter the gate before they claim a call and leave after its last
//! byte is written, so "nothing inside and closed" means nothing of the batch can land.

use async_trait::async_trait;
use parking_lot::{Condvar, Mutex};
use rayon::ThreadPool;
use reshard_core::{Error, ErrorKind, InFlight, OwnerId, ReadBatch, Result, WireReport};
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

use crate::peer::Peer;
use crate::plan::{self, Seg};
use crate::sys;
use crate::transport::Prepared;
use crate::SCHEME;

/// One posted batch, shared by its copy jobs and its handle.
pub(crate) struct Run {
    /// Holds the peers (their pidfds) and the destination blocks alive while any job may run:
    /// a registration dropped meanwhile releases its block only after this (rule 2).
    prepared: Arc<Prepared>,
    batch: Arc<ReadBatch>,
    /// Next call to claim.
    next: AtomicUsize,
    state: Mutex<RunState>,
    /// Signalled when the last job inside the gate leaves.
    left: Condvar,
    /// Signalled after every call (progress, failure) and when the gate empties.
    progress: Notify,
    /// Test-only: the read whose segments are left out (never read nor counted).
    skip: Option<u32>,
}

struct RunState {
    closed: bool,
    inside: usize,
    done_calls: usize,
    counted: WireReport,
    error: Option<Error>,
    last_progress: Instant,
}

impl Run {
    pub(crate) fn new(prepared: Arc<Prepared>, batch: Arc<ReadBatch>, skip: Option<u32>) -> Self {
        Run {
            prepared,
            batch,
            next: AtomicUsize::new(0),
            state: Mutex::new(RunState {
                closed: false,
                inside: 0,
                done_calls: 0,
                counted: WireReport::default(),
                error: None,
                last_progress: Instant::now(),
            }),
            left: Condvar::new(),
            progress: Notify::new(),
            skip,
        }
    }

    /// Stops the batch: no call starts after this; `why` becomes its error unless it already
    /// failed.
    pub(crate) fn close(&self, why: impl FnOnce() -> Error) {
        let mut st = self.state.lock();
        if !st.closed {
            st.closed = true;
            if st.error.is_none() && st.done_calls < self.prepared.calls.calls.len() {
                st.error = Some(why());
            }
        }
        drop(st);
        self.progress.notify_one();
    }

    /// Blocks until no job is inside the gate (call after [`Run::close`]).
    fn drain_blocking(&self) {
        let mut st = self.state.lock();
        while st.inside > 0 {
            self.left.wait(&mut st);
        }
    }

    /// The loop of one copy job: claim calls until none is left or the gate is closed.
    pub(crate) fn work(&self) {
        let n = self.prepared.calls.calls.len();
        loop {
            {
                let mut st = self.state.lock();
                if st.closed {
                    return;
                }
                st.inside += 1;
            }
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let r = (i < n).then(|| self.execute(i));
            let mut st = self.state.lock();
            st.inside -= 1;
            match &r {
                Some(Ok(c)) => {
                    st.done_calls += 1;
                    st.counted.reads += c.reads;
                    st.counted.bytes += c.bytes;
                    st.last_progress = Instant::now();
                }
                Some(Err(_)) => st.closed = true,
                None => {}
            }
            if let Some(Err(e)) = r {
                st.error.get_or_insert(e);
            }
            if st.inside == 0 {
                self.left.notify_all();
            }
            drop(st);
            self.progress.notify_one();
            if i >= n {
                return;
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
        let mut done = 0u64;
        while done < total {
            let (remote, local) = plan::spans(segs, done);
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
                Ok(n) => done += n,
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
            Some(r) => e.with_range(r.remote_offset..r.remote_offset.saturating_add(r.len)),
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

    /// Waits until the batch is over: every call done, or closed with nothing inside. The
    /// no-progress bound closes the batch when no call completed for `timeout`; if a call is
    /// still inside another `timeout` later (a read the kernel does not finish, e.g. a remote
    /// page that never faults in), the batch is reported quarantined: its memory stays with
    /// the running job.
    async fn settle(&mut self, aborting: bool) -> Result<WireReport> {
        let n = self.run.prepared.calls.calls.len();
        let mut closed_at: Option<Instant> = None;
        loop {
            let notified = self.run.progress.notified();
            let wait_for = {
                let mut st = self.run.state.lock();
                if st.done_calls == n && st.inside == 0 {
                    self.finished = true;
                    return Ok(st.counted);
                }
                if st.closed && st.inside == 0 {
                    self.finished = true;
                    return Err(st.error.take().unwrap_or_else(|| {
                        Error::new(ErrorKind::Aborted, "batch aborted").with_backend(SCHEME)
                    }));
                }
                let now = Instant::now();
                if st.closed {
                    let at = *closed_at.get_or_insert(now);
                    if !aborting && now.duration_since(at) >= self.timeout {
                        self.finished = true;
                        let e = st.error.take().unwrap_or_else(|| {
                            Error::new(ErrorKind::Timeout, "batch stalled").with_backend(SCHEME)
                        });
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "a process_vm_readv of this batch has not returned {:?} after \
                                 the batch ended ({e}); its destination memory is kept and \
                                 must not be reused",
                                self.timeout
                            ),
                        )
                        .with_backend(SCHEME)
                        .set_quarantined());
                    }
                    self.timeout.saturating_sub(now.duration_since(at))
                } else {
                    let idle = now.duration_since(st.last_progress);
                    if idle >= self.timeout {
                        st.closed = true;
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
                    }
                    self.timeout - idle
                }
            };
            let _ = tokio::time::timeout(wait_for, notified).await;
        }
    }
}

#[async_trait]
impl InFlight for CmaInFlight {
    async fn wait(mut self: Box<Self>) -> Result<WireReport> {
        self.settle(false).await
    }

    async fn abort(mut self: Box<Self>) {
        self.run.close(|| {
            Error::new(ErrorKind::Aborted, "batch aborted")
                .with_backend(SCHEME)
                .set_retryable(true)
        });
        let _ = self.settle(true).await;
    }
}

impl Drop for CmaInFlight {
    fn drop(&mut self) {
        // Dropped without wait/abort, or with their future dropped part-way: no call starts
        // any more, and the ones running (at most one per copy thread, each at most
        // piece_bytes) are waited out, so no byte lands after the drop (rule 1).
        if !self.finished {
            self.run
                .close(|| Error::new(ErrorKind::Aborted, "batch dropped"));
            self.run.drain_blocking();
        }
    }
}
