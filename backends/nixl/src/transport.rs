//! [`NixlTransport`]: one NIXL agent per endpoint, implementing the core contract:
//! registration, metadata exchange, and the descriptor cache (`prepare`) that `post` reuses.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use reshard_core::contract::{self, span, RemoteLookup};
use reshard_core::{
    Capability, Error, ErrorKind, ExecutionLog, InFlight, MemoryBlock, MemoryKind, OwnerId,
    PreparedBatch, ReadBatch, ReadDesc, Registration, Result, Transport,
};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::agent::{NixlAgent, Prepped, Reg, Request};
use crate::meta::{incarnation_of, AgentMeta, RegionMeta};
use crate::options::NixlOptions;
use crate::xfer::NixlInFlight;
use crate::{quarantine, runtime, BACKEND};

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
    pub(crate) log: Mutex<Option<Arc<ExecutionLog>>>,
    /// Test-only: index of a read `prepare` leaves out of every request (`u64::MAX`: none).
    #[cfg(feature = "fault-injection")]
    skip_read: AtomicU64,
    /// Declared last: dropped after every registration in `state`.
    pub(crate) agent: NixlAgent,
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

/// A local registered region.
struct Local {
    mem: Arc<LocalMem>,
    addr: u64,
    len: u64,
    kind: MemoryKind,
    /// Changes when the id is reused by nothing but a new registration; checked at post.
    generation: u64,
}

/// The NIXL registration of a local region and the memory behind it, shared by the region
/// entry and every prepared batch that reads into the region (and so by a quarantined one):
/// the last holder deregisters, and only then lets go of the memory.
pub(crate) struct LocalMem {
    reg: Option<Reg>,
    /// Only held: released after `reg` (see `Drop`).
    _block: Arc<dyn MemoryBlock>,
    registrations: Arc<AtomicUsize>,
}

