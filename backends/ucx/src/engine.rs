//! The progress thread of one endpoint: it owns the UCP worker, endpoints, memory
//! registrations, remote keys, prepared batches and every outstanding request, and is the
//! only thread that ever calls UCX for them (the context is the process-wide, thread-safe one
//! of the endpoint's configuration). The async [`crate::UcxTransport`] talks to it
//! through a [`Mailbox`] (a channel plus an eventfd that wakes it) and gets answers on
//! oneshot channels.
//!
//! While reads are outstanding the thread progresses the worker, spinning briefly when
//! nothing happens; then it arms the worker's event fd and sleeps in `poll` on that fd and
//! the mailbox's eventfd, so an idle endpoint (a publisher waiting for reads, a receiver
//! between updates) costs no CPU.
//!
//! A batch is answered only once it is quiet (no get outstanding). Ending one early (abort, a
//! dropped handle, the no-progress timeout, shutdown) stops its copies and force-closes the
//! endpoints its gets are outstanding on, since UCX cannot cancel a get; gets that still do not
//! complete are quarantined with everything they use (README, "In-flight safety").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex};
use reshard_core::contract::{self, span, RemoteLookup};
use reshard_core::{
    Error, ErrorKind, ExecutionLog, MemoryBlock, MemoryKind, OwnerId, ReadBatch, ReadDesc, Result,
    WireReport,
};
use rustix::event::{PollFd, PollFlags, Timespec};
use tokio::sync::oneshot;

use crate::alloc::Allocation;
use crate::maps::Maps;
use crate::meta::{EndpointMeta, RegionMeta};
use crate::plan::{issue_plan, IssuePlan};
use crate::raw::{self, Context, Endpoint, GetOp, MemHandle, RKey, Started};
use crate::raw::{Request, Ucx, UcxStatusError, Worker};
use crate::BACKEND;

/// Reads longer than this are issued as several pieces, so one large read is pipelined (and
/// spread over the in-flight window) instead of served as one long operation.
const MAX_PIECE: u64 = 16 << 20;
/// Bytes of direct reads copied between two looks at the mailbox (~30 ms at memory speed).
const DIRECT_BYTES: usize = 256 << 20;
/// Busy-poll this long after the last event before sleeping on the event fd.
const SPIN: Duration = Duration::from_micros(50);
/// Sleep this long while the worker was active within [`HOT`].
const MIN_NAP: Duration = Duration::from_micros(50);
/// How long after its last activity a worker keeps napping only [`MIN_NAP`].
const HOT: Duration = Duration::from_millis(100);
/// Sleep at most this long while reads are outstanding (timeouts are checked between sleeps).
const BUSY_NAP: Duration = Duration::from_millis(5);
/// Sleep at most this long when idle (a safety net; events and commands wake the thread).
const IDLE_NAP: Duration = Duration::from_secs(1);
/// Most `ucp_worker_progress` rounds in a row before the thread looks at its mailbox again
/// (a worker with a steady stream of events must not starve aborts and other commands).
const PROGRESS_ROUNDS: usize = 64;
/// Connection set-up (wire-up) is bounded by the timeout, but never by less than this: it
/// takes round trips between two processes' progress threads.
const CONNECT_MIN: Duration = Duration::from_secs(1);
/// After endpoints were force-closed, shutdown keeps progressing the worker until it has
/// been silent this long (the peers stopped sending replies for the ended reads) ...
const DRAIN_SILENCE: Duration = Duration::from_millis(100);
/// ... but for no longer than this.
const DRAIN_MAX: Duration = Duration::from_secs(10);

type Reply<T> = oneshot::Sender<Result<T>>;

/// Unit tests only: force-closing an endpoint does nothing, so its gets run on as a get
/// that cannot be stopped would (to exercise quarantine).
#[cfg(test)]
pub(crate) static TEST_IGNORE_FORCE_CLOSE: AtomicBool = AtomicBool::new(false);

/// A request to the progress thread.
pub(crate) enum Cmd {
    /// Register a block; answers `(region id, length)`.
    Register {
        block: Arc<dyn MemoryBlock>,
        reply: Reply<u64>,
    },
    /// Drop a registration (from `Registration`'s release; nobody waits).
    Deregister { id: u64 },
    /// Encode this endpoint's metadata.
    Export { reply: Reply<Bytes> },
    /// Connect to a peer and unpack its keys, replacing what `owner` had.
    LoadPeer {
        owner: OwnerId,
        meta: EndpointMeta,
        reply: Reply<()>,
    },
    /// Validate and resolve a batch, kept under `id` until `Forget`.
    Prepare {
        id: u64,
        batch: Arc<ReadBatch>,
        reply: Reply<usize>,
    },
    /// The `PreparedBatch` of `id` was dropped.
    Forget { id: u64 },
    /// Start prepared batch `prepared` as in-flight batch `batch`; `ack` answers once the
    /// first window of reads (every owner's) is issued, `done` when all completed.
    Post {
        prepared: u64,
        batch: u64,
        signal: Arc<BatchSignal>,
        ack: Reply<()>,
        done: Reply<WireReport>,
    },
    /// End `batch` as abort does: stop issuing and copying, force-close the endpoints its
    /// gets are outstanding on and answer `done` (and signal quiet) once none is left, or
    /// once they are quarantined.
    Cancel { batch: u64 },
}

/// What a posted batch's handle ([`crate::transport`]'s in-flight batch) and the progress
/// thread share: the stop flag the shared-memory copies check between pieces, and the
/// *quiet* signal, set once no byte of the batch can land any more (every get completed), or
/// once its remaining gets were quarantined.
pub(crate) struct BatchSignal {
    stop: AtomicBool,
    quiet: Mutex<bool>,
    cv: Condvar,
}

impl BatchSignal {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(BatchSignal {
            stop: AtomicBool::new(false),
            quiet: Mutex::new(false),
            cv: Condvar::new(),
        })
    }

    /// Stops the batch's copies before their next piece (the progress thread ends the rest).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn set_quiet(&self) {
        *self.quiet.lock() = true;
        self.cv.notify_all();
    }

    /// Blocks until the batch is quiet; false if the progress thread died first (it answers
    /// every batch before it stops, so this only happens after a panic there).
    pub(crate) fn wait_quiet(&self, alive: &AtomicBool) -> bool {
        let mut quiet = self.quiet.lock();
        while !*quiet {
            if !alive.load(Ordering::Acquire) {
                return false;
            }
            self.cv.wait_for(&mut quiet, Duration::from_millis(50));
        }
        true
    }
}

/// The sending side of the progress thread's queue; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub(crate) struct Mailbox {
    tx: mpsc::Sender<Option<Cmd>>,
    wake: Arc<OwnedFd>,
    alive: Arc<AtomicBool>,
}

impl Mailbox {
    /// Cleared when the progress thread exits (also by a panic).
    pub(crate) fn alive(&self) -> &AtomicBool {
        &self.alive
    }

    /// Queues `cmd` and wakes the thread; false when the thread has stopped.
    pub(crate) fn send(&self, cmd: Cmd) -> bool {
        self.push(Some(cmd))
    }

    /// Asks the thread to stop (after ending every running batch as abort does).
    pub(crate) fn shutdown(&self) {
        self.push(None);
    }

    fn push(&self, cmd: Option<Cmd>) -> bool {
        if self.tx.send(cmd).is_err() {
            return false;
        }
        // An eventfd counter only overflows after 2^64 - 2 writes; a failed write (EAGAIN)
        // means it is already signalled, which is all we need.
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        true
    }
}

/// What starting the thread gives the transport.
pub(crate) struct Spawned {
    pub(crate) mailbox: Mailbox,
    pub(crate) thread: JoinHandle<()>,
    /// Whether this context can register VRAM (CUDA memory).
    pub(crate) vram: bool,
}

/// Settings the engine runs with.
#[derive(Debug, Clone)]
pub(crate) struct EngineOptions {
    /// The process-wide context of this endpoint's configuration.
    pub(crate) context: Arc<Context>,
    /// The endpoint's incarnation, exported in its metadata.
    pub(crate) incarnation: u64,
    pub(crate) reads_in_flight: usize,
    pub(crate) timeout: Duration,
    /// Threads copying direct reads (1: on the progress thread itself).
    pub(crate) copy_threads: usize,
    /// Whether reads of a peer's shared memory mapped here are copied directly.
    pub(crate) shm_fast_path: bool,
    /// Where posted reads are recorded, when set (shared with the transport).
    pub(crate) log: LogSlot,
    /// Test-only (feature `fault-injection`): index of a read every post silently skips;
    /// `u64::MAX` when off.
    #[cfg(feature = "fault-injection")]
    pub(crate) skip_read: Arc<AtomicU64>,
}

/// The execution log slot a transport and its progress thread share.
pub(crate) type LogSlot = Arc<Mutex<Option<Arc<ExecutionLog>>>>;

