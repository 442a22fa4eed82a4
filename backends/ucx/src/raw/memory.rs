//! Memory registration and remote keys: [`MemHandle`] (`ucp_mem_map`), [`PackedRkey`] and
//! [`RKey`] (unpacked, with the direct pointer of shared memory mapped here).

use super::*;

/// A registered memory region (`ucp_mem_map`), unmapped on drop; for memory UCX allocated
/// ([`MemHandle::allocate`]), unmapping also frees it.
pub(crate) struct MemHandle {
    ctx: Arc<Context>,
    h: sys::ucp_mem_h,
}

// SAFETY: a memory handle is a context-level object: packing its key and unmapping it go
// through the thread-safe (`mt_workers_shared`) context, and reads only pass the handle to UCX.
unsafe impl Send for MemHandle {}
// SAFETY: as above; `&MemHandle` only packs keys and hands out the raw handle.
unsafe impl Sync for MemHandle {}

impl MemHandle {
    /// Allocates at least `len` bytes of zeroed host memory with UCX (`UCP_MEM_MAP_ALLOCATE`):
    /// shared memory (sysv or posix, as `UCX_ALLOC_PRIO` orders) when UCX can, which peers on
    /// this host read with plain copies through their shared-memory transports instead of
    /// asking this process to serve every read. Returns the handle, the address and length.
    pub(crate) fn allocate(
        ctx: &Arc<Context>,
        len: usize,
    ) -> Result<(Self, usize, usize), UcxStatusError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: std::ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut h = std::ptr::null_mut();
        // SAFETY: with ALLOCATE and a NULL address UCX chooses and owns the memory; the handle
        // is unmapped (and the memory freed) exactly once, by Drop.
        check("ucp_mem_map", unsafe {
            ctx.ucx.ucp.ucp_mem_map(ctx.h, &params, &mut h)
        })?;
        let mem = MemHandle {
            ctx: Arc::clone(ctx),
            h,
        };
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: `h` is live; UCX fills the requested fields.
        check("ucp_mem_query", unsafe {
            ctx.ucx.ucp.ucp_mem_query(h, &mut attr)
        })?;
        let addr = attr.address as usize;
        if addr == 0 || attr.length < len || addr.checked_add(attr.length).is_none() {
            return Err(UcxStatusError::new("ucp_mem_query", sys::UCS_ERR_NO_MEMORY));
        }
        Ok((mem, addr, attr.length))
    }

    /// Whether this handle belongs to `ctx`.
    pub(crate) fn of_context(&self, ctx: &Arc<Context>) -> bool {
        Arc::ptr_eq(&self.ctx, ctx)
    }

    /// Registers `len` bytes at `addr` of memory type `kind` (the memory is not allocated by
    /// UCX and must stay valid until this handle drops).
    pub(crate) fn map(
        ctx: &Arc<Context>,
        addr: usize,
        len: usize,
        kind: MemoryKind,
    ) -> Result<Self, UcxStatusError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE) as u64,
            address: addr as *mut c_void,
            length: len,
            memory_type: memory_type(kind),
            ..Default::default()
        };
        let mut h = std::ptr::null_mut();
        // SAFETY: the caller keeps `addr..addr+len` valid (a MemoryBlock kept alive with this
        // handle); without the ALLOCATE flag UCX only registers the existing range.
        check("ucp_mem_map", unsafe {
            ctx.ucx.ucp.ucp_mem_map(ctx.h, &params, &mut h)
        })?;
        Ok(MemHandle {
            ctx: Arc::clone(ctx),
            h,
        })
    }

    /// Packs the remote key peers need to read this region.
    pub(crate) fn pack(&self) -> Result<PackedRkey, UcxStatusError> {
        let (mut p, mut n) = (std::ptr::null_mut(), 0usize);
        // SAFETY: context and memory handle are live; UCX allocates the buffer we release.
        check("ucp_rkey_pack", unsafe {
            self.ctx
                .ucx
                .ucp
                .ucp_rkey_pack(self.ctx.h, self.h, &mut p, &mut n)
        })?;
        Ok(PackedRkey {
            ucx: self.ctx.ucx,
            ptr: p,
            len: n,
        })
    }

    /// The raw handle, passed with reads into this region.
    pub(crate) fn handle(&self) -> sys::ucp_mem_h {
        self.h
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_mem_map on this context and is unmapped once; no request
        // uses it any more (requests keep the region, and so this handle, alive).
        let st = unsafe { self.ctx.ucx.ucp.ucp_mem_unmap(self.ctx.h, self.h) };
        if st != sys::UCS_OK {
            tracing::warn!(status = status::status_name(st), "ucp_mem_unmap failed");
        }
    }
}

/// A packed remote-key buffer from `ucp_rkey_pack`, released on drop.
pub(crate) struct PackedRkey {
    ucx: &'static Ucx,
    ptr: *mut c_void,
    len: usize,
}

impl PackedRkey {
    /// The packed bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.ptr.is_null() {
            return &[];
        }
        // SAFETY: UCX returned `len` readable bytes at `ptr`, valid until release.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for PackedRkey {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: the buffer came from ucp_rkey_pack and is released once.
            unsafe { self.ucx.ucp.ucp_rkey_buffer_release(self.ptr) };
        }
    }
}

/// A peer's remote key unpacked on an endpoint, destroyed on drop (before its endpoint).
pub(crate) struct RKey {
    ep: Rc<Endpoint>,
    h: sys::ucp_rkey_h,
}

impl RKey {
    /// Unpacks `packed` (a peer's `ucp_rkey_pack` output) for `ep`.
    ///
    /// Like worker addresses, UCX does not bounds-check packed keys.
    pub(crate) fn unpack(ep: &Rc<Endpoint>, packed: &[u8]) -> Result<Self, UcxStatusError> {
        let mut h = std::ptr::null_mut();
        // SAFETY: `ep` is live; `packed` is readable for the call (UCX copies what it keeps).
        check("ucp_ep_rkey_unpack", unsafe {
            ep.worker
                .ucx()
                .ucp
                .ucp_ep_rkey_unpack(ep.h, packed.as_ptr() as *const c_void, &mut h)
        })?;
        Ok(RKey {
            ep: Rc::clone(ep),
            h,
        })
    }

    /// The raw handle, for `ucp_get_nbx` (valid while this key lives).
    pub(crate) fn handle(&self) -> sys::ucp_rkey_h {
        self.h
    }

    /// Where remote address `raddr` is mapped in this process (`ucp_rkey_ptr`), when the key
    /// names shared memory UCX mapped here (a peer's sysv/posix allocation): the mapping lives
    /// as long as this key. `None` for every other key (user memory, TCP, other hosts).
    pub(crate) fn local_ptr(&self, raddr: u64) -> Option<*const u8> {
        let mut p = std::ptr::null_mut();
        // SAFETY: `h` is a live key; UCX only computes and writes the local address.
        let st = unsafe { self.ep.worker.ucx().ucp.ucp_rkey_ptr(self.h, raddr, &mut p) };
        (st == sys::UCS_OK && !p.is_null()).then_some(p as *const u8)
    }
}

impl Drop for RKey {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_ep_rkey_unpack and is destroyed once, before its endpoint.
        unsafe { self.ep.worker.ucx().ucp.ucp_rkey_destroy(self.h) };
    }
}
