#![doc = include_str!("../README.md")]

mod fabric;
mod meta;
mod options;
mod posted;
mod transport;
mod work;

#[cfg(test)]
mod tests;

use reshard_core::config::TransportConfig;
use reshard_core::registry::{Registry, TransportFactory};
use reshard_core::{Result, Transport};
use std::sync::Arc;

pub use fabric::LoopbackFabric;
pub use options::default_workers;
pub use transport::LoopbackTransport;

/// Scheme of this backend (`transport.kind`, [`Transport::name`], error context).
pub const SCHEME: &str = "loopback";

/// Decodes loopback peer metadata (what [`Transport::load_peer`] is given) from untrusted bytes
/// and returns its canonical encoding (regions ascending by id); any defect is a typed
/// [`reshard_core::ErrorKind::Decode`] error, never a panic. For fuzzing and inspection tools.
pub fn decode_metadata(bytes: &[u8]) -> Result<bytes::Bytes> {
    meta::AgentMeta::decode(bytes).map(|m| m.encode())
}

/// Creates loopback agents on one shared fabric for the transport registry.
#[derive(Debug, Clone, Default)]
pub struct LoopbackFactory {
    fabric: LoopbackFabric,
}

impl LoopbackFactory {
    /// A factory whose agents all attach to `fabric`.
    pub fn new(fabric: LoopbackFabric) -> Self {
        LoopbackFactory { fabric }
    }

    /// The fabric new agents attach to.
    pub fn fabric(&self) -> &LoopbackFabric {
        &self.fabric
    }
}

/// Adds this backend to `registry` with a fabric of its own: every loopback endpoint the
/// registry creates can reach the others (the one line a registry needs for it).
pub fn register(registry: &mut Registry) {
    registry.register(Box::new(LoopbackFactory::new(LoopbackFabric::new())));
}

impl TransportFactory for LoopbackFactory {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>> {
        let workers = config.workers.unwrap_or_else(default_workers);
        Ok(Arc::new(LoopbackTransport::new(
            &self.fabric,
            agent,
            workers,
        )?))
    }
}
