//! Model presets: the architectures reshard plans for, and the HF-canonical tensors each one has.
//!
//! A preset is only geometry (names, dtypes, shapes); synthetic publishers derive bytes from it,
//! and `reshard plan` needs nothing else. Overrides scale a preset down so a byte-moving refit fits
//! on one machine.

use serde::{Deserialize, Serialize};

use reshard_core::{DType, Error, ErrorKind, Result, TensorSpec};

/// Mixture-of-experts shape of every MLP block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts per layer.
    pub experts: u64,
    /// Intermediate size of one expert's MLP.
    pub expert_intermediate: u64,
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
    /// Element type of every tensor.
    pub dtype: DType,
}

/// Most decoder layers a model may have. The deepest published decoders have 126 (Llama-3.1-405B)
/// to about 160 layers; 4,096 is 25x that, and keeps the per-layer loops and names of a
/// configuration read from a file or an announcement from running for hours or exhausting memory.
pub const MAX_LAYERS: u64 = 4096;

/// Most routed experts per layer. Published MoE models have up to 384 (Kimi-K2) or 512; 16,384
/// is 32x that.
pub const MAX_EXPERTS: u64 = 16_384;

/// Most tensors a model may have ([`ModelConfig::tensor_count`]). Kimi-K2, the largest preset,
/// has 70,702; 2^20 is 15x that, and [`ModelConfig::tensors`] of a model this size is about
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
            },
        },
        Preset {
            name: "kimi-k2",
            description: "Kimi-K2-like 1T MoE: 61 MoE layers, 384 experts, hidden 7168, BF16 \
                          (attention modelled as GQA, no shared expert; for plan-scale tests)",
            source: "config.json of moonshotai/Kimi-K2-Instruct on its Hugging Face model card \
                     (hidden_size 7168, num_hidden_layers 61, n_routed_experts 384, \
                     moe_intermediate_size 2048, num_attention_heads 64, vocab_size 163840). \
                     Simplified: K2's MLA attention (q/kv LoRA projections) is modelled as GQA \
                     with 64 query heads of 128 and 8 KV heads, its one shared expert and its \
                     first dense layer are left out, and embeddings are untied; the routed \
                     experts, which are 97% of the bytes and tensors, are exact.",
            config: ModelConfig {
                name: "kimi-k2".into(),
                layers: 61,
                hidden: 7168,
                heads: 64,
                kv_heads: 8,
                head_dim: 128,
                intermediate: 18_432,
                moe: Some(MoeConfig {
                    experts: 384,
                    expert_intermediate: 2048,
                }),
                vocab: 163_840,
                tied_embeddings: false,
                qk_norm: false,
                dtype: DType::Bf16,
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

/// Suffixes of a layer's whole (never split) norm tensors: q/k norms when present, then the two
/// layer norms.
pub(crate) fn layer_norm_suffixes(model: &ModelConfig) -> &'static [&'static str] {
    if model.qk_norm {
        &[
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ]
    } else {
        &["input_layernorm.weight", "post_attention_layernorm.weight"]
    }
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

    /// Checks the architecture is self-consistent and bounded: no zero sizes, query heads a
    /// multiple of KV heads, layers, experts, tensor count and total bytes within
    /// [`MAX_LAYERS`], [`MAX_EXPERTS`], [`MAX_TENSORS`] and [`MAX_TOTAL_BYTES`]. A `Config` error
    /// names the field. Every configuration from outside (a `config.json`, a publisher's
    /// announcement, a Python argument) passes here before anything is sized from it.
    pub fn validate(&self) -> Result<()> {
        let mut fields = vec![
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("vocab", self.vocab),
        ];
        match &self.moe {
            Some(m) => {
                fields.push(("experts", m.experts));
                fields.push(("expert_intermediate", m.expert_intermediate));
            }
            None => fields.push(("intermediate", self.intermediate)),
        }
        if let Some((f, _)) = fields.iter().find(|(_, v)| *v == 0) {
            return Err(Error::new(
                ErrorKind::Config,
                format!("model {}: {f} must not be zero", self.name),
            ));
        }
        if self.heads % self.kv_heads != 0 {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "model {}: {} query heads are not a multiple of {} KV heads",
                    self.name, self.heads, self.kv_heads
                ),
            ));
        }
        // Every tensor and fused parameter is at most the model's size, so one checked total
        // keeps all later unchecked shape arithmetic in range.
        if let Some(b) = self.out_of_bounds() {
            return Err(Error::new(
                ErrorKind::Config,
                format!("model {}: {b}", self.name),
            ));
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

    /// Tensor count from the architecture formula, `None` on overflow.
    fn checked_tensor_count(&self) -> Option<u64> {
        let attn = if self.qk_norm { 6 } else { 4 };
        let mlp = match &self.moe {
            Some(m) => m.experts.checked_mul(3)?.checked_add(1)?,
            None => 3,
        };
        let per_layer = mlp.checked_add(attn + 2)?;
        let globals = if self.tied_embeddings { 2 } else { 3 };
        self.layers.checked_mul(per_layer)?.checked_add(globals)
    }

    /// Total bytes from the architecture formula, `None` on overflow.
    fn checked_total_bytes(&self) -> Option<u64> {
        let mul = |v: &[u64]| v.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
        let add = |v: &[Option<u64>]| v.iter().try_fold(0u64, |a, x| a.checked_add((*x)?));
        let h = self.hidden;
        let q = mul(&[self.heads, self.head_dim, h]);
        let kv = mul(&[2, self.kv_heads, self.head_dim, h]);
        let norms = mul(&[if self.qk_norm { 2 } else { 0 }, self.head_dim]);
        let mlp = match &self.moe {
            Some(m) => add(&[
                mul(&[m.experts, h]),
                mul(&[m.experts, 3, m.expert_intermediate, h]),
            ]),
            None => mul(&[3, self.intermediate, h]),
        };
        let layer = add(&[q, q, kv, norms, mul(&[2, h]), mlp]);
        let heads = if self.tied_embeddings { 1 } else { 2 };
        let elements = add(&[
            mul(&[self.layers, layer?]),
            mul(&[heads, self.vocab, h]),
            Some(h),
        ]);
        elements?.checked_mul(self.dtype.size())
    }

    /// Rows of `q_proj` (query heads x head size).
    pub fn q_rows(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Rows of `k_proj` and of `v_proj` (KV heads x head size).
    pub fn kv_rows(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Every tensor, HF-canonical names, in a deterministic order: embedding, then per layer
    /// attention, norms and MLP (router, then experts in order), then the final norm and `lm_head`.
    pub fn tensors(&self) -> Vec<TensorSpec> {
        let dt = self.dtype;
        let h = self.hidden;
        // Bounded even for a model `validate` would refuse, so a caller that skipped it cannot
        // abort on the reservation.
        let mut out = Vec::with_capacity(self.tensor_count().min(MAX_TENSORS as usize));
        out.push(TensorSpec::new(
            "model.embed_tokens.weight",
            dt,
            vec![self.vocab, h],
        ));
        for l in 0..self.layers {
            let t = |s: &str, shape: Vec<u64>| TensorSpec::new(layer_tensor(l, s), dt, shape);
            out.push(t("self_attn.q_proj.weight", vec![self.q_rows(), h]));
            out.push(t("self_attn.k_proj.weight", vec![self.kv_rows(), h]));
            out.push(t("self_attn.v_proj.weight", vec![self.kv_rows(), h]));
            out.push(t("self_attn.o_proj.weight", vec![h, self.q_rows()]));
            for n in layer_norm_suffixes(self) {
                let len = if n.starts_with("self_attn.") {
                    self.head_dim
                } else {
                    h
                };
                out.push(t(n, vec![len]));
            }
            match &self.moe {
                Some(m) => {
                    out.push(t("mlp.gate.weight", vec![m.experts, h]));
                    let i = m.expert_intermediate;
                    for e in 0..m.experts {
                        let x = |p: &str, shape| TensorSpec::new(expert_tensor(l, e, p), dt, shape);
                        out.push(x("gate_proj", vec![i, h]));
                        out.push(x("up_proj", vec![i, h]));
                        out.push(x("down_proj", vec![h, i]));
                    }
                }
                None => {
                    let i = self.intermediate;
                    out.push(t("mlp.gate_proj.weight", vec![i, h]));
                    out.push(t("mlp.up_proj.weight", vec![i, h]));
                    out.push(t("mlp.down_proj.weight", vec![h, i]));
                }
            }
        }
        out.push(TensorSpec::new("model.norm.weight", dt, vec![h]));
        if !self.tied_embeddings {
            out.push(TensorSpec::new("lm_head.weight", dt, vec![self.vocab, h]));
        }
        out
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

    /// The config: 10^12 layers of a model otherwise a few hundred bytes wide.
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
        assert_eq!(preset("kimi-k2").unwrap().tensor_count(), 70_702);
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
}
