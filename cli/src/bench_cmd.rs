//! `reshard bench`: the before/after table of the seed note, measured on this machine. Two arms
//! on the same publishers — `baseline` (no dedup, per-copy re-slice, descriptors rebuilt every
//! update) and `reshard` (dedup, batched re-slice, cached descriptors) — each a warm-up plus N
//! measured updates verified byte-exact, and a plain memcpy of the same wire bytes in the same
//! run as the ceiling.
//!
//! `--transport all` repeats the run for every backend in the transport registry, and
//! `--sweep KEY=V1,V2,...` for every value of one model flag (how cost grows with the model);
//! both print one run's table each and a side-by-side summary, or JSON with one run object per
//! point.

use clap::Args;
use reshard_core::median;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

use reshard_core::config::Config;
use reshard_core::{Error, ErrorKind, Result};
use reshard_planner::plan::PlanOptions;
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_runtime::{ReceiverOptions, StageTimes};

use crate::refit_cmd::{
    progress, resolve_scaled, run_arm, start_bench, summarize, ArmSummary, Bench, PublisherPlace,
    PublisherSetup,
};
use crate::{ModelArgs, Outcome};

/// The `--transport` value that runs every registered backend.
const ALL_TRANSPORTS: &str = "all";

/// Flags of `reshard bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Transport scheme (overrides `RESHARD_TRANSPORT__KIND` and `reshard.toml`), or `all`: every
    /// backend registered in this binary, one after another, side by side (a backend whose
    /// runtime is missing is skipped and named).
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
    /// Where the publishers live: `local` or `process` (a child process). Default `local`; with
    /// `--transport all`, a child process for every backend that reaches other processes.
    #[arg(long = "publisher-process", value_enum)]
    place: Option<PublisherPlace>,
    /// One run per value of a model flag, e.g. `layers=1,2,4,8` (keys: layers, experts,
    /// vocab), each on fresh publishers, to show how cost grows with the wire bytes.
    #[arg(long)]
    sweep: Option<String>,
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
            // The seed's "before" had no gather reads: full pulls and re-slices instead.
            plan: PlanOptions {
                gather_reads: false,
                ..reshard.plan
            },
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

/// The model flags `--sweep` can vary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SweepKey {
    Layers,
    Experts,
    Vocab,
}

impl SweepKey {
    const ALL: [(&'static str, SweepKey); 3] = [
        ("layers", SweepKey::Layers),
        ("experts", SweepKey::Experts),
        ("vocab", SweepKey::Vocab),
    ];

    fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }

    /// The flag's current value in `model`.
    fn given(self, model: &ModelArgs) -> Option<u64> {
        match self {
            SweepKey::Layers => model.layers,
            SweepKey::Experts => model.experts,
            SweepKey::Vocab => model.vocab,
        }
    }

    /// `model` with this flag set to `value`.
    fn apply(self, model: &ModelArgs, value: u64) -> ModelArgs {
        let mut m = model.clone();
        match self {
            SweepKey::Layers => m.layers = Some(value),
            SweepKey::Experts => m.experts = Some(value),
            SweepKey::Vocab => m.vocab = Some(value),
        }
        m
    }
}

/// A parsed `--sweep KEY=V1,V2,...`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sweep {
    key: SweepKey,
    values: Vec<u64>,
}

impl std::str::FromStr for Sweep {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: String| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("--sweep {s:?}: {why}; expected KEY=V1,V2,... with KEY one of layers, experts, vocab (e.g. layers=1,2,4,8)"),
            )
        };
        let (key, values) = s
            .split_once('=')
            .ok_or_else(|| bad("no '=' between the key and its values".into()))?;
        let key = SweepKey::ALL
            .iter()
            .find(|(n, _)| *n == key.trim())
            .map(|(_, k)| *k)
            .ok_or_else(|| bad(format!("unknown key {:?}", key.trim())))?;
        let values = values
            .split(',')
            .map(|v| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| bad(format!("value {:?} is not a positive integer", v.trim())))
            })
            .collect::<Result<Vec<u64>>>()?;
        Ok(Sweep { key, values })
    }
}

