//! [`NixlTransport`]: one NIXL agent per endpoint, implementing the core contract:
//! registration, metadata exchange, and the descriptor cache (`prepare`) that `post` reuses.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::Mutex;
use reshard_core::{
    Capability, Error, ErrorKind, InFlight, MemoryBlock, MemoryKind, OwnerId, PreparedBatch,
    ReadBatch, Registration, Result, Transport, WireReport,
};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::agent::{NixlAgent, Prepped, Reg, Request};
use crate::meta::{AgentMeta, RegionMeta};
use crate::options::NixlOptions;
use crate::xfer::{self, NixlInFlight};
use crate::{runtime, BACKEND};

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
    pub(crate) timeout: Duration,
    /// This rank's GPU, when configured: VRAM on other devices is refused.
    device_id: Option<u32>,
    state: Mutex<State>,
    epoch: AtomicU64,
    next_gen: AtomicU64,
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
}

/// A local registered region.
struct Local {
    block: Arc<dyn MemoryBlock>,
    addr: u64,
    len: u64,
    kind: MemoryKind,
    /// Changes when the id is reused by nothing but a new registration; checked at post.
    generation: u64,
    /// Deregisters from NIXL when dropped (after the block is no longer used by any batch).
    _reg: Option<Reg>,
}

/// A loaded peer: its NIXL name, the regions its metadata lists, and the exact bytes loaded.
struct Peer {
    nixl_name: String,
    agent: String,
    regions: HashMap<u64, RegionMeta>,
    generation: u64,
    raw: Bytes,
}

/// One NIXL request's worth of reads: one owner, one local and one remote memory kind.
pub(crate) struct Group {
    pub(crate) owner: OwnerId,
    local_list: usize,
    remote_list: usize,
    local_ix: Vec<i32>,
    remote_ix: Vec<i32>,
    /// Remote byte range of its first read, for errors.
    pub(crate) range: Range<u64>,
}

/// The NIXL state of a [`PreparedBatch`]: prepared descriptor lists, the requests made from
/// them, and what `post` re-checks.
pub(crate) struct Prepared {
    /// Per segment, one request per group. `None` after a release (failure, timeout, abort):
    /// the next post re-makes them from the prepared lists. Declared first so requests are
    /// released before the lists they were made from.
    pub(crate) requests: Mutex<Option<Vec<Vec<Request>>>>,
    local_lists: Vec<Prepped>,
    remote_lists: Vec<Prepped>,
    /// Segments run one after another; a batch without overlapping destinations has one.
    pub(crate) segments: Vec<Vec<Group>>,
    /// `(region id, generation, block)` of every local region used; keeps the memory alive.
    locals: Vec<(u64, u64, Arc<dyn MemoryBlock>)>,
    peers: Vec<(OwnerId, u64)>,
    pub(crate) report: WireReport,
    /// A post of this batch is in flight.
    pub(crate) busy: AtomicBool,
    /// An in-flight handle was dropped without wait/abort: its requests may still run.
    pub(crate) dirty: AtomicBool,
    /// Times the requests were made (1 unless a failure, timeout or abort released them).
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

fn span(off: u64, len: u64) -> Range<u64> {
    off..off.saturating_add(len)
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
                device_id: options.device_id,
                state: Mutex::new(State {
                    next_region: 1,
                    ..State::default()
                }),
                epoch: AtomicU64::new(0),
                next_gen: AtomicU64::new(1),
                agent: nixl,
            }),
        })
    }

    /// The name NIXL knows this endpoint's agent by (unique per process and creation).
    pub fn nixl_name(&self) -> &str {
        &self.shared.nixl_name
    }

    /// Timeout of `wait` and of `abort`'s drain.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// What a batch prepared by a NIXL endpoint holds (`None` for other batches).
    pub fn prepared_stats(batch: &PreparedBatch) -> Option<PreparedStats> {
        let p = batch.state::<Arc<Prepared>>()?;
        Some(PreparedStats {
            segments: p.segments.len(),
            requests: p.segments.iter().map(Vec::len).sum(),
            local_lists: p.local_lists.len(),
            remote_lists: p.remote_lists.len(),
            request_builds: p.builds.load(Ordering::Relaxed),
            posts: p.posts.load(Ordering::Relaxed),
        })
    }
}

