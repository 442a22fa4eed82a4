//! The only place that calls UCX: the run-time loaded library ([`lib`]) and small RAII types
//! over UCP handles ([`Context`], [`Worker`], [`Endpoint`], [`MemHandle`], [`PackedRkey`],
//! [`RKey`], [`Request`]). Every status becomes a [`UcxStatusError`]; no `Drop` panics.
//!
//! The [`Context`] is process-wide per configuration (UCX's intended use: one context per
//! process, one worker per thread), created with `mt_workers_shared` so it is thread-safe, and
//! shared through `Arc`s by every endpoint of that configuration; memory handles
//! ([`MemHandle`]) belong to it and are `Send + Sync`. Memory it allocates (shared memory,
//! see [`MemHandle::allocate`]) can therefore be registered on every endpoint of the process.
//!
//! Workers, endpoints, remote keys and requests are created, used and dropped on one progress
//! thread (see `engine`), so the worker runs in `UCS_THREAD_MODE_SINGLE` and those types are
//! deliberately `!Send` (they hold `Rc`s or raw handles): the compiler keeps them on that
//! thread. Lifetimes are reference edges: an endpoint keeps its worker, a remote key its
//! endpoint, a worker or memory handle its context, so UCX objects are always released in the
//! order UCX needs.

mod copy;
pub(crate) use copy::{copy_all, CopyTask};
mod status;

pub use status::UcxStatusError;

use std::ffi::{c_char, c_void, CStr, CString};
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use reshard_core::{Error, ErrorKind, MemoryKind};

use status::check;

/// Bindgen output over `<ucp/api/ucp.h>` (see build.rs): constants, structs and `UcpLib`, the
/// function table loaded from libucp at run time.
#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_docs,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
pub(crate) mod sys {
    include!(concat!(env!("OUT_DIR"), "/ucp_bindings.rs"));
}

/// File name of the UCP library that is opened (the soname Debian's libucx0 ships).
pub const LIBUCP: &str = "libucp.so.0";
/// File name of the UCS library, used only for status descriptions.
const LIBUCS: &str = "libucs.so.0";

type StatusStringFn = unsafe extern "C" fn(sys::ucs_status_t) -> *const c_char;

/// The loaded libraries, kept for the life of the process (UCX is never unloaded: its
/// transports may have threads and signal handlers installed).
pub(crate) struct Ucx {
    pub(crate) ucp: sys::UcpLib,
    status_string: Option<StatusStringFn>,
    _ucs: Option<libloading::Library>,
    /// `major.minor.release` of the loaded library.
    pub(crate) version: (u32, u32, u32),
}

static UCX: OnceLock<Result<Ucx, String>> = OnceLock::new();

/// Serialises context creation: UCX's configuration parser has global state.
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// The process-wide UCX library, loaded on first use with `RTLD_LOCAL`; `Unavailable` when it
/// cannot be loaded or is older than the headers this crate was built against.
pub(crate) fn lib() -> Result<&'static Ucx, Error> {
    match UCX.get_or_init(load) {
        Ok(u) => Ok(u),
        Err(why) => Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "UCX is not usable here: {why}; install libucx-dev: bash scripts/install-deps.sh"
            ),
        )
        .with_backend(crate::BACKEND)),
    }
}

