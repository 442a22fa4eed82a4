//! The checks. Each is a plain async function over a [`Harness`]; a failure panics with a message
//! naming what differed, so each generated test names its own case. One file per family of checks;
//! the helpers they share are here.

mod abort;
mod fault_property;
mod install;
mod peers;
mod processes;
mod typed_failures;

pub use abort::*;
pub use fault_property::*;
pub use install::*;
pub use peers::*;
pub use processes::*;
pub use typed_failures::*;

use std::sync::Arc;

use reshard_core::{
    dedup, merge, DedupOptions, Digest, ErrorDetail, ErrorKind, HostBuffer, MemoryBlock, Plan,
    ReadBatch, ReadDesc, ShardTable, Transport,
};
use reshard_planner::plan::{plan, PlanOptions};
use reshard_runtime::{Receiver, ReceiverOptions};

use crate::faults::{is_no_op, schedule_strategy, FaultKind, FaultyTransport, Fired};
use crate::fixtures::{tiny_dense, tiny_moe, Harness};
use crate::wrappers::{FailingTransport, RecordingTransport, RewritingTransport};
use crate::Cluster;

/// Publishers of `model` under `topo` and receiver rank `rank` of a TP2 engine refit to step 0,
/// that step's reference, and the publishers moved on to step 1: where every check of a refused
/// refit starts, since the refusal must leave step 0 live.
async fn refit_then_advance(
    h: &Harness,
    model: reshard_planner::presets::ModelConfig,
    topo: &str,
    rank: u32,
) -> (Cluster, Receiver, Vec<Vec<u8>>) {
    let mut cluster = h.cluster(model, topo).await;
    let mut rx = h.receiver(&cluster, 2, rank).await;
    rx.update(&cluster.tables()).await.expect("refit");
    let reference = cluster.expected_params(rx.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step");
    (cluster, rx, reference)
}

/// Asserts `e` is one of the wire-failure `kinds` and names an owner, which it returns: how every
/// check of a failed read starts before asking whether that owner is the right one.
pub(crate) fn wire_failure_owner(
    e: &reshard_core::Error,
    kinds: &[ErrorKind],
    ctx: &str,
) -> reshard_core::OwnerId {
    assert!(
        kinds.contains(&e.kind()),
        "{ctx}: unexpected error kind: {e}"
    );
    e.context()
        .owner
        .unwrap_or_else(|| panic!("{ctx}: error names no owner: {e}"))
}

/// Posts `prepared` on `rx` and waits for it, panicking with `ctx` on either failure: the clean
/// transfer the abort and quiescence checks compare a disturbed one against.
pub(crate) async fn post_and_wait(
    rx: &dyn Transport,
    prepared: &reshard_core::PreparedBatch,
    ctx: &str,
) -> reshard_core::WireReport {
    rx.post(prepared)
        .await
        .unwrap_or_else(|e| panic!("{ctx}: post: {e}"))
        .wait()
        .await
        .unwrap_or_else(|e| panic!("{ctx}: wait: {e}"))
}

fn snapshot(rx: &Receiver) -> Vec<Vec<u8>> {
    rx.live_params()
        .expect("live weights")
        .iter()
        .map(|b| b.read().to_vec())
        .collect()
}

/// Asserts the live weights are exactly `want` (a reference or an earlier snapshot).
fn assert_live(rx: &Receiver, want: &[Vec<u8>], ctx: &str) {
    let live = rx.live_params().expect("receiver has live weights");
    assert_eq!(live.len(), want.len(), "{ctx}");
    for ((p, got), want) in rx.layout().params.iter().zip(live).zip(want) {
        let got = got.read();
        if got[..] != want[..] {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            panic!("{ctx}: live parameter {} differs at byte {at}", p.name);
        }
    }
}
