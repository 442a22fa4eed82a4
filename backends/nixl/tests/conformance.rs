//! The shared conformance suite over NIXL agents in one process: one test per check.

use std::sync::Arc;

use reshard_backend_nixl::{NixlOptions, NixlTransport};
use reshard_conformance::Harness;
use reshard_core::Transport;

/// A NIXL endpoint with default options (the UCX plugin).
fn endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
    Ok(Arc::new(NixlTransport::new(agent, &NixlOptions::default())?) as Arc<dyn Transport>)
}

fn harness() -> Harness {
    Harness::new("nixl", endpoint)
}

reshard_conformance::conformance_tests!(harness(), requires = reshard_backend_nixl::probe());

/// The same suite with every cluster's publishers in a child process (this test binary
/// re-executed), reached over NIXL between processes.
mod cross_process {
    reshard_conformance::cross_process_conformance_tests!(
        "nixl",
        super::endpoint,
        requires = reshard_backend_nixl::probe()
    );
}

reshard_conformance::fault_tests!(harness(), requires = reshard_backend_nixl::probe());

reshard_conformance::quiescence_tests!(harness(), requires = reshard_backend_nixl::probe());

// In one process NIXL's UCX moves a whole batch inside `post` (shared memory), leaving nothing
// in flight to end; over TCP the reads stay in flight, so the same tests run there too.
reshard_conformance::quiescence_tests_in_child!(
    quiescence_over_tcp,
    "nixl",
    env = [("UCX_TLS", "tcp")],
    requires = reshard_backend_nixl::probe()
);

/// The in-flight safety tests that kill or stop the publishers' process, with a 2 s
/// no-progress bound. In this process they run over NIXL's default transports (shared memory,
/// which a stopped publisher does not stall); `quiescence_over_tcp` runs them again with every
/// read crossing TCP, where stopping the publisher stalls its reads.
mod stall {
    use super::*;

    fn endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
        let options = NixlOptions {
            timeout_ms: 2_000,
            ..NixlOptions::default()
        };
        Ok(Arc::new(NixlTransport::new(agent, &options)?) as Arc<dyn Transport>)
    }

    reshard_conformance::cross_process_quiescence_tests!(
        "nixl",
        endpoint,
        requires = reshard_backend_nixl::probe()
    );
}

/// The suite again with three lanes (NIXL agents) per endpoint, so every lane posts, polls,
/// aborts, drains and quarantines: the checks, the fault property, the quiescence family (also
/// run over TCP by `quiescence_over_tcp`, whose filter matches these names too) and the
/// cross-process quiescence checks that kill or stop the publishers.
mod lanes {
    use super::*;

    fn endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
        let options = NixlOptions {
            lanes: 3,
            ..NixlOptions::default()
        };
        Ok(Arc::new(NixlTransport::new(agent, &options)?) as Arc<dyn Transport>)
    }

    fn harness() -> Harness {
        Harness::new("nixl", endpoint)
    }

    reshard_conformance::conformance_tests!(harness(), requires = reshard_backend_nixl::probe());

    reshard_conformance::fault_tests!(harness(), requires = reshard_backend_nixl::probe());

    reshard_conformance::quiescence_tests!(harness(), requires = reshard_backend_nixl::probe());

    mod stall {
        use super::*;

        fn endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
            let options = NixlOptions {
                timeout_ms: 2_000,
                lanes: 3,
                ..NixlOptions::default()
            };
            Ok(Arc::new(NixlTransport::new(agent, &options)?) as Arc<dyn Transport>)
        }

        reshard_conformance::cross_process_quiescence_tests!(
            "nixl",
            endpoint,
            requires = reshard_backend_nixl::probe()
        );
    }
}
