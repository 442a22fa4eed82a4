//! The loopback state of a prepared batch ([`Prepared`]: resolved region references and work
//! lists) and `translate`, which validates a batch through the core contract and builds it.

use reshard_core::contract::{self, LocalLookup};
use reshard_core::prepared;
use reshard_core::{OwnerId, ReadBatch, ReadDesc, Result};
use std::collections::HashMap;
use std::sync::Weak;

use super::LoopbackTransport;
use crate::fabric::AgentState;
use crate::work::{self, Piece};
use crate::SCHEME;

/// A source region as prepare resolved it (re-resolved to the live block at every post).
pub(super) struct SrcRef {
    pub(super) owner: OwnerId,
    pub(super) agent: Weak<AgentState>,
    pub(super) region: u64,
    /// Largest end offset any read uses in this region.
    pub(super) max_end: u64,
    /// First read that uses it, to name in errors.
    pub(super) first_read: usize,
}

/// A local destination region (on this agent).
pub(super) struct DstRef {
    pub(super) region: u64,
    pub(super) max_end: u64,
    pub(super) first_read: usize,
}

/// The loopback state of a [`PreparedBatch`]: resolved region references and work lists.
///
/// [`PreparedBatch`]: reshard_core::PreparedBatch
pub(crate) struct Prepared {
    pub(super) agent_uid: u64,
    pub(super) srcs: Vec<SrcRef>,
    pub(super) dsts: Vec<DstRef>,
    /// One list per worker, balanced by bytes.
    pub(crate) work: Vec<Vec<Piece>>,
}

impl LoopbackTransport {
    /// Checks every read against loaded peers and local registrations
    /// ([`contract::validate_batch`]) and builds work lists.
    pub(super) fn translate(&self, batch: &ReadBatch) -> Result<Prepared> {
        prepared::check_read_count(SCHEME, batch)?;
        let peers = self.peers.read();
        let local = self.agent.regions.read();
        contract::validate_batch(
            SCHEME,
            &self.agent.name,
            batch,
            |owner, region| {
                contract::remote_lookup(peers.get(&owner), |p| p.regions.get(&region).copied())
            },
            |region| {
                local.get(&region).map(|r| LocalLookup {
                    len: r.len,
                    ..LocalLookup::of(&*r.block)
                })
            },
        )?;
        // Every look-up below succeeds (the batch was validated under these same locks);
        // failing anyway is an internal error, never a panic.
        let missing = |i: usize, r: &ReadDesc, what: &str| {
            contract::validated_lookup_failed(SCHEME, i, r, what)
        };
        let mut srcs: Vec<SrcRef> = Vec::new();
        let mut src_ix: HashMap<(OwnerId, u64), u32> = HashMap::new();
        let mut dsts: Vec<DstRef> = Vec::new();
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
                    local
                        .get(&r.local_region)
                        .ok_or_else(|| missing(i, r, "local region"))?;
                    let d = *dst_ix.entry(r.local_region).or_insert_with(|| {
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
            // A gather spans more source bytes than it moves (validated to fit).
            let span = r.remote_span().unwrap_or(r.len);
            src.max_end = src.max_end.max(r.remote_offset + span);
            let dst = &mut dsts[d as usize];
            dst.max_end = dst.max_end.max(r.local_offset + r.len);
            whole.push(Piece {
                read: i as u32,
                src: s,
                dst: d,
                src_off: r.remote_offset,
                dst_off: r.local_offset,
                off: 0,
                len: r.len,
                last: true,
                rows: r.remote_rows,
            });
        }
        // Destinations are disjoint (validated), so workers never write the same bytes.
        let total: u64 = whole.iter().map(|p| p.len).sum();
        let lists = self.workers.max(total.div_ceil(work::LIST_BYTES) as usize);
        let work = work::split(&whole, lists);
        Ok(Prepared {
            agent_uid: self.agent.uid,
            srcs,
            dsts,
            work,
        })
    }
}
