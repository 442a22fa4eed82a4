//! Model families (docs/models.md): a real-shaped `config.json` of each family at tiny widths,
//! the tensors it implies, and the vLLM engine layout of a receiver rank, each checked against
//! what vLLM's model code loads (parameter names, shard rules, fused slots and their offsets),
//! written out by hand here rather than derived from the tables under test. Then the errors: an
//! unknown `model_type`, a tensor no rule names, a dtype the headers contradict.

use std::collections::BTreeMap;
use std::fs;

use reshard_checkpoint::config::{declared_dtype, from_hf_config, reconcile_headers, to_hf_config};
use reshard_checkpoint::{write_checkpoint, Checkpoint, WriteOptions};
use reshard_core::{DType, ErrorKind, ParamSpec, TensorSpec, WantedLayout};
use reshard_planner::layouts::receiver_layout;
use reshard_planner::presets::ModelConfig;
use reshard_planner::topology::{publisher_geometry, PublisherTopology, ReceiverTopology};
use serde_json::{json, Value};

/// Parses a config, checks it round-trips through `to_hf_config`.
fn parse(v: Value) -> ModelConfig {
    let m = from_hf_config(&v, "config.json").unwrap();
    assert_eq!(from_hf_config(&to_hf_config(&m), "again").unwrap(), m);
    m
}

/// Tensor name -> shape.
fn shapes(m: &ModelConfig) -> BTreeMap<String, Vec<u64>> {
    let t = m.tensors();
    assert_eq!(t.len(), m.tensor_count());
    assert_eq!(
        t.iter().map(TensorSpec::bytes).sum::<u64>(),
        m.total_bytes()
    );
    let map: BTreeMap<_, _> = t
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    assert_eq!(map.len(), t.len(), "names are unique");
    map
}

fn layout(m: &ModelConfig, recv: &str, rank: u32) -> WantedLayout {
    receiver_layout(m, &recv.parse::<ReceiverTopology>().unwrap(), rank).unwrap()
}

fn param<'a>(l: &'a WantedLayout, name: &str) -> &'a ParamSpec {
    l.params.iter().find(|p| p.name == name).unwrap_or_else(|| {
        let names: Vec<_> = l.params.iter().map(|p| p.name.as_str()).collect();
        panic!("no parameter {name}; have {names:?}")
    })
}

fn has_param(l: &WantedLayout, name: &str) -> bool {
    l.params.iter().any(|p| p.name == name)
}

/// `(tensor, box offset, box extent, destination element offset)` of every copy of a
/// parameter, in order (bf16 models: byte offset / 2).
fn copies(p: &ParamSpec) -> Vec<(String, Vec<u64>, Vec<u64>, u64)> {
    p.copies
        .iter()
        .map(|c| {
            (
                c.tensor.clone(),
                c.src_box.offset.clone(),
                c.src_box.extent.clone(),
                c.dst_offset / p.dtype.size(),
            )
        })
        .collect()
}

fn c(t: &str, off: &[u64], ext: &[u64], at: u64) -> (String, Vec<u64>, Vec<u64>, u64) {
    (t.to_string(), off.to_vec(), ext.to_vec(), at)
}

/// Every publisher geometry of a few topologies covers each tensor: the Megatron side walks the
/// same table.
fn publishers_cover(m: &ModelConfig, topos: &[&str]) {
    for t in topos {
        let topo: PublisherTopology = t.parse().unwrap();
        let g = publisher_geometry(m, &topo).unwrap();
        let specs = m.tensors();
        let mut covered = vec![0u64; specs.len()];
        for r in &g {
            for s in &r.shards {
                covered[s.tensor] += s.tensor_box.elements();
            }
        }
        let world = topo.world() as u64;
        for (s, n) in specs.iter().zip(covered) {
            // Replicated boxes are offered by every rank, sliced ones once per replica: each
            // tensor at least once and at most once per rank.
            let e = s.full_box().elements();
            assert!(n >= e && n <= e * world, "{t}: {} {n}", s.name);
        }
    }
}

