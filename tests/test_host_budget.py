"""Host work per steady-state step, counted like memory bytes: what a step checks and builds that wrap time already
checked and built. On a GPU the host's time is most of a step's for models up to a few hundred million parameters
(the H200 run of 2026-11-28: docs/results.md#on-a-gpu), and each of these costs the host microseconds: an argument
check of a collective, a call signature, a layout, a fused step's buffer checks. benchmarks/host_overhead.py times
them; this counts them, so that none creeps back into a step unnoticed. Allocations too: what gpudist's own code
allocates in a steady-state step, run with the Triton kernels (the GPU's path) through the interpreter."""

from __future__ import annotations

import collections
import os
import sys
import threading

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(width)])

    def forward(self, x):
        return self.layers(x)


def _warmed_up(comm, strategy: str | None, width: int = 1):
    """``strategy``'s model and optimizer on six blocks of ``width`` Linear(16, 16), in three buckets whatever the
    width (DDP, ZeRO: ~2 KB each at width 1) or a unit per block (FSDP), and a training step, taken three times (the
    warm-up: plans and buffers made). ``strategy`` None: the plain module with the same torch AdamW."""
    torch.manual_seed(0)
    net = nn.Sequential(*[_Block(width) for _ in range(6)])
    if strategy is None:
        model, opt = net, torch.optim.AdamW(net.parameters(), lr=1e-3)
    else:
        cap = 0.002 * width
        config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=cap, first_bucket_mb=cap)
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        model = model_cls(net, config, **({"auto_wrap_policy": {_Block}} if strategy == "fsdp" else {}))
        opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    return model, step


def _steady_steps(comm, strategy: str, counts: collections.Counter, meet: threading.Barrier) -> None:
    _, step = _warmed_up(comm, strategy)
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


# -- allocations --------------------------------------------------------------------------------------------------

ALLOCATIONS = {  # per rank and steady-state step, from the wrapped model: what is allocated by design, and why
    "ddp": lambda model: 0,  # gradients live in the buckets; every buffer and plan was made at wrap time
    "zero1": lambda model: 0,  # as DDP; the step's norm, verdict and scalars are kept from step to step
    # one send buffer per bucket: full gradients exist only while their bucket is in flight (ZeRO-2's memory)
    "zero2": lambda model: len(model._collective.buckets),
    # per unit: its gathered parameters in forward and again in backward (freed after each: FSDP's memory, as FSDP2)
    # and its reduce-scatter's send buffer; and the flat gradient buffer the first reduce after zero_grad takes
    "fsdp": lambda model: 3 * len(model._groups) + 1,
}
_GPUDIST_CODE = (os.path.dirname(gpudist.__file__), os.path.dirname(optim_kernels.__file__))
_TORCH = os.path.dirname(torch.__file__)
_USER_CODE = (os.path.join(_TORCH, "nn", "modules"), os.path.join(_TORCH, "optim"))
_TRANSPORT = os.path.join(os.path.dirname(comm_base.__file__), "inmemory.py")
_COUNTS_LOCK = threading.Lock()


class _Allocations(TorchDispatchMode):
    """Counts, by the line of gpudist's code that asked, every op whose output has new storage. An op whose nearest
    caller outside torch is not gpudist's, or that runs inside a module's forward or a torch optimizer (the model's
    own compute, called through the wrapper), or in the in-memory transport (the simulated wire: NCCL allocates
    nothing), is not counted."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for a in (*args, *(kwargs or {}).values())
            for t in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(t, torch.Tensor)
        }
        made = [
            t
            for t in (out if isinstance(out, (list, tuple)) else (out,))
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()
            if t.untyped_storage().data_ptr() not in inputs
        ]
        if made:
            where = _gpudist_caller(sys._getframe(1))
            if where is not None:
                self.counts[f"{where} {func}"] += len(made)
        return out


def _gpudist_caller(frame) -> str | None:
    """``file:line`` of gpudist's code that issued the op dispatched below ``frame``; None when the nearest caller
    outside torch is not gpudist's, or is a module's forward or a torch optimizer (the model's own compute, called
    through the wrapper), or the in-memory transport (the simulated wire)."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        if frame.f_code.co_filename.startswith(_USER_CODE):
            return None
        frame = frame.f_back
    where = "" if frame is None else frame.f_code.co_filename
    if not where.startswith(_GPUDIST_CODE) or where == _TRANSPORT:
        return None
    return f"{os.path.basename(where)}:{frame.f_lineno}"


def _allocating_steps(comm, strategy: str, counts: collections.Counter, sizes: dict, meet: threading.Barrier):
    model, step = _warmed_up(comm, strategy)
    mine: collections.Counter = collections.Counter()
    meet.wait()
    with _Allocations(mine):
        for _ in range(STEPS):
            step()
    with _COUNTS_LOCK:
        counts.update(mine)
    sizes[comm.rank] = ALLOCATIONS[strategy](model)


