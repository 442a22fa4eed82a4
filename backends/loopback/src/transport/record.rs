//! `record`: what a post writes to the execution log, computed back from the addresses the
//! copy jobs use.

use reshard_core::{executed, ExecutionLog, ReadDesc, RemoteRows};
use std::collections::BTreeMap;
use std::sync::Arc;

use super::{LoopbackTransport, Peer, Prepared};
use crate::fabric::Region;
use crate::posted::Live;

/// The region of `regions` whose registered block holds `addr..addr + len` and the offset of
/// `addr` in it, by the core rule ([`executed::locate`]: `prefer`, else the lowest id).
fn region_at(regions: &BTreeMap<u64, Region>, addr: u64, len: u64, prefer: u64) -> (u64, u64) {
    executed::locate(spans(regions), addr, len, Some(prefer))
}

/// `(id, start address, length)` of every region in `regions`, as [`executed`] takes them.
fn spans(regions: &BTreeMap<u64, Region>) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    regions
        .iter()
        .map(|(&id, r)| (id, r.block.addr() as u64, r.len))
}

/// A read as the copy jobs execute it: source and destination indices, first source and
/// destination addresses, bytes, and a gather's source rows.
type Extent = (u32, u32, u64, u64, u64, Option<RemoteRows>);

impl LoopbackTransport {
    /// Records every read of a post as the copy jobs will execute it: the owner is the one
    /// whose loaded peer is the agent the source block was resolved from, and regions and
    /// offsets are computed back from the source and destination addresses the jobs copy
    /// between (the block address resolved at post plus the piece's offset), looked up in the
    /// source agent's and this agent's registrations. Reads split between workers are recorded
    /// once, as the whole extent their pieces cover. A skipped read (fault injection) is not.
    pub(super) fn record(
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
            let e = ext[p.read as usize].get_or_insert((p.src, p.dst, sa, da, 0, p.rows));
            e.2 = e.2.min(sa);
            e.3 = e.3.min(da);
            e.4 += p.len;
        }
        let peers = self.peers.read();
        let mut out = Vec::with_capacity(n);
        for (s, d, sa, da, len, rows) in ext.into_iter().flatten() {
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
            // A gather's region must hold its whole source span, not just `len` bytes.
            let spanned = rows.and_then(|g| g.span(len)).unwrap_or(len);
            let remote = used.as_ref().map_or((0, sa), |a| {
                region_at(&a.regions.read(), sa, spanned, src.region)
            });
            let prefer = st.dsts[d as usize].region;
            let locals = self.agent.regions.read();
            out.push(ReadDesc {
                remote_rows: rows,
                ..executed::read(owner, remote, spans(&locals), da, len, Some(prefer))
            });
        }
        log.record(out);
    }
}