/// One point to measure: a transport (`None`: the configured one) and the model flags.
struct Point {
    transport: Option<String>,
    model: ModelArgs,
}

/// A backend `--transport all` left out, and why.
struct Skipped {
    transport: String,
    reason: String,
}

/// What one run measured: every arm on one set of publishers, and the memcpy ceiling.
struct Measured {
    transport: String,
    remote: bool,
    model: ModelConfig,
    pubs: PublisherTopology,
    recv: ReceiverTopology,
    /// Per arm: name, summary, verified.
    arms: Vec<(String, ArmSummary, bool)>,
    ceiling_bytes: u64,
    memcpy: f64,
    /// Median wire leg of the reshard arm's plan with verification off: the transport alone
    /// moving the same bytes, with nothing overlapped (the reshard arm's wire leg contains the
    /// checks run as the bytes land).
    transport_wire: Option<f64>,
    /// Bytes that run digest-checked (0: verification was off, as it must be).
    transport_wire_checked: u64,
}

/// Median seconds of the stage named `name` (see [`StageTimes::NAMES`]); 0 if there is none.
fn stage(s: &ArmSummary, name: &str) -> f64 {
    StageTimes::NAMES
        .iter()
        .position(|n| *n == name)
        .and_then(|i| s.med_stages.get(i).copied())
        .unwrap_or(0.0)
}

/// Ratios of one arm against its own wire leg and a memcpy of its wire bytes (the columns of
/// the side-by-side table).
struct Ratios {
    /// Median refit end to end over the median wire leg.
    e2e_over_wire: f64,
    /// Median refit end to end over one single-thread memcpy of the arm's wire bytes.
    e2e_over_memcpy: f64,
    /// Seconds one single-thread memcpy of the arm's wire bytes takes at the run's rate.
    memcpy_s: f64,
    /// Median wire leg per GiB of wire bytes.
    wire_s_per_gib: f64,
    /// Median refit end to end per GiB of wire bytes.
    e2e_s_per_gib: f64,
}

impl Ratios {
    fn of(s: &ArmSummary, memcpy_gbps: f64) -> Self {
        let wire = stage(s, "wire");
        let gib = s.wire_bytes as f64 / (1u64 << 30) as f64;
        let memcpy_s = if memcpy_gbps > 0.0 {
            s.wire_bytes as f64 / (memcpy_gbps * 1e9)
        } else {
            0.0
        };
        let over = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        Ratios {
            e2e_over_wire: over(s.med_e2e, wire),
            e2e_over_memcpy: over(s.med_e2e, memcpy_s),
            memcpy_s,
            wire_s_per_gib: over(wire, gib),
            e2e_s_per_gib: over(s.med_e2e, gib),
        }
    }
}

fn arm_json(name: &str, s: &ArmSummary, memcpy: f64, verified: bool) -> serde_json::Value {
    let stages: serde_json::Map<String, serde_json::Value> = StageTimes::NAMES
        .iter()
        .zip(&s.med_stages)
        .map(|(n, v)| (n.to_string(), json!(v)))
        .collect();
    let r = Ratios::of(s, memcpy);
    json!({
        "arm": name,
        "verified": verified,
        "reads": s.reads,
        "coalesced_reads": s.coalesced,
        "wire_bytes": s.wire_bytes,
        "median_wire_s": stage(s, "wire"),
        "wire_min_max_s": [s.wire_min_max.0, s.wire_min_max.1],
        "median_e2e_s": s.med_e2e,
        "e2e_min_max_s": [s.e2e_min_max.0, s.e2e_min_max.1],
        "wire_gbytes_per_s": s.gbps,
        "wire_fraction_of_memcpy": if memcpy > 0.0 { s.gbps / memcpy } else { 0.0 },
        "reads_per_s": if stage(s, "wire") > 0.0 { s.coalesced as f64 / stage(s, "wire") } else { 0.0 },
        "attribution": s.attribution,
        "resliced_bytes": s.resliced_bytes,
        "reslice_gbytes_per_s": s.reslice_gbps,
        "reslice_fraction_of_memcpy": if memcpy > 0.0 { s.reslice_gbps / memcpy } else { 0.0 },
        // Work done as the bytes landed, inside the wire leg (issue 29): the re-slice stage is
        // then 0 and so are its rates.
        "checks_while_on_wire": s.checks_on_wire,
        "reslices_while_on_wire": s.reslices_on_wire,
        "median_stages_s": stages,
        "checked_bytes": s.checked,
        "copy_hashed_bytes": s.copy_hashed,
        "median_verify_s": stage(s, "verify"),
        "e2e_over_wire": r.e2e_over_wire,
        "memcpy_s": r.memcpy_s,
        "e2e_over_memcpy": r.e2e_over_memcpy,
        "wire_s_per_gib": r.wire_s_per_gib,
        "e2e_s_per_gib": r.e2e_s_per_gib,
    })
}

