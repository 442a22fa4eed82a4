//! The rig's rendezvous: publishers announce on an in-process hub and receivers take metadata
//! and each step's tables only from what discovery returns (what `reshard refit` runs on).

use std::sync::Arc;
use std::time::Duration;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::{ErrorKind, Result, Transport};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::topology::ReceiverTopology;
use reshard_runtime::ReceiverOptions;
use reshard_testkit::models::tiny_moe;
use reshard_testkit::rig::{self, PublisherSite};
use reshard_testkit::{Meeting, Placement, Publishers};

fn maker(fabric: &LoopbackFabric) -> impl Fn(&str) -> Result<Arc<dyn Transport>> + '_ {
    move |agent| Ok(Arc::new(LoopbackTransport::new(fabric, agent, 1)?) as Arc<dyn Transport>)
}

async fn publishers(fabric: &LoopbackFabric) -> Publishers {
    rig::start_publishers(
        tiny_moe(4),
        "ep=2,dp=2".parse().expect("topology"),
        7,
        Placement::PerRank,
        PublisherSite::Local,
        maker(fabric),
    )
    .await
    .expect("publishers")
}

#[tokio::test]
async fn every_rank_is_announced_ready_and_advances_with_the_step() {
    let fabric = LoopbackFabric::new();
    let mut cluster = publishers(&fabric).await;
    let hub = cluster.meeting().hub().clone();
    let (members, _) = hub
        .members(cluster.meeting().model())
        .await
        .expect("members");
    let world = cluster.tables().len();
    assert!(world > 1);
    assert_eq!(members.len(), world);
    assert!(members
        .iter()
        .all(|m| m.ready && m.step == 0 && m.world as usize == world));
    assert!(members.iter().all(|m| m.transport == "loopback"));

    cluster.publish_step(3).expect("publish");
    cluster.announce().await.expect("announce");
    let (members, _) = hub
        .members(cluster.meeting().model())
        .await
        .expect("members");
    assert!(
        members.iter().all(|m| m.ready && m.step == 3),
        "{members:?}"
    );
}

#[tokio::test]
async fn run_updates_installs_what_the_rendezvous_announces() {
    let fabric = LoopbackFabric::new();
    let mut cluster = publishers(&fabric).await;
    let recv = ReceiverTopology::tp(2);
    let mut receivers =
        rig::connect_receivers(&cluster, &recv, &ReceiverOptions::default(), maker(&fabric))
            .await
            .expect("receivers");
    let run = rig::run_updates(&mut cluster, &mut receivers, 2, 5, |_| {})
        .await
        .expect("run");
    assert!(run.verified, "{:?}", run.failures);
    for rx in &receivers {
        assert_eq!(rx.live_step(), Some(7));
    }
    // The hub says the step the receivers installed.
    let found = cluster.meeting().discover(None).await.expect("discover");
    assert_eq!(found.step, 7);
}

#[tokio::test]
async fn a_receiver_refuses_publishers_announcing_another_transport() {
    let fabric = LoopbackFabric::new();
    let cluster = publishers(&fabric).await;
    // A second meeting on the same hub under another model name, claiming another transport.
    let mut model = cluster.model().clone();
    model.name = "other-transport".into();
    let liar = Meeting::on(cluster.meeting().hub().clone(), &model, "ucx").expect("meeting");
    liar.sync(
        &cluster.tables(),
        &cluster.metadata().await.expect("metadata"),
    )
    .await
    .expect("announce");
    let rx = maker(&fabric)("receiver").expect("endpoint");
    let e = liar
        .connect(rx.as_ref())
        .await
        .expect_err("wrong transport");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert_eq!(e.context().owner, Some(0), "{e}");
    assert!(e.message().contains("\"ucx\""), "{e}");
}

#[tokio::test]
async fn discovery_times_out_naming_the_step_it_waited_for() {
    let fabric = LoopbackFabric::new();
    let cluster = publishers(&fabric).await;
    let meeting = Meeting::on(cluster.meeting().hub().clone(), cluster.model(), "loopback")
        .expect("meeting")
        .with_timeout(Duration::from_millis(200));
    // Nothing announced above step 0: a receiver waiting for step 1 times out, saying so.
    let layout = receiver_layout(cluster.model(), &ReceiverTopology::tp(2), 0).expect("layout");
    assert!(!layout.params.is_empty());
    let rx = maker(&fabric)("receiver").expect("endpoint");
    let e = meeting
        .tables(Some(0), rx.as_ref())
        .await
        .expect_err("no step 1");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
}
