"""Model strategies: ShardedModel (base) and one module per strategy family."""

from .base import ShardedModel
from .ddp import DDPModel
from .hybrid import HybridShardedModel
from .pipeline import PipelineParallelModel
from .tensor import TensorParallelModel
from .zero import ZeRO1Model, ZeRO2Model
from .zero3 import FSDPModel, ZeRO3Model

__all__ = [
    "DDPModel",
    "FSDPModel",
    "HybridShardedModel",
    "PipelineParallelModel",
    "ShardedModel",
    "TensorParallelModel",
    "ZeRO1Model",
    "ZeRO2Model",
    "ZeRO3Model",
]
