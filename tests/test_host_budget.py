"""Host work per steady-state step, counted like memory bytes: what a step checks and builds that wrap time already
checked and built. On a GPU the host's time is most of a step's for models up to a few hundred million parameters
(the H200 run of 2026-11-28: docs/results.md#on-a-gpu), and each of these costs the host microseconds: an argument
check of a collective, a call signature, a layout, a fused step's buffer checks. benchmarks/host_overhead.py times
them; this counts them, so that none creeps back into a step unnoticed."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch import nn

import gpudist
import gpudist.comm.base as comm_base
import gpudist.kernels.bucket as bucket_kernels
import gpudist.kernels.layout as layout_module
import gpudist.kernels.optim as optim_kernels
from gpudist.strategies import DATA_PARALLEL_PAIRS
from gpudist.testing import run_ranks

STEPS = 2

BUDGET = {  # per rank and steady-state step: what is left, and why
    "ddp": {},  # nothing: the buckets' all-reduces were planned when the model was wrapped
    # nothing: the parameter gather's broadcasts (or all-gather) are planned at the first step
    "zero1": {},
    # nothing: each bucket's reduce-scatter is planned by shape at wrap time (its send buffer is new every step:
    # ZeRO-2's memory), the gather at the first step
    "zero2": {},
    # nothing: FSDP's gathers and reduce-scatters (into buffers made and freed every step) are planned by shape
    "fsdp": {},
}


@pytest.fixture
def counted(monkeypatch) -> collections.Counter:
    """Count, from here on, the checks and builds a step should not need (every thread together)."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def counting(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            with lock:
                counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    counting(comm_base.CommunicationBackend, "_check_tensor", "check_tensor")
    counting(comm_base.Signature, "__init__", "signature")
    counting(layout_module.FlatLayout, "__init__", "layout_build")
    counting(bucket_kernels, "_validate", "pack_check")
    counting(optim_kernels, "_check_buffers", "step_check")
    return counts


def _steady_steps(comm, strategy: str, counts: collections.Counter, meet: threading.Barrier) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=0.002)  # three buckets
    model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
    model = model_cls(net, config)
    opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # warm-up: plans and buffers made
        step()
    meet.wait()  # the ranks are threads: met outside gpudist, so that meeting counts nothing
    if comm.rank == 0:
        counts.clear()
    meet.wait()
    for _ in range(STEPS):
        step()


@pytest.mark.parametrize("strategy", list(BUDGET))
def test_a_steady_state_step_checks_and_builds_within_its_budget(strategy, counted):
    """Catches a collective's argument checks and signature, a layout build, or a fused step's buffer checks come back
    into a steady-state step where wrap time already did them (DDP: none at all). Two ranks in memory; the counts of
    both ranks over two steps, after three warm-up steps."""
    world = 2
    run_ranks(_steady_steps, world, "inmemory", strategy=strategy, counts=counted, meet=threading.Barrier(world))
    per_step = {k: v / (world * STEPS) for k, v in counted.items() if v}
    budget = BUDGET[strategy]
    over = {k: v for k, v in per_step.items() if v > budget.get(k, 0)}
    assert not over, f"{strategy}: per rank and step {per_step}, over the budget {budget}"
