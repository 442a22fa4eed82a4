//! Memory that transports can register: the [`MemoryBlock`] trait and a host buffer.

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::alloc::{self, Layout};
use std::cell::UnsafeCell;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::model::MemoryKind;

/// A block of memory a transport may register and move bytes into or out of.
///
/// # Safety
/// Transports write into and read from `addr()..addr()+len()` through raw pointers, from other
/// threads and (one-sided) from other processes' NICs, so an implementation promises:
/// - the range is one allocation of `len()` bytes of the stated [`MemoryKind`], valid and at a
///   fixed address for the whole life of the block (until its last `Arc` drops);
/// - writes through that address are permitted: the bytes are not behind a shared reference
///   Rust assumes immutable (use a raw allocation or `UnsafeCell`, never the address of a
///   `Box<[u8]>` or `Vec` that safe code also borrows);
/// - while a posted batch that touches the block is in flight, the owner does not read or write
///   those bytes (the transport contract says when a batch is over).
pub unsafe trait MemoryBlock: Send + Sync + fmt::Debug {
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
///
/// The bytes are a raw allocation inside an `UnsafeCell`, never a `Box<[u8]>` whose address is
/// handed out: transports write through [`MemoryBlock::addr`] while no Rust reference to the
/// bytes exists, which a `Box` would not allow.
pub struct HostBuffer {
    /// Guards the views; the bytes themselves live in `cell`.
    lock: RwLock<()>,
    cell: RawBytes,
}

/// A raw zeroed allocation of `len` bytes (dangling and never dereferenced when `len` is 0).
struct RawBytes {
    ptr: UnsafeCell<NonNull<u8>>,
    len: usize,
}

// SAFETY: the allocation is plain bytes owned by this value; access is coordinated by
// `HostBuffer::lock` (views) and the MemoryBlock contract (transports).
unsafe impl Send for RawBytes {}
// SAFETY: as above.
unsafe impl Sync for RawBytes {}

impl RawBytes {
    fn zeroed(len: usize) -> Self {
        let ptr = if len == 0 {
            NonNull::dangling()
        } else {
            let layout = Layout::array::<u8>(len).expect("buffer larger than isize::MAX");
            // SAFETY: the layout has a non-zero size.
            let p = unsafe { alloc::alloc_zeroed(layout) };
            NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout))
        };
        RawBytes {
            ptr: UnsafeCell::new(ptr),
            len,
        }
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY: the pointer itself is only written at construction.
        unsafe { (*self.ptr.get()).as_ptr() }
    }
}

impl Drop for RawBytes {
    fn drop(&mut self) {
        if self.len > 0 {
            let layout = Layout::array::<u8>(self.len).expect("checked at allocation");
            // SAFETY: allocated in `zeroed` with this layout; freed once.
            unsafe { alloc::dealloc(self.ptr(), layout) };
        }
    }
}

/// Shared view of a [`HostBuffer`]'s bytes.
pub struct BytesRef<'a> {
    _guard: RwLockReadGuard<'a, ()>,
    bytes: &'a [u8],
}

/// Exclusive view of a [`HostBuffer`]'s bytes.
pub struct BytesMut<'a> {
    _guard: RwLockWriteGuard<'a, ()>,
    bytes: &'a mut [u8],
}

impl Deref for BytesRef<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl Deref for BytesMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for BytesMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl HostBuffer {
    /// Allocates `len` zero bytes (lazily backed by the OS for large sizes).
    pub fn zeroed(len: usize) -> Self {
        HostBuffer {
            lock: RwLock::new(()),
            cell: RawBytes::zeroed(len),
        }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_bytes(data: &[u8]) -> Self {
        let b = HostBuffer::zeroed(data.len());
        b.write().copy_from_slice(data);
        b
    }

    /// Shared view of the bytes (no transport may be writing them).
    pub fn read(&self) -> BytesRef<'_> {
        let guard = self.lock.read();
        // SAFETY: the read lock excludes `write` views; transports do not write while a view
        // is held (MemoryBlock contract); the allocation lives as long as `self`.
        let bytes = unsafe { std::slice::from_raw_parts(self.cell.ptr(), self.cell.len) };
        BytesRef {
            _guard: guard,
            bytes,
        }
    }

    /// Exclusive view of the bytes (no transport may be reading or writing them).
    pub fn write(&self) -> BytesMut<'_> {
        let guard = self.lock.write();
        // SAFETY: the write lock excludes every other view; see `read`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.cell.ptr(), self.cell.len) };
        BytesMut {
            _guard: guard,
            bytes,
        }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({:#x}, {} bytes)", self.addr(), self.len())
    }
}

// SAFETY: one raw allocation, fixed for the buffer's life, never behind a Rust reference
// except inside a locked view.
unsafe impl MemoryBlock for HostBuffer {
    fn addr(&self) -> usize {
        self.cell.ptr() as usize
    }
    fn len(&self) -> usize {
        self.cell.len
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Dram
    }
}

impl HostMemory for HostBuffer {
    fn bytes(&self) -> Box<dyn Deref<Target = [u8]> + '_> {
        Box::new(self.read())
    }
    fn bytes_mut(&self) -> Box<dyn DerefMut<Target = [u8]> + '_> {
        Box::new(self.write())
    }
}

/// Fails with a clear error, instead of an allocation abort, when `bytes` exceed the memory the
/// OS reports available (Linux `MemAvailable`; skipped where that is unknown).
pub fn memory_check(bytes: u64, what: &str) -> crate::error::Result<()> {
    let Some(avail) = available_memory() else {
        return Ok(());
    };
    if bytes > avail {
        return Err(crate::error::Error::new(
            crate::error::ErrorKind::InvalidInput,
            format!(
                "{what} need {:.2} GiB but only {:.2} GiB of memory is available; scale the \
                 model down (--layers, --experts, --vocab)",
                bytes as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            ),
        ));
    }
    Ok(())
}

fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
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
        assert!(HostBuffer::zeroed(0).read().is_empty());
    }

    #[test]
    fn writes_through_the_address_are_seen_by_views() {
        // What a transport does: write through the raw address while no view is held.
        let b = HostBuffer::zeroed(64);
        // SAFETY: no view is alive; the range is inside the allocation.
        unsafe { std::ptr::write_bytes(b.addr() as *mut u8, 0xab, 64) };
        assert!(b.read().iter().all(|&x| x == 0xab));
    }
}
