"""Tiny checkpoints of three families written by `transformers` itself (`save_pretrained`, bf16),
for the tests that run the real vLLM engine (issue 43; scripts/install-vllm.sh makes the
virtualenv they run in, .deps/vllm-venv).

Families: llama; qwen2 (q/k/v biases, transformers' Qwen2Attention has them always); qwen3_moe
(routed experts, q/k norms). Each has 2 layers, hidden 256, 4 attention heads over 2 KV heads (so
TP2 splits them), and a 512-token vocabulary. No tokenizer is written: the engine is started
with `skip_tokenizer_init=True` and given token ids (see engine_smoke.py).

`step` seeds the weights, so step 1 and step 2 of a family are two different checkpoints of
the same architecture. The initializer range is larger than transformers' 0.02 so that the
logits of random weights are far from ties and greedy tokens differ clearly between steps.

    python tiny_models.py OUT_DIR [--step N] [--family F ...]
writes OUT_DIR/<family>-step<N>/ (config.json, generation_config.json, model.safetensors).
"""

import argparse
import os
import sys

COMMON = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=False,
    # No end-of-sequence token: generation always runs to max_tokens.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILIES = ("llama", "qwen2", "qwen3_moe")


def config(family):
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**COMMON)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **COMMON,
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def write(family, out_dir, step=1):
    """Writes the checkpoint of `family` at `step` into `out_dir` and returns `out_dir`."""
    import torch
    import transformers

    torch.manual_seed(1000 * FAMILIES.index(family) + step)
    model = transformers.AutoModelForCausalLM.from_config(config(family), dtype=torch.bfloat16)
    # transformers initializes norms to 1 and biases to 0; random ones make sure a loader that
    # drops them (or the q/k/v biases of qwen2) changes the tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--family", action="append", choices=FAMILIES)
    args = ap.parse_args()
    for family in args.family or FAMILIES:
        d = write(family, os.path.join(args.out, f"{family}-step{args.step}"), args.step)
        print(d, sorted(os.listdir(d)), file=sys.stderr)


if __name__ == "__main__":
    main()
