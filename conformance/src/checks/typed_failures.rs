//! Faults that must fail with the right typed error and leave the live weights: missing
//! coverage, divergent replicas, corrupted bytes, a failing transport, reads out of bounds, the
//! throughput ceiling.

use super::*;

/// A publisher missing: the error names the tensor and a missing box; live weights stay.
pub async fn missing_coverage_is_typed_and_names_tensor_and_box(h: &Harness) {
    let (cluster, mut rx, reference) = refit_then_advance(h, tiny_moe(), "ep=8,dp=8", 0).await;
    let before = snapshot(&rx);
    // Rank 3 alone holds experts 6 and 7.
    let tables: Vec<ShardTable> = cluster
        .tables()
        .into_iter()
        .filter(|t| t.publisher.rank != 3)
        .collect();
    let e = rx.update(&tables).await.expect_err("coverage is missing");
    assert_eq!(e.kind(), ErrorKind::MissingCoverage, "{e}");
    let tensor = e.context().tensor.clone().expect("names the tensor");
    assert!(
        tensor.contains("experts.6.") || tensor.contains("experts.7."),
        "{tensor}"
    );
    match e.detail() {
        Some(ErrorDetail::MissingCoverage { tensor: t, missing }) => {
            assert_eq!(t, &tensor);
            assert!(missing.elements() > 0);
        }
        other => panic!("expected a missing-coverage detail, got {other:?}"),
    }
    assert_kept(&rx, &reference, 0, "missing coverage");
    assert_eq!(snapshot(&rx), before, "live weights must be untouched");
}

/// Same box, different digests: not replicas, a naming bug; the refit fails.
pub async fn divergent_replica_digests_fail(h: &Harness) {
    let cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    let mut tables = cluster.tables();
    let t = tables
        .iter_mut()
        .find(|t| t.publisher.rank == 5)
        .expect("rank 5");
    let o = t
        .offers
        .iter_mut()
        .find(|o| o.tensor == "model.norm.weight")
        .expect("replicated norm");
    o.digest = Some(Digest::of(b"another stage's bytes"));
    let e = rx.update(&tables).await.expect_err("replicas diverge");
    assert_eq!(e.kind(), ErrorKind::ReplicaDivergence, "{e}");
    match e.detail() {
        Some(ErrorDetail::ReplicaDivergence { tensor, owners, .. }) => {
            assert_eq!(tensor, "model.norm.weight");
            assert!(owners.0 == 5 || owners.1 == 5, "{owners:?}");
        }
        other => panic!("expected a divergence detail, got {other:?}"),
    }
    assert!(rx.live_params().is_none());
}

/// Publisher memory corrupted after its digest was published: verification catches it and the
/// live weights stay at the previous step.
pub async fn corrupted_source_bytes_fail_verification(h: &Harness) {
    let (cluster, mut rx, reference) = refit_then_advance(h, tiny_moe(), "ep=8,dp=8", 1).await;
    let before = snapshot(&rx);
    // Row-parallel o_proj is pulled whole, so every one of its bytes is digest-checked.
    let name = "model.layers.1.self_attn.o_proj.weight";
    cluster.corrupt(name, 1000).expect("corrupt");
    let e = rx.update(&cluster.tables()).await.expect_err("corruption");
    assert_eq!(e.kind(), ErrorKind::Verification, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(name));
    assert_kept(&rx, &reference, 0, "corrupted source");
    assert_eq!(snapshot(&rx), before, "live weights must be untouched");
}

