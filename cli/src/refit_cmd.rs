//! `reshard refit`: synthetic publishers and receivers in this process, a warm-up and N measured
//! updates through the configured transport, each verified byte-exact against a reference built
//! from the generator.

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use reshard_core::config::Config;
use reshard_core::encoding::encode_table;
use reshard_core::{Error, ErrorKind, Result, Transport};
use reshard_planner::layouts::receiver_layout;
use reshard_runtime::remote::DEFAULT_TIMEOUT;
use reshard_runtime::{
    Publishers, Receiver, ReceiverOptions, RemoteCluster, StageTimes, SyntheticCluster,
    UpdateReport,
};

use crate::{transports, ModelArgs, Outcome};

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
    let cli = args
        .transport
        .as_ref()
        .map(|k| serde_json::json!({"transport": {"kind": k}}));
    let cfg = Config::load(args.config.as_deref(), cli)?;
    let registry = transports::registry();
    reshard_runtime::remote::serve(|agent| registry.create(agent, &cfg.transport))?;
    Ok(Outcome(true))
}

#[derive(Serialize)]
struct RankSummary {
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

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs `reshard refit`.
pub fn run(args: RefitArgs) -> Result<Outcome> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            Error::new(ErrorKind::Internal, "cannot start the async runtime").with_source(e)
        })?;
    rt.block_on(refit(args))
}

