//! `reshard receive`: one receiver rank as its own process (docs/deployment.md). It discovers
//! the model's publishers through the rendezvous, plans once, and refits every new step,
//! verified against the publishers' digests; a failed refit leaves the live weights and step
//! untouched, is reported, and the next step is waited for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use reshard_core::rendezvous::{backoff, RETRY_FIRST};
use reshard_core::{Error, ErrorDetail, ErrorKind, Result, Transport};
use reshard_planner::topology::ReceiverTopology;
use reshard_runtime::{ReceiverOptions, StepReport, Subscriber};

use crate::rendezvous_arg::{connect, RendezvousArgs, TransportArgs};
use crate::Outcome;

/// Flags of `reshard receive`.
#[derive(Args)]
pub struct ReceiveArgs {
    #[command(flatten)]
    rendezvous: RendezvousArgs,
    /// Model name publishers and receivers meet under.
    #[arg(long)]
    model: String,
    /// The inference engine's layout, e.g. `tp=2`.
    #[arg(long)]
    receivers: String,
    /// This process's receiver rank.
    #[arg(long)]
    rank: u32,
    #[command(flatten)]
    transport: TransportArgs,
    /// Exit 0 after this many verified steps (default: run until killed).
    #[arg(long)]
    steps: Option<u64>,
    /// Seconds to wait for the publishers, and then for each new step.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// Print one JSON line per step (installed or failed).
    #[arg(long)]
    json: bool,
    /// Write each installed step's weights (this rank's parameters, engine naming) as
    /// `DIR/step-N/model.safetensors`, and after the n-th failed refit the weights still live
    /// as `DIR/failure-n/model.safetensors` (its `reshard_step` metadata names the step).
    #[arg(long)]
    dump: Option<PathBuf>,
}

/// Runs the receiver until `--steps` verified steps (or forever).
pub fn run(args: ReceiveArgs) -> Result<Outcome> {
    crate::block_on(receive(args))
}

fn installed_json(r: &StepReport) -> serde_json::Value {
    let u = &r.update;
    serde_json::json!({
        "step": r.step,
        // Installed, and every installed byte matched a publisher digest.
        "verified": u.fully_checked(),
        "reads": u.wire_reads,
        "wire_bytes": u.wire_bytes,
        "stages_s": u.stages,
        "e2e_s": u.e2e_s,
        "attribution": u.attribution,
        "discovery_s": r.discovery_s,
        "peers_loaded": r.peers_loaded,
        "plan_rebuilt": u.plan_rebuilt,
        "checked_bytes": u.checked_bytes,
        // Rendezvous failures discovery waited through for this step (etcd down, a member
        // withdrawn mid-discovery), one line per distinct failure with its count.
        "waited_through": r.waited_through,
    })
}

fn failed_json(e: &Error, live: Option<u64>) -> serde_json::Value {
    serde_json::json!({
        "step": serde_json::Value::Null,
        "verified": false,
        "live_step": live,
        "error": {
            "kind": e.kind().as_str(),
            "message": e.to_string(),
            "owner": e.context().owner,
            "tensor": e.context().tensor,
        },
    })
}