fn load() -> Result<Ucx, String> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: opening libucp runs its ELF constructors (UCS/UCM global init), which are safe to
    // run once per process; RTLD_LOCAL keeps its `ucp_*` symbols out of the global namespace so
    // another UCX copy (NIXL's plugin) binds to its own.
    let ucp = unsafe { Library::open(Some(LIBUCP), RTLD_NOW | RTLD_LOCAL) }
        .map_err(|e| format!("cannot load {LIBUCP}: {e}"))?;
    // SAFETY: every symbol is looked up with the signature bindgen generated from the same
    // UCX API headers; `from_library` fails if any is missing instead of panicking later.
    let ucp = unsafe { sys::UcpLib::from_library(libloading::Library::from(ucp)) }
        .map_err(|e| format!("{LIBUCP} lacks a UCP function this build needs: {e}"))?;
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: ucp_get_version only writes the three integers it is given.
    unsafe { ucp.ucp_get_version(&mut major, &mut minor, &mut release) };
    if major != sys::UCP_API_MAJOR || minor < sys::UCP_API_MINOR {
        return Err(format!(
            "{LIBUCP} is UCX {major}.{minor}.{release}, older than the UCX {}.{} headers this \
             crate was built with",
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR
        ));
    }
    // libucp depends on libucs, so this only takes another reference to the loaded copy.
    // SAFETY: as above; the library is kept in `Ucx` for as long as the pointer is used.
    let ucs = unsafe { Library::open(Some(LIBUCS), RTLD_NOW | RTLD_LOCAL) }.ok();
    let status_string = ucs.as_ref().and_then(|l| {
        // SAFETY: `ucs_status_string` has this C signature in <ucs/type/status.h>.
        unsafe { l.get::<StatusStringFn>(b"ucs_status_string\0") }
            .ok()
            .map(|s| *s)
    });
    Ok(Ucx {
        ucp,
        status_string,
        _ucs: ucs.map(libloading::Library::from),
        version: (major, minor, release),
    })
}

/// UCX's description of a status, when the library is loaded.
fn status_description(code: sys::ucs_status_t) -> Option<String> {
    let f = UCX.get()?.as_ref().ok()?.status_string?;
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string (or NULL)
    // for any status value.
    let p = unsafe { f(code) };
    if p.is_null() {
        return None;
    }
    // SAFETY: non-NULL and NUL-terminated as above; copied before returning.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

// ---------------------------------------------------------------------------------------------
// Status pointers (the UCS_PTR_* macros of <ucs/type/status.h>).

/// What a `ucs_status_ptr_t` returned by a non-blocking call says.
pub(crate) enum StatusPtr {
    /// Completed in place (`UCS_OK`).
    Done,
    /// Started: completion comes through the request.
    Pending(*mut c_void),
    /// Failed in place.
    Failed(sys::ucs_status_t),
}

fn status_ptr(p: sys::ucs_status_ptr_t) -> StatusPtr {
    let v = p as usize;
    // UCS_PTR_IS_ERR: the pointer is a negative status in [UCS_ERR_LAST, -1].
    if v >= (sys::UCS_ERR_LAST as isize) as usize {
        StatusPtr::Failed(v as isize as sys::ucs_status_t)
    } else if v == 0 {
        StatusPtr::Done
    } else {
        StatusPtr::Pending(p)
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration and context.

/// What a context is created with: `tls` and `net_devices` override `UCX_TLS` and
/// `UCX_NET_DEVICES` through `ucp_config_modify`, never through the process environment.
#[derive(Debug, Clone, Default)]
pub(crate) struct ContextOptions {
    pub(crate) tls: Option<String>,
    pub(crate) net_devices: Option<String>,
    pub(crate) name: String,
}

/// A `ucp_config_t` read from the environment, released on drop.
struct UcpConfig {
    ucx: &'static Ucx,
    h: *mut sys::ucp_config_t,
}

impl UcpConfig {
    fn read(ucx: &'static Ucx) -> Result<Self, UcxStatusError> {
        let mut h = std::ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_ environment, default file"; `h` receives a
        // config owned by this wrapper.
        check("ucp_config_read", unsafe {
            ucx.ucp
                .ucp_config_read(std::ptr::null(), std::ptr::null(), &mut h)
        })?;
        Ok(UcpConfig { ucx, h })
    }

    fn modify(&mut self, name: &str, value: &str) -> Result<(), Error> {
        let (n, v) = match (CString::new(name), CString::new(value)) {
            (Ok(n), Ok(v)) => (n, v),
            _ => {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("UCX option {name} contains a NUL byte"),
                )
                .with_backend(crate::BACKEND))
            }
        };
        // SAFETY: `h` is a live config; both strings are NUL-terminated and outlive the call.
        let st = unsafe {
            self.ucx
                .ucp
                .ucp_config_modify(self.h, n.as_ptr(), v.as_ptr())
        };
        check("ucp_config_modify", st).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("UCX rejected {name}={value:?}: {e}"),
            )
            .with_backend(crate::BACKEND)
            .with_source(e)
        })
    }
}

