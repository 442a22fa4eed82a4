//! Receiver layouts, topology parsing and publisher geometry, checked element by element on small
//! models and against docs/design.md §8 at full scale.

mod common;

use std::collections::HashMap;

use reshard_core::layout::row_major_strides;
use reshard_core::{merge, DType, ErrorKind, MemoryKind, ParamSpec, TensorBox, TensorSpec};
use reshard_planner::layouts::{
    column_parallel, kv_rows_for_rank, receiver_layout, receiver_layouts, replicated, row_block,
    row_parallel, split_box,
};
use reshard_planner::presets::{preset, presets, ModelConfig, MoeConfig};
use reshard_planner::topology::{
    geometry_tables, publisher_geometry, PublisherTopology, ReceiverTopology,
};

// ---------------------------------------------------------------------------------------------
// Helpers

/// The shared small MoE model with 4 experts per layer.
fn tiny_moe() -> ModelConfig {
    common::tiny_moe(4)
}

/// A small dense model: GQA 4/2, tied embeddings, f32 (to exercise a non-2-byte element).
fn tiny_dense() -> ModelConfig {
    ModelConfig {
        name: "tiny-dense".into(),
        layers: 2,
        hidden: 8,
        heads: 4,
        kv_heads: 2,
        head_dim: 2,
        intermediate: 8,
        moe: None,
        vocab: 256,
        tied_embeddings: true,
        qk_norm: false,
        dtype: DType::F32,
        arch: Default::default(),
    }
}

fn recv(tp: u32) -> ReceiverTopology {
    ReceiverTopology::tp(tp)
}

fn topo(s: &str) -> PublisherTopology {
    s.parse().unwrap()
}

fn spec_of(model: &ModelConfig, name: &str) -> TensorSpec {
    model
        .tensors()
        .into_iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
}

