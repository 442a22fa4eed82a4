//! `reshard plan`: geometry only, no bytes allocated.

use clap::Args;
use serde::Serialize;
use std::time::Instant;

use reshard_core::{
    dedup, keep_all, merge, DedupOptions, DedupReport, MergedTable, PlanStats, Result, ShardTable,
};
use reshard_planner::layouts::ReceiverLayouts;
use reshard_planner::plan::{plan, PlanOptions};
use reshard_planner::topology::{geometry_tables, with_digest_placeholders};

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
#[derive(Serialize, Clone)]
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
    /// Parts of offers staged to be checked (whole row chunks or column blocks around what a
    /// copy wants).
    staged_parts: u64,
    owners: u64,
    /// Bytes the plan's digest checks cover (with digests as production publishers send them).
    checked_bytes: u64,
    /// `checked_bytes / wire_bytes`: 1 when every byte read is checked.
    checked_fraction: f64,
    /// Planner seconds for this rank; 0 when it reuses another rank's plan.
    plan_seconds: f64,
    fingerprint: String,
    /// The rank whose computed plan this rank uses: itself, or an earlier rank with the same
    /// wanted layout (a DP replica).
    plan_of_rank: u32,
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
        staged_parts: s.staged_parts,
        owners: s.owners,
        checked_bytes: s.checked_bytes,
        checked_fraction: if s.wire_bytes == 0 {
            1.0
        } else {
            s.checked_bytes as f64 / s.wire_bytes as f64
        },
        plan_seconds: secs,
        fingerprint: format!("{fp:016x}"),
        plan_of_rank: rank,
    }
}

/// Every receiver rank's row of one arm, and what it cost.
struct ArmResult {
    rows: Vec<RankRow>,
    /// Planner seconds over the computed plans (all receivers).
    plan_seconds: f64,
    /// Seconds spent building the wanted layouts (not planning).
    layout_seconds: f64,
    /// Distinct layouts planned.
    plans_computed: u32,
}

/// Plans every receiver rank against `table`. A plan is a pure function of table and layout
/// and ignores `receiver_rank`, so a rank whose layout equals an earlier rank's apart from
/// `receiver_rank` (a DP replica when experts are TP-sliced; see
/// `ReceiverTopology::same_layout_as`) reuses that rank's plan instead of being built and
/// planned again.
fn plan_arm(
    table: &MergedTable,
    layouts: &ReceiverLayouts,
    opts: &PlanOptions,
) -> Result<ArmResult> {
    let world = layouts.world();
    let mut rows: Vec<RankRow> = Vec::with_capacity(world as usize);
    let (mut plan_seconds, mut layout_seconds, mut plans_computed) = (0.0, 0.0, 0);
    for rank in 0..world {
        let same = layouts.topology().same_layout_as(rank);
        if same < rank {
            let mut r = rows[same as usize].clone();
            r.rank = rank;
            r.plan_seconds = 0.0;
            rows.push(r);
            continue;
        }
        let t = Instant::now();
        let layout = layouts.layout(rank)?;
        layout_seconds += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let p = plan(table, &layout, opts)?;
        let secs = t.elapsed().as_secs_f64();
        plan_seconds += secs;
        plans_computed += 1;
        rows.push(row(rank, &p.stats, secs, p.fingerprint));
    }
    Ok(ArmResult {
        rows,
        plan_seconds,
        layout_seconds,
        plans_computed,
    })
}

/// Merges the publishers' tables and, with `use_dedup`, collapses replicas.
fn build_table(tables: &[ShardTable], use_dedup: bool) -> Result<(MergedTable, DedupReport)> {
    let merged = merge(tables)?;
    if use_dedup {
        dedup(&merged, DedupOptions::default())
    } else {
        Ok(keep_all(merged))
    }
}

