"""The strategies, one module (or folder) per family, each holding its model wrapper, its optimizer and its traffic.

=================  =========================================================  ======================================
family             classes                                                    module
=================  =========================================================  ======================================
base classes       ShardedModel, ShardedOptimizer, OptimizationResult         ``model``, ``optimizer``
DDP                DDPModel, DDPOptimizer                                     ``ddp``
ZeRO-1 / ZeRO-2    ZeRO1Model, ZeRO2Model, ZeRO1Optimizer, ZeRO2Optimizer     ``zero`` (+ ``flat_optimizer``)
ZeRO-3 / FSDP      ZeRO3Model, FSDPModel, ZeRO3Optimizer                      ``fsdp/``
pipeline           PipelineParallelModel                                      ``pipeline/``
tensor             TensorParallelModel and the parallel layers                ``tensor/``
3D hybrid          HybridShardedModel, HybridShardedOptimizer                 ``hybrid`` (+ ``layout``)
compression        GradientCompressionOptimizer                               ``compression``
async SGD          AsyncSGDOptimizer                                          ``async_sgd``
=================  =========================================================  ======================================

:class:`gpudist.ElasticOptimizer` drives checkpoints, so it lives above them, in ``gpudist.elastic``.
"""

from .async_sgd import AsyncSGDOptimizer
from .compression import GradientCompressionOptimizer
from .ddp import DDPModel, DDPOptimizer
from .fsdp import FSDPModel, ZeRO3Model, ZeRO3Optimizer
from .hybrid import HybridShardedModel, HybridShardedOptimizer
from .model import ShardedModel
from .optimizer import OptimizationResult, ShardedOptimizer
from .pipeline import PipelineParallelModel
from .tensor import TensorParallelModel
from .zero import ZeRO1Model, ZeRO1Optimizer, ZeRO2Model, ZeRO2Optimizer

__all__ = [
    "DATA_PARALLEL_PAIRS",
    "AsyncSGDOptimizer",
    "DDPModel",
    "DDPOptimizer",
    "FSDPModel",
    "GradientCompressionOptimizer",
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "OptimizationResult",
    "PipelineParallelModel",
    "ShardedModel",
    "ShardedOptimizer",
    "TensorParallelModel",
    "ZeRO1Model",
    "ZeRO1Optimizer",
    "ZeRO2Model",
    "ZeRO2Optimizer",
    "ZeRO3Model",
    "ZeRO3Optimizer",
]

DATA_PARALLEL_PAIRS: dict[str, tuple[type[ShardedModel], type[ShardedOptimizer]]] = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "zero3": (ZeRO3Model, ZeRO3Optimizer),
    "fsdp": (FSDPModel, ZeRO3Optimizer),
}
"""The data-parallel strategies by name: each model wrapper and the optimizer that pairs with it (the examples, the
benchmarks and the tests pick strategies by these names)."""
