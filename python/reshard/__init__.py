"""reshard: move model weights from trainer ranks to inference-engine ranks, in place, verified.

A trainer rank registers the arrays it already holds and publishes each step::

    with reshard.Publisher(model="qwen3", architecture=cfg, topology={"ep": 8, "dp": 8}, rank=r,
                           rendezvous="etcd://127.0.0.1:2379", transport="ucx") as pub:
        for name, array in my_tensors.items():
            pub.register(name, array)
        pub.publish(step)

An engine rank hands its own parameter arrays and refits them between generation calls::

    rx = reshard.Receiver(model="qwen3", layout={"tp": 2}, rank=t,
                          rendezvous="etcd://127.0.0.1:2379", transport="ucx", params=engine_params)
    report = rx.refit(timeout=60)   # connects first, within the same 60 s

``model=`` is always the name publishers announce under and receivers ask for; the model's
architecture (a preset name or a :func:`model_config` dict) is ``architecture=``. Making a
:class:`Receiver` never waits: it connects in :meth:`Receiver.connect` or in its first refit.
bf16 and 8-bit float arrays carry ``ml_dtypes`` dtypes (``.view(np.uint16)`` gives the bits).

Every failure is a ``reshard.ReshardError`` subclass named after its kind (``reshard.Transport``,
``reshard.Timeout``, ``reshard.InvalidInput``, ...) with ``kind``, ``tensor``, ``owner``,
``byte_range``, ``backend`` and ``retryable`` attributes; a bug that panics inside reshard raises
``reshard.Panic`` (a ``reshard.Internal``), never PyO3's ``PanicException``. A failed refit leaves the engine's
weights untouched: the new weights land in reshard's own buffers and are verified against the
publishers' digests; only then are they copied into the engine's arrays (``install="copy"``,
``report.copy_s``), or, with ``install="swap"``, handed to the engine as read-only arrays over
reshard's buffers (:meth:`Receiver.weights`), copying nothing (python/README.md).
The GIL is released while a refit plans, moves bytes and verifies; Ctrl-C cancels it safely.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union


def _nixl_home() -> Optional[str]:
    """The folder of the ``nixl-cu12`` package installed beside this one (``pip install
    reshard[nixl]``), where its ``.nixl_cu12.mesonpy.libs/libnixl_capi.so`` lives; ``None`` when
    it is not installed. Only looked up, never imported (importing it needs CUDA)."""
    try:
        spec = importlib.util.find_spec("nixl_cu12")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


# The nixl backend loads the NIXL runtime from RESHARD_NIXL_HOME (else the loader's search path;
# never from the tree the package was built in): an explicit setting wins, else the installed
# nixl-cu12 package. Set before the native module creates any transport.
if not os.environ.get("RESHARD_NIXL_HOME") and (_home := _nixl_home()) is not None:
    os.environ["RESHARD_NIXL_HOME"] = _home

import ml_dtypes
import numpy as np

from . import _reshard
from ._reshard import (
    Aborted,
    Busy,
    Closed,
    Config,
    Decode,
    Guard,
    InconsistentTensor,
    InProcessHub,
    Internal,
    InvalidInput,
    InvalidTable,
    Layout,
    MissingCoverage,
    NoRollback,
    NotApplicable,
    NotConnected,
    OutOfBounds,
    OverlappingOffers,
    Panic,
    PeerUnknown,
    ReplicaDivergence,
    ReshardError,
    Staged,
    Timeout,
    Transport,
    Unavailable,
    Unsupported,
    Verification,
)

#: The package's version (the native module's, so a wheel and its module never disagree).
__version__: str = _reshard.__version__

__all__ = [
    "Publisher",
    "Receiver",
    "RefitReport",
    "RollbackReport",
    "Staged",
    "InProcessHub",
    "model_config",
    "hf_model_config",
    "published_step",
    "receiver_params",
    "publisher_tensors",
    "transports",
    "numpy_dtype",
    "ReshardError",
    "Aborted",
    "Busy",
    "Closed",
    "Config",
    "Decode",
    "Guard",
    "InconsistentTensor",
    "Internal",
    "InvalidInput",
    "InvalidTable",
    "Layout",
    "MissingCoverage",
    "NoRollback",
    "NotApplicable",
    "NotConnected",
    "OutOfBounds",
    "OverlappingOffers",
    "Panic",
    "PeerUnknown",
    "ReplicaDivergence",
    "Timeout",
    "Transport",
    "Unavailable",
    "Unsupported",
    "Verification",
]

Model = Union[str, Mapping[str, Any]]
"""A preset name (``"qwen3-30b-a3b"``) or a model configuration dict (see :func:`model_config`):
what ``architecture=`` takes (and the helper functions' ``model``)."""

# The numpy dtype of each reshard dtype: numpy has no bfloat16 or 8-bit floats, so those are
# ml_dtypes' (the dtypes JAX uses); their raw bits are the unsigned integers of _RAW.
_NUMPY = {
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "f32": np.float32,
    "f64": np.float64,
    "f8_e4m3": ml_dtypes.float8_e4m3fn,
    "f8_e5m2": ml_dtypes.float8_e5m2,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "u8": np.uint8,
    "bool": np.bool_,
}


# The unsigned integer dtypes holding the bits of the reshard dtypes numpy has no dtype of.
_RAW = {"bf16": np.uint16, "f8_e4m3": np.uint8, "f8_e5m2": np.uint8}

# ml_dtypes' dtypes, which export no buffer protocol: their arrays reach the native module as
# a zero-copy view of their bits (_bits).
_ML_DTYPES = {np.dtype(_NUMPY[d]) for d in _RAW}


def _error(cls: type, kind: str, message: str, tensor: Optional[str] = None,
           owner: Optional[int] = None, retryable: bool = False):
    """A reshard error of class ``cls`` raised from Python, with the attributes the native ones
    carry."""
    err = cls(f"{kind}: {message}")
    err.kind, err.tensor, err.owner = kind, tensor, owner
    err.byte_range, err.backend, err.retryable = None, None, retryable
    return err


def _invalid(message: str, tensor: Optional[str] = None, owner: Optional[int] = None):
    """A reshard.InvalidInput raised from Python."""
    return _error(InvalidInput, "invalid_input", message, tensor, owner)


def numpy_dtype(dtype: str, raw: bool = False) -> np.dtype:
    """The numpy dtype of reshard dtype ``dtype``: bf16 is ``ml_dtypes.bfloat16``, f8_e4m3
    ``ml_dtypes.float8_e4m3fn``, f8_e5m2 ``ml_dtypes.float8_e5m2``. ``raw=True`` gives, for
    those three, the unsigned integer dtype of their bits instead (``np.uint16``, ``np.uint8``:
    what an array of them ``.view()``s as)."""
    try:
        if raw and dtype in _RAW:
            return np.dtype(_RAW[dtype])
        return np.dtype(_NUMPY[dtype])
    except KeyError:
        raise _invalid(f"unknown dtype {dtype!r}") from None


def _bits(array: Any) -> Any:
    """``array`` as the native module takes it: an ml_dtypes array as a zero-copy view of its
    bits (same memory, same shape), anything else as is."""
    if isinstance(array, np.ndarray) and array.dtype in _ML_DTYPES:
        return array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8)
    return array


