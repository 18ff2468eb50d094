"""Memory per rank MEASURED from outside the wrappers (gpudist.memory), against the formulas and the self-reports.

``model.memory_per_rank()`` and ``opt.state_bytes()`` add up the tensors a wrapper knows it holds, so they cannot see
a leak. Here each Gloo rank (one process per rank, so the census counts that rank alone) takes a census of every
live tensor storage before building the model, then after wrapping, and after backward, ``opt.step()`` and
``opt.zero_grad()`` of two steps, and compares the growth with the README's formulas (fp32, Adam: K = 2):

- DDP: parameters P, gradients P (the buckets, from wrap time: ``param.grad`` are views into them), Adam 2P (made by
  the first step);
- ZeRO-1: P, P (the same buckets), 2P/N (from construction);
- ZeRO-2: P, P/N (the owned pieces; full gradients only while their bucket is in flight), 2P/N;
- ZeRO-3 / FSDP: P/N, P/N from backward until ``zero_grad`` frees them, 2P/N (torch FSDP2: 16 bytes per parameter / N
  after backward, 12 after zero_grad).

(P in bytes.) At these points no ZeRO-3 unit is gathered and no bucket is in flight: the working memory of one unit
that the README allows is a forward/backward transient, so the formula at these points has none.

Model: 4 blocks of Linear(640, 640) + ReLU in an ``nn.ModuleList`` and a Linear(640, 16) head, 1.65M parameters
(P = 6.6 MB; each measurement widens it by 4, see ``_WIDTHS``). Every parameter's size is a multiple of 4, so P/N is
exact for N = 1, 2, 4 whatever the buckets or units. Tolerance: the issue's 2% of the formula. The fixed overheads
are accounted for explicitly, not absorbed: torch's Adam (DDP) keeps a 4-byte ``step`` tensor per parameter (10
here); gpudist's fused path counts steps in Python; nothing else was found (with the Gloo backend's retention of
finished ops switched off, every strategy, N and phase measured 1.000). The smallest leak that matters is far above
2%: one unit or gradient bucket is at least P/5 (1.3 MB), while 2% of the smallest formula here (ZeRO-3 at N = 4
after zero_grad, 3P/4 = 5 MB) is 0.1 MB.

The allocator check (``allocated_bytes``, glibc's count) sees what the census cannot: buffers only C++ holds, e.g.
a collective's work object keeping its tensors. Its margin is derived at :data:`ALLOCATOR_MARGIN`.
"""

from __future__ import annotations

import gc
import itertools
import mmap
import time
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpudist import (
    DDPModel,
    DDPOptimizer,
    FSDPModel,
    ShardingConfiguration,
    ZeRO1Model,
    ZeRO1Optimizer,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
    ZeRO3Optimizer,
)
from gpudist.flat import broadcast_tensors
from gpudist.memory import allocated_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes, storage_census
from gpudist.strategies.zero import ReduceScatterBuckets
from gpudist.testing import run_ranks

IN_FLIGHT = ReduceScatterBuckets.max_in_flight

WIDTH, DEPTH, CLASSES, BATCH = 640, 4, 16, 8
TOLERANCE = 0.02
"""The issue's acceptance criterion: live memory within 2% of the formula (see the module docstring)."""
STRATEGIES = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero1": (ZeRO1Model, ZeRO1Optimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "zero3": (ZeRO3Model, ZeRO3Optimizer),
    "fsdp": (FSDPModel, ZeRO3Optimizer),
}
_WIDTHS = itertools.count(WIDTH, 4)
"""Each measurement gets a model shape no earlier one in this session used (all multiples of 4): the ranks are reused
processes, and a shape-keyed cache (as FlatLayout's view cache was) still holding an earlier test's buffer could evict
and free it during this test's measurement, which would hide a leak of the same size."""
PHASES = ("wrap", "backward 1", "step 1", "zero_grad 1", "backward 2", "step 2", "zero_grad 2")