fn llama_json() -> Value {
    // As meta-llama publishes it (no head_dim key), at tiny widths.
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 32, "vocab_size": 64, "tie_word_embeddings": false,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 500000.0
    })
}

#[test]
fn llama_tensors_and_vllm_layout() {
    let m = parse(llama_json());
    let s = shapes(&m);
    assert_eq!(s.len(), 1 + 2 * 9 + 2);
    assert_eq!(s["model.layers.1.self_attn.k_proj.weight"], [8, 16]);
    assert_eq!(s["model.layers.1.mlp.down_proj.weight"], [16, 32]);
    let l = layout(&m, "tp=2", 1);
    let qkv = param(&l, "model.layers.0.self_attn.qkv_proj.weight");
    assert_eq!(qkv.shape, [8 + 4 + 4, 16]);
    assert_eq!(
        copies(qkv),
        [
            c(
                "model.layers.0.self_attn.q_proj.weight",
                &[8, 0],
                &[8, 16],
                0
            ),
            c(
                "model.layers.0.self_attn.k_proj.weight",
                &[4, 0],
                &[4, 16],
                8 * 16
            ),
            c(
                "model.layers.0.self_attn.v_proj.weight",
                &[4, 0],
                &[4, 16],
                12 * 16
            ),
        ]
    );
    let o = param(&l, "model.layers.0.self_attn.o_proj.weight");
    assert_eq!(copies(o), [c(&o.name, &[0, 8], &[16, 8], 0)]);
    let gu = param(&l, "model.layers.1.mlp.gate_up_proj.weight");
    assert_eq!(gu.shape, [32, 16]);
    assert_eq!(
        copies(gu),
        [
            c(
                "model.layers.1.mlp.gate_proj.weight",
                &[16, 0],
                &[16, 16],
                0
            ),
            c(
                "model.layers.1.mlp.up_proj.weight",
                &[16, 0],
                &[16, 16],
                16 * 16
            ),
        ]
    );
    let down = param(&l, "model.layers.1.mlp.down_proj.weight");
    assert_eq!(copies(down), [c(&down.name, &[0, 16], &[16, 16], 0)]);
    for v in ["model.embed_tokens.weight", "lm_head.weight"] {
        assert_eq!(copies(param(&l, v)), [c(v, &[32, 0], &[32, 16], 0)]);
    }
    let n = param(&l, "model.layers.0.input_layernorm.weight");
    assert_eq!(copies(n), [c(&n.name, &[0], &[16], 0)]);
    // With 4 ranks and 2 KV heads each head is replicated on 2 ranks: rank 3 holds head 1.
    let l4 = layout(&m, "tp=4", 3);
    let qkv = param(&l4, "model.layers.0.self_attn.qkv_proj.weight");
    assert_eq!(qkv.copies[1].src_box.offset, [4, 0]);
    assert_eq!(qkv.shape, [4 + 4 + 4, 16]);
    publishers_cover(&m, &["tp=2,dp=2", "tp=4", "pp=2"]);
}

#[test]
fn tied_embeddings_have_no_lm_head() {
    let mut v = llama_json();
    v["tie_word_embeddings"] = json!(true);
    let m = parse(v);
    assert!(!shapes(&m).contains_key("lm_head.weight"));
    let l = layout(&m, "tp=2", 0);
    assert!(!has_param(&l, "lm_head.weight"));
    assert!(has_param(&l, "model.embed_tokens.weight"));
}

#[test]
fn qwen2_fuses_q_k_v_biases() {
    let mut v = llama_json();
    v["model_type"] = json!("qwen2");
    v["architectures"] = json!(["Qwen2ForCausalLM"]);
    let m = parse(v);
    let s = shapes(&m);
    assert_eq!(s["model.layers.0.self_attn.q_proj.bias"], [16]);
    assert_eq!(s["model.layers.0.self_attn.k_proj.bias"], [8]);
    assert!(!s.contains_key("model.layers.0.self_attn.o_proj.bias"));
    let l = layout(&m, "tp=2", 1);
    let b = param(&l, "model.layers.0.self_attn.qkv_proj.bias");
    assert_eq!(b.shape, [16]);
    assert_eq!(
        copies(b),
        [
            c("model.layers.0.self_attn.q_proj.bias", &[8], &[8], 0),
            c("model.layers.0.self_attn.k_proj.bias", &[4], &[4], 8),
            c("model.layers.0.self_attn.v_proj.bias", &[4], &[4], 12),
        ]
    );
    publishers_cover(&m, &["tp=2", "tp=4,dp=2"]);
}

