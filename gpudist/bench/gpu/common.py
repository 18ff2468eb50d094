"""What every part of ``gpudist bench gpu`` shares: its settings, exit codes, bandwidth arithmetic and the
repository it runs from."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...comm import ReductionOperation
from ..collectives import (
    BUS_FACTORS,
)

NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
EXIT_OK, EXIT_PART_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3
# BUS_FACTORS (from .collectives): busbw = algbw x factor(n), as nccl-tests: all-reduce 2(n-1)/n, all-gather and
# reduce-scatter (n-1)/n, broadcast 1. At n = 1 the ring factors are 0: one rank moves nothing between GPUs, and its
# time is launch overhead.

GOOD_FRACTION = 0.8
"""A memory-bound kernel should reach this fraction of the copy bandwidth (one read and one write of each byte)."""
COMPUTE_BOUND = ("topk_exact_1pct", "topk_threshold_1pct")
"""Top-k selects (a sort or a threshold search) as well as streams: its fraction of copy is reported, not judged."""


def bandwidth_GBps(nbytes: float, seconds: float) -> float:
    """GB/s (10^9 bytes per second) of moving ``nbytes`` in ``seconds``."""
    return nbytes / seconds / 1e9


def fraction_of_copy(op_GBps: float, copy_GBps: float) -> float:
    """A kernel's GB/s over the device-to-device copy's, both counting bytes read plus written (1.0: as fast as a
    copy, the most a memory-bound kernel can do)."""
    return op_GBps / copy_GBps


def bus_bandwidth(op: str, nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one ``op`` of ``nbytes`` (nccl-tests' size: the all-reduce and broadcast buffer,
    the all-gather output, the reduce-scatter input) taking ``seconds`` on ``world_size`` ranks."""
    algbw = bandwidth_GBps(nbytes, seconds)
    return algbw, algbw * BUS_FACTORS[op](world_size)


TEST_PARTS: dict[str, tuple[str, ...]] = {
    "tests-kernels": ("tests/test_kernels.py", "tests/test_kernels_compression.py"),
    "tests-nccl": ("tests/test_gpu.py", "-k", "nccl_world_one_every_op or compressed_collectives"),
    "tests-host-sync": ("tests/test_gpu.py", "-k", "no_host_sync"),
    "tests-strategies": (
        "tests/test_gpu.py",
        "-k",
        "not (nccl_world_one_every_op or compressed_collectives or no_host_sync)",
    ),
}
"""pytest's arguments for each part of the GPU test tier (each run with ``-m gpu``); together the whole tier."""

# -- settings --------------------------------------------------------------------------------------------------------


@dataclass
class GPUSettings:
    """What ``gpudist bench gpu`` runs; every part gets it (it crosses into the part's process, so it pickles)."""

    parts: tuple[str, ...] = (
        "tests-kernels",
        "tests-nccl",
        "tests-host-sync",
        "tests-strategies",
        "kernels",
        "collectives",
        "host",
        "strategies",
        "capture",
        "profile",
        "gate",
        "capture-torch",
    )
    """The parts to run, in order: correctness first, cheapest first."""
    tests: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(TEST_PARTS))
    """pytest's arguments (files, ``-k``) for each test part, run with ``-m gpu`` from the repository root."""
    test_timeout: float = 60.0
    """Seconds one test may take (pytest-timeout): a hang costs this, not the part."""
    budget: float = 450.0
    """Seconds for the whole run: each part's limit is cut to what is left, and a part with less than
    ``MIN_PART_SECONDS`` left is skipped (a short GPU slot must not end before the JSON is written)."""
    kernel_elements: tuple[int, ...] = (1 << 22, 1 << 24, 1 << 26)
    """Elements per kernel op: 4M (16 MiB of fp32, inside the H100's 50 MiB L2: where launch and host time show),
    16M and 64M (past it)."""
    kernel_ops: tuple[str, ...] | None = None
    """A subset of ``gpudist.bench.kernels.OPS``; None: all of them."""
    collective_bytes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 24, 1 << 28)
    """Collective sizes in bytes (fp32): 64 KiB is latency-bound, 256 MiB saturates NVLink."""
    workloads: tuple[str, ...] = ("mlp", "gpt", "gpt-d1024")
    """Models from ``gpudist.bench.workloads`` for the strategy step times."""
    batch: dict[str, int] = field(default_factory=lambda: {"mlp": 256, "gpt": 8, "gpt-deep": 8, "gpt-d1024": 8})
    """Samples per rank per step on the GPU (GPT: sequences of 128 tokens, gpt-d1024 of 512); the CPU benchmarks'
    batches (32, 2) leave an H100 idle between launches."""
    autocast: dict[str, str] = field(default_factory=lambda: {"gpt-d1024": "bfloat16"})
    """Workloads trained under ``torch.autocast`` to that dtype (the 185M GPT as such models are trained: there the
    kernels finish sooner and the host's share of a step shows, 2026-11-28's H200 run)."""
    model_overrides: dict = field(default_factory=dict)
    """Keyword arguments for ``workloads.make``/``batch`` (the CPU tests shrink the model)."""
    rounds: int = 7
    """Interleaved rounds per measurement; the median is reported."""
    steps: int = 5
    """Training steps per variant per round."""
    world_size: int | None = None
    """Ranks for collectives and strategies; None: ``torch.cuda.device_count()``."""
    timeouts: dict[str, float] = field(
        default_factory=lambda: {
            "tests-kernels": 180.0,
            "tests-nccl": 90.0,
            "tests-host-sync": 90.0,
            "tests-strategies": 180.0,
            "kernels": 150.0,
            "collectives": 90.0,
            "host": 60.0,
            "strategies": 240.0,
            "capture": 180.0,
            "capture-torch": 90.0,
            "profile": 120.0,
            "gate": 120.0,
        }
    )
    """Seconds each part may take before its process is stopped and the part recorded as timed out (measured on an
    H200, 2026-11-28: the whole GPU tier 41 s, kernels 25 s, collectives 13 s, strategies 20 s, the benchmark tier
    16 s; each limit leaves room for Triton's first compiles). The strategies part has had the 185M GPT under bf16
    autocast since (six variants of 185M parameters, each with its Adam state: about 25 GB; its time on a GPU is not
    measured yet, hence the wider limit)."""
    part_started: float | None = None
    """``time.monotonic()`` when the running part's process was started (its time limit counts from there; the
    clock is the machine's, the same in every process); None outside a part."""
    repo: str | None = None
    """The repository root (holding ``tests/`` and ``benchmarks/``), where the test parts and the gate run pytest;
    None: found from the working directory."""