/// Corruption inside the rows one TP rank reads of a partially read offer (a TP half of an
/// expert's gate rows) is caught by the offer's row-chunk digests; the rank reading the other
/// half never sees those bytes and installs cleanly.
pub async fn corrupted_rows_of_a_partial_read_fail_verification(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rx0 = h.receiver(&cluster, 2, 0).await;
    let mut rx1 = h.receiver(&cluster, 2, 1).await;
    rx0.update(&cluster.tables()).await.expect("refit");
    rx1.update(&cluster.tables()).await.expect("refit");
    let before = snapshot(&rx1);
    let reference = cluster.expected_params(rx1.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step");
    // gate_proj is [96, 128] bf16: row 60 lies in rank 1's half (rows 48..96).
    let name = "model.layers.0.mlp.experts.5.gate_proj.weight";
    cluster.corrupt(name, 60 * 128 * 2 + 6).expect("corrupt");
    let e = rx1.update(&cluster.tables()).await.expect_err("corruption");
    assert_eq!(e.kind(), ErrorKind::Verification, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(name));
    assert_kept(&rx1, &reference, 0, "corrupted rows");
    assert_eq!(snapshot(&rx1), before, "live weights must be untouched");
    let r = rx0
        .update(&cluster.tables())
        .await
        .expect("rank 0 reads clean rows");
    assert!(r.checked_bytes > 0);
    assert_installed(&cluster, &rx0);
}

/// A publisher rewrites its memory in place while a receiver's wire leg reads it, after it
/// published the step's digests (a trainer that overwrote without waiting): on a split that
/// reads column slices of the publishers' offers (row-parallel `o_proj`, publisher TP 2 to
/// receiver TP 4, so the receiver reads a quarter of every row and no whole offer or row
/// chunk), the column-block digests catch it; the refit is refused with `Verification` and
/// the live weights stay bit for bit (docs/design.md §6).
pub async fn rewritten_during_the_wire_leg_is_refused(h: &Harness) {
    let mut cluster = h.cluster(tiny_dense(4), "tp=2").await;
    let mut rx = h.receiver(&cluster, 4, 1).await;
    rx.update(&cluster.tables()).await.expect("refit step 0");
    let before = snapshot(&rx);
    let reference = cluster.expected_params(rx.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step 1");
    let tables = cluster.tables();
    // o_proj is [128, 128]; publisher 0 holds columns 0..64 ([128, 64] bf16), receiver rank 1
    // of 4 wants columns 32..64 of every row: row 10, column 40 is one of its bytes.
    let name = "model.layers.1.self_attn.o_proj.weight";
    let cluster = Arc::new(cluster);
    let publisher = cluster.clone();
    let rewriting: Arc<dyn Transport> =
        Arc::new(RewritingTransport::new(rx.transport().clone(), move || {
            publisher
                .corrupt(name, (10 * 64 + 40) * 2)
                .expect("rewrite in place");
        }));
    rx.set_transport(rewriting);
    let e = rx
        .update(&tables)
        .await
        .expect_err("a rewrite under the reads");
    assert_eq!(e.kind(), ErrorKind::Verification, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some(name));
    assert_eq!(e.context().owner, Some(0));
    assert_kept(&rx, &reference, 0, "rewritten during the wire leg");
    assert_eq!(snapshot(&rx), before, "live weights must be untouched");
}

/// A peer fails mid-batch: the error names the owner (and tensor); live weights stay.
pub async fn transport_failing_mid_batch_leaves_live_weights(h: &Harness) {
    let (cluster, mut rx, reference) = refit_then_advance(h, tiny_moe(), "ep=8,dp=8", 0).await;
    let before = snapshot(&rx);
    let failing: Arc<dyn Transport> = Arc::new(FailingTransport::new(
        h.endpoint("receiver-flaky").expect("endpoint"),
        3,
    ));
    cluster.connect(failing.as_ref()).await.expect("connect");
    rx.set_transport(failing);
    let e = rx
        .update(&cluster.tables())
        .await
        .expect_err("owner 3 fails");
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(3));
    assert!(e.context().tensor.is_some(), "names a tensor: {e}");
    assert_kept(&rx, &reference, 0, "transport failing mid-batch");
    assert_eq!(snapshot(&rx), before, "live weights must be untouched");
    // The same receiver, back on a working endpoint, installs the new step exactly.
    let good = h.endpoint("receiver-recovered").expect("endpoint");
    cluster.connect(good.as_ref()).await.expect("connect");
    rx.set_transport(good);
    rx.update(&cluster.tables())
        .await
        .expect("refit after the failure");
    assert_installed(&cluster, &rx);
}

/// An offer that points past its owner's registered region: a typed error, never a wild read.
pub async fn read_outside_registered_region_is_typed(h: &Harness) {
    let cluster = h.cluster(tiny_dense(4), "tp=2").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    let mut tables = cluster.tables();
    let past_end = cluster.arena_bytes();
    let o = tables[0]
        .offers
        .iter_mut()
        .find(|o| o.tensor == "model.norm.weight")
        .expect("norm offer");
    o.location.offset = past_end;
    let e = rx.update(&tables).await.expect_err("out of bounds");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert_eq!(e.context().owner, Some(0));
    assert!(rx.live_params().is_none());
}

/// A dense model of about 80 MB in bf16: a TP-2 rank's wire leg takes milliseconds, long enough
/// for its rate to be measured without timer noise dominating.
pub fn medium_dense() -> reshard_planner::presets::ModelConfig {
    reshard_planner::presets::ModelConfig {
        name: "medium-dense".into(),
        layers: 2,
        hidden: 1024,
        heads: 8,
        kv_heads: 4,
        head_dim: 128,
        intermediate: 2816,
        moe: None,
        vocab: 8000,
        tied_embeddings: false,
        qk_norm: false,
        dtype: reshard_core::DType::Bf16,
        arch: Default::default(),
    }
}

/// The rate (Gbit/s) a guard error names: the number before the first "Gbit/s" of its message.
fn rate_in_message(e: &reshard_core::Error) -> Option<f64> {
    let msg = e.to_string();
    let head = &msg[..msg.find("Gbit/s")?];
    head.split_whitespace().last()?.parse().ok()
}

/// The fabric-ceiling guard compares the real wire rate with the ceiling: measured over clean
/// refits (median of three), a ceiling of a quarter of that rate must refuse the install (and
/// name a rate above the ceiling) and leave the previous step's weights; a ceiling sixteen times
/// the measured rate must let refits install byte-exact. A few tries absorb a noisy machine
/// (a refit that happens to run 4x slower, or 16x faster, than the median).
pub async fn throughput_ceiling_guard_refuses_install(h: &Harness) {
    const TRIES: usize = 4;
    let mut cluster = h.cluster(medium_dense(), "tp=2").await;
    let mut rx = h.receiver(&cluster, 2, 1).await;
    // A warm-up refit (first touch of every buffer, descriptor build) is not measured.
    rx.update(&cluster.tables()).await.expect("warm-up refit");
    let mut rates = Vec::new();
    for step in 1..4 {
        cluster.publish_step(step).expect("publish step");
        let r = rx.update(&cluster.tables()).await.expect("refit");
        assert_installed(&cluster, &rx);
        assert!(
            r.wire_gbytes_per_s.is_finite() && r.wire_gbytes_per_s > 0.0,
            "wire rate {}",
            r.wire_gbytes_per_s
        );
        rates.push(r.wire_gbytes_per_s * 8.0);
    }
    rates.sort_by(f64::total_cmp);
    let measured = rates[1];
    let mut step = cluster.step();
    let mut log = Vec::new();

    // A ceiling well below the real rate: refused, naming the rate, previous weights kept.
    let low = measured / 4.0;
    rx.set_options(ReceiverOptions {
        max_wire_gbps: Some(low),
        ..ReceiverOptions::default()
    });
    let mut tripped = false;
    for _ in 0..TRIES {
        let reference = cluster.expected_params(rx.layout()).expect("reference");
        let live = step;
        step += 1;
        cluster.publish_step(step).expect("publish step");
        match rx.update(&cluster.tables()).await {
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Guard, "{e}");
                let rate = rate_in_message(&e)
                    .unwrap_or_else(|| panic!("the guard's message names no rate: {e}"));
                assert!(
                    rate > low,
                    "the guard names {rate} Gbit/s, not above the ceiling {low}: {e}"
                );
                assert_kept(&rx, &reference, live, "guard tripped");
                tripped = true;
                break;
            }
            Ok(r) => {
                // Only a refit slower than the ceiling may pass it.
                assert!(
                    r.wire_gbytes_per_s * 8.0 <= low,
                    "installed at {} Gbit/s above the ceiling {low}",
                    r.wire_gbytes_per_s * 8.0
                );
                assert_installed(&cluster, &rx);
                log.push(format!("passed at {:.2} Gbit/s", r.wire_gbytes_per_s * 8.0));
            }
        }
    }
    assert!(
        tripped,
        "a ceiling of {low:.2} Gbit/s (a quarter of the measured {measured:.2}) never tripped: \
         {log:?}"
    );

    // A ceiling far above the real rate: installs, byte-exact.
    let high = measured * 16.0;
    rx.set_options(ReceiverOptions {
        max_wire_gbps: Some(high),
        ..ReceiverOptions::default()
    });
    let mut passed = false;
    for _ in 0..TRIES {
        step += 1;
        cluster.publish_step(step).expect("publish step");
        match rx.update(&cluster.tables()).await {
            Ok(_) => {
                assert_installed(&cluster, &rx);
                passed = true;
                break;
            }
            Err(e) if e.kind() == ErrorKind::Guard => log.push(format!("high ceiling: {e}")),
            Err(e) => panic!("refit under a ceiling of {high:.2} Gbit/s: {e}"),
        }
    }
    assert!(
        passed,
        "a ceiling of {high:.2} Gbit/s (16x the measured {measured:.2}) never passed: {log:?}"
    );
    eprintln!(
        "{}: wire rates {rates:.2?} Gbit/s; ceiling {low:.2} tripped, {high:.2} passed",
        h.name()
    );
}