fn qwen3_moe_json() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "num_hidden_layers": 4, "intermediate_size": 24, "moe_intermediate_size": 8,
        "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 64, "tie_word_embeddings": false,
        "dtype": "bfloat16", "norm_topk_prob": true
    })
}

#[test]
fn qwen3_moe_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step() {
    let mut v = qwen3_moe_json();
    v["mlp_only_layers"] = json!([0]);
    let m = parse(v.clone());
    assert_eq!(m.arch.dense_layers, [0]);
    let s = shapes(&m);
    assert_eq!(s["model.layers.0.mlp.gate_proj.weight"], [24, 16]);
    assert!(!s.contains_key("model.layers.0.mlp.gate.weight"));
    assert_eq!(s["model.layers.1.mlp.experts.3.down_proj.weight"], [16, 8]);
    assert_eq!(s["model.layers.1.self_attn.q_norm.weight"], [8]);
    // vLLM: a layer is sparse when (layer + 1) % decoder_sparse_step == 0 and it is not in
    // mlp_only_layers.
    v["decoder_sparse_step"] = json!(2);
    let m = parse(v);
    assert_eq!(m.arch.dense_layers, [0, 2]);
    let l = layout(&m, "tp=2", 1);
    assert!(has_param(&l, "model.layers.2.mlp.gate_up_proj.weight"));
    assert!(!has_param(&l, "model.layers.2.mlp.experts.w13_weight"));
    let w13 = param(&l, "model.layers.3.mlp.experts.w13_weight");
    // [experts, 2 * I / tp, hidden]: per expert its gate half, then its up half.
    assert_eq!(w13.shape, [4, 8, 16]);
    assert_eq!(
        copies(w13)[2..4],
        [
            c(
                "model.layers.3.mlp.experts.1.gate_proj.weight",
                &[4, 0],
                &[4, 16],
                8 * 16
            ),
            c(
                "model.layers.3.mlp.experts.1.up_proj.weight",
                &[4, 0],
                &[4, 16],
                8 * 16 + 4 * 16
            ),
        ]
    );
    let w2 = param(&l, "model.layers.3.mlp.experts.w2_weight");
    assert_eq!(w2.shape, [4, 16, 4]);
    assert_eq!(
        copies(w2)[3],
        c(
            "model.layers.3.mlp.experts.3.down_proj.weight",
            &[0, 4],
            &[16, 4],
            3 * 16 * 4
        )
    );
    assert_eq!(
        copies(param(&l, "model.layers.3.mlp.gate.weight")),
        [c("model.layers.3.mlp.gate.weight", &[0, 0], &[4, 16], 0)]
    );
    // Expert parallel over 2 ranks: rank 1 holds experts 2 and 3 whole.
    let ep = layout(&m, "tp=1,dp=2,ep=2", 1);
    let w13 = param(&ep, "model.layers.1.mlp.experts.w13_weight");
    assert_eq!(w13.shape, [2, 16, 16]);
    assert_eq!(
        copies(w13)[2],
        c(
            "model.layers.1.mlp.experts.3.gate_proj.weight",
            &[0, 0],
            &[8, 16],
            16 * 16
        )
    );
    publishers_cover(&m, &["tp=2,ep=2,dp=2", "pp=2,ep=2,dp=2"]);
}

