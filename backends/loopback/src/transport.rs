//! [`LoopbackTransport`]: one agent on a [`LoopbackFabric`], implementing the core contract.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use rayon::ThreadPool;
use reshard_core::contract::{self, span, RemoteLookup};
use reshard_core::{
    Capability, Error, ErrorKind, ExecutionLog, InFlight, MemoryBlock, MemoryKind, OwnerId,
    PreparedBatch, ReadBatch, ReadDesc, Registration, Result, Transport,
};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use crate::copy::{self, Live, PostCtx};
use crate::fabric::{AgentState, LoopbackFabric, Region};
use crate::meta::AgentMeta;
use crate::work::{self, Piece};
use crate::BACKEND;

/// The in-process transport: reads are memory copies between agents of one fabric, run on a
/// pool of `workers` threads owned by this transport (started at the first post).
pub struct LoopbackTransport {
    fabric: LoopbackFabric,
    agent: Arc<AgentState>,
    workers: usize,
    peers: RwLock<HashMap<OwnerId, Arc<Peer>>>,
    pool: Mutex<Option<Arc<ThreadPool>>>,
    /// Where posted reads are recorded as resolved, when set ([`Transport::set_execution_log`]).
    log: RwLock<Option<Arc<ExecutionLog>>>,
    /// Test-only: index of a read that `post` silently skips (never copied nor counted).
    #[cfg(feature = "fault-injection")]
    skip_read: Mutex<Option<usize>>,
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

/// A source region as prepare resolved it (re-resolved to the live block at every post).
struct SrcRef {
    owner: OwnerId,
    agent: Weak<AgentState>,
    region: u64,
    /// Largest end offset any read uses in this region.
    max_end: u64,
    /// First read that uses it, to name in errors.
    first_read: usize,
}

/// A local destination region (on this agent).
struct DstRef {
    region: u64,
    max_end: u64,
    first_read: usize,
}

/// The loopback state of a [`PreparedBatch`]: resolved region references and work lists.
pub(crate) struct Prepared {
    agent_uid: u64,
    srcs: Vec<SrcRef>,
    dsts: Vec<DstRef>,
    /// One list per worker, balanced by bytes.
    pub(crate) work: Vec<Vec<Piece>>,
}

/// Test-only fault injection for the copy jobs.
#[cfg(test)]
#[derive(Default, Clone)]
pub(crate) struct Faults {
    /// Panic when a job reaches this piece index.
    pub(crate) panic_at_piece: Option<usize>,
    /// Sleep this long before each piece (makes abort observable).
    pub(crate) piece_delay: Option<std::time::Duration>,
}

#[cfg(test)]
impl Faults {
    pub(crate) fn before_piece(&self, k: usize) {
        if let Some(d) = self.piece_delay {
            std::thread::sleep(d);
        }
        if self.panic_at_piece == Some(k) {
            panic!("injected fault at piece {k}");
        }
    }
}

fn oob(owner: OwnerId, range: Range<u64>, msg: String) -> Error {
    Error::new(ErrorKind::OutOfBounds, msg)
        .with_owner(owner)
        .with_range(range)
        .with_backend(BACKEND)
}

impl LoopbackTransport {
    /// Attaches agent `agent` to `fabric` with `workers` copy threads; names are unique per
    /// fabric while their transport lives.
    pub fn new(fabric: &LoopbackFabric, agent: &str, workers: usize) -> Result<Self> {
        if workers == 0 {
            return Err(
                Error::new(ErrorKind::Config, "loopback needs at least 1 worker")
                    .with_backend(BACKEND),
            );
        }
        if agent.is_empty() || agent.len() > u16::MAX as usize {
            return Err(Error::new(
                ErrorKind::Config,
                format!("loopback agent names must be 1..={} bytes", u16::MAX),
            )
            .with_backend(BACKEND));
        }
        let state = Arc::new(AgentState::new(agent));
        {
            let mut agents = fabric.inner.agents.lock();
            if agents.contains_key(agent) {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("agent {agent:?} already exists on this loopback fabric"),
                )
                .with_backend(BACKEND));
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
            #[cfg(feature = "fault-injection")]
            skip_read: Mutex::new(None),
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
        *self.skip_read.lock() = read;
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
                .with_backend(BACKEND)
                .with_source(e)
            })?;
        let pool = Arc::new(pool);
        *slot = Some(Arc::clone(&pool));
        Ok(pool)
    }

    /// Checks every read against loaded peers and local registrations
    /// ([`contract::validate_batch`]) and builds work lists.
    fn translate(&self, batch: &ReadBatch) -> Result<Prepared> {
        if u32::try_from(batch.reads.len()).is_err() {
            return Err(
                Error::new(ErrorKind::Unsupported, "more than 2^32 reads in one batch")
                    .with_backend(BACKEND),
            );
        }
        let peers = self.peers.read();
        let local = self.agent.regions.read();
        contract::validate_batch(
            BACKEND,
            &self.agent.name,
            batch,
            |owner, region| match peers.get(&owner) {
                None => RemoteLookup::NoPeer,
                Some(p) => p
                    .regions
                    .get(&region)
                    .map_or(RemoteLookup::NoRegion, |&len| RemoteLookup::Len(len)),
            },
            |region| local.get(&region).map(|r| r.len),
        )?;
        // Every look-up below succeeds (the batch was validated under these same locks);
        // failing anyway is an internal error, never a panic.
        let missing = |i: usize, r: &ReadDesc, what: &str| {
            contract::validated_lookup_failed(BACKEND, i, r, what)
        };
        let mut srcs: Vec<SrcRef> = Vec::new();
        let mut src_ix: HashMap<(OwnerId, u64), u32> = HashMap::new();
        let mut dsts: Vec<DstRef> = Vec::new();
        // Address of each destination region (index as `dsts`), for overlap detection.
        let mut dst_base: Vec<u64> = Vec::new();
        let mut dst_ix: HashMap<u64, u32> = HashMap::new();
        let mut whole = Vec::with_capacity(batch.reads.len());
        let mut last_src: Option<(OwnerId, u64, u32)> = None;
        let mut last_dst: Option<(u64, u32)> = None;
        for (i, r) in batch.reads.iter().enumerate() {
            // Consecutive reads mostly share regions: skip the map look-ups when they do.
            let s = match last_src {
                Some((o, g, s)) if (o, g) == (r.owner, r.remote_region) => s,
                _ => {
                    let peer = peers.get(&r.owner).ok_or_else(|| missing(i, r, "peer"))?;
                    let s = *src_ix.entry((r.owner, r.remote_region)).or_insert_with(|| {
                        srcs.push(SrcRef {
                            owner: r.owner,
                            agent: Weak::clone(&peer.agent),
                            region: r.remote_region,
                            max_end: 0,
                            first_read: i,
                        });
                        (srcs.len() - 1) as u32
                    });
                    last_src = Some((r.owner, r.remote_region, s));
                    s
                }
            };
            let d = match last_dst {
                Some((g, d)) if g == r.local_region => d,
                _ => {
                    let region = local
                        .get(&r.local_region)
                        .ok_or_else(|| missing(i, r, "local region"))?;
                    let d = *dst_ix.entry(r.local_region).or_insert_with(|| {
                        dst_base.push(region.block.addr() as u64);
                        dsts.push(DstRef {
                            region: r.local_region,
                            max_end: 0,
                            first_read: i,
                        });
                        (dsts.len() - 1) as u32
                    });
                    last_dst = Some((r.local_region, d));
                    d
                }
            };
            // Validated: neither sum overflows.
            let src = &mut srcs[s as usize];
            src.max_end = src.max_end.max(r.remote_offset + r.len);
            let dst = &mut dsts[d as usize];
            dst.max_end = dst.max_end.max(r.local_offset + r.len);
            whole.push(Piece {
                read: i as u32,
                src: s,
                dst: d,
                src_off: r.remote_offset,
                dst_off: r.local_offset,
                len: r.len,
                last: true,
            });
        }
        // Overlapping destinations run on one worker, in batch order (the last writer wins).
        let workers = if work::destinations_overlap(&whole, &dst_base) {
            1
        } else {
            self.workers
        };
        let work = work::split(&whole, workers);
        Ok(Prepared {
            agent_uid: self.agent.uid,
            srcs,
            dsts,
            work,
        })
    }

    /// Resolves every region of a prepared batch to its live block, re-checking bounds.
    fn resolve(&self, prepared: &PreparedBatch, st: &Prepared) -> Result<(Vec<Live>, Vec<Live>)> {
        let reads = &prepared.batch().reads;
        let gone = |owner: OwnerId, first_read: usize, what: String| {
            let r = &reads[first_read];
            Error::new(ErrorKind::Transport, what)
                .with_owner(owner)
                .with_range(span(r.remote_offset, r.len))
                .with_backend(BACKEND)
                .set_retryable(false)
        };
        // Reads the block's address once and re-checks what prepare assumed about it: the
        // copies use exactly this address, so it must cover every byte they touch.
        let check = |owner: OwnerId, range: Range<u64>, region: &Region, max_end: u64| {
            let (addr, len) = (region.block.addr(), region.block.len());
            let fits = max_end <= region.len && max_end <= len as u64;
            if fits && addr != 0 && addr.checked_add(len).is_some() {
                Ok(addr)
            } else {
                Err(oob(
                    owner,
                    range,
                    format!(
                        "registered block no longer covers {max_end} bytes \
                         (now {len} bytes at {addr:#x})"
                    ),
                ))
            }
        };
        let mut srcs = Vec::with_capacity(st.srcs.len());
        for s in &st.srcs {
            let region = s
                .agent
                .upgrade()
                .ok_or_else(|| {
                    gone(
                        s.owner,
                        s.first_read,
                        format!("owner {} left the fabric", s.owner),
                    )
                })?
                .regions
                .read()
                .get(&s.region)
                .cloned()
                .ok_or_else(|| {
                    gone(
                        s.owner,
                        s.first_read,
                        format!(
                            "region {} of owner {} was deregistered after prepare",
                            s.region, s.owner
                        ),
                    )
                })?;
            let r = &reads[s.first_read];
            let addr = check(s.owner, span(r.remote_offset, r.len), &region, s.max_end)?;
            srcs.push(Live {
                owner: Some(s.owner),
                addr,
                _block: region.block,
            });
        }
        let mut dsts = Vec::with_capacity(st.dsts.len());
        {
            let local = self.agent.regions.read();
            for d in &st.dsts {
                let owner = reads[d.first_read].owner;
                let region = local.get(&d.region).cloned().ok_or_else(|| {
                    let r = &reads[d.first_read];
                    Error::new(
                        ErrorKind::Transport,
                        format!(
                            "local region {} (destination of owner {owner}) was deregistered \
                             after prepare",
                            d.region
                        ),
                    )
                    .with_owner(owner)
                    .with_range(span(r.local_offset, r.len))
                    .with_backend(BACKEND)
                    .set_retryable(false)
                })?;
                let r = &reads[d.first_read];
                let addr = check(owner, span(r.local_offset, r.len), &region, d.max_end)?;
                dsts.push(Live {
                    owner: None,
                    addr,
                    _block: region.block,
                });
            }
        }
        Ok((srcs, dsts))
    }
}