impl Drop for UcpConfig {
    fn drop(&mut self) {
        // SAFETY: `h` came from ucp_config_read and is released exactly once.
        unsafe { self.ucx.ucp.ucp_config_release(self.h) };
    }
}

/// A UCP context (`ucp_init` with RMA and WAKEUP, `mt_workers_shared`), cleaned up on drop.
pub(crate) struct Context {
    pub(crate) ucx: &'static Ucx,
    h: sys::ucp_context_h,
    memory_types: u64,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ucp_context({:p})", self.h)
    }
}

// SAFETY: the context is created with `mt_workers_shared = 1`, which makes UCX protect its
// context-wide state (memory maps, key packing, worker creation) with a lock, so the handle
// may be used and released from any thread. Workers and their objects stay on their threads.
unsafe impl Send for Context {}
// SAFETY: as above: concurrent context-level calls are serialised by UCX.
unsafe impl Sync for Context {}

/// Live contexts of this process, by `(tls, net_devices)`; an entry dies with its last user.
type ContextKey = (Option<String>, Option<String>);
static CONTEXTS: Mutex<Vec<(ContextKey, Weak<Context>)>> = Mutex::new(Vec::new());

impl Context {
    /// The process's context for `opts` (its `tls` and `net_devices`): the live one if an
    /// endpoint or allocation still holds it, else a new one. Sharing one context is what
    /// lets every endpoint of the process register memory another endpoint allocated.
    pub(crate) fn shared(ucx: &'static Ucx, opts: &ContextOptions) -> Result<Arc<Self>, Error> {
        let key = (opts.tls.clone(), opts.net_devices.clone());
        let mut live = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|(_, w)| w.strong_count() > 0);
        if let Some(ctx) = live
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(ctx);
        }
        let ctx = Arc::new(Context::new(ucx, opts)?);
        live.push((key, Arc::downgrade(&ctx)));
        Ok(ctx)
    }

    /// Creates a context for one-sided reads with event-fd wake-up, usable from any thread.
    fn new(ucx: &'static Ucx, opts: &ContextOptions) -> Result<Self, Error> {
        let _guard = INIT_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let mut cfg = UcpConfig::read(ucx)?;
        if let Some(t) = &opts.tls {
            cfg.modify("TLS", t)?;
        }
        if let Some(d) = &opts.net_devices {
            cfg.modify("NET_DEVICES", d)?;
        }
        let name = CString::new(opts.name.replace('\0', "?")).unwrap_or_default();
        let params = sys::ucp_params_t {
            field_mask: (sys::UCP_PARAM_FIELD_FEATURES
                | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                | sys::UCP_PARAM_FIELD_NAME) as u64,
            features: (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP) as u64,
            // Every endpoint's progress thread has its own worker on this one context.
            mt_workers_shared: 1,
            name: name.as_ptr(),
            ..Default::default()
        };
        let mut h = std::ptr::null_mut();
        // SAFETY: `params` and `cfg` are valid for the call (UCX copies what it keeps); the
        // API version is the one the bindings were generated from.
        let st = unsafe {
            ucx.ucp.ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                cfg.h,
                &mut h,
            )
        };
        check("ucp_init", st).map_err(|e| {
            // No usable transport or device for the configured tls / net_devices.
            let config = matches!(st, sys::UCS_ERR_NO_DEVICE | sys::UCS_ERR_NO_ELEM);
            if config && (opts.tls.is_some() || opts.net_devices.is_some()) {
                Error::new(
                    ErrorKind::Config,
                    format!(
                        "no usable UCX transport for tls={:?} net_devices={:?} (see ucx_info -d)",
                        opts.tls, opts.net_devices
                    ),
                )
                .with_backend(crate::BACKEND)
                .with_source(e)
            } else {
                Error::from(e)
            }
        })?;
        let mut ctx = Context {
            ucx,
            h,
            memory_types: 1 << sys::UCS_MEMORY_TYPE_HOST,
        };
        let mut attr = sys::ucp_context_attr_t {
            field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64,
            ..Default::default()
        };
        // SAFETY: `h` is the live context; `attr` is filled for the requested field only.
        if unsafe { ucx.ucp.ucp_context_query(h, &mut attr) } == sys::UCS_OK {
            ctx.memory_types = attr.memory_types;
        }
        Ok(ctx)
    }

    /// Whether UCX can register and move memory of `kind` in this context.
    pub(crate) fn supports(&self, kind: MemoryKind) -> bool {
        self.memory_types & (1 << memory_type(kind)) != 0
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and memory handle holds an `Arc<Context>`, so none is left.
        unsafe { self.ucx.ucp.ucp_cleanup(self.h) };
    }
}

