//! The checks. Each is a plain async function over a [`Harness`]; a failure panics with a message
//! naming what differed, so each generated test names its own case.

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

fn snapshot(rx: &Receiver) -> Vec<Vec<u8>> {
    rx.live_params()
        .expect("live weights")
        .iter()
        .map(|b| b.read().to_vec())
        .collect()
}

async fn refit_all(h: &Harness, model: reshard_planner::presets::ModelConfig, topo: &str, tp: u32) {
    let cluster = h.cluster(model, topo).await;
    for rank in 0..tp {
        let mut rx = h.receiver(&cluster, tp, rank).await;
        let report = rx.update(&cluster.tables()).await.expect("refit");
        assert_eq!(report.wire_bytes, report.plan.wire_bytes);
        assert!(
            report.checks_passed > 0,
            "some offers were verified by digest"
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
        assert!(r.plan.full_pull_sources > 0);
        assert_installed(&cluster, &rx);
    }
}

/// Two KV heads under publisher TP4: two ranks hold only q rows; receivers at TP2.
pub async fn install_byte_exact_gqa_kv_heads_below_publisher_tp(h: &Harness) {
    refit_all(h, tiny_dense(2), "tp=4", 2).await;
}

/// Row-parallel tensors need one run per row, so they are pulled whole and re-sliced.
pub async fn row_parallel_full_pulls_are_byte_exact(h: &Harness) {
    let cluster = h.cluster(tiny_dense(4), "dp=2").await;
    let mut rx = h.receiver(&cluster, 2, 1).await;
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
    let fp = |it: &mut dyn Iterator<Item = (u32, u64, u64, u64)>| Plan::reads_fingerprint(it);
    assert_eq!(
        fp(&mut executed
            .reads
            .iter()
            .map(|r| (r.owner, r.remote_region, r.remote_offset, r.len))),
        fp(&mut planned
            .reads
            .iter()
            .map(|r| (r.owner, r.src_region, r.src_offset, r.len))),
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

/// A publisher missing: the error names the tensor and a missing box; live weights stay.
pub async fn missing_coverage_is_typed_and_names_tensor_and_box(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    rx.update(&cluster.tables()).await.expect("refit");
    let before = snapshot(&rx);
    let reference = cluster.expected_params(rx.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step");
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
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rx = h.receiver(&cluster, 2, 1).await;
    rx.update(&cluster.tables()).await.expect("refit");
    let before = snapshot(&rx);
    let reference = cluster.expected_params(rx.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step");
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

/// A peer fails mid-batch: the error names the owner (and tensor); live weights stay.
pub async fn transport_failing_mid_batch_leaves_live_weights(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    rx.update(&cluster.tables()).await.expect("refit");
    let before = snapshot(&rx);
    let reference = cluster.expected_params(rx.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step");
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

/// A dense model of about 130 MB in bf16, the source of [`abort_stops_a_posted_batch`]: a batch
/// reading all of it stays on the wire for tens of milliseconds even within one process.
pub fn abort_model() -> reshard_planner::presets::ModelConfig {
    reshard_planner::presets::ModelConfig {
        name: "abort-dense".into(),
        layers: 1,
        vocab: 4000,
        ..crate::quiescence::large_dense()
    }
}

/// Byte the abort check's destination holds before any read lands.
const SENTINEL: u8 = 0xA5;
/// Bytes per read of the abort check.
const ABORT_READ: u64 = 256 << 10;
/// Bytes at the end of each read the quick landed-or-not probe looks at (a random source has
/// them all equal to the sentinel with probability 2^-64).
const PROBE: usize = 8;

/// Reads covering every offer of `tables`, in 256 KiB pieces, into one destination region:
/// Per offer of [`read_every_offer`]: its destination range and digest.
type OfferSpans = Vec<(std::ops::Range<usize>, Option<Digest>)>;

/// returns the reads and, per offer, its destination range and digest.
fn read_every_offer(tables: &[ShardTable], dst_region: u64) -> (Vec<ReadDesc>, OfferSpans) {
    let mut reads = Vec::new();
    let mut offers = Vec::new();
    let mut at = 0u64;
    for t in tables {
        for o in &t.offers {
            let spec = t
                .tensors
                .iter()
                .find(|s| s.name == o.tensor)
                .expect("offer of a declared tensor");
            let len = o.tensor_box.extent.iter().product::<u64>() * spec.dtype.size();
            offers.push((at as usize..(at + len) as usize, o.digest));
            let mut k = 0;
            while k < len {
                let n = ABORT_READ.min(len - k);
                reads.push(ReadDesc {
                    owner: t.publisher.rank,
                    remote_region: o.location.region,
                    remote_offset: o.location.offset + k,
                    local_region: dst_region,
                    local_offset: at + k,
                    len: n,
                });
                k += n;
            }
            at += len;
        }
    }
    (reads, offers)
}

/// Reads of `reads` none of whose bytes landed in `dst` (every byte still the sentinel).
fn untouched(dst: &HostBuffer, reads: &[ReadDesc]) -> usize {
    let d = dst.read();
    reads
        .iter()
        .filter(|r| {
            d[r.local_offset as usize..(r.local_offset + r.len) as usize]
                .iter()
                .all(|&b| b == SENTINEL)
        })
        .count()
}

/// Reads whose last [`PROBE`] bytes still hold the sentinel (quick: a few bytes per read).
fn probably_pending(dst: &HostBuffer, reads: &[ReadDesc]) -> usize {
    let d = dst.read();
    reads
        .iter()
        .filter(|r| {
            let end = (r.local_offset + r.len) as usize;
            d[end - PROBE.min(r.len as usize)..end]
                .iter()
                .all(|&b| b == SENTINEL)
        })
        .count()
}

/// Abort cuts a posted batch short and returns once nothing touches the buffers; the prepared
/// batch still works afterwards.
///
/// The source is a cluster's publishers (in a child process for a cross-process harness); the
/// batch reads every byte they offer (~130 MB, 256 KiB reads) into a sentinel-filled
/// destination. A clean post-and-wait measures the batch's time `T`. Then each try posts, aborts
/// at once, and requires: nothing lands after `abort` returned (the destination is unchanged
/// after `max(2 T, 200 ms)`), and — the point of abort — some reads never landed at all, so
/// abort did not just wait for the whole batch. A try where `post` itself moved every byte
/// cannot show that and does not count (NOTE when every try was like that, as in the in-flight
/// safety checks); otherwise at least one try must have been cut short. Every try ends with a
/// clean transfer of the same prepared batch, checked against the publishers' digests.
pub async fn abort_stops_a_posted_batch(h: &Harness) {
    const TRIES: usize = 6;
    let cluster = h.cluster(abort_model(), "tp=2").await;
    let rx = h.endpoint("abort-dst").expect("endpoint");
    cluster.connect(rx.as_ref()).await.expect("load metadata");
    let tables = cluster.tables();
    let (probe_reads, _) = read_every_offer(&tables, 0);
    let len: u64 = probe_reads.iter().map(|r| r.len).sum();
    let dst = Arc::new(HostBuffer::zeroed(len as usize));
    let reg = rx
        .register(dst.clone() as Arc<dyn MemoryBlock>)
        .await
        .expect("register");
    let (reads, offers) = read_every_offer(&tables, reg.id());
    let n = reads.len();
    let prepared = rx
        .prepare(ReadBatch {
            reads: reads.clone(),
        })
        .await
        .expect("prepare");
    let check_exact = |ctx: &str| {
        let d = dst.read();
        for (range, digest) in &offers {
            if let Some(want) = digest {
                assert_eq!(
                    &Digest::of(&d[range.clone()]),
                    want,
                    "{ctx}: destination bytes {range:?} differ from the publisher's"
                );
            }
        }
    };
    let clean = |ctx: &'static str| {
        let (rx, prepared, dst) = (&rx, &prepared, &dst);
        async move {
            dst.write().fill(SENTINEL);
            let t = std::time::Instant::now();
            let report = rx
                .post(prepared)
                .await
                .unwrap_or_else(|e| panic!("{ctx}: post: {e}"))
                .wait()
                .await
                .unwrap_or_else(|e| panic!("{ctx}: wait: {e}"));
            let took = t.elapsed();
            assert_eq!(report.bytes, len, "{ctx}: bytes moved");
            took
        }
    };
    let took = clean("clean transfer")
        .await
        .min(clean("clean transfer").await);
    check_exact("clean transfer");

    let (mut cut, mut synchronous) = (0usize, 0usize);
    let mut log = Vec::new();
    for attempt in 0..TRIES {
        dst.write().fill(SENTINEL);
        let t = std::time::Instant::now();
        let inflight = rx.post(&prepared).await.expect("post");
        let pending_at_post = probably_pending(&dst, &reads);
        inflight.abort().await;
        let aborted_after = t.elapsed();
        // From here on not one byte may land.
        let before = xxhash_rust::xxh3::xxh3_128(&dst.read());
        let left = untouched(&dst, &reads);
        tokio::time::sleep((took * 2).max(std::time::Duration::from_millis(200))).await;
        let after = xxhash_rust::xxh3::xxh3_128(&dst.read());
        let still = untouched(&dst, &reads);
        assert!(
            before == after && left == still,
            "{}: try {attempt}: bytes landed after abort returned ({left} -> {still} of {n} \
             reads untouched; abort returned {aborted_after:?} after post, a clean batch takes \
             {took:?})",
            h.name()
        );
        log.push(format!(
            "{aborted_after:?}: {pending_at_post} pending at post, {left} of {n} never landed"
        ));
        if pending_at_post == 0 {
            synchronous += 1;
        } else if left > 0 {
            cut += 1;
        }
        // The same prepared batch moves every byte exactly again.
        clean("transfer after abort").await;
        check_exact("transfer after abort");
        if cut >= 2 {
            break;
        }
    }
    eprintln!(
        "{}: abort (clean batch {took:?}): {}",
        h.name(),
        log.join("; ")
    );
    if cut == 0 {
        if synchronous == log.len() {
            eprintln!(
                "NOTE: {} abort: every post completed the whole batch before returning; nothing \
                 was in flight to abort",
                h.name()
            );
            return;
        }
        panic!(
            "{}: abort never cut the batch short in {} tries ({synchronous} completed inside \
             post): it waits for every read instead of stopping them ({})",
            h.name(),
            log.len(),
            log.join("; ")
        );
    }
    drop(reg);
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

/// Asserts a failed update's error is typed and points at an injected fault: its owner is one a
/// fault hit, and its byte range overlaps the read that fault hit.
fn assert_names_a_fault(e: &reshard_core::Error, fired: &[Fired], ctx: &str) {
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Transport | ErrorKind::PeerUnknown | ErrorKind::Verification
        ),
        "{ctx}: unexpected error kind: {e}"
    );
    let owner = e
        .context()
        .owner
        .unwrap_or_else(|| panic!("{ctx}: error names no owner: {e}"));
    let range = e
        .context()
        .range
        .clone()
        .unwrap_or_else(|| panic!("{ctx}: error names no byte range: {e}"));
    assert!(
        fired
            .iter()
            .any(|f| f.owner == owner && f.range.start < range.end && range.start < f.range.end),
        "{ctx}: error names owner {owner} bytes {range:?}, which no fired fault hit ({fired:?}): {e}"
    );
    if e.kind() != ErrorKind::PeerUnknown {
        assert!(e.context().tensor.is_some(), "{ctx}: names no tensor: {e}");
    }
    if e.kind() == ErrorKind::Transport {
        assert!(
            e.is_retryable(),
            "{ctx}: an injected wire fault is retryable: {e}"
        );
    }
}

/// Fault property: over `cases` random [`crate::faults::FaultSchedule`]s (seed
/// [`crate::fault_seed`]) on one MoE cluster (EP8 x DP8 publishers, TP2 receiver rank 1)
/// reached through a [`FaultyTransport`], each case publishes a new step and refits under the
/// schedule. Then either the refit succeeded, no fault that must fail fired, and the live
/// weights are byte-exact for the new step; or it failed with a typed error naming the owner
/// and byte range of a fault that fired, and the live weights and step are exactly the previous
/// ones (a dropped peer keeps failing with `PeerUnknown` until it is back). Nothing posted is
/// left in flight or abandoned, the next refit with the faults cleared is byte-exact, the
/// wrapper's registrations and prepared batches stay at their steady count, and dropping the
/// receiver releases all of them.
pub async fn fault_schedules_never_expose_bad_weights(h: &Harness, cases: u32) {
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let started = std::time::Instant::now();
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let faulty = Arc::new(FaultyTransport::new(
        h.endpoint("receiver-faulty").expect("endpoint"),
    ));
    let mut rx = h
        .receiver_on(&cluster, faulty.clone(), 2, 1, ReceiverOptions::default())
        .await;
    rx.update(&cluster.tables()).await.expect("clean refit");
    let mut previous = cluster.expected_params(rx.layout()).expect("reference");
    assert_live(&rx, &previous, "warm-up");
    let registrations = faulty.live_registrations();
    let prepared = faulty.live_prepared();
    assert!(
        registrations > 0 && prepared > 0,
        "the wrapper sees the receiver's handles"
    );

    let seed = crate::fault_seed();
    eprintln!(
        "{}: fault schedules from seed {seed} (replay with {}={seed})",
        h.name(),
        crate::FAULT_SEED_ENV
    );
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    );
    let strategy = schedule_strategy();
    let (mut failed, mut silent, mut silent_caught, mut no_op) = (0u32, 0u32, 0u32, 0u32);
    for case in 0..cases {
        let schedule = strategy
            .new_tree(&mut runner)
            .expect("a schedule")
            .current();
        let ctx = format!(
            "{} fault case {case} ({}={seed}): {schedule:?}",
            h.name(),
            crate::FAULT_SEED_ENV
        );
        let live_step = cluster.step();
        let step = live_step + 1;
        cluster.publish_step(step).expect("publish step");
        let tables = cluster.tables();
        let want = cluster.expected_params(rx.layout()).expect("reference");

        faulty.set_schedule(schedule);
        let result = rx.update(&tables).await;
        let fired = faulty.fired();
        let is_silent = |f: &Fired| {
            matches!(
                f.kind,
                FaultKind::Corrupt { .. }
                    | FaultKind::Truncate {
                        report_error: false,
                        ..
                    }
            )
        };
        if is_no_op(&fired) {
            no_op += 1;
        }
        let only_silent = !fired.is_empty() && fired.iter().all(is_silent);
        if only_silent {
            silent += 1;
        }
        match result {
            Ok(_) => {
                assert!(
                    !fired.iter().any(|f| f.kind.must_fail()),
                    "{ctx}: the refit succeeded although {fired:?} fired"
                );
                assert_live(&rx, &want, &ctx);
                assert_eq!(rx.live_step(), Some(step), "{ctx}");
            }
            Err(e) => {
                failed += 1;
                if only_silent {
                    silent_caught += 1;
                    assert_eq!(e.kind(), ErrorKind::Verification, "{ctx}: {e}");
                }
                assert_names_a_fault(&e, &fired, &ctx);
                assert_live(&rx, &previous, &ctx);
                assert_eq!(rx.live_step(), Some(live_step), "{ctx}");
                let dropped = faulty.dropped_peers();
                if !dropped.is_empty() {
                    let e = rx
                        .update(&tables)
                        .await
                        .expect_err("a dropped peer stays unreachable");
                    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{ctx}: {e}");
                    let owner = e.context().owner.expect("names the peer");
                    assert!(dropped.contains(&owner), "{ctx}: {e}");
                    assert_live(&rx, &previous, &ctx);
                    assert_eq!(rx.live_step(), Some(live_step), "{ctx}");
                }
            }
        }
        assert_eq!(
            faulty.in_flight(),
            0,
            "{ctx}: a posted batch is still in flight"
        );
        assert_eq!(
            faulty.abandoned(),
            0,
            "{ctx}: a posted batch was dropped unawaited"
        );

        faulty.clear();
        rx.update(&tables)
            .await
            .unwrap_or_else(|e| panic!("{ctx}: the refit after clearing the faults failed: {e}"));
        assert_live(&rx, &want, &format!("{ctx} (faults cleared)"));
        assert_eq!(rx.live_step(), Some(step), "{ctx}");
        assert_eq!(
            faulty.live_registrations(),
            registrations,
            "{ctx}: registrations leak"
        );
        assert_eq!(
            faulty.live_prepared(),
            prepared,
            "{ctx}: prepared batches leak"
        );
        assert_eq!(faulty.in_flight(), 0, "{ctx}");
        previous = want;
    }
    if cases >= 200 {
        assert!(failed > 0, "schedules fail refits");
        // A case whose faults never fired (or only delayed the batch) tests nothing.
        assert!(
            no_op * 50 < cases,
            "{no_op} of {cases} fault cases injected nothing ({}={seed})",
            crate::FAULT_SEED_ENV
        );
        // A misdirected byte or a short tail can coincide with the bytes already there (about
        // 1 in 256); anything well below all of them caught means verification is blind.
        assert!(
            silent_caught * 10 >= silent * 9 && silent >= 20,
            "silent faults caught: {silent_caught} of {silent}"
        );
    }
    assert_eq!(rx.plan_builds(), 1, "faults never change the plan");
    drop(rx);
    assert_eq!(
        faulty.live_registrations(),
        0,
        "the receiver released its registrations"
    );
    assert_eq!(
        faulty.live_prepared(),
        0,
        "the receiver released its prepared batches"
    );
    eprintln!(
        "{}: {cases} fault schedules (seed {seed}) in {:.1} s ({failed} refits failed as they \
         should; {no_op} injected nothing; silent faults caught by verification: {silent_caught} \
         of {silent})",
        h.name(),
        started.elapsed().as_secs_f64()
    );
}

// ---- The bad-input catalogue's transport rows (README "Bad input", runtime/tests/bad_input.rs),
// ---- on every backend.

/// Catalogue row "offer outside the registered region": an offer whose box is valid but whose
/// bytes lie beyond the publisher's registered memory is `OutOfBounds` naming the owner, the
/// byte range (in the owner's region) and the backend; the live weights stay at the previous
/// step.
pub async fn offer_outside_the_registered_region(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=2,dp=2").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    rx.update(&cluster.tables()).await.expect("refit");
    let reference = cluster.expected_params(rx.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step");
    let mut tables = cluster.tables();
    let far = 1u64 << 40;
    let mut holders = Vec::new();
    for t in tables.iter_mut() {
        for o in t
            .offers
            .iter_mut()
            .filter(|o| o.tensor == "model.norm.weight")
        {
            o.location.offset = far;
            holders.push(t.publisher.rank);
        }
    }
    assert!(!holders.is_empty(), "someone offers the norm");
    let e = rx.update(&tables).await.expect_err("out of bounds");
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    let owner = e.context().owner.expect("names the owner");
    assert!(
        holders.contains(&owner),
        "owner {owner} holds no moved offer: {e}"
    );
    let range = e.context().range.clone().expect("names the byte range");
    assert!(range.start >= far, "{range:?}: {e}");
    assert_eq!(e.context().backend.as_deref(), Some(h.name()), "{e}");
    assert_kept(&rx, &reference, 0, "offer outside the registered region");
}

/// Catalogue row "publisher whose metadata was never loaded": a table under a rank whose
/// transport metadata the receiver never loaded is `PeerUnknown` naming that owner and a byte
/// range of one of its offers; the live weights stay at the previous step.
pub async fn publisher_whose_metadata_was_never_loaded(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=2,dp=2").await;
    let mut rx = h.receiver(&cluster, 2, 0).await;
    rx.update(&cluster.tables()).await.expect("refit");
    let reference = cluster.expected_params(rx.layout()).expect("reference");
    cluster.publish_step(1).expect("publish step");
    let mut tables = cluster.tables();
    let mut ranges = Vec::new();
    for t in tables.iter_mut().filter(|t| t.publisher.rank == 1) {
        t.publisher.rank = 5;
        for o in &t.offers {
            let spec = t.tensors.iter().find(|s| s.name == o.tensor).expect("spec");
            let len = o.tensor_box.extent.iter().product::<u64>() * spec.dtype.size();
            ranges.push(o.location.offset..o.location.offset + len);
        }
    }
    let e = rx.update(&tables).await.expect_err("rank 5 is unknown");
    assert_eq!(e.kind(), ErrorKind::PeerUnknown, "{e}");
    assert_eq!(e.context().owner, Some(5), "{e}");
    let range = e
        .context()
        .range
        .clone()
        .unwrap_or_else(|| panic!("names no byte range: {e}"));
    assert!(
        !range.is_empty()
            && ranges
                .iter()
                .any(|r| r.start < range.end && range.start < r.end),
        "{range:?} is not a byte range of the unknown rank's offers: {e}"
    );
    assert_kept(&rx, &reference, 0, "publisher never loaded");
}

/// Catalogue row "peer metadata changed for the same name": the publishers restart under their
/// agent names with new memory and the same table geometry (a new cluster; in a new process for
/// a cross-process harness). Until their metadata is loaded the refit fails with `Transport`
/// naming an owner and keeps the previous step; after `load_peer` the epoch has moved,
/// descriptors are rebuilt, the plan is kept and the refit is byte-exact.
pub async fn peer_metadata_changed_for_the_same_name(h: &Harness) {
    let first = h.cluster(tiny_moe(), "ep=2,dp=2").await;
    let mut rx = h.receiver(&first, 2, 0).await;
    rx.update(&first.tables()).await.expect("refit");
    let reference = first.expected_params(rx.layout()).expect("reference");
    let geometry = |tables: Vec<ShardTable>| -> Vec<(u32, String, u64, u64)> {
        tables
            .into_iter()
            .flat_map(|t| {
                let rank = t.publisher.rank;
                t.offers
                    .into_iter()
                    .map(move |o| (rank, o.tensor, o.location.region, o.location.offset))
            })
            .collect()
    };
    let first_geometry = geometry(first.tables());
    drop(first);
    let mut second = h.cluster(tiny_moe(), "ep=2,dp=2").await;
    second.publish_step(1).expect("publish step");
    let e = rx
        .update(&second.tables())
        .await
        .expect_err("the old metadata reaches nothing");
    // The catalogue promises a transport failure: the backend must notice the old peer is gone
    // (a wire error, or its no-progress timer), never read whatever the old metadata still
    // reaches (that is caught by digests only when they are on).
    assert!(
        matches!(e.kind(), ErrorKind::Transport | ErrorKind::Timeout),
        "{}: a read through the departed peer's metadata must fail on the wire, got: {e}",
        h.name()
    );
    let owner = e.context().owner.expect("names the owner");
    assert!(
        second.tables().iter().any(|t| t.publisher.rank == owner),
        "{e}"
    );
    assert_kept(&rx, &reference, 0, "peer restarted, metadata not loaded");

    let epoch = rx.transport().epoch();
    second
        .connect(rx.transport().as_ref())
        .await
        .expect("load the new metadata");
    assert_ne!(
        rx.transport().epoch(),
        epoch,
        "new peer metadata moves the epoch"
    );
    let r = rx.update(&second.tables()).await.expect("refit");
    assert!(
        r.descriptors_rebuilt,
        "new peer metadata must rebuild descriptors"
    );
    // The plan is kept when the restarted publishers' offers sit where the old ones did (a
    // backend whose region ids are not reproducible legitimately re-plans).
    // A quarantining failure (bytes may still land) makes the receiver drop its buffers and
    // re-plan, which is correct too.
    if geometry(second.tables()) == first_geometry && !e.is_quarantined() {
        assert!(!r.plan_rebuilt, "the geometry did not change");
    }
    assert_installed(&second, &rx);
}

/// One hand-made publisher: tensor `w`, `[8, 8]` u8, in its own registered region.
struct OnePublisher {
    transport: Arc<dyn Transport>,
    region: u64,
    _registration: reshard_core::Registration,
    bytes: Vec<u8>,
}

async fn one_publisher(h: &Harness, agent: &str, seed: u8) -> OnePublisher {
    let transport = h.endpoint(agent).expect("endpoint");
    let bytes: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(seed) ^ seed).collect();
    let buf = Arc::new(HostBuffer::from_bytes(&bytes));
    let registration = transport
        .register(buf as Arc<dyn MemoryBlock>)
        .await
        .expect("register");
    OnePublisher {
        region: registration.id(),
        transport,
        _registration: registration,
        bytes,
    }
}

fn one_table(p: &OnePublisher, region: u64, digest_of: &[u8], step: u64) -> ShardTable {
    use reshard_core::{DType, MemoryKind, OfferLocation, ShardOffer, TensorBox, TensorSpec};
    let mut t = ShardTable::new(0, p.transport.agent(), step).bound_to(p.transport.incarnation());
    t.tensors.push(TensorSpec::new("w", DType::U8, vec![8, 8]));
    t.offers.push(ShardOffer {
        tensor: "w".into(),
        tensor_box: TensorBox::new(vec![0, 0], vec![8, 8]),
        location: OfferLocation {
            region,
            offset: 0,
            memory: MemoryKind::Dram,
        },
        digest: Some(Digest::of(digest_of)),
        chunks: None,
    });
    t
}

fn whole_w() -> reshard_core::WantedLayout {
    use reshard_core::{DType, ParamSpec, TensorBox, WantedCopy, WantedLayout};
    WantedLayout {
        receiver_rank: 0,
        params: vec![ParamSpec {
            name: "w".into(),
            dtype: DType::U8,
            shape: vec![8, 8],
            copies: vec![WantedCopy {
                tensor: "w".into(),
                src_box: TensorBox::new(vec![0, 0], vec![8, 8]),
                dst_offset: 0,
                dst_strides: vec![8, 1],
            }],
        }],
    }
}

/// Catalogue row "peer metadata of another agent for the same rank": `load_peer` of a
/// differently named agent's metadata for a loaded rank is accepted and replaces the peer; a
/// table still bound to the old agent's endpoint fails `Transport` before any read; one bound to
/// the new agent but describing the old agent's bytes fails `Verification` naming tensor, owner
/// and byte range, with the live weights kept; the new agent's own table installs exactly. (The
/// publishers are made in this process by every harness: the row is about `load_peer`.)
pub async fn peer_metadata_from_another_agent_for_the_same_rank(h: &Harness) {
    let tag = if h.is_cross_process() { "x" } else { "i" };
    let first = one_publisher(h, &format!("bi-{tag}-pub-0"), 3).await;
    let rx_t = h.endpoint(&format!("bi-{tag}-rx")).expect("endpoint");
    rx_t.load_peer(
        0,
        first.transport.export_metadata().await.expect("metadata"),
    )
    .await
    .expect("load");
    let mut rx =
        Receiver::new(rx_t.clone(), whole_w(), ReceiverOptions::default()).expect("receiver");
    rx.update(&[one_table(&first, first.region, &first.bytes, 1)])
        .await
        .expect("refit");
    assert_eq!(
        rx.live_params().expect("live")[0].read()[..],
        first.bytes[..]
    );

    let other = one_publisher(h, &format!("bi-{tag}-pub-0-restarted"), 9).await;
    rx_t.load_peer(
        0,
        other.transport.export_metadata().await.expect("metadata"),
    )
    .await
    .expect("another agent's metadata for a loaded rank is accepted");
    // A table still bound to the old agent's endpoint is refused before any read is posted.
    let mut stale = one_table(&first, other.region, &first.bytes, 2);
    let before = snapshot(&rx);
    let e = rx
        .update(std::slice::from_ref(&stale))
        .await
        .expect_err("table of another incarnation");
    assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
    assert_eq!(e.context().owner, Some(0), "{e}");
    assert!(e.to_string().contains("incarnation"), "{e}");
    assert_eq!(snapshot(&rx), before, "live weights untouched");
    // Bound to the new agent but still claiming the old agent's bytes (its digest): the reads
    // reach the new agent and verification refuses them.
    stale.publisher.agent = other.transport.agent().to_owned();
    stale.publisher.incarnation = other.transport.incarnation();
    let e = rx.update(&[stale]).await.expect_err("stale digest");
    assert_eq!(e.kind(), ErrorKind::Verification, "{e}");
    assert_eq!(e.context().tensor.as_deref(), Some("w"), "{e}");
    assert_eq!(e.context().owner, Some(0), "{e}");
    assert_eq!(e.context().range, Some(0..64), "{e}");
    assert_eq!(snapshot(&rx), before, "live weights untouched");
    assert_kept(
        &rx,
        std::slice::from_ref(&first.bytes),
        1,
        "stale table of another agent",
    );
    let r = rx
        .update(&[one_table(&other, other.region, &other.bytes, 2)])
        .await
        .expect("the new agent's table installs");
    assert!(!r.plan_rebuilt || first.region != other.region);
    assert_eq!(
        rx.live_params().expect("live")[0].read()[..],
        other.bytes[..]
    );
    assert_eq!(rx.live_step(), Some(2));
}

// ---- Concurrent receivers.

/// Two receiver ranks (TP2 ranks 0 and 1, each on its own endpoint) refit concurrently, as two
/// tokio tasks, from the same publishers for several steps; each install is byte-exact.
pub async fn two_receivers_refit_concurrently(h: &Harness) {
    let mut cluster = h.cluster(tiny_moe(), "ep=8,dp=8").await;
    let mut rxs = vec![
        h.receiver(&cluster, 2, 0).await,
        h.receiver(&cluster, 2, 1).await,
    ];
    for step in 0..4 {
        if step > 0 {
            cluster.publish_step(step).expect("publish step");
        }
        let tables = Arc::new(cluster.tables());
        let tasks: Vec<_> = rxs
            .drain(..)
            .map(|mut rx| {
                let tables = tables.clone();
                tokio::spawn(async move {
                    let r = rx.update(&tables).await;
                    (rx, r)
                })
            })
            .collect();
        for t in tasks {
            let (rx, r) = t.await.expect("receiver task");
            r.unwrap_or_else(|e| panic!("rank {} step {step}: {e}", rx.layout().receiver_rank));
            assert_installed(&cluster, &rx);
            rxs.push(rx);
        }
    }
}

/// Environment variable naming the directory a receiver process (see
/// [`two_receiver_processes`]) exchanges files with its parent through; set only in that child.
/// Not `RESHARD_`-prefixed, so configuration loading never sees it.
pub const RECEIVER_DIR_ENV: &str = "CONFORMANCE_RECEIVER_DIR";
/// Environment variable: the receiver rank (TP2) a receiver process refits.
pub const RECEIVER_RANK_ENV: &str = "CONFORMANCE_RECEIVER_RANK";
/// Steps the receiver processes refit.
const RECEIVER_PROCESS_STEPS: u64 = 4;
/// Bound on any one wait of the receiver-process check.
const RECEIVER_PROCESS_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// True in a receiver process started by [`two_receiver_processes`].
pub fn is_receiver_process() -> bool {
    std::env::var_os(RECEIVER_DIR_ENV).is_some()
}

fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Writes `bytes` to `path` atomically (a reader polling for `path` never sees it half-written).
fn publish_file(path: &std::path::Path, bytes: &[u8]) {
    let tmp = path.with_extension("part");
    std::fs::write(&tmp, bytes).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename {}: {e}", path.display()));
}

/// Waits (polling every millisecond) until `path` exists; `alive` is asked between polls and
/// may panic (a child that died).
async fn wait_for_file(path: &std::path::Path, mut alive: impl FnMut()) {
    let t = std::time::Instant::now();
    while !path.exists() {
        alive();
        assert!(
            t.elapsed() < RECEIVER_PROCESS_WAIT,
            "timed out waiting for {}",
            path.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Body of a receiver process: a TP2 receiver rank ([`RECEIVER_RANK_ENV`]) on an endpoint from
/// `endpoint`, driven through files in [`RECEIVER_DIR_ENV`]. It loads the publishers' metadata,
/// then per step says it is ready, waits for the step's encoded tables, refits, and checks every
/// live parameter against the digests of the parent's reference; any failure panics, which
/// fails the child's test run (its exit status is what the parent checks).
pub fn serve_receiver(endpoint: impl Fn(&str) -> reshard_core::Result<Arc<dyn Transport>>) {
    use reshard_planner::layouts::receiver_layout;
    use reshard_planner::topology::ReceiverTopology;
    let dir = std::path::PathBuf::from(std::env::var_os(RECEIVER_DIR_ENV).expect("receiver dir"));
    let rank: u32 = std::env::var(RECEIVER_RANK_ENV)
        .expect("receiver rank")
        .parse()
        .expect("receiver rank is a number");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let t = endpoint(&format!("receiver-process-{rank}")).expect("receiver endpoint");
        let owners = std::fs::read_to_string(dir.join("owners")).expect("owners");
        for owner in owners.split_whitespace() {
            let md = std::fs::read(dir.join(format!("meta-{owner}"))).expect("metadata");
            t.load_peer(owner.parse().expect("owner"), md.into())
                .await
                .expect("load publisher metadata");
        }
        let layout = receiver_layout(&medium_dense(), &ReceiverTopology::tp(2), rank)
            .expect("receiver layout");
        let mut rx = Receiver::new(t, layout, ReceiverOptions::default()).expect("receiver");
        for s in 0..RECEIVER_PROCESS_STEPS {
            publish_file(&dir.join(format!("ready-{rank}-{s}")), b"");
            let ready = dir.join(format!("step-{s}"));
            wait_for_file(&ready, || {}).await;
            let count: usize = std::fs::read_to_string(&ready)
                .expect("step file")
                .trim()
                .parse()
                .expect("table count");
            let tables: Vec<ShardTable> = (0..count)
                .map(|i| {
                    let b = std::fs::read(dir.join(format!("step-{s}-table-{i}"))).expect("table");
                    reshard_core::encoding::decode_table(&b).expect("decode table")
                })
                .collect();
            let t0 = unix_nanos();
            rx.update(&tables)
                .await
                .unwrap_or_else(|e| panic!("receiver process {rank}: step {s}: {e}"));
            let t1 = unix_nanos();
            let want = std::fs::read_to_string(dir.join(format!("want-{rank}-{s}")))
                .expect("reference digests");
            let live = rx.live_params().expect("live weights");
            let want: Vec<&str> = want.lines().collect();
            assert_eq!(live.len(), want.len(), "receiver process {rank}: step {s}");
            for ((p, got), want) in rx.layout().params.iter().zip(live).zip(want) {
                assert_eq!(
                    Digest::of(&got.read()).to_hex(),
                    want,
                    "receiver process {rank}: step {s}: parameter {} differs from the reference",
                    p.name
                );
            }
            assert_eq!(rx.live_step(), Some(tables[0].step));
            publish_file(
                &dir.join(format!("ok-{rank}-{s}")),
                format!("{t0} {t1}").as_bytes(),
            );
        }
    });
}

/// Kills and reaps the receiver children if the parent check fails part-way.
struct Children(Vec<std::process::Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Two receiver processes at once against publishers in a third: the harness's publisher child
/// holds a ~80 MB dense model at TP2; two children started by `command()` (this test binary
/// re-executed as [`serve_receiver`]) are receiver ranks 0 and 1, each on its own endpoint.
/// For each of several steps both children signal ready, the parent hands them the step's
/// tables at once, and both refit concurrently; each checks its live weights byte for byte
/// (by digest) against the generator's reference. Each child reports through its exit status.
pub async fn two_receiver_processes(h: &Harness, command: impl Fn() -> std::process::Command) {
    assert!(h.is_cross_process(), "needs publishers in a child process");
    let started = std::time::Instant::now();
    let mut cluster = h.cluster(medium_dense(), "tp=2").await;
    let dir = std::env::temp_dir().join(format!(
        "reshard-receivers-{}-{}",
        std::process::id(),
        unix_nanos()
    ));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let mut owners = String::new();
    for (owner, md) in cluster.metadata().await.expect("metadata") {
        publish_file(&dir.join(format!("meta-{owner}")), &md);
        owners.push_str(&format!("{owner} "));
    }
    publish_file(&dir.join("owners"), owners.as_bytes());
    let layouts: Vec<_> = (0..2)
        .map(|r| {
            reshard_planner::layouts::receiver_layout(
                cluster.model(),
                &reshard_planner::topology::ReceiverTopology::tp(2),
                r,
            )
            .expect("layout")
        })
        .collect();
    let mut children = Children(
        (0..2)
            .map(|rank| {
                let mut c = command();
                c.env(RECEIVER_DIR_ENV, &dir)
                    .env(RECEIVER_RANK_ENV, rank.to_string())
                    .stdout(std::process::Stdio::null());
                c.spawn().expect("start a receiver process")
            })
            .collect(),
    );
    // A child that exited successfully has finished its last step (it may do so while the
    // other is still refitting); only a failed exit ends the wait early.
    let alive = |children: &mut Children| {
        for (rank, c) in children.0.iter_mut().enumerate() {
            if let Ok(Some(status)) = c.try_wait().map(|s| s.filter(|s| !s.success())) {
                panic!("{}: receiver process {rank} failed: {status}", h.name());
            }
        }
    };
    let mut overlapped = 0;
    for s in 0..RECEIVER_PROCESS_STEPS {
        if s > 0 {
            cluster.publish_step(s).expect("publish step");
        }
        for (rank, layout) in layouts.iter().enumerate() {
            let want: String = cluster
                .expected_params(layout)
                .expect("reference")
                .iter()
                .map(|p| Digest::of(p).to_hex() + "\n")
                .collect();
            publish_file(&dir.join(format!("want-{rank}-{s}")), want.as_bytes());
        }
        let tables = cluster.tables();
        for (i, t) in tables.iter().enumerate() {
            publish_file(
                &dir.join(format!("step-{s}-table-{i}")),
                &reshard_core::encoding::encode_table(t),
            );
        }
        for rank in 0..2 {
            wait_for_file(&dir.join(format!("ready-{rank}-{s}")), || {
                alive(&mut children)
            })
            .await;
        }
        // Both are waiting: hand them the step at once.
        publish_file(
            &dir.join(format!("step-{s}")),
            tables.len().to_string().as_bytes(),
        );
        let mut spans = Vec::new();
        for rank in 0..2 {
            let ok = dir.join(format!("ok-{rank}-{s}"));
            wait_for_file(&ok, || alive(&mut children)).await;
            let span = std::fs::read_to_string(&ok).expect("span");
            let v: Vec<u128> = span
                .split_whitespace()
                .map(|x| x.parse().expect("nanos"))
                .collect();
            spans.push((v[0], v[1]));
        }
        if spans[0].0 < spans[1].1 && spans[1].0 < spans[0].1 {
            overlapped += 1;
        }
    }
    for (rank, c) in children.0.iter_mut().enumerate() {
        let t = std::time::Instant::now();
        let status = loop {
            if let Some(status) = c.try_wait().expect("wait for a receiver process") {
                break status;
            }
            assert!(
                t.elapsed() < RECEIVER_PROCESS_WAIT,
                "receiver process {rank} hangs"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        assert!(status.success(), "receiver process {rank} failed: {status}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{}: two receiver processes refit {RECEIVER_PROCESS_STEPS} steps byte-exact in {:.1} s \
         (refits overlapped in time in {overlapped} of them)",
        h.name(),
        started.elapsed().as_secs_f64()
    );
}
