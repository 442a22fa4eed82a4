//! `reshard refit`: synthetic publishers and receivers in this process, a warm-up and N measured
//! updates through the configured transport, each verified byte-exact against a reference built
//! from the generator.

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use reshard_core::median;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

use reshard_core::config::Config;
use reshard_core::registry::Registry;
use reshard_core::{Error, ErrorKind, Result};
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_runtime::{ReceiverOptions, StageTimes, UpdateReport};
use reshard_testkit::rig::{self, PublisherSite, RigEvent, RigRun};
use reshard_testkit::{Placement, Publishers};

use crate::{ModelArgs, Outcome};

/// Layers a refit keeps unless `--layers` says otherwise.
const DEFAULT_LAYERS: u64 = 4;
/// Experts per layer a refit keeps unless `--experts` says otherwise.
const DEFAULT_EXPERTS: u64 = 32;

/// Flags of `reshard refit` (defaults to --layers 4 and, on MoE presets, --experts 32).
#[derive(Args)]
pub struct RefitArgs {
    /// Transport scheme (overrides `RESHARD_TRANSPORT__KIND` and `reshard.toml`).
    #[arg(long)]
    transport: Option<String>,
    /// Config file (default: `$RESHARD_CONFIG`, else `./reshard.toml` when present).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// Measured updates after the warm-up.
    #[arg(long, default_value_t = 3)]
    updates: u32,
    /// Turn replica dedup off (the counterfactual arm; still byte-exact).
    #[arg(long)]
    no_dedup: bool,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0x5EED)]
    seed: u64,
    /// Where the publishers live: `local` (this process) or `process` (a child process
    /// started from this binary, so bytes and metadata cross a process boundary).
    #[arg(long = "publisher-process", value_enum, default_value_t = PublisherPlace::Local)]
    place: PublisherPlace,
    /// Publisher memory: `shared` (replicas share one buffer, so the default EP8 x DP8 rig fits
    /// on one machine) or `per-rank` (every rank its own memory and layout, as on real
    /// trainers; DP times the memory).
    #[arg(long = "publisher-memory", value_enum, default_value_t = PublisherMemory::Shared)]
    memory: PublisherMemory,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Where `reshard refit` runs its synthetic publishers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PublisherPlace {
    /// In this process.
    Local,
    /// In a child process (`reshard serve-publishers`), driven over a Unix socket.
    Process,
}

/// How `reshard refit` lays out its synthetic publishers' memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PublisherMemory {
    /// One buffer per distinct box, shared by its replicas.
    Shared,
    /// Every rank owns its memory, with its own layout.
    PerRank,
}

impl From<PublisherMemory> for Placement {
    fn from(m: PublisherMemory) -> Self {
        match m {
            PublisherMemory::Shared => Placement::SharedReplicas,
            PublisherMemory::PerRank => Placement::PerRank,
        }
    }
}

/// Flags of the hidden `reshard serve-publishers` (the child side of `--publisher-process`).
#[derive(Args)]
pub struct ServeArgs {
    /// Transport scheme.
    #[arg(long)]
    transport: Option<String>,
    /// Config file.
    #[arg(long)]
    config: Option<PathBuf>,
}

/// Runs the publisher side for a parent `reshard refit --publisher-process process`.
pub fn serve(args: ServeArgs) -> Result<Outcome> {
    let cfg = crate::load_config(args.transport.as_deref(), args.config.as_deref())?;
    let registry = reshard::registry();
    reshard_testkit::remote::serve(|agent| registry.create(agent, &cfg.transport))?;
    Ok(Outcome(true))
}

/// One receiver rank's figures in the refit JSON.
#[derive(Serialize)]
pub(crate) struct RankSummary {
    rank: u32,
    reads: u64,
    coalesced_reads: u64,
    wire_bytes: u64,
    full_pull_sources: u64,
    staged_offers: u64,
    fingerprint: String,
    median_e2e_s: f64,
    median_wire_s: f64,
    attribution: f64,
    checked_bytes: u64,
}

/// Runs `reshard refit`.
pub fn run(args: RefitArgs) -> Result<Outcome> {
    crate::block_on(refit(args))
}

/// Where `reshard refit` runs its synthetic publishers, how their memory is laid out, and the
/// seed of their weights.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PublisherSetup {
    /// This process or a child.
    pub place: PublisherPlace,
    /// Shared replicas or per-rank memory.
    pub placement: Placement,
    /// Seed of the synthetic weights.
    pub seed: u64,
}

