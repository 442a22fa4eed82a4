//! The FFI boundary: one NIXL agent with its plugin backend, wrapped in small RAII types whose
//! every status becomes a typed [`Error`]. Nothing outside this module touches `nixl_sys`.

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NixlError,
    RegistrationHandle, ThreadSync, XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};
use reshard_core::{Error, ErrorKind, MemoryKind, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::options::NixlOptions;
use crate::SCHEME;

/// NIXL's name for a status, as far as `nixl-sys` keeps it apart.
pub(crate) fn status_name(e: &NixlError) -> &'static str {
    match e {
        NixlError::InvalidParam => "NIXL_ERR_INVALID_PARAM",
        NixlError::BackendError => "NIXL_ERR_BACKEND",
        NixlError::NotFound => "NIXL_ERR_NOT_FOUND",
        NixlError::StringConversionError(_) => "NIXL_ERR_INVALID_PARAM (string with NUL)",
        NixlError::IndexOutOfBounds => "NIXL_ERR_INVALID_PARAM (index out of bounds)",
        NixlError::InvalidDataPointer => "NIXL_ERR_BACKEND (null data)",
        NixlError::FailedToCreateXferRequest => "NIXL_ERR_BACKEND (create xfer request)",
        NixlError::RegDescListCreationFailed | NixlError::RegDescAddFailed => {
            "NIXL_ERR_BACKEND (registration list)"
        }
        NixlError::FailedToCreateXferDlistHandle => "NIXL_ERR_BACKEND (xfer dlist)",
        NixlError::FailedToCreateBackend => "NIXL_ERR_BACKEND (create backend)",
        NixlError::NoTelemetry => "NIXL_ERR_NO_TELEMETRY",
    }
}

/// Whether a failed post came from the plugin (`NIXL_ERR_BACKEND`), possibly after it had
/// started some of the request's reads, rather than from NIXL's own checks before it.
pub(crate) fn plugin_failed(e: &NixlError) -> bool {
    matches!(e, NixlError::BackendError)
}

/// A `Transport` error for a failed NIXL call: names the call and NIXL's status.
pub(crate) fn nixl_error(what: &str, e: NixlError) -> Error {
    Error::new(
        ErrorKind::Transport,
        format!("NIXL {what} failed: {}", status_name(&e)),
    )
    .with_backend(SCHEME)
    .with_source(e)
}

/// NIXL memory segment of a reshard memory kind, and its device id.
pub(crate) fn seg(kind: MemoryKind) -> (MemType, u64) {
    match kind {
        MemoryKind::Dram => (MemType::Dram, 0),
        MemoryKind::Vram { device } => (MemType::Vram, u64::from(device)),
    }
}

/// A raw address range handed to NIXL registration (NIXL only reads the numbers).
#[derive(Debug)]
struct Span {
    addr: usize,
    len: usize,
    kind: MemoryKind,
}

impl MemoryRegion for Span {
    // SAFETY (of the contract): the pointer is only handed to NIXL registration as a number;
    // the block behind it is kept alive by the transport for as long as it stays registered.
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        seg(self.kind).0
    }
    fn device_id(&self) -> u64 {
        seg(self.kind).1
    }
}

/// One NIXL agent with the configured plugin backend created on it.
pub(crate) struct NixlAgent {
    agent: Agent,
    /// Kept so the backend outlives every call; the agent destroys it when it is destroyed.
    _backend: Backend,
}

