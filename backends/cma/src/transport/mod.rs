//! [`CmaTransport`]: one endpoint, implementing the core contract with `process_vm_readv`.

use async_trait::async_trait;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use rayon::ThreadPool;
use reshard_core::contract::{self, span, LocalLookup};
use reshard_core::regions::{self, RegionTable};
use reshard_core::{executed, prepared};
use reshard_core::{
    new_incarnation, Capability, CompletionSink, Error, ErrorKind, ExecutionLog, InFlight,
    MemoryBlock, OwnerId, PreparedBatch, ReadBatch, ReadDesc, Registration, Result, Transport,
};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::meta::{Meta, RegionMeta};
use crate::peer::{Host, Peer};
use crate::plan::{self, Calls, Wanted};
use crate::run::{CmaInFlight, Run};
use crate::sys;
use crate::{CmaOptions, SCHEME};

/// The cma state of a [`PreparedBatch`].
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

    /// Checks every read against the loaded peers and local registrations
    /// ([`contract::validate_batch`]) and translates the batch into calls.
    fn translate(&self, batch: &ReadBatch) -> Result<Prepared> {
        prepared::check_read_count(SCHEME, batch)?;
        // The epoch is read before the look-ups: a change racing with them makes the batch
        // look stale at post (re-checked), never fresh.
        let epoch = self.epoch();
        let peers = self.peers.read();
        let local = self.local.read();
        let mut used_peers: Vec<(OwnerId, Arc<Peer>)> = Vec::new();
        let mut peer_ix: HashMap<OwnerId, u32> = HashMap::new();
        let mut dsts: Vec<(u64, Arc<dyn MemoryBlock>)> = Vec::new();
        let mut dst_ix: HashMap<u64, usize> = HashMap::new();
        contract::validate_batch(
            SCHEME,
            &self.agent,
            batch,
            |owner, region| {
                contract::remote_lookup(peers.get(&owner), |p| {
                    p.regions.get(&region).map(|r| r.len)
                })
            },
            |region| local.get(&region).map(|b| LocalLookup::of(b.as_ref())),
        )?;
        // Every look-up below succeeds (the batch was validated under these same locks);
        // failing anyway is an internal error, never a panic.
        let missing = |i: usize, r: &ReadDesc, what: &str| {
            contract::validated_lookup_failed(SCHEME, i, r, what)
        };
        let mut wanted = Vec::with_capacity(batch.reads.len());
        for (i, r) in batch.reads.iter().enumerate() {
            let p = match peer_ix.get(&r.owner) {
                Some(&p) => p,
                None => {
                    let peer = peers.get(&r.owner).ok_or_else(|| missing(i, r, "peer"))?;
                    used_peers.push((r.owner, Arc::clone(peer)));
                    let p = (used_peers.len() - 1) as u32;
                    peer_ix.insert(r.owner, p);
                    p
                }
            };
            let region = used_peers[p as usize]
                .1
                .regions
                .get(&r.remote_region)
                .ok_or_else(|| missing(i, r, "remote region"))?;
            let d = match dst_ix.get(&r.local_region) {
                Some(&d) => d,
                None => {
                    let block = local
                        .get(&r.local_region)
                        .ok_or_else(|| missing(i, r, "local region"))?;
                    dsts.push((r.local_region, Arc::clone(block)));
                    dst_ix.insert(r.local_region, dsts.len() - 1);
                    dsts.len() - 1
                }
            };
            let block = &dsts[d].1;
            wanted.push(Wanted {
                peer: p,
                read: i as u32,
                // In range: offset + len fits the region (validated above), whose addr + len does
                // not overflow (checked at decode).
                remote: region.addr + r.remote_offset,
                local: block.addr() as u64 + r.local_offset,
                len: r.len,
            });
        }
        let calls = plan::translate(
            &wanted,
            self.options.piece_bytes,
            self.options.iovecs_per_call,
        );
        Ok(Prepared {
            endpoint: self.incarnation,
            epoch,
            peers: used_peers,
            dsts,
            calls,
            lanes: self.options.workers,
        })
    }

    /// At post, when the epoch moved since prepare: every peer and destination the batch was
    /// resolved against must still be the one loaded or registered under its name.
    fn still_valid(&self, prepared: &PreparedBatch, st: &Prepared) -> Result<()> {
        let reads = &prepared.batch().reads;
        let first = |pred: &dyn Fn(&ReadDesc) -> bool| reads.iter().find(|r| pred(r));
        let peers = self.peers.read();
        for (owner, peer) in &st.peers {
            if !peers.get(owner).is_some_and(|p| Arc::ptr_eq(p, peer)) {
                let r = first(&|r| r.owner == *owner);
                let mut e = Error::new(
                    ErrorKind::Transport,
                    format!(
                        "the metadata of owner {owner} was replaced or dropped after this batch \
                         was prepared; prepare it again"
                    ),
                )
                .with_owner(*owner)
                .with_backend(SCHEME);
                if let Some(r) = r {
                    e = e.with_range(span(r.remote_offset, r.len));
                }
                return Err(e);
            }
        }
        let local = self.local.read();
        for (region, block) in &st.dsts {
            if !local.get(region).is_some_and(|b| same_block(b, block)) {
                let r = first(&|r| r.local_region == *region);
                let mut e = Error::new(
                    ErrorKind::Transport,
                    format!("local region {region} was deregistered after this batch was prepared"),
                )
                .with_backend(SCHEME);
                if let Some(r) = r {
                    e = e
                        .with_owner(r.owner)
                        .with_range(span(r.local_offset, r.len));
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Refuses a batch that writes bytes which quarantined calls of an earlier batch (ended
    /// while they had not returned) may still write (docs/in-flight-safety.md, rule 3): a
    /// quarantined error naming the first such read. Once those calls return, their bytes are
    /// free again.
    fn refuse_quarantined(&self, prepared: &PreparedBatch, st: &Prepared) -> Result<()> {
        let busy: Vec<Range<u64>> = self
            .live
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .flat_map(|run| run.quarantined_ranges())
            .collect();
        if busy.is_empty() {
            return Ok(());
        }
        let hit = st.calls.segs.iter().find(|s| {
            busy.iter()
                .any(|b| b.start < s.local + s.len && s.local < b.end)
        });
        let Some(r) = hit.and_then(|s| prepared.batch().reads.get(s.read as usize)) else {
            return Ok(());
        };
        Err(Error::new(
            ErrorKind::Transport,
            format!(
                "a read writes local bytes {}..{} of region {}, which a process_vm_readv of an \
                 earlier batch that has not returned may still write (quarantined); use other \
                 memory or wait until it returns",
                r.local_offset,
                r.local_offset.saturating_add(r.len),
                r.local_region
            ),
        )
        .with_owner(r.owner)
        .with_range(span(r.remote_offset, r.len))
        .with_backend(SCHEME)
        .set_quarantined())
    }

    /// Records every read of a post as its calls will execute it: the owner is one under which
    /// the peer process actually read from is loaded (the batch's own owner when that is
    /// still so), and regions and offsets are resolved back from the addresses the calls use,
    /// in that peer's regions and this endpoint's registrations. A read cut into several
    /// segments is recorded once, whole; a skipped read (fault injection) not at all.
    fn record(&self, log: &ExecutionLog, st: &Prepared, skip: Option<u32>) {
        // Per read: (peer index, first remote address, first local address, bytes).
        let mut ext: BTreeMap<u32, (u32, u64, u64, u64)> = BTreeMap::new();
        for call in &st.calls.calls {
            for s in &st.calls.segs[call.segs.clone()] {
                if Some(s.read) == skip {
                    continue;
                }
                let e = ext
                    .entry(s.read)
                    .or_insert((call.peer, s.remote, s.local, 0));
                e.1 = e.1.min(s.remote);
                e.2 = e.2.min(s.local);
                e.3 += s.len;
            }
        }
        let peers = self.peers.read();
        let local = self.local.read();
        let mut out = Vec::with_capacity(ext.len());
        for (_, (p, ra, la, len)) in ext {
            let (owner, used) = &st.peers[p as usize];
            let same = |q: &Arc<Peer>| {
                q.pid == used.pid
                    && q.start_time == used.start_time
                    && q.incarnation == used.incarnation
            };
            let owner = if peers.get(owner).is_some_and(same) {
                *owner
            } else {
                peers
                    .iter()
                    .filter(|(_, q)| same(q))
                    .map(|(&o, _)| o)
                    .min()
                    .unwrap_or(*owner)
            };
            let remote = executed::locate(
                used.regions.values().map(|r| (r.id, r.addr, r.len)),
                ra,
                len,
                None,
            );
            let locals = local
                .iter()
                .map(|(&id, b)| (id, b.addr() as u64, b.len() as u64));
            out.push(executed::read(owner, remote, locals, la, len, None));
        }
        log.record(out);
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

#[async_trait]
impl Transport for CmaTransport {
    fn name(&self) -> &'static str {
        SCHEME
    }

    fn agent(&self) -> &str {
        &self.agent
    }

    fn capabilities(&self) -> Capability {
        Capability {
            one_sided_read: true,
            one_sided_write: false,
            vram: false,
            cross_process: true,
            max_reads_per_post: None,
        }
    }

    fn epoch(&self) -> u64 {
        self.local.epoch()
    }

    fn incarnation(&self) -> u64 {
        self.incarnation
    }

    fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
        self.peers.read().get(&owner).map(|p| p.incarnation)
    }

    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let how = "reads host memory only (process_vm_readv)";
        regions::check_host_block(SCHEME, how, block.as_ref())?;
        let (len, kind) = (block.len() as u64, block.kind());
        Ok(self.local.register(block, len, kind))
    }

    async fn export_metadata(&self) -> Result<Bytes> {
        let regions = self
            .local
            .read()
            .iter()
            .map(|(&id, b)| RegionMeta {
                id,
                addr: b.addr() as u64,
                len: b.len() as u64,
            })
            .collect();
        Ok(Meta {
            boot_id: self.host.boot_id,
            pid_ns: self.host.pid_ns,
            pid: self.host.pid,
            start_time: self.host.start_time,
            incarnation: self.incarnation,
            agent: self.agent.clone(),
            regions,
        }
        .encode())
    }

    async fn load_peer(&self, owner: OwnerId, metadata: Bytes) -> Result<()> {
        let meta = Meta::decode(&metadata).map_err(|e| e.with_owner(owner))?;
        let peer = Peer::open(owner, meta, &self.host)?;
        peer.probe_regions(owner)?;
        let pid = peer.pid;
        // The owner rank is the identity offers use; the process behind it may change (a
        // publisher restarted). The new metadata replaces the old and the epoch bump makes
        // every prepared batch be rebuilt.
        self.peers.write().insert(owner, Arc::new(peer));
        self.local.bump();
        tracing::debug!(agent = %self.agent, owner, pid, "cma peer loaded");
        Ok(())
    }

    async fn prepare(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let st = self.translate(&batch)?;
        tracing::debug!(
            agent = %self.agent,
            reads = batch.reads.len(),
            bytes = batch.bytes(),
            calls = st.calls.calls.len(),
            lanes = st.lanes,
            "cma prepare"
        );
        Ok(PreparedBatch::new(Arc::new(batch), SCHEME, Arc::new(st)))
    }

    async fn post(&self, prepared: &PreparedBatch) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, None)
    }

    async fn post_reporting(
        &self,
        prepared: &PreparedBatch,
        sink: CompletionSink,
    ) -> Result<Box<dyn InFlight>> {
        self.post_with(prepared, Some(sink))
    }

    fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
        *self.log.write() = log;
        true
    }
}

impl CmaTransport {
    /// Posts `prepared`, reporting each read to `sink` once all its bytes have moved.
    fn post_with(
        &self,
        prepared: &PreparedBatch,
        sink: Option<CompletionSink>,
    ) -> Result<Box<dyn InFlight>> {
        // "endpoint" alone for what else could have prepared it: the message cma always gave.
        let st = prepared::own_state::<Arc<Prepared>>(
            SCHEME,
            prepared,
            |st| st.endpoint == self.incarnation,
            "endpoint",
            "cma endpoint",
            &self.agent,
        )?;
        if st.epoch != self.epoch() {
            self.still_valid(prepared, st)?;
        }
        self.refuse_quarantined(prepared, st)?;
        let pool = self.pool()?;
        let skip = self.skip_read.get();
        if let Some(log) = self.log.read().as_ref() {
            self.record(log, st, skip);
        }
        let run = Arc::new(Run::new(
            Arc::clone(st),
            Arc::clone(prepared.batch()),
            skip,
            sink,
        ));
        {
            let mut live = self.live.lock();
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&run));
        }
        let timeout = Duration::from_millis(self.options.timeout_ms);
        Ok(Box::new(CmaInFlight::start(run, pool, st.lanes, timeout)))
    }
}
