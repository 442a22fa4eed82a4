//! `config.json` in Hugging Face form, to and from [`ModelConfig`], and dtype names.
//!
//! Reading accepts the keys real Hugging Face configs use for every family of
//! `reshard_planner::families` (docs/models.md), with their defaults where a key is optional, so
//! a downloaded checkpoint opens as well as a written one.

use std::path::Path;

use serde_json::{json, Map, Value};

use reshard_core::{DType, Error, ErrorKind, Result, TensorSpec};
use reshard_planner::families::{family, match_tensor, model_types, MoeKeys};
use reshard_planner::presets::{Arch, MlaConfig, ModelConfig, MoeConfig, MAX_LAYERS};

/// File name of the architecture description inside a checkpoint.
pub const CONFIG_FILE: &str = "config.json";

/// Key of the reshard-only label (the preset name) in `config.json`; optional on read.
const NAME_KEY: &str = "reshard_model_name";

/// The `torch_dtype` string of a dtype (what PyTorch calls it).
pub fn torch_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::Bf16 => "bfloat16",
        DType::F16 => "float16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::F8E4m3 => "float8_e4m3fn",
        DType::F8E5m2 => "float8_e5m2",
        DType::I8 => "int8",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::U8 => "uint8",
        DType::Bool => "bool",
    }
}

/// The dtype of a `torch_dtype` string, `None` when reshard has no such dtype.
pub fn dtype_from_torch(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|d| torch_dtype(*d) == name)
}

/// The safetensors header dtype of a dtype.
pub fn safetensors_dtype(dtype: DType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match dtype {
        DType::Bf16 => S::BF16,
        DType::F16 => S::F16,
        DType::F32 => S::F32,
        DType::F64 => S::F64,
        DType::F8E4m3 => S::F8_E4M3,
        DType::F8E5m2 => S::F8_E5M2,
        DType::I8 => S::I8,
        DType::I16 => S::I16,
        DType::I32 => S::I32,
        DType::I64 => S::I64,
        DType::U8 => S::U8,
        DType::Bool => S::BOOL,
    }
}

/// The dtype of a safetensors header dtype, `None` for the unsigned types reshard lacks.
pub fn dtype_from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
    DType::ALL
        .into_iter()
        .find(|d| safetensors_dtype(*d) == dtype)
}

/// `model_type` and `architectures[0]` of a model's family.
fn hf_names(model: &ModelConfig) -> (String, &'static str) {
    let arch = model
        .family()
        .map_or("LlamaForCausalLM", |f| f.architecture);
    (model.model_type().to_string(), arch)
}

/// `(first_k_dense_replace, moe_layer_freq)` whose dense layers (below `k`, or not a multiple of
/// the frequency) are exactly `dense`, when there is such a pair.
fn deepseek_pattern(dense: &[u64], layers: u64) -> (u64, u64) {
    let lead = dense
        .iter()
        .enumerate()
        .take_while(|(i, &l)| *i as u64 == l)
        .count() as u64;
    for f in 1..=layers.max(1) {
        let want: Vec<u64> = (0..layers).filter(|&l| l < lead || l % f != 0).collect();
        if want == dense {
            return (lead, f);
        }
    }
    (lead, 1)
}

