//! Model families as data: for each Hugging Face `model_type`, a table of rules naming every
//! tensor a model of that family has (its shape from the configuration), what it does under
//! tensor and expert parallelism, and which vLLM engine parameter it is loaded into, at which
//! slot of a fused parameter. docs/models.md lists each table and the vLLM version it follows.
//!
//! Nothing here is code per model: [`crate::presets::ModelConfig::tensors`], the receiver
//! layouts and the publisher geometry all walk these tables.

use crate::presets::ModelConfig;

/// A size a tensor dimension takes from the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// `hidden`.
    Hidden,
    /// `vocab`.
    Vocab,
    /// Query rows of GQA attention: `heads * head_dim`.
    QRows,
    /// Key (or value) rows of GQA attention: `kv_heads * head_dim`.
    KvRows,
    /// `head_dim`.
    HeadDim,
    /// Dense MLP intermediate size.
    Inter,
    /// One routed expert's intermediate size.
    ExpertInter,
    /// The shared expert's intermediate size.
    SharedInter,
    /// Routed experts per MoE layer.
    Experts,
    /// 1 (the shared expert gate's single output).
    One,
    /// MLA `q_lora_rank`.
    QLora,
    /// MLA `kv_lora_rank`.
    KvLora,
    /// MLA `kv_lora_rank + qk_rope_head_dim` (rows of `kv_a_proj_with_mqa`).
    KvA,
    /// MLA query rows: `heads * (qk_nope_head_dim + qk_rope_head_dim)`.
    MlaQ,
    /// MLA `kv_b_proj` rows: `heads * (qk_nope_head_dim + v_head_dim)`.
    MlaKvB,
    /// MLA `o_proj` input: `heads * v_head_dim`.
    MlaO,
}

/// Which layers (or whether the model) has a rule's tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Always.
    Always,
    /// Only when embeddings are untied (`lm_head`).
    Untied,
    /// Layers whose MLP is dense.
    Dense,
    /// Layers whose MLP is mixture-of-experts.
    Moe,
    /// MoE layers of a model with a shared expert.
    Shared,
    /// MLA with a query LoRA (`q_lora_rank` set).
    QLora,
    /// MLA without a query LoRA (`q_lora_rank` null).
    NoQLora,
}

/// Where a rule's tensors sit in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A global before the layers (`model.embed_tokens.weight`); the name is the whole name.
    First,
    /// One per decoder layer; the name follows `model.layers.{L}.`.
    Layer,
    /// One per routed expert of an MoE layer; the name follows `model.layers.{L}.` and holds
    /// `{E}` where the expert index goes. The engine parameter stacks the experts.
    Expert,
    /// A global after the layers (`model.norm.weight`, `lm_head.weight`).
    Last,
}

/// What a tensor does under tensor (and expert) parallelism, as vLLM loads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// Whole on every rank (norms, routers, `ReplicatedLinear`, `disable_tp` layers).
    Replicated,
    /// `VocabParallelEmbedding` / `ParallelLMHead`: dim-0 slice per TP rank.
    Vocab,
    /// `ColumnParallelLinear` and the parts of `MergedColumnParallelLinear`: dim-0 slice.
    Column,
    /// `RowParallelLinear`: dim-1 slice.
    Row,
    /// Query part of `QKVParallelLinear`: dim-0 slice by query heads (publishers offer it per
    /// KV group).
    QHeads,
    /// Key or value part of `QKVParallelLinear`: the rank's KV heads, replicated over ranks
    /// when there are fewer KV heads than ranks.
    KvHeads,
    /// Routed expert's gate/up projection in `FusedMoE` `w13`: dim-0 slice per TP rank, or
    /// whole on the rank owning the expert under expert parallelism.
    ExpertColumn,
    /// Routed expert's down projection in `FusedMoE` `w2`: dim-1 slice, or whole under EP.
    ExpertRow,
}

