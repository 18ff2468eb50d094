"""ZeRO model wrappers."""

from __future__ import annotations

from .ddp import DDPModel

__all__ = ["ZeRO1Model"]


class ZeRO1Model(DDPModel):
    """ZeRO stage 1, model side: parameters and gradients replicated, gradients averaged in buckets during
    backward exactly as :class:`DDPModel` does. The sharding is the optimizer's: pair it with
    :class:`gpudist.ZeRO1Optimizer` built from the same configuration, which keeps 1/N of the optimizer state
    and all-gathers the updated parameters."""

    strategy = "zero1"