/// Clears the alive flag when the progress thread ends, however it ends.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Starts the progress thread of endpoint `agent`, creating its context and worker there.
pub(crate) fn start(agent: &str, opts: EngineOptions, epoch: Arc<AtomicU64>) -> Result<Spawned> {
    let ucx = raw::lib()?;
    let wake = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )
    .map_err(|e| {
        Error::new(ErrorKind::Transport, "cannot create the progress eventfd")
            .with_backend(BACKEND)
            .with_source(std::io::Error::from(e))
    })?;
    let wake = Arc::new(wake);
    let (tx, rx) = mpsc::channel();
    let (init_tx, init_rx) = mpsc::sync_channel::<Result<bool>>(1);
    let thread_wake = Arc::clone(&wake);
    let alive = Arc::new(AtomicBool::new(true));
    let guard = AliveGuard(Arc::clone(&alive));
    let name = agent.to_owned();
    let thread = std::thread::Builder::new()
        .name(format!("ucx-{agent}"))
        .spawn(move || {
            let _guard = guard;
            match Engine::new(ucx, name, opts, epoch) {
                Ok(engine) => {
                    let _ = init_tx.send(Ok(engine.ctx.supports(MemoryKind::Vram { device: 0 })));
                    engine.run(rx, thread_wake);
                }
                Err(e) => {
                    let _ = init_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| {
            Error::new(ErrorKind::Transport, "cannot start the ucx progress thread")
                .with_backend(BACKEND)
                .with_source(e)
        })?;
    match init_rx.recv() {
        Ok(Ok(vram)) => Ok(Spawned {
            mailbox: Mailbox { tx, wake, alive },
            thread,
            vram,
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(Error::new(
                ErrorKind::Internal,
                "ucx progress thread died while starting",
            )
            .with_backend(BACKEND))
        }
    }
}

/// A local registration: its mapping and the block (kept alive while UCX may touch it).
///
/// Field order is drop order: the memory handle is unmapped before the block is released.
struct LocalRegion {
    /// Region id (1, 2, 3, ... per endpoint).
    id: u64,
    addr: usize,
    len: u64,
    kind: MemoryKind,
    /// `None` for zero-length blocks, which UCX cannot map and no read can touch.
    mem: Option<LocalMem>,
    rkey: Vec<u8>,
    /// Kept alive while UCX may read or write it (the mapping and running reads use it);
    /// declared last so it is released after `mem` is unmapped.
    _block: Arc<dyn MemoryBlock>,
}

/// How a local region is registered with UCX.
enum LocalMem {
    /// Mapped by this endpoint (`ucp_mem_map` of the block's range), unmapped with the region.
    Own(MemHandle),
    /// Inside a UCX allocation of this context: its handle is reused (its key names the
    /// shared-memory segment peers map), and the region keeps the allocation alive.
    Shared(Arc<Allocation>),
}

impl LocalMem {
    fn handle(&self) -> &MemHandle {
        match self {
            LocalMem::Own(m) => m,
            LocalMem::Shared(a) => &a.mem,
        }
    }
}

/// A loaded peer: its endpoint and unpacked keys (each key holds the endpoint, so keys are
/// destroyed before it closes).
struct Peer {
    regions: HashMap<u64, RemoteRegion>,
    agent: String,
    ep: Rc<Endpoint>,
    /// What it was loaded from: a force-closed endpoint is re-created from it.
    meta: EndpointMeta,
    /// Load sequence number: of two loads of one owner, the later one wins.
    seq: u64,
}

struct RemoteRegion {
    base: u64,
    len: u64,
    /// `None` for zero-length regions.
    rkey: Option<RKey>,
}

/// A batch translated to raw reads: valid while the objects in `peers` and `regions` live,
/// which the `Rc`s guarantee.
struct Resolved {
    /// One `ucp_get_nbx` per piece: reads longer than [`MAX_PIECE`] are cut into pieces.
    ops: Vec<GetOp>,
    /// The batch read each piece belongs to (errors name the read's owner and range).
    op_read: Vec<u32>,
    /// Issue order of the pieces.
    plan: IssuePlan,
    /// Pieces of each read, when some read was cut into several (else empty: one piece is
    /// one read), so a read is counted once all its pieces completed.
    read_pieces: Vec<u32>,
    /// The peers (endpoints, keys) the pieces use, by owner.
    peers: HashMap<OwnerId, Rc<Peer>>,
    _regions: Vec<Rc<LocalRegion>>,
}

/// A prepared batch: the descriptor cache, dropped whenever the epoch changes and rebuilt at
/// the next post.
struct PreparedEntry {
    batch: Arc<ReadBatch>,
    owners: Vec<OwnerId>,
    resolved: Option<Rc<Resolved>>,
}

/// A posted batch being executed.
struct Running {
    id: u64,
    res: Rc<Resolved>,
    batch: Arc<ReadBatch>,
    /// Next position in `res.plan.order`.
    pos: usize,
    /// Current generation.
    gen: usize,
    outstanding: usize,
    error: Option<Error>,
    /// Ended by abort, a dropped handle or shutdown: issues and copies nothing more.
    cancelled: bool,
    /// Last progress: a read issued, copied or completed, or bytes arriving (the worker
    /// progressing while gets are outstanding, until its endpoints were force-closed).
    last_event: Instant,
    /// The endpoints its gets were outstanding on were force-closed: from now on only a
    /// completion counts as progress, and no progress for the timeout quarantines it.
    closed: bool,
    done: Option<Reply<WireReport>>,
    signal: Arc<BatchSignal>,
    /// Reads and bytes of completions seen with `UCS_OK` (or copies finished), summed as
    /// they arrive: what `wait` reports.
    counted: WireReport,
    /// Pieces still to complete per read (a copy of `res.read_pieces`; empty when no read
    /// was cut).
    left: Vec<u32>,
    /// The execution log at post time, if any.
    log: Option<Arc<ExecutionLog>>,
    /// Test-only: the read this post skips (never issued, copied, counted or recorded).
    skip: Option<u32>,
}

impl Running {
    fn owner_of(&self, piece: u32) -> Option<OwnerId> {
        let read = *self.res.op_read.get(piece as usize)?;
        Some(self.batch.reads.get(read as usize)?.owner)
    }

    /// Counts piece `piece`, which completed successfully: its bytes, and its read once the
    /// read's last outstanding piece completed.
    fn complete(&mut self, piece: u32) {
        let Some(op) = self.res.ops.get(piece as usize) else {
            return;
        };
        self.counted.bytes += op.len as u64;
        if self.left.is_empty() {
            self.counted.reads += 1;
        } else if let Some(l) = self
            .res
            .op_read
            .get(piece as usize)
            .and_then(|&r| self.left.get_mut(r as usize))
        {
            *l -= 1;
            if *l == 0 {
                self.counted.reads += 1;
            }
        }
    }

    /// Whether `piece` belongs to the read fault injection skips.
    fn skipped(&self, piece: u32) -> bool {
        self.skip.is_some() && self.res.op_read.get(piece as usize).copied() == self.skip
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A batch is only dropped once none of its gets is outstanding (quarantined ones are
        // kept); waiters blocked on it must wake however it ends.
        self.signal.set_quiet();
    }
}

/// A deregistered region kept until a worker flush completed.
struct Releasing {
    flush: Request,
    _region: Rc<LocalRegion>,
    since: Instant,
    warned: bool,
}

/// A post waiting for one of its owners' endpoints to be (re-)created.
struct DeferredPost {
    prepared: u64,
    batch: u64,
    signal: Arc<BatchSignal>,
    ack: Reply<()>,
    done: Reply<WireReport>,
}

/// A peer whose endpoint is still being wired up (its flush has not completed).
struct Connecting {
    owner: OwnerId,
    peer: Peer,
    flush: Request,
    started: Instant,
    /// `None` when re-creating an endpoint that was force-closed.
    reply: Option<Reply<()>>,
}

/// An outstanding read piece: its batch, its piece index and the request to free once complete.
struct PendingRead {
    batch: u64,
    owner: OwnerId,
    /// Index into the batch's `Resolved::ops`.
    piece: u32,
    req: Request,
}

struct Engine {
    ucx: &'static Ucx,
    agent: String,
    opts: EngineOptions,
    epoch: Arc<AtomicU64>,
    running: Vec<Running>,
    pending: HashMap<u64, PendingRead>,
    connecting: Vec<Connecting>,
    prepared: HashMap<u64, PreparedEntry>,
    peers: HashMap<OwnerId, Rc<Peer>>,
    regions: BTreeMap<u64, Rc<LocalRegion>>,
    /// Batches whose gets did not complete within the no-progress bound after their
    /// endpoints were force-closed: kept with every request, key, endpoint, registration and
    /// block they use until a later progress sees the gets complete (then released).
    quarantine: Vec<Running>,
    /// Posts waiting for an owner's endpoint to be (re-)created.
    deferred: Vec<DeferredPost>,
    /// Latest load sequence number per owner (the load that must win).
    peer_seq: HashMap<OwnerId, u64>,
    next_seq: u64,
    /// Owners whose force-closed endpoint could not be re-created (yet): the metadata to
    /// try again with at their next post, and why the last attempt failed.
    lost: HashMap<OwnerId, (EndpointMeta, String)>,
    /// Set by shutdown: force-closed endpoints are not re-created.
    shutting_down: bool,
    /// Deregistered regions waiting for a worker flush (peers' reads of them served).
    releasing: Vec<Releasing>,
    /// Deregistered regions kept for good (their flush could not even start).
    kept: Vec<Rc<LocalRegion>>,
    /// Whether any endpoint was force-closed (shutdown then drains the worker).
    forced_any: bool,
    next_region: u64,
    next_token: u64,
    /// Copy pool for direct reads, started at the first one when `copy_threads > 1`.
    copy_pool: Option<rayon::ThreadPool>,
    completions: Vec<(u64, raw::sys::ucs_status_t)>,
    worker: Rc<Worker>,
    ctx: Arc<Context>,
}

fn ucx_err(e: UcxStatusError) -> Error {
    Error::from(e)
}

fn oob(owner: OwnerId, range: std::ops::Range<u64>, msg: String) -> Error {
    Error::new(ErrorKind::OutOfBounds, msg)
        .with_owner(owner)
        .with_range(range)
        .with_backend(BACKEND)
}

impl Engine {
    fn new(
        ucx: &'static Ucx,
        agent: String,
        opts: EngineOptions,
        epoch: Arc<AtomicU64>,
    ) -> Result<Self> {
        let ctx = Arc::clone(&opts.context);
        let worker = Worker::new(&ctx).map_err(ucx_err)?;
        Ok(Engine {
            ucx,
            agent,
            opts,
            epoch,
            running: Vec::new(),
            pending: HashMap::new(),
            connecting: Vec::new(),
            prepared: HashMap::new(),
            peers: HashMap::new(),
            regions: BTreeMap::new(),
            quarantine: Vec::new(),
            deferred: Vec::new(),
            peer_seq: HashMap::new(),
            next_seq: 1,
            lost: HashMap::new(),
            shutting_down: false,
            releasing: Vec::new(),
            kept: Vec::new(),
            forced_any: false,
            next_region: 1,
            next_token: 1,
            copy_pool: None,
            completions: Vec::new(),
            worker,
            ctx,
        })
    }

    /// The thread's loop: commands, progress, issue, sleep.
    fn run(mut self, rx: mpsc::Receiver<Option<Cmd>>, wake: Arc<OwnedFd>) {
        let efd = match self.worker.event_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(agent = %self.agent, "no ucx event fd ({e}); polling on a timer");
                None
            }
        };
        let mut last_work = Instant::now();
        // Last time UCX itself had work (progress returned true). Reads served from mapped
        // shared memory never touch UCX, so a receiver that only copied does not stay hot.
        let mut last_ucx = Instant::now();
        loop {
            let mut worked = false;
            loop {
                match rx.try_recv() {
                    Ok(Some(cmd)) => {
                        self.handle(cmd);
                        worked = true;
                    }
                    Ok(None) | Err(mpsc::TryRecvError::Disconnected) => {
                        self.shutdown();
                        return;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            // Bounded, so a worker with a steady stream of events cannot starve the mailbox.
            let mut rounds = 0;
            while rounds < PROGRESS_ROUNDS && self.worker.progress() {
                rounds += 1;
            }
            if rounds > 0 {
                worked = true;
                last_ucx = Instant::now();
                // Bytes are arriving: progress for every batch still waiting on its gets
                // (until its endpoints were force-closed: then only completions count).
                for r in &mut self.running {
                    if r.outstanding > 0 && !r.closed {
                        r.last_event = last_ucx;
                    }
                }
            }
            worked |= self.apply_completions();
            worked |= self.pump();
            worked |= self.poll_connecting();
            worked |= self.retry_deferred();
            worked |= self.poll_releasing();
            if worked {
                last_work = Instant::now();
                continue;
            }
            let quiet = last_work.elapsed();
            if quiet < SPIN {
                std::hint::spin_loop();
                continue;
            }
            // Not every piece of UCX's work is announced on the event fd: a publisher
            // answering emulated reads (shared-memory or TCP active messages) may hold reply
            // fragments queued until the FIFO drains, with no event when it does. So a worker
            // whose UCX was just active only naps briefly, and the nap grows with the quiet
            // time.
            let busy = !self.running.is_empty()
                || !self.connecting.is_empty()
                || !self.quarantine.is_empty()
                || !self.releasing.is_empty();
            let cap = if busy { BUSY_NAP } else { IDLE_NAP };
            let nap = if last_ucx.elapsed() < HOT {
                MIN_NAP
            } else {
                (quiet / 4).clamp(MIN_NAP, cap)
            };
            self.sleep(efd, &wake, nap, busy);
        }
    }

    /// Arms the worker and sleeps until an event, a command or `nap` passes.
    fn sleep(&self, efd: Option<i32>, wake: &OwnedFd, nap: Duration, busy: bool) {
        let efd = match (efd, self.worker.arm()) {
            (_, Ok(raw::Armed::Busy)) => return,
            (Some(fd), Ok(raw::Armed::Yes)) => Some(fd),
            (_, Err(e)) => {
                tracing::debug!(agent = %self.agent, "ucp_worker_arm: {e}");
                None
            }
            (None, Ok(raw::Armed::Yes)) => None,
        };
        // Without a usable event fd, nap briefly so outstanding reads keep progressing.
        let nap = if efd.is_none() && busy {
            Duration::from_micros(200)
        } else {
            nap
        };
        let timeout = Timespec {
            tv_sec: nap.as_secs() as _,
            tv_nsec: nap.subsec_nanos() as _,
        };
        // SAFETY: the worker's event fd stays open while the worker lives, which outlives
        // this call (the engine owns the worker).
        let efd = efd.map(|fd| unsafe { BorrowedFd::borrow_raw(fd) });
        let mut fds = vec![PollFd::new(wake, PollFlags::IN)];
        if let Some(fd) = &efd {
            fds.push(PollFd::new(fd, PollFlags::IN));
        }
        let _ = rustix::event::poll(&mut fds, Some(&timeout));
        // Reset the mailbox eventfd; commands sent after this read signal it again.
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(wake, &mut buf);
    }

    fn bump_epoch(&mut self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        // Resolved batches hold raw handles of the old state: rebuild them at the next post.
        for p in self.prepared.values_mut() {
            p.resolved = None;
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { block, reply } => {
                let _ = reply.send(self.register(block));
            }
            Cmd::Deregister { id } => {
                // Running (and quarantined) batches hold the region: it is unmapped once the
                // last of them is released, and not before peers' reads of it are served.
                if let Some(region) = self.regions.remove(&id) {
                    self.bump_epoch();
                    tracing::debug!(agent = %self.agent, region = id, "ucx deregister");
                    self.release_after_flush(region);
                }
            }
            Cmd::Export { reply } => {
                let _ = reply.send(Ok(self.export()));
            }
            Cmd::LoadPeer { owner, meta, reply } => self.start_connect(owner, meta, Some(reply)),
            Cmd::Prepare { id, batch, reply } => {
                let r = self.translate(&batch).map(|res| {
                    let gens = res.plan.generations();
                    self.prepared.insert(
                        id,
                        PreparedEntry {
                            owners: batch.owners(),
                            batch,
                            resolved: Some(Rc::new(res)),
                        },
                    );
                    gens
                });
                let _ = reply.send(r);
            }
            Cmd::Forget { id } => {
                self.prepared.remove(&id);
            }
            Cmd::Post {
                prepared,
                batch,
                signal,
                ack,
                done,
            } => {
                self.reconnect_lost(prepared);
                let d = DeferredPost {
                    prepared,
                    batch,
                    signal,
                    ack,
                    done,
                };
                if self.blocked_by_connect(d.prepared) {
                    self.deferred.push(d);
                } else {
                    self.start_post(d);
                }
            }
            Cmd::Cancel { batch } => self.cancel(batch),
        }
    }

    /// Whether prepared batch `prepared` names an owner whose newest endpoint is still being
    /// created (after a forced close, or a load racing this post): its post waits for it.
    fn blocked_by_connect(&self, prepared: u64) -> bool {
        let Some(entry) = self.prepared.get(&prepared) else {
            return false;
        };
        self.connecting.iter().any(|c| {
            self.peer_seq.get(&c.owner) == Some(&c.peer.seq) && entry.owners.contains(&c.owner)
        })
    }

    /// Starts re-creating the endpoints of `prepared`'s owners whose earlier re-creation
    /// failed; the post then waits for them.
    fn reconnect_lost(&mut self, prepared: u64) {
        let Some(entry) = self.prepared.get(&prepared) else {
            return;
        };
        let retry: Vec<(OwnerId, EndpointMeta)> = entry
            .owners
            .iter()
            .filter(|o| !self.peers.contains_key(o))
            .filter(|o| !self.connecting.iter().any(|c| c.owner == **o))
            .filter_map(|o| self.lost.get(o).map(|(m, _)| (*o, m.clone())))
            .collect();
        for (owner, meta) in retry {
            tracing::debug!(agent = %self.agent, owner, "ucx re-creating a lost endpoint");
            self.start_connect(owner, meta, None);
        }
    }

    fn start_post(&mut self, d: DeferredPost) {
        let DeferredPost {
            prepared,
            batch,
            signal,
            ack,
            done,
        } = d;
        if ack.is_closed() {
            // The post was given up before it started: start nothing.
            return;
        }
        let _ = ack.send(self.post(prepared, batch, signal, done));
    }

    /// Starts the deferred posts whose endpoints are ready; true on work.
    fn retry_deferred(&mut self) -> bool {
        if self.deferred.is_empty() {
            return false;
        }
        let mut worked = false;
        for d in std::mem::take(&mut self.deferred) {
            if self.blocked_by_connect(d.prepared) {
                self.deferred.push(d);
            } else {
                self.start_post(d);
                worked = true;
            }
        }
        worked
    }

    /// Releases `region` once a worker flush completed. Peers' emulated reads of it are
    /// answered by this worker's UCX, which copies out of the region for every reply it sends,
    /// and a peer that ended its reads (a forced close) does not tell us: replies may still be
    /// queued. The flush completes once everything queued before it was sent.
    fn release_after_flush(&mut self, region: Rc<LocalRegion>) {
        match self.worker.flush() {
            Ok(None) => drop(region),
            Ok(Some(flush)) => self.releasing.push(Releasing {
                flush,
                _region: region,
                since: Instant::now(),
                warned: false,
            }),
            Err(e) => {
                tracing::warn!(agent = %self.agent, error = %e, "ucx worker flush failed; keeping a deregistered region");
                self.kept.push(region);
            }
        }
    }

    /// Releases the regions whose flush completed; true on work.
    fn poll_releasing(&mut self) -> bool {
        let before = self.releasing.len();
        let timeout = self.opts.timeout;
        let agent = &self.agent;
        self.releasing.retain_mut(|r| {
            if r.flush.status() != raw::sys::UCS_INPROGRESS {
                return false;
            }
            if !r.warned && r.since.elapsed() > timeout {
                r.warned = true;
                tracing::warn!(
                    agent = %agent,
                    "ucx worker flush not done after the timeout; a deregistered region stays \
                     mapped until peers' reads of it are served"
                );
            }
            true
        });
        self.releasing.len() != before
    }

    /// Ends `batch` as abort does (see [`Cmd::Cancel`]).
    fn cancel(&mut self, batch: u64) {
        let Some(run) = self.running.iter_mut().find(|r| r.id == batch) else {
            // Finished (and answered) already, or quarantined.
            return;
        };
        run.cancelled = true;
        run.signal.stop();
        self.close_endpoints_of(batch);
    }

    /// Force-closes every endpoint a get of `batch` is outstanding on: UCX then completes
    /// those gets (with an error) as the worker is progressed. Other batches using a closed
    /// endpoint stop issuing on it and fail; the owner's endpoint is re-created from its
    /// metadata before the next post to it.
    fn close_endpoints_of(&mut self, batch: u64) {
        let Some(run) = self.running.iter().find(|r| r.id == batch) else {
            return;
        };
        let owners: BTreeSet<OwnerId> = self
            .pending
            .values()
            .filter(|p| p.batch == batch)
            .map(|p| p.owner)
            .collect();
        let peers: Vec<(OwnerId, Rc<Peer>)> = owners
            .into_iter()
            .filter_map(|o| run.res.peers.get(&o).map(|p| (o, Rc::clone(p))))
            .filter(|(_, p)| !p.ep.is_closed())
            .collect();
        for (owner, peer) in peers {
            self.force_close(owner, &peer);
        }
        let now = Instant::now();
        if let Some(run) = self.running.iter_mut().find(|r| r.id == batch) {
            run.closed = true;
            run.last_event = now;
        }
    }

    fn force_close(&mut self, owner: OwnerId, peer: &Rc<Peer>) {
        tracing::debug!(agent = %self.agent, owner, peer = %peer.agent, "ucx force-closing endpoint");
        self.forced_any = true;
        #[cfg(test)]
        let ignore = TEST_IGNORE_FORCE_CLOSE.load(Ordering::Relaxed);
        #[cfg(not(test))]
        let ignore = false;
        if ignore {
            tracing::debug!(agent = %self.agent, owner, "test: forced close ignored");
        } else if let Err(e) = peer.ep.force_close() {
            // Its gets are then waited out, or quarantined, by the no-progress bound.
            tracing::warn!(agent = %self.agent, owner, error = %e, "ucx forced close failed");
        }
        let now = Instant::now();
        for r in &mut self.running {
            if !r.res.peers.get(&owner).is_some_and(|p| Rc::ptr_eq(p, peer)) {
                continue;
            }
            r.closed = true;
            r.last_event = now;
            if r.error.is_none() && !r.cancelled {
                // Its gets on this endpoint complete with an error; nothing lands once they
                // have, so trying again (on the re-created endpoint) may help.
                r.error = Some(
                    Error::new(
                        ErrorKind::Transport,
                        format!(
                            "the ucx endpoint to owner {owner} was force-closed to end another \
                             batch's reads"
                        ),
                    )
                    .with_owner(owner)
                    .with_backend(BACKEND)
                    .set_retryable(true),
                );
            }
        }
        if ignore {
            // The endpoint stays usable as it was.
            return;
        }
        if self.peers.get(&owner).is_some_and(|p| Rc::ptr_eq(p, peer)) {
            // Nothing may use the closed endpoint again: the owner is re-created from the
            // metadata it was loaded from, and posts to it wait for that.
            self.peers.remove(&owner);
            self.bump_epoch();
            if !self.shutting_down {
                self.start_connect(owner, peer.meta.clone(), None);
            }
        }
    }

    fn register(&mut self, block: Arc<dyn MemoryBlock>) -> Result<u64> {
        let (addr, len, kind) = (block.addr(), block.len(), block.kind());
        if !self.ctx.supports(kind) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "this UCX build cannot register {kind} memory (no CUDA transport); \
                     use host memory or the nixl transport"
                ),
            )
            .with_backend(BACKEND));
        }
        if len > 0 && (addr == 0 || addr.checked_add(len).is_none()) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!("block {addr:#x}+{len} is not a valid address range"),
            )
            .with_backend(BACKEND));
        }
        let (mem, rkey) = if len == 0 {
            (None, Vec::new())
        } else {
            let shared = match kind {
                MemoryKind::Dram => Allocation::containing(&self.ctx, addr, len),
                MemoryKind::Vram { .. } => None,
            };
            let mem = match shared {
                Some(a) => LocalMem::Shared(a),
                None => LocalMem::Own(MemHandle::map(&self.ctx, addr, len, kind).map_err(ucx_err)?),
            };
            let rkey = mem.handle().pack().map_err(ucx_err)?.bytes().to_vec();
            (Some(mem), rkey)
        };
        let id = self.next_region;
        self.next_region += 1;
        self.regions.insert(
            id,
            Rc::new(LocalRegion {
                id,
                addr,
                len: len as u64,
                kind,
                mem,
                rkey,
                _block: block,
            }),
        );
        self.bump_epoch();
        let shared = matches!(
            self.regions.get(&id).and_then(|r| r.mem.as_ref()),
            Some(LocalMem::Shared(_))
        );
        tracing::debug!(agent = %self.agent, region = id, len, shared, "ucx register");
        Ok(id)
    }

    fn export(&self) -> Bytes {
        EndpointMeta {
            agent: self.agent.clone(),
            incarnation: self.opts.incarnation,
            worker_address: self.worker.address().to_vec(),
            regions: self
                .regions
                .iter()
                .map(|(&id, r)| {
                    // The memory the packed key maps: the allocation for a region inside
                    // one (peers map its whole segment), else the region itself.
                    let (key_base, key_len) = match &r.mem {
                        Some(LocalMem::Shared(a)) => (a.addr as u64, a.len as u64),
                        _ => (r.addr as u64, r.len),
                    };
                    RegionMeta {
                        id,
                        base: r.addr as u64,
                        len: r.len,
                        key_base,
                        key_len,
                        kind: r.kind,
                        rkey: r.rkey.clone(),
                    }
                })
                .collect(),
        }
        .encode()
    }

    /// Connects to a peer and unpacks its keys, then flushes the new endpoint so the reply
    /// comes once the connection is wired up (bounded by the timeout). Waiting for wire-up
    /// also keeps UCX 1.13's TCP transport from failing an assertion when an endpoint is
    /// closed while its peer's wire-up reply is still queued.
    ///
    /// Loads of one owner are numbered: only the latest one is installed, whichever flush
    /// completes first (an earlier load finishing later is dropped, and answers `Ok`).
    /// `reply` is `None` when re-creating a force-closed endpoint.
    fn start_connect(&mut self, owner: OwnerId, meta: EndpointMeta, reply: Option<Reply<()>>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let peer = match self.connect(owner, meta.clone(), seq) {
            Ok(p) => p,
            Err(e) => return self.connect_failed(owner, meta, e, reply),
        };
        match peer.ep.flush() {
            Ok(None) => {
                self.peer_seq.insert(owner, seq);
                self.install_peer(owner, peer);
                if let Some(r) = reply {
                    let _ = r.send(Ok(()));
                }
            }
            Ok(Some(flush)) => {
                self.peer_seq.insert(owner, seq);
                self.connecting.push(Connecting {
                    owner,
                    peer,
                    flush,
                    started: Instant::now(),
                    reply,
                })
            }
            Err(e) => self.connect_failed(owner, meta, ucx_err(e).with_owner(owner), reply),
        }
    }

    /// Answers a failed load, or records a failed re-creation (retried at the next post).
    fn connect_failed(
        &mut self,
        owner: OwnerId,
        meta: EndpointMeta,
        e: Error,
        reply: Option<Reply<()>>,
    ) {
        match reply {
            Some(r) => {
                let _ = r.send(Err(e));
            }
            // A later load installed the owner meanwhile: nothing is lost.
            None if self.peers.contains_key(&owner) => {}
            None => {
                tracing::warn!(agent = %self.agent, owner, error = %e, "ucx endpoint not re-created");
                self.lost.insert(owner, (meta, e.to_string()));
            }
        }
    }

    fn connect(&mut self, owner: OwnerId, meta: EndpointMeta, seq: u64) -> Result<Peer> {
        let ep = Endpoint::connect(&self.worker, &meta.worker_address)
            .map_err(|e| ucx_err(e).with_owner(owner))?;
        let mut regions = HashMap::with_capacity(meta.regions.len());
        for r in &meta.regions {
            let rkey = if r.len == 0 {
                None
            } else {
                Some(
                    RKey::unpack(&ep, &r.rkey)
                        .map_err(|e| ucx_err(e).with_owner(owner).with_range(0..r.len))?,
                )
            };
            regions.insert(
                r.id,
                RemoteRegion {
                    base: r.base,
                    len: r.len,
                    rkey,
                },
            );
        }
        Ok(Peer {
            regions,
            agent: meta.agent.clone(),
            ep,
            meta,
            seq,
        })
    }

    /// Installs `peer` if it is the latest load of `owner` (else drops it).
    fn install_peer(&mut self, owner: OwnerId, peer: Peer) {
        if self.peer_seq.get(&owner) != Some(&peer.seq) {
            tracing::debug!(agent = %self.agent, owner, "ucx peer load superseded by a later one");
            return;
        }
        tracing::debug!(agent = %self.agent, owner, peer = %peer.agent, "ucx peer loaded");
        // The old peer (if any) closes once no running batch uses it.
        self.peers.insert(owner, Rc::new(peer));
        self.lost.remove(&owner);
        self.bump_epoch();
    }

    /// Finishes connections whose flush completed or timed out; true on work.
    fn poll_connecting(&mut self) -> bool {
        if self.connecting.is_empty() {
            return false;
        }
        let mut worked = false;
        for c in std::mem::take(&mut self.connecting) {
            let st = c.flush.status();
            let bound = self.opts.timeout.max(CONNECT_MIN);
            let error = if st == raw::sys::UCS_INPROGRESS {
                if c.started.elapsed() <= bound {
                    self.connecting.push(c);
                    continue;
                }
                Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "connecting to owner {} (agent {:?}) took over {} ms",
                        c.owner,
                        c.peer.agent,
                        bound.as_millis()
                    ),
                )
                .with_owner(c.owner)
                .with_backend(BACKEND)
                .set_retryable(true)
            } else if st == raw::sys::UCS_OK {
                let Connecting {
                    owner, peer, reply, ..
                } = c;
                self.install_peer(owner, peer);
                if let Some(r) = reply {
                    let _ = r.send(Ok(()));
                }
                worked = true;
                continue;
            } else {
                ucx_err(UcxStatusError::new("ucp_ep_flush_nbx", st)).with_owner(c.owner)
            };
            worked = true;
            let Connecting {
                owner, peer, reply, ..
            } = c;
            let meta = peer.meta.clone();
            drop(peer);
            self.connect_failed(owner, meta, error, reply);
        }
        worked
    }

    /// Where the shared-memory segment holding `region` of `owner` is mapped in this process
    /// (`ucp_rkey_ptr`), checked: `Ok(None)` when the key names no memory mapped here (the
    /// reads go through `ucp_get_nbx`), `OutOfBounds` when it does but the region's first and
    /// last byte do not lie, contiguously, inside one readable shared mapping the kernel
    /// reports that is not this endpoint's own registered memory. UCX itself checks none of
    /// this: the pointer is the remote address plus a fixed offset.
    fn direct_base(
        &self,
        maps: &mut Option<Maps>,
        owner: OwnerId,
        id: u64,
        region: &RemoteRegion,
        rkey: &RKey,
        read: Range<u64>,
    ) -> Result<Option<usize>> {
        let Some(first) = rkey.local_ptr(region.base) else {
            return Ok(None);
        };
        let first = first as usize;
        let last_addr = region.base + (region.len - 1);
        let last = rkey.local_ptr(last_addr).map(|p| p as usize);
        let expected = usize::try_from(region.len - 1)
            .ok()
            .and_then(|n| first.checked_add(n));
        let maps = maps.get_or_insert_with(Maps::read);
        let mapping = match (last, expected) {
            (Some(l), Some(e)) if l == e => maps.containing(first, l),
            _ => None,
        };
        let own = |m: &Range<usize>| {
            self.regions
                .values()
                .any(|r| r.len > 0 && r.addr < m.end && m.start < r.addr + r.len as usize)
        };
        match mapping {
            Some(m) if m.shared && m.readable && !own(&m.range) => Ok(Some(first)),
            _ => Err(oob(
                owner,
                read,
                format!(
                    "region {id} of owner {owner} ({} bytes at {:#x}) is not inside one shared \
                     mapping of this process: ucp_rkey_ptr maps it to {first:#x}..={} \
                     (stale or corrupt peer metadata)",
                    region.len,
                    region.base,
                    match last {
                        Some(l) => format!("{l:#x}"),
                        None => "?".to_owned(),
                    }
                ),
            )),
        }
    }

    /// `PeerUnknown` for an owner whose endpoint was force-closed and could not be re-created
    /// is this backend's own `Transport` error (the peer was loaded; the endpoint is lost);
    /// every other error is returned as it is.
    fn lost_peer(&self, batch: &ReadBatch, e: Error) -> Error {
        let lost = (e.kind() == ErrorKind::PeerUnknown)
            .then(|| e.context().owner)
            .flatten()
            .and_then(|owner| Some((owner, &self.lost.get(&owner)?.1)));
        let Some((owner, why)) = lost else {
            return e;
        };
        // The first read naming the owner is the one validation refused.
        let i = batch
            .reads
            .iter()
            .position(|r| r.owner == owner)
            .unwrap_or(0);
        let range = e.context().range.clone().unwrap_or_default();
        Error::new(
            ErrorKind::Transport,
            format!(
                "read {i}: the endpoint to owner {owner} was force-closed and could not be \
                 re-created ({why}); load the peer again"
            ),
        )
        .with_owner(owner)
        .with_range(range)
        .with_backend(BACKEND)
    }

    /// Checks every read against loaded peers and local registrations and resolves it to the
    /// raw handles `ucp_get_nbx` takes.
    fn translate(&self, batch: &ReadBatch) -> Result<Resolved> {
        if u32::try_from(batch.reads.len()).is_err() {
            return Err(
                Error::new(ErrorKind::Unsupported, "more than 2^32 reads in one batch")
                    .with_backend(BACKEND),
            );
        }
        contract::validate_batch(
            BACKEND,
            &self.agent,
            batch,
            |owner, region| match self.peers.get(&owner) {
                None => RemoteLookup::NoPeer,
                Some(p) => p
                    .regions
                    .get(&region)
                    .map_or(RemoteLookup::NoRegion, |r| RemoteLookup::Len(r.len)),
            },
            |region| self.regions.get(&region).map(|l| l.len),
        )
        .map_err(|e| self.lost_peer(batch, e))?;
        // Every look-up below succeeds (validated just now, on this thread); failing anyway is
        // an internal error, never a panic.
        let missing = |i: usize, r: &ReadDesc, what: &str| {
            contract::validated_lookup_failed(BACKEND, i, r, what)
        };
        let mut ops = Vec::with_capacity(batch.reads.len());
        let mut op_read = Vec::with_capacity(batch.reads.len());
        let mut pieces = Vec::with_capacity(batch.reads.len());
        let mut peers: HashMap<OwnerId, Rc<Peer>> = HashMap::new();
        let mut regions: HashMap<u64, Rc<LocalRegion>> = HashMap::new();
        let mut direct: HashMap<(OwnerId, u64), Option<usize>> = HashMap::new();
        let mut maps = None;
        for (i, r) in batch.reads.iter().enumerate() {
            let remote = span(r.remote_offset, r.len);
            let peer = match peers.get(&r.owner) {
                Some(p) => p,
                None => {
                    let p = self
                        .peers
                        .get(&r.owner)
                        .ok_or_else(|| missing(i, r, "peer"))?;
                    peers.entry(r.owner).or_insert_with(|| Rc::clone(p))
                }
            };
            let region = peer
                .regions
                .get(&r.remote_region)
                .ok_or_else(|| missing(i, r, "remote region"))?;
            // Only zero-length regions have no key, and no validated read fits in one.
            let rkey = region
                .rkey
                .as_ref()
                .ok_or_else(|| missing(i, r, "remote key"))?;
            let local = match regions.get(&r.local_region) {
                Some(l) => l,
                None => {
                    let l = self
                        .regions
                        .get(&r.local_region)
                        .ok_or_else(|| missing(i, r, "local region"))?;
                    regions
                        .entry(r.local_region)
                        .or_insert_with(|| Rc::clone(l))
                }
            };
            // Only zero-length blocks are not mapped, and no validated read fits in one.
            let memh = local
                .mem
                .as_ref()
                .ok_or_else(|| missing(i, r, "local memory handle"))?;
            // Shared memory the peer's UCX mapped here: copy it directly (see raw::copy),
            // once the mapping is checked against what the kernel has.
            let base = match (local.kind, self.opts.shm_fast_path) {
                (MemoryKind::Dram, true) => match direct.get(&(r.owner, r.remote_region)) {
                    Some(&b) => b,
                    None => {
                        let b = self.direct_base(
                            &mut maps,
                            r.owner,
                            r.remote_region,
                            region,
                            rkey,
                            remote.clone(),
                        )?;
                        direct.insert((r.owner, r.remote_region), b);
                        b
                    }
                },
                _ => None,
            };
            // The local destination as an address, so overlap is found between regions
            // registered over the same memory too (DRAM addresses are the process's; VRAM
            // ones are per device).
            let dest_space = match local.kind {
                MemoryKind::Dram => u64::MAX,
                MemoryKind::Vram { device } => u64::from(device),
            };
            // Both ranges are inside registered regions whose addresses did not overflow, so
            // these sums and casts are exact.
            let mut done = 0;
            while done < r.len {
                let n = (r.len - done).min(MAX_PIECE);
                let remote_addr = region.base + r.remote_offset + done;
                let direct = match base {
                    Some(b) => (b + (r.remote_offset + done) as usize) as *const u8,
                    None => std::ptr::null(),
                };
                let local_addr = local.addr + (r.local_offset + done) as usize;
                ops.push(GetOp {
                    direct,
                    ep: peer.ep.handle(),
                    rkey: rkey.handle(),
                    remote_addr,
                    local: local_addr as *mut u8,
                    len: n as usize,
                    memh: memh.handle().handle(),
                    memory_type: raw::memory_type(local.kind),
                });
                pieces.push(ReadDesc {
                    remote_offset: r.remote_offset + done,
                    local_region: dest_space,
                    local_offset: local_addr as u64,
                    len: n,
                    ..*r
                });
                op_read.push(i as u32);
                done += n;
            }
        }
        if u32::try_from(ops.len()).is_err() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "more than 2^32 read pieces in one batch",
            )
            .with_backend(BACKEND));
        }
        let plan = issue_plan(&pieces);
        let read_pieces = if ops.len() > batch.reads.len() {
            let mut v = vec![0u32; batch.reads.len()];
            for &r in &op_read {
                v[r as usize] += 1;
            }
            v
        } else {
            Vec::new()
        };
        Ok(Resolved {
            ops,
            op_read,
            plan,
            read_pieces,
            peers,
            _regions: regions.into_values().collect(),
        })
    }

    /// Local byte ranges quarantined batches' outstanding gets may still write.
    fn quarantined_ranges(&self) -> Vec<Range<usize>> {
        let mut v = Vec::new();
        for q in &self.quarantine {
            for p in self.pending.values().filter(|p| p.batch == q.id) {
                if let Some(op) = q.res.ops.get(p.piece as usize) {
                    let s = op.local as usize;
                    v.push(s..s + op.len);
                }
            }
        }
        v
    }

    fn post(
        &mut self,
        prepared: u64,
        batch: u64,
        signal: Arc<BatchSignal>,
        done: Reply<WireReport>,
    ) -> Result<()> {
        let (batch_arc, cached) = {
            let entry = self.prepared.get(&prepared).ok_or_else(|| {
                Error::new(
                    ErrorKind::Internal,
                    "prepared batch is unknown to this ucx endpoint",
                )
                .with_backend(BACKEND)
            })?;
            (Arc::clone(&entry.batch), entry.resolved.clone())
        };
        let res = match cached {
            Some(r) => r,
            None => {
                // Registrations or peers changed since prepare: resolve (and validate) again.
                let r = Rc::new(self.translate(&batch_arc)?);
                if let Some(e) = self.prepared.get_mut(&prepared) {
                    e.resolved = Some(Rc::clone(&r));
                }
                r
            }
        };
        let quarantined = self.quarantined_ranges();
        if !quarantined.is_empty() {
            for (piece, op) in res.ops.iter().enumerate() {
                let s = op.local as usize;
                if quarantined
                    .iter()
                    .any(|q| q.start < s + op.len && s < q.end)
                {
                    let read = res.op_read[piece] as usize;
                    let r = &batch_arc.reads[read];
                    return Err(Error::new(
                        ErrorKind::Transport,
                        format!(
                            "read {read} writes local bytes {}..{} of region {}, which reads of \
                             an earlier batch that could not be stopped may still write \
                             (quarantined)",
                            r.local_offset,
                            r.local_offset + r.len,
                            r.local_region
                        ),
                    )
                    .with_owner(r.owner)
                    .with_range(span(r.remote_offset, r.len))
                    .with_backend(BACKEND)
                    .set_quarantined());
                }
            }
        }
        #[cfg(feature = "fault-injection")]
        let skip = u32::try_from(self.opts.skip_read.load(Ordering::Relaxed)).ok();
        #[cfg(not(feature = "fault-injection"))]
        let skip = None;
        let left = res.read_pieces.clone();
        let mut run = Running {
            counted: WireReport::default(),
            left,
            log: self.opts.log.lock().clone(),
            skip,
            id: batch,
            res,
            batch: batch_arc,
            pos: 0,
            gen: 0,
            outstanding: 0,
            error: None,
            cancelled: false,
            last_event: Instant::now(),
            closed: false,
            done: Some(done),
            signal,
        };
        // Issue the first window now, so every owner's reads are started before post returns.
        self.issue(&mut run);
        self.running.push(run);
        Ok(())
    }

    /// Issues reads of `run` until its in-flight cap, its generation's end, or a budget of
    /// one cap's worth of reads or [`DIRECT_BYTES`] of direct copies (so reads completing in
    /// place cannot starve the mailbox).
    fn issue(&mut self, run: &mut Running) -> bool {
        if run.signal.stopping() {
            run.cancelled = true;
        }
        let cap = self.opts.reads_in_flight;
        let mut issued = 0;
        let mut copied = 0;
        while run.error.is_none() && !run.cancelled {
            let Some(&gen_end) = run.res.plan.gen_ends.get(run.gen) else {
                break;
            };
            if run.pos == gen_end {
                // A barrier: the next generation overlaps this one and waits for it.
                if run.outstanding == 0 && run.gen + 1 < run.res.plan.gen_ends.len() {
                    run.gen += 1;
                    continue;
                }
                break;
            }
            if run.outstanding >= cap || issued >= cap || copied >= DIRECT_BYTES {
                break;
            }
            let piece = run.res.plan.order[run.pos];
            if run.skipped(piece) {
                run.pos += 1;
                continue;
            }
            if !run.res.ops[piece as usize].direct.is_null() {
                let (n, bytes) = self.copy_direct(run, gen_end, cap - issued);
                issued += n;
                copied += bytes;
                continue;
            }
            run.pos += 1;
            issued += 1;
            let token = self.next_token;
            self.next_token += 1;
            if run.log.is_some() {
                self.record(run, piece);
            }
            let op = &run.res.ops[piece as usize];
            // SAFETY: `op` was resolved from objects `run.res` keeps alive (endpoint, remote
            // key, local registration and its block) until the read completes: the running
            // batch is only dropped once none of its reads is outstanding (else it is kept in
            // quarantine). Its endpoint is not closed: a forced close bumps the epoch (so no
            // later post uses a resolved form holding it) and stops every running batch using
            // it (`error` set, checked above). The local range was checked inside a registered
            // block, and reads writing the same bytes are in different generations, so no
            // two outstanding reads write the same memory.
            match unsafe { raw::get(self.ucx, op, token) } {
                Started::Done => run.complete(piece),
                Started::Pending(req) => {
                    let owner = run.owner_of(piece).unwrap_or_default();
                    self.pending.insert(
                        token,
                        PendingRead {
                            batch: run.id,
                            owner,
                            piece,
                            req,
                        },
                    );
                    run.outstanding += 1;
                }
                Started::Failed(e) => {
                    run.error = Some(read_error(run, piece, e));
                }
            }
        }
        if issued > 0 {
            run.last_event = Instant::now();
        }
        issued > 0
    }

    /// Copies the direct reads of `run` from its position on (at most `max` of them, within
    /// its generation, up to [`DIRECT_BYTES`]) over the copy pool; returns how many, and their
    /// bytes.
    ///
    /// They complete before this returns, so they are never outstanding. The byte cap keeps
    /// the thread answering its mailbox (aborts, other batches) between chunks, and the
    /// batch's stop flag (set by abort or a dropped handle, from any thread) is checked before
    /// every piece of the copy.
    fn copy_direct(&mut self, run: &mut Running, gen_end: usize, max: usize) -> (usize, usize) {
        let mut tasks = Vec::new();
        let mut copied = Vec::new();
        let mut bytes = 0;
        while run.pos < gen_end && tasks.len() < max.max(1) && bytes < DIRECT_BYTES {
            let piece = run.res.plan.order[run.pos];
            if run.skipped(piece) {
                run.pos += 1;
                continue;
            }
            let op = &run.res.ops[piece as usize];
            if op.direct.is_null() {
                break;
            }
            if run.log.is_some() {
                self.record(run, piece);
            }
            let op = &run.res.ops[piece as usize];
            copied.push(piece);
            tasks.push(raw::CopyTask {
                dst: op.local,
                src: op.direct,
                len: op.len,
            });
            bytes += op.len;
            run.pos += 1;
        }
        let threads = self.opts.copy_threads;
        if threads > 1 && self.copy_pool.is_none() && !tasks.is_empty() {
            match rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("ucx-copy-{i}"))
                .build()
            {
                Ok(p) => self.copy_pool = Some(p),
                // Without threads the copy still happens, on this thread.
                Err(e) => tracing::warn!(agent = %self.agent, error = %e, "no ucx copy pool"),
            }
        }
        // SAFETY: every task is a resolved direct read of `run`: its source lies inside a
        // shared-memory segment mapped for a remote key `run.res` keeps alive (checked against
        // this process's mappings in `translate`), its destination inside a live local
        // registration. Reads of one generation have pairwise disjoint destinations (by
        // address, see `issue_plan`), and no other read of this batch is outstanding on those
        // bytes, so the copies are independent.
        let all = unsafe { raw::copy_all(self.copy_pool.as_ref(), &tasks, &run.signal.stop) };
        if all {
            for piece in copied {
                run.complete(piece);
            }
        } else {
            // Stopped part-way: the batch was ended by its handle.
            run.cancelled = true;
        }
        (tasks.len(), bytes)
    }

    /// Applies the statuses callbacks queued; true when there were any.
    fn apply_completions(&mut self) -> bool {
        raw::take_completions(&mut self.completions);
        if self.completions.is_empty() {
            return false;
        }
        let now = Instant::now();
        for (token, status) in std::mem::take(&mut self.completions) {
            let Some(p) = self.pending.remove(&token) else {
                continue;
            };
            let PendingRead {
                batch, piece, req, ..
            } = p;
            // The read is complete: it writes nothing more, and the request goes back to UCX.
            drop(req);
            if let Some(run) = self.running.iter_mut().find(|r| r.id == batch) {
                run.outstanding -= 1;
                run.last_event = now;
                if status == raw::sys::UCS_OK {
                    run.complete(piece);
                }
                // After abort or a forced close, failures are the expected way gets end.
                if status != raw::sys::UCS_OK && !run.cancelled && run.error.is_none() {
                    let e = UcxStatusError::new("ucp_get_nbx", status);
                    run.error = Some(read_error(run, piece, e));
                }
            } else if let Some(i) = self.quarantine.iter().position(|r| r.id == batch) {
                let q = &mut self.quarantine[i];
                q.outstanding -= 1;
                if q.outstanding == 0 {
                    tracing::info!(
                        agent = %self.agent,
                        batch,
                        "quarantined ucx reads completed; releasing their memory"
                    );
                    self.quarantine.swap_remove(i);
                }
            }
        }
        true
    }

    /// Issues more reads, finishes completed batches and enforces the no-progress bound;
    /// true on work.
    ///
    /// A batch with gets outstanding and no progress for the timeout first fails with
    /// `Timeout` and has its endpoints force-closed; if its gets still do not complete
    /// within another no-progress timeout, it is quarantined.
    fn pump(&mut self) -> bool {
        let mut worked = false;
        let mut runs = std::mem::take(&mut self.running);
        let now = Instant::now();
        let mut to_close = Vec::new();
        let mut to_quarantine = Vec::new();
        for run in &mut runs {
            // Nobody can wait for or abort a batch whose post was given up: end it.
            if !run.cancelled && run.done.as_ref().is_some_and(|d| d.is_closed()) {
                run.cancelled = true;
                run.signal.stop();
                to_close.push(run.id);
            }
            worked |= self.issue(run);
            if run.outstanding > 0 && now.duration_since(run.last_event) > self.opts.timeout {
                if !run.closed {
                    if run.error.is_none() && !run.cancelled {
                        run.error = Some(self.timeout_error(run));
                    }
                    to_close.push(run.id);
                } else {
                    to_quarantine.push(run.id);
                }
            }
        }
        runs.append(&mut self.running);
        self.running = runs;
        for id in to_close {
            self.close_endpoints_of(id);
            worked = true;
        }
        for id in to_quarantine {
            self.quarantine_batch(id);
            worked = true;
        }
        let mut keep = Vec::with_capacity(self.running.len());
        for mut run in std::mem::take(&mut self.running) {
            let total = run.res.plan.order.len();
            let finished =
                run.outstanding == 0 && (run.error.is_some() || run.cancelled || run.pos == total);
            if !finished {
                keep.push(run);
                continue;
            }
            worked = true;
            let result = match (run.error.take(), run.cancelled) {
                (Some(e), _) => Err(e),
                (None, true) => {
                    Err(Error::new(ErrorKind::Aborted, "ucx batch aborted").with_backend(BACKEND))
                }
                (None, false) => Ok(run.counted),
            };
            // Quiet first (no get is outstanding), so a waiter's drop returns at once.
            run.signal.set_quiet();
            if let Some(done) = run.done.take() {
                let _ = done.send(result);
            }
        }
        self.running = keep;
        worked
    }

    /// Moves `batch`, whose gets did not complete within the no-progress bound after its
    /// endpoints were force-closed, to quarantine, and answers its waiters.
    fn quarantine_batch(&mut self, batch: u64) {
        let Some(i) = self.running.iter().position(|r| r.id == batch) else {
            return;
        };
        let mut run = self.running.swap_remove(i);
        let stuck: Vec<&PendingRead> = self.pending.values().filter(|p| p.batch == batch).collect();
        let owners: BTreeSet<OwnerId> = stuck.iter().map(|p| p.owner).collect();
        let first = stuck
            .iter()
            .filter_map(|p| run.res.op_read.get(p.piece as usize))
            .filter_map(|&r| run.batch.reads.get(r as usize))
            .next();
        tracing::warn!(
            agent = %self.agent,
            batch,
            outstanding = run.outstanding,
            ?owners,
            "ucx reads did not complete after their endpoints were force-closed; quarantining \
             their memory"
        );
        let mut e = Error::new(
            ErrorKind::Timeout,
            format!(
                "{} ucx read(s) from owner(s) {owners:?} did not complete within {} ms of \
                 their endpoints being force-closed; the destination memory, keys and \
                 registrations are quarantined (kept alive, never reused) until they do{}",
                run.outstanding,
                self.opts.timeout.as_millis(),
                match &run.error {
                    Some(cause) => format!(" (the batch had failed: {cause})"),
                    None => String::new(),
                }
            ),
        )
        .with_backend(BACKEND);
        if let Some(r) = first {
            e = e
                .with_owner(r.owner)
                .with_range(span(r.remote_offset, r.len));
        }
        let e = e.set_quarantined();
        run.signal.set_quiet();
        if let Some(done) = run.done.take() {
            let _ = done.send(Err(e));
        }
        self.quarantine.push(run);
    }

    fn timeout_error(&self, run: &Running) -> Error {
        let r = self
            .pending
            .values()
            .find(|p| p.batch == run.id)
            .and_then(|p| run.res.op_read.get(p.piece as usize))
            .and_then(|&read| run.batch.reads.get(read as usize));
        let mut e = Error::new(
            ErrorKind::Timeout,
            format!(
                "ucx reads made no progress for {} ms ({} outstanding)",
                self.opts.timeout.as_millis(),
                run.outstanding
            ),
        )
        .with_backend(BACKEND)
        .set_retryable(true);
        if let Some(r) = r {
            e = e
                .with_owner(r.owner)
                .with_range(span(r.remote_offset, r.len));
        }
        e
    }

    /// Ends every running batch as abort does, waits (bounded by the no-progress timer) for
    /// their gets, answers every waiter with an error, then releases UCX, unless gets remain
    /// outstanding: then everything is leaked (quarantined for the life of the process).
    fn shutdown(mut self) {
        let stopped = |agent: &str| {
            Error::new(
                ErrorKind::Aborted,
                format!("the ucx transport of agent {agent:?} was dropped"),
            )
            .with_backend(BACKEND)
        };
        for d in std::mem::take(&mut self.deferred) {
            let _ = d.ack.send(Err(stopped(&self.agent)));
        }
        self.shutting_down = true;
        for c in std::mem::take(&mut self.connecting) {
            if let Some(r) = c.reply {
                let _ = r.send(Err(stopped(&self.agent)));
            }
        }
        let ids: Vec<u64> = self.running.iter().map(|r| r.id).collect();
        for id in ids {
            if let Some(run) = self.running.iter_mut().find(|r| r.id == id) {
                run.cancelled = true;
                run.signal.stop();
                if run.error.is_none() {
                    run.error = Some(stopped(&self.agent));
                }
            }
            self.close_endpoints_of(id);
        }
        while !self.running.is_empty() {
            let mut progressed = false;
            let mut rounds = 0;
            while rounds < PROGRESS_ROUNDS && self.worker.progress() {
                rounds += 1;
                progressed = true;
            }
            progressed |= self.apply_completions();
            // Finishes batches whose gets completed and quarantines those past the bound.
            self.pump();
            if !progressed {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        if self.forced_any {
            // A force-closed endpoint's peer does not learn that its reads were ended: an
            // emulated get's publisher keeps sending the replies it has queued. Destroying the
            // worker now would fail the peer's connection with replies still queued, which
            // crashes UCX 1.13's peer-failure handling there (`ucp_request_send_state_ff` of
            // a get reply, in `uct_tcp_ep_pending_purge`). So receive (and drop) them until
            // the worker is silent, bounded.
            let start = Instant::now();
            let mut last = Instant::now();
            while last.elapsed() < DRAIN_SILENCE && start.elapsed() < DRAIN_MAX {
                if self.worker.progress() {
                    last = Instant::now();
                } else {
                    std::thread::sleep(Duration::from_micros(200));
                }
                self.apply_completions();
            }
            tracing::debug!(agent = %self.agent, took = ?start.elapsed(), "ucx drained before shutdown");
        }
        // Peers' emulated reads are answered out of our regions until their replies are sent:
        // flush before anything is released (bounded; past it nothing is released).
        let mut flushed = true;
        let bound = self.opts.timeout.max(CONNECT_MIN);
        match self.worker.flush() {
            Ok(None) => {}
            Ok(Some(req)) => {
                let start = Instant::now();
                while req.status() == raw::sys::UCS_INPROGRESS {
                    if start.elapsed() > bound {
                        flushed = false;
                        break;
                    }
                    if !self.worker.progress() {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    self.apply_completions();
                }
            }
            Err(e) => {
                tracing::warn!(agent = %self.agent, error = %e, "ucx worker flush failed at shutdown");
                flushed = false;
            }
        }
        self.poll_releasing();
        if !flushed || !self.releasing.is_empty() {
            tracing::warn!(
                agent = %self.agent,
                "ucx replies to peers' reads not sent at shutdown; leaking the endpoint's resources"
            );
            drop(self.copy_pool.take());
            std::mem::forget(self);
            return;
        }
        if !self.pending.is_empty() || !self.quarantine.is_empty() {
            // UCX may still write into some buffers: never free them under it. Every waiter
            // has been answered (running batches finished or quarantined above).
            tracing::warn!(
                agent = %self.agent,
                outstanding = self.pending.len(),
                "ucx reads still outstanding at shutdown; leaking the endpoint's resources"
            );
            for q in &self.quarantine {
                q.signal.set_quiet();
            }
            drop(self.copy_pool.take());
            std::mem::forget(self);
        }
    }
}

impl Engine {
    /// Records read of `piece` in the batch's execution log when `piece` is the read's first
    /// piece, as the handles handed to UCX resolve: the owner whose currently loaded endpoint
    /// is the one the get uses, the remote region (of that peer's metadata) whose key is the get's key
    /// and whose range holds the get's remote address (for a direct copy: whose mapping, by
    /// `ucp_rkey_ptr`, holds the copy's source pointer), and the local registration holding
    /// the destination pointer. A read cut into several pieces is recorded once, as the extent
    /// its pieces cover. What cannot be resolved is recorded as region 0 with the raw address.
    fn record(&self, run: &Running, piece: u32) {
        let Some(log) = run.log.as_ref() else {
            return;
        };
        let p = piece as usize;
        let read = run.res.op_read[p];
        if p > 0 && run.res.op_read[p - 1] == read {
            return;
        }
        let op = &run.res.ops[p];
        let len: u64 = run.res.op_read[p..]
            .iter()
            .take_while(|&&r| r == read)
            .zip(&run.res.ops[p..])
            .map(|(_, o)| o.len as u64)
            .sum();
        let asked = &run.batch.reads[read as usize];
        // The endpoints loaded for each owner (not the batch's own owner -> peer table, which
        // is what resolution could have got wrong).
        let mut used: Vec<(OwnerId, &Rc<Peer>)> = self
            .peers
            .iter()
            .filter(|(_, peer)| peer.ep.handle() == op.ep)
            .map(|(&o, peer)| (o, peer))
            .collect();
        used.sort_unstable_by_key(|&(o, _)| (o != asked.owner, o));
        let (owner, remote) = match used.first() {
            Some(&(owner, peer)) => {
                let mut hits: Vec<(u64, u64)> = peer
                    .regions
                    .iter()
                    .filter_map(|(&id, reg)| {
                        let key = reg.rkey.as_ref()?;
                        if key.handle() != op.rkey {
                            return None;
                        }
                        if op.direct.is_null() {
                            let end = op.remote_addr.checked_add(len)?;
                            (op.remote_addr >= reg.base && end <= reg.base + reg.len)
                                .then(|| (id, op.remote_addr - reg.base))
                        } else {
                            let base = key.local_ptr(reg.base)? as usize;
                            let src = op.direct as usize;
                            let end = src.checked_add(len as usize)?;
                            (src >= base && end <= base + reg.len as usize)
                                .then(|| (id, (src - base) as u64))
                        }
                    })
                    .collect();
                hits.sort_unstable_by_key(|&(id, _)| (id != asked.remote_region, id));
                (owner, hits.first().copied())
            }
            None => (asked.owner, None),
        };
        let (remote_region, remote_offset) = remote.unwrap_or((0, op.remote_addr));
        let dst = op.local as usize;
        let mut locals: Vec<(u64, u64)> = run
            .res
            ._regions
            .iter()
            .filter(|r| dst >= r.addr && dst + len as usize <= r.addr + r.len as usize)
            .map(|r| (r.id, (dst - r.addr) as u64))
            .collect();
        locals.sort_unstable_by_key(|&(id, _)| (id != asked.local_region, id));
        let (local_region, local_offset) = locals.first().copied().unwrap_or((0, dst as u64));
        log.record([ReadDesc {
            owner,
            remote_region,
            remote_offset,
            local_region,
            local_offset,
            len,
        }]);
    }
}

/// The public error of a failed read: UCX's status plus the read's owner and remote range.
fn read_error(run: &Running, piece: u32, e: UcxStatusError) -> Error {
    let mut err = Error::from(e);
    let read = run.res.op_read.get(piece as usize);
    if let Some(r) = read.and_then(|&i| run.batch.reads.get(i as usize)) {
        err = err
            .with_owner(r.owner)
            .with_range(span(r.remote_offset, r.len));
    }
    err
}