/// Publishers for a refit: in this process, or in a child started from this binary.
pub(crate) async fn start_publishers(
    registry: &Registry,
    cfg: &Config,
    config_path: Option<&std::path::Path>,
    model: &ModelConfig,
    pubs: PublisherTopology,
    setup: PublisherSetup,
) -> Result<Publishers> {
    let site = match setup.place {
        PublisherPlace::Local => PublisherSite::Local,
        PublisherPlace::Process => {
            let exe = std::env::current_exe().map_err(|e| {
                Error::new(ErrorKind::Internal, "cannot find this binary").with_source(e)
            })?;
            let mut cmd = std::process::Command::new(exe);
            cmd.args(["serve-publishers", "--transport", &cfg.transport.kind]);
            if let Some(c) = config_path {
                cmd.arg("--config").arg(c);
            }
            PublisherSite::Process(cmd)
        }
    };
    rig::start_publishers(
        model.clone(),
        pubs,
        setup.seed,
        setup.placement,
        site,
        |agent| registry.create(agent, &cfg.transport),
    )
    .await
}

/// What every refit-style command starts from: the registry (whose loopback fabric is this
/// process's network), the resolved model and topologies, and running publishers.
pub(crate) struct Bench {
    /// Transports built into this binary.
    pub registry: Registry,
    /// The (scaled) model.
    pub model: ModelConfig,
    /// Publisher topology.
    pub pubs: PublisherTopology,
    /// Receiver topology.
    pub recv: ReceiverTopology,
    /// The publishers, in this process or a child.
    pub cluster: Publishers,
}

/// Resolves `model` with the refit defaults and starts its publishers as `setup` says.
pub(crate) async fn start_bench(
    cfg: &Config,
    config_path: Option<&std::path::Path>,
    model: &ModelArgs,
    setup: PublisherSetup,
) -> Result<Bench> {
    let (model, pubs, recv) = resolve_scaled(model)?;
    let registry = reshard::registry();
    let cluster = start_publishers(&registry, cfg, config_path, &model, pubs, setup).await?;
    Ok(Bench {
        registry,
        model,
        pubs,
        recv,
        cluster,
    })
}

/// Prints the verification verdict of `updates` measured updates plus the warm-up: `verified`
/// (byte-exact and every installed byte digest-checked), else the failures, else byte-exact
/// with checks turned off.
pub(crate) fn print_verdict(verified: bool, failures: &[String], updates: u32) {
    if verified {
        outln!(
            "  verified: every parameter of every rank byte-exact at every step, every installed \
             byte checked against a publisher digest ({} updates)",
            updates + 1
        );
    } else if failures.is_empty() {
        outln!(
            "  NOT VERIFIED: every parameter byte-exact against the reference, but digest \
             checks are off ([receiver] verify_digests = false): a deployment would install \
             these bytes unchecked"
        );
    } else {
        outln!("  VERIFICATION FAILED:");
        for f in failures {
            outln!("    {f}");
        }
    }
}

/// Resolves model flags with the refit defaults (4 layers, 32 experts on MoE presets).
pub(crate) fn resolve_scaled(
    model: &ModelArgs,
) -> Result<(ModelConfig, PublisherTopology, ReceiverTopology)> {
    let mut margs = model.clone();
    // Scaled down by default so publishers and receivers share one machine; the full model
    // is --layers 48 --experts 128 (about 57 GiB of publisher memory for qwen3-30b-a3b).
    margs.layers = margs.layers.or(Some(DEFAULT_LAYERS));
    if margs.experts.is_none()
        && reshard_planner::presets::preset(&margs.preset)?
            .moe
            .is_some()
    {
        margs.experts = Some(DEFAULT_EXPERTS);
    }
    margs.resolve()
}

/// Runs one arm: fresh receivers with `opts`, a warm-up and `updates` measured updates, the
/// publishers advancing one training step per update from `first_step` (see
/// [`rig::run_updates`]).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_arm(
    registry: &Registry,
    cluster: &mut Publishers,
    cfg: &Config,
    recv: &ReceiverTopology,
    opts: ReceiverOptions,
    updates: u32,
    first_step: u64,
    bar: &ProgressBar,
) -> Result<RigRun> {
    let mut receivers = rig::connect_receivers(cluster, recv, &opts, |agent| {
        registry.create(agent, &cfg.transport)
    })
    .await?;
    rig::run_updates(cluster, &mut receivers, updates, first_step, |e| {
        track(bar, e)
    })
    .await
}

/// Shows a rig's progress on `bar`.
pub(crate) fn track(bar: &ProgressBar, event: RigEvent<'_>) {
    match event {
        RigEvent::Publishing { step } => bar.set_message(format!("publishing step {step}")),
        RigEvent::Updating { step, rank } => bar.set_message(format!("step {step} rank {rank}")),
        RigEvent::Updated { .. } => bar.inc(1),
        RigEvent::StepDone { .. } => {}
    }
}