#[test]
fn qwen2_moe_has_a_shared_expert_and_its_gate() {
    let mut v = qwen3_moe_json();
    v["model_type"] = json!("qwen2_moe");
    v["architectures"] = json!(["Qwen2MoeForCausalLM"]);
    v["shared_expert_intermediate_size"] = json!(12);
    v.as_object_mut().unwrap().remove("head_dim");
    let m = parse(v);
    let s = shapes(&m);
    assert_eq!(
        s["model.layers.0.mlp.shared_expert.gate_proj.weight"],
        [12, 16]
    );
    assert_eq!(
        s["model.layers.0.mlp.shared_expert.down_proj.weight"],
        [16, 12]
    );
    assert_eq!(s["model.layers.0.mlp.shared_expert_gate.weight"], [1, 16]);
    assert_eq!(s["model.layers.0.self_attn.v_proj.bias"], [8]);
    assert!(!s.contains_key("model.layers.0.self_attn.q_norm.weight"));
    let l = layout(&m, "tp=2", 0);
    let gu = param(&l, "model.layers.0.mlp.shared_expert.gate_up_proj.weight");
    assert_eq!(
        copies(gu),
        [
            c(
                "model.layers.0.mlp.shared_expert.gate_proj.weight",
                &[0, 0],
                &[6, 16],
                0
            ),
            c(
                "model.layers.0.mlp.shared_expert.up_proj.weight",
                &[0, 0],
                &[6, 16],
                6 * 16
            ),
        ]
    );
    let d = param(&l, "model.layers.0.mlp.shared_expert.down_proj.weight");
    assert_eq!(copies(d), [c(&d.name, &[0, 0], &[16, 6], 0)]);
    let g = param(&l, "model.layers.0.mlp.shared_expert_gate.weight");
    assert_eq!(copies(g), [c(&g.name, &[0, 0], &[1, 16], 0)]);
    assert!(has_param(&l, "model.layers.0.self_attn.qkv_proj.bias"));
    publishers_cover(&m, &["tp=2,ep=2,dp=2"]);
}

#[test]
fn mixtral_block_sparse_moe_w1_w3_w2() {
    let m = parse(json!({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
        "vocab_size": 64, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    }));
    let s = shapes(&m);
    assert_eq!(s["model.layers.0.block_sparse_moe.gate.weight"], [4, 16]);
    assert_eq!(
        s["model.layers.0.block_sparse_moe.experts.2.w1.weight"],
        [8, 16]
    );
    assert_eq!(
        s["model.layers.0.block_sparse_moe.experts.2.w2.weight"],
        [16, 8]
    );
    assert_eq!(
        s["model.layers.0.block_sparse_moe.experts.2.w3.weight"],
        [8, 16]
    );
    assert!(!s.keys().any(|k| k.contains("mlp.")));
    let l = layout(&m, "tp=2", 1);
    let w13 = param(&l, "model.layers.1.block_sparse_moe.experts.w13_weight");
    // FusedMoE: w1 is the gate (shard 0), w3 the up projection (shard 1).
    assert_eq!(
        copies(w13)[..2],
        [
            c(
                "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                &[4, 0],
                &[4, 16],
                0
            ),
            c(
                "model.layers.1.block_sparse_moe.experts.0.w3.weight",
                &[4, 0],
                &[4, 16],
                4 * 16
            ),
        ]
    );
    let w2 = param(&l, "model.layers.1.block_sparse_moe.experts.w2_weight");
    assert_eq!(
        copies(w2)[1],
        c(
            "model.layers.1.block_sparse_moe.experts.1.w2.weight",
            &[0, 4],
            &[16, 4],
            16 * 4
        )
    );
    assert!(has_param(&l, "model.layers.1.block_sparse_moe.gate.weight"));
    publishers_cover(&m, &["tp=2,ep=2,dp=2"]);
}

fn deepseek_json() -> Value {
    // DeepSeek-V3's keys (as Kimi-K2 writes them too), at tiny widths.
    json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 3, "intermediate_size": 24, "moe_intermediate_size": 8,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 8,
        "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
        "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "vocab_size": 64,
        "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    })
}