/// The `config.json` object of a model, with the keys of its family.
pub fn to_hf_config(model: &ModelConfig) -> Value {
    let (model_type, arch) = hf_names(model);
    let fam = model.family().ok();
    let mut v = json!({
        "architectures": [arch],
        "model_type": model_type,
        "num_hidden_layers": model.layers,
        "hidden_size": model.hidden,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "intermediate_size": model.intermediate,
        "vocab_size": model.vocab,
        "tie_word_embeddings": model.tied_embeddings,
        "torch_dtype": torch_dtype(model.dtype),
        "rms_norm_eps": 1e-6,
        NAME_KEY: model.name,
    });
    let Some(obj) = v.as_object_mut() else {
        return v;
    };
    let mut put = |k: &str, x: Value| {
        obj.insert(k.into(), x);
    };
    if let Some(m) = &model.arch.mla {
        put("q_lora_rank", json!(m.q_lora_rank));
        put("kv_lora_rank", json!(m.kv_lora_rank));
        put("qk_nope_head_dim", json!(m.qk_nope_head_dim));
        put("qk_rope_head_dim", json!(m.qk_rope_head_dim));
        put("v_head_dim", json!(m.v_head_dim));
    } else {
        put("head_dim", json!(model.head_dim));
    }
    if let Some(b) = model.arch.fp8_block {
        put(
            "quantization_config",
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": b}),
        );
    }
    let Some(m) = &model.moe else {
        return v;
    };
    let top_k = m.experts.min(8);
    match fam.map_or(MoeKeys::None, |f| f.moe_keys) {
        MoeKeys::Qwen { shared } => {
            put("num_experts", json!(m.experts));
            put("moe_intermediate_size", json!(m.expert_intermediate));
            // Dense layers are listed; every other layer is MoE.
            put("decoder_sparse_step", json!(1));
            put("mlp_only_layers", json!(model.arch.dense_layers));
            put("num_experts_per_tok", json!(top_k));
            if shared {
                put(
                    "shared_expert_intermediate_size",
                    json!(model.arch.shared_intermediate),
                );
            }
        }
        MoeKeys::Mixtral => {
            put("num_local_experts", json!(m.experts));
            put("intermediate_size", json!(m.expert_intermediate));
            put("num_experts_per_tok", json!(top_k));
        }
        MoeKeys::DeepSeek => {
            let (k, f) = deepseek_pattern(&model.arch.dense_layers, model.layers);
            put("n_routed_experts", json!(m.experts));
            put("moe_intermediate_size", json!(m.expert_intermediate));
            let shared = model.arch.shared_intermediate / m.expert_intermediate.max(1);
            put("n_shared_experts", json!(shared));
            put("first_k_dense_replace", json!(k));
            put("moe_layer_freq", json!(f));
            put("num_experts_per_tok", json!(top_k));
            put("topk_method", json!("noaux_tc"));
        }
        MoeKeys::None => {}
    }
    v
}

/// The element type `config.json` declares: `dtype` (recent transformers) or `torch_dtype`;
/// `None` when it has neither (then the safetensors headers are the truth). Both present and
/// different, or an unknown name, is a `Config` error naming the key.
pub fn declared_dtype(v: &Value, label: &str) -> Result<Option<DType>> {
    let err = |m: String| Error::new(ErrorKind::Config, format!("{label}: {m}"));
    let mut found: Option<(&str, DType)> = None;
    for key in ["dtype", "torch_dtype"] {
        let s = match v.get(key) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => s.as_str(),
            Some(x) => return Err(err(format!("key {key:?} is {x}, expected a dtype name"))),
        };
        let d = dtype_from_torch(s.strip_prefix("torch.").unwrap_or(s))
            .ok_or_else(|| err(format!("unknown {key} {s:?}")))?;
        if let Some((k, prev)) = found {
            if prev != d {
                return Err(err(format!(
                    "key {k:?} says {} but key {key:?} says {}",
                    torch_dtype(prev),
                    torch_dtype(d)
                )));
            }
        }
        found = Some((key, d));
    }
    Ok(found.map(|(_, d)| d))
}