/// UCX's memory type for a reshard memory kind: VRAM is CUDA memory.
pub(crate) fn memory_type(kind: MemoryKind) -> sys::ucs_memory_type_t {
    match kind {
        MemoryKind::Dram => sys::UCS_MEMORY_TYPE_HOST,
        MemoryKind::Vram { .. } => sys::UCS_MEMORY_TYPE_CUDA,
    }
}

// ---------------------------------------------------------------------------------------------
// Worker.

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
    h: sys::ucp_worker_h,
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

    fn ucx(&self) -> &'static Ucx {
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

    /// Progresses until `req` completes or `limit` passes; true when it completed.
    fn progress_until_done(&self, req: &Request, limit: Duration) -> bool {
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

// ---------------------------------------------------------------------------------------------
// Endpoint.

/// How long closing an endpoint may progress the worker before giving up on a clean flush.
const CLOSE_LIMIT: Duration = Duration::from_secs(2);

/// Called by UCX when an endpoint fails (its peer exited or the link broke). The reads on it
/// already complete with the error status, which is what we report; this only logs.
unsafe extern "C" fn on_ep_error(_arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    tracing::debug!(status = status::status_name(status), "ucx endpoint failed");
}

/// An endpoint to a peer worker, closed on drop.
pub(crate) struct Endpoint {
    worker: Rc<Worker>,
    h: sys::ucp_ep_h,
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
            // UCX's default mode: asking for peer failure handling makes UCX 1.13 drop its
            // shared-memory transports (no peer failure detection there), leaving only TCP
            // between endpoints of one host. A vanished peer is caught by our timeout.
            err_mode: sys::UCP_ERR_HANDLING_MODE_NONE,
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
        }))
    }

    /// The raw handle, for `ucp_get_nbx` (valid while this endpoint lives).
    pub(crate) fn handle(&self) -> sys::ucp_ep_h {
        self.h
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
        let ucx = self.worker.ucx();
        // Flush mode: force mode needs peer error handling, which this crate does not ask
        // for (see `connect`). Our reads are all complete here, so the flush is short; the
        // wait is bounded in case the peer is gone.
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

// ---------------------------------------------------------------------------------------------
// Memory registration and remote keys.

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

// ---------------------------------------------------------------------------------------------
// Requests.

/// An outstanding UCP request, returned to UCX (`ucp_request_free`) on drop.
pub(crate) struct Request {
    ucx: &'static Ucx,
    ptr: *mut c_void,
}

impl Request {
    /// `UCS_INPROGRESS` while running, else the final status.
    pub(crate) fn status(&self) -> sys::ucs_status_t {
        // SAFETY: `ptr` is a live request (freed only by Drop).
        unsafe { self.ucx.ucp.ucp_request_check_status(self.ptr) }
    }

    /// Asks UCX to cancel the request; it still completes (with `UCS_ERR_CANCELED` or its
    /// real status) through its callback.
    pub(crate) fn cancel(&self, worker: &Worker) {
        // SAFETY: `ptr` is a live request of `worker`; cancelling a completed one is a no-op.
        unsafe { self.ucx.ucp.ucp_request_cancel(worker.h, self.ptr) };
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: `ptr` is freed exactly once. The engine drops requests after completion;
        // freeing an incomplete one is allowed (it finishes internally without callbacks).
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
        // SAFETY: `direct..direct+len` is the remote range inside a shared-memory segment UCX
        // mapped for a live key (the caller keeps it alive), `local..local+len` is registered
        // memory nothing else touches (caller's guarantee); they are different mappings, so
        // they do not overlap as Rust objects (the same physical pages at most, read-only).
        unsafe { copy::stream_copy(op.local, op.direct, op.len) };
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
