//! The production publisher: shards laid out from the topology, filled through a weight
//! source, published with digests a receiver verifies; the geometry (and so the receiver's plan)
//! stays the same from step to step.

use std::sync::Arc;

use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};
use reshard_core::{Error, ErrorKind, Transport};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::topology::{PublisherTopology, ReceiverTopology};
use reshard_runtime::{Receiver, ReceiverOptions, ShardPublisher};
use reshard_testkit::content;
use reshard_testkit::synthetic::reference_params;

const SEED: u64 = 11;

fn endpoint(fabric: &LoopbackFabric, agent: &str) -> Arc<dyn Transport> {
    Arc::new(LoopbackTransport::new(fabric, agent, 2).expect("endpoint"))
}

/// Fills every publisher with the generator's step `step` (the testkit content function, so
/// the expected receiver parameters can be rebuilt without any publisher).
fn fill(publishers: &mut [ShardPublisher], step: u64) {
    for p in publishers {
        p.fill(step, |spec, tbox, dst| {
            let key = content::tensor_key(SEED, step, &spec.name);
            content::fill_box(dst, key, &spec.shape, tbox, spec.dtype.size());
            Ok(())
        })
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_shards_refit_byte_exact_step_after_step_on_one_plan() {
    let model = reshard_testkit::models::tiny_moe(8);
    let topo: PublisherTopology = "ep=4,dp=8".parse().unwrap();
    let fabric = LoopbackFabric::new();
    let mut publishers = Vec::new();
    for rank in 0..topo.world() {
        let t = endpoint(&fabric, &format!("pub-{rank}"));
        publishers.push(ShardPublisher::new(t, &model, &topo, rank).await.unwrap());
    }
    let rx_t = endpoint(&fabric, "rx");
    for p in &publishers {
        let md = p.transport().export_metadata().await.unwrap();
        rx_t.load_peer(p.table().publisher.rank, md).await.unwrap();
    }
    let layout = receiver_layout(&model, &ReceiverTopology::tp(2), 1).unwrap();
    let mut rx = Receiver::new(rx_t, layout.clone(), ReceiverOptions::default()).unwrap();
    for step in [3u64, 4, 9] {
        fill(&mut publishers, step);
        let tables: Vec<_> = publishers.iter().map(|p| p.table().clone()).collect();
        assert!(tables
            .iter()
            .all(|t| t.step == step && t.publisher.incarnation != 0));
        assert!(tables[0].offers.iter().all(|o| o.digest.is_some()));
        let report = rx.update(&tables).await.unwrap();
        assert_eq!(
            report.checks_without_digest, 0,
            "step {step}: every read checked"
        );
        assert!(report.checks_passed > 0 && report.checked_bytes > 0);
        let expected = reference_params(&model.tensors(), SEED, step, &layout).unwrap();
        let live: Vec<Vec<u8>> = rx
            .live_params()
            .unwrap()
            .iter()
            .map(|p| p.read().to_vec())
            .collect();
        assert!(live == expected, "step {step}: installed bytes differ");
        assert_eq!(rx.live_step(), Some(step));
    }
    assert_eq!(
        rx.plan_builds(),
        1,
        "same geometry every step: planned once"
    );
}

#[tokio::test]
async fn a_source_error_is_returned_and_a_rank_outside_the_topology_refused() {
    let model = reshard_testkit::models::tiny_moe(4);
    let topo: PublisherTopology = "ep=2,dp=2".parse().unwrap();
    let fabric = LoopbackFabric::new();
    let e = ShardPublisher::new(endpoint(&fabric, "p9"), &model, &topo, 2)
        .await
        .err()
        .expect("rank 2 of 2");
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::InvalidInput, Some(2))
    );
    let mut p = ShardPublisher::new(endpoint(&fabric, "p0"), &model, &topo, 0)
        .await
        .unwrap();
    let e = p
        .fill(1, |spec, _, _| {
            Err(Error::new(ErrorKind::Config, "no such tensor").with_tensor(&spec.name))
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(p.table().step, 0, "a failed fill publishes nothing new");
}

/// Publishers announce through an in-process rendezvous and advance in place; a subscriber
/// started before them learns the architecture from them, installs each step byte-exact on one
/// plan, and reloads a restarted publisher's metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_refits_every_step_its_publishers_announce() {
    use bytes::Bytes;
    use reshard_core::encoding::encode_table;
    use reshard_core::rendezvous::{Announcement, Rendezvous};
    use reshard_rendezvous::InProcess;
    use reshard_runtime::Subscriber;
    use std::time::Duration;

    let model = reshard_testkit::models::tiny_moe(8);
    let topo: PublisherTopology = "ep=4,dp=4".parse().unwrap();
    let hub: Arc<dyn Rendezvous> = Arc::new(InProcess::new());
    let fabric = LoopbackFabric::new();
    let config = Bytes::from(serde_json::to_vec(&model).unwrap());
    let announce = |p: &ShardPublisher| Announcement {
        model: "tiny".into(),
        rank: p.table().publisher.rank,
        world: topo.world(),
        step: p.table().step,
        transport: p.transport().name().into(),
        incarnation: p.transport().incarnation(),
        table: Bytes::from(encode_table(p.table())),
        metadata: Bytes::new(),
        config: config.clone(),
    };
    let rx_topo = ReceiverTopology::tp(2);
    let subscriber = {
        let (hub, t) = (hub.clone(), endpoint(&fabric, "rx"));
        tokio::spawn(async move {
            Subscriber::connect(
                hub,
                "tiny",
                t,
                &rx_topo,
                0,
                ReceiverOptions::default(),
                Duration::from_secs(10),
            )
            .await
        })
    };
    let mut publishers = Vec::new();
    for rank in 0..topo.world() {
        let t = endpoint(&fabric, &format!("pub-{rank}"));
        publishers.push(ShardPublisher::new(t, &model, &topo, rank).await.unwrap());
    }
    fill(&mut publishers, 1);
    let mut held = Vec::new();
    for p in &publishers {
        let mut a = announce(p);
        a.metadata = p.transport().export_metadata().await.unwrap();
        held.push(hub.announce(a).await.unwrap());
    }
    let mut sub = subscriber.await.unwrap().unwrap();
    assert_eq!(sub.model(), &model, "architecture from the announcements");
    let layout = sub.receiver().layout().clone();
    for step in [1u64, 2, 5] {
        if step > 1 {
            for h in &held {
                h.unready().await.unwrap();
            }
            fill(&mut publishers, step);
            for (p, h) in publishers.iter().zip(&held) {
                h.advance(step, Bytes::from(encode_table(p.table())))
                    .await
                    .unwrap();
            }
        }
        let report = sub.next_step(Duration::from_secs(10)).await.unwrap();
        assert_eq!(report.step, step);
        assert_eq!(report.peers_loaded, if step == 1 { 4 } else { 0 });
        let expected = reference_params(&model.tensors(), SEED, step, &layout).unwrap();
        let live: Vec<Vec<u8>> = sub
            .receiver()
            .live_params()
            .unwrap()
            .iter()
            .map(|p| p.read().to_vec())
            .collect();
        assert!(live == expected, "step {step}: installed bytes differ");
    }
    assert_eq!(sub.receiver().plan_builds(), 1);
    // Nothing newer: waiting times out naming the step the publishers stand at.
    let e = sub.next_step(Duration::from_millis(50)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.to_string().contains("none ready above step 5"), "{e}");
    // Rank 2 restarts: a new endpoint (new incarnation), same geometry, announced at step 6.
    drop(held.remove(2));
    let t = endpoint(&fabric, "pub-2-restarted");
    publishers[2] = ShardPublisher::new(t, &model, &topo, 2).await.unwrap();
    for h in &held {
        h.unready().await.unwrap();
    }
    fill(&mut publishers, 6);
    let mut a = announce(&publishers[2]);
    a.metadata = publishers[2].transport().export_metadata().await.unwrap();
    let restarted = hub.announce(a).await.unwrap();
    for (i, h) in held.iter().enumerate() {
        let p = &publishers[if i >= 2 { i + 1 } else { i }];
        h.advance(6, Bytes::from(encode_table(p.table())))
            .await
            .unwrap();
    }
    let report = sub.next_step(Duration::from_secs(10)).await.unwrap();
    assert_eq!((report.step, report.peers_loaded), (6, 1));
    drop(restarted);
}

/// A rank's shard larger than this machine's memory is refused before anything is allocated,
/// an `InvalidInput` naming the rank (issue 42: the allocation aborted the process instead).
#[tokio::test]
async fn a_shard_larger_than_memory_is_refused_naming_the_rank() {
    let mut model = reshard_testkit::models::tiny_moe(4);
    // Embeddings of 2^33 rows: terabytes on rank 0.
    model.vocab = 1 << 33;
    let topo: PublisherTopology = "ep=2,dp=2".parse().unwrap();
    let fabric = LoopbackFabric::new();
    let e = ShardPublisher::new(endpoint(&fabric, "huge"), &model, &topo, 0)
        .await
        .err()
        .expect("refused");
    assert_eq!(
        (e.kind(), e.context().owner),
        (ErrorKind::InvalidInput, Some(0)),
        "{e}"
    );
    assert!(e.message().contains("publisher rank 0's shard"), "{e}");
}