/// One rule of a family table: a tensor (family) and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// Where the tensor sits.
    pub scope: Scope,
    /// Which layers have it.
    pub when: When,
    /// HF name (after `model.layers.{L}.` for layer and expert rules; `{E}` marks the expert).
    pub name: &'static str,
    /// Shape, from the configuration.
    pub shape: &'static [Dim],
    /// Sharding under TP/EP.
    pub shard: Shard,
    /// vLLM parameter it is loaded into (after `model.layers.{L}.` for layer and expert rules).
    pub engine: &'static str,
    /// Position in the fused parameter: slots are concatenated along dim 0 in slot order.
    pub slot: u8,
    /// A linear weight an fp8 block-quantized checkpoint stores as `float8_e4m3fn` with a
    /// `weight_scale_inv` tensor beside it.
    pub quant: bool,
}

/// A family: the rules of one attention and MLP architecture, under the `model_type` names
/// that use it, with the `config.json` keys its MoE shape is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    /// `model_type` values of `config.json` that use this table.
    pub model_types: &'static [&'static str],
    /// `architectures[0]` written for it.
    pub architecture: &'static str,
    /// Rules, in tensor order (globals first, per-layer rules, then the trailing globals).
    pub rules: &'static [Rule],
    /// Whether attention is MLA (DeepSeek) rather than GQA.
    pub mla: bool,
    /// Whether attention has per-head `q_norm`/`k_norm` (the `qk_norm` field must agree).
    pub qk_norm: bool,
    /// How `config.json` describes the MoE layers.
    pub moe_keys: MoeKeys,
}

/// The `config.json` keys of a family's mixture-of-experts shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeKeys {
    /// Dense only.
    None,
    /// Qwen2-MoE / Qwen3-MoE: `num_experts`, `moe_intermediate_size`, dense layers from
    /// `mlp_only_layers` and `decoder_sparse_step`; with `shared_expert_intermediate_size`
    /// when `shared` is set.
    Qwen {
        /// Whether the family has a shared expert.
        shared: bool,
    },
    /// Mixtral: `num_local_experts`, expert intermediate `intermediate_size`, every layer MoE.
    Mixtral,
    /// DeepSeek-V3: `n_routed_experts`, `moe_intermediate_size`, `n_shared_experts`, dense
    /// layers from `first_k_dense_replace` and `moe_layer_freq`.
    DeepSeek,
}

const fn rule(
    scope: Scope,
    when: When,
    name: &'static str,
    shape: &'static [Dim],
    shard: Shard,
    engine: &'static str,
    slot: u8,
) -> Rule {
    // Column- and row-parallel matrices are the linear layers fp8 checkpoints quantize; a
    // replicated one says so with `linear`.
    let quant = matches!(
        shard,
        Column | Row | QHeads | KvHeads | ExpertColumn | ExpertRow
    ) && shape.len() == 2;
    Rule {
        scope,
        when,
        name,
        shape,
        shard,
        engine,
        slot,
        quant,
    }
}

use Dim::*;
use Scope::{Expert, First, Last, Layer};
use Shard::{Column, ExpertColumn, ExpertRow, KvHeads, QHeads, Replicated, Row};

const EMBED: Rule = rule(
    First,
    When::Always,
    "model.embed_tokens.weight",
    &[Vocab, Hidden],
    Shard::Vocab,
    "model.embed_tokens.weight",
    0,
);
const NORM: Rule = rule(
    Last,
    When::Always,
    "model.norm.weight",
    &[Hidden],
    Replicated,
    "model.norm.weight",
    0,
);
const LM_HEAD: Rule = rule(
    Last,
    When::Untied,
    "lm_head.weight",
    &[Dim::Vocab, Hidden],
    Shard::Vocab,
    "lm_head.weight",
    0,
);
const fn layer(
    name: &'static str,
    shape: &'static [Dim],
    shard: Shard,
    engine: &'static str,
    slot: u8,
) -> Rule {
    rule(Layer, When::Always, name, shape, shard, engine, slot)
}
const fn when(mut r: Rule, w: When) -> Rule {
    r.when = w;
    r
}
const fn linear(mut r: Rule) -> Rule {
    r.quant = true;
    r
}
const fn norm(name: &'static str, shape: &'static [Dim]) -> Rule {
    rule(Layer, When::Always, name, shape, Replicated, name, 0)
}
const fn expert(
    name: &'static str,
    shape: &'static [Dim],
    shard: Shard,
    engine: &'static str,
    slot: u8,
) -> Rule {
    rule(Expert, When::Moe, name, shape, shard, engine, slot)
}

