//! Recording posted reads in the execution log, as the handles handed to UCX resolve.

use std::rc::Rc;

use reshard_core::{executed, OwnerId, ReadDesc};

use super::execute::Running;
use super::peers::Peer;
use super::Engine;
use crate::raw::GetOp;

impl Engine {
    /// Records read of `piece` in the batch's execution log when `piece` is the read's first
    /// piece, as the handles handed to UCX resolve: the owner whose currently loaded endpoint
    /// is the one the get uses, the remote region (of that peer's metadata) whose key is the get's key
    /// and whose range holds the get's remote address (for a direct copy: whose mapping, by
    /// `ucp_rkey_ptr`, holds the copy's source pointer), and the local registration holding
    /// the destination pointer. A read cut into several pieces is recorded once, as the extent
    /// its pieces cover. What cannot be resolved is recorded as region 0 with the raw address.
    pub(super) fn record(&self, run: &Running, piece: u32) {
        let Some(log) = run.log.as_ref() else {
            return;
        };
        let p = piece as usize;
        let read = run.res.op_read[p];
        if p > 0 && run.res.op_read[p - 1] == read {
            return;
        }
        let op = &run.res.ops[p];
        let len: u64 = run.res.op_read[p..]
            .iter()
            .take_while(|&&r| r == read)
            .zip(&run.res.ops[p..])
            .map(|(_, o)| o.len as u64)
            .sum();
        let asked = &run.batch.reads[read as usize];
        // A gather is recorded as one when its pieces' sources, relative to the first piece's,
        // lie where its rows are; else as the contiguous read the first piece starts (which a
        // reader of the log sees differ from what was asked).
        let rows = asked.remote_rows.filter(|_| {
            follows_rows(
                asked,
                read,
                &run.res.ops[p..],
                &run.res.op_off[p..],
                &run.res.op_read[p..],
            )
        });
        let extent = match rows {
            Some(_) => asked.remote_span().unwrap_or(len),
            None => len,
        };
        // The endpoints loaded for each owner (not the batch's own owner -> peer table, which
        // is what resolution could have got wrong).
        let mut used: Vec<(OwnerId, &Rc<Peer>)> = self
            .peers
            .iter()
            .filter(|(_, peer)| peer.ep.handle() == op.ep)
            .map(|(&o, peer)| (o, peer))
            .collect();
        used.sort_unstable_by_key(|&(o, _)| (o != asked.owner, o));
        let (owner, remote) = match used.first() {
            Some(&(owner, peer)) => {
                let mut hits: Vec<(u64, u64)> = peer
                    .regions
                    .iter()
                    .filter_map(|(&id, reg)| {
                        let key = reg.rkey.as_ref()?;
                        if key.handle() != op.rkey {
                            return None;
                        }
                        if op.direct.is_null() {
                            let end = op.remote_addr.checked_add(extent)?;
                            (op.remote_addr >= reg.base && end <= reg.base + reg.len)
                                .then(|| (id, op.remote_addr - reg.base))
                        } else {
                            let base = key.local_ptr(reg.base)? as usize;
                            let src = op.direct as usize;
                            let end = src.checked_add(extent as usize)?;
                            (src >= base && end <= base + reg.len as usize)
                                .then(|| (id, (src - base) as u64))
                        }
                    })
                    .collect();
                hits.sort_unstable_by_key(|&(id, _)| (id != asked.remote_region, id));
                (owner, hits.first().copied())
            }
            None => (asked.owner, None),
        };
        let remote = remote.unwrap_or((0, op.remote_addr));
        let locals = run
            .res
            ._regions
            .iter()
            .map(|r| (r.id, r.addr as u64, r.len));
        let prefer = Some(asked.local_region);
        log.record([ReadDesc {
            remote_rows: rows,
            ..executed::read(owner, remote, locals, op.local as u64, len, prefer)
        }]);
    }
}

/// Whether the pieces of read `read` (`ops`, `offs` and `reads` from its first piece on) take their sources where
/// the rows of the gather `asked` are: each piece's remote address (or source pointer) is the
/// first piece's moved by the distance [`ReadDesc::remote_runs`] gives between their offsets.
fn follows_rows(asked: &ReadDesc, read: u32, ops: &[GetOp], offs: &[u64], reads: &[u32]) -> bool {
    let source = |at: u64| asked.remote_runs(at, asked.len).next().map(|(o, _, _)| o);
    let (Some(first), Some(op0)) = (source(0), ops.first()) else {
        return false;
    };
    ops.iter()
        .zip(offs)
        .zip(reads)
        .take_while(|(_, &r)| r == read)
        .all(|((op, &off), _)| {
            let Some(want) = source(off).map(|o| o - first) else {
                return false;
            };
            if op.direct.is_null() {
                op.remote_addr.wrapping_sub(op0.remote_addr) == want
            } else {
                (op.direct as u64).wrapping_sub(op0.direct as u64) == want
            }
        })
}
