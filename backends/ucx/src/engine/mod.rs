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
//!
//! One file per part: `mailbox` (the commands and the batch signal), `event_loop` (the loop,
//! command dispatch, deferred posts), `regions` (local registrations), `peers` (loaded peers
//! and their wire-up), `resolve` (validating and translating batches), `execute` (issuing and
//! completing reads), `abort` (ending batches early, quarantine), `shutdown`, `record`
//! (the execution log), `order` (the order a prepared batch's pieces are issued in) and `maps`
//! (this process's mappings, to check the pointers `ucp_rkey_ptr` returns).

use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use reshard_core::{Error, ErrorKind, ExecutionLog, MemoryKind, OwnerId, Result};
use tokio::sync::oneshot;

use crate::meta::EndpointMeta;
use crate::raw::{self, Context, Ucx, UcxStatusError, Worker};
use crate::SCHEME;

mod abort;
mod event_loop;
mod execute;
mod mailbox;
mod maps;
mod order;
mod peers;
mod record;
mod regions;
mod resolve;
mod shutdown;

pub(crate) use mailbox::{BatchHold, BatchSignal, Cmd, Mailbox};

use event_loop::{DeferredPost, DeferredPrepare};
use execute::{PendingRead, Running};
use peers::{Connecting, Peer};
use regions::{LocalRegion, Releasing};
use resolve::PreparedEntry;

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
    /// Reads longer than this are issued as several pieces, so one large read is pipelined
    /// (and spread over the in-flight window) instead of served as one long operation, and
    /// the no-progress timer sees it advance piece by piece (`UcxOptions::piece_bytes`).
    pub(crate) piece_bytes: u64,
    /// Threads copying direct reads (1: on the progress thread itself).
    pub(crate) copy_threads: usize,
    /// Whether reads of a peer's shared memory mapped here are copied directly.
    pub(crate) shm_fast_path: bool,
    /// Where posted reads are recorded, when set (shared with the transport).
    pub(crate) log: LogSlot,
    /// Test-only (feature `fault-injection`): the read every post silently skips, when armed
    /// (shared with the transport).
    #[cfg(feature = "fault-injection")]
    pub(crate) skip_read: reshard_core::fault::SkipRead,
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
            .with_backend(SCHEME)
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
                .with_backend(SCHEME)
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
            .with_backend(SCHEME))
        }
    }
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
    /// Prepares waiting for an owner's endpoint to be (re-)created.
    deferred_prepares: Vec<DeferredPrepare>,
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
            deferred_prepares: Vec::new(),
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

    fn bump_epoch(&mut self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        // Resolved batches hold raw handles of the old state: rebuild them at the next post.
        for p in self.prepared.values_mut() {
            p.resolved = None;
        }
    }
}