const Q: Rule = layer(
    "self_attn.q_proj.weight",
    &[QRows, Hidden],
    QHeads,
    "self_attn.qkv_proj.weight",
    0,
);
const K: Rule = layer(
    "self_attn.k_proj.weight",
    &[KvRows, Hidden],
    KvHeads,
    "self_attn.qkv_proj.weight",
    1,
);
const V: Rule = layer(
    "self_attn.v_proj.weight",
    &[KvRows, Hidden],
    KvHeads,
    "self_attn.qkv_proj.weight",
    2,
);
const QB: Rule = rule(
    Layer,
    When::Always,
    "self_attn.q_proj.bias",
    &[QRows],
    QHeads,
    "self_attn.qkv_proj.bias",
    0,
);
const KB: Rule = rule(
    Layer,
    When::Always,
    "self_attn.k_proj.bias",
    &[KvRows],
    KvHeads,
    "self_attn.qkv_proj.bias",
    1,
);
const VB: Rule = rule(
    Layer,
    When::Always,
    "self_attn.v_proj.bias",
    &[KvRows],
    KvHeads,
    "self_attn.qkv_proj.bias",
    2,
);
const O: Rule = layer(
    "self_attn.o_proj.weight",
    &[Hidden, QRows],
    Row,
    "self_attn.o_proj.weight",
    0,
);
const Q_NORM: Rule = norm("self_attn.q_norm.weight", &[HeadDim]);
const K_NORM: Rule = norm("self_attn.k_norm.weight", &[HeadDim]);
const IN_NORM: Rule = norm("input_layernorm.weight", &[Hidden]);
const POST_NORM: Rule = norm("post_attention_layernorm.weight", &[Hidden]);
const GATE: Rule = layer(
    "mlp.gate_proj.weight",
    &[Inter, Hidden],
    Column,
    "mlp.gate_up_proj.weight",
    0,
);
const UP: Rule = layer(
    "mlp.up_proj.weight",
    &[Inter, Hidden],
    Column,
    "mlp.gate_up_proj.weight",
    1,
);
const DOWN: Rule = layer(
    "mlp.down_proj.weight",
    &[Hidden, Inter],
    Row,
    "mlp.down_proj.weight",
    0,
);
const D_GATE: Rule = when(GATE, When::Dense);
const D_UP: Rule = when(UP, When::Dense);
const D_DOWN: Rule = when(DOWN, When::Dense);
const ROUTER: Rule = rule(
    Layer,
    When::Moe,
    "mlp.gate.weight",
    &[Experts, Hidden],
    Replicated,
    "mlp.gate.weight",
    0,
);
const E_GATE: Rule = expert(
    "mlp.experts.{E}.gate_proj.weight",
    &[ExpertInter, Hidden],
    ExpertColumn,
    "mlp.experts.w13_weight",
    0,
);
const E_UP: Rule = expert(
    "mlp.experts.{E}.up_proj.weight",
    &[ExpertInter, Hidden],
    ExpertColumn,
    "mlp.experts.w13_weight",
    1,
);
const E_DOWN: Rule = expert(
    "mlp.experts.{E}.down_proj.weight",
    &[Hidden, ExpertInter],
    ExpertRow,
    "mlp.experts.w2_weight",
    0,
);