/// The descriptor cache of one prepared batch, for diagnostics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedStats {
    /// Segments run one after another (1 unless destinations overlap).
    pub segments: usize,
    /// NIXL transfer requests (one per owner and memory kind per segment).
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
    /// (local region, start, end), for overlap detection.
    dst: (u64, u64, u64),
}

/// Splits reads (in batch order) into consecutive segments whose destinations are pairwise
/// disjoint: running segments one after another applies overlapping reads in batch order.
fn segments(dsts: &[(u64, u64, u64)]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0usize;
    // Disjoint intervals of the current segment: (region, start) -> end.
    let mut seen: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    for (i, &(region, s, e)) in dsts.iter().enumerate() {
        let before = seen
            .range(..=(region, s))
            .next_back()
            .is_some_and(|(&(r, _), &end)| r == region && end > s);
        let after = seen
            .range((region, s)..)
            .next()
            .is_some_and(|(&(r, st), _)| r == region && st < e);
        if before || after {
            out.push(start..i);
            start = i;
            seen.clear();
        }
        seen.insert((region, s), e);
    }
    if start < dsts.len() {
        out.push(start..dsts.len());
    }
    out
}

impl Prepared {
    /// Makes every request from the prepared lists (at prepare, and after a release).
    pub(crate) fn make_requests(&self) -> Result<Vec<Vec<Request>>> {
        let agent = &self.shared.agent;
        self.builds.fetch_add(1, Ordering::Relaxed);
        self.segments
            .iter()
            .map(|seg| {
                seg.iter()
                    .map(|g| {
                        agent
                            .make_read(
                                &self.local_lists[g.local_list],
                                &g.local_ix,
                                &self.remote_lists[g.remote_list],
                                &g.remote_ix,
                            )
                            .map_err(|e| e.with_owner(g.owner).with_range(g.range.clone()))
                    })
                    .collect()
            })
            .collect()
    }

