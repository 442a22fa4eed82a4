"""What each vLLM rank holds after loading a Hugging Face checkpoint: the independent reference
of the HF-checkpoint tests (docs/hf-checkpoint-tests.md).

Written from vLLM's model code and parallel layers (`QKVParallelLinear`'s weight loader in
`layers/linear.py`, `layers/vocab_parallel_embedding.py`, the `FusedMoE` expert mapping as
`mixtral.py`, `qwen2_moe.py` and `deepseek_v2.py` use it, those files being the stored main
branch docs/models.md names; v0.30.0 is the newest release found, see
docs/hf-checkpoint-tests.md), never from reshard's planner: given the full HF tensors of a
checkpoint (hf_models.Checkpoint), `engine_tensors` gives every parameter a receiver rank holds, by
vLLM's parameter name, with its bytes. The rules, as vLLM's weight loaders apply them:

- rank `r` of a layout `tp`, `dp`, `ep` is `dp_rank * tp + tp_rank` (reshard's receiver order);
  everything but routed experts follows `tp_rank`;
- `QKVParallelLinear` (`qkv_proj`): q rows of heads `[tp_rank * H/tp, ...)`, then k, then v rows
  of KV heads `[s * KV/tp, ...)`, where with fewer KV heads than `tp` each rank holds one KV
  head, `s = tp_rank // (tp / KV)` (replicated); biases split the same way;
- `MergedColumnParallelLinear` (`gate_up_proj`): the rank's row block of gate, then of up;
- `ColumnParallelLinear` (`q_b_proj`, `kv_b_proj`): the rank's row block;
  `RowParallelLinear` (`o_proj`, `down_proj`): the rank's column block;
- `MergedReplicatedLinear` (MLA's `fused_qkv_a_proj`, when `q_lora_rank` is set): `q_a_proj`
  rows then `kv_a_proj_with_mqa` rows, whole on every rank; norms, routers
  (`ReplicatedLinear`), `e_score_correction_bias` and `shared_expert_gate`: whole;
- `VocabParallelEmbedding` / `ParallelLMHead`: the vocabulary padded to a multiple of 64,
  `Vp / tp` rows a rank, the rank's rows of the real vocabulary first and zero rows after;
  with `tie_word_embeddings` there is no `lm_head` parameter (it is the embedding);
- `FusedMoE`: `experts.w13_weight` `[E_local, 2 * I_local, hidden]` (per expert the gate rows,
  then the up rows) and `experts.w2_weight` `[E_local, hidden, I_local]`; without expert
  parallelism every rank holds all experts sliced by `tp_rank` (rows of gate/up, columns of
  down); with `ep = tp * dp` (`--enable-expert-parallel`) rank `r` holds whole experts
  `[r * E/ep, (r + 1) * E/ep)` (vLLM's default linear placement).

Arrays keep the checkpoint's representation (bf16 as uint16 bits), so bytes compare exactly.
"""

import numpy as np

from hf_models import qwen2_moe_sparse

# vLLM's DEFAULT_VOCAB_PADDING_SIZE.
VOCAB_PADDING = 64


def _split(n, parts, what):
    assert n % parts == 0, f"{what}: {n} does not split into {parts}"
    return n // parts


def rows(a, tp, r):
    """Column-parallel: row block `r` of `tp`."""
    n = _split(a.shape[0], tp, "rows")
    return a[r * n:(r + 1) * n]


def cols(a, tp, r):
    """Row-parallel: column block `r` of `tp`."""
    n = _split(a.shape[1], tp, "columns")
    return a[:, r * n:(r + 1) * n]