/// Per-update sums over receiver ranks (ranks run one after another), then medians.
pub(crate) struct ArmSummary {
    /// Median seconds of each stage, in [`StageTimes::NAMES`] order.
    pub med_stages: Vec<f64>,
    /// Median end-to-end seconds of one update over all ranks.
    pub med_e2e: f64,
    /// Fastest and slowest end-to-end update.
    pub e2e_min_max: (f64, f64),
    /// Fastest and slowest wire leg.
    pub wire_min_max: (f64, f64),
    /// Median of per-update (sum of stages / end-to-end).
    pub attribution: f64,
    /// Planned reads over all ranks (last update).
    pub reads: u64,
    /// Reads on the wire after coalescing.
    pub coalesced: u64,
    /// Bytes on the wire over all ranks (last update).
    pub wire_bytes: u64,
    /// Wire bytes over the median wire leg.
    pub gbps: f64,
    /// Bytes verified by digest (last update).
    pub checked: u64,
    /// Bytes the re-slice stage wrote, all ranks (last update).
    pub resliced_bytes: u64,
    /// Re-sliced bytes over the median re-slice stage (GB/s; 0 without re-slices, and 0 where
    /// the re-slices ran as the bytes landed: then they have no stage of their own).
    pub reslice_gbps: f64,
    /// Digest checks run while the wire leg was in flight, all ranks (last update).
    pub checks_on_wire: u64,
    /// Re-slices run while the wire leg was in flight, all ranks (last update).
    pub reslices_on_wire: u64,
    /// Of `checked`, bytes whose segment hashes the backend computed while copying them, all
    /// ranks (last update; `UpdateReport::copy_hashed_bytes`).
    pub copy_hashed: u64,
    /// Per rank.
    pub ranks: Vec<RankSummary>,
}

