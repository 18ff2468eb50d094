"""Model strategies: ShardedModel (base) and one module per strategy family."""

from .base import ShardedModel
from .ddp import DDPModel
from .pipeline import PipelineParallelModel
from .zero import ZeRO1Model, ZeRO2Model
from .zero3 import FSDPModel, ZeRO3Model

__all__ = ["DDPModel", "FSDPModel", "PipelineParallelModel", "ShardedModel", "ZeRO1Model", "ZeRO2Model", "ZeRO3Model"]
