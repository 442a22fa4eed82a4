//! `config.json` in Hugging Face form, to and from [`ModelConfig`], and dtype names.
//!
//! Reading accepts the keys real Hugging Face configs use (Llama, Qwen3, Qwen3-MoE), with their
//! defaults where a key is optional, so a downloaded checkpoint opens as well as a written one.

use std::path::Path;

use serde_json::{json, Map, Value};

use reshard_core::{DType, Error, ErrorKind, Result};
use reshard_planner::presets::{ModelConfig, MoeConfig};

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

/// `model_type` and `architectures[0]` for a model: Qwen3 names need q/k norms, since that is
/// what tells a Qwen3 apart from a Llama in Hugging Face's own code.
fn hf_names(model: &ModelConfig) -> (&'static str, &'static str) {
    match (model.moe.is_some(), model.qk_norm) {
        (true, true) => ("qwen3_moe", "Qwen3MoeForCausalLM"),
        (false, true) => ("qwen3", "Qwen3ForCausalLM"),
        _ => ("llama", "LlamaForCausalLM"),
    }
}

/// The `config.json` object of a model.
pub fn to_hf_config(model: &ModelConfig) -> Value {
    let (model_type, arch) = hf_names(model);
    let mut v = json!({
        "architectures": [arch],
        "model_type": model_type,
        "num_hidden_layers": model.layers,
        "hidden_size": model.hidden,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.intermediate,
        "vocab_size": model.vocab,
        "tie_word_embeddings": model.tied_embeddings,
        "torch_dtype": torch_dtype(model.dtype),
        "rms_norm_eps": 1e-6,
        NAME_KEY: model.name,
    });
    if let (Some(m), Some(obj)) = (&model.moe, v.as_object_mut()) {
        obj.insert("num_experts".into(), json!(m.experts));
        obj.insert("moe_intermediate_size".into(), json!(m.expert_intermediate));
        // Every layer is MoE (what `ModelConfig::tensors` assumes); say so the way Qwen3-MoE does.
        obj.insert("decoder_sparse_step".into(), json!(1));
        obj.insert("mlp_only_layers".into(), json!([]));
        obj.insert("num_experts_per_tok".into(), json!(m.experts.min(8)));
    }
    v
}

/// Parses a `config.json` object into a model; errors are `Config` and name the key.
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
    let hidden = req_u64("hidden_size")?;
    let heads = req_u64("num_attention_heads")?;
    // Hugging Face defaults: KV heads to query heads (no GQA), head size to hidden / heads.
    let kv_heads = opt_u64("num_key_value_heads")?.unwrap_or(heads);
    let head_dim = match opt_u64("head_dim")? {
        Some(h) => h,
        None if heads > 0 => hidden / heads,
        None => 0,
    };
    let moe = match opt_u64("num_experts")? {
        Some(e) if e > 0 => {
            // `tensors()` puts a MoE block in every layer; a config with dense layers in between
            // would name tensors it does not have, so refuse it here with the reason.
            if opt_u64("decoder_sparse_step")?.is_some_and(|s| s != 1) {
                return Err(err(
                    "decoder_sparse_step other than 1 is not supported".into()
                ));
            }
            if obj
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
            {
                return Err(err("non-empty mlp_only_layers is not supported".into()));
            }
            Some(MoeConfig {
                experts: e,
                expert_intermediate: req_u64("moe_intermediate_size")?,
            })
        }
        _ => None,
    };
    let intermediate = match &moe {
        Some(_) => opt_u64("intermediate_size")?.unwrap_or(0),
        None => req_u64("intermediate_size")?,
    };
    let tied_embeddings = match obj.get("tie_word_embeddings") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(x) => {
            return Err(err(format!(
                "key \"tie_word_embeddings\" is {x}, expected a bool"
            )))
        }
    };
    let dtype = match obj.get("torch_dtype").and_then(Value::as_str) {
        // Hugging Face falls back to float32 when the key is absent.
        None => DType::F32,
        Some(s) => dtype_from_torch(s).ok_or_else(|| err(format!("unknown torch_dtype {s:?}")))?,
    };
    let name = obj
        .get(NAME_KEY)
        .and_then(Value::as_str)
        .unwrap_or(model_type)
        .to_string();
    let model = ModelConfig {
        name,
        layers: req_u64("num_hidden_layers")?,
        hidden,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        moe,
        vocab: req_u64("vocab_size")?,
        tied_embeddings,
        qk_norm: model_type.starts_with("qwen3"),
        dtype,
    };
    // The bounds first, named by the keys of this file (validate names the model's fields).
    if let Some(b) = model.out_of_bounds() {
        let what = match b.field {
            "layers" => "key \"num_hidden_layers\"",
            "experts" => "key \"num_experts\"",
            "tensors" => "the tensor count (from \"num_hidden_layers\" and \"num_experts\")",
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

/// Reads and parses `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
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
    from_hf_config(&v, &path.display().to_string())
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

    #[test]
    fn dtype_names_are_a_bijection() {
        for d in DType::ALL {
            assert_eq!(dtype_from_torch(torch_dtype(d)), Some(d));
            assert_eq!(dtype_from_safetensors(safetensors_dtype(d)), Some(d));
        }
        assert_eq!(dtype_from_safetensors(safetensors::Dtype::U16), None);
    }
}