@pytest.mark.parametrize("strategy", list(ALLOCATIONS))
def test_a_steady_state_step_allocates_only_what_the_strategy_frees(strategy, serial_interpreter):
    """Catches gpudist's own code allocating in a steady-state step other than what the strategy frees by design (on a
    GPU each allocation is host time in the caching allocator, and a pinned buffer or event far more): a norm's
    partial sums, a verdict's host copy, a scalar, a padding tensor made per step. The Triton kernels run (the
    GPU's path: the torch references stand in for kernels on the CPU and allocate their temporaries); two ranks,
    both counted, over two steps after three warm-up steps. Exactly the designed count: ZeRO-2's and FSDP's show that
    the counter sees allocations (a counter that saw none would pass DDP's and ZeRO-1's zero)."""
    world = 2
    counts: collections.Counter = collections.Counter()
    sizes: dict = {}
    run_ranks(_allocating_steps, world, "inmemory", strategy=strategy, counts=counts, sizes=sizes,
              meet=threading.Barrier(world))  # fmt: skip
    per_step = sum(counts.values()) / (world * STEPS)
    designed = sizes[0]
    assert per_step == designed, f"{strategy}: {per_step} allocations per rank and step, {designed} by design: {counts}"


# -- device work per step -------------------------------------------------------------------------------------------


class _DeviceOps(TorchDispatchMode):
    """Counts the ops of a step: in ``counts`` those gpudist's own code dispatches (attributed as
    :func:`_gpudist_caller` does: on a GPU each is a kernel launch or a host-side tensor op, host microseconds
    apiece), in ``every`` all of them by name, autograd's backward included (it runs a CPU backward on this thread),
    but the simulated wire's. Views are left out: they launch nothing."""

    def __init__(self, counts: collections.Counter, every: collections.Counter):
        super().__init__()
        self.counts, self.every = counts, every

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _VIEWS:
            frame = sys._getframe(1)
            where = _gpudist_caller(frame)
            if where is not None:
                self.counts[f"{where} {func}"] += 1
            if not _in_transport(frame):
                self.every[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _in_transport(frame) -> bool:
    """Whether the op below ``frame`` is the in-memory transport's (the simulated wire: NCCL runs none)."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == _TRANSPORT


_VIEWS = {
    torch.ops.aten.view.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.detach.default,
    torch.ops.aten.as_strided.default,  # (FSDP's saved parameters, each a view of its gathered unit)
    torch.ops.aten.split_with_sizes.default,
}
"""Metadata-only ops (no launch on a GPU)."""


def _device_ops(
    comm, strategy: str | None, width: int, launches: collections.Counter, meet: threading.Barrier
) -> tuple:
    """What a steady-state step of :func:`_warmed_up`'s model at ``width`` runs (launches stubbed and shared; the
    plain module when ``strategy`` is None, unwrapped, with the same torch AdamW)."""
    model, step = _warmed_up(comm, strategy, width)
    if strategy is None:
        units = 0
    elif strategy == "fsdp":
        units = len(model._groups)
    else:
        units = len(model._collective.buckets)
    ops, every = collections.Counter(), collections.Counter()
    meet.wait()
    if comm.rank == 0:
        launches.clear()
    meet.wait()
    with _DeviceOps(ops, every):
        step()
    meet.wait()
    return ops, sum(launches.values()), units, every


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_a_steps_device_work_grows_with_buckets_not_parameters(strategy):
    """Catches device work per parameter coming back into a steady-state step on the GPU's path (every Triton launch
    forced and stubbed): a copy, scale or launch per gradient where one per bucket (or unit) does, which on a GPU
    costs the host ~10-20 us apiece, and in autograd's backward too (FSDP's parameter views cut one by one made a
    unit-sized zeroed gradient per parameter and summed them). Two models with the same buckets (DDP, ZeRO-1/2:
    three) or units (FSDP: six), one with twice the parameters in each: gpudist's own ops and launches per step must
    be the same, and no op of the whole step may grow by more than it grows in the plain module's. Two ranks in
    memory; rank 0's ops, both ranks' launches (the stubs are shared)."""
    pytest.importorskip("triton", reason="the GPU's path is the Triton kernels' (stubbed here, but chosen)")
    from gpudist.bench.host_calls import triton_launches_stubbed

    counted = {}
    with triton_launches_stubbed() as launches:
        for name, width in [(n, w) for n in (strategy, None) for w in (1, 2)]:
            meet = threading.Barrier(2, timeout=120)
            counted[name, width] = run_ranks(_device_ops, 2, "inmemory", strategy=name, width=width,
                                             launches=launches, meet=meet)[0]  # fmt: skip
    (ops1, launched1, units1, every1), (ops2, launched2, units2, every2) = counted[strategy, 1], counted[strategy, 2]
    assert units1 == units2, f"{strategy}: {units1} and {units2} buckets or units: the test's models are off"
    assert ops1 or strategy == "ddp", f"{strategy}: no op counted: the counter sees nothing"
    assert (ops2, launched2) == (ops1, launched1), (
        f"{strategy}: twice the parameters in {units1} buckets or units: {sum(ops1.values())} -> "
        f"{sum(ops2.values())} ops and {launched1} -> {launched2} launches per step: {ops2 - ops1}"
    )
    plain_growth = counted[None, 2][3] - counted[None, 1][3]
    assert sum(plain_growth.values()) > 0, "the plain module's ops did not grow with its parameters: nothing counted"
    grown = (every2 - every1) - plain_growth
    assert not grown, f"{strategy}: ops of the step that grow with the parameters beyond the plain module's: {grown}"
