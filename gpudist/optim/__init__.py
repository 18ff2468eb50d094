"""Optimizer strategies: ShardedOptimizer (base) and one module per strategy family."""

from .base import OptimizationResult, ShardedOptimizer
from .compression import GradientCompressionOptimizer
from .ddp import DDPOptimizer
from .async_sgd import AsyncSGDOptimizer
from .hybrid import HybridShardedOptimizer
from .zero import ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer

__all__ = ["AsyncSGDOptimizer", "DDPOptimizer", "GradientCompressionOptimizer", "HybridShardedOptimizer", "OptimizationResult",
           "ShardedOptimizer", "ZeRO1Optimizer", "ZeRO2Optimizer", "ZeRO3Optimizer"]