/// Parses a `config.json` object into a model of a known family (`model_type`); errors are
/// `Config` and name the key. Without a `dtype`/`torch_dtype` key the dtype is f32 until
/// [`reconcile_headers`] replaces it with what the tensors' headers say.
pub fn from_hf_config(v: &Value, label: &str) -> Result<ModelConfig> {
    let err = |m: String| Error::new(ErrorKind::Config, format!("{label}: {m}"));
    let obj: &Map<String, Value> = v
        .as_object()
        .ok_or_else(|| err("not a JSON object".into()))?;
    let opt_u64 = |k: &str| -> Result<Option<u64>> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .map(Some)
                .ok_or_else(|| err(format!("key {k:?} is {x}, expected an unsigned integer"))),
        }
    };
    let req_u64 =
        |k: &str| opt_u64(k)?.ok_or_else(|| err(format!("required key {k:?} is missing")));
    let model_type = obj
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| err("required key \"model_type\" is missing or not a string".into()))?;
    let fam = family(model_type).ok_or_else(|| {
        err(format!(
            "unknown model_type {model_type:?}; reshard has rules for: {}",
            model_types().join(", ")
        ))
    })?;
    let layers = req_u64("num_hidden_layers")?;
    let hidden = req_u64("hidden_size")?;
    let heads = req_u64("num_attention_heads")?;
    // Hugging Face defaults: KV heads to query heads (no GQA), head size to hidden / heads.
    let kv_heads = opt_u64("num_key_value_heads")?.unwrap_or(heads);
    let mla = if fam.mla {
        Some(MlaConfig {
            q_lora_rank: opt_u64("q_lora_rank")?,
            kv_lora_rank: req_u64("kv_lora_rank")?,
            qk_nope_head_dim: req_u64("qk_nope_head_dim")?,
            qk_rope_head_dim: req_u64("qk_rope_head_dim")?,
            v_head_dim: req_u64("v_head_dim")?,
        })
    } else {
        None
    };
    let head_dim = match (&mla, opt_u64("head_dim")?) {
        (Some(m), _) => m.qk_nope_head_dim.saturating_add(m.qk_rope_head_dim),
        (None, Some(h)) => h,
        (None, None) if heads > 0 => hidden / heads,
        (None, None) => 0,
    };
    let layer_list = |k: &str| -> Result<Vec<u64>> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64().filter(|&l| l < layers).ok_or_else(|| {
                        err(format!(
                            "key {k:?} holds {x}, expected layer indices below {layers}"
                        ))
                    })
                })
                .collect(),
            Some(x) => Err(err(format!("key {k:?} is {x}, expected a list of layers"))),
        }
    };
    let step_of = |k: &str| -> Result<u64> {
        match opt_u64(k)? {
            None => Ok(1),
            Some(0) => Err(err(format!("key {k:?} must not be zero"))),
            Some(s) => Ok(s),
        }
    };
    // transformers 5 writes a Qwen MoE config's expert count as "num_local_experts" (its config
    // classes map the attribute `num_experts` onto that key), earlier versions and published
    // checkpoints as "num_experts": either is the count, and without both the model is dense.
    let qwen_experts = |opt: &dyn Fn(&str) -> Result<Option<u64>>| -> Result<Option<u64>> {
        match (opt("num_experts")?, opt("num_local_experts")?) {
            (Some(a), Some(b)) if a != b => Err(err(format!(
                "key \"num_experts\" is {a} but key \"num_local_experts\" is {b}; \
                 they name the same expert count"
            ))),
            (a, b) => Ok(a.or(b)),
        }
    };
    let mut intermediate = opt_u64("intermediate_size")?.unwrap_or(0);
    let mut shared_intermediate = 0;
    // Which layers are MoE follows vLLM's model code for each family (docs/models.md).
    let (moe, dense_layers) = match fam.moe_keys {
        MoeKeys::None => (None, Vec::new()),
        MoeKeys::Qwen { shared } => match qwen_experts(&opt_u64)? {
            Some(e) if e > 0 => {
                let step = step_of("decoder_sparse_step")?;
                let only = layer_list("mlp_only_layers")?;
                let dense: Vec<u64> = (0..layers.min(MAX_LAYERS + 1))
                    .filter(|l| only.contains(l) || (l + 1) % step != 0)
                    .collect();
                if shared {
                    shared_intermediate = opt_u64("shared_expert_intermediate_size")?.unwrap_or(0);
                }
                let m = MoeConfig {
                    experts: e,
                    expert_intermediate: req_u64("moe_intermediate_size")?,
                };
                (Some(m), dense)
            }
            _ => (None, Vec::new()),
        },
        MoeKeys::Mixtral => {
            let m = MoeConfig {
                experts: req_u64("num_local_experts")?,
                expert_intermediate: req_u64("intermediate_size")?,
            };
            (Some(m), Vec::new())
        }
        MoeKeys::DeepSeek => match opt_u64("n_routed_experts")? {
            Some(e) if e > 0 => {
                let k = opt_u64("first_k_dense_replace")?.unwrap_or(0);
                let f = step_of("moe_layer_freq")?;
                let dense: Vec<u64> = (0..layers.min(MAX_LAYERS + 1))
                    .filter(|&l| l < k || l % f != 0)
                    .collect();
                let ei = req_u64("moe_intermediate_size")?;
                shared_intermediate = opt_u64("n_shared_experts")?
                    .unwrap_or(0)
                    .checked_mul(ei)
                    .ok_or_else(|| {
                        err("n_shared_experts x moe_intermediate_size overflows".into())
                    })?;
                let m = MoeConfig {
                    experts: e,
                    expert_intermediate: ei,
                };
                (Some(m), dense)
            }
            _ => (None, Vec::new()),
        },
    };
    if moe.is_none() || !dense_layers.is_empty() {
        intermediate = req_u64("intermediate_size")?;
    }
    let tied_embeddings = match obj.get("tie_word_embeddings") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(x) => {
            return Err(err(format!(
                "key \"tie_word_embeddings\" is {x}, expected a bool"
            )))
        }
    };
    // Hugging Face falls back to float32 when neither key is there; a checkpoint's headers
    // then decide (reconcile_headers).
    let dtype = declared_dtype(v, label)?.unwrap_or(DType::F32);
    let fp8_block = match obj.get("quantization_config") {
        None | Some(Value::Null) => None,
        Some(q) => {
            let method = q.get("quant_method").and_then(Value::as_str);
            let block = q
                .get("weight_block_size")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).collect::<Vec<_>>());
            match (method, block.as_deref()) {
                (Some("fp8"), Some(&[a, b])) => Some([a, b]),
                _ => {
                    return Err(err(format!(
                        "quantization_config {q} is not supported: reshard passes fp8 \
                         checkpoints with a 2-element weight_block_size through"
                    )))
                }
            }
        }
    };
    let name = obj
        .get(NAME_KEY)
        .and_then(Value::as_str)
        .unwrap_or(model_type)
        .to_string();
    let model = ModelConfig {
        name,
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        moe,
        vocab: req_u64("vocab_size")?,
        tied_embeddings,
        qk_norm: fam.qk_norm,
        dtype,
        arch: Box::new(Arch {
            model_type: model_type.to_string(),
            dense_layers,
            shared_intermediate,
            mla,
            dtypes: Default::default(),
            fp8_block,
        }),
    };
    // The key this file gave the expert count under, for the messages below.
    let experts_key = match fam.moe_keys {
        MoeKeys::Mixtral => "num_local_experts",
        MoeKeys::DeepSeek => "n_routed_experts",
        MoeKeys::Qwen { .. } if !obj.contains_key("num_experts") => "num_local_experts",
        _ => "num_experts",
    };
    // The bounds first, named by the keys of this file (validate names the model's fields).
    if let Some(b) = model.out_of_bounds() {
        let what = match b.field {
            "layers" => "key \"num_hidden_layers\"",
            "experts" => &format!("key {experts_key:?}"),
            "tensors" => {
                &format!("the tensor count (from \"num_hidden_layers\" and {experts_key:?})")
            }
            _ => "the total size in bytes (from the dimensions and \"torch_dtype\")",
        };
        let is = if b.value == u64::MAX {
            "overflows u64".to_string()
        } else {
            format!("is {}", b.value)
        };
        return Err(err(format!(
            "{what} {is}, above the {} reshard accepts",
            b.limit
        )));
    }
    model.validate().map_err(|e| err(e.message().to_string()))?;
    Ok(model)
}