/// Llama (and Mistral-style dense GQA): `LlamaForCausalLM`.
const LLAMA: &[Rule] = &[
    EMBED, Q, K, V, O, IN_NORM, POST_NORM, GATE, UP, DOWN, NORM, LM_HEAD,
];
/// Qwen2 / Qwen2.5: Llama with q/k/v biases fused into `qkv_proj.bias`.
const QWEN2: &[Rule] = &[
    EMBED, Q, QB, K, KB, V, VB, O, IN_NORM, POST_NORM, GATE, UP, DOWN, NORM, LM_HEAD,
];
/// Qwen3: Llama with per-head q/k norms.
const QWEN3: &[Rule] = &[
    EMBED, Q, K, V, O, Q_NORM, K_NORM, IN_NORM, POST_NORM, GATE, UP, DOWN, NORM, LM_HEAD,
];
/// Qwen3-MoE: Qwen3 attention, routed experts, dense MLP on `mlp_only_layers`.
const QWEN3_MOE: &[Rule] = &[
    EMBED, Q, K, V, O, Q_NORM, K_NORM, IN_NORM, POST_NORM, ROUTER, E_GATE, E_UP, E_DOWN, D_GATE,
    D_UP, D_DOWN, NORM, LM_HEAD,
];
/// Qwen2-MoE: Qwen2 attention, routed experts, one shared expert and its sigmoid gate.
const QWEN2_MOE: &[Rule] = &[
    EMBED,
    Q,
    QB,
    K,
    KB,
    V,
    VB,
    O,
    IN_NORM,
    POST_NORM,
    ROUTER,
    E_GATE,
    E_UP,
    E_DOWN,
    rule(
        Layer,
        When::Shared,
        "mlp.shared_expert.gate_proj.weight",
        &[SharedInter, Hidden],
        Column,
        "mlp.shared_expert.gate_up_proj.weight",
        0,
    ),
    rule(
        Layer,
        When::Shared,
        "mlp.shared_expert.up_proj.weight",
        &[SharedInter, Hidden],
        Column,
        "mlp.shared_expert.gate_up_proj.weight",
        1,
    ),
    rule(
        Layer,
        When::Shared,
        "mlp.shared_expert.down_proj.weight",
        &[Hidden, SharedInter],
        Row,
        "mlp.shared_expert.down_proj.weight",
        0,
    ),
    rule(
        Layer,
        When::Shared,
        "mlp.shared_expert_gate.weight",
        &[One, Hidden],
        Replicated,
        "mlp.shared_expert_gate.weight",
        0,
    ),
    D_GATE,
    D_UP,
    D_DOWN,
    NORM,
    LM_HEAD,
];
/// Mixtral: Llama attention, `block_sparse_moe` with experts `w1` (gate), `w3` (up), `w2`.
const MIXTRAL: &[Rule] = &[
    EMBED,
    Q,
    K,
    V,
    O,
    IN_NORM,
    POST_NORM,
    rule(
        Layer,
        When::Moe,
        "block_sparse_moe.gate.weight",
        &[Experts, Hidden],
        Replicated,
        "block_sparse_moe.gate.weight",
        0,
    ),
    expert(
        "block_sparse_moe.experts.{E}.w1.weight",
        &[ExpertInter, Hidden],
        ExpertColumn,
        "block_sparse_moe.experts.w13_weight",
        0,
    ),
    expert(
        "block_sparse_moe.experts.{E}.w3.weight",
        &[ExpertInter, Hidden],
        ExpertColumn,
        "block_sparse_moe.experts.w13_weight",
        1,
    ),
    expert(
        "block_sparse_moe.experts.{E}.w2.weight",
        &[Hidden, ExpertInter],
        ExpertRow,
        "block_sparse_moe.experts.w2_weight",
        0,
    ),
    NORM,
    LM_HEAD,
];
/// DeepSeek-V3 (and Kimi-K2): MLA attention (`q_a_proj` and `kv_a_proj_with_mqa` fused into
/// the replicated `fused_qkv_a_proj` when there is a query LoRA), dense first layers, routed
/// experts with a router bias, shared experts.
const DEEPSEEK_V3: &[Rule] = &[
    EMBED,
    linear(rule(
        Layer,
        When::QLora,
        "self_attn.q_a_proj.weight",
        &[QLora, Hidden],
        Replicated,
        "self_attn.fused_qkv_a_proj.weight",
        0,
    )),
    rule(
        Layer,
        When::QLora,
        "self_attn.q_a_layernorm.weight",
        &[QLora],
        Replicated,
        "self_attn.q_a_layernorm.weight",
        0,
    ),
    rule(
        Layer,
        When::QLora,
        "self_attn.q_b_proj.weight",
        &[MlaQ, QLora],
        Column,
        "self_attn.q_b_proj.weight",
        0,
    ),
    rule(
        Layer,
        When::NoQLora,
        "self_attn.q_proj.weight",
        &[MlaQ, Hidden],
        Column,
        "self_attn.q_proj.weight",
        0,
    ),
    linear(rule(
        Layer,
        When::QLora,
        "self_attn.kv_a_proj_with_mqa.weight",
        &[KvA, Hidden],
        Replicated,
        "self_attn.fused_qkv_a_proj.weight",
        1,
    )),
    linear(rule(
        Layer,
        When::NoQLora,
        "self_attn.kv_a_proj_with_mqa.weight",
        &[KvA, Hidden],
        Replicated,
        "self_attn.kv_a_proj_with_mqa.weight",
        0,
    )),
    rule(
        Layer,
        When::Always,
        "self_attn.kv_a_layernorm.weight",
        &[KvLora],
        Replicated,
        "self_attn.kv_a_layernorm.weight",
        0,
    ),
    rule(
        Layer,
        When::Always,
        "self_attn.kv_b_proj.weight",
        &[MlaKvB, KvLora],
        Column,
        "self_attn.kv_b_proj.weight",
        0,
    ),
    rule(
        Layer,
        When::Always,
        "self_attn.o_proj.weight",
        &[Hidden, MlaO],
        Row,
        "self_attn.o_proj.weight",
        0,
    ),
    IN_NORM,
    POST_NORM,
    ROUTER,
    rule(
        Layer,
        When::Moe,
        "mlp.gate.e_score_correction_bias",
        &[Experts],
        Replicated,
        "mlp.gate.e_score_correction_bias",
        0,
    ),
    E_GATE,
    E_UP,
    E_DOWN,
    rule(
        Layer,
        When::Shared,
        "mlp.shared_experts.gate_proj.weight",
        &[SharedInter, Hidden],
        Column,
        "mlp.shared_experts.gate_up_proj.weight",
        0,
    ),
    rule(
        Layer,
        When::Shared,
        "mlp.shared_experts.up_proj.weight",
        &[SharedInter, Hidden],
        Column,
        "mlp.shared_experts.gate_up_proj.weight",
        1,
    ),
    rule(
        Layer,
        When::Shared,
        "mlp.shared_experts.down_proj.weight",
        &[Hidden, SharedInter],
        Row,
        "mlp.shared_experts.down_proj.weight",
        0,
    ),
    D_GATE,
    D_UP,
    D_DOWN,
    NORM,
    LM_HEAD,
];

