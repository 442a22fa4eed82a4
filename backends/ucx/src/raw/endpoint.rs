//! [`Endpoint`]s to peer workers: connect from a worker address, close (cleanly or forced) on drop.

use super::*;

/// How long closing an endpoint may progress the worker before giving up on a clean flush.
const CLOSE_LIMIT: Duration = Duration::from_secs(2);

/// Called by UCX when an endpoint fails (its peer exited or the link broke). The reads on it
/// already complete with the error status, which is what we report; this only logs. With
/// `UCP_ERR_HANDLING_MODE_PEER` the failure is contained to the endpoint (the process is
/// never taken down by it).
unsafe extern "C" fn on_ep_error(_arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    tracing::debug!(status = status::status_name(status), "ucx endpoint failed");
}

/// An endpoint to a peer worker, closed on drop (or earlier, with force, by
/// [`Endpoint::force_close`]).
pub(crate) struct Endpoint {
    pub(super) worker: Rc<Worker>,
    pub(super) h: sys::ucp_ep_h,
    /// Set once the endpoint was closed with force: `h` must not be used any more.
    closed: std::cell::Cell<bool>,
    /// The forced close's request, while UCX still runs it.
    close_req: std::cell::RefCell<Option<Request>>,
}

impl Endpoint {
    /// Connects to the worker whose packed address is `address`.
    ///
    /// UCX parses the address itself and does not bounds-check it: it must come from a
    /// worker's exported metadata (the decoder checked the framing around it).
    pub(crate) fn connect(worker: &Rc<Worker>, address: &[u8]) -> Result<Rc<Self>, UcxStatusError> {
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            address: address.as_ptr() as *const sys::ucp_address_t,
            // Peer failure handling: a failed endpoint is reported through `on_ep_error` and
            // its requests' statuses instead of aborting the process, and it is what lets
            // `force_close` end outstanding gets (a forced close is an invalid parameter in
            // `UCP_ERR_HANDLING_MODE_NONE`). Measured with Debian's UCX 1.13.1: the
            // shared-memory `ucp_rkey_ptr` path and sysv/posix emulated reads stay available.
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: std::ptr::null_mut(),
            },
            ..Default::default()
        };
        let mut h = std::ptr::null_mut();
        // SAFETY: the worker is live; `address` outlives the call (UCX copies what it needs).
        check("ucp_ep_create", unsafe {
            worker.ucx().ucp.ucp_ep_create(worker.h, &params, &mut h)
        })?;
        Ok(Rc::new(Endpoint {
            worker: Rc::clone(worker),
            h,
            closed: std::cell::Cell::new(false),
            close_req: std::cell::RefCell::new(None),
        }))
    }

    /// The raw handle, for `ucp_get_nbx` (valid while this endpoint lives and is not closed).
    pub(crate) fn handle(&self) -> sys::ucp_ep_h {
        self.h
    }

    /// Whether [`Endpoint::force_close`] was called: no new operation may use the handle.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.get()
    }

    /// Closes the endpoint with `UCP_EP_CLOSE_FLAG_FORCE`: UCX discards its lanes, and every
    /// get still outstanding on it completes (with an error status) as the worker is
    /// progressed. The close request returning proves nothing about the gets: only their
    /// completions do. Idempotent.
    pub(crate) fn force_close(&self) -> Result<(), UcxStatusError> {
        if self.closed.replace(true) {
            return Ok(());
        }
        let ucx = self.worker.ucx();
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: `h` is live and closed exactly once (guarded by `closed`); the endpoint was
        // created with peer error handling, which a forced close requires. Its remote keys
        // stay valid objects of the worker until they are destroyed.
        let p = unsafe { ucx.ucp.ucp_ep_close_nbx(self.h, &param) };
        match status_ptr(p) {
            StatusPtr::Done => Ok(()),
            StatusPtr::Pending(ptr) => {
                *self.close_req.borrow_mut() = Some(Request { ucx, ptr });
                Ok(())
            }
            StatusPtr::Failed(st) => Err(UcxStatusError::new("ucp_ep_close_nbx", st)),
        }
    }

    /// Starts a flush, which completes once the connection is wired up (and anything
    /// issued before it has completed): `None` when it completed in place.
    pub(crate) fn flush(&self) -> Result<Option<Request>, UcxStatusError> {
        let ucx = self.worker.ucx();
        let param = sys::ucp_request_param_t::default();
        // SAFETY: `h` is live; without a callback the request is polled with
        // ucp_request_check_status and freed by `Request`'s Drop.
        let p = unsafe { ucx.ucp.ucp_ep_flush_nbx(self.h, &param) };
        match status_ptr(p) {
            StatusPtr::Done => Ok(None),
            StatusPtr::Pending(ptr) => Ok(Some(Request { ucx, ptr })),
            StatusPtr::Failed(st) => Err(UcxStatusError::new("ucp_ep_flush_nbx", st)),
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.closed.get() {
            // Closed with force earlier. Freeing a close request that is still running lets
            // UCX finish it internally; no get of ours is outstanding on it (running batches
            // hold the endpoint until their reads completed).
            drop(self.close_req.borrow_mut().take());
            return;
        }
        let ucx = self.worker.ucx();
        // Flush mode: every read of ours on it has completed, so the flush is short; the wait
        // is bounded in case the peer is gone. This runs on the progress thread only.
        let param = sys::ucp_request_param_t::default();
        // SAFETY: `h` is live and closed exactly once; every RKey of it is already destroyed
        // (each holds an `Rc<Endpoint>`).
        let p = unsafe { ucx.ucp.ucp_ep_close_nbx(self.h, &param) };
        match status_ptr(p) {
            StatusPtr::Done => {}
            StatusPtr::Failed(st) => {
                tracing::debug!(
                    status = status::status_name(st),
                    "ucx endpoint close failed"
                )
            }
            StatusPtr::Pending(r) => {
                let req = Request { ucx, ptr: r };
                if !self.worker.progress_until_done(&req, CLOSE_LIMIT) {
                    tracing::warn!("ucx endpoint close did not finish; left to worker teardown");
                }
            }
        }
    }
}
