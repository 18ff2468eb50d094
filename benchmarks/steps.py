"""One training step of each data-parallel strategy against its PyTorch peer at its best settings: the rank code of
the pytest-benchmark tier's strategy cases (``benchmarks/test_strategies.py``). The variants, the same-function check
and the interleaved timing are ``benchmarks/peers.py``'s, as ``python -m benchmarks.ddp`` and ``benchmarks.zero`` use.

Pairs: DDP vs torch DDP (``gradient_as_bucket_view=True``, ``static_graph=True``, fused AdamW); ZeRO-1 and ZeRO-2 vs
``ZeroRedundancyOptimizer`` (fused AdamW, ``parameters_as_bucket_view=True``; torch has no ZeRO-2 of its own); FSDP
(``FSDPModel`` + ``ZeRO3Optimizer``) vs FSDP2 (``fully_shard`` on the same units and the root, fused AdamW).
"""

from __future__ import annotations

import torch

from . import peers

__all__ = ["PAIRS", "step_rank"]

PAIRS = {
    "ddp": lambda comm, workload, x, y, bucket_mb: peers.torch_ddp_variant(workload, x, y, True, bucket_mb),
    "zero1": lambda comm, workload, x, y, bucket_mb: peers.torch_zero_variant(workload, x, y, True, bucket_mb),
    "zero2": lambda comm, workload, x, y, bucket_mb: peers.torch_zero_variant(workload, x, y, True, bucket_mb),
    "fsdp": lambda comm, workload, x, y, bucket_mb: peers.fsdp2_variant(workload, x, y, True),
}
"""gpudist strategy -> its peer at its best settings (a ``peers.Variant`` factory)."""


def step_rank(comm, strategy: str, workload: str, batch: int, steps: int, rounds: int, bucket_mb: float) -> dict:
    """On every rank: gpudist's ``strategy`` and its peer, checked to train the same function (two steps from the
    same values against a local reference), then timed in interleaved rounds of ``steps`` steps (each round at its
    slowest rank). Returns both variants' per-round seconds per step, the check, and gpudist's bytes sent per step."""
    torch.manual_seed(0)
    batches = peers.rank_batches(workload, batch, comm.world_size)
    x, y = batches[comm.rank]
    units = peers.gpudist_units(workload) if strategy == "fsdp" else None
    ours = peers.gpudist_variant(comm, workload, x, y, strategy, bucket_mb, units=units)
    peer = PAIRS[strategy](comm, workload, x, y, bucket_mb)
    res = peers.measure(comm, workload, batches, [ours, peer], steps, rounds)
    before = comm.stats.total_bytes
    ours.step()
    return {
        "ours": res["rounds"][ours.name]["wall"],
        "peer": res["rounds"][peer.name]["wall"],
        "peer_label": peer.label,
        "checks": res["checks"],
        "step_bytes": comm.stats.total_bytes - before,
    }
