//! Outstanding [`Request`]s, the completion queue their callbacks feed, and [`GetOp`], one
//! read as `ucp_get_nbx` takes it.

use super::*;

/// An outstanding UCP request, returned to UCX (`ucp_request_free`) on drop.
pub(crate) struct Request {
    pub(super) ucx: &'static Ucx,
    pub(super) ptr: *mut c_void,
}

impl Request {
    /// `UCS_INPROGRESS` while running, else the final status.
    pub(crate) fn status(&self) -> sys::ucs_status_t {
        // SAFETY: `ptr` is a live request (freed only by Drop).
        unsafe { self.ucx.ucp.ucp_request_check_status(self.ptr) }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: `ptr` is freed exactly once. The engine drops get requests only after their
        // completion: freeing an incomplete one lets the operation continue (it would keep
        // writing), and `ucp_request_cancel` ignores gets, so neither is ever used to end one.
        unsafe { self.ucx.ucp.ucp_request_free(self.ptr) };
    }
}

/// What starting a read did.
pub(crate) enum Started {
    /// Finished in place.
    Done,
    /// Running: completion arrives through the callback with this request's token.
    Pending(Request),
    /// Failed in place.
    Failed(UcxStatusError),
}

/// Called by UCX (inside `ucp_worker_progress`, on the progress thread) when a read
/// completes: queues `(token, status)` for the engine.
unsafe extern "C" fn on_get_done(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    push_completion(user_data as usize as u64, status);
}

thread_local! {
    static COMPLETIONS: std::cell::RefCell<Vec<(u64, sys::ucs_status_t)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn push_completion(token: u64, status: sys::ucs_status_t) {
    // Never panics (this runs inside a C callback): the engine never holds the borrow while
    // it calls into UCX, so `try_borrow_mut` always succeeds in practice.
    let _ = COMPLETIONS.try_with(|q| {
        if let Ok(mut q) = q.try_borrow_mut() {
            q.push((token, status));
        }
    });
}

/// Moves the completions queued by callbacks on this thread into `out`.
pub(crate) fn take_completions(out: &mut Vec<(u64, sys::ucs_status_t)>) {
    let _ = COMPLETIONS.try_with(|q| {
        if let Ok(mut q) = q.try_borrow_mut() {
            out.append(&mut q);
        }
    });
}

/// One resolved read: everything `ucp_get_nbx` needs, as raw handles whose owners (endpoint,
/// remote key, local registration) the caller keeps alive until the read completes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GetOp {
    /// The source bytes mapped in this process ([`RKey::local_ptr`]), or null: the read is then
    /// a local copy instead of a `ucp_get_nbx`.
    pub(crate) direct: *const u8,
    /// For a direct copy that gathers: where the source bytes after the first lie (a get
    /// always reads one contiguous run, so this is `None` whenever `direct` is null).
    pub(crate) rows: Option<shm_copy::Rows>,
    pub(crate) ep: sys::ucp_ep_h,
    pub(crate) rkey: sys::ucp_rkey_h,
    pub(crate) remote_addr: u64,
    pub(crate) local: *mut u8,
    pub(crate) len: usize,
    pub(crate) memh: sys::ucp_mem_h,
    pub(crate) memory_type: sys::ucs_memory_type_t,
}

/// Starts a one-sided read; a pending read reports `token` to [`take_completions`].
///
/// # Safety
/// Every handle in `op` must be live, `op.local..op.local+op.len` must be registered memory
/// that nothing else touches, and all of it must stay so until the read completes.
pub(crate) unsafe fn get(ucx: &'static Ucx, op: &GetOp, token: u64) -> Started {
    if !op.direct.is_null() {
        // SAFETY: `direct..direct+len` (or a gather's rows) is the remote range inside a shared-memory segment UCX
        // mapped for a live key (the caller keeps it alive), `local..local+len` is registered
        // memory nothing else touches (caller's guarantee); they are different mappings, so
        // they do not overlap as Rust objects (the same physical pages at most, read-only).
        let task = shm_copy::CopyTask {
            dst: op.local,
            src: op.direct,
            len: op.len,
            rows: op.rows,
            read: 0,
            off: 0,
        };
        let stop = std::sync::atomic::AtomicBool::new(false);
        // SAFETY: as above, for every row of a gather (its whole source span is inside the
        // segment); one task, so no other destination to overlap.
        unsafe { shm_copy::copy_all(None, &[task], &stop, None) };
        return Started::Done;
    }
    let mut param = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK
            | sys::UCP_OP_ATTR_FIELD_USER_DATA
            | sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE
            | sys::UCP_OP_ATTR_FIELD_MEMH,
        user_data: token as usize as *mut c_void,
        memory_type: op.memory_type,
        memh: op.memh,
        ..Default::default()
    };
    param.cb.send = Some(on_get_done);
    // SAFETY: guaranteed by the caller (see above); `param` is only read during the call.
    let p = unsafe {
        ucx.ucp.ucp_get_nbx(
            op.ep,
            op.local as *mut c_void,
            op.len,
            op.remote_addr,
            op.rkey,
            &param,
        )
    };
    match status_ptr(p) {
        StatusPtr::Done => Started::Done,
        StatusPtr::Pending(ptr) => Started::Pending(Request { ucx, ptr }),
        StatusPtr::Failed(st) => Started::Failed(UcxStatusError::new("ucp_get_nbx", st)),
    }
}