class Net(nn.Module):
    """Blocks in an ``nn.ModuleList`` (FSDPModel's default policy: one unit per block; ZeRO3Model: one per Linear)."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sizes(width: int = WIDTH, depth: int = DEPTH) -> tuple[int, int]:
    """(parameter bytes P, parameter tensors)."""
    params = list(Net(width, depth).parameters())
    return sum(p.numel() * 4 for p in params), len(params)


def formula(strategy: str, phase: str, world: int, width: int = WIDTH, depth: int = DEPTH) -> dict[str, int]:
    """Bytes this rank should hold at ``phase``, by category (fp32, Adam), per the list in the module docstring."""
    p, tensors = sizes(width, depth)
    n = world
    if strategy == "ddp":
        stepped = phase != "wrap" and phase != "backward 1"  # torch's Adam creates its state in the first step
        return {"parameters": p, "gradients": p, "optimizer_state": 2 * p + 4 * tensors if stepped else 0}
    if strategy == "zero1":
        return {"parameters": p, "gradients": p, "optimizer_state": 2 * p // n}
    if strategy == "zero2":
        return {"parameters": p, "gradients": p // n, "optimizer_state": 2 * p // n}
    has_grads = phase.startswith(("backward", "step"))
    return {"parameters": p // n, "gradients": p // n if has_grads else 0, "optimizer_state": 2 * p // n}


def retire_in_flight(comm) -> None:
    """Finish what earlier calls in this reused process may still hold through the backend (a backend that kept its
    last work objects alive, as the Gloo backend once kept 8, is pushed empty by tiny collectives), so nothing of an
    earlier test is freed during this one's measurement (which would hide a leak of the same size)."""
    one = torch.zeros(1)
    for _ in range(16):
        comm.all_reduce(one)


def let_go_of_finished_ops(comm) -> None:
    """Give Gloo's worker threads the moment they take to drop a finished op (and its tensors) after ``wait()`` has
    returned (GlooCommunicationBackend.shutdown waits for the same thing), so the census sees what is held, not
    what is in transit: two barriers of torch.distributed's own, the same number on every rank. They bypass gpudist's
    backend, so they cannot push anything out of what it keeps. Without them, a bucket's send buffer was seen alive
    after backward in 2 of 3 runs of ZeRO-2 at N = 4 (4 processes on 2 cores) once the backend kept nothing."""
    if comm.name == "gloo" and torch.distributed.is_initialized():
        for _ in range(2):
            torch.distributed.barrier()


SETTLE_SECONDS = 30.0
"""How long a census above the formula may take to come down before it counts as held (see :func:`settled_census`)."""


def settled_census(ceiling: float):
    """The census once it is at most ``ceiling`` bytes, or as it stands after :data:`SETTLE_SECONDS`.

    A finished op's tensors are in transit, not held: Gloo's worker thread drops its reference a moment after
    ``wait()`` returns, and on a loaded host (4 ranks on 2 cores) that moment outlasted the barriers of
    :func:`let_go_of_finished_ops` once in a clean CI run (a ZeRO-2 bucket's send buffer, 1.43x the formula). Memory
    that something holds never comes down, so a leak still fails, after the deadline. Polls locally (no collective),
    so ranks may settle at different times."""
    census = storage_census()
    deadline = time.monotonic() + SETTLE_SECONDS
    while census.total > ceiling and time.monotonic() < deadline:
        time.sleep(0.02)
        census = storage_census()
    return census


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Forward and backward in a frame of their own: the output and the loss are gone when it returns."""
    F.cross_entropy(model(x), y).backward()


def warm_up(comm, strategy: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """What the process sets up once, on first use, is not the measured model's memory, so it happens before the
    baseline: one step of ``strategy`` on a tiny model (the first Adam step imports torch._dynamo: ~25 MB of
    ``malloc``, no tensors), and one plain step of a model of the measured shapes (CPU matmul libraries keep
    per-shape state: 0.8-2.2 MB at widths 320-1280 in the first backward, none in later ones)."""
    model_cls, opt_cls = STRATEGIES[strategy]
    config = ShardingConfiguration(comm)
    model = model_cls(Net(8, 1), config)
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-3), config)
    backward(model, torch.randn(2, 8), torch.zeros(2, dtype=torch.int64))
    opt.step()
    opt.zero_grad()
    plain = Net(x.shape[1])
    backward(plain, x, y)
    torch.optim.Adam(plain.parameters(), lr=1e-3).step()


def measure(comm, strategy: str, width: int = WIDTH, depth: int = DEPTH, steps: int = 2) -> dict:
    """On one rank: census, allocator and self-reports at every phase of ``steps`` training steps, minus a baseline
    taken before the model existed (test data and the backend's tensors are in the baseline)."""
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, width), torch.randint(0, CLASSES, (BATCH,))
    warm_up(comm, strategy, x, y)
    retire_in_flight(comm)
    # Everything alive now is the baseline. Freezing it takes it out of the collector's lists, so each census walks
    # only what was created since (0.5 s -> milliseconds a census) and never counts what existed before.
    gc.collect()
    gc.freeze()
    try:
        return _measure_phases(comm, strategy, x, y, width, depth, steps)
    finally:
        gc.unfreeze()  # the process is reused by later tests: let the collector see its objects again


