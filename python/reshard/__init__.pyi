"""Type stubs of `reshard` (the implementation and its docstrings are in __init__.py)."""

import os
from dataclasses import dataclass
from typing import Any, ContextManager, Mapping, Optional, Union, overload

from typing_extensions import deprecated

import numpy as np

from ._reshard import (
    Aborted as Aborted,
    Busy as Busy,
    Closed as Closed,
    Config as Config,
    Decode as Decode,
    Guard as Guard,
    InconsistentTensor as InconsistentTensor,
    InProcessHub as InProcessHub,
    Internal as Internal,
    InvalidInput as InvalidInput,
    InvalidTable as InvalidTable,
    Layout as Layout,
    MissingCoverage as MissingCoverage,
    NoRollback as NoRollback,
    NotApplicable as NotApplicable,
    NotConnected as NotConnected,
    OutOfBounds as OutOfBounds,
    OverlappingOffers as OverlappingOffers,
    Panic as Panic,
    PeerUnknown as PeerUnknown,
    ReplicaDivergence as ReplicaDivergence,
    ReshardError as ReshardError,
    Staged as Staged,
    Timeout as Timeout,
    Transport as Transport,
    Unavailable as Unavailable,
    Unsupported as Unsupported,
    Verification as Verification,
)

Model = Union[str, Mapping[str, Any]]
Topology = Union[str, Mapping[str, int]]

def numpy_dtype(dtype: str, raw: bool = False) -> np.dtype: ...
def published_step(
    rendezvous: Union[str, InProcessHub], model: str, *, timeout: float = 30.0,
    after: Optional[int] = None,
) -> int: ...
def hf_model_config(
    config: Union[str, os.PathLike[str], Mapping[str, Any]], *, name: Optional[str] = None
) -> dict[str, Any]: ...
def model_config(
    preset: str, *, layers: Optional[int] = None, experts: Optional[int] = None,
    vocab: Optional[int] = None, dtype: Optional[str] = None, name: Optional[str] = None,
) -> dict: ...
def transports() -> list[dict]: ...
def receiver_params(model: Model, layout: Topology, rank: int) -> dict[str, tuple[tuple[int, ...], str]]: ...
def publisher_tensors(
    model: Model, topology: Topology, rank: int
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]: ...

__version__: str

class Publisher:
    rank: int
    model: str
    @overload
    def __init__(
        self, *, model: str, topology: Topology, rank: int,
        rendezvous: Union[str, InProcessHub], transport: Optional[str] = None,
        config: Optional[Mapping[str, Any]] = None, lease_ttl: float = 10.0,
        architecture: Optional[Model] = None,
    ) -> None: ...
    @overload
    @deprecated("model= is the rendezvous name: pass the configuration as architecture=")
    def __init__(
        self, *, model: Mapping[str, Any], topology: Topology, rank: int,
        rendezvous: Union[str, InProcessHub], transport: Optional[str] = None,
        config: Optional[Mapping[str, Any]] = None, lease_ttl: float = 10.0,
    ) -> None: ...
    @property
    def tensors(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str]]: ...
    @property
    def step(self) -> Optional[int]: ...
    def register(self, name: str, array: Any) -> None: ...
    def empty(self, name: str, shape: Optional[tuple] = None, dtype: Any = None) -> np.ndarray: ...
    def connect(self, *, timeout: float = ...) -> None: ...
    def unready(self) -> None: ...
    def ready(self) -> None: ...
    def publish(self, step: int) -> None: ...
    def wait_released(self, *, timeout: float = ...) -> dict: ...
    def updating(self, step: int, *, timeout: float = ...) -> ContextManager[dict]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Publisher: ...
    def __exit__(self, *exc: Any) -> None: ...

@dataclass
class RefitReport:
    step: int
    verified: bool
    reads: int
    wire_bytes: int
    stages: dict[str, float]
    e2e_s: float
    attribution: float
    discovery_s: float
    peers_loaded: int
    plan_rebuilt: bool
    checked_bytes: int
    rust_s: float
    copy_s: float
    native_s: float
    install: str = ...
    python_s: float = ...
    extra: dict = ...
    newer_step: Optional[int] = ...
    apply_s: float = ...

@dataclass
class RollbackReport:
    step: int
    rolled_back_from: int
    install: str
    install_s: float
    copy_s: float
    native_s: float
    python_s: float = ...

class Receiver:
    rank: int
    model: str
    install: str
    params: Optional[dict[str, Any]]
    @overload
    def __init__(
        self, *, model: str, layout: Topology, rank: int,
        rendezvous: Union[str, InProcessHub], params: Optional[Mapping[str, Any]] = None,
        transport: Optional[str] = None, config: Optional[Mapping[str, Any]] = None,
        timeout: float = 300.0, install: Optional[str] = None,
        architecture: Optional[Model] = None,
    ) -> None: ...
    @overload
    @deprecated("model= is the rendezvous name: pass the name, or its configuration as architecture=")
    def __init__(
        self, *, model: Mapping[str, Any], layout: Topology, rank: int,
        rendezvous: Union[str, InProcessHub], params: Optional[Mapping[str, Any]] = None,
        transport: Optional[str] = None, config: Optional[Mapping[str, Any]] = None,
        timeout: float = 300.0, install: Optional[str] = None,
    ) -> None: ...
    def connect(self, *, timeout: Optional[float] = None) -> None: ...
    async def connect_async(self, *, timeout: Optional[float] = None) -> None: ...
    @property
    def connected(self) -> bool: ...
    @property
    def architecture(self) -> dict[str, Any]: ...
    @property
    def live_step(self) -> Optional[int]: ...
    @property
    def staged_step(self) -> Optional[int]: ...
    def weights(self, framework: str = "numpy") -> dict[str, Any]: ...
    def refit(
        self, *, timeout: float = 300.0, step: Optional[int] = None, allow_older: bool = False
    ) -> RefitReport: ...
    async def refit_async(
        self, *, timeout: float = 300.0, step: Optional[int] = None, allow_older: bool = False
    ) -> RefitReport: ...
    def stage(
        self, *, step: Optional[int] = None, timeout: float = 60.0, allow_older: bool = False
    ) -> Staged: ...
    async def stage_async(
        self, *, step: Optional[int] = None, timeout: float = 60.0, allow_older: bool = False
    ) -> Staged: ...
    def apply(self, staged: Staged) -> RefitReport: ...
    async def apply_async(self, staged: Staged) -> RefitReport: ...
    def rollback(self) -> RollbackReport: ...
    async def rollback_async(self) -> RollbackReport: ...
    def wait_for_step(self, step: int, *, timeout: float = 300.0) -> Optional[RefitReport]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Receiver: ...
    def __exit__(self, *exc: Any) -> None: ...