fn plan_options(use_dedup: bool, threshold: u64) -> PlanOptions {
    PlanOptions {
        full_pull_threshold: threshold,
        allow_overlap: !use_dedup,
        // The counterfactual arm is the seed's "before": no gather reads either.
        gather_reads: use_dedup,
        ..PlanOptions::default()
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// This process's peak resident set size in bytes: `VmHWM` of `/proc/self/status`, the same
/// high-water mark `getrusage(RUSAGE_SELF).ru_maxrss` reports (KiB on Linux); `None` elsewhere.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Above this many receiver ranks the text output summarises (min / median / max) instead of
/// printing one column per rank; JSON always has every row.
const MAX_RANK_COLUMNS: usize = 16;

/// The row labels of the text output, in order.
const ROW_KEYS: [&str; 13] = [
    "copies (source tensors)",
    "full-pull sources",
    "reads (descriptors)",
    "coalesced reads (wire)",
    "exact descriptors before full pulls",
    "descriptors saved",
    "wire bytes",
    "extra wire bytes (full pulls, parts)",
    "owners (sessions) touched",
    "staged whole offers",
    "staged parts (to be checked)",
    "checked fraction of wire bytes",
    "plan seconds",
];

/// Index of "plan seconds" in [`ROW_KEYS`].
const SECONDS: usize = ROW_KEYS.len() - 1;
/// Index of the checked fraction in [`ROW_KEYS`].
const CHECKED: usize = SECONDS - 1;

/// Value `i` (in [`ROW_KEYS`] order) of a row; plan seconds as a number.
fn value(r: &RankRow, i: usize) -> f64 {
    match i {
        0 => r.copies as f64,
        1 => r.full_pull_sources as f64,
        2 => r.reads as f64,
        3 => r.coalesced_reads as f64,
        4 => r.exact_descriptors as f64,
        5 => r.descriptors_saved as f64,
        6 => r.wire_bytes as f64,
        7 => r.extra_wire_bytes as f64,
        8 => r.owners as f64,
        9 => r.staged_offers as f64,
        10 => r.staged_parts as f64,
        CHECKED => r.checked_fraction,
        _ => r.plan_seconds,
    }
}

fn print_rows(title: &str, rows: &[RankRow]) {
    if rows.len() > MAX_RANK_COLUMNS {
        print_summary(title, rows);
        return;
    }
    outln!("{title}");
    out!("  {:<38}", "per receiver rank");
    for r in rows {
        out!(" {:>18}", format!("rank {}", r.rank));
    }
    outln!();
    for (i, k) in ROW_KEYS.iter().enumerate() {
        out!("  {k:<38}");
        for r in rows {
            let v = match i {
                SECONDS if r.plan_of_rank != r.rank => format!("= rank {}", r.plan_of_rank),
                SECONDS => format!("{:.4}", r.plan_seconds),
                CHECKED => format!("{:.4}", r.checked_fraction),
                _ => format!("{}", value(r, i) as u64),
            };
            out!(" {v:>18}");
        }
        outln!();
    }
}

/// Min, median and max of each statistic over ranks; plan seconds over computed plans only
/// (a reused plan costs nothing).
fn print_summary(title: &str, rows: &[RankRow]) {
    outln!("{title}");
    outln!(
        "  {:<38} {:>18} {:>18} {:>18}",
        format!("per receiver rank ({} ranks)", rows.len()),
        "min",
        "median",
        "max"
    );
    for (i, k) in ROW_KEYS.iter().enumerate() {
        let mut v: Vec<f64> = rows
            .iter()
            .filter(|r| i != SECONDS || r.plan_of_rank == r.rank)
            .map(|r| value(r, i))
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let (Some(&lo), Some(&hi)) = (v.first(), v.last()) else {
            continue;
        };
        let med = reshard_core::median(v);
        let (label, fmt): (&str, fn(f64) -> String) = if i == SECONDS {
            ("plan seconds (per computed plan)", |x| format!("{x:.4}"))
        } else if i == CHECKED {
            (k, |x| format!("{x:.4}"))
        } else {
            (k, |x| format!("{}", x.round() as u64))
        };
        outln!(
            "  {label:<38} {:>18} {:>18} {:>18}",
            fmt(lo),
            fmt(med),
            fmt(hi)
        );
    }
}

/// Above this many published offers the text output does not add the no-dedup comparison:
/// at trillion-parameter scale (kimi-k2 with 256 publishers: 495k offers) its plans take tens
/// of GiB. `--no-dedup` still plans that arm alone.
const COUNTERFACTUAL_MAX_OFFERS: u64 = 250_000;

/// Runs `reshard plan`.
pub fn run(args: PlanArgs) -> Result<Outcome> {
    let (model, pubs, recv) = args.model.resolve()?;
    // Checks the receiver topology against the model before any table is built.
    let layouts = ReceiverLayouts::new(&model, &recv)?;
    let use_dedup = !args.no_dedup;
    let t = Instant::now();
    let mut tables = geometry_tables(&model, &pubs, 0)?;
    // Digests as production publishers send them: which bytes a plan checks, and what it
    // stages to check them, depend on them.
    with_digest_placeholders(&mut tables);
    let (table, report) = build_table(&tables, use_dedup)?;
    let table_seconds = t.elapsed().as_secs_f64();
    let arm = plan_arm(
        &table,
        &layouts,
        &plan_options(use_dedup, args.full_pull_threshold),
    )?;
    drop(table);
    let counterfactual = use_dedup && report.offers_in <= COUNTERFACTUAL_MAX_OFFERS && !args.json;
    if !counterfactual {
        // Only the counterfactual arm needs the raw tables again.
        tables = Vec::new();
    }
    let world = recv.world();
    if args.json {
        let v = serde_json::json!({
            "preset": model.name,
            "publishers": pubs.to_string(),
            "receiver_topology": recv,
            "receivers": arm.rows,
            "receiver_count": world,
            "plans_computed": arm.plans_computed,
            "plan_seconds": arm.plan_seconds,
            "layout_seconds": arm.layout_seconds,
            "table_seconds": table_seconds,
            "peak_rss_bytes": peak_rss_bytes(),
            "dedup": use_dedup,
            "dedup_report": report,
        });
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(Outcome(true));
    }
    let arm_name = if args.no_dedup {
        "without dedup (counterfactual)"
    } else {
        "with dedup"
    };
    outln!(
        "{} ({} layers), publishers {pubs}, receivers {recv}: plan {arm_name}",
        model.name,
        model.layers
    );
    outln!(
        "  offers in {}, kept {}, dropped {} ({} duplicate)",
        report.offers_in,
        report.kept,
        report.dropped,
        gib(report.duplicate_bytes)
    );
    print_rows("", &arm.rows);
    print_totals(&arm, world);
    outln!("  tables (build + merge + dedup): {table_seconds:.4} s");
    if !args.no_dedup && !counterfactual {
        outln!(
            "  (the no-dedup comparison is skipped above {COUNTERFACTUAL_MAX_OFFERS} offers: its \
             overlapping plans grow with every replica; run with --no-dedup to plan it alone)"
        );
    } else if counterfactual {
        // The counterfactual, so the dedup win is visible in one run.
        let (table, _) = build_table(&tables, false)?;
        drop(tables);
        let other = plan_arm(
            &table,
            &layouts,
            &plan_options(false, args.full_pull_threshold),
        )?;
        outln!();
        print_rows(
            "without dedup (counterfactual arm, benchmarks only):",
            &other.rows,
        );
        print_totals(&other, world);
        if arm.rows.len() > MAX_RANK_COLUMNS {
            let sum = |rows: &[RankRow], f: fn(&RankRow) -> u64| rows.iter().map(f).sum::<u64>();
            let (reads_a, reads_b) = (sum(&arm.rows, |r| r.reads), sum(&other.rows, |r| r.reads));
            let wire = |r: &RankRow| r.wire_bytes;
            outln!(
                "  all {} ranks: dedup cuts reads {:.1}x and wire bytes {} -> {}",
                arm.rows.len(),
                reads_b as f64 / reads_a.max(1) as f64,
                gib(sum(&other.rows, wire)),
                gib(sum(&arm.rows, wire))
            );
        } else {
            for (a, b) in arm.rows.iter().zip(&other.rows) {
                outln!(
                    "  rank {}: dedup cuts reads {:.1}x and wire bytes {} -> {}",
                    a.rank,
                    b.reads as f64 / a.reads.max(1) as f64,
                    gib(b.wire_bytes),
                    gib(a.wire_bytes)
                );
            }
        }
    }
    match peak_rss_bytes() {
        Some(b) => outln!("  peak RSS: {} ({b} bytes)", gib(b)),
        None => outln!("  peak RSS: unknown (no /proc/self/status)"),
    }
    Ok(Outcome(true))
}

/// Prints an arm's planner total, how many plans it computed and the layout time.
fn print_totals(arm: &ArmResult, world: u32) {
    outln!(
        "  plan seconds, all ranks: {:.4} ({} receivers, {} plans computed; layouts {:.4} s)",
        arm.plan_seconds,
        world,
        arm.plans_computed,
        arm.layout_seconds
    );
}