def find_repo(start: Path | None = None) -> Path | None:
    """The gpudist checkout: the working directory or the one this editable install lives in, whichever holds
    ``tests/test_gpu.py`` and ``benchmarks/workloads.py``."""
    for root in (start or Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / "tests" / "test_gpu.py").is_file() and (root / "benchmarks" / "workloads.py").is_file():
            return root.resolve()
    return None


def _repo(settings: GPUSettings) -> Path:
    """The checkout a part runs pytest in (the test parts, the gate); nothing of it is imported here."""
    if settings.repo is None:
        raise RuntimeError(
            "this part needs the gpudist repository (tests/, benchmarks/); run from its root or pass --repo"
        )
    return Path(settings.repo)


def _world(settings: GPUSettings) -> int:
    return settings.world_size or torch.cuda.device_count()


def part_rows(settings: GPUSettings, part: str, body, world: int | None = None) -> list:
    """Rank 0's result of ``body(gloo, nccl, settings)`` on ``world`` ranks (default: :func:`_world`), each with an
    NCCL group, in processes spawned for the part, stopped at the part's time limit."""
    from ...launch import spawn
    from ..collectives import on_nccl

    world = world or _world(settings)
    return spawn(on_nccl, world, body=body, settings=settings, timeout=settings.timeouts[part])[0]


class PartClock:
    """What is left of a part's time limit, for a part that runs item after item (workloads): an item starts only
    when the slowest one so far, with a margin, still fits, so that a part near its limit returns the rows it has
    instead of being stopped with none. The ranks agree (the largest estimate over the Gloo group decides)."""

    MARGIN = 1.5
    """The next item is assumed to take this many times the slowest one so far."""
    RESERVE = 0.1
    """Share of the limit kept for the part's start-up and the result's way back."""

    def __init__(self, gloo, limit: float, now: Callable[[], float] = time.monotonic, started: float | None = None):
        self.gloo, self.limit, self.now = gloo, limit, now
        self.start = now() if started is None else started
        """When the limit started counting (the part's start: its processes and NCCL set up before its first item)."""
        self.slowest = 0.0
        self._item_start = self.start

    def fits(self) -> bool:
        """Whether the next item may start (the ranks agree); starts timing it when so."""
        now = self.now()
        needed = torch.tensor([now - self.start + self.MARGIN * self.slowest], dtype=torch.float64)
        self.gloo.all_reduce(needed, ReductionOperation.MAX)
        if needed.item() > (1 - self.RESERVE) * self.limit:
            return False
        self._item_start = now
        return True

    def done(self) -> None:
        """The item started by the last :meth:`fits` has ended."""
        self.slowest = max(self.slowest, self.now() - self._item_start)


def _cupy_nccl() -> None:
    """Raise, naming the extra to install, when CuPy's NCCL (what gpudist's NCCL backend drives) is missing."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(
            f"{e}; install the extra matching your CUDA: pip install 'gpudist[cuda13]' (or [cuda12])"
        ) from e
    if not getattr(nccl, "available", True):
        raise RuntimeError("CuPy is installed but libnccl was not found: pip install 'gpudist[cuda13]' (or [cuda12])")


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]
