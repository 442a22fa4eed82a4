//! Local registrations: registering blocks with UCX, exporting this endpoint's metadata,
//! and releasing deregistered regions once a worker flush completed.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use reshard_core::{regions, Error, ErrorKind, MemoryBlock, MemoryKind, Result};

use super::{ucx_err, Engine};
use crate::alloc::Allocation;
use crate::meta::{EndpointMeta, RegionMeta};
use crate::raw::{self, MemHandle, Request};
use crate::SCHEME;

/// A local registration: its mapping and the block (kept alive while UCX may touch it).
///
/// Field order is drop order: the memory handle is unmapped before the block is released.
pub(super) struct LocalRegion {
    /// Region id (1, 2, 3, ... per endpoint).
    pub(super) id: u64,
    pub(super) addr: usize,
    pub(super) len: u64,
    pub(super) kind: MemoryKind,
    /// `None` for zero-length blocks, which UCX cannot map and no read can touch.
    pub(super) mem: Option<LocalMem>,
    rkey: Vec<u8>,
    /// Kept alive while UCX may read or write it (the mapping and running reads use it);
    /// declared last so it is released after `mem` is unmapped.
    _block: Arc<dyn MemoryBlock>,
}

/// How a local region is registered with UCX.
pub(super) enum LocalMem {
    /// Mapped by this endpoint (`ucp_mem_map` of the block's range), unmapped with the region.
    Own(MemHandle),
    /// Inside a UCX allocation of this context: its handle is reused (its key names the
    /// shared-memory segment peers map), and the region keeps the allocation alive.
    Shared(Arc<Allocation>),
}

impl LocalMem {
    pub(super) fn handle(&self) -> &MemHandle {
        match self {
            LocalMem::Own(m) => m,
            LocalMem::Shared(a) => &a.mem,
        }
    }
}

/// A deregistered region kept until a worker flush completed.
pub(super) struct Releasing {
    flush: Request,
    _region: Rc<LocalRegion>,
    since: Instant,
    warned: bool,
}

impl Engine {
    pub(super) fn register(&mut self, block: Arc<dyn MemoryBlock>) -> Result<u64> {
        let (addr, len, kind) = (block.addr(), block.len(), block.kind());
        if !self.ctx.supports(kind) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "this UCX build cannot register {kind} memory (no CUDA transport); \
                     use host memory or the nixl transport"
                ),
            )
            .with_backend(SCHEME));
        }
        regions::check_block(SCHEME, block.as_ref())?;
        let (mem, rkey) = if len == 0 {
            (None, Vec::new())
        } else {
            let shared = match kind {
                MemoryKind::Dram => Allocation::containing(&self.ctx, addr, len),
                MemoryKind::Vram { .. } => None,
            };
            let mem = match shared {
                Some(a) => LocalMem::Shared(a),
                None => LocalMem::Own(MemHandle::map(&self.ctx, addr, len, kind).map_err(ucx_err)?),
            };
            let rkey = mem.handle().pack().map_err(ucx_err)?.bytes().to_vec();
            (Some(mem), rkey)
        };
        let id = self.next_region;
        self.next_region += 1;
        self.regions.insert(
            id,
            Rc::new(LocalRegion {
                id,
                addr,
                len: len as u64,
                kind,
                mem,
                rkey,
                _block: block,
            }),
        );
        self.bump_epoch();
        let shared = matches!(
            self.regions.get(&id).and_then(|r| r.mem.as_ref()),
            Some(LocalMem::Shared(_))
        );
        tracing::debug!(agent = %self.agent, region = id, len, shared, "ucx register");
        Ok(id)
    }

    pub(super) fn export(&self) -> Bytes {
        EndpointMeta {
            agent: self.agent.clone(),
            incarnation: self.opts.incarnation,
            worker_address: self.worker.address().to_vec(),
            regions: self
                .regions
                .iter()
                .map(|(&id, r)| {
                    // The memory the packed key maps: the allocation for a region inside
                    // one (peers map its whole segment), else the region itself.
                    let (key_base, key_len) = match &r.mem {
                        Some(LocalMem::Shared(a)) => (a.addr as u64, a.len as u64),
                        _ => (r.addr as u64, r.len),
                    };
                    RegionMeta {
                        id,
                        base: r.addr as u64,
                        len: r.len,
                        key_base,
                        key_len,
                        kind: r.kind,
                        rkey: r.rkey.clone(),
                    }
                })
                .collect(),
        }
        .encode()
    }

    /// Releases `region` once a worker flush completed. Peers' emulated reads of it are
    /// answered by this worker's UCX, which copies out of the region for every reply it sends,
    /// and a peer that ended its reads (a forced close) does not tell us: replies may still be
    /// queued. The flush completes once everything queued before it was sent.
    pub(super) fn release_after_flush(&mut self, region: Rc<LocalRegion>) {
        match self.worker.flush() {
            Ok(None) => drop(region),
            Ok(Some(flush)) => self.releasing.push(Releasing {
                flush,
                _region: region,
                since: Instant::now(),
                warned: false,
            }),
            Err(e) => {
                tracing::warn!(agent = %self.agent, error = %e, "ucx worker flush failed; keeping a deregistered region");
                self.kept.push(region);
            }
        }
    }

    /// Releases the regions whose flush completed; true on work.
    pub(super) fn poll_releasing(&mut self) -> bool {
        let before = self.releasing.len();
        let timeout = self.opts.timeout;
        let agent = &self.agent;
        self.releasing.retain_mut(|r| {
            if r.flush.status() != raw::sys::UCS_INPROGRESS {
                return false;
            }
            if !r.warned && r.since.elapsed() > timeout {
                r.warned = true;
                tracing::warn!(
                    agent = %agent,
                    "ucx worker flush not done after the timeout; a deregistered region stays \
                     mapped until peers' reads of it are served"
                );
            }
            true
        });
        self.releasing.len() != before
    }
}
