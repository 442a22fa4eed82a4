//! The shared conformance suite over cma endpoints, from one call of
//! `reshard_conformance::suite!`: in this process (reads of this process's own memory through
//! the kernel), the counting family, and with the publishers in a child process.

use std::sync::Arc;

use reshard_backend_cma::{CmaOptions, CmaTransport};
use reshard_conformance::counting::{at, Counting, SkipAt, SkipRead};
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

/// The endpoint of the tests that stop or kill the publishers' process: a 2 s no-progress
/// bound. A stopped publisher does not stall cma reads (the kernel copies from its pages
/// without its help), so the stalled check installs; a killed one fails the read.
fn stall_endpoint(agent: &str) -> Result<Arc<dyn Transport>> {
    let options = CmaOptions {
        workers: 2,
        timeout_ms: 2_000,
        ..CmaOptions::default()
    };
    Ok(Arc::new(CmaTransport::new(agent, options)?) as Arc<dyn Transport>)
}

/// Calls of at most 256 KiB and 4 iovecs per side: the five reads below share calls, and the
/// 1 MiB read is cut into four.
fn counting_options() -> CmaOptions {
    CmaOptions {
        workers: 2,
        piece_bytes: 256 << 10,
        iovecs_per_call: 4,
        ..CmaOptions::default()
    }
}

/// The counting family's endpoints, with their skip hook (the `fault-injection` feature, which
/// only this crate's dev-dependency on itself enables).
fn counting() -> Counting {
    let harness = Harness::new("cma", |agent| {
        Ok(Arc::new(CmaTransport::new(agent, counting_options())?) as Arc<dyn Transport>)
    });
    let endpoint = |agent: &str| {
        let t = Arc::new(CmaTransport::new(agent, counting_options())?);
        let skip = t.clone();
        let skip: SkipRead = Arc::new(move |read| skip.inject_skip_read(read));
        Ok((t as Arc<dyn Transport>, skip))
    };
    Counting {
        reads: vec![
            at(0, 100, 0, 0, 1000),
            at(1, 0, 0, 4096, 3000),
            at(2, 7, 1, 0, 5000),
            at(3, 20_000, 1, 8192, 7000),
            at(0, 30_000, 1, 20_000, 300_000),
        ],
        split_read: Some(at(1, 0, 0, 0, 1 << 20)),
        // Two reads per owner, under 256 KiB and 4 iovecs per call: each read is one segment
        // of one call, hashed as that call's blocks land.
        hashed_reads: Some(vec![
            at(0, 100, 0, 0, 1000),
            at(1, 0, 0, 4096, 100_000),
            at(2, 7, 1, 0, 5000),
            at(3, 20_000, 1, 8192, 150_000),
        ]),
        ..Counting::new(harness, endpoint, SkipAt::Post)
    }
}

reshard_conformance::suite! {
    harness = harness(),
    requires = reshard_backend_cma::probe(),
    counting = counting(),
    cross_process = endpoint,
    stall = stall_endpoint,
}
