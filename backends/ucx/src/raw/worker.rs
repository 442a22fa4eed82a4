//! The UCP [`Worker`]: one per endpoint, single-threaded, driven by the engine's progress thread.

use super::*;

/// Outcome of [`Worker::arm`].
pub(crate) enum Armed {
    /// Armed: the event fd will signal new events.
    Yes,
    /// Events are pending: progress again before sleeping.
    Busy,
}

/// A UCP worker in single-thread mode, destroyed on drop.
pub(crate) struct Worker {
    ctx: Arc<Context>,
    pub(super) h: sys::ucp_worker_h,
    address: Vec<u8>,
}

impl Worker {
    /// Creates the worker and copies its address (what peers connect to).
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Rc<Self>, UcxStatusError> {
        let ucx = ctx.ucx;
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut h = std::ptr::null_mut();
        // SAFETY: the context is live (held by the Rc); `h` receives a worker we own.
        check("ucp_worker_create", unsafe {
            ucx.ucp.ucp_worker_create(ctx.h, &params, &mut h)
        })?;
        let mut w = Worker {
            ctx: Arc::clone(ctx),
            h,
            address: Vec::new(),
        };
        let mut attr = sys::ucp_worker_attr_t {
            field_mask: sys::UCP_WORKER_ATTR_FIELD_ADDRESS as u64,
            ..Default::default()
        };
        // SAFETY: `h` is live; UCX allocates `attr.address`, released below.
        check("ucp_worker_query", unsafe {
            ucx.ucp.ucp_worker_query(h, &mut attr)
        })?;
        if !attr.address.is_null() {
            // SAFETY: UCX returned `address_length` readable bytes at `address`.
            w.address = unsafe {
                std::slice::from_raw_parts(attr.address as *const u8, attr.address_length)
            }
            .to_vec();
            // SAFETY: the address came from ucp_worker_query on this worker; released once.
            unsafe { ucx.ucp.ucp_worker_release_address(h, attr.address) };
        }
        Ok(Rc::new(w))
    }

    pub(super) fn ucx(&self) -> &'static Ucx {
        self.ctx.ucx
    }

    /// The packed worker address peers pass to `ucp_ep_create`.
    pub(crate) fn address(&self) -> &[u8] {
        &self.address
    }

    /// Runs one round of progress; true when anything happened.
    pub(crate) fn progress(&self) -> bool {
        // SAFETY: `h` is live and only used from this thread (single-thread mode).
        unsafe { self.ucx().ucp.ucp_worker_progress(self.h) != 0 }
    }

    /// The worker's event fd (valid while the worker lives).
    pub(crate) fn event_fd(&self) -> Result<RawFd, UcxStatusError> {
        let mut fd = -1;
        // SAFETY: `h` is live; UCX writes the fd it owns.
        check("ucp_worker_get_efd", unsafe {
            self.ucx().ucp.ucp_worker_get_efd(self.h, &mut fd)
        })?;
        Ok(fd)
    }

    /// Arms the event fd after progress has drained every event.
    pub(crate) fn arm(&self) -> Result<Armed, UcxStatusError> {
        // SAFETY: `h` is live.
        match unsafe { self.ucx().ucp.ucp_worker_arm(self.h) } {
            sys::UCS_OK => Ok(Armed::Yes),
            sys::UCS_ERR_BUSY => Ok(Armed::Busy),
            st => Err(UcxStatusError::new("ucp_worker_arm", st)),
        }
    }

    /// Starts flushing every endpoint of the worker, including the ones UCX created for
    /// peers reading from us: it completes once everything issued before it, among it the
    /// replies to peers' emulated reads (which copy out of our registered memory), has
    /// completed. `None` when it completed in place.
    pub(crate) fn flush(&self) -> Result<Option<Request>, UcxStatusError> {
        let ucx = self.ucx();
        let param = sys::ucp_request_param_t::default();
        // SAFETY: `h` is live; without a callback the request is polled with
        // ucp_request_check_status and freed by `Request`'s Drop.
        let p = unsafe { ucx.ucp.ucp_worker_flush_nbx(self.h, &param) };
        match status_ptr(p) {
            StatusPtr::Done => Ok(None),
            StatusPtr::Pending(ptr) => Ok(Some(Request { ucx, ptr })),
            StatusPtr::Failed(st) => Err(UcxStatusError::new("ucp_worker_flush_nbx", st)),
        }
    }

    /// Progresses until `req` completes or `limit` passes; true when it completed.
    pub(super) fn progress_until_done(&self, req: &Request, limit: Duration) -> bool {
        let start = Instant::now();
        loop {
            if req.status() != sys::UCS_INPROGRESS {
                return true;
            }
            if !self.progress() {
                if start.elapsed() > limit {
                    return false;
                }
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: every endpoint holds an `Rc<Worker>`, so none is left; `h` is released once.
        unsafe { self.ucx().ucp.ucp_worker_destroy(self.h) };
    }
}
