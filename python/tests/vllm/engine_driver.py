"""One vLLM engine in a process of its own, driven by JSON lines (test_engine.py runs it with
.deps/vllm-venv's python).

Why a process per engine: vLLM keeps per-process global state (its parallel groups, the
`torch.distributed` world of the in-process executor), so two engines in one process are not
what users run, and a test must be able to hold a step-2 reference engine beside the engine it
refits. A process also keeps the pytest process free of vllm and torch, and is one pid to kill.

    engine_driver.py '{"model": DIR, "tp": 1, "reshard": true}'

Environment from the caller: VLLM_ENABLE_V1_MULTIPROCESSING=0 for the in-process mode (engine
core and worker in this process), unset for vLLM's default (engine core and each worker in
spawned processes). Requests arrive on stdin, one JSON object a line; each reply is one line on
stdout starting with REPLY (vLLM logs to stdout too, and those lines are not replies):
- {"op": "generate", "max_tokens": 8}: greedy tokens of PROMPTS, and the seconds it took;
- {"op": "call", "method": M, "args": [...], "kwargs": {...}}: `llm.M(*args, **kwargs)`; the
  reply has the value (as JSON, else its repr) and the seconds, or the exception: its class,
  its message, and `reshard.vllm.error_from` of it when that module is installed;
- {"op": "rpc", "fn": NAME}: `llm.collective_rpc(NAME)` for a function of this module (one value
  a worker);
- {"op": "exit"}: deletes the engine (vLLM stops its processes) and exits.
The first reply is {"ready": true, "start_s": ...} once the engine is up.
"""

import json
import os
import sys
import time
import traceback

# vLLM asks Linux for no AMX state before its bf16 attention kernel uses AMX tiles, and a
# process where nothing asked dies of SIGILL on its first forward (docs/vllm-notes.md). The
# reshard plugin does this in every engine process; this driver does it too so that the
# reference engines (started without the reshard backend) are safe whatever the plugin does.
# vLLM's spawned processes re-import this module, so it runs in each of them.
import torch  # noqa: E402

torch.cpu._init_amx()

REPLY = "@@engine-driver "

# Token-id prompts of different lengths (no tokenizer: the tiny checkpoints have none).
PROMPTS = [[1, 2, 3, 4], [100, 200, 300], [7] * 6, [511, 0, 42, 17, 256], [33, 99]]


def reply(obj):
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


def jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def describe(exc):
    """What a test needs of an exception that came out of the engine: its class, its text, and
    the typed reshard error `reshard.vllm.error_from` recovers from it (None without one)."""
    out = {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)}
    try:
        from reshard.vllm import error_from
    except ImportError:
        return out
    try:
        err = error_from(exc)
    except Exception as e:  # noqa: BLE001 - reported, the test decides
        out["error_from_failed"] = f"{type(e).__name__}: {e}"
        return out
    if err is not None:
        out["typed"] = {
            "type": type(err).__name__,
            "kind": getattr(err, "kind", None),
            "tensor": getattr(err, "tensor", None),
            "owner": getattr(err, "owner", None),
            "byte_range": list(err.byte_range) if getattr(err, "byte_range", None) else None,
            "message": str(err),
        }
    return out


# Functions sent to the workers with `llm.collective_rpc(fn)` ({"op": "rpc", "fn": NAME}): by
# reference to this file as the module `engine_driver` (a function of `__main__` does not
# re-pickle in a spawned engine core). Each takes the worker and returns plain data.


def backend_state(worker):
    """The reshard backend's view on this worker: what its last update measured
    (`last_update`: stage_s, apply_s, install_s, wire_bytes), the step it installed, and
    whether a background stage is still running or has finished (and its seconds)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        return None
    stage = engine.stage_state()
    return {
        "last_update": dict(getattr(engine, "last_update", {}) or {}),
        "installed_step": getattr(engine, "installed_step", None),
        "stage_running": stage["running"],
        "stage_result": None if stage["result"] is None
        else [stage["result"], round(stage["stage_s"], 4)],
    }


def main():
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # collective_rpc with a function (the "rpc" op) pickles it, which vLLM allows only so.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    tp = cfg.get("tp", 1)
    if tp > 1:
        # vLLM's "auto" binds by NUMA node and refuses more local workers than nodes.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(tp)))
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    kwargs = {}
    if cfg.get("reshard"):
        from vllm.config import WeightTransferConfig

        kwargs["weight_transfer_config"] = WeightTransferConfig(backend="reshard")
    llm = LLM(
        model=cfg["model"],
        dtype="bfloat16",
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        max_model_len=128,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        **kwargs,
    )
    reply({"ready": True, "start_s": round(time.monotonic() - t0, 2), "pid": os.getpid()})

    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        t = time.monotonic()
        try:
            if op == "generate":
                params = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8),
                                        ignore_eos=True, detokenize=False)
                outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                    use_tqdm=False)
                value = [list(o.outputs[0].token_ids) for o in outs]
            elif op == "call":
                value = getattr(llm, req["method"])(*req.get("args", []), **req.get("kwargs", {}))
            elif op == "rpc":
                import engine_driver

                value = llm.collective_rpc(getattr(engine_driver, req["fn"]))
            elif op == "exit":
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # noqa: BLE001 - every failure goes back to the test
            traceback.print_exc()
            reply({"ok": False, "s": round(time.monotonic() - t, 4), "error": describe(e)})
            continue
        reply({"ok": True, "s": round(time.monotonic() - t, 4), "value": jsonable(value)})
    del llm
    reply({"exited": True})


if __name__ == "__main__":
    main()
