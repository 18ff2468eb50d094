"""HybridShardedOptimizer: the optimizer side of 3D parallelism (seeds: HybridShardedOptimizer)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import ShardingConfiguration
from ..models.hybrid import HybridShardedModel
from ..models.layout import ParallelLayout
from .base import ShardedOptimizer
from .ddp import DDPOptimizer
from .zero import ZeRO1Optimizer, ZeRO2Optimizer

__all__ = ["HybridShardedOptimizer"]

_DATA_PARALLEL = {0: DDPOptimizer, 1: ZeRO1Optimizer, 2: ZeRO2Optimizer}


class HybridShardedOptimizer(ShardedOptimizer):
    """Steps a :class:`~gpudist.HybridShardedModel`'s parameters: each rank holds its pipeline stage's
    tensor-parallel shards, and the optimizer runs data parallelism in the model's data group last, after the
    model made gradients whole over the tensor group, the micro-batches and the stages.

    ``zero_stage``: 0 averages gradients with an all-reduce and keeps the full optimizer state on every replica
    (DDP); 1 (default) shards the optimizer state over the replicas (ZeRO-1: reduce-scatter, step the owned
    part, all-gather the parameters); 2 also frees the gradients this replica does not own (ZeRO-2). The sizes
    must be the model's layout (the seeds' signature; ``-1`` takes the ranks left over).
    """

    strategy = "hybrid"

    def __init__(self, optimizer: torch.optim.Optimizer, config: ShardingConfiguration,
                 pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1, data_parallel_size: int = -1, *,
                 zero_stage: int = 1):  # fmt: skip
        super().__init__(optimizer, config)
        if zero_stage not in _DATA_PARALLEL:
            raise ValueError(f"zero_stage={zero_stage!r}; use 0 (replicated state), 1 (ZeRO-1) or 2 (ZeRO-2)")
        model = self.model()
        if not isinstance(model, HybridShardedModel):
            raise TypeError("HybridShardedOptimizer steps a HybridShardedModel built from the same config; build the "
                            "model first and pass torch.optim.X(model.parameters()) here")  # fmt: skip
        layout = ParallelLayout.resolve(self.comm.world_size, pipeline_parallel_size, tensor_parallel_size,
                                        data_parallel_size)  # fmt: skip
        if layout != model.layout:
            raise ValueError(f"HybridShardedOptimizer: {layout.describe()} differs from the model's "
                             f"{model.layout.describe()}; pass the model's sizes")  # fmt: skip
        if config.max_grad_norm is not None:
            raise ValueError("HybridShardedOptimizer does not clip gradients yet (the norm spans stages, tensor "
                             "shards and replicas); set max_grad_norm=None")  # fmt: skip
        self.zero_stage = zero_stage
        data_config = dataclasses.replace(config, backend=model.data_group)
        self.inner = _DATA_PARALLEL[zero_stage](optimizer, data_config)
        model.reduce_data_parallel = False  # the inner optimizer averages (or reduce-scatters) over replicas

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
