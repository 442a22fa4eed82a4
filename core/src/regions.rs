//! Registration checks every backend's [`Transport::register`](crate::Transport::register)
//! runs, written once: [`check_block`] refuses a block whose address range cannot be real
//! memory, with the same error kind and message in every backend ([`check_host_block`] also
//! refuses device memory, for backends that move host memory only); and the bookkeeping of an
//! endpoint whose regions live in a table of its own, [`RegionTable`]: ids from 1, never
//! reused, and an epoch that every registration and release moves.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard};

use crate::error::{Error, ErrorKind, Result};
use crate::memory::MemoryBlock;
use crate::model::MemoryKind;
use crate::transport::Registration;

/// Refuses a non-empty block at address 0 or whose end overflows (`OutOfBounds`, naming
/// `backend`). Empty blocks pass wherever they claim to be: no read can touch them, and they
/// still take a region id, so ids stay aligned across backends.
pub fn check_block(backend: &'static str, block: &dyn MemoryBlock) -> Result<()> {
    let (addr, len) = (block.addr(), block.len());
    if len > 0 && (addr == 0 || addr.checked_add(len).is_none()) {
        return Err(Error::new(
            ErrorKind::OutOfBounds,
            format!("block {addr:#x}+{len} is not a valid address range"),
        )
        .with_backend(backend));
    }
    Ok(())
}

/// Refuses device memory (`Unsupported`: `backend` `how`, e.g. "moves host memory only", and
/// points at the backends whose capabilities include VRAM), then checks the block as
/// [`check_block`] does.
pub fn check_host_block(backend: &'static str, how: &str, block: &dyn MemoryBlock) -> Result<()> {
    let kind = block.kind();
    if let MemoryKind::Vram { .. } = kind {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("{backend} {how}; cannot register {kind} (use a transport with the `vram` capability: `reshard transports`)"),
        )
        .with_backend(backend));
    }
    check_block(backend, block)
}

/// The regions an endpoint registered, by id, and the endpoint's epoch
/// ([`Transport::epoch`](crate::Transport::epoch)). Registrations hold the table weakly, so a
/// handle dropped after its endpoint releases nothing.
pub struct RegionTable<R> {
    regions: RwLock<BTreeMap<u64, R>>,
    next_id: AtomicU64,
    epoch: AtomicU64,
}

impl<R> Default for RegionTable<R> {
    fn default() -> Self {
        RegionTable {
            regions: RwLock::new(BTreeMap::new()),
            // Ids start at 1 in every backend, so ids stay aligned across backends.
            next_id: AtomicU64::new(1),
            epoch: AtomicU64::new(0),
        }
    }
}

impl<R: Send + Sync + 'static> RegionTable<R> {
    /// An empty table at epoch 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The endpoint's epoch: moved by every registration and release, and by [`Self::bump`].
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Moves the epoch for a change outside the table (a peer loaded), so that batches
    /// prepared before it are re-resolved at post.
    pub fn bump(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The registered regions, ascending by id, read-locked.
    pub fn read(&self) -> RwLockReadGuard<'_, BTreeMap<u64, R>> {
        self.regions.read()
    }

    /// Adds `region` (`len` bytes of `kind`) under a fresh id and moves the epoch; dropping the
    /// returned handle removes it and moves the epoch again.
    pub fn register(self: &Arc<Self>, region: R, len: u64, kind: MemoryKind) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.regions.write().insert(id, region);
        self.bump();
        let table = Arc::downgrade(self);
        Registration::new(id, len, kind, move || {
            if let Some(t) = table.upgrade() {
                // The region may hold its block's last reference, whose Drop may do anything
                // (a posted batch holding another releases it when the batch ends): drop ours
                // outside the lock.
                let removed = t.regions.write().remove(&id);
                if removed.is_some() {
                    t.bump();
                }
                drop(removed);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_count_from_one_and_every_change_moves_the_epoch() {
        let t = Arc::new(RegionTable::new());
        let e0 = t.epoch();
        let a = t.register("a", 4, MemoryKind::Dram);
        let b = t.register("b", 0, MemoryKind::Vram { device: 2 });
        assert_eq!((a.id(), a.len(), a.kind()), (1, 4, MemoryKind::Dram));
        assert_eq!((b.id(), b.kind()), (2, MemoryKind::Vram { device: 2 }));
        assert_eq!(t.epoch(), e0 + 2);
        assert_eq!(
            t.read().iter().collect::<Vec<_>>(),
            [(&1, &"a"), (&2, &"b")]
        );
        drop(a);
        assert_eq!(t.epoch(), e0 + 3);
        assert_eq!(t.read().keys().collect::<Vec<_>>(), [&2]);
        let c = t.register("c", 1, MemoryKind::Dram);
        assert_eq!(c.id(), 3, "ids are never reused");
        t.bump();
        assert_eq!(t.epoch(), e0 + 5);
    }

    #[test]
    fn a_handle_outliving_its_table_releases_nothing() {
        let t = Arc::new(RegionTable::new());
        let a = t.register(Arc::new(()), 1, MemoryKind::Dram);
        let block = Arc::clone(&t.read()[&1]);
        drop(t);
        assert_eq!(
            Arc::strong_count(&block),
            1,
            "the table's reference went with it"
        );
        drop(a);
    }
}
