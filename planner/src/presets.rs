//! Model presets: the architectures reshard plans for, and the HF-canonical tensors each one has.
//!
//! A preset is only geometry (names, dtypes, shapes); synthetic publishers derive bytes from it,
//! and `reshard plan` needs nothing else. Overrides scale a preset down so a byte-moving refit fits
//! on one machine.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use reshard_core::{DType, Error, ErrorKind, Result, TensorSpec};

use crate::families::{family, model_types, Family, Rule, Scope, SCALE_SUFFIX};

/// Mixture-of-experts shape of every MLP block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts per layer.
    pub experts: u64,
    /// Intermediate size of one expert's MLP.
    pub expert_intermediate: u64,
}

/// Multi-head latent attention (DeepSeek-V3, Kimi-K2) sizes, as `config.json` names them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlaConfig {
    /// `q_lora_rank`; `None` (null) when queries are projected directly (`q_proj`).
    pub q_lora_rank: Option<u64>,
    /// `kv_lora_rank`.
    pub kv_lora_rank: u64,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: u64,
    /// `qk_rope_head_dim`.
    pub qk_rope_head_dim: u64,
    /// `v_head_dim`.
    pub v_head_dim: u64,
}

/// Architecture facts beyond the GQA / all-MoE shape of the first presets. Every field has a
/// default that is left out of the JSON, so announcements of those models are unchanged and
/// older ones still decode.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arch {
    /// Hugging Face `model_type`, the key of the family table (`crate::families`). Empty:
    /// `qwen3_moe`, `qwen3` or `llama`, told apart by `moe` and `qk_norm`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model_type: String,
    /// Layers of an MoE model whose MLP is dense (`mlp_only_layers`, `decoder_sparse_step`,
    /// `first_k_dense_replace`, `moe_layer_freq`), ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dense_layers: Vec<u64>,
    /// Intermediate size of the shared expert(s) of every MoE layer; 0 for none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_intermediate: u64,
    /// MLA sizes, for a family with MLA attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaConfig>,
    /// Element type of a rule's tensors where it differs from `dtype`, keyed by the rule's
    /// name (`mlp.gate.e_score_correction_bias`), as the checkpoint's headers say.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dtypes: BTreeMap<String, DType>,
    /// fp8 block quantization (`quantization_config.weight_block_size`): every linear weight is
    /// `float8_e4m3fn` (unless `dtypes` says otherwise) with an f32 `weight_scale_inv` of one
    /// element per block beside it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_block: Option<[u64; 2]>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Arch {
    fn is_default(&self) -> bool {
        *self == Arch::default()
    }
}

/// Where a tensor of [`ModelConfig::tensors`] comes from: its rule, layer, expert, and whether
/// it is the rule's fp8 scale tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Index into the family's rules.
    pub rule: usize,
    /// Decoder layer (0 for globals).
    pub layer: u64,
    /// Expert (0 unless an expert rule).
    pub expert: u64,
    /// The rule's `weight_scale_inv` rather than its weight.
    pub scale: bool,
}

/// The architecture facts reshard needs: enough to name and shape every tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Preset name (or a user-chosen label).
    pub name: String,
    /// Decoder layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads (GQA groups).
    pub kv_heads: u64,
    /// Size of one attention head.
    pub head_dim: u64,
    /// Dense MLP intermediate size; unused when `moe` is set.
    pub intermediate: u64,
    /// Mixture-of-experts MLP, when every layer is MoE.
    pub moe: Option<MoeConfig>,
    /// Vocabulary size (rows of the embedding and of `lm_head`).
    pub vocab: u64,
    /// Whether `lm_head` shares the embedding (then it is not a separate tensor).
    pub tied_embeddings: bool,
    /// Whether attention has per-head `q_norm` / `k_norm` (Qwen3).
    pub qk_norm: bool,
    /// Element type of every tensor (but those `arch.dtypes` and `arch.fp8_block` name).
    pub dtype: DType,
    /// Family (`model_type`), dense layers, shared experts, MLA, per-rule dtypes.
    #[serde(default, skip_serializing_if = "Arch::is_default")]
    pub arch: Arch,
}