/// Tensors models keep in float32 whatever dtype config.json declares: DeepSeek-V3's (and
/// Kimi-K2's) router score-correction bias, which its checkpoints store and vLLM holds in
/// float32 (docs/models.md).
const KEPT_IN_F32: &[&str] = &["mlp.gate.e_score_correction_bias"];

/// Reconciles a model read from `config.json` with its checkpoint's tensors (name, header
/// dtype, shape): every tensor must fit a rule of the model's family (else a `Config` error
/// naming it); with a declared dtype (`declared`), a float tensor whose header dtype differs is
/// a `Config` error naming it (under an fp8 `quantization_config`, linear weights are
/// `float8_e4m3fn`, their scales f32, and other tensors may be f32; [`KEPT_IN_F32`] tensors may
/// be f32 in any model); without one, the headers are
/// the truth: the model's dtype becomes the embedding's, and rules whose tensors differ get
/// their own. Shapes and the set of tensors are checked by the caller against the result.
pub fn reconcile_headers(
    mut model: ModelConfig,
    declared: Option<DType>,
    headers: &[(&TensorSpec, &str)],
) -> Result<ModelConfig> {
    let fam = model.family()?;
    let cfg = |m: String, t: &str| Error::new(ErrorKind::Config, m).with_tensor(t);
    let mut seen: Vec<(usize, bool, DType, &str)> = Vec::new();
    // In name order, so the tensor an error names does not depend on the caller's order.
    let mut headers = headers.to_vec();
    headers.sort_by(|a, b| a.0.name.cmp(&b.0.name));
    for (h, file) in headers {
        let Some((rule, _, _, scale)) = match_tensor(fam, &model, &h.name) else {
            return Err(cfg(
                format!(
                    "unexpected tensor {} in shard file {file}: it fits no rule of model_type \
                     {:?} with the layers and experts of config.json (docs/models.md lists \
                     the rules)",
                    h.name,
                    model.model_type()
                ),
                &h.name,
            ));
        };
        let r = &fam.rules[rule];
        if scale && !model.has_scale(r) {
            return Err(cfg(
                format!(
                    "tensor {} in shard file {file} is an fp8 scale but config.json has no fp8 \
                     quantization_config",
                    h.name
                ),
                &h.name,
            ));
        }
        if let Some(d) = declared {
            let fp8 = model.arch.fp8_block.is_some();
            let ok = if scale {
                h.dtype == DType::F32
            } else if fp8 && r.quant {
                h.dtype == DType::F8E4m3
            } else {
                let kept_f32 = KEPT_IN_F32.iter().any(|k| h.name.ends_with(k));
                h.dtype == d || ((fp8 || kept_f32) && h.dtype == DType::F32)
            };
            if !ok {
                let want = match (scale, fp8 && r.quant) {
                    (true, _) => DType::F32,
                    (false, true) => DType::F8E4m3,
                    _ => d,
                };
                return Err(cfg(
                    format!(
                        "tensor {} in shard file {file} has dtype {} in its safetensors header \
                         but config.json declares {}",
                        h.name,
                        torch_dtype(h.dtype),
                        torch_dtype(want)
                    ),
                    &h.name,
                ));
            }
        }
        if !scale {
            match seen.iter().find(|s| s.0 == rule) {
                Some(&(_, _, d, first)) if d != h.dtype => {
                    return Err(cfg(
                        format!(
                            "tensor {} in shard file {file} has dtype {} but {first} of the same \
                             rule has {}",
                            h.name,
                            torch_dtype(h.dtype),
                            torch_dtype(d)
                        ),
                        &h.name,
                    ))
                }
                Some(_) => {}
                None => seen.push((rule, scale, h.dtype, &h.name)),
            }
        }
    }
    model.dtype = match declared {
        Some(d) => d,
        // The embedding's dtype, else the first tensor's.
        None => seen
            .iter()
            .find(|s| fam.rules[s.0].name == "model.embed_tokens.weight")
            .or(seen.first())
            .map_or(model.dtype, |s| s.2),
    };
    model.arch.dtypes.clear();
    for &(rule, _, d, _) in &seen {
        let r = &fam.rules[rule];
        if model.rule_dtype(r, false) != d {
            model.arch.dtypes.insert(r.name.to_string(), d);
        }
    }
    Ok(model)
}

