//! Models shared by the planner's integration tests.

use reshard_core::DType;
use reshard_planner::presets::{ModelConfig, MoeConfig};

/// A small MoE model whose every element can be enumerated: 2 layers of `experts` experts
/// (intermediate 8, hidden 8), GQA 8/2, qk norm, untied head, vocab 16.
pub fn tiny_moe(experts: u64) -> ModelConfig {
    ModelConfig {
        name: "tiny-moe".into(),
        layers: 2,
        hidden: 8,
        heads: 8,
        kv_heads: 2,
        head_dim: 2,
        intermediate: 0,
        moe: Some(MoeConfig {
            experts,
            expert_intermediate: 8,
        }),
        vocab: 256,
        tied_embeddings: false,
        qk_norm: true,
        dtype: DType::Bf16,
        arch: Default::default(),
    }
}