def _measure_phases(comm, strategy, x, y, width, depth, steps) -> dict:
    model_cls, opt_cls = STRATEGIES[strategy]
    base, base_alloc = storage_census(), allocated_bytes()
    config = ShardingConfiguration(comm)
    model = model_cls(Net(width, depth), config)
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-3), config)
    rows: dict[str, dict] = {}

    def record(phase: str) -> None:
        let_go_of_finished_ops(comm)
        expected = sum(formula(strategy, phase, comm.world_size, width, depth).values())
        census = settled_census(base.total + (1 + TOLERANCE) * expected)
        alloc = allocated_bytes()
        reported = model.memory_per_rank()
        rows[phase] = {
            "census": census.total - base.total,
            "allocated": None if alloc is None else alloc - base_alloc,
            "reported": sum(reported.values()),
            "reported_by_category": reported,
            "state_bytes": opt.state_bytes(),
        }

    record("wrap")
    for step in range(1, steps + 1):
        backward(model, x, y)
        record(f"backward {step}")
        opt.step()
        record(f"step {step}")
        opt.zero_grad()
        record(f"zero_grad {step}")
    return rows


ALLOCATOR_MARGIN = 1 << 20
"""How far the allocator's growth may exceed the census's: malloc'd memory that is not tensor data. That is the
wrappers' Python objects (module dicts, hooks, lists), C++ state (autograd nodes, Gloo work objects) and the c10d
flight recorder, which keeps an entry of about a kB per collective up to ``TORCH_FR_BUFFER_SIZE`` entries (with it
set to 0, ZeRO-3's growth per step fell from ~35 kB to ~2 kB), plus each storage's malloc header and page rounding
(at most 4 KiB + 80 B). Over the 2 steps measured here it came to at most 0.4 MB (FSDP, N = 4). The margin sits
between that and the smallest buffer the check exists to catch, a full unit or bucket held only from C++
(one Linear's, 1.6 MB); a buffer of one rank's shard (0.4 MB at N = 4) is below what it can tell apart."""


def check_rank(strategy: str, world: int, rank: int, rows: dict, width: int) -> list[str]:
    """Every way this rank's census disagrees with the formula or with the self-reports, as readable lines."""
    problems = []
    for phase in PHASES:
        row, expected = rows[phase], formula(strategy, phase, world, width)
        total = sum(expected.values())
        where = f"{strategy} N={world} rank {rank} after {phase}"
        if abs(row["census"] - total) > TOLERANCE * total:
            problems.append(
                f"{where}: live storages {row['census']:,} B = {row['census'] / total:.3f}x the formula "
                f"{total:,} B ({expected})"
            )
        if abs(row["reported"] - row["census"]) > TOLERANCE * total:
            problems.append(
                f"{where}: the model reports {row['reported']:,} B ({row['reported_by_category']}) but "
                f"{row['census']:,} B are live"
            )
        if abs(row["state_bytes"] - expected["optimizer_state"]) > TOLERANCE * total:
            problems.append(
                f"{where}: opt.state_bytes() = {row['state_bytes']:,} B, formula {expected['optimizer_state']:,} B"
            )
    return problems


_MEASURED: dict[tuple[str, int], tuple[int, list[dict]]] = {}


