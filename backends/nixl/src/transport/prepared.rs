//! [`Prepared`]: the NIXL state of a prepared batch (groups, descriptor lists, requests,
//! phase), how its requests are made, recorded and released, and what `post` re-checks.

use parking_lot::Mutex;
use reshard_core::{
    executed, Error, ErrorKind, ExecutionLog, OwnerId, ReadDesc, RemoteRows, Result,
};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use super::peers::Peer;
use super::regions::LocalMem;
use super::{Shared, State};
use crate::agent::{Prepped, Request};
use crate::SCHEME;

/// One NIXL request's worth of reads: one owner, one local and one remote memory kind.
///
/// A read longer than the request size, or a gather (one piece per row), is split into pieces
/// (consecutive descriptors, in this or the following groups of its owner); every field
/// below is per piece.
pub(crate) struct Group {
    pub(crate) owner: OwnerId,
    /// The lane whose agent the request is made, posted and polled on.
    pub(crate) lane: usize,
    pub(super) local_list: usize,
    pub(super) remote_list: usize,
    pub(super) local_ix: Vec<i32>,
    pub(super) remote_ix: Vec<i32>,
    /// Per piece: the whole read's length if the piece starts a read, else 0 (the execution
    /// log records a read once, whole, when its first piece is posted).
    pub(super) read_len: Vec<u64>,
    /// Per piece: the read's source rows if the piece starts a gather read, else `None`.
    pub(super) read_rows: Vec<Option<RemoteRows>>,
    /// Reads whose last piece this request carries: what its completion adds to the count.
    pub(super) ends: u64,
    /// Per piece: `(index of its read in the batch, bytes)`, to report a read complete when
    /// the request landing its last byte ends (requests of one read may end in any order).
    pub(crate) pieces: Vec<(u32, u64)>,
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
pub(super) struct RemoteList {
    /// The owner whose peer entry gave the NIXL agent name, and every owner that named that
    /// agent at prepare (several owners may name one agent).
    pub(super) owner: OwnerId,
    pub(super) owners: Vec<OwnerId>,
    /// The peer metadata (regions with addresses) of that agent.
    pub(super) peer: Arc<Peer>,
    /// `(address, length)` of every descriptor, in list order: exactly what NIXL was given.
    pub(super) descs: Vec<(u64, u64)>,
}

/// The NIXL objects of a prepared batch. Field order is release order: requests before the
/// lists they were made from.
pub(crate) struct NixlObjects {
    /// One request per group. `None` after a failure that every pending request was seen to
    /// end: the next post re-makes them from the prepared lists.
    pub(crate) requests: Option<Vec<Request>>,
    /// Per lane, the lists prepared on its agent (empty for a lane that holds no request).
    pub(super) lists: Vec<LaneLists>,
}

/// The descriptor lists of one lane, prepared on its agent: the same descriptors on every
/// lane, so a group's list and descriptor indices hold on whichever lane it is.
#[derive(Default)]
pub(crate) struct LaneLists {
    pub(super) local: Vec<Prepped>,
    pub(super) remote: Vec<Prepped>,
}

/// [`Prepared::phase`]: no request in progress; `post` may take it.
pub(crate) const IDLE: u8 = 0;
/// A [`NixlInFlight`] owns the requests.
///
/// [`NixlInFlight`]: crate::xfer::NixlInFlight
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
///
/// [`PreparedBatch`]: reshard_core::PreparedBatch
pub(crate) struct Prepared {
    /// `None` once released (the batch was retired or left the quarantine). Declared first:
    /// released before the registrations and memory below.
    pub(crate) nixl: Mutex<Option<NixlObjects>>,
    /// The batch's requests (destinations are disjoint, so all may be in flight at once).
    pub(crate) groups: Vec<Group>,
    /// `(region id, generation, registration and memory)` of every local region used.
    pub(super) locals: Vec<(u64, u64, Arc<LocalMem>)>,
    /// `(space, start, end)` local address range of every local region used.
    pub(super) local_ranges: Vec<(u64, u64, u64)>,
    pub(super) peers: Vec<(OwnerId, u64)>,
    /// NIXL names of the remote agents the remote lists were made from.
    pub(super) remote_agents: Vec<String>,
    /// Descriptors of each local list as handed to NIXL, and the local regions
    /// `(id, space, start, end)` they may lie in, for the execution log.
    pub(super) local_descs: Vec<Vec<(u64, u64)>>,
    pub(super) local_spaces: Vec<u64>,
    pub(super) local_table: Vec<(u64, u64, u64, u64)>,
    /// Per remote list, what it was prepared against (execution log).
    pub(super) remote_info: Vec<RemoteList>,
    /// Reads and bytes of the batch as planned (diagnostics only; `wait` counts its own).
    pub(crate) planned: (u64, u64),
    /// `IDLE`, `BUSY`, `QUARANTINED` or `RETIRED`; moves out of `IDLE` only under the
    /// endpoint's state lock.
    pub(crate) phase: AtomicU8,
    /// Times the requests were made (1 unless a failure released them).
    pub(super) builds: AtomicU64,
    /// Times the batch was posted.
    pub(crate) posts: AtomicU64,
    /// Declared last: the agent outlives the lists and requests above.
    pub(crate) shared: Arc<Shared>,
}

impl Prepared {
    /// Makes every request from the prepared lists (at prepare, and after a failure that
    /// every pending request was seen to end).
    pub(crate) fn make_requests(&self, nixl: &NixlObjects) -> Result<Vec<Request>> {
        self.builds.fetch_add(1, Ordering::Relaxed);
        self.groups
            .iter()
            .map(|g| {
                // `prepare` gives every lane holding a group its lists; a miss is internal.
                let found = nixl.lists.get(g.lane).and_then(|l| {
                    Some((
                        self.shared.lanes.get(g.lane)?,
                        l.local.get(g.local_list)?,
                        l.remote.get(g.remote_list)?,
                    ))
                });
                let Some((lane, local, remote)) = found else {
                    return Err(Error::new(
                        ErrorKind::Internal,
                        format!("nixl lane {} has no descriptor lists", g.lane),
                    )
                    .with_backend(SCHEME));
                };
                lane.agent
                    .make_read(local, &g.local_ix, remote, &g.remote_ix)
                    .map_err(|e| e.with_owner(g.owner).with_range(g.range.clone()))
            })
            .collect()
    }

