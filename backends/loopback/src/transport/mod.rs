//! [`LoopbackTransport`]: one agent on a [`LoopbackFabric`], implementing the core contract.
//!
//! This file owns the endpoint itself (constructor, accessors, copy-thread pool, drop); the
//! rest is split by concern:
//! - `translate`: [`Prepared`] and `translate`, what `prepare` builds;
//! - `resolve`: re-resolving a prepared batch to live blocks at post;
//! - `record`: what a post writes to the execution log;
//! - `faults`: test-only fault hooks of the copy jobs;
//! - `trait_impl`: the [`Transport`] impl.
//!
//! [`Transport`]: reshard_core::Transport

#[cfg(test)]
mod faults;
mod post;
mod record;
mod resolve;
mod trait_impl;
mod translate;

use parking_lot::{Mutex, RwLock};
use rayon::ThreadPool;
use reshard_core::{Error, ErrorKind, ExecutionLog, OwnerId, Result};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Weak};

use crate::fabric::{AgentState, LoopbackFabric};
use crate::SCHEME;

#[cfg(test)]
pub(crate) use faults::Faults;
pub(crate) use translate::Prepared;

/// The in-process transport: reads are memory copies between agents of one fabric, run on a
/// pool of `workers` threads owned by this transport (started at the first post).
pub struct LoopbackTransport {
    fabric: LoopbackFabric,
    agent: Arc<AgentState>,
    workers: usize,
    peers: RwLock<HashMap<OwnerId, Arc<Peer>>>,
    pool: Mutex<Option<Arc<ThreadPool>>>,
    /// Where posted reads are recorded as resolved, when set ([`Transport::set_execution_log`]).
    ///
    /// [`Transport::set_execution_log`]: reshard_core::Transport::set_execution_log
    log: RwLock<Option<Arc<ExecutionLog>>>,
    /// Test-only: index of a read that `post` silently skips (never copied nor counted).
    /// Always present (cheap) so `post` reads it in one place; only `inject_skip_read`, behind
    /// the `fault-injection` feature, arms it.
    skip_read: reshard_core::fault::SkipRead,
    #[cfg(test)]
    pub(crate) faults: Faults,
}

/// A loaded peer: the agent its metadata names and the regions the metadata lists.
struct Peer {
    agent: Weak<AgentState>,
    /// The exporting agent's uid, which is its incarnation.
    uid: u64,
    regions: HashMap<u64, u64>,
}

fn oob(owner: OwnerId, range: Range<u64>, msg: String) -> Error {
    Error::new(ErrorKind::OutOfBounds, msg)
        .with_owner(owner)
        .with_range(range)
        .with_backend(SCHEME)
}

impl LoopbackTransport {
    /// Attaches agent `agent` to `fabric` with `workers` copy threads; names are unique per
    /// fabric while their transport lives.
    pub fn new(fabric: &LoopbackFabric, agent: &str, workers: usize) -> Result<Self> {
        if workers == 0 {
            return Err(
                Error::new(ErrorKind::Config, "loopback needs at least 1 worker")
                    .with_backend(SCHEME),
            );
        }
        if agent.is_empty() || agent.len() > u16::MAX as usize {
            return Err(Error::new(
                ErrorKind::Config,
                format!("loopback agent names must be 1..={} bytes", u16::MAX),
            )
            .with_backend(SCHEME));
        }
        let state = Arc::new(AgentState::new(agent));
        {
            let mut agents = fabric.inner.agents.lock();
            if agents.contains_key(agent) {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("agent {agent:?} already exists on this loopback fabric"),
                )
                .with_backend(SCHEME));
            }
            agents.insert(agent.to_owned(), Arc::clone(&state));
        }
        Ok(LoopbackTransport {
            fabric: fabric.clone(),
            agent: state,
            workers,
            peers: RwLock::new(HashMap::new()),
            pool: Mutex::new(None),
            log: RwLock::new(None),
            skip_read: reshard_core::fault::SkipRead::default(),
            #[cfg(test)]
            faults: Faults::default(),
        })
    }

    /// Test-only fault injection (feature `fault-injection`, off by default): while set to
    /// `Some(i)`, every `post` silently skips read `i` of its batch (it is neither copied nor
    /// counted in the [`reshard_core::WireReport`], nor recorded in the execution log), as a
    /// backend that loses a read would. Reads are numbered in batch order.
    #[cfg(feature = "fault-injection")]
    pub fn inject_skip_read(&self, read: Option<usize>) {
        self.skip_read.set(read);
    }

    /// Number of copy threads.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The fabric this agent is attached to.
    pub fn fabric(&self) -> &LoopbackFabric {
        &self.fabric
    }

    fn pool(&self) -> Result<Arc<ThreadPool>> {
        let mut slot = self.pool.lock();
        if let Some(p) = &*slot {
            return Ok(Arc::clone(p));
        }
        let name = self.agent.name.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(self.workers)
            .thread_name(move |i| format!("loopback-{name}-{i}"))
            // Jobs catch their own panics; this only keeps a stray one from aborting.
            .panic_handler(|_| {})
            .build()
            .map_err(|e| {
                Error::new(
                    ErrorKind::Transport,
                    "could not start loopback copy threads",
                )
                .with_backend(SCHEME)
                .with_source(e)
            })?;
        let pool = Arc::new(pool);
        *slot = Some(Arc::clone(&pool));
        Ok(pool)
    }
}

impl Drop for LoopbackTransport {
    fn drop(&mut self) {
        // Leave the fabric so the name can be reused; only remove our own entry.
        let mut agents = self.fabric.inner.agents.lock();
        if agents
            .get(&self.agent.name)
            .is_some_and(|a| a.uid == self.agent.uid)
        {
            agents.remove(&self.agent.name);
        }
    }
}

impl fmt::Debug for LoopbackTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackTransport")
            .field("agent", &self.agent.name)
            .field("fabric", &format_args!("{:#018x}", self.fabric.id()))
            .field("workers", &self.workers)
            .field("regions", &self.agent.regions.read().len())
            .field("peers", &self.peers.read().len())
            .finish()
    }
}
