//! The refit rig shared by the CLI (`refit`, `bench`, `soak`), the benches and the conformance
//! suite: it starts synthetic publishers (in this process or in a child process), connects
//! receiver ranks to them over endpoints of one transport, and runs a warm-up plus measured
//! updates, each verified byte-exact against the generator's reference. Owning this once keeps
//! the three callers measuring and verifying the same thing.

use std::process::Command;
use std::sync::Arc;

use reshard_core::{Error, ErrorKind, HostBuffer, Result, Transport, WantedLayout};
use reshard_planner::layouts::ReceiverLayouts;
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_runtime::{Receiver, ReceiverOptions, UpdateReport};

use crate::remote::DEFAULT_TIMEOUT;
use crate::{Placement, Publishers, RemoteCluster, SyntheticCluster};

/// Where a rig's publishers run.
pub enum PublisherSite {
    /// In this process, each rank on its own endpoint.
    Local,
    /// In a child process started by this command, which must end up calling
    /// [`crate::remote::serve`] with endpoints of the same transport.
    Process(Command),
}

/// Starts publishers of `model` under `topo` with weights from `seed`, memory placed as
/// `placement` says, at `site`; local ranks get endpoints from `make("publisher-{rank}")`.
pub async fn start_publishers(
    model: ModelConfig,
    topo: PublisherTopology,
    seed: u64,
    placement: Placement,
    site: PublisherSite,
    make: impl Fn(&str) -> Result<Arc<dyn Transport>>,
) -> Result<Publishers> {
    Ok(match site {
        PublisherSite::Local => {
            Publishers::local(
                SyntheticCluster::with_placement(model, topo, seed, placement, |rank| {
                    make(&format!("publisher-{rank}"))
                })
                .await?,
            )
            .await?
        }
        PublisherSite::Process(cmd) => {
            Publishers::remote(
                // Spawning and the first reply block; keep them off the runtime's workers.
                tokio::task::spawn_blocking(move || {
                    RemoteCluster::spawn_with_placement(
                        cmd,
                        model,
                        topo,
                        seed,
                        placement,
                        DEFAULT_TIMEOUT,
                    )
                })
                .await
                .map_err(|e| Error::new(ErrorKind::Internal, format!("spawn task: {e}")))??,
            )
            .await?
        }
    })
}

/// A receiver for `layout` over `transport`, which first loads every publisher's metadata as
/// the rig's rendezvous announces it.
pub async fn connect_receiver(
    cluster: &Publishers,
    transport: Arc<dyn Transport>,
    layout: WantedLayout,
    opts: ReceiverOptions,
) -> Result<Receiver> {
    cluster.connect(transport.as_ref()).await?;
    Receiver::new(transport, layout, opts)
}

/// Every rank of `recv` for `cluster`'s model, rank `r` on the endpoint `make("receiver-{r}")`.
pub async fn connect_receivers(
    cluster: &Publishers,
    recv: &ReceiverTopology,
    opts: &ReceiverOptions,
    make: impl Fn(&str) -> Result<Arc<dyn Transport>>,
) -> Result<Vec<Receiver>> {
    let layouts = ReceiverLayouts::new(cluster.model(), recv)?;
    let mut receivers = Vec::with_capacity(recv.world() as usize);
    for rank in 0..recv.world() {
        let t = make(&format!("receiver-{rank}"))?;
        receivers.push(connect_receiver(cluster, t, layouts.layout(rank)?, opts.clone()).await?);
    }
    Ok(receivers)
}

/// One message per live parameter of `layout` whose bytes differ from `want` (the reference):
/// what turns a refit's exit code into 1.
pub fn differing_params(
    layout: &WantedLayout,
    live: &[Arc<HostBuffer>],
    want: &[Vec<u8>],
    step: u64,
    rank: u32,
) -> Vec<String> {
    layout
        .params
        .iter()
        .zip(live)
        .zip(want)
        .filter(|((_, got), want)| got.read()[..] != want[..])
        .map(|((p, _), _)| {
            format!(
                "step {step} rank {rank}: parameter {} differs from the reference",
                p.name
            )
        })
        .collect()
}

