//! The shared conformance suite, run over the loopback backend: one test per check.

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_conformance::Harness;
use reshard_core::Transport;

fn harness() -> Harness {
    let fabric = LoopbackFabric::new();
    Harness::new("loopback", move |agent| {
        Ok(Arc::new(LoopbackTransport::new(&fabric, agent, 2)?) as Arc<dyn Transport>)
    })
}

reshard_conformance::conformance_tests!(harness());

reshard_conformance::fault_tests!(harness());

reshard_conformance::quiescence_tests!(harness());
