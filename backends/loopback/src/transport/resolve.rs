//! `resolve`: re-resolves every region of a prepared batch to its live block at post,
//! re-checking bounds.

use reshard_core::contract::span;
use reshard_core::{Error, ErrorKind, OwnerId, PreparedBatch, Result};
use std::ops::Range;

use super::{oob, LoopbackTransport, Prepared};
use crate::fabric::Region;
use crate::posted::Live;
use crate::SCHEME;

impl LoopbackTransport {
    /// Resolves every region of a prepared batch to its live block, re-checking bounds.
    pub(super) fn resolve(
        &self,
        prepared: &PreparedBatch,
        st: &Prepared,
    ) -> Result<(Vec<Live>, Vec<Live>)> {
        let reads = &prepared.batch().reads;
        let gone = |owner: OwnerId, first_read: usize, what: String| {
            let r = &reads[first_read];
            Error::new(ErrorKind::Transport, what)
                .with_owner(owner)
                .with_range(span(r.remote_offset, r.len))
                .with_backend(SCHEME)
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
            let addr = check(
                s.owner,
                span(r.remote_offset, r.remote_span().unwrap_or(r.len)),
                &region,
                s.max_end,
            )?;
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
                    .with_backend(SCHEME)
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