def _is_hf_config(architecture: Any) -> bool:
    """Whether ``architecture`` is a Hugging Face ``config.json``: its dict (it has a
    ``model_type``, which a reshard configuration never has), or a path to the file or to the
    folder holding it."""
    if isinstance(architecture, os.PathLike):
        return True
    if isinstance(architecture, str):
        return os.sep in architecture or architecture.endswith(".json") or \
            os.path.exists(architecture)
    return isinstance(architecture, Mapping) and "model_type" in architecture


def _architecture(architecture: Model, name: str) -> str:
    """JSON of ``architecture`` (a preset name, a configuration dict, or a Hugging Face
    ``config.json``: :func:`hf_model_config`) named ``name``: the name publishers announce
    under is ``model=``, whatever name the architecture carries."""
    if _is_hf_config(architecture):
        cfg = hf_model_config(architecture)
    elif isinstance(architecture, str):
        try:
            cfg = json.loads(_reshard.model_config(architecture, None, None, None))
        except Config as e:
            raise _error(Config, "config",
                         f"architecture {architecture!r} is no preset ({e}): pass a preset name "
                         "or a model configuration dict (reshard.model_config) as "
                         "architecture=") from None
    else:
        cfg = dict(architecture)
    cfg["name"] = name
    return json.dumps(cfg)


def _deprecated_model(cls: str, model: Any, architecture: Optional[Model]) -> tuple:
    """``(name, architecture)`` from the earlier spelling ``model=<config dict>`` of ``cls``,
    with a DeprecationWarning (``model=`` is the rendezvous name; the dict is ``architecture=``)."""
    warnings.warn(
        f"{cls}(model=<configuration dict>) is deprecated: model= is the name publishers "
        f"announce under; pass model=<name> and the dict as architecture=",
        DeprecationWarning, stacklevel=3)
    if architecture is not None:
        raise _invalid(f"{cls}: model= is a configuration dict and architecture= is given too; "
                       "pass the name as model= and the configuration as architecture=")
    try:
        name = str(model["name"])
    except (KeyError, TypeError):
        raise _invalid(f"{cls}: model= is neither a name nor a configuration dict with a "
                       "'name'") from None
    return name, model


def _model_json(model: Model) -> str:
    if _is_hf_config(model):
        return json.dumps(hf_model_config(model))
    if isinstance(model, str):
        return model
    return json.dumps(dict(model))


def _pairs(topology: Union[str, Mapping[str, int]]) -> str:
    if isinstance(topology, str):
        return topology
    return ",".join(f"{k}={int(v)}" for k, v in topology.items())


def _config(config: Optional[Mapping[str, Any]]) -> Optional[str]:
    return None if config is None else json.dumps(dict(config))


