"""Tiny checkpoints written the way Hugging Face writes them (issue 31, item 3).

Every family reshard is meant to refit (docs/hf-checkpoint-tests.md): llama, qwen2 (q/k/v
biases), qwen2_moe (shared expert and its gate), qwen3, qwen3_moe (also with `mlp_only_layers`
and `decoder_sparse_step`), mixtral (`block_sparse_moe.experts.N.w1/w2/w3`), deepseek_v3 (MLA,
shared experts, dense first layers, router bias) and tied embeddings. Tensor names and
`config.json` keys are those of the families' published checkpoints and of transformers'
configuration classes; the sizes are scaled down so a checkpoint is a few hundred KiB.

Files are written by Hugging Face's `safetensors` package as transformers writes them:
`{"format": "pt"}` metadata in every file, one `model.safetensors`, or
`model-0000i-of-0000N.safetensors` shards in module order with a `model.safetensors.index.json`
(`metadata.total_size` in tensor bytes, `weight_map` with sorted keys) and `config.json` with
sorted keys. A file with only numpy dtypes goes through `safetensors.numpy.save_file`; numpy has
no bfloat16, so a file holding bf16 tensors goes through `safetensors.serialize_file`, the
serializer `save_file` itself calls, with each bf16 tensor described by a `TensorSpec` of dtype
"bfloat16" over its bits (uint16), as `safetensors.torch` describes a torch bf16 tensor. No
header is written by hand.

A checkpoint is `Checkpoint(config, tensors)`: `tensors` maps each HF name to
`(dtype, array)`, with `dtype` the torch name ("bfloat16", "float16", "float32") and `array` the
values (bf16 as uint16 bit patterns). The reference (vllm_reference.py) reads these, never the
files, so a writer bug and a reader bug cannot cancel out: the files are read back and compared
with `tensors` by `write` itself.
"""

import json
import os
import zlib
from dataclasses import dataclass, field

import numpy as np
import safetensors
import safetensors.numpy

# numpy dtype of each torch dtype name, as the bytes are held here (bf16 as its bits).
NUMPY = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}


@dataclass
class Checkpoint:
    """One model: its `config.json` object and its tensors by HF name (see the module doc)."""

    config: dict
    tensors: dict = field(default_factory=dict)

    @property
    def model_type(self):
        """The config's `model_type`."""
        return self.config["model_type"]


class _Values:
    """Random tensor values, reproducible per (model, tensor name)."""

    def __init__(self, label, dtype):
        self.label, self.dtype = label, dtype

    def __call__(self, name, shape, dtype=None):
        dtype = dtype or self.dtype
        seed = zlib.crc32(f"{self.label}/{name}".encode())
        f = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.05
        if dtype == "bfloat16":
            # bf16 is the top half of an f32: random values, as a trainer's bits would be.
            return dtype, (f.view(np.uint32) >> 16).astype(np.uint16)
        return dtype, f.astype(NUMPY[dtype])


def _dtype_keys(config, dtype, dtype_key):
    """`torch_dtype` (transformers before 4.56) or `dtype` (newer), with the matching version."""
    if dtype_key == "torch_dtype":
        config.update(torch_dtype=dtype, transformers_version="4.51.3")
    else:
        config.update(dtype=dtype, transformers_version="4.57.1")
    return config


