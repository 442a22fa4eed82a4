//! The rendezvous under load, small enough for CI (issue 42 item 7; the measured run is the
//! `load` example, BENCHMARKS.md, "Load held, measured"): 128 publisher ranks, each with its
//! real table and lease, and 16 receivers refitting at once through a 3-member etcd cluster of
//! its own. Every receiver must discover every rank and pass the reader fence, and no reading
//! claim may be left once they released. No timing is asserted: machines are noisy.

mod common;
mod load;

use std::path::PathBuf;
use std::time::Duration;

use load::{connect_receivers, round, Counters, Publishers};
use reshard_core::rendezvous::Rendezvous;

/// Members of the cluster.
const MEMBERS: usize = 3;

/// A private cluster in a fresh folder, stopped when dropped (and by the script's watcher
/// should this binary die first).
struct Cluster {
    dir: PathBuf,
    url: String,
}

impl Cluster {
    fn start(name: &str) -> Option<Cluster> {
        if !common::etcd_installed() {
            return None;
        }
        let dir = std::env::temp_dir().join(format!("reshard-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = common::etcd_sh(
            &[
                "start-cluster".as_ref(),
                dir.as_os_str(),
                MEMBERS.to_string().as_ref(),
            ],
            None,
        );
        Some(Cluster { dir, url })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        common::etcd_sh(&["stop".as_ref(), self.dir.as_os_str()], None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_and_twenty_eight_publishers_and_sixteen_receivers_at_once() {
    let Some(cluster) = Cluster::start("load") else {
        return;
    };
    // 128 ranks of Qwen3-30B-A3B: 8 pipeline stages x 16 data-parallel ranks, experts split 16 ways.
    let topology = "pp=8,dp=16,ep=16".parse().unwrap();
    let options = common::options(10);
    let pubs = Publishers::announce(&cluster.url, "qwen3-30b-a3b", &topology, 4, options.clone())
        .await
        .expect("announce every rank");
    assert_eq!(pubs.world, 128);
    let receivers = connect_receivers(&cluster.url, 16, options)
        .await
        .expect("connect the receivers");
    let before = Counters::scrape(&cluster.url)
        .await
        .expect("etcd's metrics");
    let (outcomes, listing) = round(
        &receivers,
        &pubs.model,
        Duration::from_secs(60),
        Some((pubs.connection(), &cluster.url)),
    )
    .await;
    let counted = Counters::scrape(&cluster.url)
        .await
        .expect("etcd's metrics")
        .since(&before);
    for (i, o) in outcomes.iter().enumerate() {
        let f = o.as_ref().unwrap_or_else(|e| panic!("receiver {i}: {e}"));
        assert_eq!(f.ranks, 128, "receiver {i} discovered {} ranks", f.ranks);
        assert!(
            f.still_ready,
            "receiver {i}: the publishers moved on under its claim, though none wrote"
        );
        assert!(
            f.fetched_bytes >= pubs.table_bytes,
            "receiver {i} fetched {} bytes, the tables alone are {}",
            f.fetched_bytes,
            pubs.table_bytes
        );
    }
    // While every receiver held its claim, a publisher's fence saw all sixteen.
    let listing = listing.expect("the claims were listed");
    assert_eq!(listing.claims.as_ref().ok(), Some(&16), "{listing:?}");
    // Released: every claim's lease revoked, so the fence is open for every publisher.
    let (claims, _) = receivers[0]
        .readers(&pubs.model)
        .await
        .expect("list claims");
    assert!(claims.is_empty(), "claims left after release: {claims:?}");
    // etcd counted the refits: at least each receiver's claim (a lease grant and revoke).
    assert!(
        counted.unary.get("LeaseGrant").copied().unwrap_or(0.0) >= 16.0
            && counted.unary.get("LeaseRevoke").copied().unwrap_or(0.0) >= 16.0,
        "etcd's counters: {counted:?}"
    );
    assert!(
        counted.sent_bytes as u64 >= 16 * pubs.table_bytes,
        "{counted:?}"
    );
    let model = pubs.model.clone();
    pubs.withdraw().await.expect("withdraw");
    let (members, _) = receivers[0].members(&model).await.expect("members");
    assert!(
        members.is_empty(),
        "members left after withdrawal: {members:?}"
    );
}