def measured(strategy: str, world: int) -> tuple[int, list[dict]]:
    """(width, per-rank phases) of ``strategy`` on ``world`` Gloo ranks, measured once per session: the formula test
    and the allocator test read the same run."""
    key = (strategy, world)
    if key not in _MEASURED:
        width = next(_WIDTHS)
        _MEASURED[key] = width, run_ranks(measure, world, "gloo", strategy=strategy, width=width)
    return _MEASURED[key]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_live_memory_matches_the_formula_and_the_self_report(strategy, world):
    """Catches memory the wrappers hold without knowing it, in every strategy: a full copy of the model kept alive
    by a cache (FlatLayout's views of the buffer ``broadcast_tensors`` packed at wrap time: +P on every rank) or by
    the backend's finished work objects, ZeRO-3's persistent P/N gradient copy in the optimizer, gradients that
    ``zero_grad`` does not free, optimizer state that is not split, placeholders that outlive their use, bucket
    send buffers kept after backward; and self-reports (``memory_per_rank``, ``state_bytes``) that disagree with what
    is live. Census per rank (one Gloo process each) at every phase of two steps."""
    width, results = measured(strategy, world)
    problems = [line for rank, rows in enumerate(results) for line in check_rank(strategy, world, rank, rows, width)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_allocator_sees_no_more_than_the_census(strategy, world):
    """Catches buffers held only from C++, which the census cannot see: a collective's finished work object keeping
    its send buffer or a gathered unit, tensors autograd saved and never released. glibc's count of live
    allocations must exceed the census by no more than the bookkeeping of :data:`ALLOCATOR_MARGIN`."""
    if allocated_bytes() is None:
        pytest.skip("no allocator count here: glibc's mallinfo2 is unavailable (not Linux/glibc 2.33+)")
    _, results = measured(strategy, world)
    problems = [
        f"{strategy} N={world} rank {rank} after {phase}: the allocator holds {row['allocated']:,} B more "
        f"than before the model, the census counts {row['census']:,} B of live storages"
        for rank, rows in enumerate(results)
        for phase, row in rows.items()
        if row["allocated"] - row["census"] > ALLOCATOR_MARGIN
    ]
    assert not problems, "\n".join(problems)


def broadcast_and_census(comm, numel: int, tensors: int) -> dict:
    """Census and allocator growth from ``broadcast_tensors`` of ``tensors`` fp32 tensors of ``numel`` elements each
    (created and retired before the baseline)."""
    values = [torch.full((numel,), float(comm.rank)) for _ in range(tensors)]
    retire_in_flight(comm)
    gc.collect()
    base, base_alloc = storage_census(), allocated_bytes()
    broadcast_tensors(comm, values)
    let_go_of_finished_ops(comm)
    census, alloc = storage_census(), allocated_bytes()
    return {
        "census": census.total - base.total,
        "allocated": None if alloc is None else alloc - base_alloc,
        "received": all(bool((v == 0).all()) for v in values),
    }


@pytest.mark.parametrize(("backend", "world"), [("inmemory", 1), ("gloo", 2)])
def test_broadcast_tensors_keeps_no_copy_of_what_it_sent(backend, world):
    """Catches the FlatLayout view cache coming back: ``broadcast_tensors`` packs the tensors into one flat buffer
    (at wrap time: every parameter, a full copy of the model), and views of that buffer cached in the shared layout
    kept it alive after the call (one in-memory rank: nothing but gpudist.flat and the layout is involved). On Gloo
    (a process per rank, so the census is that rank's) it also catches the backend holding the buffer after the
    broadcast completed (finished work objects kept). Nothing the call created may outlive it: tolerance 1% of the
    8 MB sent (a signature tensor or two are bytes; the buffer is 100%)."""
    numel, tensors = 1 << 18, 8  # 8 x 1 MiB
    sent = numel * tensors * 4
    results = run_ranks(broadcast_and_census, world, backend, numel=numel + world, tensors=tensors)
    for rank, r in enumerate(results):
        assert r["received"]
        assert r["census"] <= 0.01 * sent, (
            f"rank {rank}: {r['census']:,} B of storages outlive broadcast_tensors of {sent:,} B"
        )
        if backend == "gloo" and r["allocated"] is not None:  # one process per rank: the allocator is this rank's
            grown = r["allocated"]
            assert grown <= 0.01 * sent + ALLOCATOR_MARGIN, f"rank {rank}: allocator +{grown:,} B, sent {sent:,}"


def test_census_counts_each_storage_once_whole_and_finds_what_autograd_made():
    """Catches a census that double counts views, counts a slice instead of the storage it keeps alive, misses a
    gradient autograd created in C++ (no Python object until someone reads ``.grad``), or counts meta and empty
    tensors; and an allocator count that disagrees with it on plain large tensors."""
    gc.collect()
    base, base_alloc = storage_census(), allocated_bytes()
    big = torch.zeros(1 << 20)  # 4 MiB
    views = [big[:10], big.view(1024, 1024), big[1::2]]  # share big's storage
    slice_only = torch.zeros(1 << 19)[:1]  # keeps 2 MiB alive through a 1-element view
    plain = (1 << 22) + (1 << 21)
    census, alloc = storage_census(), allocated_bytes()
    assert census.total - base.total == plain
    assert census.by_device.get("cpu", 0) - base.by_device.get("cpu", 0) == plain
    assert census.by_dtype.get("float32", 0) - base.by_dtype.get("float32", 0) == plain
    assert storage_census([*views, slice_only]).total == plain
    if alloc is not None:
        # Two storages, each a malloc chunk of its own (mmapped: rounded up to a page, + 64 B of alignment), and the
        # few Python objects made here (five tensor objects, a list): a few KiB more; a thread of an earlier test
        # finishing meanwhile can free a few KiB (seen: 752 B net below). A missed or doubled storage is MiBs.
        assert abs((alloc - base_alloc) - plain) < 64 << 10, (alloc - base_alloc, plain)
    layer = nn.Linear(512, 256)  # 131,328 parameters
    layer(torch.randn(4, 512)).sum().backward()  # .grad made by autograd in C++
    grads = 2 * sum(p.numel() * 4 for p in layer.parameters())  # the parameters and their gradients
    assert storage_census().total - base.total == plain + grads
    meta, empty = torch.empty(1 << 20, device="meta"), torch.empty(0)
    assert storage_census([meta, empty]).total == 0
    assert storage_census().total - base.total == plain + grads
    del big, views, slice_only, layer, meta, empty


def test_rss_peak_follows_touched_memory_and_resets():
    """Catches peak RSS that is not the high-water mark of resident memory (e.g. VmRSS read for VmHWM) and a reset
    that does not work where the kernel offers it: a 64 MiB buffer written and freed raises the peak by at least
    that, and after reset_peak_rss the peak is back near the current resident set."""
    size, page = 64 << 20, mmap.PAGESIZE
    before = peak_rss_bytes()
    # Its own mapping, not malloc's: malloc may serve 64 MiB from free heap memory that is already resident and keep
    # it after the free (seen under OMP_NUM_THREADS=1 after the rest of the suite), which this test must not depend on.
    buf = mmap.mmap(-1, size)
    for offset in range(0, size, page):
        buf[offset] = 1  # written: resident
    assert rss_bytes() is None or rss_bytes() >= size
    peak = peak_rss_bytes()
    buf.close()  # unmapped: back to the kernel at once
    assert peak >= max(before, size)
    if not reset_peak_rss():
        pytest.skip("reset_peak_rss is not available here (/proc/self/clear_refs not writable)")
    after, now = peak_rss_bytes(), rss_bytes()
    assert after <= peak - size // 2, (peak, after)
    assert now is None or after <= now + (16 << 20)  # other threads may touch a little memory meanwhile


def count_send_buffers_alive(comm, layers: int, width: int) -> dict:
    """ZeRO-2 backward over ``layers`` one-bucket layers; at each reduce-scatter, how many of the send buffers of this
    backward's earlier reduce-scatters are still alive (weak references: alive means something, the model or the
    backend, still holds the memory)."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    layer_mb = (width * width + width) * 4 / 2**20
    config = ShardingConfiguration(comm, bucket_cap_mb=0.9 * layer_mb, first_bucket_mb=0.9 * layer_mb)
    model = ZeRO2Model(net, config)
    sent, alive = [], []

    class Spy:  # stands in for each bucket's planned reduce-scatter
        def __init__(self, plan):
            self.plan = plan

        def start(self, inp, out):
            return spy(self.plan, inp, out)

    def spy(plan, inp, out):
        # Buffers whose op finished may still be in transit in Gloo's worker thread (see settled_census): give them
        # the same grace; a buffer the model holds stays alive however long this waits.
        deadline = time.monotonic() + (SETTLE_SECONDS if max(alive, default=0) <= IN_FLIGHT else 0)
        while sum(ref() is not None for ref in sent) > IN_FLIGHT and time.monotonic() < deadline:
            time.sleep(0.005)
        alive.append(sum(ref() is not None for ref in sent))
        sent.append(weakref.ref(inp))
        return plan.start(inp, out)

    collective = model._collective
    collective._plans = [Spy(plan) for plan in collective._plans]
    model(torch.randn(4, width)).sum().backward()
    return {"launched": len(sent), "most_alive": max(alive), "buckets": len(model._buckets)}


@pytest.mark.parametrize(("backend", "world"), [("inmemory", 2), ("gloo", 2)])
def test_zero2_holds_at_most_two_buckets_in_flight_during_backward(backend, world):
    """Catches ZeRO-2 launching every bucket's reduce-scatter and waiting for them all at the end of backward: each
    holds its bucket's full-size send buffer, so at the last launch a full copy of the gradients was alive (P, where
    the formula allows P/N plus the working buckets), and on Gloo that memory freed at once went back to the OS and
    was faulted in again every step. With 8 one-layer buckets, at most 2 earlier send buffers may be alive when a
    third is launched (IN_FLIGHT); without the bound the last launch sees 7."""
    layers = 8
    for rank, r in enumerate(run_ranks(count_send_buffers_alive, world, backend, layers=layers, width=128)):
        assert r["buckets"] == r["launched"] == layers, (rank, r)
        assert r["most_alive"] <= IN_FLIGHT, f"rank {rank}: {r['most_alive']} send buffers alive at once"