impl Measured {
    fn verified(&self) -> bool {
        self.arms.iter().all(|a| a.2)
    }

    fn find(&self, name: &str) -> Option<&ArmSummary> {
        self.arms.iter().find(|a| a.0 == name).map(|a| &a.1)
    }

    /// Baseline over reshard: end to end and wire leg.
    fn speedups(&self) -> (Option<f64>, Option<f64>) {
        match (self.find("baseline"), self.find("reshard")) {
            (Some(b), Some(r)) => (
                (r.med_e2e > 0.0).then(|| b.med_e2e / r.med_e2e),
                (stage(r, "wire") > 0.0).then(|| stage(b, "wire") / stage(r, "wire")),
            ),
            _ => (None, None),
        }
    }

    /// The reshard arm's end to end over the transport's own wire leg of the same plan.
    fn e2e_over_transport_wire(&self) -> Option<f64> {
        let (r, t) = (self.find("reshard")?, self.transport_wire?);
        (t > 0.0).then(|| r.med_e2e / t)
    }

    /// The run's JSON object: the keys `reshard bench --json` has always printed, and more.
    fn json(&self, updates: u32) -> serde_json::Value {
        let (speedup, wire_speedup) = self.speedups();
        json!({
            "transport_wire_s": self.transport_wire,
            "transport_wire_checked_bytes": self.transport_wire_checked,
            "e2e_over_transport_wire": self.e2e_over_transport_wire(),
            "verified": self.verified(),
            "transport": self.transport,
            "publisher_process": self.remote,
            "preset": self.model.name,
            "layers": self.model.layers,
            "experts": self.model.moe.as_ref().map(|m| m.experts),
            "vocab": self.model.vocab,
            "publishers": self.pubs.to_string(),
            "receivers_topology": self.recv.to_string(),
            "updates": updates,
            "memcpy_bytes": self.ceiling_bytes,
            "memcpy_gbytes_per_s": self.memcpy,
            "speedup_e2e": speedup,
            "speedup_wire": wire_speedup,
            "arms": self.arms.iter().map(|(n, s, ok)| arm_json(n, s, self.memcpy, *ok)).collect::<Vec<_>>(),
        })
    }

