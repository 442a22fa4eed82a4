//! Configuration and context: `ucp_config_*` and the process-wide [`Context`] per configuration,
//! and UCX's memory type of a reshard memory kind.

use super::*;

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
                .with_backend(crate::SCHEME))
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
            .with_backend(crate::SCHEME)
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

/// Whether a `UCX_TLS`-style list lets UCX use TCP: empty (UCX's default, all), `all`, a
/// list naming `tcp`, or an exclusion list (`^...`) that does not name it.
fn tcp_listed(tls: &str) -> bool {
    let tls = tls.trim();
    match tls.strip_prefix('^') {
        Some(excluded) => !excluded.split(',').any(|t| t.trim() == "tcp"),
        None => tls.is_empty() || tls.split(',').any(|t| matches!(t.trim(), "tcp" | "all")),
    }
}

/// A UCP context (`ucp_init` with RMA and WAKEUP, `mt_workers_shared`), cleaned up on drop.
pub(crate) struct Context {
    pub(crate) ucx: &'static Ucx,
    pub(super) h: sys::ucp_context_h,
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
        // UCX's TCP transport connects with a blocking connect() by default, on the thread
        // that creates the endpoint: this endpoint's progress thread, which re-creates a
        // force-closed endpoint at once. To a host whose link is down that blocks it for
        // seconds per attempt (until ARP gives up: `No route to host`), and with it every
        // batch, abort and timeout of the endpoint (a refit then failed 30-47 s after a link
        // went down, not after the 3 s no-progress bound). Non-blocking, a failed connect is
        // an endpoint error like any other. A user's UCX_TCP_CONN_NB is kept. (A UCT option
        // is given to ucp_config_modify by its name in the transport's table, and UCX warns
        // about one no transport used: only when TCP is among the transports.)
        let tls = opts
            .tls
            .clone()
            .or_else(|| std::env::var("UCX_TLS").ok())
            .unwrap_or_default();
        if std::env::var_os("UCX_TCP_CONN_NB").is_none() && tcp_listed(&tls) {
            cfg.modify("CONN_NB", "y")?;
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
                .with_backend(crate::SCHEME)
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
