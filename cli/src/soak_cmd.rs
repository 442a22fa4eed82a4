//! `reshard soak`: one cluster and one set of receivers through many consecutive updates, the
//! weights changing every step, each update verified byte-exact; reports resident memory over
//! the run, plan and descriptor rebuilds after the first update, and whether the receivers'
//! registrations are released when they drop.

use clap::Args;
use reshard_core::median;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use reshard_core::{MemoryBlock, Registration, Result, Transport};
use reshard_runtime::ReceiverOptions;
use reshard_testkit::rig::{self, RigEvent};

use crate::refit_cmd::{
    print_verdict, progress, start_bench, track, Bench, PublisherPlace, PublisherSetup,
};
use crate::{ModelArgs, Outcome};

/// Flags of `reshard soak` (model defaults as `refit`: --layers 4, --experts 32 on MoE).
#[derive(Args)]
pub struct SoakArgs {
    /// Transport scheme (overrides `RESHARD_TRANSPORT__KIND` and `reshard.toml`).
    #[arg(long)]
    transport: Option<String>,
    /// Config file (default: `$RESHARD_CONFIG`, else `./reshard.toml` when present).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    /// Consecutive updates after the warm-up, one new training step each.
    #[arg(long, default_value_t = 50)]
    updates: u32,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0x5EED)]
    seed: u64,
    /// Where the publishers live: `local` or `process` (as `refit`). RSS is this process's.
    #[arg(long = "publisher-process", value_enum, default_value_t = PublisherPlace::Local)]
    place: PublisherPlace,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Passes everything through to `inner` and counts the registrations callers still hold.
#[derive(Debug)]
struct CountingTransport {
    inner: Arc<dyn Transport>,
    live: Arc<AtomicU64>,
}

reshard_core::forward_transport!(CountingTransport => inner {
    async fn register(&self, block: Arc<dyn MemoryBlock>) -> Result<Registration> {
        let inner = self.inner.register(block).await?;
        let (id, len, kind) = (inner.id(), inner.len(), inner.kind());
        let live = self.live.clone();
        live.fetch_add(1, Ordering::SeqCst);
        Ok(Registration::new(id, len, kind, move || {
            drop(inner);
            live.fetch_sub(1, Ordering::SeqCst);
        }))
    }
});

/// This process's resident set size in KiB (`VmRSS` of `/proc/self/status`), if known.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Least-squares slope of `v` against its index (units of `v` per sample; 0 for < 2 samples).
fn slope(v: &[f64]) -> f64 {
    let n = v.len() as f64;
    if v.len() < 2 {
        return 0.0;
    }
    let mx = (n - 1.0) / 2.0;
    let my = v.iter().sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (i, y) in v.iter().enumerate() {
        let dx = i as f64 - mx;
        num += dx * (y - my);
        den += dx * dx;
    }
    num / den
}

/// Runs `reshard soak`.
pub fn run(args: SoakArgs) -> Result<Outcome> {
    crate::block_on(soak(args))
}

