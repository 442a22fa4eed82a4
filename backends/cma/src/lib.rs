#![doc = include_str!("../README.md")]

mod meta;
mod options;
mod peer;
mod plan;
mod run;
mod sys;
mod transport;

use reshard_core::config::{backend_options, TransportConfig};
use reshard_core::registry::{Registry, TransportFactory};
use reshard_core::{Error, ErrorKind, Result, Transport};
use std::sync::{Arc, OnceLock};

pub use options::CmaOptions;
pub use transport::CmaTransport;

/// Scheme of this backend (`transport.kind`, [`Transport::name`], error context).
pub const SCHEME: &str = "cma";

/// Decodes cma peer metadata (what [`Transport::load_peer`] is given) from untrusted bytes and
/// returns its canonical encoding (regions ascending by id); any defect is a typed
/// [`ErrorKind::Decode`] error, never a panic. For fuzzing and inspection tools.
pub fn decode_metadata(bytes: &[u8]) -> Result<bytes::Bytes> {
    meta::Meta::decode(bytes).map(|m| m.encode())
}

/// Whether cross-memory attach works here: this process reads 8 bytes of its own memory with
/// `process_vm_readv`. Checked once per process; a kernel without it or a seccomp filter that
/// forbids it is `Unsupported`.
pub fn probe() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            sys::read_self().map_err(|e| {
                let why = match e.raw_os_error() {
                    Some(libc::ENOSYS) => "the kernel has no cross-memory attach \
                                           (CONFIG_CROSS_MEMORY_ATTACH)"
                        .to_string(),
                    Some(libc::EPERM) => "process_vm_readv is forbidden here (a seccomp \
                                          profile, e.g. a container without CAP_SYS_PTRACE)"
                        .to_string(),
                    _ => format!("process_vm_readv of this process failed: {e}"),
                };
                format!("cma unavailable: {why}")
            })
        })
        .clone()
        .map_err(|msg| Error::new(ErrorKind::Unsupported, msg).with_backend(SCHEME))
}

/// Creates cma endpoints for the transport registry from `[backends.cma]` options.
#[derive(Debug, Clone, Default)]
pub struct CmaFactory;

impl CmaFactory {
    /// A factory; each endpoint it creates is its own set of copy threads in this process.
    pub fn new() -> Self {
        CmaFactory
    }
}

impl TransportFactory for CmaFactory {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn probe(&self) -> Result<()> {
        probe()
    }

    fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>> {
        let mut options: CmaOptions = backend_options(config)?;
        if let Some(w) = config.workers {
            options.workers = w;
        }
        Ok(Arc::new(CmaTransport::new(agent, options)?))
    }
}

/// Adds the cma factory to `registry`.
pub fn register(registry: &mut Registry) {
    registry.register(Box::new(CmaFactory));
}

#[cfg(test)]
mod tests;
