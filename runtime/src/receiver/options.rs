//! [`ReceiverOptions`]: how a receiver plans, verifies and installs, read from the `[planner]`
//! and `[receiver]` config sections; the "arm" of options a cached plan depends on; and the
//! wire-leg policy layers the options compose.

use std::sync::Arc;
use std::time::Duration;

use reshard_core::config::Config;
use reshard_core::Transport;
use reshard_planner::plan::PlanOptions;

use crate::layers::{self, Layer, PostLimitLayer, RetryLayer, TimeoutLayer, WavesLayer};

/// How a receiver plans, verifies and installs.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceiverOptions {
    /// Replica dedup (off only for the benchmark counterfactual).
    pub dedup: bool,
    /// Spread owners across replicas by receiver rank.
    pub spread_owners: bool,
    /// Planner options (full-pull threshold; overlap is allowed automatically without dedup).
    pub plan: PlanOptions,
    /// Check installed bytes against publisher digests.
    pub verify_digests: bool,
    /// Fabric ceiling in Gbit/s; a faster wire leg fails the update before install.
    pub max_wire_gbps: Option<f64>,
    /// Minimum fraction of parameter bytes the plan must write.
    pub min_coverage: Option<f64>,
    /// Re-slice full pulls in one parallel pass (false: one copy at a time, the baseline).
    pub batched_reslice: bool,
    /// Reuse descriptors across updates (false: rebuild every update, the baseline).
    pub cache_descriptors: bool,
    /// Run digest checks and re-slices as the bytes land, while the rest of the batch is on
    /// the wire (with dedup and batched re-slice; re-slices whose destinations may overlap run
    /// per parameter in plan order); false: after the wire leg, in stages of their own (the
    /// baseline's order, and what a benchmark of the re-slice stage alone measures).
    /// `[receiver] verify_while_landing`.
    pub verify_while_landing: bool,
    /// With checks run as the bytes land: hand the backend the digest segments of each read
    /// (a [`reshard_core::HashPlan`]), so a backend that copies with its own CPU hashes them
    /// right after copying them and a check folds those hashes instead of reading its bytes
    /// again (docs/in-flight-safety.md, "Hashing while copying"); false: every check hashes
    /// its bytes from the destination. `[receiver] hash_while_copying`.
    pub hash_while_copying: bool,
    /// Times a wire leg failing with a retryable error is posted again (reads only write the
    /// bank that is not live, so repeating them is safe).
    /// (the receiver's [`RetryLayer`]).
    pub retries: u32,
    /// Backoff before the first retry, doubled for each further one.
    pub retry_backoff: Duration,
    /// Bound on one wire leg with its retries; past it the leg fails with `Timeout` and
    /// [`ErrorDetail::WireLegTimedOut`](reshard_core::ErrorDetail::WireLegTimedOut) (the receiver's [`TimeoutLayer`], outside the retry).
    pub wire_timeout: Option<Duration>,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        ReceiverOptions {
            dedup: true,
            spread_owners: false,
            plan: PlanOptions::default(),
            verify_digests: true,
            max_wire_gbps: None,
            min_coverage: None,
            batched_reslice: true,
            cache_descriptors: true,
            verify_while_landing: true,
            hash_while_copying: true,
            retries: 0,
            retry_backoff: Duration::from_millis(20),
            wire_timeout: None,
        }
    }
}

impl ReceiverOptions {
    /// Options from the `[planner]` and `[receiver]` config sections.
    pub fn from_config(cfg: &Config) -> Self {
        ReceiverOptions {
            dedup: cfg.planner.dedup,
            spread_owners: cfg.planner.spread_owners,
            plan: PlanOptions {
                full_pull_threshold: cfg.planner.full_pull_threshold,
                gather_reads: cfg.planner.gather_reads,
                gather_min_row_bytes: cfg.planner.gather_min_row_bytes,
                ..PlanOptions::default()
            },
            verify_digests: cfg.receiver.verify_digests,
            max_wire_gbps: cfg.receiver.max_wire_gbps,
            min_coverage: cfg.receiver.min_coverage,
            retries: cfg.receiver.retries,
            retry_backoff: Duration::from_millis(cfg.receiver.retry_backoff_ms),
            wire_timeout: cfg.receiver.wire_timeout_ms.map(Duration::from_millis),
            verify_while_landing: cfg.receiver.verify_while_landing,
            hash_while_copying: cfg.receiver.hash_while_copying,
            ..ReceiverOptions::default()
        }
    }

    pub(super) fn plan_options(&self) -> PlanOptions {
        PlanOptions {
            allow_overlap: !self.dedup,
            ..self.plan
        }
    }

    /// The wire-leg policies as transport layers, outermost first:
    /// `Timeout(Retry(Waves(PostLimit(t))))`.
    ///
    /// The retry layer is always there (with 0 retries it only passes through), so batches
    /// prepared under one policy stay valid under another and a policy change keeps the
    /// cached descriptors; the timeout layer forwards `prepare` and is there only when set.
    /// The post-limit layer is there when the transport advertises
    /// `Capability::max_reads_per_post`, which it then enforces (parts of at most that many
    /// reads, all posted before any wait). The waves layer is always there: a batch with
    /// overlapping destinations (the no-dedup arm) goes to the transport as disjoint waves, one
    /// after another, which is what backends accept; a disjoint batch passes straight through.
    pub(super) fn wire_stack(&self, transport: Arc<dyn Transport>) -> Arc<dyn Transport> {
        let transport = match transport.capabilities().max_reads_per_post {
            Some(_) => PostLimitLayer.layer(transport),
            None => transport,
        };
        let transport = WavesLayer.layer(transport);
        let retry = RetryLayer {
            retries: self.retries,
            backoff: self.retry_backoff,
        };
        match self.wire_timeout {
            Some(limit) => layers::stack(transport, &[&TimeoutLayer { limit }, &retry]),
            None => retry.layer(transport),
        }
    }

    /// Options that change the plan or its descriptors (the "arm").
    pub(super) fn arm(&self) -> Arm {
        Arm {
            dedup: self.dedup,
            spread_owners: self.spread_owners,
            full_pull_threshold: self.plan.full_pull_threshold,
            gather_reads: self.plan.gather_reads,
            gather_min_row_bytes: self.plan.gather_min_row_bytes,
        }
    }
}

/// The receiver options a cached plan, its buffers and its descriptors were made under (the
/// "arm" of a benchmark); any other option can change without rebuilding them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Arm {
    /// [`ReceiverOptions::dedup`]: one replica per byte, or every replica (overlapping reads).
    dedup: bool,
    /// [`ReceiverOptions::spread_owners`]: which replica each byte is read from.
    spread_owners: bool,
    /// [`PlanOptions::full_pull_threshold`]: where strided reads become full pulls.
    full_pull_threshold: u64,
    /// [`PlanOptions::gather_reads`]: column blocks read as gathers or row by row.
    gather_reads: bool,
    /// [`PlanOptions::gather_min_row_bytes`]: the shortest row a gather is planned for.
    gather_min_row_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn landing_and_copy_hashing_come_from_the_receiver_section() {
        let on = ReceiverOptions::from_config(&Config::default());
        assert!(on.verify_while_landing && on.hash_while_copying);
        let cfg = Config::from_toml(
            "[receiver]\nverify_while_landing = false\nhash_while_copying = false\n",
        )
        .unwrap();
        let off = ReceiverOptions::from_config(&cfg);
        assert!(!off.verify_while_landing && !off.hash_while_copying);
        assert_eq!(
            ReceiverOptions {
                verify_while_landing: true,
                hash_while_copying: true,
                ..off
            },
            on
        );
    }
}
