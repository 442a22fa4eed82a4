//! Memory that transports can register: the [`MemoryBlock`] trait and a host buffer.

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::model::MemoryKind;

/// A block of memory a transport may register and move bytes into or out of.
///
/// Contract: `addr()..addr()+len()` stays valid and does not move for the life of the block;
/// while a posted batch that touches it is in flight, its owner does not read or write it.
pub trait MemoryBlock: Send + Sync + fmt::Debug {
    /// Address of the first byte (a device address for VRAM).
    fn addr(&self) -> usize;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when the block has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the bytes live.
    fn kind(&self) -> MemoryKind;
}

/// Host (DRAM) memory whose owner reads and writes its bytes between transfers: a
/// [`HostBuffer`], or memory a transport allocated for fast sharing with its peers
/// ([`crate::Transport::allocate_host`]). The views lock out each other like a `RwLock`; the
/// [`MemoryBlock`] contract still applies (no access while a batch touching it is in flight).
pub trait HostMemory: MemoryBlock {
    /// Shared view of the bytes.
    fn bytes(&self) -> Box<dyn Deref<Target = [u8]> + '_>;
    /// Exclusive view of the bytes.
    fn bytes_mut(&self) -> Box<dyn DerefMut<Target = [u8]> + '_>;
}

/// A zero-initialised host (DRAM) buffer whose address is stable for its whole life.
pub struct HostBuffer {
    bytes: RwLock<Box<[u8]>>,
    addr: usize,
    len: usize,
}

impl HostBuffer {
    /// Allocates `len` zero bytes (lazily backed by the OS for large sizes).
    pub fn zeroed(len: usize) -> Self {
        let b = vec![0u8; len].into_boxed_slice();
        let addr = b.as_ptr() as usize;
        HostBuffer {
            bytes: RwLock::new(b),
            addr,
            len,
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_bytes(data: &[u8]) -> Self {
        let b = HostBuffer::zeroed(data.len());
        b.write().copy_from_slice(data);
        b
    }

    /// Shared view of the bytes (no transport may be writing them).
    pub fn read(&self) -> RwLockReadGuard<'_, Box<[u8]>> {
        self.bytes.read()
    }

    /// Exclusive view of the bytes (no transport may be reading or writing them).
    pub fn write(&self) -> RwLockWriteGuard<'_, Box<[u8]>> {
        self.bytes.write()
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({:#x}, {} bytes)", self.addr, self.len)
    }
}

impl MemoryBlock for HostBuffer {
    fn addr(&self) -> usize {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Dram
    }
}

impl HostMemory for HostBuffer {
    fn bytes(&self) -> Box<dyn Deref<Target = [u8]> + '_> {
        Box::new(RwLockReadGuard::map(self.read(), |b| &**b))
    }
    fn bytes_mut(&self) -> Box<dyn DerefMut<Target = [u8]> + '_> {
        Box::new(RwLockWriteGuard::map(self.write(), |b| &mut **b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_is_stable_and_bytes_zeroed() {
        let b = HostBuffer::zeroed(4096);
        let a = b.addr();
        assert!(b.read().iter().all(|&x| x == 0));
        b.write()[7] = 9;
        assert_eq!(b.addr(), a);
        assert_eq!(b.read()[7], 9);
        assert_eq!(b.len(), 4096);
        assert_eq!(HostBuffer::from_bytes(&[1, 2, 3]).read()[..], [1, 2, 3]);
        let h: &dyn HostMemory = &b;
        h.bytes_mut()[8] = 5;
        assert_eq!(h.bytes()[7..9], [9, 5]);
    }
}
