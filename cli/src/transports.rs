//! The one place that lists backends: one line per transport crate.

use reshard_backend_loopback::{LoopbackFabric, LoopbackFactory};
use reshard_backend_nixl::NixlFactory;
use reshard_backend_ucx::UcxFactory;
use reshard_core::registry::Registry;

/// Every transport built into this binary. The loopback fabric is this process's "network".
pub fn registry() -> Registry {
    Registry::new()
        .with(LoopbackFactory::new(LoopbackFabric::new()))
        .with(NixlFactory::new())
        .with(UcxFactory::new())
}