/// Every element of a box: (global coordinates, element offset at `base` with `strides`).
fn box_elements(b: &TensorBox, strides: &[u64], base: u64) -> Vec<(Vec<u64>, u64)> {
    let mut out = Vec::new();
    let mut rel = vec![0u64; b.rank()];
    loop {
        let global: Vec<u64> = (0..b.rank()).map(|d| b.offset[d] + rel[d]).collect();
        let dst = base + (0..b.rank()).map(|d| rel[d] * strides[d]).sum::<u64>();
        out.push((global, dst));
        let mut d = b.rank();
        loop {
            if d == 0 {
                return out;
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

/// Installs a parameter from its copies, element by element: which (tensor, global coordinate)
/// lands on each parameter element. Fails if an element is written twice or never.
fn install(p: &ParamSpec) -> Vec<(String, Vec<u64>)> {
    let n: u64 = p.shape.iter().product();
    let mut out: Vec<Option<(String, Vec<u64>)>> = vec![None; n as usize];
    let esize = p.dtype.size();
    for c in &p.copies {
        assert_eq!(c.dst_offset % esize, 0, "{}: unaligned copy", p.name);
        for (g, dst) in box_elements(&c.src_box, &c.dst_strides, c.dst_offset / esize) {
            let slot = &mut out[dst as usize];
            assert!(slot.is_none(), "{}: element {dst} written twice", p.name);
            *slot = Some((c.tensor.clone(), g));
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, s)| s.unwrap_or_else(|| panic!("{}: element {i} never written", p.name)))
        .collect()
}

fn param<'a>(layout: &'a reshard_core::WantedLayout, name: &str) -> &'a ParamSpec {
    layout
        .params
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("no parameter {name}"))
}

/// Element `(r, c)` of a 2-D installed parameter.
fn at(installed: &[(String, Vec<u64>)], cols: u64, r: u64, c: u64) -> (&str, Vec<u64>) {
    let (t, g) = &installed[(r * cols + c) as usize];
    (t.as_str(), g.clone())
}

// ---------------------------------------------------------------------------------------------
// Building blocks

#[test]
fn column_and_row_slices_for_dividing_tps() {
    let spec = TensorSpec::new("w", DType::Bf16, vec![64, 32]);
    for tp in [1u32, 2, 4, 8, 16, 32] {
        for r in 0..tp {
            let rows = 64 / tp as u64;
            let cols = 32 / tp as u64;
            assert_eq!(
                column_parallel(&spec, tp, r).unwrap(),
                TensorBox::new(vec![r as u64 * rows, 0], vec![rows, 32])
            );
            assert_eq!(
                row_parallel(&spec, tp, r).unwrap(),
                TensorBox::new(vec![0, r as u64 * cols], vec![64, cols])
            );
        }
    }
    // 64 TP ranks split 64 rows but not 32 columns.
    assert!(column_parallel(&spec, 64, 63).is_ok());
    assert_eq!(
        row_parallel(&spec, 64, 0).unwrap_err().kind(),
        ErrorKind::Layout
    );
}

#[test]
fn slice_that_does_not_divide_names_tensor_and_extent() {
    let spec = TensorSpec::new(
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        DType::Bf16,
        vec![768, 2048],
    );
    let e = column_parallel(&spec, 5, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(e.context().tensor.as_deref(), Some(spec.name.as_str()));
    assert!(e.message().contains("768"), "{e}");
    let e = row_parallel(&spec, 3, 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert!(e.message().contains("2048"), "{e}");
    // Out-of-range ranks, zero parts and missing dimensions are errors, not panics.
    assert_eq!(
        column_parallel(&spec, 2, 2).unwrap_err().kind(),
        ErrorKind::Layout
    );
    assert_eq!(
        column_parallel(&spec, 0, 0).unwrap_err().kind(),
        ErrorKind::Layout
    );
    let norm = TensorSpec::new("n", DType::Bf16, vec![2048]);
    assert_eq!(
        row_parallel(&norm, 2, 0).unwrap_err().kind(),
        ErrorKind::Layout
    );
    assert_eq!(
        split_box("n", &[8], 0, 4, 3).unwrap(),
        TensorBox::new(vec![6], vec![2])
    );
}

#[test]
fn replicated_and_row_block_helpers() {
    let spec = TensorSpec::new("w", DType::F32, vec![6, 4]);
    let p = replicated(&spec);
    assert_eq!(p.name, "w");
    assert_eq!(p.shape, vec![6, 4]);
    assert_eq!(p.copies.len(), 1);
    assert_eq!(p.copies[0].src_box, spec.full_box());
    assert_eq!(p.copies[0].dst_strides, vec![4, 1]);
    assert_eq!(
        row_block(&spec, 2, 3),
        TensorBox::new(vec![2, 0], vec![3, 4])
    );
}

// ---------------------------------------------------------------------------------------------
// Receiver layouts

#[test]
fn every_parameter_element_is_written_exactly_once() {
    for (model, tps) in [
        (tiny_moe(), vec![1, 2, 4, 8]),
        (tiny_dense(), vec![1, 2, 4]),
    ] {
        for tp in tps {
            for layout in receiver_layouts(&model, &recv(tp)).unwrap() {
                for p in &layout.params {
                    install(p);
                }
            }
        }
    }
}

#[test]
fn one_copy_per_source_tensor() {
    for tp in [1, 2, 4] {
        let model = tiny_moe();
        let l = receiver_layout(&model, &recv(tp), 0).unwrap();
        assert_eq!(l.copies(), model.tensors().len());
    }
    // Tied embeddings: the head is the embedding, so no lm_head tensor and no parameter.
    let dense = tiny_dense();
    let l = receiver_layout(&dense, &recv(2), 1).unwrap();
    assert_eq!(l.copies(), dense.tensors().len());
    assert!(l.params.iter().all(|p| p.name != "lm_head.weight"));
}

#[test]
fn norms_and_router_are_whole_on_every_rank() {
    let model = tiny_moe();
    for tp in [1, 2, 4] {
        for layout in receiver_layouts(&model, &recv(tp)).unwrap() {
            for name in [
                "model.layers.1.self_attn.q_norm.weight",
                "model.layers.1.self_attn.k_norm.weight",
                "model.layers.1.input_layernorm.weight",
                "model.layers.1.post_attention_layernorm.weight",
                "model.layers.1.mlp.gate.weight",
                "model.norm.weight",
            ] {
                let spec = spec_of(&model, name);
                let p = param(&layout, name);
                assert_eq!(p.shape, spec.shape);
                assert_eq!(p.copies.len(), 1);
                assert_eq!(p.copies[0].src_box, spec.full_box());
            }
        }
    }
}

#[test]
fn qkv_fused_when_kv_heads_at_least_tp() {
    // tiny_moe: 8 q heads, 2 KV heads, head dim 2, hidden 8: q 16 rows, k/v 4 rows.
    let model = tiny_moe();
    for tp in [1u64, 2] {
        for t in 0..tp {
            let l = receiver_layout(&model, &recv(tp as u32), t as u32).unwrap();
            let p = param(&l, "model.layers.0.self_attn.qkv_proj.weight");
            let (qr, kr) = (16 / tp, 4 / tp);
            assert_eq!(p.shape, vec![qr + 2 * kr, 8]);
            let inst = install(p);
            for c in 0..8 {
                for j in 0..qr {
                    assert_eq!(
                        at(&inst, 8, j, c),
                        (
                            "model.layers.0.self_attn.q_proj.weight",
                            vec![t * qr + j, c]
                        )
                    );
                }
                for j in 0..kr {
                    assert_eq!(
                        at(&inst, 8, qr + j, c),
                        (
                            "model.layers.0.self_attn.k_proj.weight",
                            vec![t * kr + j, c]
                        )
                    );
                    assert_eq!(
                        at(&inst, 8, qr + kr + j, c),
                        (
                            "model.layers.0.self_attn.v_proj.weight",
                            vec![t * kr + j, c]
                        )
                    );
                }
            }
        }
    }
    // Full scale, docs/design.md §8: TP2 rank 1 gets q rows 2048.., k and v rows 256.. (2 KV
    // heads each).
    let qwen = preset("qwen3-30b-a3b").unwrap();
    let l = receiver_layout(&qwen, &recv(2), 1).unwrap();
    let p = param(&l, "model.layers.47.self_attn.qkv_proj.weight");
    assert_eq!(p.shape, vec![2048 + 2 * 256, 2048]);
    let boxes: Vec<_> = p
        .copies
        .iter()
        .map(|c| (c.src_box.clone(), c.dst_offset))
        .collect();
    assert_eq!(
        boxes,
        vec![
            (TensorBox::new(vec![2048, 0], vec![2048, 2048]), 0),
            (
                TensorBox::new(vec![256, 0], vec![256, 2048]),
                2048 * 2048 * 2
            ),
            (
                TensorBox::new(vec![256, 0], vec![256, 2048]),
                (2048 + 256) * 2048 * 2
            ),
        ]
    );
}

#[test]
fn qkv_fused_when_kv_heads_fewer_than_tp() {
    // 2 KV heads over TP4 and TP8: each KV head replicated on 2 (resp. 4) consecutive ranks.
    let model = tiny_moe();
    for tp in [4u64, 8] {
        let per_head = tp / 2;
        for t in 0..tp {
            let l = receiver_layout(&model, &recv(tp as u32), t as u32).unwrap();
            let p = param(&l, "model.layers.1.self_attn.qkv_proj.weight");
            let qr = 16 / tp;
            assert_eq!(p.shape, vec![qr + 4, 8]);
            let inst = install(p);
            let head = t / per_head;
            for c in 0..8 {
                for j in 0..2 {
                    assert_eq!(
                        at(&inst, 8, qr + j, c),
                        (
                            "model.layers.1.self_attn.k_proj.weight",
                            vec![head * 2 + j, c]
                        )
                    );
                    assert_eq!(
                        at(&inst, 8, qr + 2 + j, c),
                        (
                            "model.layers.1.self_attn.v_proj.weight",
                            vec![head * 2 + j, c]
                        )
                    );
                }
            }
        }
    }
    assert_eq!(kv_rows_for_rank(&model, 8, 5).unwrap(), (2, 2));
    assert_eq!(kv_rows_for_rank(&model, 2, 1).unwrap(), (2, 2));
    assert_eq!(kv_rows_for_rank(&model, 1, 0).unwrap(), (0, 4));
}

#[test]
fn qkv_errors_name_tensor_and_extent() {
    // 8 heads over TP3: not divisible.
    let e = receiver_layout(&tiny_moe(), &recv(3), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.layers.0.self_attn.q_proj.weight")
    );
    assert!(e.message().contains("16"), "{e}");
    // 12 heads, 3 KV heads over TP2: heads divide, KV heads do not.
    let mut m = tiny_moe();
    m.heads = 12;
    m.kv_heads = 3;
    let e = receiver_layout(&m, &recv(2), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.layers.0.self_attn.k_proj.weight")
    );
    assert!(e.message().contains("6"), "{e}");
    // 12 heads, 3 KV heads over TP4: heads divide, 4 is not a multiple of 3 KV heads.
    let e = receiver_layout(&m, &recv(4), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    // Rank outside the topology.
    assert_eq!(
        receiver_layout(&m, &recv(2), 2).unwrap_err().kind(),
        ErrorKind::Layout
    );
}

#[test]
fn o_proj_and_down_are_row_parallel_column_halves() {
    let model = tiny_dense();
    for t in 0..2u64 {
        let l = receiver_layout(&model, &recv(2), t as u32).unwrap();
        // o_proj [hidden 8, q rows 8] -> [8, 4], columns t*4...
        let p = param(&l, "model.layers.0.self_attn.o_proj.weight");
        assert_eq!(p.shape, vec![8, 4]);
        assert_eq!(p.copies[0].dst_strides, vec![4, 1]);
        let inst = install(p);
        for r in 0..8 {
            for c in 0..4 {
                assert_eq!(
                    at(&inst, 4, r, c),
                    ("model.layers.0.self_attn.o_proj.weight", vec![r, t * 4 + c])
                );
            }
        }
        let p = param(&l, "model.layers.1.mlp.down_proj.weight");
        assert_eq!(p.shape, vec![8, 4]);
        assert_eq!(
            p.copies[0].src_box,
            TensorBox::new(vec![0, t * 4], vec![8, 4])
        );
    }
}

#[test]
fn dense_gate_up_is_gate_half_then_up_half() {
    let model = tiny_dense();
    for tp in [1u64, 2, 4] {
        for t in 0..tp {
            let l = receiver_layout(&model, &recv(tp as u32), t as u32).unwrap();
            let p = param(&l, "model.layers.1.mlp.gate_up_proj.weight");
            let ip = 8 / tp;
            assert_eq!(p.shape, vec![2 * ip, 8]);
            let inst = install(p);
            for c in 0..8 {
                for j in 0..ip {
                    assert_eq!(
                        at(&inst, 8, j, c),
                        ("model.layers.1.mlp.gate_proj.weight", vec![t * ip + j, c])
                    );
                    assert_eq!(
                        at(&inst, 8, ip + j, c),
                        ("model.layers.1.mlp.up_proj.weight", vec![t * ip + j, c])
                    );
                }
            }
            // f32: byte offsets use 4-byte elements.
            assert_eq!(p.copies[1].dst_offset, ip * 8 * 4);
        }
    }
    let mut m = tiny_dense();
    m.intermediate = 6;
    let e = receiver_layout(&m, &recv(4), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.layers.0.mlp.gate_proj.weight")
    );
}

#[test]
fn stacked_experts_w13_and_w2() {
    // 4 experts, expert intermediate 8, hidden 8, TP2: w13 [4, 8, 8], w2 [4, 8, 4].
    let model = tiny_moe();
    let ip = 4u64;
    for t in 0..2u64 {
        let l = receiver_layout(&model, &recv(2), t as u32).unwrap();
        let w13 = param(&l, "model.layers.1.mlp.experts.w13_weight");
        assert_eq!(w13.shape, vec![4, 2 * ip, 8]);
        let inst = install(w13);
        for e in 0..4u64 {
            let gate = format!("model.layers.1.mlp.experts.{e}.gate_proj.weight");
            let up = format!("model.layers.1.mlp.experts.{e}.up_proj.weight");
            let base = e * 2 * ip * 8;
            for j in 0..ip {
                for c in 0..8 {
                    let g = &inst[(base + j * 8 + c) as usize];
                    assert_eq!(g, &(gate.clone(), vec![t * ip + j, c]));
                    let u = &inst[(base + (ip + j) * 8 + c) as usize];
                    assert_eq!(u, &(up.clone(), vec![t * ip + j, c]));
                }
            }
        }
        let w2 = param(&l, "model.layers.1.mlp.experts.w2_weight");
        assert_eq!(w2.shape, vec![4, 8, ip]);
        let inst = install(w2);
        for e in 0..4u64 {
            let down = format!("model.layers.1.mlp.experts.{e}.down_proj.weight");
            for r in 0..8 {
                for j in 0..ip {
                    let d = &inst[(e * 8 * ip + r * ip + j) as usize];
                    assert_eq!(d, &(down.clone(), vec![r, t * ip + j]));
                }
            }
        }
    }
    // Full scale: expert 127 of TP2 rank 1 lands at byte 127 * (2 * 384) * 2048 * 2.
    let qwen = preset("qwen3-30b-a3b").unwrap();
    let l = receiver_layout(&qwen, &recv(2), 1).unwrap();
    let w13 = param(&l, "model.layers.0.mlp.experts.w13_weight");
    assert_eq!(w13.shape, vec![128, 768, 2048]);
    let last_up = &w13.copies[255];
    assert_eq!(
        last_up.tensor,
        "model.layers.0.mlp.experts.127.up_proj.weight"
    );
    assert_eq!(
        last_up.src_box,
        TensorBox::new(vec![384, 0], vec![384, 2048])
    );
    assert_eq!(last_up.dst_offset, (127 * 768 * 2048 + 384 * 2048) * 2);
    let w2 = param(&l, "model.layers.0.mlp.experts.w2_weight");
    assert_eq!(w2.shape, vec![128, 2048, 384]);
    assert_eq!(w2.copies[3].dst_offset, 3 * 2048 * 384 * 2);
    assert_eq!(w2.copies[3].dst_strides, vec![384, 1]);
    // An expert intermediate of 6 does not split over TP4, while everything else does.
    let mut m = tiny_moe();
    m.moe = Some(MoeConfig {
        experts: 4,
        expert_intermediate: 6,
    });
    let e = receiver_layout(&m, &recv(4), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.layers.0.mlp.experts.0.gate_proj.weight")
    );
}

#[test]
fn vocab_parallel_embedding_and_head() {
    let model = tiny_moe();
    for t in 0..4u64 {
        let l = receiver_layout(&model, &recv(4), t as u32).unwrap();
        for name in ["model.embed_tokens.weight", "lm_head.weight"] {
            let p = param(&l, name);
            assert_eq!(p.shape, vec![64, 8]);
            assert_eq!(
                p.copies[0].src_box,
                TensorBox::new(vec![t * 64, 0], vec![64, 8])
            );
        }
    }
    // vLLM pads a vocabulary to a multiple of 64 and splits the padded one: 1,000 rows become
    // 1,024, 512 per rank; rank 1 holds rows 512..1000 in the first 488 rows of its 512, and
    // the rest is padding no copy writes.
    let mut m = tiny_moe();
    m.vocab = 1000;
    for (t, rows) in [(0u64, 512u64), (1, 488)] {
        let l = receiver_layout(&m, &recv(2), t as u32).unwrap();
        for name in ["model.embed_tokens.weight", "lm_head.weight"] {
            let p = param(&l, name);
            assert_eq!(p.shape, vec![512, 8], "{name} of rank {t}");
            assert_eq!(p.copies.len(), 1);
            assert_eq!(
                (&p.copies[0].src_box, p.copies[0].dst_offset),
                (&TensorBox::new(vec![t * 512, 0], vec![rows, 8]), 0)
            );
        }
    }
    // Qwen's 151,935-row vocabulary: 151,936 padded, 75,968 per rank of TP2.
    let m = preset("qwen3-30b-a3b")
        .unwrap()
        .with_overrides(Some(1), Some(8), Some(151_935))
        .unwrap();
    let l = receiver_layout(&m, &recv(2), 1).unwrap();
    let p = param(&l, "model.embed_tokens.weight");
    assert_eq!(p.shape[0], 75_968);
    assert_eq!(p.copies[0].src_box.offset[0], 75_968);
    assert_eq!(p.copies[0].src_box.extent[0], 75_967);
    // A padded vocabulary TP does not divide (1,024 over 3), and a rank that would hold only
    // padding (16 rows padded to 64, 32 per rank of TP2: rank 1 has none), are typed errors
    // naming the tensor.
    let mut m = tiny_moe();
    m.heads = 6;
    m.kv_heads = 3;
    m.vocab = 1000;
    let e = receiver_layout(&m, &recv(3), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.embed_tokens.weight")
    );
    assert!(e.message().contains("1024"), "{e}");
    m = tiny_moe();
    m.vocab = 16;
    let e = receiver_layout(&m, &recv(2), 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert!(e.message().contains("only padding"), "{e}");
}

#[test]
fn full_scale_layout_matches_design() {
    let qwen = preset("qwen3-30b-a3b").unwrap();
    for t in 0..2 {
        let l = receiver_layout(&qwen, &recv(2), t).unwrap();
        assert_eq!(l.copies(), 18_867);
        assert_eq!(l.receiver_rank, t);
        // Half of every TP-split tensor, all of the replicated ones.
        let o = param(&l, "model.layers.3.self_attn.o_proj.weight");
        assert_eq!(o.shape, vec![2048, 2048]);
        assert_eq!(param(&l, "lm_head.weight").shape, vec![75_968, 2048]);
    }
}

// ---------------------------------------------------------------------------------------------
// Presets

#[test]
fn presets_are_listed_and_unknown_names_are_config_errors() {
    let names: Vec<_> = presets().iter().map(|p| p.name).collect();
    assert_eq!(names, vec!["qwen3-30b-a3b", "llama-3-8b", "kimi-k2"]);
    for p in presets() {
        assert_eq!(p.config.name, p.name);
        assert!(!p.source.is_empty() && !p.description.is_empty());
        p.config.validate().unwrap();
    }
    let e = preset("gpt-5").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("qwen3-30b-a3b"));
}

#[test]
fn kimi_k2_is_a_trillion_parameter_moe() {
    let m = preset("kimi-k2").unwrap();
    let t = m.tensors();
    // The real architecture (DeepSeek-V3): per layer MLA (q_a_proj, q_a_layernorm, q_b_proj,
    // kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj) and 2 norms; layer 0 a dense MLP
    // (3), the 60 others a router, its bias, 384 x 3 experts and a shared expert (3); embed,
    // final norm, head.
    assert_eq!(t.len(), 9 + 3 + 60 * (9 + 2 + 384 * 3 + 3) + 3);
    let shape = |n: &str| t.iter().find(|s| s.name == n).unwrap().shape.clone();
    assert_eq!(
        shape("model.layers.0.self_attn.q_a_proj.weight"),
        [1536, 7168]
    );
    assert_eq!(
        shape("model.layers.0.self_attn.q_b_proj.weight"),
        [64 * 192, 1536]
    );
    assert_eq!(
        shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
        [576, 7168]
    );
    assert_eq!(
        shape("model.layers.0.self_attn.kv_b_proj.weight"),
        [64 * 256, 512]
    );
    assert_eq!(
        shape("model.layers.0.self_attn.o_proj.weight"),
        [7168, 64 * 128]
    );
    assert_eq!(shape("model.layers.0.mlp.down_proj.weight"), [7168, 18_432]);
    assert_eq!(
        shape("model.layers.1.mlp.shared_experts.up_proj.weight"),
        [2048, 7168]
    );
    assert_eq!(
        shape("model.layers.60.mlp.gate.e_score_correction_bias"),
        [384]
    );
    assert!(!t.iter().any(|s| s.name == "model.layers.0.mlp.gate.weight"));
    let params = m.total_bytes() / 2;
    assert!(
        (1_000_000_000_000..1_100_000_000_000).contains(&params),
        "{params} parameters"
    );
}

#[test]
fn qwen3_tensors_match_design() {
    let m = preset("qwen3-30b-a3b").unwrap();
    let t = m.tensors();
    assert_eq!(t.len(), 18_867);
    let shapes: HashMap<_, _> = t
        .iter()
        .map(|s| (s.name.as_str(), s.shape.clone()))
        .collect();
    let expect: &[(&str, &[u64])] = &[
        ("model.embed_tokens.weight", &[151_936, 2048]),
        ("model.layers.0.self_attn.q_proj.weight", &[4096, 2048]),
        ("model.layers.0.self_attn.k_proj.weight", &[512, 2048]),
        ("model.layers.0.self_attn.v_proj.weight", &[512, 2048]),
        ("model.layers.0.self_attn.o_proj.weight", &[2048, 4096]),
        ("model.layers.0.self_attn.q_norm.weight", &[128]),
        ("model.layers.0.self_attn.k_norm.weight", &[128]),
        ("model.layers.0.input_layernorm.weight", &[2048]),
        ("model.layers.0.post_attention_layernorm.weight", &[2048]),
        ("model.layers.0.mlp.gate.weight", &[128, 2048]),
        (
            "model.layers.47.mlp.experts.127.gate_proj.weight",
            &[768, 2048],
        ),
        (
            "model.layers.47.mlp.experts.127.up_proj.weight",
            &[768, 2048],
        ),
        (
            "model.layers.47.mlp.experts.127.down_proj.weight",
            &[2048, 768],
        ),
        ("model.norm.weight", &[2048]),
        ("lm_head.weight", &[151_936, 2048]),
    ];
    for (name, shape) in expect {
        assert_eq!(shapes[name].as_slice(), *shape, "{name}");
    }
    assert!(t.iter().all(|s| s.dtype == DType::Bf16));
    // Deterministic, unique names.
    assert_eq!(m.tensors(), t);
    assert_eq!(shapes.len(), t.len());
}

#[test]
fn overrides_shrink_and_reject_nonsense() {
    let m = preset("qwen3-30b-a3b").unwrap();
    let small = m
        .clone()
        .with_overrides(Some(2), Some(16), Some(1024))
        .unwrap();
    assert_eq!(small.tensors().len(), 2 * (9 + 3 * 16) + 3);
    assert_eq!(small.vocab, 1024);
    for (l, e, v) in [
        (Some(0), None, None),
        (Some(49), None, None),
        (None, Some(0), None),
        (None, Some(129), None),
        (None, None, Some(0)),
        (None, None, Some(151_937)),
    ] {
        assert_eq!(
            m.clone().with_overrides(l, e, v).unwrap_err().kind(),
            ErrorKind::Config
        );
    }
    let dense = preset("llama-3-8b").unwrap();
    assert_eq!(
        dense
            .with_overrides(None, Some(8), None)
            .unwrap_err()
            .kind(),
        ErrorKind::Config
    );
    let mut bad = tiny_moe();
    bad.kv_heads = 3;
    assert_eq!(bad.validate().unwrap_err().kind(), ErrorKind::Config);
}

// ---------------------------------------------------------------------------------------------
// Topology parsing

#[test]
fn publisher_topology_parses_with_defaults_and_round_trips() {
    let t = topo("ep=8,dp=8");
    assert_eq!(
        t,
        PublisherTopology {
            tp: 1,
            ep: 8,
            dp: 8,
            pp: 1
        }
    );
    assert_eq!(t.world(), 8);
    assert_eq!(t.to_string(), "tp=1,ep=8,dp=8,pp=1");
    assert_eq!(topo(&t.to_string()), t);
    let t = topo(" tp=2 , dp=4,pp=3 ");
    assert_eq!(
        t,
        PublisherTopology {
            tp: 2,
            ep: 1,
            dp: 4,
            pp: 3
        }
    );
    assert_eq!(t.world(), 24);
    // rank = pp_rank * (tp * dp) + dp_rank * tp + tp_rank
    assert_eq!(t.coords(0), (0, 0, 0));
    assert_eq!(t.coords(1), (1, 0, 0));
    assert_eq!(t.coords(2), (0, 1, 0));
    assert_eq!(t.coords(8), (0, 0, 1));
    assert_eq!(t.coords(23), (1, 3, 2));
}

#[test]
fn topology_parse_errors_are_config_errors() {
    for bad in [
        "",
        "ep=0",
        "xp=2",
        "tp",
        "tp=two",
        "tp=-1",
        "tp=2,tp=2",
        "dp=65536,tp=65536",
    ] {
        let e = bad.parse::<PublisherTopology>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{bad:?}");
    }
    let e = "xp=2".parse::<PublisherTopology>().unwrap_err();
    assert!(e.message().contains("tp, ep, dp, pp"), "{e}");
    assert_eq!("tp=2".parse::<ReceiverTopology>().unwrap(), recv(2));
    assert_eq!(recv(4).to_string(), "tp=4");
    for bad in ["", "tp=0", "dp=2", "tp=1,tp=2"] {
        let e = bad.parse::<ReceiverTopology>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{bad:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Publisher geometry

/// Per tensor, how often each element is offered across all ranks (small models only).
fn coverage(model: &ModelConfig, t: &PublisherTopology) -> Vec<(String, Vec<u32>)> {
    let specs = model.tensors();
    let mut counts: Vec<Vec<u32>> = specs
        .iter()
        .map(|s| vec![0; s.shape.iter().product::<u64>() as usize])
        .collect();
    for g in publisher_geometry(model, t).unwrap() {
        for s in g.shards {
            let strides = row_major_strides(&specs[s.tensor].shape);
            let b = &s.tensor_box;
            let base: u64 = (0..b.rank()).map(|d| b.offset[d] * strides[d]).sum();
            for (_, i) in box_elements(b, &strides, base) {
                counts[s.tensor][i as usize] += 1;
            }
        }
    }
    specs.into_iter().map(|s| s.name).zip(counts).collect()
}

#[test]
fn every_tensor_is_covered_once_per_replica() {
    let cases = [
        (tiny_moe(), "tp=1"),
        (tiny_moe(), "ep=4,dp=4"),
        (tiny_moe(), "ep=2,dp=4"),
        (tiny_moe(), "tp=2,ep=2,dp=2"),
        (tiny_moe(), "tp=4,dp=2"),
        (tiny_moe(), "tp=8,ep=4,dp=4,pp=2"),
        (tiny_dense(), "tp=2,dp=3"),
        (tiny_dense(), "tp=4,pp=2"),
    ];
    for (model, s) in cases {
        let t = topo(s);
        for (name, counts) in coverage(&model, &t) {
            // Experts have dp / ep replicas; norms and the router are whole on every TP rank
            // of every replica; every other tensor is split over TP and replicated dp times.
            let want = if name.contains(".experts.") {
                t.dp / t.ep
            } else if name.ends_with("norm.weight") || name.ends_with(".mlp.gate.weight") {
                t.dp * t.tp
            } else {
                t.dp
            };
            assert!(
                counts.iter().all(|&c| c == want),
                "{s}: {name} covered {:?} times, want {want}",
                counts.iter().min()..counts.iter().max()
            );
        }
    }
}

#[test]
fn design_ep8_dp8_geometry() {
    let qwen = preset("qwen3-30b-a3b").unwrap();
    let specs = qwen.tensors();
    let by_name: HashMap<&str, &TensorSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
    let g = publisher_geometry(&qwen, &topo("ep=8,dp=8")).unwrap();
    assert_eq!(g.len(), 8);
    for rank in &g {
        let r = rank.rank as u64;
        let mut per_tensor: HashMap<&str, Vec<&TensorBox>> = HashMap::new();
        for s in &rank.shards {
            per_tensor
                .entry(specs[s.tensor].name.as_str())
                .or_default()
                .push(&s.tensor_box);
        }
        for (name, boxes) in &per_tensor {
            if let Some(rest) = name.strip_prefix("model.layers.") {
                if let Some(pos) = rest.find(".mlp.experts.") {
                    let e: u64 = rest[pos + 13..].split('.').next().unwrap().parse().unwrap();
                    assert!((16 * r..16 * r + 16).contains(&e), "rank {r} holds {name}");
                }
            }
            let spec = by_name[name];
            if name.ends_with("q_proj.weight") {
                let want: Vec<_> = (0..4).map(|g| row_block(spec, g * 1024, 1024)).collect();
                assert_eq!(boxes.iter().map(|b| (*b).clone()).collect::<Vec<_>>(), want);
            } else if name.ends_with("k_proj.weight") || name.ends_with("v_proj.weight") {
                let want: Vec<_> = (0..4).map(|g| row_block(spec, g * 128, 128)).collect();
                assert_eq!(boxes.iter().map(|b| (*b).clone()).collect::<Vec<_>>(), want);
            } else {
                assert_eq!(boxes.as_slice(), &[&spec.full_box()], "{name} whole");
            }
        }
        // Every dense tensor, and 16 experts x 3 x 48 layers.
        let dense = 48 * 9 + 3;
        assert_eq!(per_tensor.len(), dense + 16 * 3 * 48);
    }
}

#[test]
fn tp_above_kv_heads_leaves_some_ranks_with_only_q_rows() {
    // tiny_moe has 2 KV heads, 8 q heads: qpg = 4 heads x 2 = 8 rows per group. TP8: 4 ranks
    // per group, each with 2 q rows; only ranks 0 and 4 offer k and v.
    let model = tiny_moe();
    let specs = model.tensors();
    let g = publisher_geometry(&model, &topo("tp=8")).unwrap();
    for rank in &g {
        let t = rank.rank as u64;
        let names: Vec<_> = rank
            .shards
            .iter()
            .filter(|s| {
                specs[s.tensor]
                    .name
                    .starts_with("model.layers.0.self_attn.")
            })
            .map(|s| (specs[s.tensor].name.as_str(), s.tensor_box.clone()))
            .collect();
        let q = &specs[1];
        let group = t / 4;
        let mut want = vec![(
            "model.layers.0.self_attn.q_proj.weight",
            row_block(q, group * 8 + (t % 4) * 2, 2),
        )];
        if t % 4 == 0 {
            let k = &specs[2];
            want.push((
                "model.layers.0.self_attn.k_proj.weight",
                row_block(k, group * 2, 2),
            ));
            want.push((
                "model.layers.0.self_attn.v_proj.weight",
                row_block(k, group * 2, 2),
            ));
        }
        want.push((
            "model.layers.0.self_attn.o_proj.weight",
            TensorBox::new(vec![0, t * 2], vec![8, 2]),
        ));
        want.push((
            "model.layers.0.self_attn.q_norm.weight",
            TensorBox::new(vec![0], vec![2]),
        ));
        want.push((
            "model.layers.0.self_attn.k_norm.weight",
            TensorBox::new(vec![0], vec![2]),
        ));
        assert_eq!(names, want, "rank {t}");
    }
}

#[test]
fn pipeline_stages_hold_their_layers_and_the_ends() {
    let model = tiny_dense();
    let specs = model.tensors();
    let g = publisher_geometry(&model, &topo("tp=2,pp=2")).unwrap();
    assert_eq!(g.len(), 4);
    for rank in &g {
        let stage = rank.rank / 2;
        for s in &rank.shards {
            let name = &specs[s.tensor].name;
            match name.as_str() {
                "model.embed_tokens.weight" => assert_eq!(stage, 0),
                "model.norm.weight" => assert_eq!(stage, 1),
                n => assert!(n.starts_with(&format!("model.layers.{stage}.")), "{n}"),
            }
        }
    }
    let e = publisher_geometry(&tiny_dense(), &topo("pp=3")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}

#[test]
fn impossible_publisher_topologies_are_errors() {
    let moe = tiny_moe();
    let kind = |m: &ModelConfig, s: &str| publisher_geometry(m, &topo(s)).unwrap_err().kind();
    assert_eq!(kind(&moe, "ep=4,dp=2"), ErrorKind::Config); // ep must divide dp
    assert_eq!(kind(&moe, "ep=3,dp=3"), ErrorKind::Config); // 4 experts over ep=3
    assert_eq!(kind(&tiny_dense(), "ep=2,dp=2"), ErrorKind::Config); // no experts
    assert_eq!(kind(&moe, "tp=3"), ErrorKind::Layout); // 8 heads over tp=3
    let e = publisher_geometry(&moe, &topo("tp=16")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.layers.0.self_attn.q_proj.weight")
    );
    // A vocabulary of 12 over tp=8, with heads that do split.
    let mut m = tiny_dense();
    m.vocab = 12;
    m.heads = 8;
    m.kv_heads = 8;
    let e = publisher_geometry(&m, &topo("tp=8")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Layout);
    assert_eq!(
        e.context().tensor.as_deref(),
        Some("model.embed_tokens.weight")
    );
    assert!(e.message().contains("12"), "{e}");
}

#[test]
fn geometry_tables_pack_offers_back_to_back() {
    let model = tiny_moe();
    let t = topo("tp=2,ep=2,dp=2");
    let tables = geometry_tables(&model, &t, 42).unwrap();
    assert_eq!(tables.len(), 4);
    for (r, table) in tables.iter().enumerate() {
        table.validate().unwrap();
        assert_eq!(table.publisher.rank, r as u32);
        assert_eq!(table.publisher.agent, format!("publisher-{r}"));
        assert_eq!(table.step, 42);
        let mut next = 0;
        for o in &table.offers {
            assert_eq!(o.location.region, 0);
            assert_eq!(o.location.memory, MemoryKind::Dram);
            assert_eq!(o.location.offset, next);
            assert!(o.digest.is_none());
            next += o.tensor_box.elements() * 2;
        }
    }
    let merged = merge(&tables).unwrap();
    assert_eq!(merged.tensors.len(), model.tensors().len());
}
