//! `prepare`: checks every read through the core contract and translates the batch into
//! `process_vm_readv` calls.

use reshard_core::contract::{self, LocalLookup};
use reshard_core::prepared;
use reshard_core::{MemoryBlock, OwnerId, ReadBatch, ReadDesc, Result, Transport};
use std::collections::HashMap;
use std::sync::Arc;

use crate::peer::Peer;
use crate::plan::{self, Source, Wanted};
use crate::SCHEME;

use super::*;

impl CmaTransport {
    /// Checks every read against the loaded peers and local registrations
    /// ([`contract::validate_batch`]) and translates the batch into calls.
    pub(super) fn translate(&self, batch: &ReadBatch) -> Result<Prepared> {
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
                // In range: offset plus the read's source span (a gather's rows included) fits
                // the region (validated above), whose addr + len does not overflow (checked at
                // decode).
                src: Source {
                    addr: region.addr + r.remote_offset,
                    rows: r.remote_rows,
                },
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
}