/// Most decoder layers a model may have. The deepest published decoders have 126 (Llama-3.1-405B)
/// to about 160 layers; 4,096 is 25x that, and keeps the per-layer loops and names of a
/// configuration read from a file or an announcement from running for hours or exhausting memory.
pub const MAX_LAYERS: u64 = 4096;

/// Most routed experts per layer. Published MoE models have up to 384 (Kimi-K2) or 512; 16,384
/// is 32x that.
pub const MAX_EXPERTS: u64 = 16_384;

/// Most tensors a model may have ([`ModelConfig::tensor_count`]). Kimi-K2, the largest preset,
/// has 69,975; 2^20 is 15x that, and [`ModelConfig::tensors`] of a model this size is about
/// 150 MB of names and shapes, which every publisher and receiver builds once: an allocation a
/// host survives, where a count taken from outside unchecked (10^12 layers) aborts the process.
pub const MAX_TENSORS: u64 = 1 << 20;

/// Most bytes a model may have ([`ModelConfig::total_bytes`]): 1 PiB, 512x Kimi-K2's 2 TB in
/// BF16. Every offset and size inside the model then fits u64 with a factor of 16,000 to spare,
/// so the arithmetic over boxes, ranks and digests that follows validation cannot overflow.
pub const MAX_TOTAL_BYTES: u64 = 1 << 50;

/// A model field, or a count derived from fields, above what reshard accepts
/// ([`ModelConfig::out_of_bounds`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfBounds {
    /// The [`ModelConfig`] field (`layers`, `experts`), or the derived count (`tensors`,
    /// `total_bytes`).
    pub field: &'static str,
    /// Its value; `u64::MAX` when the count itself overflows u64.
    pub value: u64,
    /// The largest value accepted.
    pub limit: u64,
}

impl std::fmt::Display for OutOfBounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.value == u64::MAX {
            write!(
                f,
                "{} overflows u64 (at most {} accepted)",
                self.field, self.limit
            )
        } else {
            write!(
                f,
                "{} is {}, above the {} reshard accepts",
                self.field, self.value, self.limit
            )
        }
    }
}

/// A named, documented model configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Preset {
    /// Name used by `--preset`.
    pub name: &'static str,
    /// One-line description.
    pub description: &'static str,
    /// Where the numbers come from.
    pub source: &'static str,
    /// The configuration.
    pub config: ModelConfig,
}

