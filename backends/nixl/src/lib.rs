#![doc = include_str!("../README.md")]

mod agent;
mod meta;
mod options;
mod quarantine;
pub mod runtime;
mod transport;
mod xfer;

use reshard_core::config::{backend_options, TransportConfig};
use reshard_core::registry::{Registry, TransportFactory};
use reshard_core::{Result, Transport};
use std::sync::{Arc, OnceLock};

pub use options::NixlOptions;
pub use transport::{LaneStats, NixlTransport, PreparedStats};

/// Scheme of this backend (`transport.kind`, [`Transport::name`], error context).
pub const SCHEME: &str = "nixl";

/// Decodes nixl peer metadata (what `load_peer` is given) from untrusted bytes, checksum
/// included, and returns its canonical encoding (regions ascending by id); any defect is a
/// typed [`reshard_core::ErrorKind::Decode`] error, never a panic. Needs no NIXL runtime: for
/// fuzzing and inspection tools.
pub fn decode_metadata(bytes: &[u8]) -> Result<bytes::Bytes> {
    meta::AgentMeta::decode(bytes).map(|m| m.encode())
}

/// Whether NIXL is usable here: the runtime loads and its UCX plugin creates a backend on a
/// throw-away agent. Checked once per process; a missing runtime is `Unavailable`, never an
/// abort.
pub fn probe() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), (reshard_core::ErrorKind, String)>> =
        OnceLock::new();
    let r = PROBE.get_or_init(|| {
        runtime::ensure(None)
            .and_then(|_| NixlTransport::new("reshard-probe", &NixlOptions::default()))
            .map(drop)
            .map_err(|e| (e.kind(), e.message().to_string()))
    });
    r.clone()
        .map_err(|(kind, msg)| reshard_core::Error::new(kind, msg).with_backend(SCHEME))
}

/// Creates NIXL endpoints for the transport registry from `[backends.nixl]` options.
#[derive(Debug, Clone, Default)]
pub struct NixlFactory;

impl NixlFactory {
    /// A factory; each endpoint it creates is its own NIXL agent.
    pub fn new() -> Self {
        NixlFactory
    }
}

/// Adds this backend to `registry` (the one line a registry needs for it).
pub fn register(registry: &mut Registry) {
    registry.register(Box::new(NixlFactory::new()));
}

impl TransportFactory for NixlFactory {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn probe(&self) -> Result<()> {
        probe()
    }

    fn env_vars(&self) -> &'static [&'static str] {
        &[runtime::HOME_ENV]
    }

    fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>> {
        let options: NixlOptions = backend_options(config)?;
        Ok(Arc::new(NixlTransport::new(agent, &options)?))
    }
}
