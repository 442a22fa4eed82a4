//! The small models tests and benchmarks share, defined once: big enough to have every kind
//! of parameter (GQA attention, q/k norms, experts, an untied head), small enough to refit in
//! milliseconds.

use reshard_core::DType;
use reshard_planner::presets::{ModelConfig, MoeConfig};

/// A small dense GQA model (Llama-shaped) with `kv_heads` KV heads.
pub fn tiny_dense(kv_heads: u64) -> ModelConfig {
    ModelConfig {
        name: format!("tiny-dense-kv{kv_heads}"),
        layers: 2,
        hidden: 128,
        heads: 8,
        kv_heads,
        head_dim: 16,
        intermediate: 256,
        moe: None,
        vocab: 512,
        tied_embeddings: false,
        qk_norm: false,
        dtype: DType::Bf16,
        arch: Default::default(),
    }
}

/// The small MoE model (Qwen3-MoE-shaped) with `experts` experts per layer, q/k norms and an
/// untied head: 2 layers, hidden 128, GQA 8/4.
pub fn tiny_moe(experts: u64) -> ModelConfig {
    ModelConfig {
        name: "tiny-moe".into(),
        layers: 2,
        hidden: 128,
        heads: 8,
        kv_heads: 4,
        head_dim: 16,
        intermediate: 0,
        moe: Some(MoeConfig {
            experts,
            expert_intermediate: 96,
        }),
        vocab: 256,
        tied_embeddings: false,
        qk_norm: true,
        dtype: DType::Bf16,
        arch: Default::default(),
    }
}
