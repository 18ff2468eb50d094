"""The peers' settings that ``gpudist bench gpu``'s strategies part shares with the CPU strategy benchmarks
(``benchmarks/peers.py``, which re-exports these and has the rest: the variants, the same-function check, interleaved
timing, the summary): the optimizer every variant steps and the sharding units on both sides."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LR", "adamw", "fsdp_units", "gpudist_units"]

LR = 1e-4
"""The learning rate of every variant's AdamW."""


def adamw(params, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, fused=True) if fused else torch.optim.AdamW(params, lr=LR)


def fsdp_units(workload: str, model: nn.Module) -> list[nn.Module]:
    """FSDP units: each Linear of the MLP, each transformer block of the GPT (torchtitan's choice)."""
    if workload == "mlp":
        return [m for m in model.modules() if isinstance(m, nn.Linear)]
    return list(model.blocks)


def gpudist_units(workload: str):
    return {nn.Linear} if workload == "mlp" else None  # None: each ModuleList entry (the blocks)
