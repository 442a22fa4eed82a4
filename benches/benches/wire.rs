//! The wire leg of every backend available here, both endpoints in this process: a publisher
//! endpoint holding one registered 256 MiB block and a receiver endpoint connected to it by
//! exported and loaded metadata, as a receiver connects to its publishers.
//!
//! Groups, one per batch shape (`wire_large_64x4MiB`, `wire_small_65536x4KiB`), byte
//! throughput:
//! - `memcpy`: one thread copying the same bytes between two resident buffers (the reference);
//! - `<backend>`: post of a prepared (cached) batch + wait, what every update pays;
//! - `<backend>_with_prepare`: prepare + post + wait, what an update pays when descriptors are
//!   rebuilt every time (the baseline arm).
//!
//! Groups `prepare_<shape>` time the descriptor build alone (`Transport::prepare`), with the
//! reads built per second as element throughput.
//!
//! Backends come from the transport registry (`reshard::registry`), each with its
//! default options. `loopback` always runs; the others run when the conformance suite's probe
//! (`reshard_conformance::backend_available`) finds their runtime, and are skipped with a
//! `SKIPPED:` line otherwise (unless `RESHARD_REQUIRE_BACKENDS` names them, which fails as in
//! the tests). The ucx publisher block comes from `allocate_host`, as the synthetic publishers'
//! arena does: that is UCX's shared-memory path. Every backend and shape is checked byte-exact
//! once before it is timed.
//!
//! `cargo bench -p reshard-benches --bench wire`

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use std::sync::Arc;
use std::time::Duration;

use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, Criterion, SamplingMode, Throughput,
};
use reshard_benches::wire::{Memcpy, Shape, WirePair, LARGE, SMALL};
use reshard_core::{Result, Transport};
use tokio::runtime::Runtime;

const SHAPES: [Shape; 2] = [LARGE, SMALL];

/// Makes an endpoint of one backend by agent name.
type MakeEndpoint = Box<dyn Fn(&str) -> Result<Arc<dyn Transport>>>;

/// A backend under test: its scheme, whether its runtime is usable here, and its endpoints.
struct Backend {
    name: &'static str,
    probe: Result<()>,
    make: MakeEndpoint,
}

/// Every backend the registry has, with its default options (the registry's loopback fabric
/// is shared by the endpoints it makes).
fn backends() -> Vec<Backend> {
    let registry = Arc::new(reshard::registry());
    registry
        .schemes()
        .into_iter()
        .map(|name| {
            let r = Arc::clone(&registry);
            Backend {
                name,
                probe: registry.probe(name),
                make: Box::new(move |agent| r.create_default(name, agent)),
            }
        })
        .collect()
}

/// Publisher and receiver endpoints of `backend`, connected, with `len` registered bytes each.
fn pair(rt: &Runtime, backend: &Backend, len: usize) -> Result<WirePair> {
    let publisher = (backend.make)("wire-publisher")?;
    let receiver = (backend.make)("wire-receiver")?;
    rt.block_on(WirePair::connect(publisher, receiver, len))
}

/// A group for one shape: every row of it moves `bytes` bytes (or builds `reads` descriptors).
fn group<'a>(
    c: &'a mut Criterion,
    prefix: &str,
    shape: Shape,
    throughput: Throughput,
) -> BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(format!("{prefix}_{}", shape.id()));
    g.throughput(throughput);
    // An iteration takes tens of milliseconds: flat sampling keeps the iteration count (and
    // the run time) proportional to the measurement time instead of growing with the sample.
    g.sampling_mode(SamplingMode::Flat);
    g
}

fn wire(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let len = SHAPES.iter().map(Shape::bytes).max().unwrap_or(0);
    let len = usize::try_from(len).expect("shapes fit in memory");

    for shape in SHAPES {
        let mut m = Memcpy::new(usize::try_from(shape.bytes()).expect("shape fits in memory"));
        let mut g = group(c, "wire", shape, Throughput::Bytes(shape.bytes()));
        g.bench_function("memcpy", |b| b.iter(|| m.run()));
        g.finish();
    }

    for mut backend in backends() {
        let probe = std::mem::replace(&mut backend.probe, Ok(()));
        if !reshard_conformance::backend_available(backend.name, probe) {
            continue;
        }
        // One backend at a time: its endpoints (and progress threads) are gone before the next.
        let pair = match pair(&rt, &backend, len) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("SKIPPED: backend {}: set-up failed: {e}", backend.name);
                continue;
            }
        };
        eprintln!(
            "{}: publisher block from {} ({} bytes)",
            backend.name,
            if pair.src_from_backend() {
                "the backend's allocate_host"
            } else {
                "a HostBuffer"
            },
            len
        );
        for shape in SHAPES {
            rt.block_on(pair.verify(shape))
                .unwrap_or_else(|e| panic!("{} {}: not byte-exact: {e}", backend.name, shape.id()));
            let prepared = rt.block_on(pair.prepare(shape)).expect("prepare");

            let mut g = group(c, "wire", shape, Throughput::Bytes(shape.bytes()));
            g.bench_function(backend.name, |b| {
                b.iter(|| {
                    rt.block_on(pair.post_and_wait(&prepared))
                        .expect("wire leg")
                })
            });
            g.bench_function(format!("{}_with_prepare", backend.name), |b| {
                b.iter(|| {
                    rt.block_on(async {
                        let p = pair.prepare(shape).await?;
                        pair.post_and_wait(&p).await
                    })
                    .expect("prepare and wire leg")
                })
            });
            g.finish();

            let mut g = group(c, "prepare", shape, Throughput::Elements(shape.reads));
            g.bench_function(backend.name, |b| {
                b.iter(|| rt.block_on(pair.prepare(shape)).expect("prepare"))
            });
            g.finish();
        }
        drop(pair);
    }
}

criterion_group! {
    name = benches;
    // Few samples and short windows: the whole file runs in a few minutes on 2 cores.
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = wire
}
criterion_main!(benches);