impl NixlAgent {
    /// Creates agent `name` and the plugin backend from the plugin's default parameters with
    /// `options.plugin_params` applied over them.
    pub(crate) fn new(name: &str, options: &NixlOptions) -> Result<NixlAgent> {
        let cfg = AgentConfig {
            enable_prog_thread: options.progress_thread,
            enable_listen_thread: false,
            // Strict: NIXL serialises every call on the agent, so posting, polling and
            // registering from different tokio workers is safe.
            thread_sync: ThreadSync::Strict,
            pthr_delay_us: options.progress_delay_us,
            ..AgentConfig::default()
        };
        let agent =
            Agent::new_configured(name, &cfg).map_err(|e| nixl_error("agent creation", e))?;
        let plugins = agent
            .get_available_plugins()
            .map_err(|e| nixl_error("plugin listing", e))?;
        let names: Vec<String> = plugins
            .iter()
            .filter_map(|p| p.ok())
            .map(String::from)
            .collect();
        if !names.iter().any(|p| p == &options.backend) {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "NIXL plugin {:?} is not installed; available: {}",
                    options.backend,
                    names.join(", ")
                ),
            )
            .with_backend(SCHEME));
        }
        let (_mems, defaults) = agent
            .get_plugin_params(&options.backend)
            .map_err(|e| nixl_error("plugin parameters", e))?;
        let mut params = defaults
            .clone()
            .map_err(|e| nixl_error("plugin parameters", e))?;
        let known: Vec<String> = (&defaults)
            .into_iter()
            .map(|(k, _)| k.to_string())
            .collect();
        for (k, v) in &options.plugin_params {
            if !known.contains(k) {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "plugin {} has no parameter {k:?}; it has: {}",
                        options.backend,
                        known.join(", ")
                    ),
                )
                .with_backend(SCHEME));
            }
            params
                .set(k, v)
                .map_err(|e| nixl_error("plugin parameter", e))?;
        }
        let backend = agent
            .create_backend(&options.backend, &params)
            .map_err(|e| nixl_error(&format!("{} backend creation", options.backend), e))?;
        Ok(NixlAgent {
            agent,
            _backend: backend,
        })
    }

    /// Registers `addr..addr+len` of `kind`; the handle deregisters when dropped.
    pub(crate) fn register(&self, addr: usize, len: usize, kind: MemoryKind) -> Result<Reg> {
        let span = Span { addr, len, kind };
        let h = self
            .agent
            .register_memory(&span, None)
            .map_err(|e| nixl_error(&format!("registration of {kind} memory"), e))?;
        Ok(Reg(Some(h)))
    }

    /// This agent's metadata (connection info and registrations).
    pub(crate) fn local_md(&self) -> Result<Vec<u8>> {
        self.agent
            .get_local_md()
            .map_err(|e| nixl_error("getLocalMD", e))
    }

    /// Loads a remote agent's metadata; returns the agent name NIXL read from it.
    pub(crate) fn load_remote(&self, md: &[u8]) -> Result<String> {
        self.agent
            .load_remote_md(md)
            .map_err(|e| nixl_error("loadRemoteMD", e))
    }

    /// Forgets a remote agent's metadata (and its connection).
    pub(crate) fn invalidate_remote(&self, name: &str) -> Result<()> {
        self.agent
            .invalidate_remote_md(name)
            .map_err(|e| nixl_error("invalidateRemoteMD", e))
    }

    /// Prepares a descriptor list once: `agent` is `""` for local memory, else the remote
    /// agent whose registrations the descriptors must lie in (NIXL checks that too).
    pub(crate) fn prep_dlist(
        &self,
        agent: &str,
        kind: MemoryKind,
        descs: &[(u64, u64)],
    ) -> Result<Prepped> {
        let (mem, dev) = seg(kind);
        let mut list = XferDescList::new(mem).map_err(|e| nixl_error("descriptor list", e))?;
        for &(addr, len) in descs {
            list.add_desc(addr as usize, len as usize, dev);
        }
        let h = self
            .agent
            .prepare_xfer_dlist(agent, &list, None)
            .map_err(|e| nixl_error("prepXferDlist", e))?;
        Ok(Prepped(h))
    }

    /// Makes a READ request from prepared lists and index lists (the descriptor cache).
    pub(crate) fn make_read(
        &self,
        local: &Prepped,
        local_ix: &[i32],
        remote: &Prepped,
        remote_ix: &[i32],
    ) -> Result<Request> {
        self.agent
            .make_xfer_req(XferOp::Read, &local.0, local_ix, &remote.0, remote_ix, None)
            .map(|r| Request(Some(r)))
            .map_err(|e| nixl_error("makeXferReq", e))
    }

    /// Posts a request; `Ok(true)` while it is in flight, `Ok(false)` when already complete.
    pub(crate) fn post(&self, req: &Request) -> std::result::Result<bool, NixlError> {
        self.agent.post_xfer_req(req.get()?, None)
    }

    /// Polls a posted request (this also drives NIXL's progress); `Ok(true)` when complete.
    pub(crate) fn done(&self, req: &Request) -> std::result::Result<bool, NixlError> {
        self.agent
            .get_xfer_status(req.get()?)
            .map(|s| s == XferStatus::Success)
    }
}

/// A registration; dropping it deregisters, never panicking.
pub(crate) struct Reg(Option<RegistrationHandle>);

impl Drop for Reg {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            // nixl-sys' handle unwraps internally (lock poisoning, allocation): keep any such
            // panic out of our Drop.
            if catch_unwind(AssertUnwindSafe(|| drop(h))).is_err() {
                tracing::warn!("nixl deregistration panicked; the region stays registered");
            }
        }
    }
}

/// A prepared descriptor list (`nixlDlistH`), released on drop.
pub(crate) struct Prepped(XferDlistHandle);

// SAFETY: the handle is an opaque pointer into its agent's state. It is only passed back to
// that agent's calls, which NIXL serialises (ThreadSync::Strict), and released once, in Drop;
// nothing in it is tied to the thread that created it.
unsafe impl Send for Prepped {}
// SAFETY: shared access only reads the pointer to pass it to NIXL calls, serialised as above.
unsafe impl Sync for Prepped {}

/// A transfer request (`nixlXferReqH`), released on drop. NIXL releases a request in
/// progress without stopping its reads, so only drop one that has been seen to end (see
/// `crate::xfer` and `crate::quarantine`).
pub(crate) struct Request(Option<XferRequest>);

impl Request {
    fn get(&self) -> std::result::Result<&XferRequest, NixlError> {
        // Only `Drop` empties it.
        self.0.as_ref().ok_or(NixlError::InvalidParam)
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(r) = self.0.take() {
            // nixl-sys releases in its own Drop and unwraps a lock there: keep any panic out
            // of ours.
            if catch_unwind(AssertUnwindSafe(|| drop(r))).is_err() {
                tracing::warn!("nixl request release panicked");
            }
        }
    }
}
