//! Byte-exact installs across layouts, the executed reads against the plan, descriptor reuse
//! and successive steps.

use super::*;

/// Asserts the receiver's live weights equal the generator's reference for the cluster's step.
pub fn assert_installed(cluster: &Cluster, rx: &Receiver) {
    let want = cluster
        .expected_params(rx.layout())
        .expect("reference parameters");
    let live = rx.live_params().expect("receiver has live weights");
    assert_eq!(live.len(), want.len());
    for ((p, got), want) in rx.layout().params.iter().zip(live).zip(&want) {
        let got = got.read();
        if got[..] != want[..] {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            panic!(
                "parameter {} differs from the reference at byte {at} (step {})",
                p.name,
                cluster.step()
            );
        }
    }
    assert_eq!(rx.live_step(), Some(cluster.step()));
}

/// Asserts the receiver still holds exactly the weights of step `step`: `reference` is the
/// generator's reference for that step (from `cluster.expected_params` before the next step was
/// published), so a refused update that installed anything, or a live bank a failed wire leg
/// wrote into, shows as a byte difference.
pub fn assert_kept(rx: &Receiver, reference: &[Vec<u8>], step: u64, ctx: &str) {
    assert_live(rx, reference, ctx);
    assert_eq!(rx.live_step(), Some(step), "{ctx}: live step moved");
}

async fn refit_all(h: &Harness, model: reshard_planner::presets::ModelConfig, topo: &str, tp: u32) {
    let cluster = h.cluster(model, topo).await;
    for rank in 0..tp {
        let mut rx = h.receiver(&cluster, tp, rank).await;
        let report = rx.update(&cluster.tables()).await.expect("refit");
        assert_eq!(report.wire_bytes, report.plan.wire_bytes);
        // Every installed byte matched a publisher digest (docs/design.md §6).
        assert_eq!(
            report.checked_bytes, report.wire_bytes,
            "every byte on the wire is digest-checked"
        );
        assert!(
            report.fully_checked(),
            "{} checks without a digest",
            report.checks_without_digest
        );
        assert_installed(&cluster, &rx);
    }
}

/// Dense GQA model, Megatron TP4 x DP2 publishers, vLLM TP2 receivers.
pub async fn install_byte_exact_dense_tp4_to_tp2(h: &Harness) {
    refit_all(h, tiny_dense(4), "tp=4,dp=2", 2).await;
}

/// Dense GQA model, TP2 publishers, TP4 receivers.
pub async fn install_byte_exact_dense_tp2_to_tp4(h: &Harness) {
    refit_all(h, tiny_dense(4), "tp=2", 4).await;
}

/// MoE model, EP8 x DP8 publishers (replicated dense tensors), TP2 receivers.
pub async fn install_byte_exact_moe_ep8_dp8_to_tp2(h: &Harness) {
    let cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    for rank in 0..2 {
        let mut rx = h.receiver(&cluster, 2, rank).await;
        let r = rx.update(&cluster.tables()).await.expect("refit");
        assert!(r.dedup.dropped > 0, "replicas must be deduplicated");
        assert_eq!(r.plan.owners, 8, "experts come from all eight ranks");
        assert!(
            r.fully_checked(),
            "{} of {} bytes checked",
            r.checked_bytes,
            r.wire_bytes
        );
        assert_installed(&cluster, &rx);
    }
}

/// Two KV heads under publisher TP4: two ranks hold only q rows; receivers at TP2.
pub async fn install_byte_exact_gqa_kv_heads_below_publisher_tp(h: &Harness) {
    refit_all(h, tiny_dense(2), "tp=4", 2).await;
}

/// Row-parallel tensors need one run per row; without gather reads (the baseline's planner)
/// they are pulled whole and re-sliced.
pub async fn row_parallel_full_pulls_are_byte_exact(h: &Harness) {
    let cluster = h.cluster(tiny_dense(4), "dp=2").await;
    let t = h.endpoint("receiver-1-of-2").expect("receiver endpoint");
    let opts = ReceiverOptions {
        plan: PlanOptions {
            gather_reads: false,
            ..PlanOptions::default()
        },
        ..ReceiverOptions::default()
    };
    let mut rx = h.receiver_on(&cluster, t, 2, 1, opts).await;
    let r = rx.update(&cluster.tables()).await.expect("refit");
    // o_proj and down_proj of both layers.
    assert!(r.plan.full_pull_sources >= 4, "{:?}", r.plan);
    assert!(r.plan.extra_wire_bytes > 0);
    assert!(r.plan.descriptors_saved > 0);
    assert_installed(&cluster, &rx);
}

