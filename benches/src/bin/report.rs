//! `reshard-report`: every BENCHMARKS.md figure measured in one run, printed as markdown (and
//! JSON with `--json`). Ratios compare arms measured in the same process, minutes apart at most.
//!
//! Usage: cargo run --release -p reshard-benches --bin reshard-report [-- --json]

use std::time::Instant;

use reshard_benches::{reference_geometry, time_plans, LoopbackRig};
use reshard_core::median;
use reshard_core::{dedup, merge, table_geometry_key, DedupOptions, ReplicaGroups, Result};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::plan::{plan, PlanOptions};
use reshard_planner::presets::preset;
use reshard_planner::topology::{geometry_tables, ReceiverTopology};
use reshard_runtime::ReceiverOptions;

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// XXH3-128 and BLAKE3 on one core: (xxh3, blake3) GB/s on `len` bytes, hashed `reps` times.
fn digest_figures(len: usize, reps: usize) -> (f64, f64) {
    let buf: Vec<u8> = (0..len as u64)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let run = |f: &dyn Fn(&[u8])| {
        median(
            (0..5)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..reps {
                        f(std::hint::black_box(&buf));
                    }
                    gbps((buf.len() * reps) as u64, t.elapsed().as_secs_f64())
                })
                .collect(),
        )
    };
    let xxh = run(&|b| {
        std::hint::black_box(twox_hash::XxHash3_128::oneshot(b));
    });
    let b3 = run(&|b| {
        std::hint::black_box(blake3::hash(b));
    });
    (xxh, b3)
}