async fn refit(args: RefitArgs) -> Result<Outcome> {
    let cli = args
        .transport
        .as_ref()
        .map(|k| serde_json::json!({"transport": {"kind": k}}));
    let mut cfg = Config::load(args.config.as_deref(), cli)?;
    if args.no_dedup {
        cfg.planner.dedup = false;
    }
    let mut margs = args.model.clone();
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
    let (model, pubs, recv) = margs.resolve()?;
    let registry = transports::registry();
    let tcfg = cfg.transport.clone();
    let make = |agent: String| registry.create(&agent, &tcfg);

    let mut cluster = match args.place {
        PublisherPlace::Local => Publishers::Local(
            SyntheticCluster::new(model.clone(), pubs, args.seed, |rank| {
                make(format!("publisher-{rank}"))
            })
            .await?,
        ),
        PublisherPlace::Process => {
            let exe = std::env::current_exe().map_err(|e| {
                Error::new(ErrorKind::Internal, "cannot find this binary").with_source(e)
            })?;
            let mut cmd = std::process::Command::new(exe);
            cmd.args(["serve-publishers", "--transport", &cfg.transport.kind]);
            if let Some(c) = &args.config {
                cmd.arg("--config").arg(c);
            }
            let model = model.clone();
            let seed = args.seed;
            Publishers::Remote(
                tokio::task::spawn_blocking(move || {
                    RemoteCluster::spawn(cmd, model, pubs, seed, DEFAULT_TIMEOUT)
                })
                .await
                .map_err(|e| Error::new(ErrorKind::Internal, format!("spawn task: {e}")))??,
            )
        }
    };
    let mut receivers = Vec::new();
    for rank in 0..recv.tp {
        let t: Arc<dyn Transport> = make(format!("receiver-{rank}"))?;
        cluster.connect(t.as_ref()).await?;
        let layout = receiver_layout(&model, &recv, rank)?;
        receivers.push(Receiver::new(
            t,
            layout,
            ReceiverOptions::from_config(&cfg),
        )?);
    }

    let total = (args.updates as u64 + 1) * recv.tp as u64;
    let bar = ProgressBar::new(total);
    if args.json {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{spinner} refit [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut verified = true;
    let mut failures = Vec::new();
    let mut reports: Vec<Vec<UpdateReport>> = vec![Vec::new(); recv.tp as usize];
    for update in 0..=args.updates as u64 {
        if update > 0 {
            bar.set_message(format!("publishing step {update}"));
            cluster.publish_step(update)?;
        }
        // Publishers send encoded tables; decoding them is the receiver's discover stage.
        let encoded: Vec<Vec<u8>> = cluster.tables().iter().map(encode_table).collect();
        for rx in receivers.iter_mut() {
            bar.set_message(format!("step {update} rank {}", rx.layout().receiver_rank));
            let report = rx.update_encoded(&encoded).await?;
            let want = cluster.expected_params(rx.layout())?;
            let live = rx
                .live_params()
                .ok_or_else(|| Error::new(ErrorKind::Internal, "no live weights after a refit"))?;
            for ((p, got), want) in rx.layout().params.iter().zip(live).zip(&want) {
                if got.read()[..] != want[..] {
                    verified = false;
                    failures.push(format!(
                        "step {update} rank {}: parameter {} differs from the reference",
                        rx.layout().receiver_rank,
                        p.name
                    ));
                }
            }
            if update > 0 {
                reports[rx.layout().receiver_rank as usize].push(report);
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    // Per update, stages and e2e summed over receiver ranks (ranks run one after another).
    let n = args.updates as usize;
    let mut stage_cols: Vec<Vec<f64>> = vec![Vec::new(); StageTimes::NAMES.len()];
    let mut e2e = Vec::new();
    let mut attr = Vec::new();
    for u in 0..n {
        let mut sum = [0.0; 10];
        let mut e = 0.0;
        for r in &reports {
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
    let med_stages: Vec<f64> = stage_cols.into_iter().map(median).collect();
    let med_e2e = median(e2e);
    // Per update (stages over end-to-end), then the median: medians of different stages may
    // come from different updates, so their sum is not comparable with the median e2e.
    let attribution = median(attr);
    let last: Vec<&UpdateReport> = reports.iter().filter_map(|r| r.last()).collect();
    let reads: u64 = last.iter().map(|r| r.plan.reads).sum();
    let coalesced: u64 = last.iter().map(|r| r.plan.coalesced_reads).sum();
    let wire_bytes: u64 = last.iter().map(|r| r.wire_bytes).sum();
    let wire_med = med_stages[6];
    let gbps = if wire_med > 0.0 {
        wire_bytes as f64 / wire_med / 1e9
    } else {
        0.0
    };
    let checked: u64 = last.iter().map(|r| r.checked_bytes).sum();
    let ranks: Vec<RankSummary> = reports
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
    let stages_map: BTreeMap<&str, f64> = StageTimes::NAMES
        .iter()
        .copied()
        .zip(med_stages.iter().copied())
        .collect();

    if args.json {
        let v = serde_json::json!({
            "verified": verified,
            "failures": failures,
            "transport": cfg.transport.kind,
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
            "publisher_arena_bytes": cluster.arena_bytes(),
            "publisher_process": cluster.is_remote(),
            "ranks": ranks,
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        println!(
            "refit {} ({} layers{}) publishers {pubs} -> receivers {recv} over {}{}: {} measured updates after a warm-up",
            model.name,
            model.layers,
            model
                .moe
                .as_ref()
                .map(|m| format!(", {} experts", m.experts))
                .unwrap_or_default(),
            cfg.transport.kind,
            if cfg.planner.dedup { "" } else { " (no dedup)" },
            args.updates
        );
        println!("  median stage seconds per update (all {} ranks):", recv.tp);
        for (name, v) in StageTimes::NAMES.iter().zip(&med_stages) {
            println!("    {name:<17} {v:>10.4}");
        }
        println!("    {:<17} {:>10.4}", "end-to-end", med_e2e);
        println!("  attribution       {:.1}%", attribution * 100.0);
        println!("  reads             {reads} ({coalesced} on the wire after coalescing)");
        println!(
            "  wire bytes        {wire_bytes} ({:.2} GiB)",
            wire_bytes as f64 / (1u64 << 30) as f64
        );
        println!("  effective wire    {gbps:.2} GB/s");
        println!("  digest-checked    {checked} bytes");
        for r in &ranks {
            println!(
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
        if verified {
            println!(
                "  verified: every parameter of every rank byte-exact at every step ({} updates)",
                args.updates + 1
            );
        } else {
            println!("  VERIFICATION FAILED:");
            for f in &failures {
                println!("    {f}");
            }
        }
    }
    Ok(Outcome(verified))
}
