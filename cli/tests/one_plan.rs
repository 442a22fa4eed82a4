//! One plan, every backend: the same refits (the default qwen3 rig, a dense and a MoE topology)
//! over every backend available in this process, each receiver's reads recorded by the backend
//! as it executed them ([`ExecutionLog`]). Every backend must run the same plan (fingerprint)
//! and execute the same multiset of reads, owner, region, offset, length and destination
//! included, and that multiset must be the plan's. Region ids are part of the contract
//! (1, 2, 3... per endpoint in registration order), so they must agree too.

use std::collections::BTreeMap;
use std::sync::Arc;

use reshard_conformance::checks::assert_installed;
use reshard_conformance::fixtures::{tiny_dense, tiny_moe};
use reshard_conformance::{backend_available, Harness};
use reshard_core::{ExecutionLog, ReadDesc};
use reshard_planner::presets::{preset, ModelConfig};
use reshard_runtime::ReceiverOptions;
use reshard_testkit::Placement;

/// One refit set-up: model, publisher topology, receiver TP, placement of publisher memory.
struct Rig {
    name: &'static str,
    model: ModelConfig,
    publishers: &'static str,
    tp: u32,
    placement: Placement,
}

fn rigs() -> Vec<Rig> {
    // `reshard refit`'s default rig: Qwen3-30B-A3B at 4 layers and 32 experts, EP8 x DP8 to
    // TP2; its replicas share memory as in `reshard refit` (per-rank memory would be 64 copies
    // of the dense weights).
    let qwen3 = preset("qwen3-30b-a3b")
        .expect("preset")
        .with_overrides(Some(4), Some(32), None)
        .expect("scaled preset");
    vec![
        Rig {
            name: "qwen3 default rig",
            model: qwen3,
            publishers: "ep=8,dp=8",
            tp: 2,
            placement: Placement::SharedReplicas,
        },
        Rig {
            name: "dense tp4 dp2 -> tp2",
            model: tiny_dense(4),
            publishers: "tp=4,dp=2",
            tp: 2,
            placement: Placement::PerRank,
        },
        Rig {
            name: "moe ep8 dp8 -> tp4",
            model: tiny_moe(),
            publishers: "ep=8,dp=8",
            tp: 4,
            placement: Placement::PerRank,
        },
    ]
}

/// Every registered backend usable here, with its default options, as the registry lists them
/// (the registry's loopback fabric lives as long as the harnesses that share it).
fn harnesses() -> Vec<Harness> {
    let registry = Arc::new(reshard::registry());
    let mut out = Vec::new();
    for scheme in registry.schemes() {
        if backend_available(scheme, registry.probe(scheme)) {
            let registry = Arc::clone(&registry);
            out.push(Harness::new(scheme, move |agent| {
                registry.create_default(scheme, agent)
            }));
        }
    }
    out
}

/// Sort key of a read, so multisets compare as sorted vectors.
fn key(r: &ReadDesc) -> (u32, u64, u64, u64, u64, u64) {
    (
        r.owner,
        r.remote_region,
        r.remote_offset,
        r.local_region,
        r.local_offset,
        r.len,
    )
}

/// What one receiver rank ran over one backend: plan fingerprint and executed reads, sorted.
type Executed = (String, Vec<ReadDesc>);

async fn run(h: &Harness, rig: &Rig) -> Vec<Executed> {
    let cluster = h
        .cluster_placed(rig.model.clone(), rig.publishers, rig.placement)
        .await;
    let mut out = Vec::new();
    for rank in 0..rig.tp {
        let t = h
            .endpoint(&format!("receiver-{rank}-of-{}", rig.tp))
            .expect("receiver endpoint");
        let log = ExecutionLog::new();
        assert!(
            t.set_execution_log(Some(log.clone())),
            "{}: the backend cannot record what it executes",
            h.name()
        );
        let mut rx = h
            .receiver_on(
                &cluster,
                t.clone(),
                rig.tp,
                rank,
                ReceiverOptions::default(),
            )
            .await;
        let report = rx
            .update(&cluster.tables())
            .await
            .unwrap_or_else(|e| panic!("{} over {}: refit: {e}", rig.name, h.name()));
        assert_installed(&cluster, &rx);
        let mut executed = log.take();
        executed.sort_by_key(key);
        let plan = rx.plan().expect("plan").clone();
        // The executed reads are the plan's: same owner, region, offset and length, as many.
        let mut planned: Vec<_> = plan
            .reads
            .iter()
            .map(|r| (r.owner, r.src_region, r.src_offset, r.len))
            .collect();
        planned.sort_unstable();
        let mut ran: Vec<_> = executed
            .iter()
            .map(|r| (r.owner, r.remote_region, r.remote_offset, r.len))
            .collect();
        ran.sort_unstable();
        assert_eq!(
            ran,
            planned,
            "{} over {} rank {rank}: executed reads differ from the plan",
            rig.name,
            h.name()
        );
        assert_eq!(report.wire_reads, executed.len() as u64, "{}", h.name());
        assert_eq!(
            report.wire_bytes,
            executed.iter().map(|r| r.len).sum::<u64>(),
            "{}",
            h.name()
        );
        assert!(
            executed
                .iter()
                .all(|r| r.remote_region >= 1 && r.local_region >= 1),
            "{}: region ids start at 1",
            h.name()
        );
        t.set_execution_log(None);
        out.push((format!("{:032x}", plan.fingerprint), executed));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_plan_every_backend() {
    let harnesses = harnesses();
    for rig in rigs() {
        let mut by_backend: BTreeMap<String, Vec<Executed>> = BTreeMap::new();
        for h in &harnesses {
            by_backend.insert(h.name().to_string(), run(h, &rig).await);
        }
        let (first, reference) = by_backend.iter().next().expect("loopback ran");
        for (name, got) in &by_backend {
            for (rank, ((fp_a, reads_a), (fp_b, reads_b))) in reference.iter().zip(got).enumerate()
            {
                assert_eq!(
                    fp_a, fp_b,
                    "{}: rank {rank} plan fingerprint over {first} and {name} differ",
                    rig.name
                );
                if reads_a != reads_b {
                    let at = reads_a
                        .iter()
                        .zip(reads_b)
                        .position(|(a, b)| a != b)
                        .unwrap_or(reads_a.len().min(reads_b.len()));
                    panic!(
                        "{}: rank {rank} executed reads over {first} and {name} differ ({} vs {} \
                         reads; first difference at {at}: {:?} vs {:?})",
                        rig.name,
                        reads_a.len(),
                        reads_b.len(),
                        reads_a.get(at),
                        reads_b.get(at)
                    );
                }
            }
        }
        eprintln!(
            "{}: {} backends ({}) ran the same plan and the same reads",
            rig.name,
            by_backend.len(),
            by_backend.keys().cloned().collect::<Vec<_>>().join(", ")
        );
    }
}