/// Finds the region of `regions` whose registered block holds `addr..addr + len`: its id and
/// the offset of `addr` in it. When several do (one memory registered twice), `prefer` wins if
/// it is one of them, else the lowest id.
fn region_at(
    regions: &HashMap<u64, Region>,
    addr: u64,
    len: u64,
    prefer: u64,
) -> Option<(u64, u64)> {
    let holds = |r: &Region| {
        let base = r.block.addr() as u64;
        addr >= base && addr.saturating_add(len) <= base.saturating_add(r.len)
    };
    if let Some(r) = regions.get(&prefer).filter(|r| holds(r)) {
        return Some((prefer, addr - r.block.addr() as u64));
    }
    regions
        .iter()
        .filter(|(_, r)| holds(r))
        .min_by_key(|(&id, _)| id)
        .map(|(&id, r)| (id, addr - r.block.addr() as u64))
}

/// A read as the copy jobs execute it: source and destination indices, first source and
/// destination addresses, and bytes.
type Extent = (u32, u32, u64, u64, u64);

impl LoopbackTransport {
    /// Records every read of a post as the copy jobs will execute it: the owner is the one
    /// whose loaded peer is the agent the source block was resolved from, and regions and
    /// offsets are computed back from the source and destination addresses the jobs copy
    /// between (the block address resolved at post plus the piece's offset), looked up in the
    /// source agent's and this agent's registrations. Reads split between workers are recorded
    /// once, as the whole extent their pieces cover. A skipped read (fault injection) is not.
    fn record(
        &self,
        log: &ExecutionLog,
        st: &Prepared,
        srcs: &[Live],
        dsts: &[Live],
        skip: Option<u32>,
    ) {
        // Per read: (src index, dst index, first source address, first destination address, len).
        let n = st
            .work
            .iter()
            .flatten()
            .map(|p| p.read as usize + 1)
            .max()
            .unwrap_or(0);
        let mut ext: Vec<Option<Extent>> = vec![None; n];
        for p in st.work.iter().flatten() {
            if Some(p.read) == skip {
                continue;
            }
            let sa = srcs[p.src as usize].addr as u64 + p.src_off;
            let da = dsts[p.dst as usize].addr as u64 + p.dst_off;
            let e = ext[p.read as usize].get_or_insert((p.src, p.dst, sa, da, 0));
            e.2 = e.2.min(sa);
            e.3 = e.3.min(da);
            e.4 += p.len;
        }
        let peers = self.peers.read();
        let mut out = Vec::with_capacity(n);
        for (s, d, sa, da, len) in ext.into_iter().flatten() {
            let src = &st.srcs[s as usize];
            let used = src.agent.upgrade();
            let is_used = |p: &Arc<Peer>| {
                used.as_ref()
                    .is_some_and(|a| std::ptr::eq(p.agent.as_ptr(), Arc::as_ptr(a)))
            };
            let owner = if peers.get(&src.owner).is_some_and(is_used) {
                src.owner
            } else {
                peers
                    .iter()
                    .filter(|(_, p)| is_used(p))
                    .map(|(&o, _)| o)
                    .min()
                    .unwrap_or(src.owner)
            };
            let (remote_region, remote_offset) = used
                .as_ref()
                .and_then(|a| region_at(&a.regions.read(), sa, len, src.region))
                .unwrap_or((0, sa));
            let (local_region, local_offset) = region_at(
                &self.agent.regions.read(),
                da,
                len,
                st.dsts[d as usize].region,
            )
            .unwrap_or((0, da));
            out.push(ReadDesc {
                owner,
                remote_region,
                remote_offset,
                local_region,
                local_offset,
                len,
            });
        }
        log.record(out);
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

#[async_trait]
impl Transport for LoopbackTransport {
    fn name(&self) -> &'static str {
        BACKEND
    }

    fn agent(&self) -> &str {
        &self.agent.name
    }

    fn capabilities(&self) -> Capability {
        Capability {
            one_sided_read: true,
            one_sided_write: false,
            vram: false,
            cross_process: false,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.agent.epoch.load(Ordering::Acquire)
    }

    fn incarnation(&self) -> u64 {
        // Agent uids are never reused within a fabric (which is one process), and start at 1.
        self.agent.uid
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.peers.read().get(&owner).map(|p| p.uid)
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let kind = block.kind();
        if let MemoryKind::Vram { .. } = kind {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("loopback moves host memory only; cannot register {kind} (use nixl)"),
            )
            .with_backend(BACKEND));
        }
        let (addr, len) = (block.addr(), block.len());
        if len > 0 && (addr == 0 || addr.checked_add(len).is_none()) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!("block {addr:#x}+{len} is not a valid address range"),
            )
            .with_backend(BACKEND));
        }
        let id = self.agent.next_region.fetch_add(1, Ordering::Relaxed);
        let len = len as u64;
        self.agent.regions.write().insert(id, Region { block, len });
        self.agent.bump_epoch();
        tracing::debug!(agent = %self.agent.name, region = id, len, "loopback register");
        let agent = Arc::downgrade(&self.agent);
        Ok(Registration::new(id, len, kind, move || {
            if let Some(a) = agent.upgrade() {
                // Drop the block outside the lock: its own Drop may do anything.
                let removed = a.regions.write().remove(&id);
                if removed.is_some() {
                    a.bump_epoch();
                }
                drop(removed);
            }
        }))
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        let mut regions: Vec<(u64, u64)> = self
            .agent
            .regions
            .read()
            .iter()
            .map(|(&id, r)| (id, r.len))
            .collect();
        regions.sort_unstable();
        Ok(AgentMeta {
            fabric: self.fabric.id(),
            agent_uid: self.agent.uid,
            agent: self.agent.name.clone(),
            regions,
        }
        .encode())
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let meta = AgentMeta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        if meta.fabric != self.fabric.id() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "metadata of agent {:?} comes from another loopback fabric (another process \
                     or LoopbackFabric); cross-process transfers need the ucx or nixl transport",
                    meta.agent
                ),
            )
            .with_owner(owner)
            .with_backend(BACKEND));
        }
        let agent = self
            .fabric
            .inner
            .agents
            .lock()
            .get(&meta.agent)
            .filter(|a| a.uid == meta.agent_uid)
            .map(Arc::downgrade)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::PeerUnknown,
                    format!(
                        "agent {:?} that exported this metadata is no longer on the fabric",
                        meta.agent
                    ),
                )
                .with_owner(owner)
                .with_backend(BACKEND)
            })?;
        // The metadata's region lengths are the publisher's claim; the fabric has the real
        // registrations. A region advertised larger than the block registered under its id
        // is refused before any read can be prepared against it. (A region no longer
        // registered is not: stale metadata fails the post that would read it.)
        if let Some(a) = agent.upgrade() {
            let real = a.regions.read();
            for &(id, len) in &meta.regions {
                if let Some(r) = real.get(&id).filter(|r| len > r.len) {
                    return Err(oob(
                        owner,
                        r.len..len,
                        format!(
                            "metadata of agent {:?} advertises region {id} as {len} bytes, but \
                             it registered {} bytes",
                            meta.agent, r.len
                        ),
                    ));
                }
            }
        }
        let peer = Peer {
            uid: meta.agent_uid,
            agent,
            regions: meta.regions.into_iter().collect(),
        };
        // The owner rank is the identity offers use; the agent behind it may change (a
        // publisher restarted, possibly under another name). The new metadata replaces the old
        // and the epoch bump makes every prepared batch re-resolve against it.
        let old = self.peers.write().insert(owner, Arc::new(peer));
        if let Some(old_agent) = old.and_then(|p| p.agent.upgrade()) {
            if old_agent.name != meta.agent {
                tracing::info!(
                    agent = %self.agent.name,
                    owner,
                    old = %old_agent.name,
                    new = %meta.agent,
                    "loopback peer replaced by another agent"
                );
            }
        }
        self.agent.bump_epoch();
        tracing::debug!(agent = %self.agent.name, owner, peer = %meta.agent, "loopback peer");
        Ok(())
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let st = self.translate(&batch)?;
        tracing::debug!(
            agent = %self.agent.name,
            reads = batch.reads.len(),
            bytes = batch.bytes(),
            lists = st.work.len(),
            "loopback prepare"
        );
        Ok(PreparedBatch::new(Arc::new(batch), BACKEND, Arc::new(st)))
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        let st = prepared
            .state::<Arc<Prepared>>()
            .filter(|st| st.agent_uid == self.agent.uid)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "batch was prepared by {} (another backend or loopback agent), not by \
                         loopback agent {:?}",
                        prepared.backend(),
                        self.agent.name
                    ),
                )
                .with_backend(BACKEND)
            })?;
        let (srcs, dsts) = self.resolve(prepared, st)?;
        let pool = self.pool()?;
        #[cfg(feature = "fault-injection")]
        let skip = (*self.skip_read.lock()).and_then(|i| u32::try_from(i).ok());
        #[cfg(not(feature = "fault-injection"))]
        let skip: Option<u32> = None;
        if let Some(log) = self.log.read().as_ref() {
            self.record(log, st, &srcs, &dsts, skip);
        }
        let ctx = PostCtx {
            prepared: Arc::clone(st),
            srcs,
            dsts,
            abort: Arc::new(AtomicBool::new(false)),
            gate: Arc::default(),
            #[cfg(feature = "fault-injection")]
            skip_read: skip,
            #[cfg(test)]
            faults: self.faults.clone(),
        };
        tracing::trace!(agent = %self.agent.name, jobs = st.work.len(), "loopback post");
        Ok(Box::new(copy::start(&pool, ctx)))
    }

    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        *self.log.write() = log;
        true
    }
}
