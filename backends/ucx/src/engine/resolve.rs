//! Resolving a batch: validation against loaded peers and local registrations and
//! translation to the raw gets (and checked direct copies) UCX executes.

use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

use reshard_core::contract::{self, span, LocalLookup};
use reshard_core::prepared;
use reshard_core::{Error, ErrorKind, MemoryKind, OwnerId, ReadBatch, ReadDesc, Result};

use super::maps::Maps;
use super::order::issue_order;
use super::peers::{Peer, RemoteRegion};
use super::regions::LocalRegion;
use super::Engine;
use crate::raw::{self, GetOp, RKey};
use crate::SCHEME;

/// A batch translated to raw reads: valid while the objects in `peers` and `regions` live,
/// which the `Rc`s guarantee.
pub(super) struct Resolved {
    /// One `ucp_get_nbx` (or direct copy) per piece: one per contiguous source run of a read
    /// (a gather read by gets has one per row), runs longer than `piece_bytes` cut into
    /// pieces; a direct copy of a gather walks its rows, one piece per `piece_bytes`.
    pub(super) ops: Vec<GetOp>,
    /// The batch read each piece belongs to (errors name the read's owner and range).
    pub(super) op_read: Vec<u32>,
    /// Offset of each piece's first byte in its read (where a hasher of the read starts).
    pub(super) op_off: Vec<u64>,
    /// Issue order of the pieces (round-robin by owner).
    pub(super) order: Vec<u32>,
    /// Pieces of each read, when some read was cut into several (else empty: one piece is
    /// one read), so a read is counted once all its pieces completed.
    pub(super) read_pieces: Vec<u32>,
    /// The peers (endpoints, keys) the pieces use, by owner.
    pub(super) peers: HashMap<OwnerId, Rc<Peer>>,
    pub(super) _regions: Vec<Rc<LocalRegion>>,
}

/// A prepared batch: the descriptor cache, dropped whenever the epoch changes and rebuilt at
/// the next post.
pub(super) struct PreparedEntry {
    pub(super) batch: Arc<ReadBatch>,
    pub(super) owners: Vec<OwnerId>,
    pub(super) resolved: Option<Rc<Resolved>>,
}

fn oob(owner: OwnerId, range: std::ops::Range<u64>, msg: String) -> Error {
    Error::new(ErrorKind::OutOfBounds, msg)
        .with_owner(owner)
        .with_range(range)
        .with_backend(SCHEME)
}

impl Engine {
    /// Where the shared-memory segment holding `region` of `owner` is mapped in this process
    /// (`ucp_rkey_ptr`), checked: `Ok(None)` when the key names no memory mapped here (the
    /// reads go through `ucp_get_nbx`), `OutOfBounds` when it does but the region's first and
    /// last byte do not lie, contiguously, inside one readable shared mapping the kernel
    /// reports that is not this endpoint's own registered memory. UCX itself checks none of
    /// this: the pointer is the remote address plus a fixed offset.
    fn direct_base(
        &self,
        maps: &mut Option<Maps>,
        owner: OwnerId,
        id: u64,
        region: &RemoteRegion,
        rkey: &RKey,
        read: Range<u64>,
    ) -> Result<Option<usize>> {
        let Some(first) = rkey.local_ptr(region.base) else {
            return Ok(None);
        };
        let first = first as usize;
        let last_addr = region.base + (region.len - 1);
        let last = rkey.local_ptr(last_addr).map(|p| p as usize);
        let expected = usize::try_from(region.len - 1)
            .ok()
            .and_then(|n| first.checked_add(n));
        let maps = maps.get_or_insert_with(Maps::read);
        let mapping = match (last, expected) {
            (Some(l), Some(e)) if l == e => maps.containing(first, l),
            _ => None,
        };
        let own = |m: &Range<usize>| {
            self.regions
                .values()
                .any(|r| r.len > 0 && r.addr < m.end && m.start < r.addr + r.len as usize)
        };
        match mapping {
            Some(m) if m.shared && m.readable && !own(&m.range) => Ok(Some(first)),
            _ => Err(oob(
                owner,
                read,
                format!(
                    "region {id} of owner {owner} ({} bytes at {:#x}) is not inside one shared \
                     mapping of this process: ucp_rkey_ptr maps it to {first:#x}..={} \
                     (stale or corrupt peer metadata)",
                    region.len,
                    region.base,
                    match last {
                        Some(l) => format!("{l:#x}"),
                        None => "?".to_owned(),
                    }
                ),
            )),
        }
    }

