//! [`NixlTransport`]: one NIXL agent per endpoint, implementing the core contract:
//! registration, metadata exchange, and the descriptor cache (`prepare`) that `post` reuses.
//!
//! This file owns the endpoint itself and its shared state (constructor, accessors, drop);
//! the rest is split by concern:
//! - `regions`: local regions and `register`;
//! - `peers`: `load_peer`, retiring batches made from replaced metadata, region checks;
//! - `prepared`: [`Prepared`], the NIXL state of a prepared batch;
//! - `prepare`: validation and translation of a batch into descriptor lists and requests;
//! - `post`: re-checks and starts a prepared batch;
//! - `trait_impl`: the [`Transport`](reshard_core::Transport) impl, delegating to the above.

mod peers;
mod post;
mod prepare;
mod prepared;
mod regions;
mod trait_impl;

use parking_lot::Mutex;
use reshard_core::{Error, ErrorKind, ExecutionLog, OwnerId, PreparedBatch, Result};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::agent::NixlAgent;
use crate::options::{NixlOptions, MAX_LANES};
use crate::{quarantine, runtime, SCHEME};

use peers::Peer;
pub(crate) use prepared::{Group, Prepared, IDLE, QUARANTINED};
use regions::Local;

/// A NIXL endpoint: one agent (with its plugin backend) and the regions and peers it knows.
pub struct NixlTransport {
    shared: Arc<Shared>,
}

/// State shared with registrations (weakly) and prepared batches (strongly, so the agent
/// outlives every descriptor list and request made on it).
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) nixl_name: String,
    pub(crate) uid: u64,
    /// The no-progress bound: how long a wait (or an abort's drain) goes on while no pending
    /// request completes.
    pub(crate) timeout: Duration,
    /// Most bytes per request ([`NixlOptions::request_bytes`]).
    request_bytes: u64,
    /// Requests per owner in flight at once ([`NixlOptions::requests_in_flight`]).
    pub(crate) requests_in_flight: usize,
    /// Set when the [`NixlTransport`] is dropped: waiters stop waiting (after draining).
    pub(crate) closed: AtomicBool,
    /// NIXL registrations of this endpoint not yet deregistered (diagnostics and tests).
    registrations: Arc<AtomicUsize>,
    /// This rank's GPU, when configured: VRAM on other devices is refused.
    device_id: Option<u32>,
    state: Mutex<State>,
    epoch: AtomicU64,
    next_gen: AtomicU64,
    /// Where posted reads are recorded, when set ([`Transport::set_execution_log`]).
    ///
    /// [`Transport::set_execution_log`]: reshard_core::Transport::set_execution_log
    pub(crate) log: Mutex<Option<Arc<ExecutionLog>>>,
    /// Test-only: the read `prepare` leaves out of every request, when armed.
    #[cfg(feature = "fault-injection")]
    skip_read: reshard_core::fault::SkipRead,
    /// The lanes: one NIXL agent each ([`NixlOptions::lanes`]); lane 0's agent is the one
    /// peers know (its name is `nixl_name`, its metadata is exported). Declared last: dropped
    /// after every registration in `state`.
    pub(crate) lanes: Vec<Lane>,
}

/// One lane of an endpoint: a NIXL agent (its own lock, UCX worker and progress thread) and
/// what its agent reported complete.
pub(crate) struct Lane {
    pub(crate) agent: NixlAgent,
    /// Requests, and their bytes, that this lane's agent reported complete (at post or when
    /// polled): what [`NixlTransport::lane_stats`] reads.
    requests: AtomicU64,
    bytes: AtomicU64,
}

impl Lane {
    /// Counts a request of `bytes` this lane's agent reported complete.
    pub(crate) fn completed(&self, bytes: u64) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// What one lane of an endpoint moved ([`NixlTransport::lane_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaneStats {
    /// Requests the lane's NIXL agent reported complete.
    pub requests: u64,
    /// Bytes of those requests.
    pub bytes: u64,
}

#[derive(Default)]
struct State {
    regions: HashMap<u64, Local>,
    next_region: u64,
    /// Loaded peers by the owner id reads name.
    peers: HashMap<OwnerId, Arc<Peer>>,
    /// Loaded peers by NIXL agent name (several owners may name one agent).
    loaded: HashMap<String, Arc<Peer>>,
    /// Every prepared batch of this endpoint still alive, so a peer reload can find those
    /// made from the metadata it replaces.
    batches: Vec<Weak<Prepared>>,
}

