//! `prepare`: validates a batch through the core contract, resolves its reads against the
//! regions and peers, and translates them into NIXL descriptor lists and requests.

use parking_lot::Mutex;
use reshard_core::contract::{self, span, LocalLookup};
use reshard_core::{
    Error, ErrorKind, MemoryKind, OwnerId, PreparedBatch, ReadBatch, ReadDesc, Result,
};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicU8};
use std::sync::Arc;

use super::peers::Peer;
use super::prepared::{Group, LaneLists, NixlObjects, Prepared, RemoteList, IDLE};
use super::regions::{space, LocalMem};
use super::{oob, NixlTransport};
use crate::SCHEME;

/// A read resolved against the regions at prepare time.
struct Resolved {
    owner: OwnerId,
    remote_addr: u64,
    remote_kind: MemoryKind,
    local_addr: u64,
    local_kind: MemoryKind,
    len: u64,
    /// Where its bytes are in the owner's region: contiguous, or rows at a pitch.
    desc: ReadDesc,
    remote_range: Range<u64>,
}

impl NixlTransport {
    /// [`reshard_core::Transport::prepare`].
    // Moved verbatim out of the `#[async_trait]` impl, whose expansion kept clippy from
    // looking at these local tuple types.
    #[allow(clippy::type_complexity)]
    pub(super) fn prepare_batch(&self, batch: ReadBatch) -> Result<PreparedBatch> {
        let s = &self.shared;
        if i32::try_from(batch.reads.len()).is_err() {
            return Err(
                Error::new(ErrorKind::Unsupported, "more than 2^31 reads in one batch")
                    .with_backend(SCHEME),
            );
        }
        let mut resolved = Vec::with_capacity(batch.reads.len());
        let mut locals: BTreeMap<u64, (u64, Arc<LocalMem>, (u64, u64, u64))> = BTreeMap::new();
        let mut peers: BTreeMap<OwnerId, (u64, String, Arc<Peer>)> = BTreeMap::new();
        #[cfg(feature = "fault-injection")]
        let skip = s.skip_read.get().map(|r| r as usize);
        #[cfg(not(feature = "fault-injection"))]
        let skip: Option<usize> = None;
        // Held until the batch is registered in `batches`: no peer reload can invalidate the
        // metadata its lists and requests are made from in between.
        let mut st = s.state.lock();
        contract::validate_batch(
            SCHEME,
            &s.name,
            &batch,
            |owner, region| {
                contract::remote_lookup(st.peers.get(&owner), |p| {
                    p.regions.get(&region).map(|r| r.len)
                })
            },
            |region| {
                st.regions.get(&region).map(|l| LocalLookup {
                    len: l.len,
                    addr: l.addr,
                    kind: l.kind,
                })
            },
        )?;
        {
            // Every look-up below succeeds (validated under this same lock); failing anyway
            // is an internal error, never a panic.
            let missing = |i: usize, r: &ReadDesc, what: &str| {
                contract::validated_lookup_failed(SCHEME, i, r, what)
            };
            for (i, r) in batch.reads.iter().enumerate() {
                let remote = span(r.remote_offset, r.remote_span().unwrap_or(r.len));
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
                    desc: *r,
                    remote_range: remote,
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
            // One descriptor pair per contiguous source run (the whole read, or one row of a
            // gather), cut at the request size; the local descriptors of a gather's rows are
            // consecutive, so its destination stays contiguous.
            let mut pieces = Vec::with_capacity(r.len.div_ceil(piece) as usize);
            let region_base = r.remote_addr - r.desc.remote_offset;
            for (roff, at, run) in r.desc.remote_runs(0, r.len) {
                let mut off = 0;
                while off < run {
                    let n = piece.min(run - off);
                    local_descs[l].push((r.local_addr + at + off, n));
                    remote_descs[m].push((region_base + roff + off, n));
                    pieces.push((
                        l,
                        local_descs[l].len() as i32 - 1,
                        m,
                        remote_descs[m].len() as i32 - 1,
                        n,
                    ));
                    off += n;
                }
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
            .with_backend(SCHEME));
        }
        // Destinations are disjoint (validated), so every request may be in flight at once.
        let mut groups: Vec<Group> = Vec::new();
        for (i, r) in resolved.iter().enumerate() {
            if skip == Some(i) {
                // Fault injection: this read is never handed to a request.
                continue;
            }
            let last = at[i].len() - 1;
            for (k, &(l, li, m, mi, n)) in at[i].iter().enumerate() {
                let read_len = if k == 0 { r.len } else { 0 };
                let read_rows = if k == 0 { r.desc.remote_rows } else { None };
                let ends = u64::from(k == last);
                // The newest request of these lists, while it has room: NIXL reports
                // progress only per request, so requests are capped at `request_bytes`
                // to give the no-progress timer (and abort) steps to see.
                match groups.iter_mut().rev().find(|g| {
                    g.local_list == l && g.remote_list == m && g.bytes.saturating_add(n) <= piece
                }) {
                    Some(g) => {
                        g.local_ix.push(li);
                        g.remote_ix.push(mi);
                        g.read_len.push(read_len);
                        g.read_rows.push(read_rows);
                        g.pieces.push((i as u32, n));
                        g.ends += ends;
                        g.bytes += n;
                    }
                    None => groups.push(Group {
                        owner: r.owner,
                        lane: 0,
                        local_list: l,
                        remote_list: m,
                        local_ix: vec![li],
                        remote_ix: vec![mi],
                        read_len: vec![read_len],
                        read_rows: vec![read_rows],
                        ends,
                        pieces: vec![(i as u32, n)],
                        range: r.remote_range.clone(),
                        bytes: n,
                    }),
                }
            }
        }
        // Lanes: each request goes to the lane with the fewest bytes so far (ties: the lowest),
        // in batch order, so every lane gets an even share of the bytes and of each owner.
        let lanes = s.lanes.len();
        let mut load = vec![0u64; lanes];
        for g in &mut groups {
            let lane = (0..lanes).min_by_key(|&k| (load[k], k)).unwrap_or(0);
            load[lane] += g.bytes;
            g.lane = lane;
        }
        // Lists on every lane holding a request (lane 0 always: its errors name the culprit).
        let mut lists: Vec<LaneLists> = (0..lanes).map(|_| LaneLists::default()).collect();
        for (lane, agent) in s.agents().enumerate() {
            if lane > 0 && !groups.iter().any(|g| g.lane == lane) {
                continue;
            }
            let local = local_keys
                .iter()
                .zip(&local_descs)
                .map(|(&k, d)| agent.prep_dlist("", k, d))
                .collect::<Result<Vec<_>>>()?;
            let remote = remote_keys
                .iter()
                .zip(&remote_descs)
                .map(|(&(owner, k), d)| {
                    let name = &peers[&owner].1;
                    agent.prep_dlist(name, k, d).map_err(|e| {
                        // NIXL checks every remote descriptor against the registrations in the
                        // peer's NIXL metadata. Name the first read it refuses (trying each
                        // alone: the error path only) as out of bounds: the peer's envelope
                        // advertised bytes it did not register.
                        let bad = resolved.iter().find(|r| {
                            r.owner == owner
                                && r.remote_kind == k
                                && agent
                                    .prep_dlist(
                                        name,
                                        k,
                                        &[(
                                            r.remote_addr,
                                            r.remote_range.end - r.remote_range.start,
                                        )],
                                    )
                                    .is_err()
                        });
                        match bad {
                            Some(r) => oob(
                                owner,
                                r.remote_range.clone(),
                                format!(
                                    "NIXL refuses remote bytes {}..{} of owner {owner}: they are \
                                     not inside memory its agent registered ({e})",
                                    r.remote_range.start, r.remote_range.end
                                ),
                            )
                            .with_source(e),
                            None => e.with_owner(owner),
                        }
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            lists[lane] = LaneLists { local, remote };
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
            groups,
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
            lists,
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
            requests = prepared.groups.len(),
            "nixl prepare"
        );
        Ok(PreparedBatch::new(Arc::new(batch), SCHEME, prepared))
    }
}