/// Every family reshard knows, keyed by `model_type`.
pub const FAMILIES: &[Family] = &[
    Family {
        model_types: &["llama", "mistral"],
        architecture: "LlamaForCausalLM",
        rules: LLAMA,
        mla: false,
        qk_norm: false,
        moe_keys: MoeKeys::None,
    },
    Family {
        model_types: &["qwen2"],
        architecture: "Qwen2ForCausalLM",
        rules: QWEN2,
        mla: false,
        qk_norm: false,
        moe_keys: MoeKeys::None,
    },
    Family {
        model_types: &["qwen3"],
        architecture: "Qwen3ForCausalLM",
        rules: QWEN3,
        mla: false,
        qk_norm: true,
        moe_keys: MoeKeys::None,
    },
    Family {
        model_types: &["qwen2_moe"],
        architecture: "Qwen2MoeForCausalLM",
        rules: QWEN2_MOE,
        mla: false,
        qk_norm: false,
        moe_keys: MoeKeys::Qwen { shared: true },
    },
    Family {
        model_types: &["qwen3_moe"],
        architecture: "Qwen3MoeForCausalLM",
        rules: QWEN3_MOE,
        mla: false,
        qk_norm: true,
        moe_keys: MoeKeys::Qwen { shared: false },
    },
    Family {
        model_types: &["mixtral"],
        architecture: "MixtralForCausalLM",
        rules: MIXTRAL,
        mla: false,
        qk_norm: false,
        moe_keys: MoeKeys::Mixtral,
    },
    Family {
        model_types: &["deepseek_v3", "kimi_k2"],
        architecture: "DeepseekV3ForCausalLM",
        rules: DEEPSEEK_V3,
        mla: true,
        qk_norm: false,
        moe_keys: MoeKeys::DeepSeek,
    },
];