fn oob(owner: OwnerId, range: Range<u64>, msg: String) -> Error {
    Error::new(ErrorKind::OutOfBounds, msg)
        .with_owner(owner)
        .with_range(range)
        .with_backend(SCHEME)
}

/// NIXL name of lane `k` of the endpoint whose lane 0 is `base`.
fn lane_name(base: &str, k: usize) -> String {
    if k == 0 {
        base.to_owned()
    } else {
        format!("{base}.lane{k}")
    }
}

/// A name no other NIXL agent (in this or another process or host) is likely to carry, so a
/// re-created endpoint is never confused with its predecessor of the same reshard name.
fn unique_name(agent: &str, uid: u64) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{agent}@{:x}.{uid:x}.{nanos:x}", std::process::id())
}

impl NixlTransport {
    /// Creates endpoint `agent`: loads the NIXL runtime if needed (`Unavailable` when it is
    /// missing), creates a NIXL agent and the configured plugin backend.
    pub fn new(agent: &str, options: &NixlOptions) -> Result<Self> {
        if agent.is_empty() || agent.len() > 1024 || agent.contains('\0') {
            return Err(Error::new(
                ErrorKind::Config,
                "nixl agent names must be 1..=1024 bytes without NUL",
            )
            .with_backend(SCHEME));
        }
        if options.timeout_ms == 0 {
            return Err(Error::new(
                ErrorKind::Config,
                "backends.nixl.timeout_ms must be at least 1",
            )
            .with_backend(SCHEME));
        }
        if options.lanes == 0 || options.lanes > MAX_LANES {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "backends.nixl.lanes must be 1..={MAX_LANES} (got {})",
                    options.lanes
                ),
            )
            .with_backend(SCHEME));
        }
        if options.lanes > 1 && !options.experimental_lanes {
            // Issue 42: lanes > 1 either pass the cross-process family ten times in a row
            // under load or are refused; they stalled (README, "Lanes"), so refused.
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "backends.nixl.lanes = {} is refused: with more than one lane on every \
                     endpoint a cross-process refit can stall until the no-progress bound \
                     quarantines it (a known defect, not yet explained: \
                     backends/nixl/README.md, \"Lanes\"); set \
                     backends.nixl.experimental_lanes = true to run them anyway",
                    options.lanes
                ),
            )
            .with_backend(SCHEME));
        }
        if options.request_bytes < 1 << 20 || options.requests_in_flight == 0 {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "backends.nixl.request_bytes must be at least 1 MiB (got {}) and \
                     backends.nixl.requests_in_flight at least 1 (got {})",
                    options.request_bytes, options.requests_in_flight
                ),
            )
            .with_backend(SCHEME));
        }
        runtime::ensure(options.plugin_dir.as_deref())?;
        static NEXT_UID: AtomicU64 = AtomicU64::new(1);
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let nixl_name = unique_name(agent, uid);
        // Lane 0 carries the endpoint's name; the others derive theirs from it (unique too).
        let lanes = (0..options.lanes)
            .map(|k| {
                let name = lane_name(&nixl_name, k);
                Ok(Lane {
                    agent: NixlAgent::new(&name, options)?,
                    requests: AtomicU64::new(0),
                    bytes: AtomicU64::new(0),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            agent,
            nixl = %nixl_name,
            plugin = %options.backend,
            lanes = options.lanes,
            "nixl agent"
        );
        Ok(NixlTransport {
            shared: Arc::new(Shared {
                name: agent.to_owned(),
                nixl_name,
                uid,
                timeout: Duration::from_millis(options.timeout_ms),
                request_bytes: options.request_bytes,
                requests_in_flight: options.requests_in_flight,
                closed: AtomicBool::new(false),
                registrations: Arc::new(AtomicUsize::new(0)),
                device_id: options.device_id,
                state: Mutex::new(State {
                    next_region: 1,
                    ..State::default()
                }),
                epoch: AtomicU64::new(0),
                next_gen: AtomicU64::new(1),
                log: Mutex::new(None),
                #[cfg(feature = "fault-injection")]
                skip_read: reshard_core::fault::SkipRead::default(),
                lanes,
            }),
        })
    }

    /// The name NIXL knows this endpoint's agent by (unique per process and creation).
    pub fn nixl_name(&self) -> &str {
        &self.shared.nixl_name
    }

    /// Number of lanes (NIXL agents) of this endpoint ([`NixlOptions::lanes`]).
    pub fn lanes(&self) -> usize {
        self.shared.lanes.len()
    }

    /// Per lane, the requests and bytes its NIXL agent reported complete since the endpoint
    /// was created: counted where that agent's `postXferReq` or `getXferStatus` reported a
    /// request done, so it shows how posted reads really spread over the lanes.
    pub fn lane_stats(&self) -> Vec<LaneStats> {
        self.shared
            .lanes
            .iter()
            .map(|l| LaneStats {
                requests: l.requests.load(Ordering::Relaxed),
                bytes: l.bytes.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// The no-progress bound of `wait` and of `abort`'s drain: how long they go on while no
    /// pending request completes.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// NIXL registrations of this endpoint still in place. A dropped [`Registration`] stays
    /// registered while a prepared, posted or quarantined batch still uses its region.
    ///
    /// [`Registration`]: reshard_core::Registration
    pub fn registrations(&self) -> usize {
        self.shared.registrations.load(Ordering::Acquire)
    }

    /// Batches of this endpoint held by the quarantine: their reads were still in progress
    /// when they were ended, and their memory stays alive until NIXL reports them finished.
    pub fn quarantined(&self) -> usize {
        quarantine::count(self.shared.uid)
    }

    /// Test-only fault injection (feature `fault-injection`, off by default): while set to
    /// `Some(i)`, every `prepare` leaves read `i` of its batch out of the NIXL requests it
    /// makes (its descriptors are never handed to a request, so it is never posted, counted in
    /// the [`reshard_core::WireReport`] or recorded in the execution log), as a backend that
    /// loses a read would. NIXL requests are built once per prepared batch, so the switch acts
    /// on batches prepared while it is set. Reads are numbered in batch order.
    #[cfg(feature = "fault-injection")]
    pub fn inject_skip_read(&self, read: Option<usize>) {
        self.shared.skip_read.set(read);
    }

    /// What a batch prepared by a NIXL endpoint holds (`None` for other batches).
    pub fn prepared_stats(batch: &PreparedBatch) -> Option<PreparedStats> {
        let p = batch.state::<Arc<Prepared>>()?;
        let (local_lists, remote_lists) = p.nixl.lock().as_ref().map_or((0, 0), |n| {
            n.lists.iter().fold((0, 0), |(l, r), x| {
                (l.max(x.local.len()), r.max(x.remote.len()))
            })
        });
        let mut lanes: Vec<usize> = p.groups.iter().map(|g| g.lane).collect();
        lanes.sort_unstable();
        lanes.dedup();
        Some(PreparedStats {
            requests: p.groups.len(),
            lanes: lanes.len(),
            local_lists,
            remote_lists,
            request_builds: p.builds.load(Ordering::Relaxed),
            posts: p.posts.load(Ordering::Relaxed),
        })
    }
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        // Wakes every waiter (rule 4); the agent itself lives on while any batch, in-flight
        // handle or quarantine entry holds the shared state.
        self.shared.closed.store(true, Ordering::Release);
    }
}

/// The descriptor cache of one prepared batch, for diagnostics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedStats {
    /// NIXL transfer requests (per owner and memory kind, one per `request_bytes`).
    pub requests: usize,
    /// Lanes holding at least one of those requests (each request lives on one lane).
    pub lanes: usize,
    /// Prepared local descriptor lists per lane holding requests (one per local memory kind;
    /// each such lane prepares the same lists on its own agent).
    pub local_lists: usize,
    /// Prepared remote descriptor lists per lane holding requests (one per owner and memory
    /// kind).
    pub remote_lists: usize,
    /// Times the requests were made: 1 while every post reuses them.
    pub request_builds: u64,
    /// Times the batch was posted.
    pub posts: u64,
}

impl Shared {
    /// Lane 0's agent: the one peers know and whose metadata is exported.
    pub(crate) fn agent(&self) -> &NixlAgent {
        &self.lanes[0].agent
    }

    /// Every lane's agent, lane 0 first.
    pub(crate) fn agents(&self) -> impl Iterator<Item = &NixlAgent> {
        self.lanes.iter().map(|l| &l.agent)
    }

    fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    fn generation(&self) -> u64 {
        self.next_gen.fetch_add(1, Ordering::Relaxed)
    }
}

impl fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.state.lock();
        f.debug_struct("NixlTransport")
            .field("agent", &self.shared.name)
            .field("nixl", &self.shared.nixl_name)
            .field("regions", &st.regions.len())
            .field("peers", &st.peers.len())
            .finish()
    }
}
