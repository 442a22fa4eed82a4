#![doc = include_str!("../README.md")]

mod alloc;
mod engine;
mod meta;
mod options;
mod raw;
mod transport;
pub mod ucs_log;

use reshard_core::config::TransportConfig;
use reshard_core::registry::{Registry, TransportFactory};
use reshard_core::{Result, Transport};
use std::sync::Arc;

pub use alloc::UcxHostMemory;
pub use options::{
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

/// Decodes ucx peer metadata (what [`Transport::load_peer`] is given) from untrusted bytes and
/// returns its canonical encoding (regions ascending by id); any defect is a typed
/// [`reshard_core::ErrorKind::Decode`] error, never a panic. Needs no UCX runtime. For fuzzing
/// and inspection tools.
pub fn decode_metadata(bytes: &[u8]) -> Result<bytes::Bytes> {
    meta::EndpointMeta::decode(bytes).map(|m| m.encode())
}

/// Metadata as a real UCX endpoint exports it: an agent name, an opaque worker address, and
/// three regions (DRAM inside a larger UCX allocation, an empty one without a key, VRAM that is
/// its own key's whole range), written by this backend's own encoder. The seed of the fuzz
/// corpus (`fuzz/corpus/ucx_metadata/seed-three-regions`) and a fixture for tools.
pub fn example_metadata() -> bytes::Bytes {
    use meta::{EndpointMeta, RegionMeta};
    use reshard_core::MemoryKind;
    EndpointMeta {
        agent: "publisher-3".into(),
        incarnation: 0x5eed_0003,
        worker_address: (0..61u8).map(|i| i.wrapping_mul(37)).collect(),
        regions: vec![
            RegionMeta {
                id: 1,
                base: 0x7f00_0000_1000,
                len: 4096,
                key_base: 0x7f00_0000_0000,
                key_len: 0x10_0000,
                kind: MemoryKind::Dram,
                rkey: vec![0x11; 24],
            },
            RegionMeta {
                id: 2,
                base: 0,
                len: 0,
                key_base: 0,
                key_len: 0,
                kind: MemoryKind::Dram,
                rkey: vec![],
            },
            RegionMeta {
                id: 3,
                base: 0x2000,
                len: 64,
                key_base: 0x2000,
                key_len: 64,
                kind: MemoryKind::Vram { device: 1 },
                rkey: vec![0x22; 16],
            },
        ],
    }
    .encode()
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