/// The family of a `model_type`, `None` when reshard has no table for it.
pub fn family(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .find(|f| f.model_types.contains(&model_type))
}

/// Every `model_type` with a table, for error messages.
pub fn model_types() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect()
}

/// Suffix of an fp8 block-quantized weight's scale tensor (it replaces `weight`).
pub const SCALE_SUFFIX: &str = "weight_scale_inv";

impl Dim {
    /// The configuration field the size comes from (for error messages).
    pub fn field(self) -> &'static str {
        match self {
            Hidden => "hidden",
            Dim::Vocab => "vocab",
            QRows | HeadDim => "head_dim",
            KvRows => "kv_heads",
            Inter => "intermediate",
            ExpertInter => "expert_intermediate",
            SharedInter => "shared_intermediate",
            Experts => "experts",
            One => "one",
            QLora => "q_lora_rank",
            KvLora | KvA => "kv_lora_rank",
            MlaQ => "qk_head_dim",
            MlaKvB | MlaO => "v_head_dim",
        }
    }

    /// The size in `model`, `None` on overflow (a field a family does not use is 0).
    pub fn size(self, m: &ModelConfig) -> Option<u64> {
        let mla = m.arch.mla.as_ref();
        let mla_val =
            |f: &dyn Fn(&crate::presets::MlaConfig) -> Option<u64>| mla.and_then(f).unwrap_or(0);
        Some(match self {
            Hidden => m.hidden,
            Dim::Vocab => m.vocab,
            QRows => m.heads.checked_mul(m.head_dim)?,
            KvRows => m.kv_heads.checked_mul(m.head_dim)?,
            HeadDim => m.head_dim,
            Inter => m.intermediate,
            ExpertInter => m.moe.as_ref().map_or(0, |x| x.expert_intermediate),
            SharedInter => m.arch.shared_intermediate,
            Experts => m.moe.as_ref().map_or(0, |x| x.experts),
            One => 1,
            QLora => mla_val(&|x| x.q_lora_rank),
            KvLora => mla_val(&|x| Some(x.kv_lora_rank)),
            KvA => mla_val(&|x| x.kv_lora_rank.checked_add(x.qk_rope_head_dim)),
            MlaQ => mla_val(&|x| {
                m.heads
                    .checked_mul(x.qk_nope_head_dim.checked_add(x.qk_rope_head_dim)?)
            }),
            MlaKvB => mla_val(&|x| {
                m.heads
                    .checked_mul(x.qk_nope_head_dim.checked_add(x.v_head_dim)?)
            }),
            MlaO => mla_val(&|x| m.heads.checked_mul(x.v_head_dim)),
        })
    }
}

