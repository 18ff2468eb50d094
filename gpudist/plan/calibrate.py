"""Calibrating a :class:`~gpudist.plan.Cluster` on this machine (``gpudist plan --measure``): all-reduces over local
ranks give its links, a matmul its FLOP/s and an add its memory bandwidth."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from .model import Cluster


def _measure_rank(comm, sizes: Sequence[int], rounds: int) -> dict[str, float]:
    """On each rank: the time of an all-reduce of each size (median of ``rounds``), and a matmul and copy probe."""
    out: dict[str, float] = {}
    for size in sizes:
        t = torch.zeros(size // 4)
        comm.all_reduce(t)
        times = []
        for _ in range(rounds):
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - start)
        out[f"all_reduce_{size}"] = sorted(times)[len(times) // 2]
    if comm.rank == 0:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b
        start = time.perf_counter()
        for _ in range(8):
            a @ b
        out["flops"] = 8 * 2 * 512**3 / (time.perf_counter() - start)
        x = torch.zeros(1 << 22)
        y = torch.ones(1 << 22)
        x.add_(y)
        start = time.perf_counter()
        for _ in range(8):
            x.add_(y)
        out["memory_bandwidth"] = 8 * 3 * x.numel() * 4 / (time.perf_counter() - start)
    return out


def measure_cluster(base: Cluster | None = None, backend: str = "gloo", world_size: int = 2) -> Cluster:
    """Calibrate ``base`` on this machine: all-reduces of 4 KiB and 4 MiB over ``world_size`` local ranks give the
    latency and bandwidth of both link classes (one machine: intra = inter), a 512x512 matmul the FLOP/s, and an
    add of 16 MiB the memory bandwidth (per rank: the other ranks' processes share the cores). The host term is
    dropped (``host_scale=0``): on the CPU the host runs the compute itself, and what it spends beyond the measured
    FLOP/s is ``step_overhead``."""
    from ..testing import run_ranks

    small, large = 4 << 10, 4 << 20
    results = run_ranks(_measure_rank, world_size, backend, sizes=(small, large), rounds=7)
    r0 = results[0]
    n = world_size
    t_small, t_large = r0[f"all_reduce_{small}"], r0[f"all_reduce_{large}"]
    factor = 2 * (n - 1) / n
    bandwidth = factor * (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - factor * small / bandwidth, 1e-7) / (2 * (n - 1))
    base = base or Cluster()
    return replace(
        base,
        nodes=1,
        devices_per_node=world_size,
        device_flops=r0["flops"] / world_size,
        memory_bandwidth=r0["memory_bandwidth"],
        intra_bandwidth=bandwidth,
        inter_bandwidth=bandwidth,
        intra_latency=latency,
        inter_latency=latency,
        chunked_overlap=backend != "nccl",
        host_scale=0.0,
    )
