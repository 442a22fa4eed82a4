//! [`CmaTransport`]: one endpoint, implementing the core contract with `process_vm_readv`.
//!
//! This file owns the endpoint itself (constructor, accessors, copy-thread pool, drop); the
//! rest is split by concern:
//! - `prepare`: validating a batch and translating it into calls;
//! - `post`: what post re-checks, what it writes to the execution log, and starting the batch;
//! - `trait_impl`: the [`Transport`](reshard_core::Transport) impl.

mod post;
mod prepare;
mod trait_impl;

use parking_lot::{Mutex, RwLock};
use rayon::ThreadPool;
use reshard_core::regions::RegionTable;
use reshard_core::{new_incarnation, Error, ErrorKind, ExecutionLog, MemoryBlock, OwnerId, Result};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Weak};

use crate::peer::{Host, Peer};
use crate::plan::Calls;
use crate::run::Run;
use crate::sys;
use crate::{CmaOptions, SCHEME};

/// The cma state of a [`PreparedBatch`](reshard_core::PreparedBatch).
pub(crate) struct Prepared {
    /// Incarnation of the endpoint that prepared it.
    endpoint: u64,
    epoch: u64,
    /// Owners and the peers their reads were resolved against, indexed by `Call::peer`.
    pub(crate) peers: Vec<(OwnerId, Arc<Peer>)>,
    /// Destination regions and their blocks (kept alive while the batch exists).
    dsts: Vec<(u64, Arc<dyn MemoryBlock>)>,
    pub(crate) calls: Calls,
    /// Jobs a post starts (at most; destinations are disjoint, so calls may run concurrently).
    lanes: usize,
}

/// A cma endpoint: registers host memory, exports where it is, and reads peers' memory with
/// `process_vm_readv` on a pool of `workers` copy threads (started at the first post).
pub struct CmaTransport {
    agent: String,
    options: CmaOptions,
    incarnation: u64,
    host: Host,
    /// What registrations and the transport share: the regions and the epoch.
    local: Arc<RegionTable<Arc<dyn MemoryBlock>>>,
    peers: RwLock<HashMap<OwnerId, Arc<Peer>>>,
    pool: Mutex<Option<Arc<ThreadPool>>>,
    /// Posted batches, so dropping the endpoint ends them (rule 4).
    live: Mutex<Vec<Weak<Run>>>,
    log: RwLock<Option<Arc<ExecutionLog>>>,
    /// Always present (cheap) so `post` reads it in one place; only `inject_skip_read`, behind
    /// the `fault-injection` feature, arms it.
    skip_read: reshard_core::fault::SkipRead,
}

fn same_block(a: &Arc<dyn MemoryBlock>, b: &Arc<dyn MemoryBlock>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

impl CmaTransport {
    /// Creates endpoint `agent` (1..=65535 bytes) in this process.
    pub fn new(agent: &str, options: CmaOptions) -> Result<Self> {
        options.validate()?;
        if agent.is_empty() || agent.len() > u16::MAX as usize {
            return Err(Error::new(
                ErrorKind::Config,
                format!("cma agent names must be 1..={} bytes", u16::MAX),
            )
            .with_backend(SCHEME));
        }
        let host = Host::here()?;
        if options.allow_any_reader {
            sys::allow_any_ptracer().map_err(|e| {
                Error::new(
                    ErrorKind::Unsupported,
                    "prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) failed (allow_any_reader)",
                )
                .with_backend(SCHEME)
                .with_source(e)
            })?;
        }
        Ok(CmaTransport {
            agent: agent.to_owned(),
            options,
            incarnation: new_incarnation(),
            host,
            local: Arc::new(RegionTable::new()),
            peers: RwLock::new(HashMap::new()),
            pool: Mutex::new(None),
            live: Mutex::new(Vec::new()),
            log: RwLock::new(None),
            skip_read: reshard_core::fault::SkipRead::default(),
        })
    }

    /// The options this endpoint runs with.
    pub fn options(&self) -> &CmaOptions {
        &self.options
    }

    /// Test-only fault injection (feature `fault-injection`, off by default): while set to
    /// `Some(i)`, every `post` leaves read `i` of its batch out (it is neither read nor
    /// counted in the [`reshard_core::WireReport`], nor recorded in the execution log), as a
    /// backend that loses a read would. Reads are numbered in batch order.
    #[cfg(feature = "fault-injection")]
    pub fn inject_skip_read(&self, read: Option<usize>) {
        self.skip_read.set(read);
    }

    fn pool(&self) -> Result<Arc<ThreadPool>> {
        let mut slot = self.pool.lock();
        if let Some(p) = &*slot {
            return Ok(Arc::clone(p));
        }
        let name = self.agent.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.options.workers)
            .thread_name(move |i| format!("cma-{name}-{i}"))
            .build()
            .map_err(|e| {
                Error::new(ErrorKind::Transport, "could not start cma copy threads")
                    .with_backend(SCHEME)
                    .with_source(e)
            })?;
        let pool = Arc::new(pool);
        *slot = Some(Arc::clone(&pool));
        Ok(pool)
    }
}

impl Drop for CmaTransport {
    fn drop(&mut self) {
        // Every waiter wakes with an error (rule 4); the calls already running finish, and the
        // handles' drops or waits wait them out (bounded by the no-progress timer, past which
        // they are quarantined: their jobs keep the memory they write alive).
        for run in self.live.get_mut().drain(..).filter_map(|w| w.upgrade()) {
            run.close(|| {
                Error::new(
                    ErrorKind::Aborted,
                    format!("cma endpoint {:?} was dropped", self.agent),
                )
                .with_backend(SCHEME)
                .set_retryable(true)
            });
        }
    }
}

impl fmt::Debug for CmaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmaTransport")
            .field("agent", &self.agent)
            .field("pid", &self.host.pid)
            .field("options", &self.options)
            .field("regions", &self.local.read().len())
            .field("peers", &self.peers.read().len())
            .finish()
    }
}
