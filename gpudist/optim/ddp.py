"""DDPOptimizer: replicated optimizer state; gradients averaged over ranks before each step."""

from __future__ import annotations

import torch

from .. import kernels
from ..comm import ReductionOperation
from ..flat import FlatBuffer, assign_buckets
from .base import ShardedOptimizer

__all__ = ["DDPOptimizer"]


class DDPOptimizer(ShardedOptimizer):
    """Data-parallel optimizer: every rank holds the full optimizer state and applies the same update.

    With a ``DDPModel`` built from the same config, gradients arrive already averaged (the model reduced
    them during backward) and ``step`` only waits for that. With a plain module, ``step`` averages the
    gradients itself first: flattened into ``bucket_cap_mb`` buckets (one all-reduce each, 2(N-1)/N x P
    bytes per rank in all). Parameters that got no gradient on a rank count as zeros, so ranks always agree.
    """

    def reduce_gradients(self) -> None:
        model = self.model()
        if model is not None:
            return  # DDPModel averaged these gradients in its backward hooks; never reduce twice
        params = [p for p in self._params() if p.requires_grad]
        if self.comm.world_size == 1 or not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        cap = self.config.bucket_cap_bytes()
        wire_dtype = self.config.communication_dtype
        with torch.no_grad():
            for indices in assign_buckets(grads, cap, cap):
                group = [grads[i] for i in indices]
                flat = FlatBuffer.empty_like(group, dtype=wire_dtype or group[0].dtype, zero=False)
                kernels.pack(group, flat.data, scale=1.0 / self.comm.world_size)
                self.comm.all_reduce(flat.data, ReductionOperation.SUM)
                kernels.unpack(flat.data, group)