impl Rule {
    /// Whether layer `l` of `m` (any layer for globals) has this rule's tensor.
    pub fn applies(&self, m: &ModelConfig, l: u64) -> bool {
        let q_lora = m.arch.mla.as_ref().is_some_and(|x| x.q_lora_rank.is_some());
        match self.when {
            When::Always => true,
            When::Untied => !m.tied_embeddings,
            When::Dense => !m.is_moe_layer(l),
            When::Moe => m.is_moe_layer(l),
            When::Shared => m.is_moe_layer(l) && m.arch.shared_intermediate > 0,
            When::QLora => q_lora,
            When::NoQLora => !q_lora,
        }
    }

    /// The shape in `m`, `None` on overflow.
    pub fn dims(&self, m: &ModelConfig) -> Option<Vec<u64>> {
        self.shape.iter().map(|d| d.size(m)).collect()
    }

    /// The full name of this rule's tensor in layer `l`, expert `e`.
    pub fn tensor_name(&self, l: u64, e: u64) -> String {
        match self.scope {
            First | Last => self.name.to_string(),
            Layer => format!("model.layers.{l}.{}", self.name),
            Expert => format!(
                "model.layers.{l}.{}",
                self.name.replace("{E}", &e.to_string())
            ),
        }
    }

    /// The full name of the engine parameter of layer `l`.
    pub fn engine_name(&self, l: u64) -> String {
        match self.scope {
            First | Last => self.engine.to_string(),
            Layer | Expert => format!("model.layers.{l}.{}", self.engine),
        }
    }

    /// `(layer, expert)` when `name` is this rule's tensor (or, with `scale`, its fp8 scale
    /// tensor), parsed from the name alone.
    pub fn parse(&self, name: &str, scale: bool) -> Option<(u64, u64)> {
        if !scale {
            return self.parse_with(name, self.name);
        }
        if !self.quant {
            return None;
        }
        // The rule's name with its `weight` suffix swapped for the scale's.
        let base = name.strip_suffix(SCALE_SUFFIX)?;
        self.parse_with(base, self.name.strip_suffix("weight")?)
    }

    fn parse_with(&self, name: &str, pattern: &str) -> Option<(u64, u64)> {
        match self.scope {
            First | Last => (name == pattern).then_some((0, 0)),
            Layer | Expert => {
                let rest = name.strip_prefix("model.layers.")?;
                let (l, rest) = rest.split_once('.')?;
                let l = parse_index(l)?;
                match pattern.split_once("{E}") {
                    None => (rest == pattern).then_some((l, 0)),
                    Some((pre, post)) => {
                        let e = rest.strip_prefix(pre)?.strip_suffix(post)?;
                        Some((l, parse_index(e)?))
                    }
                }
            }
        }
    }
}

/// A decimal index without sign or leading zeros (so one tensor has one name).
fn parse_index(s: &str) -> Option<u64> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    s.parse().ok()
}

/// Which rule of `family` a tensor named `name` belongs to in `m`: `(rule index, layer, expert,
/// is an fp8 scale tensor)`, `None` when no rule of the family (whose condition holds in that
/// layer) names it.
pub fn match_tensor(
    family: &Family,
    m: &ModelConfig,
    name: &str,
) -> Option<(usize, u64, u64, bool)> {
    let scale = name.ends_with(SCALE_SUFFIX);
    family.rules.iter().enumerate().find_map(|(i, r)| {
        let (l, e) = r.parse(name, scale)?;
        let in_model = match r.scope {
            First | Last => true,
            Layer => l < m.layers,
            Expert => l < m.layers && e < m.moe.as_ref().map_or(0, |x| x.experts),
        };
        (in_model && r.applies(m, l)).then_some((i, l, e, scale))
    })
}
