//! The shared conformance suite, run over the loopback backend: one call of
//! `reshard_conformance::suite!`, which emits every family loopback's declared capabilities
//! allow (loopback declares `cross_process = false`, so the cross-process families are one
//! `family_inapplicable` test each).

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_conformance::counting::{at, Counting, SkipAt, SkipRead};
use reshard_conformance::Harness;
use reshard_core::Transport;

fn harness() -> Harness {
    let fabric = LoopbackFabric::new();
    Harness::new("loopback", move |agent| {
        Ok(Arc::new(LoopbackTransport::new(&fabric, agent, 2)?) as Arc<dyn Transport>)
    })
}

/// Loopback endpoints on one fabric (two copy workers each), with their skip hook (the
/// `fault-injection` feature, which only this crate's dev-dependency on itself enables).
/// Regions of 1 MiB; five reads over every source and destination region, of distinct lengths;
/// a 1 MiB read is split between the two workers (two 512 KiB pieces).
fn counting() -> Counting {
    let fabric = LoopbackFabric::new();
    let f = fabric.clone();
    let harness = Harness::new("loopback", move |agent| {
        Ok(Arc::new(LoopbackTransport::new(&f, agent, 2)?) as Arc<dyn Transport>)
    });
    let endpoint = move |agent: &str| {
        let t = Arc::new(LoopbackTransport::new(&fabric, agent, 2)?);
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
            at(0, 30_000, 1, 20_000, 11_000),
        ],
        split_read: Some(at(1, 0, 0, 0, 1 << 20)),
        // Reads below 512 KiB stay whole with one worker; the 400 000-byte one is copied (and
        // hashed) in two blocks, with segments across the block boundary.
        hashed_reads: Some(vec![
            at(0, 100, 0, 0, 1000),
            at(2, 7, 1, 0, 5000),
            at(1, 3, 0, 8192, 400_000),
            at(3, 20_000, 1, 8192, 70_000),
        ]),
        ..Counting::new(harness, endpoint, SkipAt::Post)
    }
}

reshard_conformance::suite! {
    harness = harness(),
    counting = counting(),
}
