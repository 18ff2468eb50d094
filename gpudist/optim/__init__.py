"""Optimizer strategies: ShardedOptimizer (base) and one module per strategy family."""

from .base import OptimizationResult, ShardedOptimizer
from .ddp import DDPOptimizer

__all__ = ["DDPOptimizer", "OptimizationResult", "ShardedOptimizer"]
