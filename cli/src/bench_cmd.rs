//! `reshard bench`: the before/after table of the seed note, measured on this machine. Two arms
//! on the same publishers — `baseline` (no dedup, per-copy re-slice, descriptors rebuilt every
//! update) and `reshard` (dedup, batched re-slice, cached descriptors) — each a warm-up plus N
//! measured updates verified byte-exact, and a plain memcpy of the same wire bytes in the same
//! run as the ceiling.

use clap::Args;
use reshard_core::median;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

use reshard_core::config::Config;
use reshard_core::{Error, ErrorKind, Result};
use reshard_runtime::{ReceiverOptions, StageTimes};

use crate::refit_cmd::{
    progress, run_arm, start_bench, summarize, ArmSummary, Bench, PublisherPlace, PublisherSetup,
};
use crate::{ModelArgs, Outcome};

/// Flags of `reshard bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Transport scheme (overrides `RESHARD_TRANSPORT__KIND` and `reshard.toml`).
    #[arg(long)]
    transport: Option<String>,
    /// Config file (default: `$RESHARD_CONFIG`, else `./reshard.toml` when present).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// Measured updates per arm after its warm-up.
    #[arg(long, default_value_t = 10)]
    updates: u32,
    /// Arms to run, in order (`baseline`, `reshard`).
    #[arg(long, value_delimiter = ',', default_value = "baseline,reshard")]
    arms: Vec<String>,
    /// Where the publishers live: `local` or `process` (a child process).
    #[arg(long = "publisher-process", value_enum, default_value_t = PublisherPlace::Local)]
    place: PublisherPlace,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0x5EED)]
    seed: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Receiver options of a named arm.
fn arm_options(name: &str, cfg: &Config) -> Result<ReceiverOptions> {
    let reshard = ReceiverOptions::from_config(cfg);
    match name {
        "reshard" => Ok(ReceiverOptions {
            dedup: true,
            batched_reslice: true,
            cache_descriptors: true,
            ..reshard
        }),
        "baseline" => Ok(ReceiverOptions {
            dedup: false,
            batched_reslice: false,
            cache_descriptors: false,
            ..reshard
        }),
        other => Err(Error::new(
            ErrorKind::InvalidInput,
            format!("unknown bench arm {other:?}; arms: baseline, reshard"),
        )),
    }
}

/// Plain single-threaded memcpy of `bytes` between two pre-faulted buffers: GB/s, median of 5.
pub(crate) fn memcpy_gbps(bytes: u64) -> f64 {
    let n = bytes.max(1) as usize;
    let src: Vec<u8> = (0..n).map(|i| (i as u8) | 1).collect();
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    median(
        (0..5)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
                n as f64 / t.elapsed().as_secs_f64() / 1e9
            })
            .collect(),
    )
}

fn arm_json(name: &str, s: &ArmSummary, memcpy: f64, verified: bool) -> serde_json::Value {
    let stages: serde_json::Map<String, serde_json::Value> = StageTimes::NAMES
        .iter()
        .zip(&s.med_stages)
        .map(|(n, v)| (n.to_string(), json!(v)))
        .collect();
    json!({
        "arm": name,
        "verified": verified,
        "reads": s.reads,
        "coalesced_reads": s.coalesced,
        "wire_bytes": s.wire_bytes,
        "median_wire_s": s.med_stages[6],
        "wire_min_max_s": [s.wire_min_max.0, s.wire_min_max.1],
        "median_e2e_s": s.med_e2e,
        "e2e_min_max_s": [s.e2e_min_max.0, s.e2e_min_max.1],
        "wire_gbytes_per_s": s.gbps,
        "wire_fraction_of_memcpy": if memcpy > 0.0 { s.gbps / memcpy } else { 0.0 },
        "reads_per_s": if s.med_stages[6] > 0.0 { s.coalesced as f64 / s.med_stages[6] } else { 0.0 },
        "attribution": s.attribution,
        "resliced_bytes": s.resliced_bytes,
        "reslice_gbytes_per_s": s.reslice_gbps,
        "reslice_fraction_of_memcpy": if memcpy > 0.0 { s.reslice_gbps / memcpy } else { 0.0 },
        "median_stages_s": stages,
        "checked_bytes": s.checked,
    })
}

/// Runs `reshard bench`.
pub fn run(args: BenchArgs) -> Result<Outcome> {
    crate::block_on(bench(args))
}