    /// Prints the run's table (one column per arm).
    fn print(&self, updates: u32) {
        let memcpy = self.memcpy;
        outln!(
            "bench {} publishers {} -> receivers {} over {}{}: per arm a warm-up + {} measured updates, all ranks",
            crate::describe_model(&self.model),
            self.pubs,
            self.recv,
            self.transport,
            if self.remote {
                " (publishers in another process)"
            } else {
                ""
            },
            updates
        );
        out!("{:<28}", "");
        for (n, _, _) in &self.arms {
            out!("{n:>26}");
        }
        outln!();
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
                        ms(stage(s, "wire")),
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
                Box::new(move |s| {
                    format!("{:.2}x", if memcpy > 0.0 { s.gbps / memcpy } else { 0.0 })
                }),
            ),
            (
                "e2e / wire",
                Box::new(move |s| format!("{:.2}", Ratios::of(s, memcpy).e2e_over_wire)),
            ),
            (
                "e2e / memcpy of wire bytes",
                Box::new(move |s| format!("{:.2}", Ratios::of(s, memcpy).e2e_over_memcpy)),
            ),
            (
                "verify stage, median",
                Box::new(|s| format!("{:.1} ms", ms(stage(s, "verify")))),
            ),
            (
                "re-slice (bytes, median)",
                Box::new(move |s| {
                    format!(
                        "{:.3} GiB, {:.1} ms",
                        gib(s.resliced_bytes),
                        ms(stage(s, "reslice"))
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
            out!("{label:<28}");
            for (_, s, _) in &self.arms {
                out!("{:>26}", f(s));
            }
            outln!();
        }
        outln!(
            "memcpy ceiling (one thread, {:.3} GiB, same run): {memcpy:.2} GB/s",
            gib(self.ceiling_bytes)
        );
        if let (Some(t), Some(x)) = (self.transport_wire, self.e2e_over_transport_wire()) {
            outln!(
                "transport alone (reshard plan, verification off): {:.1} ms wire leg; reshard \
                 e2e / that = {x:.2}",
                ms(t)
            );
        }
        let (speedup, wire_speedup) = self.speedups();
        if let Some(x) = speedup {
            outln!(
                "reshard vs baseline: {x:.2}x end to end, {:.2}x wire leg",
                wire_speedup.unwrap_or(0.0)
            );
        }
        outln!(
            "verified: {}",
            if self.verified() {
                "every parameter of every rank byte-exact and digest-checked at every step of \
                 every arm"
            } else {
                "FAILED"
            }
        );
    }
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn ms(s: f64) -> f64 {
    s * 1e3
}

/// Runs `reshard bench`.
pub fn run(args: BenchArgs) -> Result<Outcome> {
    crate::block_on(bench(args))
}

/// The points `args` asks for, and the registered backends `--transport all` skips. Every
/// point's model is resolved here, so a bad sweep value fails before anything is measured.
fn points(args: &BenchArgs) -> Result<(Vec<Point>, Vec<Skipped>)> {
    let models: Vec<ModelArgs> = match &args.sweep {
        None => vec![args.model.clone()],
        Some(s) => {
            let sweep: Sweep = s.parse()?;
            if let Some(v) = sweep.key.given(&args.model) {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "--sweep {s} and --{} {v} both set {}: give one",
                        sweep.key.name(),
                        sweep.key.name()
                    ),
                ));
            }
            sweep
                .values
                .iter()
                .map(|&v| sweep.key.apply(&args.model, v))
                .collect()
        }
    };
    for m in &models {
        resolve_scaled(m)?;
    }
    let mut skipped = Vec::new();
    let transports: Vec<Option<String>> = match args.transport.as_deref() {
        Some(ALL_TRANSPORTS) => {
            let registry = reshard::registry();
            let mut ok = Vec::new();
            for scheme in registry.schemes() {
                match registry.probe(scheme) {
                    Ok(()) => ok.push(Some(scheme.to_string())),
                    Err(e) => skipped.push(Skipped {
                        transport: scheme.to_string(),
                        reason: e.to_string(),
                    }),
                }
            }
            ok
        }
        other => vec![other.map(str::to_string)],
    };
    let points = transports
        .iter()
        .flat_map(|t| {
            models.iter().map(move |m| Point {
                transport: t.clone(),
                model: m.clone(),
            })
        })
        .collect();
    Ok((points, skipped))
}

/// Where one point's publishers live: `--publisher-process` when given (a backend that cannot
/// reach another process keeps them here under `--transport all`); by default here, or with
/// `--transport all` in a child process for every backend that can reach one, as the issue's
/// table was measured.
fn place_for(args: &BenchArgs, cfg: &Config) -> Result<PublisherPlace> {
    let all = args.transport.as_deref() == Some(ALL_TRANSPORTS);
    match (args.place, all) {
        (Some(PublisherPlace::Local), _) => Ok(PublisherPlace::Local),
        (Some(p), false) => Ok(p),
        (None, false) => Ok(PublisherPlace::Local),
        (_, true) => {
            // The backend's own word on whether peers may live in other processes: an
            // endpoint's capabilities, dropped before the publishers start.
            let probe = reshard::registry()
                .create("bench-capabilities", &cfg.transport)?
                .capabilities();
            Ok(if probe.cross_process {
                PublisherPlace::Process
            } else {
                PublisherPlace::Local
            })
        }
    }
}