#[test]
fn deepseek_v3_mla_dense_first_layers_shared_experts_router_bias() {
    let m = parse(deepseek_json());
    assert_eq!(m.arch.dense_layers, [0]);
    let s = shapes(&m);
    let a = "model.layers.1.self_attn.";
    assert_eq!(s[&format!("{a}q_a_proj.weight")], [8, 16]);
    assert_eq!(s[&format!("{a}q_a_layernorm.weight")], [8]);
    assert_eq!(s[&format!("{a}q_b_proj.weight")], [4 * 6, 8]);
    assert_eq!(s[&format!("{a}kv_a_proj_with_mqa.weight")], [8 + 2, 16]);
    assert_eq!(s[&format!("{a}kv_a_layernorm.weight")], [8]);
    assert_eq!(s[&format!("{a}kv_b_proj.weight")], [4 * 8, 8]);
    assert_eq!(s[&format!("{a}o_proj.weight")], [16, 4 * 4]);
    assert_eq!(s["model.layers.0.mlp.gate_proj.weight"], [24, 16]);
    assert_eq!(s["model.layers.2.mlp.gate.e_score_correction_bias"], [4]);
    assert_eq!(
        s["model.layers.2.mlp.shared_experts.up_proj.weight"],
        [8, 16]
    );
    assert!(!s.contains_key("model.layers.0.mlp.gate.weight"));
    assert_eq!(s.len(), 1 + 3 * 9 + 3 + 2 * (2 + 12 + 3) + 2);

    let l = layout(&m, "tp=2", 1);
    // fused_qkv_a_proj: MergedColumnParallelLinear with disable_tp, q_a rows then kv_a rows.
    let f = param(&l, "model.layers.1.self_attn.fused_qkv_a_proj.weight");
    assert_eq!(f.shape, [8 + 10, 16]);
    assert_eq!(
        copies(f),
        [
            c(&format!("{a}q_a_proj.weight"), &[0, 0], &[8, 16], 0),
            c(
                &format!("{a}kv_a_proj_with_mqa.weight"),
                &[0, 0],
                &[10, 16],
                8 * 16
            ),
        ]
    );
    let qb = param(&l, "model.layers.1.self_attn.q_b_proj.weight");
    assert_eq!(copies(qb), [c(&qb.name, &[12, 0], &[12, 8], 0)]);
    let kvb = param(&l, "model.layers.1.self_attn.kv_b_proj.weight");
    assert_eq!(copies(kvb), [c(&kvb.name, &[16, 0], &[16, 8], 0)]);
    let o = param(&l, "model.layers.1.self_attn.o_proj.weight");
    assert_eq!(copies(o), [c(&o.name, &[0, 8], &[16, 8], 0)]);
    for n in ["q_a_layernorm", "kv_a_layernorm"] {
        let p = param(&l, &format!("{a}{n}.weight"));
        assert_eq!(copies(p), [c(&p.name, &[0], &[8], 0)]);
    }
    let bias = param(&l, "model.layers.2.mlp.gate.e_score_correction_bias");
    assert_eq!(copies(bias), [c(&bias.name, &[0], &[4], 0)]);
    let sgu = param(&l, "model.layers.2.mlp.shared_experts.gate_up_proj.weight");
    assert_eq!(sgu.shape, [8, 16]);
    let sd = param(&l, "model.layers.2.mlp.shared_experts.down_proj.weight");
    assert_eq!(copies(sd), [c(&sd.name, &[0, 4], &[16, 4], 0)]);
    assert!(has_param(&l, "model.layers.0.mlp.gate_up_proj.weight"));
    assert!(has_param(&l, "model.layers.1.mlp.experts.w13_weight"));
    assert!(!has_param(&l, "model.layers.0.mlp.experts.w13_weight"));
    publishers_cover(&m, &["tp=2,ep=2,dp=2", "tp=4", "pp=3"]);

    // Without a query LoRA: q_proj is column-parallel, kv_a_proj_with_mqa replicated alone.
    let mut v = deepseek_json();
    v["q_lora_rank"] = Value::Null;
    let m = parse(v);
    let s = shapes(&m);
    assert_eq!(s[&format!("{a}q_proj.weight")], [24, 16]);
    assert!(!s.contains_key(&format!("{a}q_a_proj.weight")));
    let l = layout(&m, "tp=2", 1);
    let q = param(&l, &format!("{a}q_proj.weight"));
    assert_eq!(copies(q), [c(&q.name, &[12, 0], &[12, 16], 0)]);
    let kva = param(&l, &format!("{a}kv_a_proj_with_mqa.weight"));
    assert_eq!(copies(kva), [c(&kva.name, &[0, 0], &[10, 16], 0)]);
    assert!(!has_param(&l, &format!("{a}fused_qkv_a_proj.weight")));

    // moe_layer_freq 2 (with no dense prefix): layers 0 and 2 MoE, layer 1 dense.
    let mut v = deepseek_json();
    v["first_k_dense_replace"] = json!(0);
    v["moe_layer_freq"] = json!(2);
    assert_eq!(parse(v).arch.dense_layers, [1]);
    // Kimi-K2 names its model_type itself; the table is DeepSeek-V3's.
    let mut v = deepseek_json();
    v["model_type"] = json!("kimi_k2");
    assert_eq!(
        shapes(&parse(v)).len(),
        1 + 3 * 9 + 3 + 2 * (2 + 12 + 3) + 2
    );
}