/// Writes the live parameters (of step `step`) as one safetensors file under `dir/sub`.
fn dump(sub: &Subscriber, dir: &Path, folder: &str, step: u64) -> Result<PathBuf> {
    let io = |what: &str, e: &dyn std::fmt::Display| {
        Error::new(
            ErrorKind::InvalidInput,
            format!("--dump: cannot {what}: {e}"),
        )
    };
    let params = sub
        .receiver()
        .live_params()
        .ok_or_else(|| Error::new(ErrorKind::Internal, "--dump: no weights are live"))?;
    let layout = sub.receiver().layout();
    let folder = dir.join(folder);
    std::fs::create_dir_all(&folder).map_err(|e| io("create the folder", &e))?;
    let guards: Vec<_> = params.iter().map(|p| p.read()).collect();
    let mut views = Vec::with_capacity(layout.params.len());
    for (p, g) in layout.params.iter().zip(&guards) {
        let shape: Vec<usize> = p.shape.iter().map(|&d| d as usize).collect();
        let view = safetensors::tensor::TensorView::new(
            reshard_checkpoint::config::safetensors_dtype(p.dtype),
            shape,
            &g[..],
        )
        .map_err(|e| io("describe a parameter", &e))?;
        views.push((p.name.clone(), view));
    }
    let meta = HashMap::from([("reshard_step".to_string(), step.to_string())]);
    let path = folder.join("model.safetensors");
    let tmp = folder.join("model.safetensors.tmp");
    safetensors::tensor::serialize_to_file(views, &Some(meta), &tmp)
        .map_err(|e| io("write the file", &e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io("rename the file", &e))?;
    Ok(path)
}

/// Says that discovery failed with `e` (not in time: the caller's deadline is still ahead) and
/// that the receiver waits and looks again; live weights stay as they are.
fn waiting(args: &ReceiveArgs, e: &Error, live: Option<u64>) {
    if args.json {
        let mut v = failed_json(e, live);
        v["event"] = "waiting".into();
        outln!("{v}");
    } else {
        eprintln!(
            "receiver rank {}: waiting for the publishers, step {live:?} stays live: {e}",
            args.rank
        );
    }
}

/// Pause after a discovery failure that is not a timeout, before looking again.
const RETRY: Duration = Duration::from_secs(1);

/// Retries `attempt` while it fails, reporting each failure, until `deadline`; the last failure
/// (or the timeout) is returned then.
async fn until<T, F, Fut>(
    args: &ReceiveArgs,
    deadline: Instant,
    live: Option<u64>,
    mut attempt: F,
) -> Result<T>
where
    F: FnMut(Duration) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match attempt(left).await {
            Ok(v) => return Ok(v),
            // Only the deadline ends the wait: a request or a connection attempt that timed out
            // (an etcd that is down or unreachable at start) is one more failure to wait
            // through, not the receiver's own timeout.
            Err(e) if Instant::now() + RETRY >= deadline => return Err(e),
            Err(e) => {
                waiting(args, &e, live);
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

async fn receive(args: ReceiveArgs) -> Result<Outcome> {
    let cfg = args.transport.load()?;
    let topology: ReceiverTopology = args.receivers.parse()?;
    let timeout = Duration::from_secs(args.timeout_s);
    // Nothing the rendezvous does ends this process before its own timeout (docs/deployment.md
    // §2, "Faults discovery waits through"): an etcd that is down at start, or publishers that
    // disagree until one of them is replaced, is reported and waited through.
    let deadline = Instant::now() + timeout;
    let rendezvous = until(&args, deadline, None, |_| connect(&args.rendezvous)).await?;
    let registry = reshard::registry();
    let agent = format!("{}-receiver-{}", args.model, args.rank);
    let transport: Arc<dyn Transport> = registry.create(&agent, &cfg.transport)?;
    let options = ReceiverOptions::from_config(&cfg);
    let mut sub = until(&args, deadline, None, |left| {
        Subscriber::connect(
            rendezvous.clone(),
            &args.model,
            transport.clone(),
            &topology,
            args.rank,
            options.clone(),
            left,
        )
    })
    .await?;
    let mut verified = 0u64;
    let mut failures = 0u64;
    // While the sets found keep moving on before their reads begin, no new step came: the
    // deadline stays the one set before the first of them, and each retry pauses longer
    // (`backoff`), so such sets cost a few rendezvous requests a second until the timeout.
    let mut moved_on: Option<(Instant, Duration)> = None;
    while args.steps.is_none_or(|n| verified < n) {
        // No new step in time ends the receiver; a failed refit of a step it found does not,
        // nor does a rendezvous failure while there is time left.
        let live = sub.receiver().live_step();
        let deadline = moved_on.map_or_else(|| Instant::now() + timeout, |(d, _)| d);
        let found = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match sub.discover_next(left).await {
                Ok(f) => break f,
                Err(e) if Instant::now() + RETRY >= deadline => return Err(e),
                Err(e) => {
                    waiting(&args, &e, live);
                    tokio::time::sleep(RETRY).await;
                }
            }
        };
        match sub.install(found).await {
            // The publishers moved on between discovery and the reader's claim (one began to
            // rewrite its memory): nothing was read; discover again after a pause.
            Err(e) if matches!(e.detail(), Some(ErrorDetail::MovedOn { .. })) => {
                if Instant::now() >= deadline {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "receiver rank {}: no new step within {} s: every set found moved \
                             on before its reads began; the last: {e}",
                            args.rank, args.timeout_s
                        ),
                    ));
                }
                let (_, pause) = moved_on.get_or_insert((deadline, RETRY_FIRST));
                backoff(pause, deadline).await;
                continue;
            }
            Ok(report) => {
                verified += 1;
                if let Some(dir) = &args.dump {
                    dump(&sub, dir, &format!("step-{}", report.step), report.step)?;
                }
                if args.json {
                    outln!("{}", installed_json(&report));
                } else {
                    eprintln!(
                        "receiver rank {}: installed step {} ({} reads, {:.1} MiB, {:.3} s)",
                        args.rank,
                        report.step,
                        report.update.wire_reads,
                        report.update.wire_bytes as f64 / (1u64 << 20) as f64,
                        report.update.e2e_s
                    );
                }
            }
            Err(e) => {
                let live = sub.receiver().live_step();
                failures += 1;
                // What is live after the failure, read from memory, so a fault test sees that
                // no weight was lost rather than trusting the dump of the step's install.
                let after = match (&args.dump, live) {
                    (Some(dir), Some(step)) => {
                        Some(dump(&sub, dir, &format!("failure-{failures}"), step)?)
                    }
                    _ => None,
                };
                if args.json {
                    let mut v = failed_json(&e, live);
                    if let Some(path) = after {
                        v["dump"] = path.display().to_string().into();
                    }
                    outln!("{v}");
                } else {
                    eprintln!(
                        "receiver rank {}: refit failed, step {live:?} stays live: {e}",
                        args.rank
                    );
                }
                // Give a dead publisher's lease time to expire before looking again.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        // A refit came to an end (installed or failed): the next step has its own deadline.
        moved_on = None;
    }
    Ok(Outcome(true))
}
