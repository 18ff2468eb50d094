"""Optimizer strategies: ShardedOptimizer (base) and one module per strategy family."""

from .async_sgd import AsyncSGDOptimizer
from .base import OptimizationResult, ShardedOptimizer
from .compression import GradientCompressionOptimizer
from .ddp import DDPOptimizer
from .elastic import ElasticOptimizer
from .hybrid import HybridShardedOptimizer
from .zero import ZeRO1Optimizer, ZeRO2Optimizer, ZeRO3Optimizer

__all__ = [
    "AsyncSGDOptimizer",
    "DDPOptimizer",
    "ElasticOptimizer",
    "GradientCompressionOptimizer",
    "HybridShardedOptimizer",
    "OptimizationResult",
    "ShardedOptimizer",
    "ZeRO1Optimizer",
    "ZeRO2Optimizer",
    "ZeRO3Optimizer",
]