    /// Records the reads of the given groups (just posted) in `log`, as the
    /// descriptors handed to NIXL resolve: the owner whose peer entry named the remote agent
    /// the remote list was prepared against, the region of that agent's metadata holding the
    /// remote descriptor's address (offset = address - region base), and the local region
    /// holding the local descriptor's address.
    pub(crate) fn record(&self, log: &ExecutionLog, groups: &[usize]) {
        let mut out = Vec::new();
        for &g in groups {
            let Some(group) = self.groups.get(g) else {
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
                let (li, ri) = (group.local_ix[k] as usize, group.remote_ix[k] as usize);
                let (la, _) = local[li];
                let (ra, _) = remote.descs[ri];
                // A gather is recorded as one when its descriptors lie where its rows are;
                // else as the contiguous read its first descriptor starts (which a reader of
                // the log sees differ from what was asked).
                let rows = group.read_rows[k]
                    .filter(|&rows| follows_rows(rows, len, &local[li..], &remote.descs[ri..]));
                let extent = rows
                    .and_then(|rows| gather_at_zero(rows, len).remote_span())
                    .unwrap_or(len);
                let remote_at = executed::locate(
                    remote.peer.regions.values().map(|r| (r.id, r.addr, r.len)),
                    ra,
                    extent,
                    None,
                );
                // Only regions in the memory space the local list is in.
                let locals = self.local_table.iter().filter(|t| t.1 == space_l);
                let locals = locals.map(|&(id, _, s, e)| (id, s, e - s));
                out.push(ReadDesc {
                    remote_rows: rows,
                    ..executed::read(owner, remote_at, locals, la, len, None)
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
    pub(super) fn check_live(&self, st: &State) -> Result<()> {
        for &(id, generation, _) in &self.locals {
            if st.regions.get(&id).map(|l| l.generation) != Some(generation) {
                return Err(Error::new(
                    ErrorKind::Transport,
                    format!("local region {id} was deregistered after prepare; prepare again"),
                )
                .with_backend(SCHEME));
            }
        }
        for &(owner, generation) in &self.peers {
            if st.peers.get(&owner).map(|p| p.generation) != Some(generation) {
                return Err(Error::new(
                    ErrorKind::Transport,
                    format!("metadata of owner {owner} changed after prepare; prepare again"),
                )
                .with_owner(owner)
                .with_backend(SCHEME));
            }
        }
        Ok(())
    }
}

/// A gather of `len` bytes in `rows` from offset 0: its runs are offsets from its first row.
fn gather_at_zero(rows: RemoteRows, len: u64) -> ReadDesc {
    ReadDesc {
        owner: 0,
        remote_region: 0,
        remote_offset: 0,
        local_region: 0,
        local_offset: 0,
        len,
        remote_rows: Some(rows),
    }
}

/// Whether the descriptors of a gather of `len` bytes in `rows` (`local` and `remote` from its
/// first pair on, consecutive in their lists) land contiguously and take their sources where
/// the rows are, relative to the first descriptor's source.
fn follows_rows(rows: RemoteRows, len: u64, local: &[(u64, u64)], remote: &[(u64, u64)]) -> bool {
    let asked = gather_at_zero(rows, len);
    let (Some(&(la, _)), Some(&(ra, _))) = (local.first(), remote.first()) else {
        return false;
    };
    let mut at = 0;
    for (&(l, n), &(r, rn)) in local.iter().zip(remote) {
        if at >= len {
            break;
        }
        let want = asked.remote_runs(at, len).next().map(|(o, _, _)| o);
        if n != rn || l.wrapping_sub(la) != at || Some(r.wrapping_sub(ra)) != want {
            return false;
        }
        at += n;
    }
    at == len
}

// `Prepared` has no `Drop`: its last `Arc` goes only when no in-flight handle and no
// quarantine entry holds it, i.e. when none of its requests can be in progress, so its
// fields are released in declaration order without waiting: requests, lists, then the
// registrations (deregistered when no other batch or region entry holds them) and memory.
