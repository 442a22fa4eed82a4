#![doc = include_str!("../README.md")]

mod alloc;
mod config;
mod engine;
mod maps;
mod meta;
mod plan;
mod raw;
mod transport;
pub mod ucs_log;

use reshard_core::config::TransportConfig;
use reshard_core::registry::{Registry, TransportFactory};
use reshard_core::{Result, Transport};
use std::sync::Arc;

pub use alloc::UcxHostMemory;
pub use config::{
    UcxOptions, DEFAULT_PIECE_BYTES, DEFAULT_READS_IN_FLIGHT, DEFAULT_TIMEOUT_MS, MIN_PIECE_BYTES,
};
pub use raw::{UcxStatusError, LIBUCP};
pub use transport::UcxTransport;

/// Scheme of this backend (`transport.kind`, [`Transport::name`], error context).
pub const SCHEME: &str = "ucx";

/// Whether UCX is usable on this machine: loads libucp (once per process) and checks its
/// version; `Unavailable`, saying how to install it, when it cannot.
pub fn probe() -> Result<()> {
    raw::lib().map(|_| ())
}

/// `major.minor.release` of the loaded UCX library.
pub fn ucx_version() -> Result<(u32, u32, u32)> {
    raw::lib().map(|u| u.version)
}

/// Creates UCX endpoints for the transport registry from `[backends.ucx]` options.
#[derive(Debug, Clone, Default)]
pub struct UcxFactory;

impl UcxFactory {
    /// A factory; UCX itself is loaded when the first endpoint is created.
    pub fn new() -> Self {
        UcxFactory
    }
}

/// Adds this backend to `registry` (the one line a registry needs for it).
pub fn register(registry: &mut Registry) {
    registry.register(Box::new(UcxFactory::new()));
}

impl TransportFactory for UcxFactory {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn probe(&self) -> Result<()> {
        probe()
    }

    /// `transport.workers` is not used: each endpoint has one UCX worker driven by one
    /// progress thread, and the copies themselves are done by UCX's transports.
    fn create(&self, agent: &str, config: &TransportConfig) -> Result<Arc<dyn Transport>> {
        let options = UcxOptions::from_transport_config(config)?;
        Ok(Arc::new(UcxTransport::new(agent, options)?))
    }
}