async fn soak(args: SoakArgs) -> Result<Outcome> {
    let cfg = crate::load_config(args.transport.as_deref(), args.config.as_deref())?;
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
    let live_regs = Arc::new(AtomicU64::new(0));
    let mut receivers = rig::connect_receivers(
        &cluster,
        &recv,
        &ReceiverOptions::from_config(&cfg),
        |agent| {
            let inner = registry.create(agent, &cfg.transport)?;
            Ok(Arc::new(CountingTransport {
                inner,
                live: live_regs.clone(),
            }) as Arc<dyn Transport>)
        },
    )
    .await?;
    let bar = progress(
        (args.updates as u64 + 1) * recv.world() as u64,
        args.json,
        "soak",
    );
    let mut rss = Vec::with_capacity(args.updates as usize + 1);
    let (mut plan_rebuilds, mut descriptor_rebuilds) = (0u64, 0u64);
    let mut e2e = Vec::with_capacity(args.updates as usize);
    let mut wire_bytes = 0u64;
    let mut update_s = 0.0;
    let mut regs_steady = 0u64;
    let mut regs_changed = false;
    let run = rig::run_updates(&mut cluster, &mut receivers, args.updates, 0, |event| {
        match event {
            RigEvent::Updated { update, report, .. } => {
                update_s += report.e2e_s;
                wire_bytes += report.wire_bytes;
                if update > 0 {
                    plan_rebuilds += u64::from(report.plan_rebuilt);
                    descriptor_rebuilds += u64::from(report.descriptors_rebuilt);
                }
            }
            RigEvent::StepDone { update } => {
                let regs = live_regs.load(Ordering::SeqCst);
                if update == 0 {
                    regs_steady = regs;
                } else {
                    e2e.push(update_s);
                    regs_changed |= regs != regs_steady;
                }
                if let Some(kib) = rss_kib() {
                    rss.push(kib);
                }
                // The figures are per update: the next one starts from zero, and the last
                // update's wire bytes are what is reported.
                update_s = 0.0;
                if update < args.updates as u64 {
                    wire_bytes = 0;
                }
            }
            _ => {}
        }
        track(&bar, event)
    })
    .await?;
    let (failures, verified) = (run.failures, run.verified);
    bar.finish_and_clear();
    let plan_builds: u64 = receivers.iter().map(|r| r.plan_builds()).sum();
    let descriptor_builds: u64 = receivers.iter().map(|r| r.descriptor_builds()).sum();
    drop(receivers);
    let regs_after_drop = live_regs.load(Ordering::SeqCst);
    let released = regs_after_drop == 0 && regs_steady > 0;
    let rss_f: Vec<f64> = rss.iter().map(|&k| k as f64).collect();
    let (first, last) = (rss.first().copied(), rss.last().copied());
    let max = rss.iter().copied().max();
    let rss_slope = slope(&rss_f);
    let ok =
        verified && plan_rebuilds == 0 && descriptor_rebuilds == 0 && !regs_changed && released;

    if args.json {
        let v = serde_json::json!({
            "ok": ok,
            "verified": verified,
            "failures": failures,
            "transport": cfg.transport.kind,
            "preset": model.name,
            "layers": model.layers,
            "experts": model.moe.as_ref().map(|m| m.experts),
            "publishers": pubs.to_string(),
            "receivers_topology": recv.to_string(),
            "updates": args.updates,
            "publisher_process": cluster.is_remote(),
            "median_e2e_s": median(e2e),
            "wire_bytes_per_update": wire_bytes,
            "rss_kib": {
                "after_warmup": first,
                "last": last,
                "max": max,
                "slope_per_update": rss_slope,
                "samples": rss,
            },
            "plan_rebuilds_after_first": plan_rebuilds,
            "descriptor_rebuilds_after_first": descriptor_rebuilds,
            "plan_builds": plan_builds,
            "descriptor_builds": descriptor_builds,
            "registrations": {
                "steady": regs_steady,
                "changed_during_soak": regs_changed,
                "after_receivers_dropped": regs_after_drop,
                "released": released,
            },
        });
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        let kib = |v: Option<u64>| v.map_or("unknown".to_string(), |k| format!("{k} KiB"));
        outln!(
            "soak {} ({} layers) publishers {pubs} -> receivers {recv} over {}: {} updates after \
             a warm-up, new weights every step",
            model.name,
            model.layers,
            cfg.transport.kind,
            args.updates
        );
        outln!("  median update     {:.4} s (all ranks)", median(e2e));
        outln!("  wire bytes        {wire_bytes} per update");
        outln!(
            "  RSS               after warm-up {}, last {}, max {}, slope {rss_slope:.1} KiB/update",
            kib(first),
            kib(last),
            kib(max)
        );
        outln!(
            "  rebuilds          plan {plan_rebuilds}, descriptors {descriptor_rebuilds} after \
             the first update (builds in total: plan {plan_builds}, descriptors {descriptor_builds})"
        );
        outln!(
            "  registrations     {regs_steady} held{}, {regs_after_drop} after the receivers \
             dropped{}",
            if regs_changed {
                " (CHANGED during the soak)"
            } else {
                ", unchanged"
            },
            if released { "" } else { " (NOT RELEASED)" }
        );
        print_verdict(verified, &failures, args.updates);
    }
    Ok(Outcome(ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_noise() {
        assert_eq!(slope(&[]), 0.0);
        assert_eq!(slope(&[5.0]), 0.0);
        assert!((slope(&[1.0, 3.0, 5.0, 7.0]) - 2.0).abs() < 1e-12);
        assert!(slope(&[4.0, 4.0, 4.0]).abs() < 1e-12);
    }

    #[test]
    fn this_process_has_a_resident_set() {
        if std::path::Path::new("/proc/self/status").exists() {
            assert!(rss_kib().is_some_and(|k| k > 0));
        }
    }
}
