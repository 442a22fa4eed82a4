//! Shared measurement code of the criterion benches and the `reshard-report` command.
pub mod wire;

use std::sync::Arc;
use std::time::Instant;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::{dedup, merge, DedupOptions, MergedTable, Result, Transport, WantedLayout};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::plan::{plan, PlanOptions};
use reshard_planner::presets::{preset, ModelConfig};
use reshard_planner::topology::{geometry_tables, ReceiverTopology};
use reshard_runtime::{Receiver, ReceiverOptions};
use reshard_testkit::rig::{self, PublisherSite};
use reshard_testkit::{Placement, Publishers};

/// The docs/design.md §8 setup at full scale, geometry only: deduplicated table and both TP2
/// layouts.
pub fn reference_geometry() -> Result<(MergedTable, Vec<WantedLayout>)> {
    let model = preset("qwen3-30b-a3b")?;
    let tables = geometry_tables(&model, &"ep=8,dp=8".parse()?, 0)?;
    let table = dedup(&merge(&tables)?, DedupOptions::default())?.0;
    let layouts = (0..2)
        .map(|r| receiver_layout(&model, &ReceiverTopology::tp(2), r))
        .collect::<Result<Vec<_>>>()?;
    Ok((table, layouts))
}

/// Plans every layout once; returns seconds.
pub fn time_plans(table: &MergedTable, layouts: &[WantedLayout]) -> Result<f64> {
    let t = Instant::now();
    for l in layouts {
        std::hint::black_box(plan(table, l, &PlanOptions::default())?);
    }
    Ok(t.elapsed().as_secs_f64())
}

/// An in-process refit set-up over loopback: publishers and one receiver rank.
pub struct LoopbackRig {
    /// The publishers.
    pub cluster: Publishers,
    /// Receiver rank 0.
    pub receiver: Receiver,
}

impl LoopbackRig {
    /// Builds publishers of `model` under `topo` and receiver rank 0 of a TP-`tp` engine.
    pub async fn new(
        model: ModelConfig,
        topo: &str,
        tp: u32,
        workers: usize,
        opts: ReceiverOptions,
    ) -> Result<Self> {
        let fabric = LoopbackFabric::new();
        let make = |agent: &str| {
            Ok(Arc::new(LoopbackTransport::new(&fabric, agent, workers)?) as Arc<dyn Transport>)
        };
        // Replicas share memory so large EP x DP rigs fit beside the receivers.
        let cluster = rig::start_publishers(
            model,
            topo.parse()?,
            7,
            Placement::SharedReplicas,
            PublisherSite::Local,
            make,
        )
        .await?;
        let layout = receiver_layout(cluster.model(), &ReceiverTopology::tp(tp), 0)?;
        let receiver = rig::connect_receiver(&cluster, make("receiver")?, layout, opts).await?;
        Ok(LoopbackRig { cluster, receiver })
    }
}