async fn bench(args: BenchArgs) -> Result<Outcome> {
    let cfg = crate::load_config(args.transport.as_deref(), args.config.as_deref())?;
    let opts: Vec<(String, ReceiverOptions)> = args
        .arms
        .iter()
        .map(|a| Ok((a.clone(), arm_options(a, &cfg)?)))
        .collect::<Result<_>>()?;
    let Bench {
        registry,
        model,
        pubs,
        recv,
        mut cluster,
    } = start_bench(
        &cfg,
        args.config.as_deref(),
        &args.model,
        PublisherSetup {
            place: args.place,
            // Replicas share memory so the default EP8 x DP8 rig fits beside the receivers.
            placement: reshard_testkit::Placement::SharedReplicas,
            seed: args.seed,
        },
    )
    .await?;
    let per_arm = (args.updates as u64 + 1) * recv.world() as u64;
    let bar = progress(per_arm * opts.len() as u64, args.json, "bench");
    let mut runs = Vec::new();
    let mut step = 0;
    for (name, o) in &opts {
        let run = run_arm(
            &registry,
            &mut cluster,
            &cfg,
            &recv,
            o.clone(),
            args.updates,
            step,
            &bar,
        )
        .await?;
        step += args.updates as u64 + 1;
        runs.push((name.clone(), summarize(&run, args.updates), run.verified));
    }
    bar.finish_and_clear();
    let ceiling_bytes = runs.iter().map(|r| r.1.wire_bytes).min().unwrap_or(0);
    let memcpy = memcpy_gbps(ceiling_bytes);
    let verified = runs.iter().all(|r| r.2);
    let find = |n: &str| runs.iter().find(|r| r.0 == n).map(|r| &r.1);
    let speedup = match (find("baseline"), find("reshard")) {
        (Some(b), Some(r)) if r.med_e2e > 0.0 => Some(b.med_e2e / r.med_e2e),
        _ => None,
    };
    let wire_speedup = match (find("baseline"), find("reshard")) {
        (Some(b), Some(r)) if r.med_stages[6] > 0.0 => Some(b.med_stages[6] / r.med_stages[6]),
        _ => None,
    };
    if args.json {
        let v = json!({
            "verified": verified,
            "transport": cfg.transport.kind,
            "publisher_process": cluster.is_remote(),
            "preset": model.name,
            "layers": model.layers,
            "experts": model.moe.as_ref().map(|m| m.experts),
            "publishers": pubs.to_string(),
            "receivers_topology": recv.to_string(),
            "updates": args.updates,
            "memcpy_bytes": ceiling_bytes,
            "memcpy_gbytes_per_s": memcpy,
            "speedup_e2e": speedup,
            "speedup_wire": wire_speedup,
            "arms": runs.iter().map(|(n, s, ok)| arm_json(n, s, memcpy, *ok)).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(Outcome(verified));
    }
    println!(
        "bench {} publishers {pubs} -> receivers {recv} over {}{}: per arm a warm-up + {} measured updates, all ranks",
        crate::describe_model(&model),
        cfg.transport.kind,
        if cluster.is_remote() {
            " (publishers in another process)"
        } else {
            ""
        },
        args.updates
    );
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let ms = |s: f64| s * 1e3;
    print!("{:<28}", "");
    for (n, _, _) in &runs {
        print!("{n:>26}");
    }
    println!();
    type Row<'a> = (&'a str, Box<dyn Fn(&ArmSummary) -> String>);
    let rows: Vec<Row> = vec![
        (
            "wire bytes",
            Box::new(move |s| format!("{:.3} GiB", gib(s.wire_bytes))),
        ),
        (
            "wire reads (coalesced)",
            Box::new(|s| format!("{} ({})", s.reads, s.coalesced)),
        ),
        (
            "wire leg, median [min-max]",
            Box::new(move |s| {
                format!(
                    "{:.1} [{:.1}-{:.1}] ms",
                    ms(s.med_stages[6]),
                    ms(s.wire_min_max.0),
                    ms(s.wire_min_max.1)
                )
            }),
        ),
        (
            "refit e2e, median [min-max]",
            Box::new(move |s| {
                format!(
                    "{:.1} [{:.1}-{:.1}] ms",
                    ms(s.med_e2e),
                    ms(s.e2e_min_max.0),
                    ms(s.e2e_min_max.1)
                )
            }),
        ),
        (
            "effective wire rate",
            Box::new(|s| format!("{:.2} GB/s", s.gbps)),
        ),
        (
            "wire / memcpy",
            Box::new(move |s| format!("{:.2}x", if memcpy > 0.0 { s.gbps / memcpy } else { 0.0 })),
        ),
        (
            "re-slice (bytes, median)",
            Box::new(move |s| {
                format!(
                    "{:.3} GiB, {:.1} ms",
                    gib(s.resliced_bytes),
                    ms(s.med_stages[7])
                )
            }),
        ),
        (
            "re-slice rate / memcpy",
            Box::new(move |s| {
                format!(
                    "{:.2} GB/s = {:.2}x",
                    s.reslice_gbps,
                    if memcpy > 0.0 {
                        s.reslice_gbps / memcpy
                    } else {
                        0.0
                    }
                )
            }),
        ),
        (
            "stage attribution",
            Box::new(|s| format!("{:.1}%", s.attribution * 100.0)),
        ),
    ];
    for (label, f) in &rows {
        print!("{label:<28}");
        for (_, s, _) in &runs {
            print!("{:>26}", f(s));
        }
        println!();
    }
    println!(
        "memcpy ceiling (one thread, {:.3} GiB, same run): {memcpy:.2} GB/s",
        gib(ceiling_bytes)
    );
    if let Some(x) = speedup {
        println!(
            "reshard vs baseline: {x:.2}x end to end, {:.2}x wire leg",
            wire_speedup.unwrap_or(0.0)
        );
    }
    println!(
        "verified: {}",
        if verified {
            "every parameter of every rank byte-exact and digest-checked at every step of every \
             arm"
        } else {
            "FAILED"
        }
    );
    Ok(Outcome(verified))
}