/// The reads the backend was asked to move are exactly the planner's plan, and the plan the
/// receiver executes is the one the planner builds from the same tables.
pub async fn executed_reads_equal_the_plan(h: &Harness) {
    let cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let rec = Arc::new(RecordingTransport::new(
        h.endpoint("recorder").expect("endpoint"),
    ));
    let mut rx = h
        .receiver_on(&cluster, rec.clone(), 2, 0, ReceiverOptions::default())
        .await;
    let tables = cluster.tables();
    rx.update(&tables).await.expect("refit");
    let posted = rec.posted();
    assert_eq!(posted.len(), 1, "one post per update");
    let executed = &posted[0];
    let planned: Arc<Plan> = rx.plan().expect("plan").clone();
    assert_eq!(executed.reads.len() as u64, planned.stats.coalesced_reads);
    type Key = (u32, u64, u64, u64, Option<reshard_core::RemoteRows>);
    let fp = |it: &mut dyn Iterator<Item = Key>| Plan::reads_fingerprint(it);
    assert_eq!(
        fp(&mut executed.reads.iter().map(|r| (
            r.owner,
            r.remote_region,
            r.remote_offset,
            r.len,
            r.remote_rows
        ))),
        fp(&mut planned.reads.iter().map(|r| (
            r.owner,
            r.src_region,
            r.src_offset,
            r.len,
            r.src_rows
        ))),
    );
    let table = dedup(&merge(&tables).expect("merge"), DedupOptions::default())
        .expect("dedup")
        .0;
    let direct = plan(&table, rx.layout(), &PlanOptions::default()).expect("plan");
    assert_eq!(direct.fingerprint, planned.fingerprint);
    assert_eq!(direct.fingerprint, direct.compute_fingerprint());
}

/// Plan and descriptors are built once and reused by later updates.
pub async fn descriptors_are_reused_across_updates(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let rec = Arc::new(RecordingTransport::new(
        h.endpoint("recorder").expect("endpoint"),
    ));
    let mut rx = h
        .receiver_on(&cluster, rec.clone(), 2, 1, ReceiverOptions::default())
        .await;
    let first = rx.update(&cluster.tables()).await.expect("refit");
    assert!(first.plan_rebuilt && first.descriptors_rebuilt);
    let builds = rec.prepares();
    for step in 1..4 {
        cluster.publish_step(step).expect("publish step");
        let r = rx.update(&cluster.tables()).await.expect("refit");
        assert!(!r.plan_rebuilt, "step {step} rebuilt the plan");
        assert!(!r.descriptors_rebuilt, "step {step} rebuilt descriptors");
        assert_installed(&cluster, &rx);
    }
    assert_eq!(rec.prepares(), builds);
    assert_eq!(rx.plan_builds(), 1);
}

/// Each training step's weights replace the previous ones.
pub async fn successive_steps_install_new_weights(h: &Harness) {
    let mut cluster = h.cluster(tiny_dense(4), "tp=2,dp=2").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    rx.update(&cluster.tables()).await.expect("refit");
    let before = snapshot(&rx);
    cluster.publish_step(9).expect("publish step");
    rx.update(&cluster.tables()).await.expect("refit");
    assert_installed(&cluster, &rx);
    assert_ne!(before, snapshot(&rx));
}

/// Row-parallel tensors read as gather reads (the default planner): each column half is one
/// read of just its columns, landing where the parameter wants it and checked there against
/// the publisher's column-block digests, so nothing is pulled whole, nothing re-sliced for
/// them, and every byte is checked; the refit installs byte-exact over several steps.
pub async fn row_parallel_gathers_are_byte_exact_and_checked(h: &Harness) {
    // Rows of 1 KiB in o_proj ([128, 8 x 64]) and down_proj ([128, 512]): two column blocks
    // of the digest grid each, so each TP2 half is a whole block, checked where it lands.
    let model = reshard_planner::presets::ModelConfig {
        name: "tiny-dense-wide-rows".into(),
        head_dim: 64,
        intermediate: 512,
        ..tiny_dense(4)
    };
    let mut cluster = h.cluster(model, "dp=2").await;
    let mut step = 0;
    // These rows are 512 bytes: below the default shortest row to gather.
    let opts = ReceiverOptions {
        plan: PlanOptions {
            gather_min_row_bytes: 0,
            ..PlanOptions::default()
        },
        ..ReceiverOptions::default()
    };
    for rank in 0..2 {
        let t = h
            .endpoint(&format!("receiver-{rank}-of-2"))
            .expect("receiver endpoint");
        let mut rx = h.receiver_on(&cluster, t, 2, rank, opts.clone()).await;
        for _ in 0..2 {
            step += 1;
            cluster.publish_step(step).expect("publish");
            let r = rx.update(&cluster.tables()).await.expect("refit");
            let plan = rx.plan().expect("plan");
            let gathers: Vec<_> = plan.reads.iter().filter(|r| r.src_rows.is_some()).collect();
            assert!(
                gathers.len() >= 4,
                "o_proj and down_proj of both layers are gathers: {:?}",
                r.plan
            );
            assert!(
                gathers
                    .iter()
                    .all(|g| matches!(g.dst, reshard_core::Dest::Param(_))),
                "a gather lands in its parameter, not in staging"
            );
            assert_eq!(r.plan.full_pull_sources, 0, "{:?}", r.plan);
            assert!(
                r.fully_checked(),
                "{} of {} bytes checked",
                r.checked_bytes,
                r.wire_bytes
            );
            assert_installed(&cluster, &rx);
        }
    }
}
