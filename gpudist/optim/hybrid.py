"""HybridShardedOptimizer: the optimizer side of 3D parallelism (seeds: HybridShardedOptimizer)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .. import kernels
from ..comm import ReductionOperation
from ..config import ShardingConfiguration
from ..models.hybrid import HybridShardedModel
from ..models.layout import ParallelLayout
from .base import ShardedOptimizer
from .zero import data_parallel_optimizer

__all__ = ["HybridShardedOptimizer"]


class HybridShardedOptimizer(ShardedOptimizer):
    """Steps a :class:`~gpudist.HybridShardedModel`'s parameters: each rank holds its pipeline stage's
    tensor-parallel shards, and the optimizer runs data parallelism in the model's data group last, after the
    model made gradients whole over the tensor group, the micro-batches and the stages.

    ``zero_stage``: 0 averages gradients with an all-reduce and keeps the full optimizer state on every replica
    (DDP); 1 (default) shards the optimizer state over the replicas (ZeRO-1: reduce-scatter, step the owned
    part, all-gather the parameters); 2 also frees the gradients this replica does not own (ZeRO-2). The sizes
    must be the model's layout (the seeds' signature; ``-1`` takes the ranks left over).

    ``config.max_grad_norm`` clips to the L2 norm of the whole model's gradient, as
    ``torch.nn.utils.clip_grad_norm_`` on one process: after the replica average, every rank sums the squares it
    owns (its tensor shards of split parameters, tensor rank 0 the unsplit ones, the first holding stage a tied
    parameter; with ZeRO its range of the replicas' average, with DDP replica 0), and one 8-byte all-reduce over
    all ranks gives the norm. With ZeRO a non-finite norm skips the step on every rank, as ZeRO does.
    """

    strategy = "hybrid"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: ShardingConfiguration,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = -1,
        *,
        zero_stage: int = 1,
    ):
        super().__init__(optimizer, config)
        inner_class = data_parallel_optimizer(zero_stage)
        model = self.model()
        if not isinstance(model, HybridShardedModel):
            raise TypeError(
                "HybridShardedOptimizer steps a HybridShardedModel built from the same config; build the "
                "model first and pass torch.optim.X(model.parameters()) here"
            )
        layout = ParallelLayout.resolve(
            self.comm.world_size, pipeline_parallel_size, tensor_parallel_size, data_parallel_size
        )
        if layout != model.layout:
            raise ValueError(
                f"HybridShardedOptimizer: {layout.describe()} differs from the model's "
                f"{model.layout.describe()}; pass the model's sizes"
            )
        self.zero_stage = zero_stage
        data_config = dataclasses.replace(config, backend=model.data_group)
        self.inner = inner_class(optimizer, data_config)
        if config.max_grad_norm is not None:  # the inner optimizer sees the data group only: it clips (and ZeRO
            self.inner.gradient_norm_fn = self._global_norm  # skips non-finite steps) with the whole model's norm
        model.reduce_data_parallel = False  # the inner optimizer averages (or reduce-scatters) over replicas
        self.last_grad_norm = math.nan
        if zero_stage == 0:  # the replicas' averaged gradients are equal: replica 0 counts them
            first = model.data_parallel_rank == 0
            self._norm_params = [p for p in self._params() if p.requires_grad and first and model.counts_in_norm(p)]
        else:  # each replica counts its own range of the flat gradient, [lo, hi) of the inner optimizer's buffer
            self._norm_spans = self._owned_spans(model)

    def _owned_spans(self, model: HybridShardedModel) -> list[tuple[int, int]]:
        inner = self.inner
        layout, spans = inner._flat.layout, []
        for start, length, at in inner._segment_spans():
            for p, offset, numel in zip(inner._flat_params, layout.offsets, layout.numels, strict=True):
                lo, hi = max(start, offset), min(start + length, offset + numel)
                if lo < hi and model.counts_in_norm(p):
                    lo, hi = at + lo - start, at + hi - start
                    if spans and spans[-1][1] == lo:
                        spans[-1] = (spans[-1][0], hi)
                    else:
                        spans.append((lo, hi))
        return spans

    def _global_norm(self) -> float:
        """The whole model's gradient norm, from the squares this rank counts (collective over all ranks)."""
        if self.zero_stage == 0:
            grads = [p.grad.reshape(-1) for p in self._norm_params if p.grad is not None]
        else:
            grads = [self.inner._grad[lo:hi] for lo, hi in self._norm_spans]
        total = torch.zeros(1, dtype=torch.float64, device=self.comm.device)
        for g in grads:
            total += kernels.squared_norm(g.contiguous()).double()
        self.comm.all_reduce(total, ReductionOperation.SUM)
        self.last_grad_norm = math.sqrt(total.item())
        return self.last_grad_norm

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