fn plan_figures() -> Result<(f64, f64, f64, f64)> {
    let (table, layouts) = reference_geometry()?;
    time_plans(&table, &layouts)?;
    let dedup_s = median(
        (0..7)
            .map(|_| time_plans(&table, &layouts).unwrap_or(f64::NAN))
            .collect(),
    );
    let model = preset("qwen3-30b-a3b")?;
    let tables = geometry_tables(&model, &"ep=8,dp=8".parse()?, 0)?;
    let t = Instant::now();
    let merged = merge(&tables)?;
    let merge_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let deduped = dedup(&merged, DedupOptions::default())?;
    let dedup_s2 = t.elapsed().as_secs_f64();
    drop(deduped);
    let merge_dedup_s = merge_s + dedup_s2;
    // What a receiver does instead on a step with unchanged geometry.
    let groups = ReplicaGroups::of(&tables);
    let stable_s = median(
        (0..7)
            .map(|_| {
                let t = Instant::now();
                let keys: Vec<u64> = tables.iter().map(table_geometry_key).collect();
                std::hint::black_box(keys);
                let ok = groups.check(&tables).is_ok();
                std::hint::black_box(ok);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );
    let t = Instant::now();
    for r in 0..2 {
        let l = receiver_layout(&model, &ReceiverTopology::tp(2), r)?;
        std::hint::black_box(plan(
            &merged,
            &l,
            &PlanOptions {
                allow_overlap: true,
                ..PlanOptions::default()
            },
        )?);
    }
    let no_dedup_s = t.elapsed().as_secs_f64();
    Ok((dedup_s, merge_dedup_s, no_dedup_s, stable_s))
}

struct RigFigures {
    wire_bytes: u64,
    loopback_gbps: f64,
    memcpy_gbps: f64,
    reslice_batched_s: f64,
    reslice_per_copy_over_batched: f64,
    loopback_over_memcpy: f64,
    reslice_copies: usize,
    desc_cached_s: f64,
    desc_uncached_s: f64,
    reads: u64,
    e2e_s: f64,
    attribution: f64,
}

async fn rig_figures(layers: u64, experts: u64, updates: u64) -> Result<RigFigures> {
    let model = preset("qwen3-30b-a3b")?.with_overrides(Some(layers), Some(experts), None)?;
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let mut rig =
        LoopbackRig::new(model, "ep=8,dp=8", 2, workers, ReceiverOptions::default()).await?;
    let tables = rig.cluster.tables();
    // Warm-up: plan, register, first touch of every page.
    rig.receiver.update(&tables).await?;
    rig.receiver.update(&tables).await?;
    let mut wire = Vec::new();
    let mut e2e = Vec::new();
    let mut attr = Vec::new();
    let mut cached = Vec::new();
    let mut batched = Vec::new();
    let mut per_copy = Vec::new();
    let mut uncached = Vec::new();
    let mut memcpy = Vec::new();
    let mut ratio = Vec::new();
    let mut wire_bytes = 0;
    let mut reads = 0;
    // The plain memcpy baseline copies the same number of bytes, pages touched first.
    let bytes = rig.receiver.plan().map_or(0, |p| p.stats.wire_bytes) as usize;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    // Arms interleave within each iteration, so a noisy neighbour hits them alike; ratios are
    // taken per iteration, then the median.
    for _ in 0..updates {
        rig.receiver.set_options(ReceiverOptions::default());
        let r = rig.receiver.update(&tables).await?;
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        let m = t.elapsed().as_secs_f64();
        memcpy.push(m);
        ratio.push(m / r.stages.wire);
        wire.push(r.stages.wire);
        e2e.push(r.e2e_s);
        attr.push(r.attribution);
        cached.push(r.stages.descriptor_build);
        wire_bytes = r.wire_bytes;
        reads = r.plan.reads;
        // The batched re-slice as a stage of its own: by default it runs as the bytes land
        // and has none.
        rig.receiver.set_options(ReceiverOptions {
            verify_while_landing: false,
            ..ReceiverOptions::default()
        });
        let r = rig.receiver.update(&tables).await?;
        batched.push(r.stages.reslice);
        rig.receiver.set_options(ReceiverOptions {
            batched_reslice: false,
            cache_descriptors: false,
            ..ReceiverOptions::default()
        });
        let r = rig.receiver.update(&tables).await?;
        per_copy.push(r.stages.reslice / batched[batched.len() - 1]);
        uncached.push(r.stages.descriptor_build);
    }
    let memcpy = median(memcpy);
    let reslice_copies = rig.receiver.plan().map(|p| p.reslices.len()).unwrap_or(0);
    Ok(RigFigures {
        wire_bytes,
        loopback_gbps: gbps(wire_bytes, median(wire)),
        memcpy_gbps: gbps(wire_bytes, memcpy),
        loopback_over_memcpy: median(ratio),
        reslice_batched_s: median(batched),
        reslice_per_copy_over_batched: median(per_copy),
        reslice_copies,
        desc_cached_s: median(cached),
        desc_uncached_s: median(uncached),
        reads,
        e2e_s: median(e2e),
        attribution: median(attr),
    })
}

fn main() -> Result<()> {
    let json = std::env::args().any(|a| a == "--json");
    let (xxh, b3) = digest_figures(256 << 20, 1);
    let (xxh_l2, b3_l2) = digest_figures(256 << 10, 1024);
    let (plan_s, merge_dedup_s, no_dedup_s, stable_s) = plan_figures()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| reshard_core::Error::new(reshard_core::ErrorKind::Internal, e.to_string()))?;
    let (layers, experts, updates) = (8, 64, 7);
    let rig = rt.block_on(rig_figures(layers, experts, updates))?;
    if json {
        let v = serde_json::json!({
            "digest_gbytes_per_s": {"xxh3_128": xxh, "blake3": b3, "xxh3_128_in_cache": xxh_l2, "blake3_in_cache": b3_l2},
            "plan_full_scale_both_ranks_s": plan_s,
            "merge_dedup_full_scale_s": merge_dedup_s,
            "stable_geometry_check_full_scale_s": stable_s,
            "plan_no_dedup_both_ranks_s": no_dedup_s,
            "rig": {"preset": "qwen3-30b-a3b", "layers": layers, "experts": experts, "publishers": "ep=8,dp=8", "receiver": "tp=2 rank 0", "updates": updates},
            "wire_bytes": rig.wire_bytes,
            "reads": rig.reads,
            "loopback_wire_gbytes_per_s": rig.loopback_gbps,
            "memcpy_gbytes_per_s": rig.memcpy_gbps,
            "loopback_over_memcpy": rig.loopback_over_memcpy,
            "reslice_batched_s": rig.reslice_batched_s,
            "reslice_per_copy_over_batched": rig.reslice_per_copy_over_batched,
            "reslice_copies": rig.reslice_copies,
            "descriptor_build_cached_s": rig.desc_cached_s,
            "descriptor_build_uncached_s": rig.desc_uncached_s,
            "refit_e2e_s": rig.e2e_s,
            "attribution": rig.attribution,
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    println!("| figure | value |");
    println!("|---|---|");
    println!("| digest XXH3-128, one core, 256 MiB buffer | {xxh:.2} GB/s |");
    println!("| digest BLAKE3, one core, 256 MiB buffer | {b3:.2} GB/s |");
    println!("| digest XXH3-128, one core, 256 KiB buffer (in cache) | {xxh_l2:.2} GB/s |");
    println!("| digest BLAKE3, one core, 256 KiB buffer (in cache) | {b3_l2:.2} GB/s |");
    println!(
        "| plan, full scale, both TP2 ranks, one core (median of 7) | {:.2} ms |",
        plan_s * 1e3
    );
    println!(
        "| merge + dedup, full scale, 8 publishers | {:.2} ms |",
        merge_dedup_s * 1e3
    );
    println!(
        "| plan without dedup, both ranks | {:.2} ms |",
        no_dedup_s * 1e3
    );
    println!(
        "| per update with unchanged geometry instead: table keys + replica digest check | {:.2} ms |",
        stable_s * 1e3
    );
    println!(
        "| rig | qwen3-30b-a3b, {layers} layers, {experts} experts, EP8/DP8 -> TP2 rank 0, {} reads, {} wire bytes, median of {updates} |",
        rig.reads, rig.wire_bytes
    );
    println!("| loopback wire leg | {:.2} GB/s |", rig.loopback_gbps);
    println!(
        "| plain memcpy of the same bytes | {:.2} GB/s |",
        rig.memcpy_gbps
    );
    println!(
        "| loopback / memcpy (median of per-iteration ratios) | {:.2}x |",
        rig.loopback_over_memcpy
    );
    println!(
        "| re-slice of {} full-pull copies, batched | {:.2} ms |",
        rig.reslice_copies,
        rig.reslice_batched_s * 1e3
    );
    println!(
        "| re-slice per copy / batched (median of per-iteration ratios) | {:.2}x |",
        rig.reslice_per_copy_over_batched
    );
    println!(
        "| descriptor_build, cached | {:.4} ms |",
        rig.desc_cached_s * 1e3
    );
    println!(
        "| descriptor_build, uncached | {:.4} ms |",
        rig.desc_uncached_s * 1e3
    );
    println!(
        "| refit end-to-end (rank 0) | {:.1} ms, attribution {:.1}% |",
        rig.e2e_s * 1e3,
        rig.attribution * 100.0
    );
    Ok(())
}
