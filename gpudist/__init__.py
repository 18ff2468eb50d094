"""gpudist: data-, model- and pipeline-parallel training for PyTorch.

Triton kernels feed NCCL through CuPy on GPUs; the same strategy classes run on CPU over Gloo, MPI or an
in-memory backend. See docs/strategies.md for the strategy guide and docs/architecture.md for the architecture.
"""

from importlib.metadata import PackageNotFoundError, version

from . import compression
from .capture import CapturedStep, capture
from .checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointWrite,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from .comm import (
    CollectiveMismatchError,
    CommunicationBackend,
    CommunicationError,
    CommunicationTimeoutError,
    GlooCommunicationBackend,
    InMemoryCommunicationBackend,
    ReductionOperation,
)
from .config import ShardingConfiguration
from .elastic import ElasticOptimizer
from .launch import init
from .plan import plan
from .strategies import (
    AsyncSGDOptimizer,
    DDPModel,
    DDPOptimizer,
    FSDPModel,
    GradientCompressionOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
    OptimizationResult,
    PipelineParallelModel,
    ShardedModel,
    ShardedOptimizer,
    TensorParallelModel,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
    ZeRO3Optimizer,
)
from .topology import NodeLayout, Topology, detect_layout

try:
    __version__ = version("gpudist")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+source"

__all__ = [
    "AsyncSGDOptimizer",
    "CapturedStep",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWrite",
    "CollectiveMismatchError",
    "CommunicationBackend",
    "CommunicationError",
    "CommunicationTimeoutError",
    "DDPModel",
    "DDPOptimizer",
    "ElasticOptimizer",
    "FSDPModel",
    "GlooCommunicationBackend",
    "GradientCompressionOptimizer",
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "InMemoryCommunicationBackend",
    "MPICommunicationBackend",
    "NCCLCommunicationBackend",
    "NodeLayout",
    "OptimizationResult",
    "PipelineParallelModel",
    "ReductionOperation",
    "ShardedModel",
    "ShardedOptimizer",
    "ShardingConfiguration",
    "TensorParallelModel",
    "Topology",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
    "__version__",
    "capture",
    "compression",
    "detect_layout",
    "init",
    "latest_checkpoint",
    "load_checkpoint",
    "plan",
    "read_manifest",
    "save_checkpoint",
]


def __getattr__(name: str):
    """``gpudist.MPICommunicationBackend`` and ``gpudist.NCCLCommunicationBackend`` import their extras on use."""
    if name in ("MPICommunicationBackend", "NCCLCommunicationBackend"):
        from . import comm

        return getattr(comm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