impl Drop for LocalMem {
    fn drop(&mut self) {
        // Deregister first, explicitly: the block (a field, dropped after this body) must
        // outlive its registration.
        if let Some(reg) = self.reg.take() {
            drop(reg);
            self.registrations.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Address space of a memory kind, for comparing address ranges.
fn space(kind: MemoryKind) -> u64 {
    match kind {
        MemoryKind::Dram => 0,
        MemoryKind::Vram { device } => 1 + u64::from(device),
    }
}

/// A loaded peer: its NIXL name, the regions its metadata lists, and the exact bytes loaded.
struct Peer {
    nixl_name: String,
    /// Its incarnation ([`incarnation_of`] its NIXL name).
    incarnation: u64,
    agent: String,
    regions: HashMap<u64, RegionMeta>,
    generation: u64,
    raw: Bytes,
}

/// One NIXL request's worth of reads: one owner, one local and one remote memory kind.
///
/// A read longer than the request size is split into pieces (consecutive descriptors, in
/// this or the following groups of its owner); every field below is per piece.
pub(crate) struct Group {
    pub(crate) owner: OwnerId,
    local_list: usize,
    remote_list: usize,
    local_ix: Vec<i32>,
    remote_ix: Vec<i32>,
    /// Per piece: the whole read's length if the piece starts a read, else 0 (the execution
    /// log records a read once, whole, when its first piece is posted).
    read_len: Vec<u64>,
    /// Reads whose last piece this request carries: what its completion adds to the count.
    ends: u64,
    /// Remote byte range of its first read, for errors.
    pub(crate) range: Range<u64>,
    /// Bytes its pieces move (at most the request size).
    pub(crate) bytes: u64,
}

impl Group {
    /// Reads this request completes (those whose last piece it carries).
    pub(crate) fn reads(&self) -> u64 {
        self.ends
    }
}

/// What a remote descriptor list was prepared against, to resolve its descriptors back to
/// owner and region for the execution log.
struct RemoteList {
    /// The owner whose peer entry gave the NIXL agent name, and every owner that named that
    /// agent at prepare (several owners may name one agent).
    owner: OwnerId,
    owners: Vec<OwnerId>,
    /// The peer metadata (regions with addresses) of that agent.
    peer: Arc<Peer>,
    /// `(address, length)` of every descriptor, in list order: exactly what NIXL was given.
    descs: Vec<(u64, u64)>,
}

/// The NIXL objects of a prepared batch. Field order is release order: requests before the
/// lists they were made from.
pub(crate) struct NixlObjects {
    /// Per segment, one request per group. `None` after a failure that every pending request
    /// was seen to end: the next post re-makes them from the prepared lists.
    pub(crate) requests: Option<Vec<Vec<Request>>>,
    local_lists: Vec<Prepped>,
    remote_lists: Vec<Prepped>,
}

/// [`Prepared::phase`]: no request in progress; `post` may take it.
pub(crate) const IDLE: u8 = 0;
/// A [`NixlInFlight`] owns the requests.
pub(crate) const BUSY: u8 = 1;
/// Requests may still be in progress with nobody waiting: the quarantine holds the batch.
/// Never posted again.
pub(crate) const QUARANTINED: u8 = 2;
/// A peer it reads from was reloaded: its NIXL objects were released. Never posted again.
pub(crate) const RETIRED: u8 = 3;

/// The NIXL state of a [`PreparedBatch`]: prepared descriptor lists, the requests made from
/// them, and what `post` re-checks.
///
/// Invariant: a request is only released (dropped) while the phase is `IDLE` or `RETIRED`
/// (every request seen to end), or by the quarantine once it saw them end. Whoever holds an
/// `Arc<Prepared>` keeps the lists, the registrations and the memory alive, so a batch's
/// in-flight handle and the quarantine keep everything its reads touch.
pub(crate) struct Prepared {
    /// `None` once released (the batch was retired or left the quarantine). Declared first:
    /// released before the registrations and memory below.
    pub(crate) nixl: Mutex<Option<NixlObjects>>,
    /// Segments run one after another; a batch without overlapping destinations has one.
    pub(crate) segments: Vec<Vec<Group>>,
    /// `(region id, generation, registration and memory)` of every local region used.
    locals: Vec<(u64, u64, Arc<LocalMem>)>,
    /// `(space, start, end)` local address range of every local region used.
    local_ranges: Vec<(u64, u64, u64)>,
    peers: Vec<(OwnerId, u64)>,
    /// NIXL names of the remote agents the remote lists were made from.
    remote_agents: Vec<String>,
    /// Descriptors of each local list as handed to NIXL, and the local regions
    /// `(id, space, start, end)` they may lie in, for the execution log.
    local_descs: Vec<Vec<(u64, u64)>>,
    local_spaces: Vec<u64>,
    local_table: Vec<(u64, u64, u64, u64)>,
    /// Per remote list, what it was prepared against (execution log).
    remote_info: Vec<RemoteList>,
    /// Reads and bytes of the batch as planned (diagnostics only; `wait` counts its own).
    pub(crate) planned: (u64, u64),
    /// `IDLE`, `BUSY`, `QUARANTINED` or `RETIRED`; moves out of `IDLE` only under the
    /// endpoint's state lock.
    pub(crate) phase: AtomicU8,
    /// Times the requests were made (1 unless a failure released them).
    builds: AtomicU64,
    /// Times the batch was posted.
    pub(crate) posts: AtomicU64,
    /// Declared last: the agent outlives the lists and requests above.
    pub(crate) shared: Arc<Shared>,
}

fn oob(owner: OwnerId, range: Range<u64>, msg: String) -> Error {
    Error::new(ErrorKind::OutOfBounds, msg)
        .with_owner(owner)
        .with_range(range)
        .with_backend(BACKEND)
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
            .with_backend(BACKEND));
        }
        if options.timeout_ms == 0 {
            return Err(Error::new(
                ErrorKind::Config,
                "backends.nixl.timeout_ms must be at least 1",
            )
            .with_backend(BACKEND));
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
            .with_backend(BACKEND));
        }
        runtime::ensure(options.plugin_dir.as_deref())?;
        static NEXT_UID: AtomicU64 = AtomicU64::new(1);
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let nixl_name = unique_name(agent, uid);
        let nixl = NixlAgent::new(&nixl_name, options)?;
        tracing::debug!(agent, nixl = %nixl_name, plugin = %options.backend, "nixl agent");
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
                skip_read: AtomicU64::new(u64::MAX),
                agent: nixl,
            }),
        })
    }

    /// The name NIXL knows this endpoint's agent by (unique per process and creation).
    pub fn nixl_name(&self) -> &str {
        &self.shared.nixl_name
    }

    /// The no-progress bound of `wait` and of `abort`'s drain: how long they go on while no
    /// pending request completes.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// NIXL registrations of this endpoint still in place. A dropped [`Registration`] stays
    /// registered while a prepared, posted or quarantined batch still uses its region.
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
        let v = read.map_or(u64::MAX, |i| i as u64);
        self.shared.skip_read.store(v, Ordering::Relaxed);
    }

    /// What a batch prepared by a NIXL endpoint holds (`None` for other batches).
    pub fn prepared_stats(batch: &PreparedBatch) -> Option<PreparedStats> {
        let p = batch.state::<Arc<Prepared>>()?;
        let (local_lists, remote_lists) = p
            .nixl
            .lock()
            .as_ref()
            .map_or((0, 0), |n| (n.local_lists.len(), n.remote_lists.len()));
        Some(PreparedStats {
            segments: p.segments.len(),
            requests: p.segments.iter().map(Vec::len).sum(),
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
    /// Segments run one after another (1 unless destinations overlap).
    pub segments: usize,
    /// NIXL transfer requests (per segment, per owner and memory kind, one per
    /// `request_bytes`).
    pub requests: usize,
    /// Prepared local descriptor lists (one per local memory kind).
    pub local_lists: usize,
    /// Prepared remote descriptor lists (one per owner and memory kind).
    pub remote_lists: usize,
    /// Times the requests were made: 1 while every post reuses them.
    pub request_builds: u64,
    /// Times the batch was posted.
    pub posts: u64,
}

impl Shared {
    fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    fn generation(&self) -> u64 {
        self.next_gen.fetch_add(1, Ordering::Relaxed)
    }
}

/// A read resolved against the regions at prepare time.
struct Resolved {
    owner: OwnerId,
    remote_addr: u64,
    remote_kind: MemoryKind,
    local_addr: u64,
    local_kind: MemoryKind,
    len: u64,
    remote_range: Range<u64>,
    /// (address space, start address, end address) of the destination, for overlap
    /// detection.
    dst: (u64, u64, u64),
}

/// Splits reads (in batch order) into consecutive segments whose destinations are pairwise
/// disjoint: running segments one after another applies overlapping reads in batch order.
/// Destinations are local *address* ranges (with their address space), not region offsets:
/// the same memory registered twice is two regions but one destination.
fn segments(dsts: &[(u64, u64, u64)]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0usize;
    // Disjoint intervals of the current segment: (space, start) -> end.
    let mut seen: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    for (i, &(space, s, e)) in dsts.iter().enumerate() {
        let before = seen
            .range(..=(space, s))
            .next_back()
            .is_some_and(|(&(r, _), &end)| r == space && end > s);
        let after = seen
            .range((space, s)..)
            .next()
            .is_some_and(|(&(r, st), _)| r == space && st < e);
        if before || after {
            out.push(start..i);
            start = i;
            seen.clear();
        }
        seen.insert((space, s), e);
    }
    if start < dsts.len() {
        out.push(start..dsts.len());
    }
    out
}

impl Prepared {
    /// Makes every request from the prepared lists (at prepare, and after a failure that
    /// every pending request was seen to end).
    pub(crate) fn make_requests(&self, nixl: &NixlObjects) -> Result<Vec<Vec<Request>>> {
        let agent = &self.shared.agent;
        self.builds.fetch_add(1, Ordering::Relaxed);
        self.segments
            .iter()
            .map(|seg| {
                seg.iter()
                    .map(|g| {
                        agent
                            .make_read(
                                &nixl.local_lists[g.local_list],
                                &g.local_ix,
                                &nixl.remote_lists[g.remote_list],
                                &g.remote_ix,
                            )
                            .map_err(|e| e.with_owner(g.owner).with_range(g.range.clone()))
                    })
                    .collect()
            })
            .collect()
    }

    /// Records the reads of the given groups of segment `seg` (just posted) in `log`, as the
    /// descriptors handed to NIXL resolve: the owner whose peer entry named the remote agent
    /// the remote list was prepared against, the region of that agent's metadata holding the
    /// remote descriptor's address (offset = address - region base), and the local region
    /// holding the local descriptor's address.
    pub(crate) fn record(&self, log: &ExecutionLog, seg: usize, groups: &[usize]) {
        let mut out = Vec::new();
        for &g in groups {
            let Some(group) = self.segments.get(seg).and_then(|s| s.get(g)) else {
                continue;
            };
            let remote = &self.remote_info[group.remote_list];
            let owner = if remote.owners.contains(&remote.owner) {
                remote.owner
            } else {
                remote.owners.iter().copied().min().unwrap_or(remote.owner)
            };
            let local = &self.local_descs[group.local_list];
            let space_l = self.local_spaces[group.local_list];
            for k in 0..group.local_ix.len() {
                // A read is recorded whole, from its first piece.
                let len = group.read_len[k];
                if len == 0 {
                    continue;
                }
                let (la, _) = local[group.local_ix[k] as usize];
                let (ra, _) = remote.descs[group.remote_ix[k] as usize];
                let (remote_region, remote_offset) = remote
                    .peer
                    .regions
                    .values()
                    .filter(|r| ra >= r.addr && ra.saturating_add(len) <= r.addr + r.len)
                    .map(|r| (r.id, ra - r.addr))
                    .min()
                    .unwrap_or((0, ra));
                let (local_region, local_offset) = self
                    .local_table
                    .iter()
                    .filter(|&&(_, sp, s, e)| {
                        sp == space_l && la >= s && la.saturating_add(len) <= e
                    })
                    .map(|&(id, _, s, _)| (id, la - s))
                    .min()
                    .unwrap_or((0, la));
                out.push(ReadDesc {
                    owner,
                    remote_region,
                    remote_offset,
                    local_region,
                    local_offset,
                    len,
                });
            }
        }
        log.record(out);
    }

    /// `(space, start, end)` of every local region this batch writes into.
    pub(crate) fn local_ranges(&self) -> &[(u64, u64, u64)] {
        &self.local_ranges
    }

    /// Ids of the local regions this batch writes into.
    pub(crate) fn local_regions(&self) -> Vec<u64> {
        self.locals.iter().map(|l| l.0).collect()
    }

    /// Releases the NIXL objects (requests, then lists). Only for a batch none of whose
    /// requests is in progress.
    pub(crate) fn release_nixl(&self) {
        let old = self.nixl.lock().take();
        drop(old);
    }

    /// Fails when a region or peer this batch was prepared against has changed since.
    fn check_live(&self, st: &State) -> Result<()> {
        for &(id, generation, _) in &self.locals {
            if st.regions.get(&id).map(|l| l.generation) != Some(generation) {
                return Err(Error::new(
                    ErrorKind::Transport,
                    format!("local region {id} was deregistered after prepare; prepare again"),
                )
                .with_backend(BACKEND));
            }
        }
        for &(owner, generation) in &self.peers {
            if st.peers.get(&owner).map(|p| p.generation) != Some(generation) {
                return Err(Error::new(
                    ErrorKind::Transport,
                    format!("metadata of owner {owner} changed after prepare; prepare again"),
                )
                .with_owner(owner)
                .with_backend(BACKEND));
            }
        }
        Ok(())
    }
}

// `Prepared` has no `Drop`: its last `Arc` goes only when no in-flight handle and no
// quarantine entry holds it, i.e. when none of its requests can be in progress, so its
// fields are released in declaration order without waiting: requests, lists, then the
// registrations (deregistered when no other batch or region entry holds them) and memory.

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

/// Live batches of the endpoint whose remote lists were made from agent `nixl_name`'s
/// metadata (forgets dead ones).
fn users(st: &mut State, nixl_name: &str) -> Vec<Arc<Prepared>> {
    st.batches.retain(|w| w.strong_count() > 0);
    st.batches
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|p| p.remote_agents.iter().any(|a| a == nixl_name))
        .collect()
}

fn has_users(st: &mut State, nixl_name: &str) -> bool {
    !users(st, nixl_name).is_empty()
}

/// Before the metadata of agent `nixl_name` is invalidated: refuses while a batch made from it
/// is posted or quarantined (its requests may be in progress), and releases the NIXL objects
/// of the idle ones, which can then never be posted again.
///
/// Releasing them now, rather than keeping the old remote loaded until they are dropped, is
/// deliberate: NIXL keeps one metadata per agent name, so the new metadata cannot be loaded
/// while the old one stays, and idle requests and lists are safe to release at any time.
/// They already fail `check_live` (the peer's generation changes), so nothing is lost, and
/// their later drop finds nothing made from the freed metadata. Runs under the state lock, so
/// no `post` can move a batch out of `IDLE` meanwhile.
fn retire_users(st: &mut State, nixl_name: &str, owner: OwnerId) -> Result<()> {
    let users = users(st, nixl_name);
    for p in &users {
        let what = match p.phase.load(Ordering::Acquire) {
            BUSY => "is in flight: wait for it or abort it first",
            QUARANTINED => {
                "was ended while its reads still ran and is quarantined until they finish: \
                 wait for them (NixlTransport::quarantined) first"
            }
            _ => continue,
        };
        return Err(Error::new(
            ErrorKind::Transport,
            format!(
                "cannot reload the metadata of owner {owner} (NIXL agent {nixl_name}): a batch \
                 reading from it {what}"
            ),
        )
        .with_owner(owner)
        .with_backend(BACKEND)
        .set_retryable(true));
    }
    for p in users {
        let idle = p
            .phase
            .compare_exchange(IDLE, RETIRED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if idle || p.phase.load(Ordering::Acquire) == RETIRED {
            p.release_nixl();
        }
    }
    Ok(())
}

/// Checks every non-empty region of a peer's envelope against the registrations in the NIXL
/// metadata just loaded for agent `name` (one prepared remote list per memory kind; only when
/// that fails, one per region to name the culprit): `OutOfBounds` naming the owner and the
/// advertised byte range of the first region NIXL does not find registered.
fn check_regions(
    agent: &NixlAgent,
    name: &str,
    owner: OwnerId,
    regions: &[RegionMeta],
) -> Result<()> {
    let mut kinds: Vec<MemoryKind> = regions.iter().map(|r| r.kind).collect();
    kinds.sort_unstable_by_key(|&k| space(k));
    kinds.dedup();
    for kind in kinds {
        let of_kind: Vec<&RegionMeta> = regions
            .iter()
            .filter(|r| r.kind == kind && r.len > 0)
            .collect();
        let descs: Vec<(u64, u64)> = of_kind.iter().map(|r| (r.addr, r.len)).collect();
        if descs.is_empty() || agent.prep_dlist(name, kind, &descs).is_ok() {
            continue;
        }
        for r in of_kind {
            if let Err(e) = agent.prep_dlist(name, kind, &[(r.addr, r.len)]) {
                return Err(oob(
                    owner,
                    0..r.len,
                    format!(
                        "metadata of owner {owner} advertises region {} as {} bytes at {:#x}, \
                         but its NIXL agent registered no such memory ({e})",
                        r.id, r.len, r.addr
                    ),
                )
                .with_source(e));
            }
        }
    }
    Ok(())
}

#[async_trait]
impl Transport for NixlTransport {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn agent(&self) -> &str {
        &self.shared.name
    }

    fn capabilities(&self) -> Capability {
        Capability {
            one_sided_read: true,
            one_sided_write: false,
            // VRAM is registered as VRAM_SEG when asked, but not shown to work on this
            // machine (no GPU), so it is not advertised.
            vram: false,
            cross_process: true,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.shared.epoch.load(Ordering::Acquire)
    }

    fn incarnation(&self) -> u64 {
        incarnation_of(&self.shared.nixl_name)
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.shared
            .state
            .lock()
            .peers
            .get(&owner)
            .map(|p| p.incarnation)
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let s = &self.shared;
        let kind = block.kind();
        if let (MemoryKind::Vram { device }, Some(mine)) = (kind, s.device_id) {
            if device != mine {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "block is on GPU {device} but this endpoint uses GPU {mine} (device_id)"
                    ),
                )
                .with_backend(BACKEND));
            }
        }
        let (addr, len) = (block.addr(), block.len());
        if len > 0 && (addr == 0 || addr.checked_add(len).is_none()) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!("block {addr:#x}+{len} is not a valid address range"),
            )
            .with_backend(BACKEND));
        }
        // Zero-length blocks get an id (ids stay aligned across backends) but nothing to
        // register: no read can touch them.
        let reg = if len == 0 {
            None
        } else {
            Some(s.agent.register(addr, len, kind).map_err(|e| {
                match kind {
                    MemoryKind::Dram => e,
                    MemoryKind::Vram { .. } => Error::new(
                        ErrorKind::Unsupported,
                        format!("NIXL could not register {kind} memory (no usable GPU?): {e}"),
                    )
                    .with_backend(BACKEND),
                }
            })?)
        };
        if reg.is_some() {
            s.registrations.fetch_add(1, Ordering::AcqRel);
        }
        let mem = Arc::new(LocalMem {
            reg,
            _block: block,
            registrations: Arc::clone(&s.registrations),
        });
        let id = {
            let mut st = s.state.lock();
            let id = st.next_region;
            st.next_region += 1;
            let generation = s.generation();
            st.regions.insert(
                id,
                Local {
                    mem,
                    addr: addr as u64,
                    len: len as u64,
                    kind,
                    generation,
                },
            );
            id
        };
        s.bump();
        tracing::debug!(agent = %s.name, region = id, len, %kind, "nixl register");
        let weak = Arc::downgrade(&self.shared);
        Ok(Registration::new(id, len as u64, kind, move || {
            if let Some(s) = weak.upgrade() {
                // Deregister outside the lock: NIXL calls and the block's Drop may take time.
                // The region's registration is shared with every batch that reads into it;
                // it is deregistered when the last of them (and this entry) is gone.
                let removed = s.state.lock().regions.remove(&id);
                if removed.is_some() {
                    s.bump();
                }
                drop(removed);
            }
        }))
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        let s = &self.shared;
        let st = s.state.lock();
        let mut regions: Vec<RegionMeta> = st
            .regions
            .iter()
            .map(|(&id, l)| RegionMeta {
                id,
                addr: l.addr,
                len: l.len,
                kind: l.kind,
            })
            .collect();
        regions.sort_unstable_by_key(|r| r.id);
        // Under the lock: the NIXL metadata matches the region list exactly.
        let nixl_md = s.agent.local_md()?;
        Ok(AgentMeta {
            agent: s.name.clone(),
            nixl_name: s.nixl_name.clone(),
            regions,
            nixl_md,
        }
        .encode())
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let s = &self.shared;
        let meta = AgentMeta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        if meta.nixl_name == s.nixl_name {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "an endpoint cannot load its own metadata as a peer",
            )
            .with_owner(owner)
            .with_backend(BACKEND));
        }
        let mut st = s.state.lock();
        if st.peers.get(&owner).is_some_and(|p| p.raw == metadata) {
            // Same bytes again: nothing changed, prepared batches stay valid.
            return Ok(());
        }
        let peer = match st.loaded.get(&meta.nixl_name) {
            Some(p) if p.raw == metadata => Arc::clone(p),
            old => {
                if old.is_some() {
                    // Replace, not merge: drop what NIXL holds for the old metadata first,
                    // but never under a request made from it (invalidation destroys the
                    // remote keys those requests read with, and their completion could no
                    // longer be observed).
                    retire_users(&mut st, &meta.nixl_name, owner)?;
                    s.agent
                        .invalidate_remote(&meta.nixl_name)
                        .map_err(|e| e.with_owner(owner))?;
                    st.loaded.remove(&meta.nixl_name);
                }
                let name = s
                    .agent
                    .load_remote(&meta.nixl_md)
                    .map_err(|e| e.with_owner(owner))?;
                if name != meta.nixl_name {
                    // Forget what was just loaded, unless that agent is one this endpoint
                    // already uses (its batches' requests need its keys).
                    if !st.loaded.contains_key(&name) && !has_users(&mut st, &name) {
                        let _ = s.agent.invalidate_remote(&name);
                    }
                    return Err(Error::new(
                        ErrorKind::Decode,
                        format!(
                            "metadata envelope names NIXL agent {:?} but carries metadata of \
                             {name:?}",
                            meta.nixl_name
                        ),
                    )
                    .with_owner(owner)
                    .with_backend(BACKEND));
                }
                // The envelope's regions are the peer's claim; NIXL's own metadata holds the
                // descriptors it registered. A region advertised beyond them is refused here,
                // before any read is prepared against it.
                if let Err(e) = check_regions(&s.agent, &name, owner, &meta.regions) {
                    if !st.loaded.contains_key(&name) && !has_users(&mut st, &name) {
                        let _ = s.agent.invalidate_remote(&name);
                    }
                    return Err(e);
                }
                let p = Arc::new(Peer {
                    incarnation: incarnation_of(&name),
                    nixl_name: name.clone(),
                    agent: meta.agent.clone(),
                    regions: meta.regions.iter().map(|r| (r.id, *r)).collect(),
                    generation: s.generation(),
                    raw: metadata,
                });
                // Owners that named the old metadata of this agent now see the new one.
                for v in st.peers.values_mut() {
                    if v.nixl_name == name {
                        *v = Arc::clone(&p);
                    }
                }
                st.loaded.insert(name, Arc::clone(&p));
                p
            }
        };
        tracing::debug!(agent = %s.name, owner, peer = %peer.agent, "nixl peer");
        st.peers.insert(owner, peer);
        drop(st);
        s.bump();
        Ok(())
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let s = &self.shared;
        if i32::try_from(batch.reads.len()).is_err() {
            return Err(
                Error::new(ErrorKind::Unsupported, "more than 2^31 reads in one batch")
                    .with_backend(BACKEND),
            );
        }
        let mut resolved = Vec::with_capacity(batch.reads.len());
        let mut locals: BTreeMap<u64, (u64, Arc<LocalMem>, (u64, u64, u64))> = BTreeMap::new();
        let mut peers: BTreeMap<OwnerId, (u64, String, Arc<Peer>)> = BTreeMap::new();
        #[cfg(feature = "fault-injection")]
        let skip = usize::try_from(s.skip_read.load(Ordering::Relaxed)).ok();
        #[cfg(not(feature = "fault-injection"))]
        let skip: Option<usize> = None;
        // Held until the batch is registered in `batches`: no peer reload can invalidate the
        // metadata its lists and requests are made from in between.
        let mut st = s.state.lock();
        contract::validate_batch(
            BACKEND,
            &s.name,
            &batch,
            |owner, region| match st.peers.get(&owner) {
                None => RemoteLookup::NoPeer,
                Some(p) => p
                    .regions
                    .get(&region)
                    .map_or(RemoteLookup::NoRegion, |r| RemoteLookup::Len(r.len)),
            },
            |region| st.regions.get(&region).map(|l| l.len),
        )?;
        {
            // Every look-up below succeeds (validated under this same lock); failing anyway
            // is an internal error, never a panic.
            let missing = |i: usize, r: &ReadDesc, what: &str| {
                contract::validated_lookup_failed(BACKEND, i, r, what)
            };
            for (i, r) in batch.reads.iter().enumerate() {
                let remote = span(r.remote_offset, r.len);
                let peer = st
                    .peers
                    .get(&r.owner)
                    .ok_or_else(|| missing(i, r, "peer"))?;
                let region = peer
                    .regions
                    .get(&r.remote_region)
                    .ok_or_else(|| missing(i, r, "remote region"))?;
                let local = st
                    .regions
                    .get(&r.local_region)
                    .ok_or_else(|| missing(i, r, "local region"))?;
                locals.entry(r.local_region).or_insert_with(|| {
                    (
                        local.generation,
                        Arc::clone(&local.mem),
                        (space(local.kind), local.addr, local.addr + local.len),
                    )
                });
                peers
                    .entry(r.owner)
                    .or_insert_with(|| (peer.generation, peer.nixl_name.clone(), Arc::clone(peer)));
                resolved.push(Resolved {
                    owner: r.owner,
                    remote_addr: region.addr + r.remote_offset,
                    remote_kind: region.kind,
                    local_addr: local.addr + r.local_offset,
                    local_kind: local.kind,
                    len: r.len,
                    remote_range: remote,
                    dst: (
                        space(local.kind),
                        local.addr + r.local_offset,
                        local.addr + r.local_offset + r.len,
                    ),
                });
            }
        }
        // Local lists: one per local memory kind; remote lists: one per (owner, kind). Index
        // of each read inside its lists.
        let mut local_keys: Vec<MemoryKind> = Vec::new();
        let mut remote_keys: Vec<(OwnerId, MemoryKind)> = Vec::new();
        let mut local_descs: Vec<Vec<(u64, u64)>> = Vec::new();
        let mut remote_descs: Vec<Vec<(u64, u64)>> = Vec::new();
        // Per read, its pieces: (local list, local index, remote list, remote index, length).
        let piece = s.request_bytes;
        let mut at: Vec<Vec<(usize, i32, usize, i32, u64)>> = Vec::with_capacity(resolved.len());
        for r in &resolved {
            let l = match local_keys.iter().position(|k| *k == r.local_kind) {
                Some(l) => l,
                None => {
                    local_keys.push(r.local_kind);
                    local_descs.push(Vec::new());
                    local_keys.len() - 1
                }
            };
            let key = (r.owner, r.remote_kind);
            let m = match remote_keys.iter().position(|k| *k == key) {
                Some(m) => m,
                None => {
                    remote_keys.push(key);
                    remote_descs.push(Vec::new());
                    remote_keys.len() - 1
                }
            };
            let mut pieces = Vec::with_capacity(r.len.div_ceil(piece) as usize);
            let mut off = 0;
            while off < r.len {
                let n = piece.min(r.len - off);
                local_descs[l].push((r.local_addr + off, n));
                remote_descs[m].push((r.remote_addr + off, n));
                pieces.push((
                    l,
                    local_descs[l].len() as i32 - 1,
                    m,
                    remote_descs[m].len() as i32 - 1,
                    n,
                ));
                off += n;
            }
            at.push(pieces);
        }
        if local_descs
            .iter()
            .chain(&remote_descs)
            .any(|d| i32::try_from(d.len()).is_err())
        {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "more than 2^31 NIXL descriptors in one list (reads split at request_bytes)",
            )
            .with_backend(BACKEND));
        }
        let local_lists = local_keys
            .iter()
            .zip(&local_descs)
            .map(|(&k, d)| s.agent.prep_dlist("", k, d))
            .collect::<Result<Vec<_>>>()?;
        let remote_lists = remote_keys
            .iter()
            .zip(&remote_descs)
            .map(|(&(owner, k), d)| {
                let name = &peers[&owner].1;
                s.agent.prep_dlist(name, k, d).map_err(|e| {
                    // NIXL checks every remote descriptor against the registrations in the
                    // peer's NIXL metadata. Name the first read it refuses (trying each alone:
                    // the error path only) as out of bounds: the peer's envelope advertised
                    // bytes it did not register.
                    let bad = resolved.iter().find(|r| {
                        r.owner == owner
                            && r.remote_kind == k
                            && s.agent
                                .prep_dlist(name, k, &[(r.remote_addr, r.len)])
                                .is_err()
                    });
                    match bad {
                        Some(r) => oob(
                            owner,
                            r.remote_range.clone(),
                            format!(
                                "NIXL refuses remote bytes {}..{} of owner {owner}: they are not \
                                 inside memory its agent registered ({e})",
                                r.remote_range.start, r.remote_range.end
                            ),
                        )
                        .with_source(e),
                        None => e.with_owner(owner),
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let dsts: Vec<_> = resolved.iter().map(|r| r.dst).collect();
        let cuts = segments(&dsts);
        let mut segs = Vec::with_capacity(cuts.len());
        for cut in &cuts {
            let mut groups: Vec<Group> = Vec::new();
            for i in cut.clone() {
                if skip == Some(i) {
                    // Fault injection: this read is never handed to a request.
                    continue;
                }
                let r = &resolved[i];
                let last = at[i].len() - 1;
                for (k, &(l, li, m, mi, n)) in at[i].iter().enumerate() {
                    let read_len = if k == 0 { r.len } else { 0 };
                    let ends = u64::from(k == last);
                    // The newest request of these lists, while it has room: NIXL reports
                    // progress only per request, so requests are capped at `request_bytes`
                    // to give the no-progress timer (and abort) steps to see.
                    match groups.iter_mut().rev().find(|g| {
                        g.local_list == l
                            && g.remote_list == m
                            && g.bytes.saturating_add(n) <= piece
                    }) {
                        Some(g) => {
                            g.local_ix.push(li);
                            g.remote_ix.push(mi);
                            g.read_len.push(read_len);
                            g.ends += ends;
                            g.bytes += n;
                        }
                        None => groups.push(Group {
                            owner: r.owner,
                            local_list: l,
                            remote_list: m,
                            local_ix: vec![li],
                            remote_ix: vec![mi],
                            read_len: vec![read_len],
                            ends,
                            range: r.remote_range.clone(),
                            bytes: n,
                        }),
                    }
                }
            }
            segs.push(groups);
        }
        let remote_info = remote_keys
            .iter()
            .zip(remote_descs)
            .map(|(&(owner, _), descs)| {
                let (_, name, peer) = &peers[&owner];
                let mut owners: Vec<OwnerId> = st
                    .peers
                    .iter()
                    .filter(|(_, p)| p.nixl_name == *name)
                    .map(|(&o, _)| o)
                    .collect();
                owners.sort_unstable();
                RemoteList {
                    owner,
                    owners,
                    peer: Arc::clone(peer),
                    descs,
                }
            })
            .collect();
        let local_table = locals
            .iter()
            .map(|(&id, (_, _, (sp, a, e)))| (id, *sp, *a, *e))
            .collect();
        let mut remote_agents: Vec<String> = peers.values().map(|(_, n, _)| n.clone()).collect();
        remote_agents.sort_unstable();
        remote_agents.dedup();
        let prepared = Prepared {
            nixl: Mutex::new(None),
            segments: segs,
            local_ranges: locals.values().map(|l| l.2).collect(),
            locals: locals
                .into_iter()
                .map(|(id, (g, m, _))| (id, g, m))
                .collect(),
            peers: peers.into_iter().map(|(o, (g, _, _))| (o, g)).collect(),
            remote_agents,
            local_spaces: local_keys.iter().map(|&k| space(k)).collect(),
            local_descs,
            local_table,
            remote_info,
            planned: (batch.reads.len() as u64, batch.bytes()),
            phase: AtomicU8::new(IDLE),
            builds: AtomicU64::new(0),
            posts: AtomicU64::new(0),
            shared: Arc::clone(&self.shared),
        };
        let mut objects = NixlObjects {
            requests: None,
            local_lists,
            remote_lists,
        };
        objects.requests = Some(prepared.make_requests(&objects)?);
        *prepared.nixl.lock() = Some(objects);
        let prepared = Arc::new(prepared);
        st.batches.retain(|w| w.strong_count() > 0);
        st.batches.push(Arc::downgrade(&prepared));
        drop(st);
        tracing::debug!(
            agent = %s.name,
            reads = prepared.planned.0,
            bytes = prepared.planned.1,
            segments = prepared.segments.len(),
            requests = prepared.segments.iter().map(Vec::len).sum::<usize>(),
            "nixl prepare"
        );
        Ok(PreparedBatch::new(Arc::new(batch), BACKEND, prepared))
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let p = prepared
            .state::<Arc<Prepared>>()
            .filter(|p| p.shared.uid == self.shared.uid)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "batch was prepared by {} (another backend or nixl endpoint), not by \
                         nixl endpoint {:?}",
                        prepared.backend(),
                        self.shared.name
                    ),
                )
                .with_backend(BACKEND)
            })?;
        {
            // Under the state lock: a peer reload never sees a batch leave IDLE meanwhile.
            let st = self.shared.state.lock();
            match p.phase.load(Ordering::Acquire) {
                BUSY => {
                    return Err(Error::new(
                        ErrorKind::Transport,
                        "this prepared batch is still in flight; wait for or abort it first",
                    )
                    .with_backend(BACKEND)
                    .set_retryable(true))
                }
                QUARANTINED => {
                    return Err(Error::new(
                        ErrorKind::Transport,
                        format!(
                            "this prepared batch was ended while its reads still ran and is \
                             quarantined (local regions {:?} kept alive until they finish); it \
                             is never posted again: prepare a new batch",
                            p.local_regions()
                        ),
                    )
                    .with_backend(BACKEND)
                    .set_quarantined())
                }
                RETIRED => {
                    return Err(Error::new(
                        ErrorKind::Transport,
                        "the metadata of a peer of this batch was reloaded after prepare; \
                         prepare again",
                    )
                    .with_backend(BACKEND))
                }
                _ => {}
            }
            p.check_live(&st)?;
            let busy = quarantine::conflicts(self.shared.uid, p.local_ranges());
            if !busy.is_empty() {
                let ranges: Vec<String> = busy
                    .iter()
                    .map(|(a, b)| format!("{a:#x}..{b:#x}"))
                    .collect();
                return Err(Error::new(
                    ErrorKind::Transport,
                    format!(
                        "local memory {} is quarantined: reads of an earlier batch may still \
                         land in it; use other memory or wait until they finish",
                        ranges.join(", ")
                    ),
                )
                .with_backend(BACKEND)
                .set_quarantined());
            }
            if p.phase
                .compare_exchange(IDLE, BUSY, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                return Err(Error::new(
                    ErrorKind::Transport,
                    "this prepared batch is being posted concurrently",
                )
                .with_backend(BACKEND)
                .set_retryable(true));
            }
        }
        let flight = NixlInFlight::start(Arc::clone(p)).await?;
        Ok(Box::new(flight))
    }

    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        *self.shared.log.lock() = log;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::segments;

    #[test]
    fn disjoint_destinations_are_one_segment() {
        let d = [(1, 0, 8), (1, 8, 16), (2, 0, 8), (1, 16, 24)];
        assert_eq!(segments(&d), vec![0..4]);
        assert!(segments(&[]).is_empty());
    }

    #[test]
    fn overlaps_start_a_new_segment_in_batch_order() {
        // Read 2 overlaps read 0; read 3 overlaps read 2; read 4 is disjoint from 3.
        let d = [(1, 0, 8), (1, 8, 16), (1, 4, 12), (1, 6, 10), (2, 0, 4)];
        assert_eq!(segments(&d), vec![0..2, 2..3, 3..5]);
        // Identical replicas into one place: one segment each.
        let d = [(1, 0, 8), (1, 0, 8), (1, 0, 8)];
        assert_eq!(segments(&d), vec![0..1, 1..2, 2..3]);
    }
}
