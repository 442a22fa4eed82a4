//! The shared conformance suite over NIXL agents, one `reshard_conformance::suite!` call per
//! configuration: default options (every family, the publishers also in a child process, and
//! the in-process quiescence tests rerun over TCP in a child process) and two lanes (module
//! `lanes`).

use std::sync::Arc;

use reshard_backend_nixl::{NixlOptions, NixlTransport};
use reshard_conformance::counting::{at, Counting, SkipAt, SkipRead};
use reshard_conformance::Harness;
use reshard_core::Transport;

const MIB: u64 = 1 << 20;

/// A NIXL endpoint with default options (the UCX plugin).
fn endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
    Ok(Arc::new(NixlTransport::new(agent, &NixlOptions::default())?) as Arc<dyn Transport>)
}

fn harness() -> Harness {
    Harness::new("nixl", endpoint)
}

/// The endpoint of the in-flight safety tests that kill or stop the publishers' process: a 2 s
/// no-progress bound. In this process they run over NIXL's default transports (shared memory,
/// which a stopped publisher does not stall); `quiescence_over_tcp` runs them again with every
/// read crossing TCP, where stopping the publisher stalls its reads.
fn stall_endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
    let options = NixlOptions {
        timeout_ms: 2_000,
        ..NixlOptions::default()
    };
    Ok(Arc::new(NixlTransport::new(agent, &options)?) as Arc<dyn Transport>)
}

/// The counting family's endpoints, with their skip hook (the `fault-injection` feature, which
/// only this crate's dev-dependency on itself enables). Owners 4 and 9 with two regions each
/// (owner 4's first one 72 MiB, so its reads need two 64 MiB-capped requests), one receiver
/// with two regions. Six reads: two large ones of owner 4 (one request each: together they
/// exceed 64 MiB) and small ones of both owners sharing requests. NIXL applies an injected skip
/// when it builds requests, at prepare.
fn counting() -> Counting {
    let harness = Harness::new("nixl", |agent| {
        Ok(Arc::new(NixlTransport::new(agent, &NixlOptions::default())?) as Arc<dyn Transport>)
    });
    let endpoint = |agent: &str| {
        let t = Arc::new(NixlTransport::new(agent, &NixlOptions::default())?);
        let skip = t.clone();
        let skip: SkipRead = Arc::new(move |read| skip.inject_skip_read(read));
        Ok((t as Arc<dyn Transport>, skip))
    };
    Counting {
        src_lens: [[72 * MIB, MIB], [MIB, MIB]],
        dst_lens: [72 * MIB, MIB],
        reads: vec![
            at(0, 100, 0, 0, 40 * MIB),
            at(0, 40 * MIB + 200, 0, 40 * MIB, 30 * MIB),
            at(1, 0, 1, 0, 3000),
            at(2, 7, 1, 4096, 5000),
            at(3, 20_000, 1, 16_384, 7000),
            at(1, 30_000, 1, 65_536, 11_000),
        ],
        ..Counting::new(harness, endpoint, SkipAt::Prepare)
    }
}

// In one process NIXL's UCX moves a whole batch inside `post` (shared memory), leaving nothing
// in flight to end; over TCP the reads stay in flight, so `quiescence_over_tcp` reruns the
// in-process quiescence tests (and abort, and the stall family) there, in a child process.
reshard_conformance::suite! {
    harness = harness(),
    requires = reshard_backend_nixl::probe(),
    counting = counting(),
    cross_process = endpoint,
    stall = stall_endpoint,
    quiescence_in_child = (quiescence_over_tcp, env = [("UCX_TLS", "tcp")]),
}

/// The suite again with two lanes (NIXL agents) per endpoint, so every lane posts, polls,
/// aborts, drains and quarantines: the checks, the fault property, the quiescence family (also
/// run over TCP by `quiescence_over_tcp`, whose filter matches these names too) and the
/// cross-process quiescence checks that kill or stop the publishers. Not the cross-process
/// family: with two lanes on every endpoint its `two_receivers_refit_concurrently` stalled once
/// in two full runs (a known defect of lanes > 1, which is why the default is one lane:
/// backends/nixl/README.md, "Lanes").
mod lanes {
    use super::*;

    fn endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
        let options = NixlOptions {
            lanes: 2,
            experimental_lanes: true,
            ..NixlOptions::default()
        };
        Ok(Arc::new(NixlTransport::new(agent, &options)?) as Arc<dyn Transport>)
    }

    fn harness() -> Harness {
        Harness::new("nixl", endpoint)
    }

    fn stall_endpoint(agent: &str) -> reshard_core::Result<Arc<dyn Transport>> {
        let options = NixlOptions {
            timeout_ms: 2_000,
            lanes: 2,
            experimental_lanes: true,
            ..NixlOptions::default()
        };
        Ok(Arc::new(NixlTransport::new(agent, &options)?) as Arc<dyn Transport>)
    }

    reshard_conformance::suite! {
        harness = harness(),
        requires = reshard_backend_nixl::probe(),
        stall = stall_endpoint,
        families = [checks, fault, quiescence, stall],
    }
}
