//! Local regions: what a registration holds, and `register`.

use reshard_core::{regions, Error, ErrorKind, MemoryBlock, MemoryKind, Registration, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::NixlTransport;
use crate::agent::Reg;
use crate::SCHEME;

/// A local registered region.
pub(super) struct Local {
    pub(super) mem: Arc<LocalMem>,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) kind: MemoryKind,
    /// Changes when the id is reused by nothing but a new registration; checked at post.
    pub(super) generation: u64,
}

/// The NIXL registration of a local region and the memory behind it, shared by the region
/// entry and every prepared batch that reads into the region (and so by a quarantined one):
/// the last holder deregisters, and only then lets go of the memory.
pub(crate) struct LocalMem {
    /// One registration per lane (the same memory on every lane's agent); empty for a
    /// zero-length block.
    regs: Vec<Reg>,
    /// Only held: released after `reg` (see `Drop`).
    _block: Arc<dyn MemoryBlock>,
    registrations: Arc<AtomicUsize>,
}

impl Drop for LocalMem {
    fn drop(&mut self) {
        // Deregister first, explicitly: the block (a field, dropped after this body) must
        // outlive its registrations.
        if !self.regs.is_empty() {
            self.regs.clear();
            self.registrations.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Address space of a memory kind, for comparing address ranges.
pub(super) fn space(kind: MemoryKind) -> u64 {
    match kind {
        MemoryKind::Dram => 0,
        MemoryKind::Vram { device } => 1 + u64::from(device),
    }
}

impl NixlTransport {
    /// [`reshard_core::Transport::register`].
    pub(super) fn register_block(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let s = &self.shared;
        let kind = block.kind();
        if let (MemoryKind::Vram { device }, Some(mine)) = (kind, s.device_id) {
            if device != mine {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "block is on GPU {device} but this endpoint uses GPU {mine} (device_id)"
                    ),
                )
                .with_backend(SCHEME));
            }
        }
        let (addr, len) = (block.addr(), block.len());
        regions::check_block(SCHEME, block.as_ref())?;
        // Zero-length blocks get an id (ids stay aligned across backends) but nothing to
        // register: no read can touch them.
        // Every lane registers the block: each lane's agent writes into it. A failure on any
        // lane drops (deregisters) the lanes already registered: nothing is half-installed.
        let regs = if len == 0 {
            Vec::new()
        } else {
            s.agents()
                .map(|agent| {
                    agent.register(addr, len, kind).map_err(|e| match kind {
                        MemoryKind::Dram => e,
                        MemoryKind::Vram { .. } => Error::new(
                            ErrorKind::Unsupported,
                            format!("NIXL could not register {kind} memory (no usable GPU?): {e}"),
                        )
                        .with_backend(SCHEME),
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        if !regs.is_empty() {
            s.registrations.fetch_add(1, Ordering::AcqRel);
        }
        let mem = Arc::new(LocalMem {
            regs,
            _block: block,
            registrations: Arc::clone(&s.registrations),
        });
        let id = {
            let mut st = s.state.lock();
            let id = st.next_region;
            st.next_region += 1;
            let generation = s.generation();
            st.regions.insert(
                id,
                Local {
                    mem,
                    addr: addr as u64,
                    len: len as u64,
                    kind,
                    generation,
                },
            );
            id
        };
        s.bump();
        tracing::debug!(agent = %s.name, region = id, len, %kind, "nixl register");
        let weak = Arc::downgrade(&self.shared);
        Ok(Registration::new(id, len as u64, kind, move || {
            if let Some(s) = weak.upgrade() {
                // Deregister outside the lock: NIXL calls and the block's Drop may take time.
                // The region's registration is shared with every batch that reads into it;
                // it is deregistered when the last of them (and this entry) is gone.
                let removed = s.state.lock().regions.remove(&id);
                if removed.is_some() {
                    s.bump();
                }
                drop(removed);
            }
        }))
    }
}
