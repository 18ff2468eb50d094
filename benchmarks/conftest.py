"""The pytest-benchmark tier: every kernel, collective and strategy step against its PyTorch peer (docs/benchmarks.md).

    pytest benchmarks/ --benchmark-only [--gate | --gate-write] [--benchmark-json=FILE]

Not in the default test run (``testpaths = ["tests"]``). How each case is timed: gpudist and its peer run
round-robin in the same rounds (in this process for kernels; on a session-wide pool of two spawned Gloo ranks for
collectives and strategy steps, where each round counts at its slowest rank), by the same functions
``gpudist bench`` uses. gpudist's per-round times are then handed to pytest-benchmark as its rounds, so its table,
``--benchmark-compare`` and ``--benchmark-histogram`` show them; the peer's time, the ratio peer / gpudist, the bytes
moved and the bandwidth as a fraction of a copy on the same device go in ``extra_info``. The ratio table is printed
at the end of the session; ``--gate`` compares the ratios with ``benchmarks/baselines/<device kind>.json``
(benchmarks/gate.py) and fails the session beyond the tolerance.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from gpudist.bench import environment
from gpudist.bench.kernels import copy_bandwidth

from . import gate

CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False (the CUDA cases run on a GPU runner)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason=NO_CUDA))]
"""Every case runs on each; the CUDA ones skip with the reason where there is no GPU."""

_RECORDS = pytest.StashKey[list]()
_REPORT = pytest.StashKey[gate.GateReport]()
_THREADS = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpudist-bench", "gpudist benchmark tier (benchmarks/)")
    group.addoption("--gate", action="store_true", help="fail if a ratio fell below its baseline (benchmarks/gate.py)")
    group.addoption("--gate-write", action="store_true", help="store this run's ratios as the baselines")
    group.addoption("--gate-baselines", default=str(gate.BASELINES), help="folder of <device kind>.json baselines")
    group.addoption("--gate-tolerance", type=float, default=None, help="override every baseline's own tolerance")
    group.addoption(
        "--bench-elements",
        default=None,
        help="kernel elements per op, e.g. 64K, or several: 4M,16M,64M (one case per size; default: 4M on CPU, 64M "
        "on CUDA, the size the baselines were recorded at)",
    )
    group.addoption("--bench-rounds", type=int, default=25, help="interleaved rounds per case (default 25)")
    group.addoption(
        "--bench-round-ms", type=float, default=10.0, help="kernels: ms each variant runs per round (default 10)"
    )
    group.addoption(
        "--bench-threads",
        type=int,
        default=1,
        help="torch intra-op threads of this process (default 1; 0: torch's own default, one per core)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RECORDS] = []
    # One thread by default: on a shared CPU runner, multi-threaded ops time bimodally when other jobs hold the cores
    # (here, while other jobs ran: MKL's dot of 64K fp32 elements, squared_norm's CPU path, 10 us on one thread and
    # 4-26 ms on two; torch's fused SGD step of 16K elements 0.1 ms on one thread, 12 ms on two), and each ratio would
    # measure the load. The spawned ranks run one thread each anyway.
    threads = config.getoption("--bench-threads", default=1)
    config.stash[_THREADS] = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _THREADS in config.stash:  # as it was: this session may run inside another (tests/test_bench_gate.py)
        torch.set_num_threads(config.stash[_THREADS])


def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    """Versions and hardware beside every saved number (--benchmark-json, --benchmark-autosave)."""
    machine_info["gpudist_environment"] = environment()


@pytest.fixture(scope="session")
def rounds(request) -> int:
    return request.config.getoption("--bench-rounds")


@pytest.fixture(scope="session")
def copy_GBps():
    """GB/s of ``dst.copy_(src)`` (read + write) on a device for a number of fp32 elements, measured once per
    session."""
    cache: dict[tuple[str, int], float] = {}

    def measure(device: str, elements: int) -> float:
        key = (device, elements)
        if key not in cache:
            cache[key] = copy_bandwidth(max(elements, 1), torch.device(device))
        return cache[key]

    return measure


@pytest.fixture(scope="session")
def gloo_pool():
    """Two spawned Gloo ranks for the whole session (gpudist.launch.WorkerPool), shared by the collective and strategy
    cases: starting ranks costs seconds, a case's call to them milliseconds."""
    from gpudist.launch import WorkerPool

    pool = WorkerPool(2, timeout=300.0)
    yield pool
    pool.close()


