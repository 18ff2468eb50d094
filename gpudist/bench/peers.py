"""The peers' settings that ``gpudist bench gpu``'s strategies part shares with the CPU strategy benchmarks
(``benchmarks/peers.py``, which re-exports these and has the rest: the variants, the same-function check, interleaved
timing, the summary): the optimizer every variant steps and the sharding units on both sides."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LR", "adamw", "fsdp_units", "fully_sharded", "gpudist_units", "zero_redundancy"]

LR = 1e-4
"""The learning rate of every variant's AdamW."""


def adamw(params, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, fused=True) if fused else torch.optim.AdamW(params, lr=LR)


def zero_redundancy(params, process_group, optimizer_class=torch.optim.AdamW, **kw):
    """torch's ZeRO peer at its best: ``ZeroRedundancyOptimizer`` with parameters as bucket views (fused AdamW by
    default), over the given process group."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        params,
        optimizer_class=optimizer_class,
        process_group=process_group,
        lr=LR,
        parameters_as_bucket_view=True,
        **({"fused": True} if optimizer_class is torch.optim.AdamW else {}) | kw,
    )


def fsdp_units(workload: str, model: nn.Module) -> list[nn.Module]:
    """FSDP units: each Linear of the MLP, each transformer block of the GPT (torchtitan's choice)."""
    if workload == "mlp":
        return [m for m in model.modules() if isinstance(m, nn.Linear)]
    return list(model.blocks)


def fully_sharded(workload: str, model: nn.Module, process_group, device: torch.device) -> nn.Module:
    """FSDP2, torch's FSDP peer: ``fully_shard`` on each unit (:func:`fsdp_units`), then on the root, over a mesh of
    ``process_group``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(process_group, device.type)
    for unit in fsdp_units(workload, model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gpudist_units(workload: str):
    return {nn.Linear} if workload == "mlp" else None  # None: each ModuleList entry (the blocks)
