//! vLLM receiver topologies beyond one TP group: data-parallel replicas (`dp`) and expert
//! parallelism (`ep = tp * dp`, whole experts spread over every rank), parsed, validated, laid
//! out element by element on a small MoE model and planned against deduplicated tables.

mod common;

use std::collections::HashMap;

use reshard_core::{
    dedup, merge, DedupOptions, ErrorKind, MergedTable, ParamSpec, TensorBox, WantedLayout,
};
use reshard_planner::layouts::{receiver_layout, receiver_layouts, ReceiverLayouts};
use reshard_planner::plan::{plan, PlanOptions};
use reshard_planner::presets::{preset, ModelConfig};
use reshard_planner::topology::{geometry_tables, PublisherTopology, ReceiverTopology};

/// The shared small MoE model with 8 experts per layer.
fn tiny_moe() -> ModelConfig {
    common::tiny_moe(8)
}

fn recv(s: &str) -> ReceiverTopology {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn param<'a>(l: &'a WantedLayout, name: &str) -> &'a ParamSpec {
    l.params
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no parameter {name}"))
}

fn deduped(model: &ModelConfig, publishers: &str) -> MergedTable {
    let t: PublisherTopology = publishers.parse().unwrap();
    let tables = geometry_tables(model, &t, 0).unwrap();
    dedup(&merge(&tables).unwrap(), DedupOptions::default())
        .unwrap()
        .0
}

// ---------------------------------------------------------------------------------------------
// Parsing and validation

#[test]
fn receiver_keys_parse_print_and_round_trip() {
    let t = recv("tp=8,dp=16,ep=128");
    assert_eq!((t.tp, t.dp, t.ep), (8, 16, 128));
    assert_eq!(t.world(), 128);
    assert!(t.expert_parallel());
    assert_eq!(t.to_string(), "tp=8,dp=16,ep=128");
    assert_eq!(recv(&t.to_string()), t);
    // rank = dp_rank * tp + tp_rank
    assert_eq!(t.coords(0), (0, 0));
    assert_eq!(t.coords(7), (7, 0));
    assert_eq!(t.coords(8), (0, 1));
    assert_eq!(t.coords(127), (7, 15));

    // Only non-default keys beyond tp are printed, so a plain TP group prints as before.
    assert_eq!(recv("tp=2"), ReceiverTopology::tp(2));
    assert_eq!(ReceiverTopology::tp(2).to_string(), "tp=2");
    assert_eq!(
        (ReceiverTopology::tp(2).dp, ReceiverTopology::tp(2).ep),
        (1, 1)
    );
    let t = recv(" dp=2 , tp=4 ");
    assert_eq!((t.tp, t.dp, t.ep, t.world()), (4, 2, 1, 8));
    assert_eq!(t.to_string(), "tp=4,dp=2");
    assert!(!t.expert_parallel());
    // ep = tp * dp = 1 is the same placement as no expert parallelism.
    assert_eq!(recv("tp=1,ep=1"), ReceiverTopology::tp(1));
    // DP replicas share a layout unless experts are spread over every rank.
    assert_eq!(t.same_layout_as(5), 1);
    assert_eq!(recv("tp=4,dp=2,ep=8").same_layout_as(5), 5);
}