/// Measures every arm of `args` at one point.
async fn measure(args: &BenchArgs, point: &Point) -> Result<Measured> {
    let cfg = crate::load_config(point.transport.as_deref(), args.config.as_deref())?;
    let opts: Vec<(String, ReceiverOptions)> = args
        .arms
        .iter()
        .map(|a| Ok((a.clone(), arm_options(a, &cfg)?)))
        .collect::<Result<_>>()?;
    let place = place_for(args, &cfg)?;
    let Bench {
        registry,
        model,
        pubs,
        recv,
        mut cluster,
    } = start_bench(
        &cfg,
        args.config.as_deref(),
        &point.model,
        PublisherSetup {
            place,
            // Replicas share memory so the default EP8 x DP8 rig fits beside the receivers.
            placement: reshard_testkit::Placement::SharedReplicas,
            seed: args.seed,
        },
    )
    .await?;
    let per_arm = (args.updates as u64 + 1) * recv.world() as u64;
    // The reshard arm once more without verification: the transport's own wire leg.
    let bare = opts
        .iter()
        .find(|(n, _)| n == "reshard")
        .map(|(_, o)| ReceiverOptions {
            verify_digests: false,
            ..o.clone()
        });
    let runs = opts.len() as u64 + u64::from(bare.is_some());
    let bar = progress(per_arm * runs, args.json, "bench");
    let mut arms = Vec::new();
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
        arms.push((name.clone(), summarize(&run, args.updates), run.verified));
    }
    let (mut transport_wire, mut transport_wire_checked) = (None, 0);
    if let Some(o) = bare {
        let run = run_arm(
            &registry,
            &mut cluster,
            &cfg,
            &recv,
            o,
            args.updates,
            step,
            &bar,
        )
        .await?;
        let bare = summarize(&run, args.updates);
        transport_wire = Some(stage(&bare, "wire"));
        transport_wire_checked = bare.checked;
    }
    bar.finish_and_clear();
    let remote = cluster.is_remote();
    // The publishers' memory is released before the ceiling's two buffers are allocated, so a
    // large sweep point does not hold both.
    drop(cluster);
    let ceiling_bytes = arms.iter().map(|r| r.1.wire_bytes).min().unwrap_or(0);
    let memcpy = memcpy_gbps(ceiling_bytes);
    Ok(Measured {
        transport: cfg.transport.kind.clone(),
        remote,
        model,
        pubs,
        recv,
        arms,
        ceiling_bytes,
        memcpy,
        transport_wire,
        transport_wire_checked,
    })
}

async fn bench(args: BenchArgs) -> Result<Outcome> {
    // Arm names are checked before anything starts.
    for a in &args.arms {
        arm_options(a, &Config::default())?;
    }
    let (points, skipped) = points(&args)?;
    let multi = args.sweep.is_some() || args.transport.as_deref() == Some(ALL_TRANSPORTS);
    let mut runs = Vec::new();
    for p in &points {
        let m = measure(&args, p).await.map_err(|e| match &p.transport {
            Some(t) if multi => e.with_backend(t.clone()),
            _ => e,
        })?;
        if !args.json {
            if multi {
                outln!();
            }
            m.print(args.updates);
        }
        runs.push(m);
    }
    let verified = !runs.is_empty() && runs.iter().all(Measured::verified);
    if !multi {
        if let (Some(m), true) = (runs.first(), args.json) {
            outln!(
                "{}",
                serde_json::to_string_pretty(&m.json(args.updates)).unwrap_or_default()
            );
        }
        return Ok(Outcome(verified));
    }
    let sweep = match &args.sweep {
        Some(s) => {
            let s: Sweep = s.parse()?;
            json!({"key": s.key.name(), "values": s.values})
        }
        None => serde_json::Value::Null,
    };
    if args.json {
        let v = json!({
            "verified": verified,
            "sweep": sweep,
            "transports": runs.iter().map(|m| m.transport.clone()).fold(Vec::<String>::new(), |mut v, t| {
                if !v.contains(&t) {
                    v.push(t);
                }
                v
            }),
            "skipped": skipped.iter().map(|s| json!({"transport": s.transport, "reason": s.reason})).collect::<Vec<_>>(),
            "updates": args.updates,
            "runs": runs.iter().map(|m| m.json(args.updates)).collect::<Vec<_>>(),
        });
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(Outcome(verified));
    }
    outln!();
    print_summary(&runs, &skipped);
    Ok(Outcome(verified))
}