    /// Fails when a region or peer this batch was prepared against has changed since.
    fn check_live(&self) -> Result<()> {
        let st = self.shared.state.lock();
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

impl Drop for Prepared {
    fn drop(&mut self) {
        // A post dropped without wait/abort may still be moving bytes into memory this batch
        // keeps alive: wait (bounded) before the blocks and requests go.
        if self.dirty.load(Ordering::Acquire) || self.busy.load(Ordering::Acquire) {
            xfer::drain_blocking(self);
        }
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
        let id = {
            let mut st = s.state.lock();
            let id = st.next_region;
            st.next_region += 1;
            let generation = s.generation();
            st.regions.insert(
                id,
                Local {
                    block,
                    addr: addr as u64,
                    len: len as u64,
                    kind,
                    generation,
                    _reg: reg,
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
                    // Replace, not merge: drop what NIXL holds for the old metadata first.
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
                    let _ = s.agent.invalidate_remote(&name);
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
                let p = Arc::new(Peer {
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
        let mut locals: BTreeMap<u64, (u64, Arc<dyn MemoryBlock>)> = BTreeMap::new();
        let mut peers: BTreeMap<OwnerId, (u64, String)> = BTreeMap::new();
        {
            let st = s.state.lock();
            for (i, r) in batch.reads.iter().enumerate() {
                let remote = span(r.remote_offset, r.len);
                if r.len == 0 {
                    return Err(oob(r.owner, remote, format!("read {i} has zero length")));
                }
                let peer = st.peers.get(&r.owner).ok_or_else(|| {
                    Error::new(
                        ErrorKind::PeerUnknown,
                        format!("no metadata loaded for owner {}", r.owner),
                    )
                    .with_owner(r.owner)
                    .with_backend(BACKEND)
                })?;
                let region = peer.regions.get(&r.remote_region).ok_or_else(|| {
                    oob(
                        r.owner,
                        remote.clone(),
                        format!(
                            "owner {} ({}) has no region {}",
                            r.owner, peer.agent, r.remote_region
                        ),
                    )
                })?;
                if r.remote_offset
                    .checked_add(r.len)
                    .is_none_or(|e| e > region.len)
                {
                    return Err(oob(
                        r.owner,
                        remote,
                        format!(
                            "read {i} ends past region {} of owner {} ({} bytes)",
                            r.remote_region, r.owner, region.len
                        ),
                    ));
                }
                let local_range = span(r.local_offset, r.len);
                let local = st.regions.get(&r.local_region).ok_or_else(|| {
                    oob(
                        r.owner,
                        local_range.clone(),
                        format!("no local region {} (read {i})", r.local_region),
                    )
                })?;
                if r.local_offset
                    .checked_add(r.len)
                    .is_none_or(|e| e > local.len)
                {
                    return Err(oob(
                        r.owner,
                        local_range,
                        format!(
                            "read {i} ends past local region {} ({} bytes)",
                            r.local_region, local.len
                        ),
                    ));
                }
                locals
                    .entry(r.local_region)
                    .or_insert_with(|| (local.generation, Arc::clone(&local.block)));
                peers
                    .entry(r.owner)
                    .or_insert_with(|| (peer.generation, peer.nixl_name.clone()));
                resolved.push(Resolved {
                    owner: r.owner,
                    remote_addr: region.addr + r.remote_offset,
                    remote_kind: region.kind,
                    local_addr: local.addr + r.local_offset,
                    local_kind: local.kind,
                    len: r.len,
                    remote_range: remote,
                    dst: (r.local_region, r.local_offset, r.local_offset + r.len),
                });
            }
        }
        // Local lists: one per local memory kind; remote lists: one per (owner, kind). Index
        // of each read inside its lists.
        let mut local_keys: Vec<MemoryKind> = Vec::new();
        let mut remote_keys: Vec<(OwnerId, MemoryKind)> = Vec::new();
        let mut local_descs: Vec<Vec<(u64, u64)>> = Vec::new();
        let mut remote_descs: Vec<Vec<(u64, u64)>> = Vec::new();
        let mut at = Vec::with_capacity(resolved.len());
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
            local_descs[l].push((r.local_addr, r.len));
            remote_descs[m].push((r.remote_addr, r.len));
            at.push((
                l,
                local_descs[l].len() as i32 - 1,
                m,
                remote_descs[m].len() as i32 - 1,
            ));
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
                s.agent
                    .prep_dlist(&peers[&owner].1, k, d)
                    .map_err(|e| e.with_owner(owner))
            })
            .collect::<Result<Vec<_>>>()?;
        let dsts: Vec<_> = resolved.iter().map(|r| r.dst).collect();
        let cuts = segments(&dsts);
        let mut segs = Vec::with_capacity(cuts.len());
        for cut in &cuts {
            let mut groups: Vec<Group> = Vec::new();
            for i in cut.clone() {
                let (l, li, m, mi) = at[i];
                let r = &resolved[i];
                match groups
                    .iter_mut()
                    .find(|g| g.local_list == l && g.remote_list == m)
                {
                    Some(g) => {
                        g.local_ix.push(li);
                        g.remote_ix.push(mi);
                    }
                    None => groups.push(Group {
                        owner: r.owner,
                        local_list: l,
                        remote_list: m,
                        local_ix: vec![li],
                        remote_ix: vec![mi],
                        range: r.remote_range.clone(),
                    }),
                }
            }
            segs.push(groups);
        }
        let prepared = Prepared {
            requests: Mutex::new(None),
            local_lists,
            remote_lists,
            segments: segs,
            locals: locals.into_iter().map(|(id, (g, b))| (id, g, b)).collect(),
            peers: peers.into_iter().map(|(o, (g, _))| (o, g)).collect(),
            report: WireReport {
                reads: batch.reads.len() as u64,
                bytes: batch.bytes(),
            },
            busy: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            builds: AtomicU64::new(0),
            posts: AtomicU64::new(0),
            shared: Arc::clone(&self.shared),
        };
        let requests = prepared.make_requests()?;
        *prepared.requests.lock() = Some(requests);
        tracing::debug!(
            agent = %s.name,
            reads = prepared.report.reads,
            bytes = prepared.report.bytes,
            segments = prepared.segments.len(),
            requests = prepared.segments.iter().map(Vec::len).sum::<usize>(),
            "nixl prepare"
        );
        Ok(PreparedBatch::new(
            Arc::new(batch),
            BACKEND,
            Arc::new(prepared),
        ))
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
        p.check_live()?;
        if p.busy.swap(true, Ordering::AcqRel) {
            return Err(Error::new(
                ErrorKind::Transport,
                "this prepared batch is still in flight; wait for or abort it first",
            )
            .with_backend(BACKEND)
            .set_retryable(true));
        }
        let flight = NixlInFlight::start(Arc::clone(p)).await?;
        Ok(Box::new(flight))
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