def _replay(seconds: list[float]):
    """A timer whose successive (start, end) readings differ by ``seconds[0]``, ``seconds[1]``, ...: how per-round times
    measured elsewhere (interleaved with the peer, or on other ranks) become pytest-benchmark's rounds."""
    ends = list(itertools.accumulate(seconds))
    readings = iter([t for start, end in zip([0.0, *ends[:-1]], ends, strict=True) for t in (start, end)])

    def interleaved_rounds_replay() -> float:
        return next(readings)

    return interleaved_rounds_replay


class RatioRecorder:
    """What a case hands its measurements to: ``record(...)`` fills pytest-benchmark's stats and ``extra_info`` and
    queues the ratio for the session's table and gate."""

    def __init__(self, benchmark, request: pytest.FixtureRequest):
        self.benchmark, self.request = benchmark, request

    def record(
        self,
        device: str,
        ours: list[float],
        peer: list[float],
        peer_name: str,
        bytes_moved: int,
        size: str,
        bandwidth_GBps: float | None = None,
        **info,
    ) -> dict:
        """``ours`` and ``peer``: seconds per call in each round (the same rounds); ``bytes_moved``: what one call
        reads plus writes (kernels) or sends (collectives, steps); ``size``: what the baseline must match;
        ``bandwidth_GBps``: the achieved bandwidth if not bytes / time (collectives: bus bandwidth)."""
        summary = gate.ratio_summary(ours, peer)
        gbps = bandwidth_GBps if bandwidth_GBps is not None else bytes_moved / summary["gpudist_s"] / 1e9
        copy = self.request.getfixturevalue("copy_GBps")(device, max(bytes_moved // 8, 1))
        extra = {
            "device": device,
            "device_kind": gate.device_kind(device),
            "size": size,
            "peer": peer_name,
            **summary,
            "bytes_moved": bytes_moved,
            "GBps": gbps,
            "copy_GBps": copy,
            "fraction_of_copy": gbps / copy,
            **info,
        }
        self.benchmark.extra_info.update(extra)
        if self.benchmark.enabled:
            self.benchmark._timer = _replay(ours)  # pytest-benchmark 4-5 read the timer from this attribute
            self.benchmark.pedantic(lambda: None, rounds=len(ours), iterations=1)
        self.request.config.stash[_RECORDS].append({"key": self.request.node.nodeid, **extra})
        return extra


@pytest.fixture
def ratio(benchmark, request) -> RatioRecorder:
    return RatioRecorder(benchmark, request)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    records = config.stash.get(_RECORDS, [])
    if not records:
        return
    directory, tolerance = config.getoption("--gate-baselines"), config.getoption("--gate-tolerance")
    if config.getoption("--gate-write"):
        config.stash[_REPORT] = gate.GateReport(
            notes=[f"wrote {p}" for p in gate.write_baselines(records, directory, tolerance=tolerance)]
        )
    elif config.getoption("--gate"):
        report = config.stash[_REPORT] = gate.check(records, directory, tolerance)
        if not report.ok and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    records = config.stash.get(_RECORDS, [])
    if not records:
        return
    tr = terminalreporter
    tr.section("gpudist vs peer: ratio = peer time / gpudist time (> 1: gpudist faster), median of per-round ratios")
    tr.write_line(
        f"{'case':<62} {'gpudist':>10} {'peer':>10} {'ratio':>6} {'IQR':>11} {'GB/s':>8} {'of copy':>7}  peer"
    )
    for r in records:
        name = r["key"].split("::")[-1]
        tr.write_line(
            f"{name:<62} {r['gpudist_s'] * 1e6:>8.1f}us {r['peer_s'] * 1e6:>8.1f}us {r['ratio']:>6.3f} "
            f"{r['ratio_q1']:>5.2f}-{r['ratio_q3']:<5.2f} {r['GBps']:>8.2f} {r['fraction_of_copy']:>7.3f}  {r['peer']}"
        )
    report = config.stash.get(_REPORT, None)
    if report is not None:
        tr.section("gpudist benchmark gate", red=not report.ok, green=report.ok)
        for line in report.format().splitlines():
            tr.write_line(line)