/// Summarises an arm's measured updates.
pub(crate) fn summarize(run: &RigRun, updates: u32) -> ArmSummary {
    let reports = &run.reports;
    let n = updates as usize;
    let mut stage_cols: Vec<Vec<f64>> = vec![Vec::new(); StageTimes::NAMES.len()];
    let mut e2e = Vec::new();
    let mut attr = Vec::new();
    for u in 0..n {
        let mut sum = [0.0; 10];
        let mut e = 0.0;
        for r in reports {
            for (i, v) in r[u].stages.values().iter().enumerate() {
                sum[i] += v;
            }
            e += r[u].e2e_s;
        }
        for (i, v) in sum.iter().enumerate() {
            stage_cols[i].push(*v);
        }
        attr.push(if e > 0.0 {
            sum.iter().sum::<f64>() / e
        } else {
            0.0
        });
        e2e.push(e);
    }
    let min_max = |v: &[f64]| {
        (
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(0.0, f64::max),
        )
    };
    let e2e_min_max = min_max(&e2e);
    let wire_min_max = min_max(&stage_cols[6]);
    let med_stages: Vec<f64> = stage_cols.into_iter().map(median).collect();
    let med_e2e = median(e2e);
    // Per update (stages over end-to-end), then the median: medians of different stages may
    // come from different updates, so their sum is not comparable with the median e2e.
    let attribution = median(attr);
    let last: Vec<&UpdateReport> = reports.iter().filter_map(|r| r.last()).collect();
    // GB/s of `bytes` over a median stage time; 0 for a stage that did not run.
    let rate = |bytes: u64, secs: f64| {
        if secs > 0.0 {
            bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    };
    let wire_bytes: u64 = last.iter().map(|r| r.wire_bytes).sum();
    let gbps = rate(wire_bytes, med_stages[6]);
    let resliced_bytes: u64 = last.iter().map(|r| r.resliced_bytes).sum();
    let reslice_gbps = rate(resliced_bytes, med_stages[7]);
    let ranks = reports
        .iter()
        .filter_map(|rs| {
            let l = rs.last()?;
            Some(RankSummary {
                rank: l.receiver_rank,
                reads: l.plan.reads,
                coalesced_reads: l.plan.coalesced_reads,
                wire_bytes: l.wire_bytes,
                full_pull_sources: l.plan.full_pull_sources,
                staged_offers: l.plan.staged_offers,
                fingerprint: format!("{:016x}", l.fingerprint),
                median_e2e_s: median(rs.iter().map(|r| r.e2e_s).collect()),
                median_wire_s: median(rs.iter().map(|r| r.stages.wire).collect()),
                attribution: median(rs.iter().map(|r| r.attribution).collect()),
                checked_bytes: l.checked_bytes,
            })
        })
        .collect();
    ArmSummary {
        reads: last.iter().map(|r| r.plan.reads).sum(),
        coalesced: last.iter().map(|r| r.plan.coalesced_reads).sum(),
        checked: last.iter().map(|r| r.checked_bytes).sum(),
        checks_on_wire: last.iter().map(|r| r.checks_while_on_wire).sum(),
        reslices_on_wire: last.iter().map(|r| r.reslices_while_on_wire).sum(),
        copy_hashed: last.iter().map(|r| r.copy_hashed_bytes).sum(),
        med_stages,
        med_e2e,
        e2e_min_max,
        wire_min_max,
        attribution,
        wire_bytes,
        gbps,
        resliced_bytes,
        reslice_gbps,
        ranks,
    }
}

/// A progress bar on stderr, hidden for JSON output.
pub(crate) fn progress(total: u64, hidden: bool, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if hidden {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} {what} [{{bar:30}}] {{pos}}/{{len}} {{msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

async fn refit(args: RefitArgs) -> Result<Outcome> {
    let mut cfg = crate::load_config(args.transport.as_deref(), args.config.as_deref())?;
    if args.no_dedup {
        cfg.planner.dedup = false;
    }
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
            placement: args.memory.into(),
            seed: args.seed,
        },
    )
    .await?;
    let bar = progress(
        (args.updates as u64 + 1) * recv.world() as u64,
        args.json,
        "refit",
    );
    let run = run_arm(
        &registry,
        &mut cluster,
        &cfg,
        &recv,
        ReceiverOptions::from_config(&cfg),
        args.updates,
        0,
        &bar,
    )
    .await?;
    bar.finish_and_clear();
    let ArmSummary {
        med_stages,
        med_e2e,
        attribution,
        reads,
        coalesced,
        wire_bytes,
        gbps,
        checked,
        copy_hashed,
        ranks,
        ..
    } = summarize(&run, args.updates);
    let (verified, byte_exact, failures) = (run.verified, run.byte_exact, run.failures);
    let stages_map: BTreeMap<&str, f64> = StageTimes::NAMES
        .iter()
        .copied()
        .zip(med_stages.iter().copied())
        .collect();

    if args.json {
        let v = serde_json::json!({
            "verified": verified,
            "byte_exact": byte_exact,
            "failures": failures,
            "transport": cfg.transport.kind,
            "rendezvous": cluster.meeting().hub().endpoint(),
            "preset": model.name,
            "layers": model.layers,
            "experts": model.moe.as_ref().map(|m| m.experts),
            "publishers": pubs.to_string(),
            "receivers_topology": recv.to_string(),
            "dedup": cfg.planner.dedup,
            "updates": args.updates,
            "reads": reads,
            "coalesced_reads": coalesced,
            "wire_bytes": wire_bytes,
            "wire_gbytes_per_s": gbps,
            "attribution": attribution,
            "median_stages_s": stages_map,
            "median_e2e_s": med_e2e,
            "checked_bytes": checked,
            "copy_hashed_bytes": copy_hashed,
            "publisher_arena_bytes": cluster.arena_bytes(),
            "publisher_process": cluster.is_remote(),
            "publisher_memory": match args.memory {
                PublisherMemory::Shared => "shared",
                PublisherMemory::PerRank => "per-rank",
            },
            "ranks": ranks,
        });
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        outln!(
            "refit {} publishers {pubs} -> receivers {recv} over {}{}: {} measured updates after a warm-up",
            crate::describe_model(&model),
            cfg.transport.kind,
            if cfg.planner.dedup { "" } else { " (no dedup)" },
            args.updates
        );
        outln!(
            "  median stage seconds per update (all {} ranks):",
            recv.world()
        );
        for (name, v) in StageTimes::NAMES.iter().zip(&med_stages) {
            outln!("    {name:<17} {v:>10.4}");
        }
        outln!("    {:<17} {:>10.4}", "end-to-end", med_e2e);
        outln!("  attribution       {:.1}%", attribution * 100.0);
        outln!(
            "  rendezvous        {} (tables and metadata taken from discovery)",
            cluster.meeting().hub().endpoint()
        );
        outln!("  reads             {reads} ({coalesced} on the wire after coalescing)");
        outln!(
            "  wire bytes        {wire_bytes} ({:.2} GiB)",
            wire_bytes as f64 / (1u64 << 30) as f64
        );
        outln!("  effective wire    {gbps:.2} GB/s");
        outln!("  digest-checked    {checked} bytes");
        for r in &ranks {
            outln!(
                "  rank {}: {} reads, {} bytes, e2e {:.4} s, wire {:.4} s, attribution {:.1}%, plan {}",
                r.rank,
                r.reads,
                r.wire_bytes,
                r.median_e2e_s,
                r.median_wire_s,
                r.attribution * 100.0,
                r.fingerprint
            );
        }
        print_verdict(verified, &failures, args.updates);
    }
    // Exit 1 on a wrong parameter or an unchecked byte while checks are on; checks turned off
    // by configuration are reported (`verified: false`), not an error.
    Ok(Outcome(byte_exact && failures.is_empty()))
}