    /// `PeerUnknown` for an owner whose endpoint was force-closed and could not be re-created
    /// is this backend's own `Transport` error (the peer was loaded; the endpoint is lost);
    /// every other error is returned as it is.
    fn lost_peer(&self, batch: &ReadBatch, e: Error) -> Error {
        let lost = (e.kind() == ErrorKind::PeerUnknown)
            .then(|| e.context().owner)
            .flatten()
            .and_then(|owner| Some((owner, &self.lost.get(&owner)?.1)));
        let Some((owner, why)) = lost else {
            return e;
        };
        // The first read naming the owner is the one validation refused.
        let i = batch
            .reads
            .iter()
            .position(|r| r.owner == owner)
            .unwrap_or(0);
        let range = e.context().range.clone().unwrap_or_default();
        Error::new(
            ErrorKind::Transport,
            format!(
                "read {i}: the endpoint to owner {owner} was force-closed and could not be \
                 re-created ({why}); load the peer again"
            ),
        )
        .with_owner(owner)
        .with_range(range)
        .with_backend(SCHEME)
    }

    /// Checks every read against loaded peers and local registrations and resolves it to the
    /// raw handles `ucp_get_nbx` takes.
    pub(super) fn translate(&self, batch: &ReadBatch) -> Result<Resolved> {
        prepared::check_read_count(SCHEME, batch)?;
        contract::validate_batch(
            SCHEME,
            &self.agent,
            batch,
            |owner, region| {
                contract::remote_lookup(self.peers.get(&owner), |p| {
                    p.regions.get(&region).map(|r| r.len)
                })
            },
            |region| {
                self.regions.get(&region).map(|l| LocalLookup {
                    len: l.len,
                    addr: l.addr as u64,
                    kind: l.kind,
                })
            },
        )
        .map_err(|e| self.lost_peer(batch, e))?;
        // Every look-up below succeeds (validated just now, on this thread); failing anyway is
        // an internal error, never a panic.
        let missing = |i: usize, r: &ReadDesc, what: &str| {
            contract::validated_lookup_failed(SCHEME, i, r, what)
        };
        let mut ops = Vec::with_capacity(batch.reads.len());
        let mut op_read = Vec::with_capacity(batch.reads.len());
        let mut op_off = Vec::with_capacity(batch.reads.len());
        let mut piece_owner = Vec::with_capacity(batch.reads.len());
        let mut peers: HashMap<OwnerId, Rc<Peer>> = HashMap::new();
        let mut regions: HashMap<u64, Rc<LocalRegion>> = HashMap::new();
        let mut direct: HashMap<(OwnerId, u64), Option<usize>> = HashMap::new();
        let mut maps = None;
        for (i, r) in batch.reads.iter().enumerate() {
            let remote = span(r.remote_offset, r.remote_span().unwrap_or(r.len));
            let peer = match peers.get(&r.owner) {
                Some(p) => p,
                None => {
                    let p = self
                        .peers
                        .get(&r.owner)
                        .ok_or_else(|| missing(i, r, "peer"))?;
                    peers.entry(r.owner).or_insert_with(|| Rc::clone(p))
                }
            };
            let region = peer
                .regions
                .get(&r.remote_region)
                .ok_or_else(|| missing(i, r, "remote region"))?;
            // Only zero-length regions have no key, and no validated read fits in one.
            let rkey = region
                .rkey
                .as_ref()
                .ok_or_else(|| missing(i, r, "remote key"))?;
            let local = match regions.get(&r.local_region) {
                Some(l) => l,
                None => {
                    let l = self
                        .regions
                        .get(&r.local_region)
                        .ok_or_else(|| missing(i, r, "local region"))?;
                    regions
                        .entry(r.local_region)
                        .or_insert_with(|| Rc::clone(l))
                }
            };
            // Only zero-length blocks are not mapped, and no validated read fits in one.
            let memh = local
                .mem
                .as_ref()
                .ok_or_else(|| missing(i, r, "local memory handle"))?;
            // Shared memory the peer's UCX mapped here: copy it directly (see raw::shm_copy),
            // once the mapping is checked against what the kernel has.
            let base = match (local.kind, self.opts.shm_fast_path) {
                (MemoryKind::Dram, true) => match direct.get(&(r.owner, r.remote_region)) {
                    Some(&b) => b,
                    None => {
                        let b = self.direct_base(
                            &mut maps,
                            r.owner,
                            r.remote_region,
                            region,
                            rkey,
                            remote.clone(),
                        )?;
                        direct.insert((r.owner, r.remote_region), b);
                        b
                    }
                },
                _ => None,
            };
            // Both ranges are inside registered regions whose addresses did not overflow (a
            // gather's whole source span was validated), so these sums and casts are exact.
            // Pieces as (source offset in the region, offset in the read, bytes, rows a direct
            // copy walks); the destination stays contiguous. A direct copy walks a gather's rows
            // itself (`raw::Rows`): one piece per `piece_bytes` of destination, however short
            // the rows, so a gather of small rows costs one task, one hasher and one count per
            // piece, not per row. Otherwise one get (or copy) per contiguous source run (the
            // whole read, or one row of a gather), cut at `piece_bytes`.
            let step = self.opts.piece_bytes;
            let pieces: Box<dyn Iterator<Item = (u64, u64, u64, Option<raw::Rows>)>> =
                match (base, r.remote_rows) {
                    (Some(_), Some(g)) => Box::new(cuts(r.len, step).map(move |(at, n)| {
                        let (row, head) = (at / g.row_bytes, at % g.row_bytes);
                        let rows = raw::Rows {
                            row: g.row_bytes as usize,
                            pitch: g.pitch as usize,
                            head: head as usize,
                        };
                        (r.remote_offset + row * g.pitch + head, at, n, Some(rows))
                    })),
                    _ => Box::new(r.remote_runs(0, r.len).flat_map(move |(roff, at, run)| {
                        cuts(run, step).map(move |(d, n)| (roff + d, at + d, n, None))
                    })),
                };
            for (roff, at, n, rows) in pieces {
                let direct = match base {
                    Some(b) => (b + roff as usize) as *const u8,
                    None => std::ptr::null(),
                };
                let local_addr = local.addr + (r.local_offset + at) as usize;
                ops.push(GetOp {
                    direct,
                    rows,
                    ep: peer.ep.handle(),
                    rkey: rkey.handle(),
                    remote_addr: region.base + roff,
                    local: local_addr as *mut u8,
                    len: n as usize,
                    memh: memh.handle().handle(),
                    memory_type: raw::memory_type(local.kind),
                });
                piece_owner.push(r.owner);
                op_read.push(i as u32);
                op_off.push(at);
            }
        }
        if u32::try_from(ops.len()).is_err() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "more than 2^32 read pieces in one batch",
            )
            .with_backend(SCHEME));
        }
        let order = issue_order(&piece_owner);
        let read_pieces = if ops.len() > batch.reads.len() {
            let mut v = vec![0u32; batch.reads.len()];
            for &r in &op_read {
                v[r as usize] += 1;
            }
            v
        } else {
            Vec::new()
        };
        Ok(Resolved {
            ops,
            op_read,
            op_off,
            order,
            read_pieces,
            peers,
            _regions: regions.into_values().collect(),
        })
    }
}

/// `len` bytes cut into pieces of at most `step` (at least 1): `(offset, bytes)` of each.
fn cuts(len: u64, step: u64) -> impl Iterator<Item = (u64, u64)> {
    let step = step.max(1);
    (0..len.div_ceil(step)).map(move |k| (k * step, (len - k * step).min(step)))
}