/// The side-by-side table of a multi-run bench: one row per run and arm.
fn print_summary(runs: &[Measured], skipped: &[Skipped]) {
    outln!(
        "side by side (per update, all ranks; ratios within each run; cost per GiB of wire bytes)"
    );
    outln!(
        "{:<10} {:>7} {:>8} {:>9} {:>10} {:>10} {:>9} {:>9} {:>10} {:>10} {:>9} {:>11} {:>11} {:>10}",
        "transport",
        "layers",
        "experts",
        "arm",
        "wire GiB",
        "wire ms",
        "e2e ms",
        "e2e/wire",
        "wire/memcpy",
        "e2e/memcpy",
        "verify ms",
        "wire ms/GiB",
        "e2e ms/GiB",
        "e2e/xport"
    );
    for m in runs {
        for (name, s, _) in &m.arms {
            let r = Ratios::of(s, m.memcpy);
            outln!(
                "{:<10} {:>7} {:>8} {:>9} {:>10.3} {:>10.1} {:>9.1} {:>9.2} {:>10.2}x {:>10.2} {:>9.1} {:>11.1} {:>11.1} {:>10}",
                m.transport,
                m.model.layers,
                m.model
                    .moe
                    .as_ref()
                    .map(|x| x.experts.to_string())
                    .unwrap_or_else(|| "-".into()),
                name,
                gib(s.wire_bytes),
                ms(stage(s, "wire")),
                ms(s.med_e2e),
                r.e2e_over_wire,
                if m.memcpy > 0.0 { s.gbps / m.memcpy } else { 0.0 },
                r.e2e_over_memcpy,
                ms(stage(s, "verify")),
                ms(r.wire_s_per_gib),
                ms(r.e2e_s_per_gib),
                // The reshard arm against the transport alone moving its plan.
                match (name.as_str(), m.e2e_over_transport_wire()) {
                    ("reshard", Some(x)) => format!("{x:.2}"),
                    _ => "-".into(),
                },
            );
        }
    }
    for s in skipped {
        outln!("{:<10} skipped: {}", s.transport, s.reason);
    }
    outln!(
        "verified: {}",
        if runs.iter().all(Measured::verified) {
            "every run, every arm, every step byte-exact and digest-checked"
        } else {
            "FAILED"
        }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_parses_a_key_and_its_values() {
        let s: Sweep = "layers=1,2, 4,8".parse().expect("sweep");
        assert_eq!(s.key, SweepKey::Layers);
        assert_eq!(s.values, vec![1, 2, 4, 8]);
        let s: Sweep = "experts=8".parse().expect("sweep");
        assert_eq!((s.key, s.values), (SweepKey::Experts, vec![8]));
    }

    #[test]
    fn a_bad_sweep_is_typed_and_names_what_is_wrong() {
        for (input, names) in [
            ("layers", "no '='"),
            ("heads=1,2", "unknown key \"heads\""),
            ("layers=1,two", "\"two\""),
            ("layers=", "\"\""),
            ("layers=1,-2", "\"-2\""),
        ] {
            let e = input.parse::<Sweep>().expect_err(input);
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{input}");
            assert!(e.message().contains(names), "{input}: {e}");
            assert!(e.message().contains("layers=1,2,4,8"), "{input}: {e}");
        }
    }
}