def _attention(t, v, p, c, bias):
    """q/k/v/o of a GQA layer; q/k/v biases where the family has them (Qwen2)."""
    h, n, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // n
    for proj, rows in (("q_proj", n * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        t[f"{p}.self_attn.{proj}.weight"] = v(f"{p}.{proj}.w", (rows, h))
        if bias:
            t[f"{p}.self_attn.{proj}.bias"] = v(f"{p}.{proj}.b", (rows,))
    t[f"{p}.self_attn.o_proj.weight"] = v(f"{p}.o_proj", (h, n * hd))


def _mlp(t, v, prefix, h, inter, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    t[f"{prefix}.{gate}.weight"] = v(f"{prefix}.{gate}", (inter, h))
    t[f"{prefix}.{up}.weight"] = v(f"{prefix}.{up}", (inter, h))
    t[f"{prefix}.{down}.weight"] = v(f"{prefix}.{down}", (h, inter))


def _norms(t, v, p, h):
    t[f"{p}.input_layernorm.weight"] = v(f"{p}.in_norm", (h,))
    t[f"{p}.post_attention_layernorm.weight"] = v(f"{p}.post_norm", (h,))


def _ends(t, v, c):
    """Embedding first, final norm and (untied) `lm_head` last, as in a state dict."""
    h, vocab = c["hidden_size"], c["vocab_size"]
    t["model.norm.weight"] = v("norm", (h,))
    if not c.get("tie_word_embeddings", False):
        t["lm_head.weight"] = v("lm_head", (vocab, h))


def qwen2_moe_sparse(c, layer):
    """Whether `layer` is a MoE layer in a Qwen2-MoE / Qwen3-MoE config (their modeling code's
    rule: not in `mlp_only_layers`, experts present, and `(layer + 1) % decoder_sparse_step`)."""
    return (layer not in c.get("mlp_only_layers", []) and c.get("num_experts", 0) > 0
            and (layer + 1) % c.get("decoder_sparse_step", 1) == 0)


def llama(label, dtype="bfloat16", dtype_key="torch_dtype", tied=False, vocab=256, layers=2):
    """Llama 3 (Llama-3.1-8B's config keys; Llama-3.2-1B's `head_dim` and tied embeddings)."""
    c = _dtype_keys({
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 16, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 4, "num_hidden_layers": layers, "num_key_value_heads": 2,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": tied, "use_cache": True,
        "vocab_size": vocab,
    }, dtype, dtype_key)
    v, t = _Values(label, dtype), {}
    t["model.embed_tokens.weight"] = v("embed", (vocab, 64))
    for i in range(layers):
        p = f"model.layers.{i}"
        _attention(t, v, p, c, bias=False)
        _mlp(t, v, f"{p}.mlp", 64, 96)
        _norms(t, v, p, 64)
    _ends(t, v, c)
    return Checkpoint(c, t)


def qwen2(label, dtype="bfloat16", dtype_key="torch_dtype", tied=False, layers=2):
    """Qwen2 / Qwen2.5 (Qwen2.5-7B's keys): q/k/v with biases, no `head_dim` key."""
    c = _dtype_keys({
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 131072, "max_window_layers": layers, "model_type": "qwen2",
        "num_attention_heads": 4, "num_hidden_layers": layers, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": 131072, "tie_word_embeddings": tied, "use_cache": True,
        "use_sliding_window": False, "vocab_size": 256,
    }, dtype, dtype_key)
    v, t = _Values(label, dtype), {}
    t["model.embed_tokens.weight"] = v("embed", (256, 64))
    for i in range(layers):
        p = f"model.layers.{i}"
        _attention(t, v, p, c, bias=True)
        _mlp(t, v, f"{p}.mlp", 64, 96)
        _norms(t, v, p, 64)
    _ends(t, v, c)
    return Checkpoint(c, t)


def qwen2_moe(label, dtype="bfloat16", dtype_key="torch_dtype", layers=2):
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B's keys): q/k/v biases, 4 routed experts, one shared expert
    with its sigmoid gate `shared_expert_gate` ([1, hidden])."""
    c = _dtype_keys({
        "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151643,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "max_position_embeddings": 8192, "max_window_layers": layers,
        "model_type": "qwen2_moe", "moe_intermediate_size": 32, "norm_topk_prob": False,
        "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": layers, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 48, "sliding_window": 32768,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
        "vocab_size": 256,
    }, dtype, dtype_key)
    v, t = _Values(label, dtype), {}
    t["model.embed_tokens.weight"] = v("embed", (256, 64))
    for i in range(layers):
        p = f"model.layers.{i}"
        _attention(t, v, p, c, bias=True)
        if qwen2_moe_sparse(c, i):
            t[f"{p}.mlp.gate.weight"] = v(f"{p}.gate", (4, 64))
            for e in range(4):
                _mlp(t, v, f"{p}.mlp.experts.{e}", 64, 32)
            _mlp(t, v, f"{p}.mlp.shared_expert", 64, 48)
            t[f"{p}.mlp.shared_expert_gate.weight"] = v(f"{p}.shared_gate", (1, 64))
        else:
            _mlp(t, v, f"{p}.mlp", 64, 96)
        _norms(t, v, p, 64)
    _ends(t, v, c)
    return Checkpoint(c, t)


def qwen3(label, dtype="bfloat16", dtype_key="torch_dtype", tied=False, layers=2):
    """Qwen3 (Qwen3-8B's keys; Qwen3-0.6B's tied embeddings): per-head q/k norms."""
    c = _dtype_keys({
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "max_position_embeddings": 40960, "max_window_layers": layers,
        "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": layers,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": tied,
        "use_cache": True, "use_sliding_window": False, "vocab_size": 256,
    }, dtype, dtype_key)
    v, t = _Values(label, dtype), {}
    t["model.embed_tokens.weight"] = v("embed", (256, 64))
    for i in range(layers):
        p = f"model.layers.{i}"
        _attention(t, v, p, c, bias=False)
        t[f"{p}.self_attn.q_norm.weight"] = v(f"{p}.q_norm", (16,))
        t[f"{p}.self_attn.k_norm.weight"] = v(f"{p}.k_norm", (16,))
        _mlp(t, v, f"{p}.mlp", 64, 96)
        _norms(t, v, p, 64)
    _ends(t, v, c)
    return Checkpoint(c, t)


def qwen3_moe(label, dtype="bfloat16", dtype_key="torch_dtype", layers=2,
              mlp_only_layers=(), decoder_sparse_step=1):
    """Qwen3-MoE (Qwen3-30B-A3B's keys): 4 experts, q/k norms; dense layers where
    `mlp_only_layers` / `decoder_sparse_step` say so."""
    c = _dtype_keys({
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": decoder_sparse_step, "eos_token_id": 151645, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "max_position_embeddings": 40960, "max_window_layers": layers,
        "mlp_only_layers": list(mlp_only_layers), "model_type": "qwen3_moe",
        "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": layers,
        "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": 256,
    }, dtype, dtype_key)
    v, t = _Values(label, dtype), {}
    t["model.embed_tokens.weight"] = v("embed", (256, 64))
    for i in range(layers):
        p = f"model.layers.{i}"
        _attention(t, v, p, c, bias=False)
        t[f"{p}.self_attn.q_norm.weight"] = v(f"{p}.q_norm", (16,))
        t[f"{p}.self_attn.k_norm.weight"] = v(f"{p}.k_norm", (16,))
        if qwen2_moe_sparse(c, i):
            t[f"{p}.mlp.gate.weight"] = v(f"{p}.gate", (4, 64))
            for e in range(4):
                _mlp(t, v, f"{p}.mlp.experts.{e}", 64, 32)
        else:
            _mlp(t, v, f"{p}.mlp", 64, 96)
        _norms(t, v, p, 64)
    _ends(t, v, c)
    return Checkpoint(c, t)


def mixtral(label, dtype="bfloat16", dtype_key="torch_dtype", layers=2):
    """Mixtral (Mixtral-8x7B's keys): `block_sparse_moe` with `w1` (gate), `w3` (up), `w2`
    (down) per expert and `intermediate_size` the expert width; no `head_dim` key."""
    c = _dtype_keys({
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 32, "max_position_embeddings": 32768, "model_type": "mixtral",
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": layers,
        "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": 256,
    }, dtype, dtype_key)
    v, t = _Values(label, dtype), {}
    t["model.embed_tokens.weight"] = v("embed", (256, 64))
    for i in range(layers):
        p = f"model.layers.{i}"
        _attention(t, v, p, c, bias=False)
        t[f"{p}.block_sparse_moe.gate.weight"] = v(f"{p}.gate", (4, 64))
        for e in range(4):
            _mlp(t, v, f"{p}.block_sparse_moe.experts.{e}", 64, 32, names=("w1", "w3", "w2"))
        _norms(t, v, p, 64)
    _ends(t, v, c)
    return Checkpoint(c, t)


def deepseek_v3(label, dtype="bfloat16", dtype_key="torch_dtype", layers=3,
                model_type="deepseek_v3"):
    """DeepSeek-V3 / Kimi-K2 (`deepseek_v3`; Kimi-K2's `n_group` 1 and no MTP layer): MLA
    attention (`q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`/`kv_a_layernorm`/
    `kv_b_proj`), `first_k_dense_replace` dense layers, then 4 routed experts, one shared
    expert, and the router bias `e_score_correction_bias` (float32 in the real checkpoints,
    whatever the weights' dtype). Kimi-K2's own config says `model_type` "kimi_k2"."""
    h, heads, q_rank, kv_rank, nope, rope, vd = 64, 4, 32, 16, 16, 8, 16
    c = _dtype_keys({
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 163584, "eos_token_id": 163585,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": h,
        "initializer_range": 0.02, "intermediate_size": 96, "kv_lora_rank": kv_rank,
        "max_position_embeddings": 131072, "model_type": model_type,
        "moe_intermediate_size": 32, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 4,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": heads,
        "num_experts_per_tok": 2, "num_hidden_layers": layers, "num_key_value_heads": heads,
        "num_nextn_predict_layers": 0, "q_lora_rank": q_rank, "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
        "use_cache": True, "v_head_dim": vd, "vocab_size": 256,
    }, dtype, dtype_key)
    v, t = _Values(label, dtype), {}
    t["model.embed_tokens.weight"] = v("embed", (256, h))
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        t[f"{a}.q_a_proj.weight"] = v(f"{a}.q_a", (q_rank, h))
        t[f"{a}.q_a_layernorm.weight"] = v(f"{a}.q_a_norm", (q_rank,))
        t[f"{a}.q_b_proj.weight"] = v(f"{a}.q_b", (heads * (nope + rope), q_rank))
        t[f"{a}.kv_a_proj_with_mqa.weight"] = v(f"{a}.kv_a", (kv_rank + rope, h))
        t[f"{a}.kv_a_layernorm.weight"] = v(f"{a}.kv_a_norm", (kv_rank,))
        t[f"{a}.kv_b_proj.weight"] = v(f"{a}.kv_b", (heads * (nope + vd), kv_rank))
        t[f"{a}.o_proj.weight"] = v(f"{a}.o", (h, heads * vd))
        if i >= c["first_k_dense_replace"]:
            t[f"{p}.mlp.gate.weight"] = v(f"{p}.gate", (4, h))
            t[f"{p}.mlp.gate.e_score_correction_bias"] = v(f"{p}.bias", (4,), "float32")
            for e in range(4):
                _mlp(t, v, f"{p}.mlp.experts.{e}", h, 32)
            _mlp(t, v, f"{p}.mlp.shared_experts", h, 32 * c["n_shared_experts"])
        else:
            _mlp(t, v, f"{p}.mlp", h, 96)
        _norms(t, v, p, h)
    _ends(t, v, c)
    return Checkpoint(c, t)


def _save(path, tensors):
    """One safetensors file of `tensors` (name -> (dtype, array)), as transformers saves it."""
    meta = {"format": "pt"}
    if all(d != "bfloat16" for d, _ in tensors.values()):
        safetensors.numpy.save_file({k: a for k, (_, a) in tensors.items()}, path, metadata=meta)
        return
    arrays = {k: np.ascontiguousarray(a) for k, (_, a) in tensors.items()}
    specs = {
        k: safetensors.TensorSpec(dtype=d, shape=list(arrays[k].shape),
                                  data_ptr=arrays[k].ctypes.data, data_len=arrays[k].nbytes)
        for k, (d, _) in tensors.items()
    }
    # `arrays` keeps every buffer alive while the serializer reads it.
    safetensors.serialize_file(specs, path, metadata=meta)


def write(ckpt, folder, sharded, max_shard_bytes=64 << 10):
    """Writes `ckpt` into `folder`: `config.json` and one `model.safetensors`, or (`sharded`)
    shards of at most `max_shard_bytes` each (a tensor never split, as transformers does) in
    state-dict order and the index, written last. Reads every file back and checks it holds
    exactly `ckpt.tensors` (names, dtypes, shapes, bytes). Returns the file names."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(json.dumps(ckpt.config, indent=2, sort_keys=True) + "\n")
    if not sharded:
        groups = [list(ckpt.tensors)]
    else:
        groups, size = [[]], 0
        for name, (_, a) in ckpt.tensors.items():
            if groups[-1] and size + a.nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += a.nbytes
    n = len(groups)
    files = (["model.safetensors"] if not sharded else
             [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
    weight_map = {}
    for fname, names in zip(files, groups):
        _save(os.path.join(folder, fname), {k: ckpt.tensors[k] for k in names})
        weight_map.update({k: fname for k in names})
    if sharded:
        total = sum(a.nbytes for _, a in ckpt.tensors.values())
        meta = {"total_size": total}
        if "dtype" in ckpt.config:  # transformers 4.56 and later also count parameters
            meta["total_parameters"] = sum(a.size for _, a in ckpt.tensors.values())
        index = {"metadata": meta, "weight_map": weight_map}
        tmp = os.path.join(folder, "model.safetensors.index.json.tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.rename(tmp, os.path.join(folder, "model.safetensors.index.json"))
    _check_written(ckpt, folder, weight_map)
    return files


# The safetensors header dtype of each torch dtype name.
_HEADER = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _check_written(ckpt, folder, weight_map):
    """The files hold exactly `ckpt.tensors`: read back through safetensors' own reader."""
    seen = set()
    for fname in sorted(set(weight_map.values())):
        path = os.path.join(folder, fname)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        assert header.pop("__metadata__") == {"format": "pt"}, fname
        with safetensors.safe_open(path, framework="np") as f:
            assert set(f.keys()) == set(header), fname
        with open(path, "rb") as f:
            data = f.read()[8 + n:]
        for name, info in header.items():
            dtype, a = ckpt.tensors[name]
            assert info["dtype"] == _HEADER[dtype] and info["shape"] == list(a.shape), name
            lo, hi = info["data_offsets"]
            assert data[lo:hi] == a.tobytes(), f"{name} bytes in {fname}"
            seen.add(name)
    assert seen == set(ckpt.tensors)
