//! The receiver's install-side stages on a scaled-down loopback rig (`reshard_benches::
//! LoopbackRig`: Qwen3-30B-A3B at 4 layers / 32 experts, EP8/DP8 publishers -> TP2 rank 0):
//!
//! - `descriptor_build_<rig>`: `Receiver::prepare` on unchanged tables (the per-update front:
//!   step and geometry checks, replica digest check, plan reuse, descriptors) with the
//!   descriptor cache on (`cached`: both banks' prepared batches reused) and off (`uncached`:
//!   the bank's batch rebuilt and `Transport::prepare`d every call, the baseline arm), with the
//!   plan's reads as element throughput. The runtime builds descriptors only inside that front,
//!   so `Receiver::prepare` is the smallest public unit that contains the build; the difference
//!   of the two rows is the build itself, and the `descriptor_build` stage time the receiver
//!   reports is printed next to them (the figure `reshard-report` gives).
//! - `reslice_<rig>`: the re-slice of full pulls out of staging into the parameters, batched
//!   (one parallel pass over parameters) and per copy (one copy at a time, the baseline), with
//!   the re-sliced bytes as throughput. The runtime only re-slices inside a whole update, so
//!   each iteration runs `Receiver::update` (digest verification off: it does not touch the
//!   re-slice) and criterion is given the receiver's own `reslice` stage time, not the update's
//!   wall time (`iter_custom`).
//!
//! `cargo bench -p reshard-benches --bench install`

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use reshard_benches::LoopbackRig;
use reshard_core::median;
use reshard_planner::presets::preset;
use reshard_runtime::ReceiverOptions;

/// Rig scale: large enough to have hundreds of full-pull re-slices, small enough that one
/// update takes well under a second on 2 cores.
const LAYERS: u64 = 4;
const EXPERTS: u64 = 32;
const RIG: &str = "qwen3_30b_a3b_4l32e_ep8dp8_tp2r0";

fn options(batched_reslice: bool, cache_descriptors: bool) -> ReceiverOptions {
    ReceiverOptions {
        batched_reslice,
        cache_descriptors,
        // Verification neither reads nor writes what these benches time; off, each update is
        // shorter and the run is faster.
        verify_digests: false,
        // The re-slice as a stage of its own (as the landed bytes come in it has none).
        verify_while_landing: false,
        ..ReceiverOptions::default()
    }
}

fn install(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let model = preset("qwen3-30b-a3b")
        .and_then(|m| m.with_overrides(Some(LAYERS), Some(EXPERTS), None))
        .expect("scaled preset");
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut rig = rt
        .block_on(LoopbackRig::new(
            model,
            "ep=8,dp=8",
            2,
            workers,
            options(true, true),
        ))
        .expect("loopback rig");
    let tables = rig.cluster.tables();
    // Warm-up: plan, register, build both banks' descriptors, first touch of every page.
    for _ in 0..2 {
        rt.block_on(rig.receiver.update(&tables)).expect("update");
    }
    let plan = rig.receiver.plan().expect("prepared plan").clone();
    let reslice_bytes: u64 = plan.reslices.iter().map(|r| r.bytes()).sum();
    eprintln!(
        "rig {RIG}: {} reads, {} wire bytes, {} re-slices of {} bytes",
        plan.stats.reads,
        plan.stats.wire_bytes,
        plan.reslices.len(),
        reslice_bytes
    );

    let mut g = c.benchmark_group(format!("descriptor_build_{RIG}"));
    g.throughput(Throughput::Elements(plan.stats.reads));
    for (name, cache) in [("cached", true), ("uncached", false)] {
        rig.receiver.set_options(options(true, cache));
        let mut stage = Vec::new();
        g.bench_function(name, |b| {
            b.iter(|| {
                let st = rt.block_on(rig.receiver.prepare(&tables)).expect("prepare");
                stage.push(st.descriptor_build);
            })
        });
        let calls = stage.len();
        eprintln!(
            "descriptor_build stage, {name}: median {:.1} us over {calls} calls",
            median(stage) * 1e6,
        );
    }
    g.finish();

    let mut g = c.benchmark_group(format!("reslice_{RIG}"));
    g.throughput(Throughput::Bytes(reslice_bytes));
    // Each iteration is a whole update of tens of milliseconds.
    g.sampling_mode(SamplingMode::Flat);
    for (name, batched) in [("batched", true), ("per_copy", false)] {
        rig.receiver.set_options(options(batched, true));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| {
                        let r = rt.block_on(rig.receiver.update(&tables)).expect("update");
                        Duration::from_secs_f64(r.stages.reslice)
                    })
                    .sum()
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    // Few samples and short windows: the whole file runs in a minute or two on 2 cores.
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = install
}
criterion_main!(benches);
