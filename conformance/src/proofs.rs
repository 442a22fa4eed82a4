//! Checks of the suite itself: a deliberately wrong backend (one read sent to another owner, or
//! to another offset) must be caught, which needs publishers whose replicas live at different
//! offsets in different memory ([`reshard_testkit::Placement::PerRank`]).

use std::sync::Arc;

use reshard_core::{ErrorKind, OwnerId, Transport};
use reshard_runtime::{Receiver, ReceiverOptions};
use reshard_testkit::Placement;

use crate::fixtures::{tiny_moe, Harness};
use crate::wrappers::{Misdirect, MisdirectingTransport};
use crate::Cluster;

/// True when every live parameter equals the generator's reference for the cluster's step.
fn live_is_exact(cluster: &Cluster, rx: &Receiver) -> bool {
    let want = cluster.expected_params(rx.layout()).expect("reference");
    match rx.live_params() {
        Some(live) => live
            .iter()
            .zip(&want)
            .all(|(got, w)| got.read()[..] == w[..]),
        None => false,
    }
}

/// A planned read of a replicated box and another owner holding the same box: (owner, offset,
/// other owner, the other owner's offset of that box).
fn replicated_read(cluster: &Cluster, rx: &Receiver) -> (OwnerId, u64, OwnerId, u64) {
    let plan = rx.plan().expect("plan").clone();
    let tables = cluster.tables();
    for r in &plan.reads {
        let Some(mine) = tables
            .iter()
            .find(|t| t.publisher.rank == r.owner)
            .and_then(|t| {
                t.offers.iter().find(|o| {
                    let elem = t
                        .tensors
                        .iter()
                        .find(|s| s.name == o.tensor)
                        .map_or(1, |s| s.dtype.size());
                    let len = o.tensor_box.elements() * elem;
                    o.location.offset <= r.src_offset && r.src_offset < o.location.offset + len
                })
            })
        else {
            continue;
        };
        let other = tables.iter().find_map(|t| {
            (t.publisher.rank != r.owner)
                .then(|| {
                    t.offers
                        .iter()
                        .find(|o| o.tensor == mine.tensor && o.tensor_box == mine.tensor_box)
                })
                .flatten()
                .map(|o| (t.publisher.rank, o.location.offset))
        });
        if let Some((to, at)) = other {
            return (r.owner, r.src_offset, to, at);
        }
    }
    panic!("no planned read of a replicated box");
}

/// Refits rank 0 of TP2 through a [`MisdirectingTransport`] with `rule`; returns whether the
/// suite caught it: the refit failed with a typed error and installed nothing, or it installed
/// bytes that differ from the reference (what `assert_installed` reports).
async fn caught(h: &Harness, cluster: &Cluster, rule: Misdirect, verify: bool) -> bool {
    let t = Arc::new(MisdirectingTransport::new(
        h.endpoint("receiver-misdirected").expect("endpoint"),
        rule,
    ));
    let opts = ReceiverOptions {
        verify_digests: verify,
        ..ReceiverOptions::default()
    };
    let mut rx = h
        .receiver_on(cluster, t.clone() as Arc<dyn Transport>, 2, 0, opts)
        .await;
    let r = rx.update(&cluster.tables()).await;
    assert!(t.misdirected().is_some(), "{rule:?} matched no read");
    match r {
        Err(e) => {
            assert!(
                matches!(
                    e.kind(),
                    ErrorKind::Verification | ErrorKind::OutOfBounds | ErrorKind::Transport
                ),
                "{rule:?}: {e}"
            );
            assert!(rx.live_params().is_none(), "{rule:?}: installed after {e}");
            true
        }
        Ok(_) => !live_is_exact(cluster, &rx),
    }
}

/// A backend that reads one replicated box from another owner (same region and offset), or
/// from 64 bytes further on, is caught with verification on (a typed error, nothing installed)
/// and with it off (the installed bytes differ from the reference). With replicas sharing one
/// buffer, the wrong-owner read would be invisible: the reason publishers own their memory.
pub async fn wrong_owner_or_offset_is_caught(h: &Harness) {
    let cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    rx.update(&cluster.tables()).await.expect("clean refit");
    let (owner, offset, to, their_offset) = replicated_read(&cluster, &rx);
    assert_ne!(
        offset, their_offset,
        "replicas of one box sit at different offsets on different ranks"
    );
    let rules = [
        Misdirect::Owner { owner, offset, to },
        Misdirect::Offset {
            owner,
            offset,
            by: 64,
        },
    ];
    for rule in rules {
        for verify in [true, false] {
            assert!(
                caught(h, &cluster, rule, verify).await,
                "{rule:?} (verification {verify}) installed the reference bytes: the suite \
                 cannot see it"
            );
        }
    }
    // The same misdirection over publishers whose replicas share bytes goes unnoticed (a new
    // cluster: the first one's endpoint names go first).
    drop(rx);
    drop(cluster);
    let shared = h
        .cluster_placed(tiny_moe(), "ep=8,dp=8", Placement::SharedReplicas)
        .await;
    let mut rx = h.receiver(&shared, 2, 0).await;
    rx.update(&shared.tables()).await.expect("clean refit");
    let (owner, offset, to, _) = replicated_read(&shared, &rx);
    assert!(
        !caught(h, &shared, Misdirect::Owner { owner, offset, to }, true).await,
        "with shared replicas a wrong-owner read is expected to be invisible"
    );
}
