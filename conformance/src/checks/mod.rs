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
use crate::wrappers::{FailingTransport, RecordingTransport};
use crate::Cluster;

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
