"""Model strategies: ShardedModel (base) and one module per strategy family."""

from .base import ShardedModel
from .ddp import DDPModel

__all__ = ["DDPModel", "ShardedModel"]
