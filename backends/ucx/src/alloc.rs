//! Host memory allocated by UCX ([`crate::UcxTransport`]'s `allocate_host`): shared memory
//! that peers on this host read with plain copies (UCX's sysv/posix RMA), where memory the
//! caller allocated is served by software-emulated reads that cost the publisher's progress
//! thread a copy per fragment (see README "Transports and throughput").
//!
//! The allocation belongs to the process-wide UCX context of its configuration, so any
//! endpoint of that configuration can register it: registration then reuses the allocation's
//! memory handle (its packed key names the shared segment) instead of mapping the range again.
//! A process-wide table of live allocations lets an endpoint recognise such a block from its
//! address alone (a `MemoryBlock` carries no type information).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, Weak};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use reshard_core::{HostMemory, MemoryBlock, MemoryKind};

use crate::raw::{Context, MemHandle};

/// A UCX allocation: the memory and its handle; dropping the last reference unmaps (frees) it.
pub(crate) struct Allocation {
    pub(crate) mem: MemHandle,
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

/// Live allocations of this process (weak: the table never keeps memory alive).
static LIVE: Mutex<Vec<Weak<Allocation>>> = Mutex::new(Vec::new());

impl Allocation {
    /// Allocates `len` zeroed bytes in `ctx` and records the allocation in the table.
    pub(crate) fn new(ctx: &Arc<Context>, len: usize) -> Result<Arc<Self>, crate::UcxStatusError> {
        let (mem, addr, _mapped) = MemHandle::allocate(ctx, len.max(1))?;
        // SAFETY: UCX allocated `_mapped >= len` writable bytes at `addr` for this handle, which
        // nothing else uses yet. Shared-memory pages come zeroed from the kernel, but UCX's
        // last-resort allocator (the heap) does not, and the contract promises zeroes.
        unsafe { std::ptr::write_bytes(addr as *mut u8, 0, len) };
        let a = Arc::new(Allocation { mem, addr, len });
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|w| w.strong_count() > 0);
        live.push(Arc::downgrade(&a));
        Ok(a)
    }

    /// The live allocation of context `ctx` holding `addr..addr+len`, if any.
    pub(crate) fn containing(ctx: &Arc<Context>, addr: usize, len: usize) -> Option<Arc<Self>> {
        let end = addr.checked_add(len)?;
        let live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        live.iter()
            .filter_map(Weak::upgrade)
            .find(|a| a.addr <= addr && end <= a.addr + a.len && a.mem.of_context(ctx))
    }
}

/// Host memory UCX allocated for fast sharing; a [`HostMemory`] block like a `HostBuffer`.
pub struct UcxHostMemory {
    alloc: Arc<Allocation>,
    /// Orders the owner's views of the bytes (like `HostBuffer`'s lock).
    lock: RwLock<()>,
}

impl UcxHostMemory {
    pub(crate) fn new(alloc: Arc<Allocation>) -> Self {
        UcxHostMemory {
            alloc,
            lock: RwLock::new(()),
        }
    }
}

impl fmt::Debug for UcxHostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "UcxHostMemory({:#x}, {} bytes)",
            self.alloc.addr, self.alloc.len
        )
    }
}

unsafe impl MemoryBlock for UcxHostMemory {
    fn addr(&self) -> usize {
        self.alloc.addr
    }
    fn len(&self) -> usize {
        self.alloc.len
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Dram
    }
}

/// A shared view: the read lock and the bytes.
struct View<'a> {
    _guard: RwLockReadGuard<'a, ()>,
    bytes: &'a [u8],
}

impl Deref for View<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

/// An exclusive view: the write lock and the bytes.
struct ViewMut<'a> {
    _guard: RwLockWriteGuard<'a, ()>,
    bytes: &'a mut [u8],
}

impl Deref for ViewMut<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}

impl DerefMut for ViewMut<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
}

impl HostMemory for UcxHostMemory {
    fn bytes(&self) -> Box<dyn Deref<Target = [u8]> + '_> {
        let guard = self.lock.read();
        // SAFETY: `addr..addr+len` is allocated host memory that lives as long as `self.alloc`
        // (so for the view's lifetime); the read lock excludes the owner's exclusive views,
        // and the MemoryBlock contract keeps transports from writing it while the owner looks.
        let bytes =
            unsafe { std::slice::from_raw_parts(self.alloc.addr as *const u8, self.alloc.len) };
        Box::new(View {
            _guard: guard,
            bytes,
        })
    }

    fn bytes_mut(&self) -> Box<dyn DerefMut<Target = [u8]> + '_> {
        let guard = self.lock.write();
        // SAFETY: as in `bytes`, and the write lock makes this the only view of the owner;
        // peers only read the memory, and not while the owner writes (MemoryBlock contract).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.alloc.addr as *mut u8, self.alloc.len) };
        Box::new(ViewMut {
            _guard: guard,
            bytes,
        })
    }
}
