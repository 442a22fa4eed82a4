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

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use reshard_core::{
    Error, ErrorKind, MemoryBlock, MemoryKind, OwnerId, ReadBatch, ReadDesc, Result, WireReport,
};
use rustix::event::{PollFd, PollFlags, Timespec};
use tokio::sync::oneshot;

use crate::alloc::Allocation;
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
/// How long shutdown waits for cancelled reads before leaking their buffers instead.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

type Reply<T> = oneshot::Sender<Result<T>>;

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
        ack: Reply<()>,
        done: Reply<WireReport>,
    },
    /// Stop issuing reads of `batch` and cancel its outstanding ones.
    Cancel { batch: u64 },
}

/// The sending side of the progress thread's queue; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub(crate) struct Mailbox {
    tx: mpsc::Sender<Option<Cmd>>,
    wake: Arc<OwnedFd>,
}

impl Mailbox {
    /// Queues `cmd` and wakes the thread; false when the thread has stopped.
    pub(crate) fn send(&self, cmd: Cmd) -> bool {
        self.push(Some(cmd))
    }

    /// Asks the thread to stop (after cancelling and draining outstanding reads).
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
    pub(crate) reads_in_flight: usize,
    pub(crate) timeout: Duration,
    /// Threads copying direct reads (1: on the progress thread itself).
    pub(crate) copy_threads: usize,
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
    let name = agent.to_owned();
    let thread = std::thread::Builder::new()
        .name(format!("ucx-{agent}"))
        .spawn(move || match Engine::new(ucx, name, opts, epoch) {
            Ok(engine) => {
                let _ = init_tx.send(Ok(engine.ctx.supports(MemoryKind::Vram { device: 0 })));
                engine.run(rx, thread_wake);
            }
            Err(e) => {
                let _ = init_tx.send(Err(e));
            }
        })
        .map_err(|e| {
            Error::new(ErrorKind::Transport, "cannot start the ucx progress thread")
                .with_backend(BACKEND)
                .with_source(e)
        })?;
    match init_rx.recv() {
        Ok(Ok(vram)) => Ok(Spawned {
            mailbox: Mailbox { tx, wake },
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

/// A local registration: the block (kept alive while UCX may touch it) and its mapping.
struct LocalRegion {
    /// Kept alive while UCX may read or write it (the mapping and running reads use it).
    _block: Arc<dyn MemoryBlock>,
    addr: usize,
    len: u64,
    kind: MemoryKind,
    /// `None` for zero-length blocks, which UCX cannot map and no read can touch.
    mem: Option<LocalMem>,
    rkey: Vec<u8>,
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
    report: WireReport,
    _peers: Vec<Rc<Peer>>,
    _regions: Vec<Rc<LocalRegion>>,
}

/// A prepared batch: the descriptor cache, dropped whenever the epoch changes and rebuilt at
/// the next post.
struct PreparedEntry {
    batch: Arc<ReadBatch>,
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
    cancelled: bool,
    last_event: Instant,
    /// Set when a timed-out batch's reads ignored cancellation for another full timeout.
    abandoned: bool,
    done: Option<Reply<WireReport>>,
}

/// A peer whose endpoint is still being wired up (its flush has not completed).
struct Connecting {
    owner: OwnerId,
    peer: Peer,
    flush: Request,
    started: Instant,
    reply: Reply<()>,
}

/// An outstanding read piece: its batch, its piece index and the request to free once complete.
struct PendingRead {
    batch: u64,
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
    /// Batches given up on after a timeout whose reads never completed: their buffers stay
    /// alive (leaked) until the worker is destroyed, since UCX might still write them.
    zombies: Vec<Running>,
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

fn span(off: u64, len: u64) -> std::ops::Range<u64> {
    off..off.saturating_add(len)
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
            zombies: Vec::new(),
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
            while self.worker.progress() {
                worked = true;
                last_ucx = Instant::now();
            }
            worked |= self.apply_completions();
            worked |= self.pump();
            worked |= self.poll_connecting();
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
            let busy = !self.running.is_empty() || !self.connecting.is_empty();
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
                if self.regions.remove(&id).is_some() {
                    self.bump_epoch();
                    tracing::debug!(agent = %self.agent, region = id, "ucx deregister");
                }
            }
            Cmd::Export { reply } => {
                let _ = reply.send(Ok(self.export()));
            }
            Cmd::LoadPeer { owner, meta, reply } => self.load_peer(owner, meta, reply),
            Cmd::Prepare { id, batch, reply } => {
                let r = self.translate(&batch).map(|res| {
                    let gens = res.plan.generations();
                    self.prepared.insert(
                        id,
                        PreparedEntry {
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
                ack,
                done,
            } => {
                let _ = ack.send(self.post(prepared, batch, done));
            }
            Cmd::Cancel { batch } => {
                if let Some(r) = self.running.iter_mut().find(|r| r.id == batch) {
                    r.cancelled = true;
                    cancel_batch(&self.pending, &self.worker, batch);
                }
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
                _block: block,
                addr,
                len: len as u64,
                kind,
                mem,
                rkey,
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
            worker_address: self.worker.address().to_vec(),
            regions: self
                .regions
                .iter()
                .map(|(&id, r)| RegionMeta {
                    id,
                    base: r.addr as u64,
                    len: r.len,
                    kind: r.kind,
                    rkey: r.rkey.clone(),
                })
                .collect(),
        }
        .encode()
    }

    /// Connects to a peer and unpacks its keys, then flushes the new endpoint so the reply
    /// comes once the connection is wired up (bounded by the timeout). Waiting for wire-up
    /// also keeps UCX 1.13's TCP transport from failing an assertion when an endpoint is
    /// closed while its peer's wire-up reply is still queued.
    fn load_peer(&mut self, owner: OwnerId, meta: EndpointMeta, reply: Reply<()>) {
        let peer = match self.connect(owner, meta) {
            Ok(p) => p,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        match peer.ep.flush() {
            Ok(None) => {
                self.install_peer(owner, peer);
                let _ = reply.send(Ok(()));
            }
            Ok(Some(flush)) => self.connecting.push(Connecting {
                owner,
                peer,
                flush,
                started: Instant::now(),
                reply,
            }),
            Err(e) => {
                let _ = reply.send(Err(ucx_err(e).with_owner(owner)));
            }
        }
    }

    fn connect(&mut self, owner: OwnerId, meta: EndpointMeta) -> Result<Peer> {
        let ep = Endpoint::connect(&self.worker, &meta.worker_address)
            .map_err(|e| ucx_err(e).with_owner(owner))?;
        let mut regions = HashMap::with_capacity(meta.regions.len());
        for r in meta.regions {
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
            agent: meta.agent,
            ep,
        })
    }

    fn install_peer(&mut self, owner: OwnerId, peer: Peer) {
        tracing::debug!(agent = %self.agent, owner, peer = %peer.agent, "ucx peer loaded");
        // The old peer (if any) closes once no running batch uses it.
        self.peers.insert(owner, Rc::new(peer));
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
            if st == raw::sys::UCS_INPROGRESS {
                if c.started.elapsed() <= self.opts.timeout {
                    self.connecting.push(c);
                    continue;
                }
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "connecting to owner {} (agent {:?}) took over {} ms",
                        c.owner,
                        c.peer.agent,
                        self.opts.timeout.as_millis()
                    ),
                )
                .with_owner(c.owner)
                .with_backend(BACKEND)
                .set_retryable(true);
                let _ = c.reply.send(Err(e));
            } else if st == raw::sys::UCS_OK {
                let Connecting {
                    owner, peer, reply, ..
                } = c;
                self.install_peer(owner, peer);
                let _ = reply.send(Ok(()));
            } else {
                let e = ucx_err(UcxStatusError::new("ucp_ep_flush_nbx", st)).with_owner(c.owner);
                let _ = c.reply.send(Err(e));
            }
            worked = true;
        }
        worked
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
        let mut ops = Vec::with_capacity(batch.reads.len());
        let mut op_read = Vec::with_capacity(batch.reads.len());
        let mut pieces = Vec::with_capacity(batch.reads.len());
        let mut peers: HashMap<OwnerId, Rc<Peer>> = HashMap::new();
        let mut regions: HashMap<u64, Rc<LocalRegion>> = HashMap::new();
        for (i, r) in batch.reads.iter().enumerate() {
            let remote = span(r.remote_offset, r.len);
            if r.len == 0 {
                return Err(oob(r.owner, remote, format!("read {i} has zero length")));
            }
            let peer = match peers.get(&r.owner) {
                Some(p) => p,
                None => {
                    let p = self.peers.get(&r.owner).ok_or_else(|| {
                        Error::new(
                            ErrorKind::PeerUnknown,
                            format!(
                                "read {i} names owner {} whose metadata was never loaded",
                                r.owner
                            ),
                        )
                        .with_owner(r.owner)
                        .with_range(remote.clone())
                        .with_backend(BACKEND)
                    })?;
                    peers.entry(r.owner).or_insert_with(|| Rc::clone(p))
                }
            };
            let region = peer.regions.get(&r.remote_region).ok_or_else(|| {
                oob(
                    r.owner,
                    remote.clone(),
                    format!(
                        "read {i}: owner {} has no region {}",
                        r.owner, r.remote_region
                    ),
                )
            })?;
            let inside = r
                .remote_offset
                .checked_add(r.len)
                .is_some_and(|e| e <= region.len);
            let rkey = match (&region.rkey, inside) {
                (Some(k), true) => k,
                _ => {
                    return Err(oob(
                        r.owner,
                        remote.clone(),
                        format!(
                            "read {i}: bytes {}..{} outside region {} of owner {} ({} bytes)",
                            remote.start, remote.end, r.remote_region, r.owner, region.len
                        ),
                    ))
                }
            };
            let lrange = span(r.local_offset, r.len);
            let local = match regions.get(&r.local_region) {
                Some(l) => l,
                None => {
                    let l = self.regions.get(&r.local_region).ok_or_else(|| {
                        oob(
                            r.owner,
                            lrange.clone(),
                            format!(
                                "read {i}: local region {} is not registered on agent {:?}",
                                r.local_region, self.agent
                            ),
                        )
                    })?;
                    regions
                        .entry(r.local_region)
                        .or_insert_with(|| Rc::clone(l))
                }
            };
            let inside = r
                .local_offset
                .checked_add(r.len)
                .is_some_and(|e| e <= local.len);
            let memh = match (&local.mem, inside) {
                (Some(m), true) => m,
                _ => {
                    return Err(oob(
                        r.owner,
                        lrange.clone(),
                        format!(
                            "read {i}: local bytes {}..{} outside local region {} ({} bytes)",
                            lrange.start, lrange.end, r.local_region, local.len
                        ),
                    ))
                }
            };
            // Both ranges are inside registered regions whose addresses did not overflow, so
            // these sums and casts are exact.
            let mut done = 0;
            while done < r.len {
                let n = (r.len - done).min(MAX_PIECE);
                let remote_addr = region.base + r.remote_offset + done;
                // Shared memory the peer's UCX mapped here: copy it directly (see raw::copy).
                let direct = match local.kind {
                    MemoryKind::Dram => rkey.local_ptr(remote_addr).unwrap_or(std::ptr::null()),
                    MemoryKind::Vram { .. } => std::ptr::null(),
                };
                ops.push(GetOp {
                    direct,
                    ep: peer.ep.handle(),
                    rkey: rkey.handle(),
                    remote_addr,
                    local: (local.addr + (r.local_offset + done) as usize) as *mut u8,
                    len: n as usize,
                    memh: memh.handle().handle(),
                    memory_type: raw::memory_type(local.kind),
                });
                pieces.push(ReadDesc {
                    remote_offset: r.remote_offset + done,
                    local_offset: r.local_offset + done,
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
        Ok(Resolved {
            ops,
            op_read,
            plan,
            report: WireReport {
                reads: batch.reads.len() as u64,
                bytes: batch.bytes(),
            },
            _peers: peers.into_values().collect(),
            _regions: regions.into_values().collect(),
        })
    }

    fn post(&mut self, prepared: u64, batch: u64, done: Reply<WireReport>) -> Result<()> {
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
        let mut run = Running {
            id: batch,
            res,
            batch: batch_arc,
            pos: 0,
            gen: 0,
            outstanding: 0,
            error: None,
            cancelled: false,
            last_event: Instant::now(),
            abandoned: false,
            done: Some(done),
        };
        // Issue the first window now, so every owner's reads are started before post returns.
        self.issue(&mut run);
        self.running.push(run);
        Ok(())
    }

    /// Issues reads of `run` until its in-flight cap, its generation's end, or a budget of
    /// one cap's worth of reads (so reads completing in place cannot starve the mailbox).
    fn issue(&mut self, run: &mut Running) -> bool {
        let cap = self.opts.reads_in_flight;
        let mut issued = 0;
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
            if run.outstanding >= cap || issued >= cap {
                break;
            }
            let piece = run.res.plan.order[run.pos];
            if !run.res.ops[piece as usize].direct.is_null() {
                issued += self.copy_direct(run, gen_end, cap - issued);
                continue;
            }
            run.pos += 1;
            issued += 1;
            let token = self.next_token;
            self.next_token += 1;
            let op = &run.res.ops[piece as usize];
            // SAFETY: `op` was resolved from objects `run.res` keeps alive (endpoint, remote
            // key, local registration and its block) until the read completes: the running
            // batch is only dropped once none of its reads is outstanding. The local range
            // was checked inside a registered block, and reads writing the same bytes are in
            // different generations, so no two outstanding reads write the same memory.
            match unsafe { raw::get(self.ucx, op, token) } {
                Started::Done => {}
                Started::Pending(req) => {
                    self.pending.insert(
                        token,
                        PendingRead {
                            batch: run.id,
                            piece,
                            req,
                        },
                    );
                    run.outstanding += 1;
                }
                Started::Failed(e) => {
                    run.error = Some(read_error(run, piece, e));
                    cancel_batch(&self.pending, &self.worker, run.id);
                }
            }
        }
        if issued > 0 {
            run.last_event = Instant::now();
        }
        issued > 0
    }

    /// Copies the direct reads of `run` from its position on (at most `max` of them, within
    /// its generation, up to [`DIRECT_BYTES`]) over the copy pool; returns how many.
    ///
    /// They complete before this returns, so they are never outstanding. The byte cap keeps
    /// the thread answering its mailbox (aborts, other batches) between chunks.
    fn copy_direct(&mut self, run: &mut Running, gen_end: usize, max: usize) -> usize {
        let mut tasks = Vec::new();
        let mut bytes = 0;
        while run.pos < gen_end && tasks.len() < max.max(1) && bytes < DIRECT_BYTES {
            let op = &run.res.ops[run.res.plan.order[run.pos] as usize];
            if op.direct.is_null() {
                break;
            }
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
        // shared-memory segment mapped for a remote key `run.res` keeps alive, its destination
        // inside a live local registration, checked in `translate`. Reads of one generation
        // have pairwise disjoint destinations (see `issue_plan`), and no other read of this
        // batch is outstanding on those bytes, so the copies are independent.
        unsafe { raw::copy_all(self.copy_pool.as_ref(), &tasks) };
        tasks.len()
    }

    /// Applies the statuses callbacks queued; true when there were any.
    fn apply_completions(&mut self) -> bool {
        raw::take_completions(&mut self.completions);
        if self.completions.is_empty() {
            return false;
        }
        let now = Instant::now();
        for (token, status) in std::mem::take(&mut self.completions) {
            // Unknown tokens belong to abandoned requests, already freed.
            let Some(p) = self.pending.remove(&token) else {
                continue;
            };
            let PendingRead { batch, piece, req } = p;
            // The read is complete: return the request to UCX.
            drop(req);
            let Some(run) = self.running.iter_mut().find(|r| r.id == batch) else {
                continue;
            };
            run.outstanding -= 1;
            run.last_event = now;
            let cancelled = run.cancelled && status == raw::sys::UCS_ERR_CANCELED;
            if status != raw::sys::UCS_OK && !cancelled && run.error.is_none() {
                let e = UcxStatusError::new("ucp_get_nbx", status);
                run.error = Some(read_error(run, piece, e));
                cancel_batch(&self.pending, &self.worker, batch);
            }
        }
        true
    }

    /// Issues more reads, finishes completed batches and enforces timeouts; true on work.
    fn pump(&mut self) -> bool {
        let mut worked = false;
        let mut runs = std::mem::take(&mut self.running);
        let now = Instant::now();
        for run in &mut runs {
            worked |= self.issue(run);
            if run.outstanding > 0 && now.duration_since(run.last_event) > self.opts.timeout {
                if run.error.is_none() {
                    run.error = Some(self.timeout_error(run));
                    run.last_event = now;
                    cancel_batch(&self.pending, &self.worker, run.id);
                } else {
                    // Cancelled reads did not complete within another timeout: stop waiting
                    // and keep their buffers alive until the worker is gone.
                    tracing::warn!(
                        agent = %self.agent,
                        outstanding = run.outstanding,
                        "ucx reads ignored cancellation; abandoning them"
                    );
                    // Dropping a request frees it without completion; UCX then calls no
                    // callback for it.
                    self.pending.retain(|_, p| p.batch != run.id);
                    run.outstanding = 0;
                    run.abandoned = true;
                }
            }
        }
        let mut keep = Vec::with_capacity(runs.len());
        for mut run in runs {
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
                (None, false) => Ok(run.res.report),
            };
            if let Some(done) = run.done.take() {
                let _ = done.send(result);
            }
            if run.abandoned {
                self.zombies.push(run);
            }
        }
        keep.append(&mut self.running);
        self.running = keep;
        worked
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

    /// Cancels every running batch, waits (bounded) for their reads, then releases UCX.
    fn shutdown(mut self) {
        for r in &mut self.running {
            r.cancelled = true;
        }
        for p in self.pending.values() {
            p.req.cancel(&self.worker);
        }
        let start = Instant::now();
        while !self.pending.is_empty() && start.elapsed() < SHUTDOWN_GRACE {
            if !self.worker.progress() {
                std::thread::yield_now();
            }
            self.apply_completions();
        }
        self.pump();
        if !self.pending.is_empty() || !self.zombies.is_empty() {
            // UCX may still write into some buffers: never free them under it.
            tracing::warn!(
                agent = %self.agent,
                outstanding = self.pending.len(),
                "ucx reads still outstanding at shutdown; leaking the endpoint's resources"
            );
            std::mem::forget(self);
        }
    }
}

/// Asks UCX to cancel every outstanding read of `batch`.
fn cancel_batch(pending: &HashMap<u64, PendingRead>, worker: &Worker, batch: u64) {
    for p in pending.values().filter(|p| p.batch == batch) {
        p.req.cancel(worker);
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
