"""Model strategies: ShardedModel (base) and one module per strategy family."""

from .base import ShardedModel
from .ddp import DDPModel
from .zero import ZeRO1Model, ZeRO2Model

__all__ = ["DDPModel", "ShardedModel", "ZeRO1Model", "ZeRO2Model"]