# torch dtypes numpy's DLPack import refuses: their bits cross as a signed integer torch dtype of
# the same width (every torch version has those) and are then viewed as the ml_dtypes dtype of
# the reshard dtype (see _NUMPY).
_TORCH_BITS = {
    "bfloat16": ("int16", ml_dtypes.bfloat16),
    "float8_e4m3fn": ("int8", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": ("int8", ml_dtypes.float8_e5m2),
}

# reshard dtypes numpy has only through ml_dtypes, and the torch dtype that reads them.
_TORCH_DTYPE = {"bf16": "bfloat16", "f8_e4m3": "float8_e4m3fn", "f8_e5m2": "float8_e5m2"}


def _torch_span(tensor: Any) -> tuple:
    """``(address, bytes)`` torch tensor ``tensor`` holds now: its data pointer, and its byte size
    or, when its storage no longer covers that (resized or freed in place, as FSDP does with
    ``untyped_storage().resize_(0)``), the bytes the storage still has from the pointer on."""
    # From the storage, not `tensor.data_ptr()`, which raises once the storage is freed.
    storage = tensor.untyped_storage()
    offset = tensor.storage_offset() * tensor.element_size()
    size = tensor.numel() * tensor.element_size()
    return storage.data_ptr() + offset, max(0, min(size, storage.nbytes() - offset))


def _dlpack_span(array: Any) -> tuple:
    """``(address, bytes)`` a ``__dlpack__`` exporter holds now, from a fresh export of it."""
    view = np.from_dlpack(array)
    return view.__array_interface__["data"][0], view.nbytes


def _exported(array: Any, tensor: Optional[str] = None) -> tuple:
    """``(buffer, probe)``: the object whose buffer is registered, and a callable returning
    ``(address, bytes)`` of the caller's ``array`` as it is now, or None when the buffer is
    ``array`` itself (reshard then asks it again). The buffer is ``array`` when it exports the
    buffer protocol (numpy), else a zero-copy numpy view of its ``__dlpack__`` export (torch CPU
    tensors; bf16 and 8-bit float tensors as ml_dtypes arrays over their bits). The
    probe holds ``array``: a torch tensor then lives as long as reshard holds its memory, and
    reshard asks the probe before every publish and refit whether the memory is still there.
    An ml_dtypes array is its own buffer (the native module gets its bits: :func:`_bits`)."""
    if isinstance(array, np.ndarray) and array.dtype in _ML_DTYPES:
        return array, None
    try:
        memoryview(array).release()
        return array, None
    except TypeError:
        if not hasattr(array, "__dlpack__"):
            raise _invalid(f"tensor {tensor!r} is a {type(array).__name__}, which exports "
                           "neither the buffer protocol nor __dlpack__", tensor) from None
    torch_dtype = str(getattr(array, "dtype", "")).removeprefix("torch.")
    is_torch = type(array).__module__.startswith("torch") and hasattr(array, "untyped_storage")
    probe = functools.partial(_torch_span if is_torch else _dlpack_span, array)
    bits = None
    source = array
    if is_torch and torch_dtype in _TORCH_BITS:
        import torch

        carrier, bits = _TORCH_BITS[torch_dtype]
        source = array.view(getattr(torch, carrier))
    try:
        out = np.from_dlpack(source)
        return (out if bits is None else out.view(bits)), probe
    except (BufferError, RuntimeError, TypeError, ValueError) as e:
        device = getattr(array, "device", None)
        where = f" on device {device}" if device is not None else ""
        raise _invalid(f"tensor {tensor!r}{where} cannot be viewed as host memory through "
                       f"__dlpack__ ({e}); reshard's Python package registers CPU memory",
                       tensor) from None


def model_config(
    preset: str,
    *,
    layers: Optional[int] = None,
    experts: Optional[int] = None,
    vocab: Optional[int] = None,
    dtype: Optional[str] = None,
    name: Optional[str] = None,
) -> dict:
    """Preset ``preset``'s configuration as a dict, scaled down (``layers``, ``experts``,
    ``vocab`` only shrink), with every tensor's ``dtype`` and the rendezvous ``name`` replaced
    when given."""
    cfg = json.loads(_reshard.model_config(preset, layers, experts, vocab))
    if dtype is not None:
        cfg["dtype"] = dtype
    if name is not None:
        cfg["name"] = name
    return cfg


def hf_model_config(config: Union[str, "os.PathLike[str]", Mapping[str, Any]], *,
                    name: Optional[str] = None) -> dict:
    """The configuration (as :func:`model_config` gives) of the model a Hugging Face
    ``config.json`` describes: ``config`` is its dict (``model.config.to_dict()``), the file, or
    the folder holding it. The families and keys are those ``reshard checkpoint`` reads
    (docs/models.md); the dtype is the config's ``dtype``/``torch_dtype``. Raises
    :class:`Config` naming the key that is missing or wrong. Any ``architecture=`` argument
    takes such a config directly."""
    if isinstance(config, Mapping):
        text, label = json.dumps(dict(config)), "config.json (a dict)"
    else:
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise _error(Config, "config", f"cannot read {path}: {e}") from None
        label = path
    cfg = json.loads(_reshard.hf_model_config(text, label))
    if name is not None:
        cfg["name"] = name
    return cfg


def published_step(rendezvous: Union[str, "InProcessHub"], model: str, *,
                   timeout: float = 30.0, after: Optional[int] = None) -> int:
    """The newest step (above ``after``) at which every publisher rank of ``model`` is ready,
    waiting up to ``timeout`` seconds for one (:class:`Timeout` says who was seen). An
    orchestrator pins it so that every engine rank installs the same step
    (``stage(step=...)``, the vLLM backend's ``update_weights``)."""
    step, _ = _reshard.published_step(rendezvous, model, timeout, after)
    return step


def receiver_params(model: Model, layout: Union[str, Mapping[str, int]], rank: int) -> dict:
    """``{name: (shape, dtype)}`` of receiver rank ``rank``'s parameters (engine naming:
    ``qkv_proj``, ``gate_up_proj``, experts ``w13``/``w2``), in engine order: the arrays to
    allocate and hand to :class:`Receiver`."""
    rows = _reshard.receiver_params(_model_json(model), _pairs(layout), rank)
    return {name: (tuple(shape), dtype) for name, dtype, shape in rows}


def publisher_tensors(model: Model, topology: Union[str, Mapping[str, int]], rank: int) -> dict:
    """``{name: (offset, shape, dtype)}`` of the tensors publisher rank ``rank`` holds: each is
    the rank's box of the global tensor, starting at ``offset`` in global coordinates."""
    rows = _reshard.publisher_tensors(_model_json(model), _pairs(topology), rank)
    return {name: (tuple(offset), tuple(shape), dtype) for name, dtype, offset, shape in rows}


def transports() -> list:
    """Every transport built into this package, in registry order: ``[{"transport", "usable",
    "reason", "cross_process"}]``. ``usable`` says whether its runtime loads here (``reason``
    says why not); ``cross_process`` whether its peers may live in other processes (the
    backend's own word). Tests and tools take backends from here, never from a list by hand."""
    return [
        {"transport": scheme, "usable": reason is None, "reason": reason,
         "cross_process": cross}
        for scheme, reason, cross in _reshard.transports()
    ]


class Publisher:
    """One trainer rank publishing the tensors it holds, in place.

    ``model`` is the name the publisher announces under (what receivers ask for);
    ``architecture`` the model's shapes: a preset name, a configuration dict
    (:func:`model_config`; its own ``name`` is replaced by ``model``), or a Hugging Face
    ``config.json`` (its dict, the file or its folder: :func:`hf_model_config`), for a trainer
    that holds an HF model; by default the preset named ``model``. The earlier spelling ``model=<configuration dict>`` still works (its
    ``name`` is the name) with a DeprecationWarning.
    ``topology`` the trainer's parallelism (``{"ep": 8, "dp": 8}``, keys tp/ep/dp/pp);
    ``rendezvous`` an :class:`InProcessHub` or ``"etcd://HOST:PORT"``; ``transport`` a scheme
    (``"loopback"``, ``"ucx"``, ``"nixl"``, ``"cma"``); ``config`` a dict as ``reshard.toml``
    would give it (e.g. ``{"backends": {"ucx": {"tls": "tcp"}}}``). ``lease_ttl`` is how long a
    dead publisher's announcement outlives it.

    Making a publisher waits for no peer: it creates its transport endpoint and, with an etcd
    rendezvous, opens its etcd client (a refused connection fails at once; an unreachable host
    within etcd's connect timeout, 5 s); it announces nothing until the first :meth:`publish`.
    """

    def __init__(
        self,
        *,
        model: Model,
        topology: Union[str, Mapping[str, int]],
        rank: int,
        rendezvous: Union[str, InProcessHub],
        transport: Optional[str] = None,
        config: Optional[Mapping[str, Any]] = None,
        lease_ttl: float = 10.0,
        architecture: Optional[Model] = None,
    ) -> None:
        if isinstance(model, str):
            name = model
            architecture = model if architecture is None else architecture
        else:
            name, architecture = _deprecated_model("Publisher", model, architecture)
        self.model = name
        self._native = _reshard.NativePublisher(
            _architecture(architecture, name),
            _pairs(topology),
            rank,
            rendezvous,
            transport,
            _config(config),
            lease_ttl,
        )
        self.rank = rank

    @property
    def tensors(self) -> dict:
        """``{name: (offset, shape, dtype)}`` of every tensor this rank must register."""
        return {
            name: (tuple(offset), tuple(shape), dtype)
            for name, dtype, offset, shape in self._native.tensors()
        }

    @property
    def step(self) -> Optional[int]:
        """The last step published."""
        return self._native.step

    def register(self, name: str, array: Any) -> None:
        """Registers ``array`` (buffer protocol or ``__dlpack__``, C-contiguous, the tensor's
        shape and dtype) as tensor ``name``, zero-copy. Register every tensor before the first
        :meth:`publish`; the array stays referenced until :meth:`close`."""
        buffer, probe = _exported(array, name)
        self._native.register(name, _bits(buffer), probe)

    def empty(self, name: str, shape: Optional[tuple] = None, dtype: Any = None) -> np.ndarray:
        """A new zeroed array for tensor ``name``, registered as it, backed by memory the
        transport allocates for fast sharing with its peers where it has an allocator (plain
        host memory otherwise). ``shape`` and ``dtype``, when given, must be the tensor's
        (:attr:`tensors`); the array is writable in place like any registered array. bf16 and
        8-bit float tensors come as ml_dtypes arrays; ``dtype=np.uint16`` (``np.uint8``) gives
        their raw bits instead (so does ``.view(np.uint16)`` of the array)."""
        tensors = self.tensors
        if name not in tensors:
            raise _invalid(f"publisher rank {self.rank} holds no tensor {name!r}", name, self.rank)
        _, want_shape, want_dtype = tensors[name]
        np_dtype = numpy_dtype(want_dtype)
        if shape is not None and tuple(shape) != want_shape:
            raise _invalid(f"tensor {name!r} has shape {want_shape}, not {tuple(shape)}",
                           name, self.rank)
        if dtype is not None and dtype != want_dtype:
            try:
                asked = np.dtype(dtype)
            except TypeError:
                asked = None
            if asked == numpy_dtype(want_dtype, raw=True):
                np_dtype = asked
            elif asked != np_dtype:
                raise _invalid(f"tensor {name!r} is {want_dtype} ({np_dtype}), not {dtype}",
                               name, self.rank)
        buffer = self._native.empty(name)
        # numpy keeps `buffer` (and so the memory) alive as the array's base.
        return np.frombuffer(buffer, dtype=np_dtype).reshape(want_shape)

    def connect(self, *, timeout: float = 10.0) -> None:
        """Reaches the rendezvous now (etcd: connects within ``timeout`` seconds), so a bad or
        unreachable address fails here, typed (``reshard.Transport``, ``reshard.Timeout``),
        rather than at the first :meth:`publish`, which otherwise connects. A no-op once
        connected, and for an :class:`InProcessHub`."""
        self._native.connect(timeout)

    def unready(self) -> None:
        """Tells receivers not to start reading: call before rewriting the arrays. Optional;
        a receiver that reads during a rewrite fails verification and keeps its weights."""
        self._native.unready()

    def ready(self) -> None:
        """Marks the announced step ready again, unchanged: :meth:`unready`'s counterpart for a
        rewrite that did not happen. Checks first that every array is where it was registered
        (:class:`InvalidInput` naming one that moved, and the step stays not ready). The bytes
        must be the step's as published: receivers verify them against its digests."""
        self._native.ready()

    def publish(self, step: int) -> None:
        """Digests every registered array and announces step ``step`` (newer than the last)."""
        self._native.publish(step)

    def wait_released(self, *, timeout: float = 60.0) -> dict:
        """Waits until no receiver reads this rank's memory (the reader fence; call after
        :meth:`unready`, which stops new readers). Receivers claim what they read through the
        rendezvous under their own lease, so a dead receiver holds nobody past its lease TTL.
        Returns ``{"waited_s": float, "readers": [str]}`` (the readers waited for); raises
        ``reshard.Timeout`` naming the readers still reading after ``timeout`` seconds."""
        waited_s, readers = self._native.wait_released(timeout)
        return {"waited_s": waited_s, "readers": readers}

    @contextlib.contextmanager
    def updating(self, step: int, *, timeout: float = 60.0) -> Iterator[dict]:
        """``with publisher.updating(step): <rewrite the arrays>``: marks the announcement not
        ready, waits until no receiver reads this rank's memory (:meth:`wait_released`, which
        it yields the result of), runs the body, then publishes ``step``. When the body raises,
        nothing is published and the announcement stays not ready (the arrays may be half
        rewritten); when the wait times out, the body does not run, the step announced before
        is marked ready again (its arrays were not touched) and :class:`Timeout` is raised: the
        rank stays available to every receiver at the step it had."""
        self.unready()
        try:
            released = self.wait_released(timeout=timeout)
        except Timeout:
            self._native.ready()
            raise
        yield released
        self.publish(step)

    def close(self) -> None:
        """Withdraws the announcement and releases the arrays."""
        self._native.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class RefitReport:
    """What one refit did. ``stages`` maps each stage (discover, merge, dedup, plan, register,
    descriptor_build, wire, reslice, install, verify) to seconds; ``e2e_s`` is the Rust
    refit's end to end, ``rust_s`` the same call including discovery, ``copy_s`` the copy into
    the engine's arrays (0 with ``install == "swap"``), ``native_s`` the whole native call and
    ``python_s`` the whole :meth:`Receiver.refit` as Python saw it. ``verified`` is true when
    every byte the refit installed matched a publisher digest (``checked_bytes == wire_bytes``);
    false when a publisher sent no digests or verification is off in the configuration."""

    step: int
    verified: bool
    reads: int
    wire_bytes: int
    stages: dict
    e2e_s: float
    attribution: float
    discovery_s: float
    peers_loaded: int
    plan_rebuilt: bool
    checked_bytes: int
    rust_s: float
    copy_s: float
    native_s: float
    install: str = "copy"
    python_s: float = 0.0
    extra: dict = field(default_factory=dict)
    newer_step: Optional[int] = None
    """A step newer than this one that a publisher stood ready at right after staging, when one
    was seen (the engine applied a step that is not the newest)."""
    apply_s: float = 0.0
    """Seconds the apply took: the receiver's pointer swap, plus the copy with ``install == "copy"``."""


@dataclass
class RollbackReport:
    """What :meth:`Receiver.rollback` did: ``step`` is live now, ``rolled_back_from`` was;
    ``install_s`` is the receiver's swap back, ``copy_s`` the copy into the engine's arrays (0
    with ``install == "swap"``), ``native_s`` the whole native call and ``python_s`` the call as
    Python saw it."""

    step: int
    rolled_back_from: int
    install: str
    install_s: float
    copy_s: float
    native_s: float
    python_s: float = 0.0


class Receiver:
    """One engine rank refitting its own parameter arrays.

    ``model`` is the name publishers announce under (the earlier spelling, a configuration
    dict whose ``name`` is used, still works with a DeprecationWarning);
    ``layout`` the engine's parallelism (``{"tp": 2}``, keys tp/dp/ep).

    Construction never waits: it checks the arguments and creates the transport endpoint.
    :meth:`connect` reaches the rendezvous, waits for the publishers and learns the model they
    announce (``timeout`` here is its default); without it, the first :meth:`refit`,
    :meth:`stage` or :meth:`wait_for_step` connects, within that call's own timeout. Until then
    :attr:`architecture` raises :class:`NotConnected`. The engine's ``params`` are checked
    against the layout when it is known: at construction when ``architecture`` (a preset name
    or a configuration dict) is given, which the publishers' model must then match
    (:class:`Config` at connect otherwise), else at connect.

    ``install`` says how verified weights reach the engine:

    - ``"copy"`` (the default when ``params`` is given): ``params`` maps every parameter name of
      the rank (see :func:`receiver_params`) to a writable C-contiguous array of its shape and
      dtype, and each refit copies the new weights into those arrays (``report.copy_s``).
    - ``"swap"`` (the default without ``params``): nothing is copied. After each refit,
      :meth:`weights` returns read-only arrays over reshard's buffer of the new step; the engine
      re-points its parameters to them. An array stays valid and unchanged until the refit
      *after* the next one, so the engine may keep serving from it while the next refit runs;
      a refit that would land in buffers the engine still holds arrays of raises
      :class:`Busy` naming them, before anything is written.
    """

    def __init__(
        self,
        *,
        model: Model,
        layout: Union[str, Mapping[str, int]],
        rank: int,
        rendezvous: Union[str, InProcessHub],
        params: Optional[Mapping[str, Any]] = None,
        transport: Optional[str] = None,
        config: Optional[Mapping[str, Any]] = None,
        timeout: float = 300.0,
        install: Optional[str] = None,
        architecture: Optional[Model] = None,
    ) -> None:
        if isinstance(model, str):
            name = model
        else:
            # The dict only ever named the model here; its shapes were never used.
            name, _ = _deprecated_model("Receiver", model, architecture)
        if install is None:
            install = "swap" if params is None else "copy"
        exported = {} if params is None else {k: _exported(v, k) for k, v in params.items()}
        self.params = None if params is None else {k: b for k, (b, _) in exported.items()}
        bits = None if params is None else {k: _bits(b) for k, b in self.params.items()}
        probes = {k: p for k, (_, p) in exported.items() if p is not None}
        self._native = _reshard.NativeReceiver(
            name, _pairs(layout), rank, rendezvous, bits, transport, _config(config),
            timeout, install, probes,
            None if architecture is None else _architecture(architecture, name),
        )
        self.model = name
        self.rank = rank
        self.install = install
        self._timeout = timeout
        self._dtypes: Optional[dict] = None

    def connect(self, *, timeout: Optional[float] = None) -> None:
        """Connects: reaches the rendezvous, waits for the publishers and learns the model they
        announce, all within ``timeout`` seconds (default: the constructor's ``timeout``;
        ``inf``: no limit). Does nothing when connected already. Raises :class:`Timeout` naming
        what was missing, and leaves the receiver unconnected (call again to retry)."""
        self._native.connect(self._timeout if timeout is None else timeout, None)

    async def connect_async(self, *, timeout: Optional[float] = None) -> None:
        """:meth:`connect` on a worker thread; cancelling the task stops the wait."""
        t = self._timeout if timeout is None else timeout
        await self._cancellable(lambda token: self._native.connect(t, token))

    @property
    def connected(self) -> bool:
        """Whether the receiver has connected (:meth:`connect`, or a refit or stage did)."""
        return self._native.is_connected

    @property
    def architecture(self) -> dict:
        """The model configuration the publishers announce (a dict as :func:`model_config`
        gives). Raises :class:`NotConnected` before the receiver has connected: it never
        connects on its own, so reading it never waits."""
        return json.loads(self._native.architecture())

    def _dtype(self, name: str) -> np.dtype:
        if self._dtypes is None:
            self._dtypes = {n: numpy_dtype(d) for n, d, _ in self._native.params()}
        return self._dtypes[name]

    def weights(self, framework: str = "numpy") -> dict:
        """``{name: array}`` of the live weights, in engine order: the engine's own arrays with
        ``install="copy"``; with ``install="swap"``, fresh read-only numpy arrays over reshard's
        buffer of the live step (zero-copy). Call it after every refit and re-point the engine's
        parameters to what it returns: the arrays stay valid until the refit after the next one,
        which raises :class:`Busy` while any of them is still alive. Raises
        :class:`InvalidInput` before the first refit in swap install.

        ``framework="torch"`` (swap install) gives CPU torch tensors over the same memory instead,
        in the model's torch dtype (bf16 as ``torch.bfloat16``, not its bits); they must not be
        written (torch has no read-only tensors)."""
        if framework not in ("numpy", "torch"):
            raise _invalid(f"framework must be 'numpy' or 'torch', not {framework!r}")
        if self.params is not None:
            if framework == "torch":
                raise _invalid("framework='torch' is for swap install: with install='copy' the "
                               "weights are the engine's own arrays")
            return self.params
        rows = self._native.weights()
        if rows is None:
            raise _invalid(f"receiver rank {self.rank} has no weights before its first refit")
        arrays = {
            name: np.frombuffer(view, dtype=self._dtype(name)).reshape(shape)
            for name, view, _, shape in rows
        }
        if framework == "numpy":
            return arrays
        import warnings

        import torch

        dtypes = {name: dtype for name, _, dtype, _ in rows}
        out = {}
        with warnings.catch_warnings():
            # Read-only by design (python/README.md, swap install rule 5).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for name, a in arrays.items():
                if dtypes[name] in _TORCH_DTYPE:
                    # Bits in through a signed integer of the same width (as in _exported).
                    signed = np.int16 if a.itemsize == 2 else np.int8
                    t = torch.from_numpy(a.view(signed))
                    t = t.view(getattr(torch, _TORCH_DTYPE[dtypes[name]]))
                else:
                    t = torch.from_numpy(a)
                out[name] = t
        return out

    @property
    def live_step(self) -> Optional[int]:
        """The step of the live weights (None before the first refit)."""
        return self._native.live_step

    @property
    def staged_step(self) -> Optional[int]:
        """The step staged by :meth:`stage` and not applied yet (None when there is none)."""
        return self._native.staged_step

    def refit(self, *, timeout: float = 300.0, step: Optional[int] = None,
              allow_older: bool = False) -> RefitReport:
        """Installs the next step (into the engine's arrays, or as the buffer :meth:`weights`
        lends): :meth:`stage`, then :meth:`apply`, in one call. ``timeout`` seconds (``inf``: no
        limit) bound the whole call: connecting when not connected yet, waiting for the
        publishers, moving and verifying.
        ``step`` and ``allow_older`` are :meth:`stage`'s. Raises a :class:`ReshardError`
        subclass on failure, with the live weights untouched."""
        return self._refit(timeout, None, step, allow_older)

    def _refit(self, timeout: float, cancel: Optional[Any], step: Optional[int] = None,
               allow_older: bool = False) -> RefitReport:
        import time

        t0 = time.perf_counter()
        d = self._native.refit(timeout, cancel, step, allow_older)
        report = RefitReport(**d)
        report.python_s = time.perf_counter() - t0
        return report

    def stage(self, *, step: Optional[int] = None, timeout: float = 60.0,
              allow_older: bool = False) -> Staged:
        """Moves and verifies a step into reshard's bank that is not live, while the engine keeps
        serving the live weights untouched; :meth:`apply` makes it live when the engine chooses.
        ``step=None`` stages the newest step above the live one every publisher is ready at;
        ``step=n`` waits for exactly step ``n`` across all publishers (a :class:`Timeout` names
        each publisher rank that lacks it and the step it has) and refuses a step older than the
        live one (:class:`InvalidInput`) unless ``allow_older``. ``timeout`` bounds the whole
        call, connecting included when the receiver has not connected yet. A stage replaces a
        step staged before and not applied (its handle is then refused by :meth:`apply`), and
        overwrites the step :meth:`rollback` would return to."""
        return self._native.stage(timeout, step, allow_older, None)

    def _stage(self, step: Optional[int], timeout: float, allow_older: bool,
               cancel: Optional[Any]) -> Staged:
        return self._native.stage(timeout, step, allow_older, cancel)

    def apply(self, staged: Staged) -> RefitReport:
        """Makes a staged step live: with ``install="swap"`` a pointer swap (:meth:`weights`
        then lends the new step), with ``install="copy"`` the copy into the engine's arrays.
        Returns the refit's report (``apply_s``: this call's swap and copy; ``newer_step``: a
        newer step seen right after staging, if any; applying it anyway is allowed). Raises
        :class:`NotApplicable`, changing nothing, for a handle of another receiver, one applied
        already, one a later :meth:`stage` or :meth:`refit` replaced, or one whose buffers were
        discarded."""
        import time

        t0 = time.perf_counter()
        report = RefitReport(**self._native.apply(staged))
        report.python_s = time.perf_counter() - t0
        return report

    def rollback(self) -> RollbackReport:
        """Makes the previous step live again from reshard's bank that still holds it: no wire,
        no publisher needed (they may be gone); with ``install="copy"`` it is copied into the
        engine's arrays. Raises :class:`NoRollback`, changing nothing, when there is none: the
        first step, a rollback already went back, or a :meth:`stage` or :meth:`refit` has landed
        in that bank since (``reason`` says which)."""
        import time

        t0 = time.perf_counter()
        report = RollbackReport(**self._native.rollback())
        report.python_s = time.perf_counter() - t0
        return report

    async def _cancellable(self, call: Any, *args: Any) -> Any:
        """Runs ``call(*args, token)`` on a worker thread, cancelled through its own token (see
        :meth:`refit_async`)."""
        loop = asyncio.get_running_loop()
        # One token per call, made before the call is queued: a cancel that comes before the
        # worker thread starts it is seen by it (it then does nothing), and a cancel of this
        # call never reaches another.
        token = _reshard.CancelToken()
        future = loop.run_in_executor(None, call, *args, token)
        swallowed = 0
        while True:
            try:
                result = await asyncio.shield(future)
                break
            except asyncio.CancelledError:
                if future.cancelled():
                    raise
                # The call's outcome decides (awaited again: at once if it is over, else once
                # the worker has stopped, within ~10 ms, or finished).
                token.cancel()
                swallowed += 1
            except ReshardError:
                if swallowed:
                    # Stopped by the cancel (Aborted), or failed on its own while stopping:
                    # either way nothing was installed, and the cancel is what the caller sees.
                    raise asyncio.CancelledError() from None
                raise
        task = asyncio.current_task()
        for _ in range(swallowed):
            # The cancellations were answered with the result, not honoured: say so to asyncio
            # (timeouts and task groups count them).
            task.uncancel()
        return result

    async def refit_async(self, *, timeout: float = 300.0, step: Optional[int] = None,
                          allow_older: bool = False) -> RefitReport:
        """:meth:`refit` on a worker thread. Cancelling the task cancels the refit: one that has
        not started yet never starts, one that is running stops with the weights untouched, and
        the task raises :class:`asyncio.CancelledError`. A refit that had already installed when
        the cancel reached it returns its report instead: the weights changed, so the caller
        learns which step they hold."""
        return await self._cancellable(
            lambda token: self._refit(timeout, token, step, allow_older))

    async def stage_async(self, *, step: Optional[int] = None, timeout: float = 60.0,
                          allow_older: bool = False) -> Staged:
        """:meth:`stage` on a worker thread, next to generation. Cancelling the task stops the
        stage (the live weights are untouched either way); a stage that had finished when the
        cancel reached it returns its handle."""
        return await self._cancellable(
            lambda token: self._stage(step, timeout, allow_older, token))

    async def apply_async(self, staged: Staged) -> RefitReport:
        """:meth:`apply` on a worker thread (a copy install's copy takes milliseconds)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.apply, staged)

    async def rollback_async(self) -> RollbackReport:
        """:meth:`rollback` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(None, self.rollback)

    def wait_for_step(self, step: int, *, timeout: float = 300.0) -> Optional[RefitReport]:
        """Refits until the live step is at least ``step``; returns the last report (None when
        it already was). ``timeout`` seconds (``inf``: no limit) bound the whole call, however
        many refits it takes (connecting included): one deadline from the call's start, never
        restarted by a refit that installed an older step. Raises :class:`Timeout` naming the
        step wanted and the live one when the deadline passes."""
        if not timeout >= 0:  # NaN and negative values alike
            raise _invalid(f"timeout must be a number of seconds >= 0, or inf for no timeout; "
                           f"{timeout} is not")
        deadline = time.monotonic() + timeout
        report = None
        live = self.live_step
        if live is not None and live >= step:
            return None
        while report is None or report.step < step:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise _error(Timeout, "timeout", "no time left", retryable=True)
                report = self.refit(timeout=left)
            except Timeout as e:
                raise _error(
                    Timeout, "timeout",
                    f"receiver rank {self.rank}: the live step is {self.live_step}, not yet "
                    f"step {step}, after wait_for_step's timeout of {timeout} s ({e})",
                    retryable=True) from e
        return report

    def close(self) -> None:
        """Releases reshard's buffers and its hold on the engine's arrays. Arrays from
        :meth:`weights` stay valid: each keeps its own buffer alive."""
        self._native.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
