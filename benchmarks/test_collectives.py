"""Every collective of gpudist's backend against the same call through the transport's own library, on the same group
and buffers (``gpudist.bench.collectives.measure_collective``: what ``gpudist bench collectives`` sweeps). Gloo: raw
``torch.distributed``; NCCL (CUDA): raw ``cupy.cuda.nccl`` (it has no all-to-all of its own: that case skips).

Two ranks, spawned once per session (the ``gloo_pool`` fixture); each round counts at its slowest rank, and gpudist,
gpudist inside ``comm.unchecked()`` and the raw call run round-robin in it. The gated ratio is raw time / gpudist
time with the cross-rank check on (the default); the unchecked one is in ``extra_info``.

    pytest benchmarks/ --benchmark-only -k collectives [--gate]
"""

from __future__ import annotations

import os

import pytest
import torch

from gpudist.bench.collectives import BASELINES, BUS_FACTORS, collective_rank

from .conftest import DEVICES
from .gate import ratio_summary

WORLD = 2
SIZES = {"64K": 64 << 10, "4M": 4 << 20}
"""Bytes per op: 64 KiB (latency-bound: gpudist's per-op overhead shows), 4 MiB (bandwidth-bound)."""


def _backend(device: str) -> str:
    if device == "cpu":
        return "gloo"
    if torch.cuda.device_count() < WORLD and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        pytest.skip(f"NCCL at world size {WORLD} needs {WORLD} GPUs (or NCCL_MULTI_RANK_GPU_ENABLE=1 on NCCL >= 2.30)")
    return "nccl"


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("op", list(BUS_FACTORS))
@pytest.mark.parametrize("device", DEVICES)
def test_collective(ratio, gloo_pool, rounds, device, op, size):
    backend = _backend(device)
    if backend == "nccl" and op == "all_to_all":
        pytest.skip("cupy.cuda.nccl has no all-to-all call to compare with (NCCL's is grouped send/recv)")
    nbytes = SIZES[size]
    row = gloo_pool.run(collective_rank, backend, op, nbytes // 4 // WORLD * WORLD, rounds)[0]
    ours, raw = row["rounds_s"]["gpudist"], row["rounds_s"]["baseline"]
    seconds = ratio_summary(ours, raw)["gpudist_s"]
    ratio.record(
        device,
        ours,
        raw,
        peer_name=f"{BASELINES[backend]} ({backend}, world {WORLD})",
        bytes_moved=row["bytes"],
        size=f"{row['bytes']} bytes, world {WORLD}",
        bandwidth_GBps=row["bytes"] / seconds / 1e9 * BUS_FACTORS[op](WORLD),
        bandwidth="busbw (nccl-tests)",
        ratio_unchecked=ratio_summary(row["rounds_s"]["gpudist_nocheck"], raw)["ratio"],
        iters=row["iters"],
    )