/// Every preset, in a stable order.
pub fn presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "qwen3-30b-a3b",
            description: "Qwen3-30B-A3B: 48 MoE layers, 128 experts, GQA 32/4, BF16 \
                          (docs/design.md §8)",
            source: "config.json of Qwen/Qwen3-30B-A3B on its Hugging Face model card \
                     (hidden_size 2048, num_hidden_layers 48, num_experts 128, \
                     moe_intermediate_size 768, num_attention_heads 32, num_key_value_heads 4, \
                     head_dim 128, vocab_size 151936, tie_word_embeddings false)",
            config: ModelConfig {
                name: "qwen3-30b-a3b".into(),
                layers: 48,
                hidden: 2048,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                // Dense intermediate of the config (6144) is never used: every layer is MoE
                // (decoder_sparse_step 1, no mlp_only_layers).
                intermediate: 6144,
                moe: Some(MoeConfig {
                    experts: 128,
                    expert_intermediate: 768,
                }),
                vocab: 151_936,
                tied_embeddings: false,
                qk_norm: true,
                dtype: DType::Bf16,
                arch: Arch {
                    model_type: "qwen3_moe".into(),
                    ..Arch::default()
                },
            },
        },
        Preset {
            name: "llama-3-8b",
            description: "Llama-3-8B: 32 dense layers, GQA 32/8, BF16",
            source: "config.json of meta-llama/Meta-Llama-3-8B on its Hugging Face model card \
                     (hidden_size 4096, num_hidden_layers 32, num_attention_heads 32, \
                     num_key_value_heads 8, intermediate_size 14336, vocab_size 128256, \
                     tie_word_embeddings false; head_dim = 4096 / 32)",
            config: ModelConfig {
                name: "llama-3-8b".into(),
                layers: 32,
                hidden: 4096,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                intermediate: 14_336,
                moe: None,
                vocab: 128_256,
                tied_embeddings: false,
                qk_norm: false,
                dtype: DType::Bf16,
                arch: Arch {
                    model_type: "llama".into(),
                    ..Arch::default()
                },
            },
        },
        Preset {
            name: "kimi-k2",
            description: "Kimi-K2 1T MoE (DeepSeek-V3 architecture): 61 layers, MLA, first layer \
                          dense, 384 routed experts and 1 shared expert, hidden 7168, BF16",
            source: "config.json of moonshotai/Kimi-K2-Instruct on its Hugging Face model card \
                     (model_type kimi_k2, architectures DeepseekV3ForCausalLM, hidden_size 7168, \
                     num_hidden_layers 61, first_k_dense_replace 1, moe_layer_freq 1, \
                     n_routed_experts 384, n_shared_experts 1, moe_intermediate_size 2048, \
                     intermediate_size 18432, num_attention_heads 64, q_lora_rank 1536, \
                     kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, \
                     vocab_size 163840, tie_word_embeddings false). Its published weights are \
                     fp8 blocks of 128x128 with scales; a trainer holds them in BF16, as here.",
            config: ModelConfig {
                name: "kimi-k2".into(),
                layers: 61,
                hidden: 7168,
                heads: 64,
                kv_heads: 64,
                // qk_nope_head_dim + qk_rope_head_dim: what one MLA query head is wide.
                head_dim: 192,
                intermediate: 18_432,
                moe: Some(MoeConfig {
                    experts: 384,
                    expert_intermediate: 2048,
                }),
                vocab: 163_840,
                tied_embeddings: false,
                qk_norm: false,
                dtype: DType::Bf16,
                arch: Arch {
                    model_type: "kimi_k2".into(),
                    dense_layers: vec![0],
                    shared_intermediate: 2048,
                    mla: Some(MlaConfig {
                        q_lora_rank: Some(1536),
                        kv_lora_rank: 512,
                        qk_nope_head_dim: 128,
                        qk_rope_head_dim: 64,
                        v_head_dim: 128,
                    }),
                    ..Arch::default()
                },
            },
        },
    ]
}

/// The configuration of a preset by name; an unknown name is a `Config` error listing the names.
pub fn preset(name: &str) -> Result<ModelConfig> {
    let all = presets();
    if let Some(p) = all.iter().find(|p| p.name == name) {
        return Ok(p.config.clone());
    }
    let names: Vec<&str> = all.iter().map(|p| p.name).collect();
    Err(Error::new(
        ErrorKind::Config,
        format!("unknown preset {name:?}; available: {}", names.join(", ")),
    ))
}

/// Name of a decoder layer's tensor: `model.layers.{layer}.{suffix}`.
pub fn layer_tensor(layer: u64, suffix: &str) -> String {
    format!("model.layers.{layer}.{suffix}")
}

/// Name of one expert's tensor: `model.layers.{layer}.mlp.experts.{expert}.{proj}.weight`.
pub fn expert_tensor(layer: u64, expert: u64, proj: &str) -> String {
    format!("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight")
}