/// What a rig reports while it runs, so callers can draw progress or sample resources.
pub enum RigEvent<'a> {
    /// The publishers are about to publish training step `step`.
    Publishing {
        /// The step.
        step: u64,
    },
    /// Receiver `rank` is about to refit to step `step`.
    Updating {
        /// The step.
        step: u64,
        /// The receiver rank.
        rank: u32,
    },
    /// Receiver `rank` refit and was verified; `update` 0 is the warm-up.
    Updated {
        /// Index of the update (0 = warm-up).
        update: u64,
        /// The receiver rank.
        rank: u32,
        /// Its report.
        report: &'a UpdateReport,
    },
    /// Every receiver rank finished update `update`.
    StepDone {
        /// Index of the update (0 = warm-up).
        update: u64,
    },
}

/// Every receiver rank's reports of one run, and whether every update verified.
pub struct RigRun {
    /// Measured updates per receiver rank (the warm-up is not kept).
    pub reports: Vec<Vec<UpdateReport>>,
    /// Every parameter of every rank byte-exact at every step, and every installed byte
    /// matched a publisher digest ([`UpdateReport::fully_checked`]).
    pub verified: bool,
    /// Every parameter of every rank byte-exact at every step (against the generator's
    /// reference, which no deployment has).
    pub byte_exact: bool,
    /// What went wrong: parameters that differ, and updates that installed bytes no digest
    /// checked although their receiver verifies digests (a receiver told not to verify
    /// installs unchecked bytes by choice: not a failure, but not `verified` either).
    pub failures: Vec<String>,
}

/// Runs a warm-up and `updates` measured updates on `receivers` (ranks one after another), the
/// publishers advancing one training step per update from `first_step`; each update verified
/// against the generator's reference.
pub async fn run_updates(
    cluster: &mut Publishers,
    receivers: &mut [Receiver],
    updates: u32,
    first_step: u64,
    mut on_event: impl FnMut(RigEvent<'_>),
) -> Result<RigRun> {
    let mut run = RigRun {
        reports: vec![Vec::new(); receivers.len()],
        verified: true,
        byte_exact: true,
        failures: Vec::new(),
    };
    for update in 0..=updates as u64 {
        let step = first_step + update;
        if step != cluster.step() {
            on_event(RigEvent::Publishing { step });
            cluster.publish_step(step)?;
        }
        cluster.announce().await?;
        for (i, rx) in receivers.iter_mut().enumerate() {
            let rank = rx.layout().receiver_rank;
            on_event(RigEvent::Updating { step, rank });
            // Each receiver takes the step's encoded tables from the rendezvous, as a deployed
            // receiver does; decoding them is the receiver's discover stage.
            let encoded = cluster
                .meeting()
                .tables(step.checked_sub(1), rx.transport().as_ref())
                .await?;
            let report = rx.update_encoded(&encoded).await?;
            let want = cluster.expected_params(rx.layout())?;
            let live = rx
                .live_params()
                .ok_or_else(|| Error::new(ErrorKind::Internal, "no live weights after a refit"))?;
            let failures = differing_params(rx.layout(), live, &want, step, rank);
            run.byte_exact &= failures.is_empty();
            run.verified &= failures.is_empty() && report.fully_checked();
            run.failures.extend(failures);
            if !report.fully_checked() && rx.options().verify_digests {
                run.failures.push(format!(
                    "rank {rank} step {step}: {} of {} bytes on the wire were not checked \
                     against a publisher digest ({} checks had no digest)",
                    report.wire_bytes.saturating_sub(report.checked_bytes),
                    report.wire_bytes,
                    report.checks_without_digest
                ));
            }
            on_event(RigEvent::Updated {
                update,
                rank,
                report: &report,
            });
            if update > 0 {
                run.reports[i].push(report);
            }
        }
        on_event(RigEvent::StepDone { update });
    }
    Ok(run)
}