/// Reads and parses `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    Ok(read_config_declared(dir)?.0)
}

/// Reads and parses `dir/config.json`, with the dtype it declares ([`declared_dtype`]).
pub fn read_config_declared(dir: &Path) -> Result<(ModelConfig, Option<DType>)> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read(&path).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("cannot read {}: {e}", path.display()),
        )
        .with_source(e)
    })?;
    let v: Value = serde_json::from_slice(&text).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("{} is not valid JSON: {e}", path.display()),
        )
    })?;
    let label = path.display().to_string();
    Ok((from_hf_config(&v, &label)?, declared_dtype(&v, &label)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_planner::presets::{preset, presets};

    #[test]
    fn every_preset_round_trips_through_config_json() {
        for p in presets() {
            let v = to_hf_config(&p.config);
            assert_eq!(from_hf_config(&v, "t").unwrap(), p.config, "{}", p.name);
        }
        let q = to_hf_config(&preset("qwen3-30b-a3b").unwrap());
        assert_eq!(q["model_type"], "qwen3_moe");
        assert_eq!(q["architectures"][0], "Qwen3MoeForCausalLM");
        assert_eq!(q["torch_dtype"], "bfloat16");
        let l = to_hf_config(&preset("llama-3-8b").unwrap());
        assert_eq!(l["model_type"], "llama");
        assert!(l.get("num_experts").is_none());
    }

    #[test]
    fn hf_defaults_and_missing_keys() {
        // A Llama config as Meta publishes it: no head_dim key.
        let v = json!({
            "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
            "vocab_size": 128256, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
        });
        let m = from_hf_config(&v, "t").unwrap();
        assert_eq!(m.head_dim, 128);
        assert!(!m.qk_norm && m.moe.is_none());
        let mut bad = v.clone();
        bad.as_object_mut().unwrap().remove("vocab_size");
        let e = from_hf_config(&bad, "t").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("vocab_size"), "{e}");
    }

    /// The config: 10^12 layers of a model a few hundred bytes wide.
    fn absurd() -> Value {
        json!({
            "model_type": "llama", "hidden_size": 8, "num_attention_heads": 1,
            "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 1_000_000_000_000u64,
            "intermediate_size": 8, "vocab_size": 64, "torch_dtype": "bfloat16"
        })
    }

    #[test]
    fn counts_above_the_bounds_are_refused_naming_the_key() {
        let e = from_hf_config(&absurd(), "t").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message()
                .contains("\"num_hidden_layers\" is 1000000000000"),
            "{e}"
        );
        let mut v = to_hf_config(&preset("qwen3-30b-a3b").unwrap());
        v["num_experts"] = json!(1u64 << 40);
        let e = from_hf_config(&v, "t").unwrap_err();
        assert!(e.message().contains("\"num_experts\""), "{e}");
        v["num_experts"] = json!(16_384);
        let e = from_hf_config(&v, "t").unwrap_err();
        assert!(e.message().contains("tensor count"), "{e}");
        v["num_experts"] = json!(128);
        v["vocab_size"] = json!(u64::MAX / 4);
        let e = from_hf_config(&v, "t").unwrap_err();
        assert!(e.message().contains("total size in bytes"), "{e}");
    }

    /// config.json of the tiny Qwen3-MoE model transformers 5.19's `save_pretrained` writes
    /// (python/tests/vllm/tiny_models.py), keys that carry no shape left out.
    fn transformers5_qwen3_moe() -> Value {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "decoder_sparse_step": 1, "dtype": "bfloat16", "head_dim": 64, "hidden_size": 256,
            "intermediate_size": 512, "mlp_only_layers": [], "moe_intermediate_size": 128,
            "norm_topk_prob": true, "num_attention_heads": 4, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": false, "transformers_version": "5.19.0", "vocab_size": 512
        })
    }

    #[test]
    fn qwen_moe_expert_count_under_either_key() {
        // transformers 5 says "num_local_experts": the model is MoE, every layer sparse.
        let v = transformers5_qwen3_moe();
        let m = from_hf_config(&v, "t").unwrap();
        let moe = m
            .moe
            .as_ref()
            .expect("a num_local_experts config parsed as dense");
        assert_eq!((moe.experts, moe.expert_intermediate), (4, 128));
        assert!(m.arch.dense_layers.is_empty(), "{:?}", m.arch.dense_layers);
        assert!(m.qk_norm);
        // The same count under the older key, or under both, is the same model.
        let mut old = v.clone();
        let n = old
            .as_object_mut()
            .unwrap()
            .remove("num_local_experts")
            .unwrap();
        old["num_experts"] = n;
        assert_eq!(from_hf_config(&old, "t").unwrap(), m);
        let mut both = old.clone();
        both["num_local_experts"] = json!(4);
        assert_eq!(from_hf_config(&both, "t").unwrap(), m);
        // Two different counts: which one is meant cannot be told, so neither is taken.
        both["num_local_experts"] = json!(8);
        let e = from_hf_config(&both, "t").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().contains("\"num_experts\" is 4")
                && e.message().contains("\"num_local_experts\" is 8"),
            "{e}"
        );
        // qwen2_moe's classes map the key the same way.
        let mut q2 = v.clone();
        q2["model_type"] = json!("qwen2_moe");
        q2["shared_expert_intermediate_size"] = json!(256);
        let m2 = from_hf_config(&q2, "t").unwrap();
        assert_eq!(m2.moe.as_ref().map(|m| m.experts), Some(4));
        assert_eq!(m2.arch.shared_intermediate, 256);
        // A bound exceeded names the key the file used.
        let mut big = v.clone();
        big["num_local_experts"] = json!(1u64 << 40);
        let e = from_hf_config(&big, "t").unwrap_err();
        assert!(e.message().contains("key \"num_local_experts\""), "{e}");
    }

    #[test]
    fn transformers5_dense_configs_parse() {
        // What transformers 5.19 writes for llama and qwen2 (tiny_models.py): "dtype" instead of
        // "torch_dtype", "rope_parameters" instead of "rope_theta" (not a shape: ignored),
        // qwen2 without "head_dim".
        let llama = json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "attention_bias": false, "dtype": "bfloat16", "head_dim": 64, "hidden_size": 256,
            "intermediate_size": 512, "mlp_bias": false, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": false, "vocab_size": 512
        });
        let mut qwen2 = llama.clone();
        let o = qwen2.as_object_mut().unwrap();
        for k in ["attention_bias", "mlp_bias", "head_dim"] {
            o.remove(k);
        }
        o.insert("model_type".into(), json!("qwen2"));
        o.insert(
            "layer_types".into(),
            json!(["full_attention", "full_attention"]),
        );
        for (v, t) in [(llama, "llama"), (qwen2, "qwen2")] {
            let m = from_hf_config(&v, "t").unwrap();
            assert_eq!(m.model_type(), t);
            assert_eq!((m.layers, m.hidden, m.heads, m.kv_heads), (2, 256, 4, 2));
            assert_eq!((m.head_dim, m.intermediate, m.vocab), (64, 512, 512));
            assert_eq!(m.dtype, DType::Bf16);
            assert!(m.moe.is_none() && !m.tied_embeddings && !m.qk_norm, "{t}");
        }
    }

    #[test]
    fn dtype_names_are_a_bijection() {
        for d in DType::ALL {
            assert_eq!(dtype_from_torch(torch_dtype(d)), Some(d));
            assert_eq!(dtype_from_safetensors(safetensors_dtype(d)), Some(d));
        }
        assert_eq!(dtype_from_safetensors(safetensors::Dtype::U16), None);
    }
}