#[test]
fn bad_receiver_topologies_are_config_errors_naming_the_problem() {
    for (bad, names) in [
        ("", "tp, dp, ep"),
        ("tp=2,xp=2", "tp, dp, ep"),
        ("tp=2,dp=0", "dp"),
        ("tp=2,ep=0", "ep"),
        ("tp=2,dp=2,dp=2", "dp"),
        ("dp=2", "tp"),
        ("ep=4,dp=4", "tp"),
        // ep must be 1 or exactly tp * dp.
        ("tp=2,dp=2,ep=2", "ep=2"),
        ("tp=2,dp=2,ep=8", "tp*dp=4"),
        ("tp=2,ep=4", "ep=4"),
        ("tp=65536,dp=65536", "overflows"),
    ] {
        let e = bad.parse::<ReceiverTopology>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{bad:?}");
        assert!(e.message().contains(names), "{bad:?}: {e}");
    }
    // A hand-built struct is checked too.
    let t = ReceiverTopology {
        tp: 2,
        dp: 2,
        ep: 3,
    };
    assert_eq!(t.validate().unwrap_err().kind(), ErrorKind::Config);
    let e = receiver_layout(&tiny_moe(), &t, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}

#[test]
fn expert_parallel_needs_experts_that_split_evenly() {
    // A dense model has no experts to spread.
    let dense = preset("llama-3-8b").unwrap();
    let e = receiver_layout(&dense, &recv("tp=2,dp=2,ep=4"), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("dense") && e.message().contains("ep=4"),
        "{e}"
    );
    // ... but DP replicas of a dense model are fine.
    assert_eq!(
        receiver_layouts(
            &dense.with_overrides(Some(1), None, None).unwrap(),
            &recv("tp=2,dp=2")
        )
        .unwrap()
        .len(),
        4
    );
    // 8 experts over 16 ranks, or 8 over 3 ranks: the error names the stacked weight and extent.
    for r in ["tp=2,dp=8,ep=16", "tp=1,dp=3,ep=3"] {
        let e = ReceiverLayouts::new(&tiny_moe(), &recv(r)).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Layout, "{r}");
        assert_eq!(
            e.context().tensor.as_deref(),
            Some("model.layers.0.mlp.experts.w13_weight")
        );
        assert!(e.message().contains("8 experts"), "{e}");
    }
    // A rank outside the world is a Layout error, not a panic.
    let e = receiver_layout(&tiny_moe(), &recv("tp=2,dp=2,ep=4"), 4).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert!(e.message().contains("tp=2,dp=2,ep=4"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Layouts

/// Which (tensor, global coordinate) lands on each element of a parameter; fails on an element
/// written twice or never.
fn install(p: &ParamSpec) -> Vec<(String, Vec<u64>)> {
    let n: u64 = p.shape.iter().product();
    let mut out: Vec<Option<(String, Vec<u64>)>> = vec![None; n as usize];
    for c in &p.copies {
        let b = &c.src_box;
        let base = c.dst_offset / p.dtype.size();
        let mut rel = vec![0u64; b.rank()];
        'elements: loop {
            let g: Vec<u64> = (0..b.rank()).map(|d| b.offset[d] + rel[d]).collect();
            let dst = base
                + (0..b.rank())
                    .map(|d| rel[d] * c.dst_strides[d])
                    .sum::<u64>();
            let slot = &mut out[dst as usize];
            assert!(slot.is_none(), "{}: element {dst} written twice", p.name);
            *slot = Some((c.tensor.clone(), g));
            let mut d = b.rank();
            loop {
                if d == 0 {
                    break 'elements;
                }
                d -= 1;
                rel[d] += 1;
                if rel[d] < b.extent[d] {
                    break;
                }
                rel[d] = 0;
            }
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, s)| s.unwrap_or_else(|| panic!("{}: element {i} never written", p.name)))
        .collect()
}

fn is_expert_param(name: &str) -> bool {
    name.contains(".mlp.experts.")
}

#[test]
fn every_expert_is_held_whole_by_exactly_one_rank() {
    let model = tiny_moe();
    let (i, h) = (8u64, 8u64);
    for (r, per) in [
        ("tp=2,dp=2,ep=4", 2u64),
        ("tp=1,dp=8,ep=8", 1),
        ("tp=4,dp=1,ep=4", 2),
    ] {
        let t = recv(r);
        let layouts = receiver_layouts(&model, &t).unwrap();
        assert_eq!(layouts.len(), t.world() as usize, "{r}");
        // (layer, expert, proj) -> ranks holding it.
        let mut holders: HashMap<String, Vec<u32>> = HashMap::new();
        for (rank, l) in layouts.iter().enumerate() {
            assert_eq!(l.receiver_rank, rank as u32);
            for p in l.params.iter().filter(|p| is_expert_param(&p.name)) {
                for c in &p.copies {
                    holders
                        .entry(c.tensor.clone())
                        .or_default()
                        .push(rank as u32);
                    // Whole experts: the copy is the full source tensor.
                    let whole = model
                        .tensors()
                        .into_iter()
                        .find(|s| s.name == c.tensor)
                        .unwrap();
                    assert_eq!(c.src_box, whole.full_box(), "{r}: {}", c.tensor);
                }
            }
            for layer in 0..model.layers {
                let w13 = param(l, &format!("model.layers.{layer}.mlp.experts.w13_weight"));
                assert_eq!(w13.shape, vec![per, 2 * i, h], "{r}");
                assert_eq!(w13.copies.len() as u64, 2 * per);
                // Gate rows then up rows per expert, experts [rank * per, (rank + 1) * per).
                let inst = install(w13);
                for j in 0..per {
                    let e = rank as u64 * per + j;
                    for row in 0..2 * i {
                        for col in 0..h {
                            let (proj, src_row) = if row < i {
                                ("gate", row)
                            } else {
                                ("up", row - i)
                            };
                            let want = (
                                format!("model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"),
                                vec![src_row, col],
                            );
                            assert_eq!(inst[((j * 2 * i + row) * h + col) as usize], want);
                        }
                    }
                }
                let w2 = param(l, &format!("model.layers.{layer}.mlp.experts.w2_weight"));
                assert_eq!(w2.shape, vec![per, h, i], "{r}");
                let inst = install(w2);
                for j in 0..per {
                    let e = rank as u64 * per + j;
                    for row in 0..h {
                        for col in 0..i {
                            let want = (
                                format!("model.layers.{layer}.mlp.experts.{e}.down_proj.weight"),
                                vec![row, col],
                            );
                            assert_eq!(inst[((j * h + row) * i + col) as usize], want);
                        }
                    }
                }
            }
            // Every other parameter is written exactly once too.
            for p in &l.params {
                install(p);
            }
        }
        // 2 layers x 8 experts x 3 projections, each on exactly one rank.
        assert_eq!(holders.len(), 2 * 8 * 3, "{r}");
        for (tensor, ranks) in &holders {
            assert_eq!(ranks.len(), 1, "{r}: {tensor} held by {ranks:?}");
        }
    }
}

#[test]
fn attention_is_tp_sliced_and_identical_across_dp_replicas() {
    let model = tiny_moe();
    for r in ["tp=2,dp=2,ep=4", "tp=2,dp=2", "tp=4,dp=2,ep=8"] {
        let t = recv(r);
        let tp_only = receiver_layouts(&model, &ReceiverTopology::tp(t.tp)).unwrap();
        let layouts = receiver_layouts(&model, &t).unwrap();
        for (rank, l) in layouts.iter().enumerate() {
            let (tp_rank, _) = t.coords(rank as u32);
            let dense = |l: &WantedLayout| -> Vec<ParamSpec> {
                l.params
                    .iter()
                    .filter(|p| !is_expert_param(&p.name))
                    .cloned()
                    .collect()
            };
            // Attention, norms, router, embedding and head: what TP rank tp_rank of a plain
            // TP group holds, on every DP replica.
            assert_eq!(
                dense(l),
                dense(&tp_only[tp_rank as usize]),
                "{r} rank {rank}"
            );
            // Layouts the topology says are equal are equal (apart from receiver_rank): what
            // `reshard plan` relies on to plan each distinct layout once.
            let same = &layouts[t.same_layout_as(rank as u32) as usize];
            assert_eq!(l.params, same.params, "{r} rank {rank}");
        }
        // qkv of TP rank 1 holds q rows 8..16 (4 of 8 heads of 2).
        let q = &param(&layouts[1], "model.layers.0.self_attn.qkv_proj.weight").copies[0];
        let qr = 16 / t.tp as u64;
        assert_eq!(q.src_box, TensorBox::new(vec![qr, 0], vec![qr, 8]), "{r}");
        if t.expert_parallel() {
            // Expert-parallel ranks of one TP rank still differ in their experts.
            assert_ne!(layouts[1].params, layouts[1 + t.tp as usize].params);
        } else {
            // Without expert parallelism DP replicas want exactly the same bytes.
            assert_eq!(layouts[1].params, layouts[1 + t.tp as usize].params);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Planning

#[test]
fn every_expert_parallel_layout_plans_without_full_pulls() {
    let opts = PlanOptions::default();
    // Whole experts from TP2 publishers (each expert in two slices) and from TP1 EP publishers.
    let model = tiny_moe();
    for publishers in ["tp=2,ep=2,dp=2", "ep=4,dp=4"] {
        let table = deduped(&model, publishers);
        let t = recv("tp=2,dp=2,ep=4");
        let mut param_bytes = 0;
        for l in receiver_layouts(&model, &t).unwrap() {
            let p = plan(&table, &l, &opts).unwrap();
            assert_eq!(p.stats.full_pull_sources, 0, "{publishers}");
            assert_eq!(p.stats.staged_offers, 0, "{publishers}");
            assert_eq!(p.stats.extra_wire_bytes, 0, "{publishers}");
            assert_eq!(p.stats.written_bytes, p.stats.param_bytes);
            assert_eq!(p.stats.wire_bytes, p.stats.param_bytes);
            param_bytes += p.stats.param_bytes;
        }
        let experts: u64 = model
            .tensors()
            .iter()
            .filter(|s| s.name.contains(".mlp.experts."))
            .map(|s| s.bytes())
            .sum();
        // Expert bytes arrive once across the world; everything else once per DP replica, as
        // one plain TP2 group holds it (norms and router whole on both TP ranks, the rest
        // split), so it is what the TP2 group holds beyond its one copy of the experts.
        let tp_group: u64 = receiver_layouts(&model, &recv("tp=2"))
            .unwrap()
            .iter()
            .map(|l| l.bytes())
            .sum();
        let rest = tp_group - experts;
        assert!(
            rest > model.total_bytes() - experts,
            "replicated norms count twice"
        );
        assert_eq!(param_bytes, experts + 2 * rest, "{publishers}");
    }

    // A real preset scaled down: Qwen3-30B-A3B at 2 layers and 16 experts, Megatron EP8/DP8,
    // into vLLM DP4 with EP4 (TP1, so attention is whole too): every copy is one read.
    let qwen = preset("qwen3-30b-a3b")
        .unwrap()
        .with_overrides(Some(2), Some(16), Some(4096))
        .unwrap();
    let table = deduped(&qwen, "ep=8,dp=8");
    for l in receiver_layouts(&qwen, &recv("tp=1,dp=4,ep=4")).unwrap() {
        let p = plan(&table, &l, &opts).unwrap();
        assert_eq!(p.stats.full_pull_sources, 0);
        assert_eq!(p.stats.extra_wire_bytes, 0);
        // 2 layers x (q, k, v, o, 4 norms, router, 4 experts x 3) + embed, norm, head.
        assert_eq!(p.stats.copies, 2 * (9 + 4 * 3) + 3);
        // Each whole expert lies in one owner's block and one read per destination parameter:
        // gate and up are adjacent on both sides (Megatron's fc1, vLLM's w13), so they fuse
        // into one read, and down is a second. No expert tensor is split over reads.
        let mut reads_per_tensor = vec![0; p.tensors.len()];
        for r in &p.reads {
            reads_per_tensor[r.tensor as usize] += 1;
        }
        let experts: Vec<_> = (0..p.tensors.len())
            .filter(|&i| p.tensors[i].contains(".mlp.experts."))
            .collect();
        assert_eq!(experts.len(), 2 * 4 * 3);
        assert!(experts.iter().all(|&i| reads_per_tensor[i] <= 1));
        let expert_reads: u64 = experts.iter().map(|&i| reads_per_tensor[i]).sum();
        assert_eq!(expert_reads, 2 * 4 * 2);
    }
}

#[test]
fn dp_replicas_plan_identically() {
    // Plans depend on table and layout only, so replicas that want equal layouts get equal
    // plans (fingerprints): sharing one plan among them changes nothing.
    let model = tiny_moe();
    let table = deduped(&model, "tp=2,ep=2,dp=2");
    let t = recv("tp=2,dp=3");
    let layouts = receiver_layouts(&model, &t).unwrap();
    let fp: Vec<u64> = layouts
        .iter()
        .map(|l| {
            plan(&table, l, &PlanOptions::default())
                .unwrap()
                .fingerprint
        })
        .collect();
    for rank in 0..t.world() {
        assert_eq!(fp[rank as usize], fp[t.same_layout_as(rank) as usize]);
    }
    assert_ne!(fp[0], fp[1]);
}

#[test]
fn one_ranks_geometry_is_its_row_of_the_whole_and_a_rank_outside_is_named() {
    use reshard_planner::topology::{publisher_geometry, rank_geometry};
    let model = tiny_moe();
    let topo: PublisherTopology = "ep=2,dp=2".parse().expect("topology");
    let all = publisher_geometry(&model, &topo).expect("geometry");
    for g in &all {
        let one = rank_geometry(&model, &topo, g.rank).expect("rank geometry");
        assert_eq!(one.rank, g.rank);
        assert_eq!(one.shards.len(), g.shards.len());
        for (a, b) in one.shards.iter().zip(&g.shards) {
            assert_eq!((a.tensor, &a.tensor_box), (b.tensor, &b.tensor_box));
        }
    }
    let world = topo.world();
    let e = rank_geometry(&model, &topo, world).expect_err("outside");
    assert_eq!(e.kind(), reshard_core::ErrorKind::InvalidInput, "{e}");
    assert_eq!(e.context().owner, Some(world), "{e}");
    assert!(e.message().contains(&format!("rank {world}")), "{e}");
}