def vocab(a, tp, r):
    """Vocab-parallel: rows of the padded vocabulary, zero past the real one."""
    v = a.shape[0]
    padded = -(-v // VOCAB_PADDING) * VOCAB_PADDING
    per = _split(padded, tp, "padded vocabulary")
    lo, hi = min(r * per, v), min((r + 1) * per, v)
    out = np.zeros((per,) + a.shape[1:], dtype=a.dtype)
    out[:hi - lo] = a[lo:hi]
    return out


def qkv(q, k, v, heads, kv_heads, tp, r):
    """`QKVParallelLinear`'s shard (weight or bias) of rank `r`."""
    hd = q.shape[0] // heads
    n = _split(heads, tp, "query heads")
    if kv_heads >= tp:
        nk, s = _split(kv_heads, tp, "KV heads"), r
    else:
        nk, s = 1, r // _split(tp, kv_heads, "TP over KV heads")
    kv = slice(s * nk * hd, (s + 1) * nk * hd)
    return np.concatenate([q[r * n * hd:(r + 1) * n * hd], k[kv], v[kv]])


def merged(parts, tp, r):
    """`MergedColumnParallelLinear`: each part's row block, in order."""
    return np.concatenate([rows(p, tp, r) for p in parts])


class _Rank:
    def __init__(self, ckpt, layout, rank):
        self.t = ckpt.tensors
        self.c = ckpt.config
        self.tp = layout.get("tp", 1)
        self.dp = layout.get("dp", 1)
        self.ep = layout.get("ep", 1)
        assert 0 <= rank < self.tp * self.dp
        assert self.ep in (1, self.tp * self.dp), "vLLM's EP spans tp * dp"
        self.rank, self.r = rank, rank % self.tp
        self.out = {}

    def a(self, name):
        return self.t[name][1]

    def put(self, name, array, like):
        self.out[name] = (self.t[like][0], np.ascontiguousarray(array))

    def whole(self, name, engine=None):
        self.put(engine or name, self.a(name), name)

    def embeddings(self):
        e = "model.embed_tokens.weight"
        self.put(e, vocab(self.a(e), self.tp, self.r), e)
        self.whole("model.norm.weight")
        if not self.c.get("tie_word_embeddings", False):
            self.put("lm_head.weight", vocab(self.a("lm_head.weight"), self.tp, self.r),
                     "lm_head.weight")

    def gqa(self, p, bias=False, qk_norm=False):
        c, s = self.c, f"{p}.self_attn"
        heads, kvh = c["num_attention_heads"], c["num_key_value_heads"]
        for part in ("weight", "bias") if bias else ("weight",):
            q, k, v = (self.a(f"{s}.{x}_proj.{part}") for x in "qkv")
            self.put(f"{s}.qkv_proj.{part}", qkv(q, k, v, heads, kvh, self.tp, self.r),
                     f"{s}.q_proj.{part}")
        self.put(f"{s}.o_proj.weight", cols(self.a(f"{s}.o_proj.weight"), self.tp, self.r),
                 f"{s}.o_proj.weight")
        if qk_norm:
            self.whole(f"{s}.q_norm.weight")
            self.whole(f"{s}.k_norm.weight")

    def norms(self, p):
        self.whole(f"{p}.input_layernorm.weight")
        self.whole(f"{p}.post_attention_layernorm.weight")

    def mlp(self, p, gate="gate_proj", up="up_proj", down="down_proj"):
        """A dense MLP at HF prefix `p`: `p.gate_up_proj` and `p.down_proj`."""
        g, u, d = (self.a(f"{p}.{x}.weight") for x in (gate, up, down))
        self.put(f"{p}.gate_up_proj.weight", merged([g, u], self.tp, self.r), f"{p}.{gate}.weight")
        self.put(f"{p}.down_proj.weight", cols(d, self.tp, self.r), f"{p}.{down}.weight")

    def experts(self, p, n, gate="gate_proj", up="up_proj", down="down_proj"):
        """FusedMoE `p.experts.w13_weight` / `w2_weight` from HF `p.experts.E.*`."""
        if self.ep > 1:
            per = _split(n, self.ep, "experts over EP")
            mine = range(self.rank * per, (self.rank + 1) * per)
            tp, r = 1, 0
        else:
            mine, tp, r = range(n), self.tp, self.r
        w13, w2 = [], []
        for e in mine:
            g, u, d = (self.a(f"{p}.experts.{e}.{x}.weight") for x in (gate, up, down))
            w13.append(merged([g, u], tp, r))
            w2.append(cols(d, tp, r))
        like = f"{p}.experts.0.{gate}.weight"
        self.put(f"{p}.experts.w13_weight", np.stack(w13), like)
        self.put(f"{p}.experts.w2_weight", np.stack(w2), like)


def _llama_like(x, bias, qk_norm):
    for i in range(x.c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x.gqa(p, bias=bias, qk_norm=qk_norm)
        x.mlp(f"{p}.mlp")
        x.norms(p)


def _qwen_moe(x, bias, qk_norm, shared):
    c = x.c
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x.gqa(p, bias=bias, qk_norm=qk_norm)
        if qwen2_moe_sparse(c, i):
            x.whole(f"{p}.mlp.gate.weight")
            x.experts(f"{p}.mlp", c["num_experts"])
            if shared:
                x.mlp(f"{p}.mlp.shared_expert")
                x.whole(f"{p}.mlp.shared_expert_gate.weight")
        else:
            x.mlp(f"{p}.mlp")
        x.norms(p)


def _mixtral(x):
    for i in range(x.c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x.gqa(p)
        x.whole(f"{p}.block_sparse_moe.gate.weight")
        x.experts(f"{p}.block_sparse_moe", x.c["num_local_experts"], "w1", "w3", "w2")
        x.norms(p)


def _deepseek_v3(x):
    c = x.c
    for i in range(c["num_hidden_layers"]):
        p, s = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        assert c["q_lora_rank"] is not None, "this reference covers MLA with a q LoRA"
        fused = np.concatenate([x.a(f"{s}.q_a_proj.weight"),
                                x.a(f"{s}.kv_a_proj_with_mqa.weight")])
        x.put(f"{s}.fused_qkv_a_proj.weight", fused, f"{s}.q_a_proj.weight")
        x.whole(f"{s}.q_a_layernorm.weight")
        x.whole(f"{s}.kv_a_layernorm.weight")
        for proj in ("q_b_proj", "kv_b_proj"):
            n = f"{s}.{proj}.weight"
            x.put(n, rows(x.a(n), x.tp, x.r), n)
        n = f"{s}.o_proj.weight"
        x.put(n, cols(x.a(n), x.tp, x.r), n)
        if i >= c["first_k_dense_replace"] and i % c.get("moe_layer_freq", 1) == 0:
            x.whole(f"{p}.mlp.gate.weight")
            x.whole(f"{p}.mlp.gate.e_score_correction_bias")
            x.experts(f"{p}.mlp", c["n_routed_experts"])
            x.mlp(f"{p}.mlp.shared_experts")
        else:
            x.mlp(f"{p}.mlp")
        x.norms(p)


FAMILIES = {
    "llama": lambda x: _llama_like(x, bias=False, qk_norm=False),
    "qwen2": lambda x: _llama_like(x, bias=True, qk_norm=False),
    "qwen3": lambda x: _llama_like(x, bias=False, qk_norm=True),
    "qwen2_moe": lambda x: _qwen_moe(x, bias=True, qk_norm=False, shared=True),
    "qwen3_moe": lambda x: _qwen_moe(x, bias=False, qk_norm=True, shared=False),
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "kimi_k2": _deepseek_v3,  # Kimi-K2's model_type; vLLM loads it as DeepseekV3ForCausalLM
}


def engine_tensors(ckpt, layout, rank):
    """`{vLLM parameter name: (torch dtype name, array)}` of receiver rank `rank` of `layout`
    (`{"tp": .., "dp": .., "ep": ..}`) after vLLM loads `ckpt`."""
    x = _Rank(ckpt, layout, rank)
    x.embeddings()
    FAMILIES[ckpt.model_type](x)
    return x.out
