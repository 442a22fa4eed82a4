//! The harness a backend hands the suite, and the small models and topologies the checks use.

use std::process::Command;
use std::sync::Arc;

use reshard_core::{Result, Transport};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_runtime::{Receiver, ReceiverOptions};
use reshard_testkit::rig::{self, PublisherSite};
use reshard_testkit::{Placement, Publishers as Cluster};

/// Creates transport endpoints of the backend under test, by agent name.
pub type MakeTransport = dyn Fn(&str) -> Result<Arc<dyn Transport>> + Send + Sync;

/// Makes the command that starts a publisher process (see [`crate::remote`]).
pub type MakeCommand = dyn Fn() -> Command + Send + Sync;

/// What a backend gives the suite: a name, a way to make endpoints on one shared fabric, and
/// optionally a way to start publishers in another process.
#[derive(Clone)]
pub struct Harness {
    name: String,
    make: Arc<MakeTransport>,
    publisher_process: Option<Arc<MakeCommand>>,
    known_defects: Vec<(String, String)>,
}

impl Harness {
    /// A harness for `name` whose endpoints come from `make(agent)`.
    pub fn new(
        name: impl Into<String>,
        make: impl Fn(&str) -> Result<Arc<dyn Transport>> + Send + Sync + 'static,
    ) -> Self {
        Harness {
            name: name.into(),
            make: Arc::new(make),
            publisher_process: None,
            known_defects: Vec::new(),
        }
    }

    /// Marks `check` as failing on this backend for `reason` (an open defect): the check must
    /// then fail, and the test fails the day it passes, so the mark cannot outlive the defect.
    /// Marks are listed in conformance/README.md, "What the suite proves".
    pub fn with_known_defect(mut self, check: &str, reason: &str) -> Self {
        self.known_defects.push((check.into(), reason.into()));
        self
    }

    /// The reason `check` is marked as a known defect here, if it is.
    pub fn known_defect(&self, check: &str) -> Option<&str> {
        self.known_defects
            .iter()
            .find(|(c, _)| c == check)
            .map(|(_, r)| r.as_str())
    }

    /// Puts every cluster's publishers in a child process started by `command()`, which must
    /// end up calling [`reshard_testkit::remote::serve`] with this backend's endpoints.
    pub fn with_publisher_process(
        mut self,
        command: impl Fn() -> Command + Send + Sync + 'static,
    ) -> Self {
        self.publisher_process = Some(Arc::new(command));
        self
    }

    /// True when clusters live in a child process.
    pub fn is_cross_process(&self) -> bool {
        self.publisher_process.is_some()
    }

    /// Backend name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A new endpoint.
    pub fn endpoint(&self, agent: &str) -> Result<Arc<dyn Transport>> {
        (self.make)(agent)
    }

    /// Publishers for `model` under `topo`, each on its own endpoint with its own memory and
    /// layout ([`Placement::PerRank`]), in this process or in a child process (see
    /// [`Harness::with_publisher_process`]).
    pub async fn cluster(&self, model: ModelConfig, topo: &str) -> Cluster {
        self.cluster_placed(model, topo, Placement::PerRank).await
    }

    /// [`Self::cluster`] with the publishers' memory placed as `placement` says.
    pub async fn cluster_placed(
        &self,
        model: ModelConfig,
        topo: &str,
        placement: Placement,
    ) -> Cluster {
        let topo: PublisherTopology = topo.parse().expect("valid publisher topology");
        let site = match &self.publisher_process {
            Some(command) => PublisherSite::Process(command()),
            None => PublisherSite::Local,
        };
        rig::start_publishers(model, topo, 42, placement, site, |agent| (self.make)(agent))
            .await
            .expect("publishers")
    }

    /// Receiver rank `rank` of a TP-`tp` engine over `transport`, connected to `cluster`.
    pub async fn receiver_on(
        &self,
        cluster: &Cluster,
        transport: Arc<dyn Transport>,
        tp: u32,
        rank: u32,
        opts: ReceiverOptions,
    ) -> Receiver {
        let layout = receiver_layout(cluster.model(), &ReceiverTopology::tp(tp), rank)
            .expect("receiver layout");
        rig::connect_receiver(cluster, transport, layout, opts)
            .await
            .expect("receiver")
    }

    /// Receiver rank `rank` of a TP-`tp` engine on a fresh endpoint.
    pub async fn receiver(&self, cluster: &Cluster, tp: u32, rank: u32) -> Receiver {
        let t = self
            .endpoint(&format!("receiver-{rank}-of-{tp}"))
            .expect("receiver endpoint");
        self.receiver_on(cluster, t, tp, rank, ReceiverOptions::default())
            .await
    }
}

/// A small dense GQA model (Llama-shaped) with `kv_heads` KV heads: [`reshard_testkit::models`].
pub fn tiny_dense(kv_heads: u64) -> ModelConfig {
    reshard_testkit::models::tiny_dense(kv_heads)
}

/// The small MoE model with 16 experts: [`reshard_testkit::models::tiny_moe`].
pub fn tiny_moe() -> ModelConfig {
    reshard_testkit::models::tiny_moe(16)
}