#[test]
fn an_unknown_model_type_is_a_config_error_naming_it() {
    let mut v = llama_json();
    v["model_type"] = json!("gpt_oss");
    let e = from_hf_config(&v, "config.json").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("\"gpt_oss\"") && e.message().contains("qwen2_moe"),
        "{e}"
    );
}

#[test]
fn dtype_and_torch_dtype_are_both_read() {
    let mut v = llama_json();
    v.as_object_mut().unwrap().remove("torch_dtype");
    assert_eq!(declared_dtype(&v, "c").unwrap(), None);
    v["dtype"] = json!("float16");
    assert_eq!(from_hf_config(&v, "c").unwrap().dtype, DType::F16);
    v["torch_dtype"] = json!("float16");
    assert_eq!(declared_dtype(&v, "c").unwrap(), Some(DType::F16));
    v["torch_dtype"] = json!("bfloat16");
    let e = declared_dtype(&v, "c").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("\"dtype\"") && e.message().contains("\"torch_dtype\""),
        "{e}"
    );
}

fn write(m: &ModelConfig, dir: &std::path::Path) {
    let opts = WriteOptions {
        max_shard_bytes: 16 << 10,
    };
    write_checkpoint(m, 1, dir, &opts).unwrap();
}

fn edit_config(dir: &std::path::Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    f(&mut v);
    fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn without_a_dtype_key_the_headers_are_the_truth() {
    let tmp = tempfile::tempdir().unwrap();
    let m = parse(deepseek_json());
    write(&m, tmp.path());
    edit_config(tmp.path(), |v| {
        v.as_object_mut().unwrap().remove("torch_dtype");
    });
    let ck = Checkpoint::open(tmp.path()).unwrap();
    assert_eq!(ck.model().dtype, DType::Bf16);
    assert_eq!(ck.model(), &m);
}

#[test]
fn a_tensor_no_rule_names_is_a_config_error_naming_it() {
    let m = parse(llama_json());
    let spec = TensorSpec::new(
        "model.layers.0.self_attn.rotary_emb.inv_freq",
        DType::F32,
        vec![4],
    );
    let e = reconcile_headers(
        m.clone(),
        Some(DType::Bf16),
        &[(&spec, "model.safetensors")],
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.context().tensor.as_deref(), Some(spec.name.as_str()));
    assert!(
        e.message().contains("fits no rule") && e.message().contains("\"llama\""),
        "{e}"
    );
    // A layer past the model's is no rule's either.
    let spec = TensorSpec::new(
        "model.layers.2.input_layernorm.weight",
        DType::Bf16,
        vec![16],
    );
    let e = reconcile_headers(m, Some(DType::Bf16), &[(&spec, "f")]).unwrap_err();
    assert_eq!(e.context().tensor.as_deref(), Some(spec.name.as_str()));
}

#[test]
fn a_config_dtype_the_headers_contradict_names_the_tensor() {
    let m = parse(llama_json());
    let ok = TensorSpec::new("model.norm.weight", DType::Bf16, vec![16]);
    let bad = TensorSpec::new(
        "model.layers.1.mlp.up_proj.weight",
        DType::F16,
        vec![32, 16],
    );
    let e =
        reconcile_headers(m.clone(), Some(DType::Bf16), &[(&ok, "a"), (&bad, "b")]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert_eq!(e.context().tensor.as_deref(), Some(bad.name.as_str()));
    assert!(
        e.message().contains("float16") && e.message().contains("bfloat16"),
        "{e}"
    );
    // Without a declared dtype the headers decide, per rule: an f32 norm in a bf16 model.
    let emb = TensorSpec::new("model.embed_tokens.weight", DType::Bf16, vec![64, 16]);
    let f32_norm = TensorSpec::new("model.norm.weight", DType::F32, vec![16]);
    let r = reconcile_headers(m.clone(), None, &[(&emb, "a"), (&f32_norm, "a")]).unwrap();
    assert_eq!(r.dtype, DType::Bf16);
    assert_eq!(r.arch.dtypes.get("model.norm.weight"), Some(&DType::F32));
    // Two layers of one rule disagreeing is refused, naming one of them.
    let a = TensorSpec::new(
        "model.layers.0.input_layernorm.weight",
        DType::Bf16,
        vec![16],
    );
    let b = TensorSpec::new(
        "model.layers.1.input_layernorm.weight",
        DType::F16,
        vec![16],
    );
    let e = reconcile_headers(m, None, &[(&a, "f"), (&b, "f")]).unwrap_err();
    assert_eq!(e.context().tensor.as_deref(), Some(b.name.as_str()));
}

#[test]
fn fp8_weights_and_their_scales_pass_through() {
    let mut v = deepseek_json();
    v["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [4, 4]});
    let m = parse(v);
    let t = m.tensors();
    let get = |n: &str| t.iter().find(|s| s.name == n).unwrap().clone();
    let a = "model.layers.1.self_attn.";
    assert_eq!(get(&format!("{a}kv_b_proj.weight")).dtype, DType::F8E4m3);
    let sc = get(&format!("{a}kv_b_proj.weight_scale_inv"));
    assert_eq!((sc.dtype, sc.shape.clone()), (DType::F32, vec![8, 2]));
    let e = get("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv");
    assert_eq!(e.shape, [4, 2]);
    // Not quantized: router, its bias, norms, embeddings.
    assert_eq!(get("model.layers.1.mlp.gate.weight").dtype, DType::Bf16);
    assert!(!t
        .iter()
        .any(|s| s.name == "model.layers.1.mlp.gate.weight_scale_inv"));
    // Written and opened again: every header fits a rule, dtypes as they are.
    let tmp = tempfile::tempdir().unwrap();
    write(&m, tmp.path());
    let ck = Checkpoint::open(tmp.path()).unwrap();
    assert_eq!(ck.model(), &m);
    // vLLM's block-quantized parameters: scales beside their weights, sliced in blocks.
    let l = layout(&m, "tp=2", 1);
    let kvb = param(&l, &format!("{a}kv_b_proj.weight_scale_inv"));
    assert_eq!(copies(kvb), [c(&sc.name, &[4, 0], &[4, 2], 0)]);
    let fused = param(&l, &format!("{a}fused_qkv_a_proj.weight_scale_inv"));
    assert_eq!(fused.shape, [2 + 3, 4]);
    let w2 = param(&l, "model.layers.1.mlp.experts.w2_weight_scale_inv");
    assert_eq!(w2.shape, [4, 4, 1]);
    // A bf16 weight where the fp8 config wants float8_e4m3fn is refused, naming it.
    let w = TensorSpec::new(format!("{a}o_proj.weight"), DType::Bf16, vec![16, 16]);
    let e = reconcile_headers(m.clone(), Some(DType::Bf16), &[(&w, "f")]).unwrap_err();
    assert_eq!(e.context().tensor.as_deref(), Some(w.name.as_str()));
    assert!(e.message().contains("float8_e4m3fn"), "{e}");
    // A scale tensor without a quantization_config fits no rule.
    let plain = parse(deepseek_json());
    let e = reconcile_headers(plain, Some(DType::Bf16), &[(&sc, "f")]).unwrap_err();
    assert_eq!(e.context().tensor.as_deref(), Some(sc.name.as_str()));
}