impl ModelConfig {
    /// Scales the model down: fewer layers, fewer experts or a smaller vocabulary. Overrides only
    /// shrink (a larger model than the preset is not the preset any more); zero, growth, or
    /// experts on a dense model are `Config` errors.
    pub fn with_overrides(
        mut self,
        layers: Option<u64>,
        experts: Option<u64>,
        vocab: Option<u64>,
    ) -> Result<Self> {
        let shrink = |what: &str, want: u64, have: u64| -> Result<u64> {
            if want == 0 || want > have {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "--{what} {want} is out of range for {}: expected 1..={have}",
                        self.name
                    ),
                ));
            }
            Ok(want)
        };
        if let Some(l) = layers {
            self.layers = shrink("layers", l, self.layers)?;
            let kept = self.layers;
            self.arch.dense_layers.retain(|&d| d < kept);
        }
        if let Some(e) = experts {
            let have = match &self.moe {
                Some(m) => m.experts,
                None => {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!("--experts {e} given but {} is a dense model", self.name),
                    ))
                }
            };
            let e = shrink("experts", e, have)?;
            if let Some(m) = self.moe.as_mut() {
                m.experts = e;
            }
        }
        if let Some(v) = vocab {
            self.vocab = shrink("vocab", v, self.vocab)?;
        }
        self.validate()?;
        Ok(self)
    }

    /// The `model_type` whose family table describes this model: `arch.model_type`, or for a
    /// configuration without one, `qwen3_moe` / `qwen3` / `llama` by `moe` and `qk_norm`.
    pub fn model_type(&self) -> &str {
        if !self.arch.model_type.is_empty() {
            return &self.arch.model_type;
        }
        match (self.moe.is_some(), self.qk_norm) {
            (true, true) => "qwen3_moe",
            (false, true) => "qwen3",
            (false, false) => "llama",
            (true, false) => "",
        }
    }

    /// The family table of this model; an unknown `model_type` is a `Config` error naming it.
    pub fn family(&self) -> Result<&'static Family> {
        let mt = self.model_type();
        family(mt).ok_or_else(|| {
            let what = if mt.is_empty() {
                "an MoE model without q/k norms and without model_type has no family".to_string()
            } else {
                format!("unknown model_type {mt:?}")
            };
            Error::new(
                ErrorKind::Config,
                format!(
                    "model {}: {what}; reshard has rules for: {}",
                    self.name,
                    model_types().join(", ")
                ),
            )
        })
    }

    /// Whether layer `l`'s MLP is mixture-of-experts.
    pub fn is_moe_layer(&self, l: u64) -> bool {
        self.moe.is_some() && self.arch.dense_layers.binary_search(&l).is_err()
    }

    /// Number of MoE layers.
    fn moe_layers(&self) -> u64 {
        match self.moe {
            Some(_) => self
                .layers
                .saturating_sub(self.arch.dense_layers.len() as u64),
            None => 0,
        }
    }

    /// Element type of rule `r`'s weight (or, with `scale`, of its fp8 scale tensor).
    pub fn rule_dtype(&self, r: &Rule, scale: bool) -> DType {
        if scale {
            return DType::F32;
        }
        if let Some(d) = self.arch.dtypes.get(r.name) {
            return *d;
        }
        if r.quant && self.arch.fp8_block.is_some() {
            return DType::F8E4m3;
        }
        self.dtype
    }

    /// Whether rule `r` has an fp8 scale tensor in this model.
    pub fn has_scale(&self, r: &Rule) -> bool {
        r.quant && r.shape.len() == 2 && self.arch.fp8_block.is_some()
    }

    /// Shape of rule `r`'s fp8 scale tensor, given its weight's shape: one element per block.
    pub fn scale_shape(&self, weight: &[u64]) -> Vec<u64> {
        let b = self.arch.fp8_block.unwrap_or([1, 1]);
        weight
            .iter()
            .zip(b)
            .map(|(&d, b)| d.div_ceil(b.max(1)))
            .collect()
    }

    /// Layers of the model having rule `r` (1 for an applying global, 0 otherwise).
    fn rule_layers(&self, r: &Rule) -> u64 {
        use crate::families::When;
        let q_lora = self
            .arch
            .mla
            .as_ref()
            .is_some_and(|x| x.q_lora_rank.is_some());
        let global = matches!(r.scope, Scope::First | Scope::Last);
        let n = if global { 1 } else { self.layers };
        match r.when {
            When::Always => n,
            When::Untied => u64::from(!self.tied_embeddings) * n,
            When::Dense => n - self.moe_layers().min(n),
            When::Moe => self.moe_layers(),
            When::Shared if self.arch.shared_intermediate > 0 => self.moe_layers(),
            When::Shared => 0,
            When::QLora => u64::from(q_lora) * n,
            When::NoQLora => u64::from(!q_lora) * n,
        }
    }

    /// How many tensors rule `r` has: its layers, times the experts for an expert rule, `None`
    /// on overflow.
    fn rule_count(&self, r: &Rule) -> Option<u64> {
        let n = self.rule_layers(r);
        match r.scope {
            Scope::Expert => n.checked_mul(self.moe.as_ref().map_or(0, |m| m.experts)),
            _ => Some(n),
        }
    }

    /// Checks the architecture is self-consistent and bounded: a known family whose features
    /// agree with the fields, no zero size any of its tensors uses, query heads a multiple of
    /// KV heads, dense layers inside the model, and layers, experts, tensor count and total bytes
    /// within [`MAX_LAYERS`], [`MAX_EXPERTS`], [`MAX_TENSORS`] and [`MAX_TOTAL_BYTES`]. A
    /// `Config` error names the field. Every configuration from outside (a `config.json`, a
    /// publisher's announcement, a Python argument) passes here before anything is sized from it.
    pub fn validate(&self) -> Result<()> {
        let cfg = |m: String| Error::new(ErrorKind::Config, format!("model {}: {m}", self.name));
        let fam = self.family()?;
        let mut fields = vec![
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("vocab", self.vocab),
        ];
        if !fam.mla {
            fields.push(("kv_heads", self.kv_heads));
            fields.push(("head_dim", self.head_dim));
        }
        match &self.moe {
            Some(m) => {
                fields.push(("experts", m.experts));
                fields.push(("expert_intermediate", m.expert_intermediate));
            }
            None => fields.push(("intermediate", self.intermediate)),
        }
        if let Some((f, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(cfg(format!("{f} must not be zero")));
        }
        if !self.arch.model_type.is_empty() && fam.qk_norm != self.qk_norm {
            return Err(cfg(format!(
                "qk_norm is {} but model_type {:?} has it {}",
                self.qk_norm, self.arch.model_type, fam.qk_norm
            )));
        }
        if fam.mla != self.arch.mla.is_some() {
            return Err(cfg(format!(
                "model_type {:?} {} MLA attention but the configuration {} MLA sizes",
                self.model_type(),
                if fam.mla { "has" } else { "has no" },
                if self.arch.mla.is_some() {
                    "gives"
                } else {
                    "gives no"
                }
            )));
        }
        if !self.arch.dense_layers.is_empty() && self.moe.is_none() {
            return Err(cfg("dense_layers given for a dense model".into()));
        }
        if let Some(w) = self.arch.dense_layers.windows(2).find(|w| w[0] >= w[1]) {
            return Err(cfg(format!(
                "dense_layers must be ascending without repeats ({} then {})",
                w[0], w[1]
            )));
        }
        if let Some(&l) = self.arch.dense_layers.last() {
            if l >= self.layers {
                return Err(cfg(format!(
                    "dense layer {l} is not below the {} layers",
                    self.layers
                )));
            }
        }
        if self.arch.fp8_block.is_some_and(|b| b.contains(&0)) {
            return Err(cfg("fp8 weight_block_size must not be zero".into()));
        }
        if !fam.mla && self.heads % self.kv_heads != 0 {
            return Err(cfg(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.heads, self.kv_heads
            )));
        }
        // Every size a tensor of this model uses is non-zero.
        for r in fam.rules {
            if self.rule_count(r) == Some(0) {
                continue;
            }
            for d in r.shape {
                if d.size(self) == Some(0) {
                    return Err(cfg(format!(
                        "{} must not be zero (tensor {})",
                        d.field(),
                        r.name
                    )));
                }
            }
        }
        // Every tensor and fused parameter is at most the model's size, so one checked total
        // keeps all later unchecked shape arithmetic in range.
        if let Some(b) = self.out_of_bounds() {
            return Err(cfg(b.to_string()));
        }
        Ok(())
    }

    /// The first field or derived count above its limit, checked without building anything:
    /// layers, experts, then the tensor count and the total bytes (each `u64::MAX` when the
    /// count overflows). `None` when the model is within every limit.
    pub fn out_of_bounds(&self) -> Option<OutOfBounds> {
        let over = |field, value: Option<u64>, limit| {
            let value = value.unwrap_or(u64::MAX);
            (value > limit).then_some(OutOfBounds {
                field,
                value,
                limit,
            })
        };
        over("layers", Some(self.layers), MAX_LAYERS)
            .or_else(|| {
                let experts = self.moe.as_ref().map_or(0, |m| m.experts);
                over("experts", Some(experts), MAX_EXPERTS)
            })
            .or_else(|| over("tensors", self.checked_tensor_count(), MAX_TENSORS))
            .or_else(|| over("total_bytes", self.checked_total_bytes(), MAX_TOTAL_BYTES))
    }

    /// Tensor count from the family's rules, `None` on overflow (or an unknown family).
    fn checked_tensor_count(&self) -> Option<u64> {
        let fam = self.family().ok()?;
        fam.rules.iter().try_fold(0u64, |a, r| {
            let n = self.rule_count(r)?;
            let n = if self.has_scale(r) {
                n.checked_mul(2)?
            } else {
                n
            };
            a.checked_add(n)
        })
    }

    /// Total bytes from the family's rules, `None` on overflow (or an unknown family).
    fn checked_total_bytes(&self) -> Option<u64> {
        let fam = self.family().ok()?;
        let bytes =
            |shape: &[u64], dt: DType| shape.iter().try_fold(dt.size(), |a, &x| a.checked_mul(x));
        fam.rules.iter().try_fold(0u64, |a, r| {
            let n = self.rule_count(r)?;
            if n == 0 {
                return Some(a);
            }
            let dims = r.dims(self)?;
            let mut one = bytes(&dims, self.rule_dtype(r, false))?;
            if self.has_scale(r) {
                one = one.checked_add(bytes(&self.scale_shape(&dims), DType::F32)?)?;
            }
            a.checked_add(n.checked_mul(one)?)
        })
    }

    /// Rows of `q_proj` (query heads x head size).
    pub fn q_rows(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Rows of `k_proj` and of `v_proj` (KV heads x head size).
    pub fn kv_rows(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Every tensor, HF-canonical names, with where each comes from, in the family table's
    /// order: leading globals, then per layer its rules in order (the experts of an expert block
    /// one after another, each with all the block's rules), then trailing globals. An fp8 scale
    /// tensor follows its weight. Empty for a model without a family (`validate` refuses it).
    pub fn placed_tensors(&self) -> Vec<(TensorSpec, Placement)> {
        let Ok(fam) = self.family() else {
            return Vec::new();
        };
        // Bounded even for a model `validate` would refuse, so a caller that skipped it cannot
        // abort on the reservation.
        let mut out = Vec::with_capacity(self.tensor_count().min(MAX_TENSORS as usize));
        let mut push = |r: &Rule, i: usize, l: u64, e: u64| {
            let Some(shape) = r.dims(self) else {
                return;
            };
            let name = r.tensor_name(l, e);
            let place = Placement {
                rule: i,
                layer: l,
                expert: e,
                scale: false,
            };
            if self.has_scale(r) {
                let scale = self.scale_shape(&shape);
                let sname = format!("{}{SCALE_SUFFIX}", &name[..name.len() - "weight".len()]);
                out.push((
                    TensorSpec::new(name, self.rule_dtype(r, false), shape),
                    place,
                ));
                out.push((
                    TensorSpec::new(sname, DType::F32, scale),
                    Placement {
                        scale: true,
                        ..place
                    },
                ));
            } else {
                out.push((
                    TensorSpec::new(name, self.rule_dtype(r, false), shape),
                    place,
                ));
            }
        };
        let rules = fam.rules;
        for (i, r) in rules.iter().enumerate() {
            if r.scope == Scope::First && r.applies(self, 0) {
                push(r, i, 0, 0);
            }
        }
        let experts = self.moe.as_ref().map_or(0, |m| m.experts);
        for l in 0..self.layers {
            let mut i = 0;
            while i < rules.len() {
                let r = &rules[i];
                match r.scope {
                    Scope::Layer => {
                        if r.applies(self, l) {
                            push(r, i, l, 0);
                        }
                        i += 1;
                    }
                    Scope::Expert => {
                        let end = (i..rules.len())
                            .find(|&j| rules[j].scope != Scope::Expert)
                            .unwrap_or(rules.len());
                        if r.applies(self, l) {
                            for e in 0..experts {
                                for (j, x) in rules.iter().enumerate().take(end).skip(i) {
                                    push(x, j, l, e);
                                }
                            }
                        }
                        i = end;
                    }
                    _ => i += 1,
                }
            }
        }
        for (i, r) in rules.iter().enumerate() {
            if r.scope == Scope::Last && r.applies(self, 0) {
                push(r, i, 0, 0);
            }
        }
        out
    }

    /// Every tensor, HF-canonical names, in a deterministic order ([`ModelConfig::placed_tensors`]):
    /// for the first families the embedding, then per layer attention, norms and MLP (router, then
    /// experts in order), then the final norm and `lm_head`.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        self.placed_tensors().into_iter().map(|(s, _)| s).collect()
    }

    /// Number of tensors [`ModelConfig::tensors`] returns, without building them (saturates at
    /// `usize::MAX` for a configuration that [`ModelConfig::validate`] rejects).
    pub fn tensor_count(&self) -> usize {
        self.checked_tensor_count()
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(usize::MAX)
    }

    /// Total bytes of all tensors, computed without building them (saturates at `u64::MAX` for
    /// a configuration that [`ModelConfig::validate`] rejects as overflowing).
    pub fn total_bytes(&self) -> u64 {
        self.checked_total_bytes().unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_has_the_design_tensor_count_and_size() {
        let m = preset("qwen3-30b-a3b").unwrap();
        let t = m.tensors();
        assert_eq!(t.len(), 18_867);
        assert_eq!(m.tensor_count(), 18_867);
        // 30.5 B parameters in BF16.
        assert_eq!(m.total_bytes(), 61_064_245_248);
        assert_eq!(
            t.iter().map(TensorSpec::bytes).sum::<u64>(),
            m.total_bytes()
        );
    }

    #[test]
    fn formula_total_matches_tensors_for_tied_and_overflow_is_rejected() {
        let mut m = preset("qwen3-30b-a3b").unwrap();
        m.tied_embeddings = true;
        m.qk_norm = false;
        let t = m.tensors();
        assert_eq!(t.len(), m.tensor_count());
        assert_eq!(
            t.iter().map(TensorSpec::bytes).sum::<u64>(),
            m.total_bytes()
        );
        m.vocab = u64::MAX / 2;
        assert_eq!(m.validate().unwrap_err().kind(), ErrorKind::Config);
        assert_eq!(m.total_bytes(), u64::MAX);
    }

    /// The issue's config: 10^12 layers of a model otherwise a few hundred bytes wide.
    fn absurd_layers() -> ModelConfig {
        ModelConfig {
            name: "absurd".into(),
            layers: 1_000_000_000_000,
            hidden: 8,
            heads: 1,
            kv_heads: 1,
            head_dim: 8,
            intermediate: 8,
            moe: None,
            vocab: 64,
            tied_embeddings: false,
            qk_norm: false,
            dtype: DType::Bf16,
            arch: Arch::default(),
        }
    }

    #[test]
    fn counts_from_outside_are_bounded_naming_the_field() {
        let m = absurd_layers();
        // Small enough in bytes to pass the overflow check alone: only the bounds refuse it.
        assert!(m.checked_total_bytes().is_some());
        let e = m.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("layers is 1000000000000"), "{e}");
        assert_eq!(m.out_of_bounds().unwrap().field, "layers");
        // The receiver's path: an announced architecture is validated before the tensor index.
        let recv: crate::topology::ReceiverTopology = "tp=1".parse().unwrap();
        let e = crate::layouts::receiver_layout(&m, &recv, 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("layers"), "{e}");

        let mut moe = preset("qwen3-30b-a3b").unwrap();
        moe.moe.as_mut().unwrap().experts = MAX_EXPERTS + 1;
        assert_eq!(moe.out_of_bounds().unwrap().field, "experts");
        // Each field within its own limit, their product is not.
        moe.moe.as_mut().unwrap().experts = MAX_EXPERTS;
        moe.layers = 64;
        let b = moe.out_of_bounds().unwrap();
        // Per layer: 4 projections, q/k norms, 2 layer norms, the router and 3 per expert.
        assert_eq!(
            (b.field, b.value),
            ("tensors", 64 * (9 + 3 * MAX_EXPERTS) + 3)
        );
        assert_eq!(moe.validate().unwrap_err().kind(), ErrorKind::Config);
        let mut wide = preset("llama-3-8b").unwrap();
        wide.vocab = 1 << 40;
        assert_eq!(wide.out_of_bounds().unwrap().field, "total_bytes");
        wide.vocab = u64::MAX / 2;
        let b = wide.out_of_bounds().unwrap();
        assert_eq!((b.field, b.value), ("total_bytes", u64::MAX));
        // At the limits exactly, accepted.
        let mut edge = absurd_layers();
        edge.layers = MAX_LAYERS;
        edge.validate().unwrap();
        assert_eq!(edge.tensors().len(), edge.tensor_count());
    }

    #[test]
    fn every_preset_is_well_inside_the_bounds() {
        for p in presets() {
            let m = &p.config;
            m.validate().unwrap();
            assert!(m.layers * 16 <= MAX_LAYERS, "{}", p.name);
            assert!(m.moe.as_ref().map_or(0, |x| x.experts) * 16 <= MAX_EXPERTS);
            assert!(m.tensor_count() as u64 * 14 <= MAX_TENSORS, "{}", p.name);
            assert!(m.total_bytes() * 500 <= MAX_TOTAL_BYTES, "{}", p.name);
        }
        // 1 embedding, 12 in the dense first layer, 60 MoE layers of 1,166 (7 MLA, 2 norms, router
        // and its bias, 3 x 384 experts, 3 shared), the final norm and lm_head.
        assert_eq!(preset("kimi-k2").unwrap().tensor_count(), 69_975);
    }

    #[test]
    fn llama_is_dense_with_eight_kv_heads() {
        let m = preset("llama-3-8b").unwrap();
        let t = m.tensors();
        assert_eq!(t.len(), 32 * 9 + 3);
        assert_eq!(m.tensor_count(), t.len());
        let k = t
            .iter()
            .find(|s| s.name == "model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k.shape, vec![1024, 4096]);
        // 8.03 B parameters in BF16.
        assert_eq!(m.total_bytes(), 16_060_522_496);
        assert_eq!(
            t.iter().map(TensorSpec::bytes).sum::<u64>(),
            m.total_bytes()
        );
    }

    #[test]
    fn announced_json_decodes_with_or_without_arch_and_names_a_bad_family() {
        // An announcement from before families: no "arch", decoded as its qwen3_moe family.
        let old = r#"{"name": "q", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2,
            "head_dim": 16, "intermediate": 96, "moe": {"experts": 4, "expert_intermediate": 32},
            "vocab": 128, "tied_embeddings": false, "qk_norm": true, "dtype": "bf16"}"#;
        let m: ModelConfig = serde_json::from_str(old).unwrap();
        assert_eq!(m.arch, Arch::default());
        assert_eq!(m.model_type(), "qwen3_moe");
        m.validate().unwrap();
        // A default arch stays out of the JSON: such announcements are byte-identical.
        assert!(!serde_json::to_string(&m).unwrap().contains("arch"));
        for p in presets() {
            let json = serde_json::to_string(&p.config).unwrap();
            assert_eq!(
                serde_json::from_str::<ModelConfig>(&json).unwrap(),
                p.config
            );
        }
        let mut bad = m.clone();
        bad.arch.model_type = "gpt_oss".into();
        let e = bad.validate().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("\"gpt_oss\""), "{e}");
        let mut no_family = m.clone();
        no_family.qk_norm = false;
        let e = no_family.validate().unwrap_err();
        assert!(e.message().contains("model_type"), "{e}");
        let mut dense = m.clone();
        dense.arch.dense_layers = vec![1, 2];
        let e = dense.validate().unwrap_err();
        assert!(e.message().contains("dense layer 2"), "{e}");
        dense.arch.dense_layers = vec![1, 0];
        assert!(dense
            .validate()
            .unwrap_err()
            .message()
            .contains("ascending"));
        // More dense layers than layers (unvalidated) is counted without overflow.
        dense.arch.dense_layers = vec![0, 1, 2, 3];
        let _ = dense.tensor_count();
        let mut mla = preset("kimi-k2").unwrap();
        mla.arch.mla = None;
        assert!(mla.validate().unwrap_err().message().contains("MLA"));
        let mut zero = preset("kimi-k2").unwrap();
        zero.arch.mla.as_mut().unwrap().kv_lora_rank = 0;
        let e = zero.validate().unwrap_err();
        assert!(e.message().contains("kv_lora_rank must not be zero"), "{e}");
    }
}
