//! The shared conformance suite over UCX endpoints (each its own UCP context, worker and
//! progress thread): in this process with UCX's default transports and with TCP only, and
//! with the publishers in a child process.

use std::sync::Arc;

use reshard_backend_ucx::{UcxOptions, UcxTransport};
use reshard_conformance::Harness;
use reshard_core::{Result, Transport};

fn endpoint_with(agent: &str, options: UcxOptions) -> Result<Arc<dyn Transport>> {
    Ok(Arc::new(UcxTransport::new(agent, options)?) as Arc<dyn Transport>)
}

/// An endpoint with default options (UCX picks the transports).
fn endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
    endpoint_with(agent, UcxOptions::default())
}

fn harness() -> Harness {
    Harness::new("ucx", endpoint)
}

reshard_conformance::conformance_tests!(harness(), requires = reshard_backend_ucx::probe());

reshard_conformance::fault_tests!(harness(), requires = reshard_backend_ucx::probe());

reshard_conformance::quiescence_tests!(harness(), requires = reshard_backend_ucx::probe());

/// The same suite with `tls = "tcp"`: RMA reads emulated over TCP, which needs the
/// publisher's progress thread to answer them.
mod tcp {
    use super::*;

    fn harness() -> Harness {
        Harness::new("ucx", |agent| {
            endpoint_with(
                agent,
                UcxOptions {
                    tls: Some("tcp".into()),
                    ..UcxOptions::default()
                },
            )
        })
    }

    reshard_conformance::conformance_tests!(harness(), requires = reshard_backend_ucx::probe());

    reshard_conformance::quiescence_tests!(harness(), requires = reshard_backend_ucx::probe());
}

/// The suite with every cluster's publishers in a child process (this test binary re-executed),
/// so reads cross a process boundary.
mod cross_process {
    reshard_conformance::cross_process_conformance_tests!(
        "ucx",
        super::endpoint,
        requires = reshard_backend_ucx::probe()
    );
}

/// The in-flight safety tests that kill or stop the publishers' process, with every read
/// crossing TCP (so reads need the publisher's progress thread, and stopping it stalls them)
/// and a 2 s no-progress timeout.
mod cross_process_tcp {
    use super::*;

    fn endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
        endpoint_with(
            agent,
            UcxOptions {
                tls: Some("tcp".into()),
                timeout_ms: 2_000,
                ..UcxOptions::default()
            },
        )
    }

    reshard_conformance::cross_process_quiescence_tests!(
        "ucx",
        endpoint,
        requires = reshard_backend_ucx::probe()
    );
}
