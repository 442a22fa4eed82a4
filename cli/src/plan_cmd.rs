//! `reshard plan`: geometry only, no bytes allocated.

use clap::Args;
use serde::Serialize;
use std::time::Instant;

use reshard_core::{dedup, keep_all, merge, DedupOptions, DedupReport, PlanStats, Result};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::plan::{plan, PlanOptions};
use reshard_planner::topology::geometry_tables;

use crate::{ModelArgs, Outcome};

/// Flags of `reshard plan`.
#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Plan without replica dedup (the benchmark-only counterfactual arm).
    #[arg(long)]
    no_dedup: bool,
    /// Runs per copy above which a tiling tensor is pulled whole and re-sliced.
    #[arg(long, default_value_t = 64)]
    full_pull_threshold: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// One receiver rank's statistics; the JSON keys are a contract.
#[derive(Serialize)]
struct RankRow {
    rank: u32,
    copies: u64,
    reads: u64,
    coalesced_reads: u64,
    wire_bytes: u64,
    exact_descriptors: u64,
    descriptors_saved: u64,
    extra_wire_bytes: u64,
    full_pull_sources: u64,
    staged_offers: u64,
    owners: u64,
    plan_seconds: f64,
    fingerprint: String,
}

fn row(rank: u32, s: &PlanStats, secs: f64, fp: u64) -> RankRow {
    RankRow {
        rank,
        copies: s.copies,
        reads: s.reads,
        coalesced_reads: s.coalesced_reads,
        wire_bytes: s.wire_bytes,
        exact_descriptors: s.exact_descriptors,
        descriptors_saved: s.descriptors_saved,
        extra_wire_bytes: s.extra_wire_bytes,
        full_pull_sources: s.full_pull_sources,
        staged_offers: s.staged_offers,
        owners: s.owners,
        plan_seconds: secs,
        fingerprint: format!("{fp:016x}"),
    }
}

fn arm(
    tables: &[reshard_core::ShardTable],
    model: &reshard_planner::presets::ModelConfig,
    recv: &reshard_planner::topology::ReceiverTopology,
    use_dedup: bool,
    threshold: u64,
) -> Result<(Vec<RankRow>, f64, DedupReport)> {
    let merged = merge(tables)?;
    let (table, report) = if use_dedup {
        dedup(&merged, DedupOptions::default())?
    } else {
        keep_all(merged)
    };
    let opts = PlanOptions {
        full_pull_threshold: threshold,
        allow_overlap: !use_dedup,
    };
    let mut rows = Vec::new();
    let mut total = 0.0;
    for rank in 0..recv.tp {
        let layout = receiver_layout(model, recv, rank)?;
        let t = Instant::now();
        let p = plan(&table, &layout, &opts)?;
        let secs = t.elapsed().as_secs_f64();
        total += secs;
        rows.push(row(rank, &p.stats, secs, p.fingerprint));
    }
    Ok((rows, total, report))
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn print_rows(title: &str, rows: &[RankRow]) {
    println!("{title}");
    let keys = [
        "copies (source tensors)",
        "full-pull sources",
        "reads (descriptors)",
        "coalesced reads (wire)",
        "exact descriptors before full pulls",
        "descriptors saved",
        "wire bytes",
        "extra wire bytes from full pulls",
        "owners (sessions) touched",
        "staged whole offers",
        "plan seconds",
    ];
    print!("  {:<38}", "per receiver rank");
    for r in rows {
        print!(" {:>18}", format!("rank {}", r.rank));
    }
    println!();
    for (i, k) in keys.iter().enumerate() {
        print!("  {k:<38}");
        for r in rows {
            let v = match i {
                0 => r.copies.to_string(),
                1 => r.full_pull_sources.to_string(),
                2 => r.reads.to_string(),
                3 => r.coalesced_reads.to_string(),
                4 => r.exact_descriptors.to_string(),
                5 => r.descriptors_saved.to_string(),
                6 => r.wire_bytes.to_string(),
                7 => r.extra_wire_bytes.to_string(),
                8 => r.owners.to_string(),
                9 => r.staged_offers.to_string(),
                _ => format!("{:.4}", r.plan_seconds),
            };
            print!(" {v:>18}");
        }
        println!();
    }
}

/// Above this many published offers the text output does not add the no-dedup comparison:
/// at trillion-parameter scale (kimi-k2 with 256 publishers: 719k offers) its plans take tens
/// of GiB. `--no-dedup` still plans that arm alone.
const COUNTERFACTUAL_MAX_OFFERS: u64 = 250_000;

/// Runs `reshard plan`.
pub fn run(args: PlanArgs) -> Result<Outcome> {
    let (model, pubs, recv) = args.model.resolve()?;
    let tables = geometry_tables(&model, &pubs, 0)?;
    let (rows, secs, report) = arm(
        &tables,
        &model,
        &recv,
        !args.no_dedup,
        args.full_pull_threshold,
    )?;
    if args.json {
        let v = serde_json::json!({
            "preset": model.name,
            "publishers": pubs.to_string(),
            "receivers": rows,
            "plan_seconds": secs,
            "dedup": !args.no_dedup,
            "dedup_report": report,
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(Outcome(true));
    }
    let arm_name = if args.no_dedup {
        "without dedup (counterfactual)"
    } else {
        "with dedup"
    };
    println!(
        "{} ({} layers), publishers {pubs}, receivers {recv}: plan {arm_name}",
        model.name, model.layers
    );
    println!(
        "  offers in {}, kept {}, dropped {} ({} duplicate)",
        report.offers_in,
        report.kept,
        report.dropped,
        gib(report.duplicate_bytes)
    );
    print_rows("", &rows);
    println!("  plan seconds, all ranks: {secs:.4}");
    if !args.no_dedup && report.offers_in > COUNTERFACTUAL_MAX_OFFERS {
        println!(
            "  (the no-dedup comparison is skipped above {COUNTERFACTUAL_MAX_OFFERS} offers: its \
             overlapping plans grow with every replica; run with --no-dedup to plan it alone)"
        );
    } else if !args.no_dedup {
        // The counterfactual, so the dedup win is visible in one run.
        let (other, osecs, _) = arm(&tables, &model, &recv, false, args.full_pull_threshold)?;
        println!();
        print_rows(
            "without dedup (counterfactual arm, benchmarks only):",
            &other,
        );
        println!("  plan seconds, all ranks: {osecs:.4}");
        for (a, b) in rows.iter().zip(&other) {
            println!(
                "  rank {}: dedup cuts reads {:.1}x and wire bytes {} -> {}",
                a.rank,
                b.reads as f64 / a.reads.max(1) as f64,
                gib(b.wire_bytes),
                gib(a.wire_bytes)
            );
        }
    }
    Ok(Outcome(true))
}
