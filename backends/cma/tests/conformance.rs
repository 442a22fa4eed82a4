//! The shared conformance suite over cma endpoints: in this process (reads of this process's
//! own memory through the kernel) and with the publishers in a child process.

use std::sync::Arc;

use reshard_backend_cma::{CmaOptions, CmaTransport};
use reshard_conformance::Harness;
use reshard_core::{Result, Transport};

/// An endpoint with two copy threads and otherwise default options.
fn endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
    let options = CmaOptions {
        workers: 2,
        ..CmaOptions::default()
    };
    Ok(Arc::new(CmaTransport::new(agent, options)?) as Arc<dyn Transport>)
}

fn harness() -> Harness {
    Harness::new("cma", endpoint)
}

reshard_conformance::conformance_tests!(harness(), requires = reshard_backend_cma::probe());

reshard_conformance::fault_tests!(harness(), requires = reshard_backend_cma::probe());

reshard_conformance::quiescence_tests!(harness(), requires = reshard_backend_cma::probe());

/// The suite with every cluster's publishers in a child process (this test binary re-executed),
/// so every read crosses a process boundary.
mod cross_process {
    reshard_conformance::cross_process_conformance_tests!(
        "cma",
        super::endpoint,
        requires = reshard_backend_cma::probe()
    );
}

/// The in-flight safety tests that stop or kill the publishers' process, with a 2 s
/// no-progress bound. A stopped publisher does not stall cma reads (the kernel copies from its
/// pages without its help), so the stalled check installs; a killed one fails the read.
mod stall {
    use super::*;

    fn endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
        let options = CmaOptions {
            workers: 2,
            timeout_ms: 2_000,
            ..CmaOptions::default()
        };
        Ok(Arc::new(CmaTransport::new(agent, options)?) as Arc<dyn Transport>)
    }

    reshard_conformance::cross_process_quiescence_tests!(
        "cma",
        endpoint,
        requires = reshard_backend_cma::probe()
    );
}
