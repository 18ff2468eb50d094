"""Host time, measured like memory: what gpudist's glue costs the host per call and per parameter, beside torch's.

    python -m benchmarks.host_overhead [--sections calls,backward,steps] [--rounds 7] [--out FILE]

On a GPU the host's time is most of a step's for models up to a few hundred million parameters (the H200 run of
2026-11-28: docs/results.md#on-a-gpu), so it is measured here where it can be isolated, on the CPU, with the work
itself made negligible (tiny tensors), interleaved round by round with the torch call that does the same job:

- ``calls``: host microseconds per call, issued back to back. ``pack``/``unpack`` of 1, 30 and 300 tensors of 4
  elements (against ``torch.cat(out=)`` + ``mul_``, and ``_foreach_copy_`` into views) and the same through a
  :class:`gpudist.kernels.PackPlan` built once; ``adam_step`` on a 1,024-element shard, and through a
  :class:`gpudist.kernels.AdamStep` built once (against ``torch._fused_adamw_``); the same plans on the GPU's (Triton)
  path with the kernel launch made a no-op (``*_launch_stubbed``: gpudist's own host work per call, to which a GPU
  adds one Triton launch; the Adam row as ZeRO calls it, with the global norm and a clip); one
  collective through gpudist's
  NCCL backend built over the simulated NCCL of tests/fakenccl.py, then given a no-op communicator and a no-op CUDA
  seam (stream hand-off, events), so only the backend's own Python remains: unchecked, async and planned
  (``plan_all_reduce``), against the same no-op call made directly. The pack and Adam rows come from
  ``gpudist.bench.host_calls``, beside ``cuda_call_rows``, which ``gpudist bench gpu`` times on a GPU.
- ``backward``: Python time inside backward per parameter: a model of 300 tiny parameters (150 Linear(8, 8)) at
  world size 1 over Gloo in this process, each wrapper's backward time minus the plain module's, over the parameter
  count; torch DDP (bucket view, static graph), ZeroRedundancyOptimizer and FSDP2 (each Linear a unit, as gpudist's
  FSDP here) beside, every optimizer AdamW(fused=True); gpudist DDP and ZeRO-2 also with ``static_graph=True``
  (``*_static``: one hook per bucket, under the promise torch DDP's row makes too). Medians of interleaved rounds.
- ``steps``: the same step per strategy (DDP, ZeRO-1/2/3, FSDP, DDP with int8 compression) on the GPU's path with
  CUDA stubbed: gpudist's NCCL backend over the simulated NCCL (tests/fakenccl.py), two ranks that build every
  strategy and take a step together, after which the communicator and the CUDA seam are no-ops and rank 0 alone
  times the steps; every Triton kernel forced and its launch a counted no-op. Per strategy: host microseconds per
  step by phase, the Python calls of one step (counted, not timed: immune to this machine's noise), its Triton
  launches and NCCL calls per step, its buckets (or units), and its glue (step time over the plain module's) per
  bucket and per parameter; the torch peers beside it on a Gloo group of one rank (their
  CPU path: their C++ glue plus tiny copies, no device to stub). Buckets of 5 KB: 8 for the 300 parameters.

The host-bound step against the peers over two Gloo processes on TCP is the strategy benchmarks' job, on the
``gpt-host`` workload (292 tiny tensors): ``GPUDIST_SHM=0 python -m benchmarks.ddp --workload gpt-host --phases 10``
and ``GPUDIST_SHM=0 python -m benchmarks.zero --workload gpt-host --phases 10``.
Results: ``benchmarks/results/host_overhead.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from gpudist.bench import environment
from gpudist.bench.host_calls import adam_variants, interleaved, pack_variants, per_call_us
from gpudist.bench.host_calls import cuda_call_rows as cuda_call_rows  # re-exported: the GPU rows live in the package
from gpudist.fileio import atomic_write_json

RESULTS = Path(__file__).resolve().parent / "results"


# -- calls -----------------------------------------------------------------------------------------------------------


class _NullCommunicator:
    """Stands in for the NCCL communicator once the backend is built: every call returns at once, so what is timed
    is the backend's own Python (the simulated NCCL's call, a matching of ranks across threads, costs ~60 us)."""

    def __getattr__(self, name: str):
        return _null


def _null(*args) -> None:
    return None


class _DoneEvent:
    @staticmethod
    def query() -> bool:
        return True


class _NullRuntime:
    """Stands in for the backend's CUDA seam (stream hand-off, events, holding tensors): nothing to do, so the
    measured time is gpudist's frontend alone. On a GPU the hand-off costs what it costs for any caller; the raw
    baseline here makes no hand-off either."""

    _event = _DoneEvent()

    def stream(self) -> int:
        return 0

    def hold(self, tensors) -> None:
        pass

    def record(self) -> _DoneEvent:
        return self._event

    def record_current(self) -> _DoneEvent:
        return self._event

    def recycle(self, event) -> None:
        pass

    def wait(self, event) -> None:
        pass

    def on_comm(self):
        return contextlib.nullcontext()

    def selected(self):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass


def _collective_rows(comm, calls: int, rounds: int) -> dict[str, dict]:
    x = torch.ones(256)
    saved = comm._comm, comm._rt
    comm._comm, comm._rt = raw, _ = _NullCommunicator(), _NullRuntime()
    lib = comm._lib
    planned = comm.plan_all_reduce(x)

    def unchecked() -> None:
        with comm.unchecked():
            comm.all_reduce(x)

    rows = {
        "all_reduce_raw": lambda: per_call_us(
            lambda: raw.allReduce(x.data_ptr(), x.data_ptr(), 256, lib.NCCL_FLOAT32, lib.NCCL_SUM, 0), calls
        ),
        "all_reduce_unchecked": lambda: per_call_us(unchecked, calls),
        "all_reduce_async": lambda: per_call_us(lambda: comm.all_reduce(x, async_op=True).wait(), calls),
    }
    if planned is not None:
        rows["all_reduce_planned"] = lambda: per_call_us(lambda: planned.start().wait(), calls)
    try:
        return interleaved(rows, rounds)
    finally:
        comm._comm, comm._rt = saved  # shutdown needs the real ones


def _simulated_nccl():
    """tests/fakenccl.py's simulated NCCL (``FakeNccl``, ``run_nccl``): CUDA and NCCL cost ~0 there."""
    repo = Path(__file__).resolve().parents[1]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from tests.fakenccl import FakeNccl, run_nccl

    return FakeNccl, run_nccl


def calls_section(rounds: int, calls: int) -> dict:
    rows = {}
    for n in (1, 30, 300):
        rows.update(interleaved(pack_variants(n, max(50, calls // max(1, n // 30))), rounds))
    rows.update(interleaved(adam_variants(calls), rounds))
    FakeNccl, run_nccl = _simulated_nccl()
    rows.update(run_nccl(_collective_rows, 1, FakeNccl(), calls=calls, rounds=rounds)[0])
    return rows


# -- backward --------------------------------------------------------------------------------------------------------

LAYERS = 150
TENSORS = 2 * LAYERS


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(LAYERS)])


def _phases(model: nn.Module, opt, x: torch.Tensor) -> Callable[[], dict[str, float]]:
    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "zero_grad": t4 - t3}

    return step


def _built(
    comm, bucket_mb: float | None = None, peers: bool = True
) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
    """The plain module and its torch peers at their best on the default (Gloo) process group (unless not ``peers``),
    and gpudist's wrappers on ``comm``, each on a fresh :func:`_tiny` with fused AdamW; ``bucket_mb``: every bucket
    cap (None: the defaults)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import gpudist
    from gpudist.strategies import DATA_PARALLEL_PAIRS, GradientCompressionOptimizer

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, fused=True)

    built = {}
    if peers:
        caps = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
        plain = _tiny()
        built["plain"] = (plain, adamw(plain.parameters()))
        ddp = DistributedDataParallel(_tiny(), gradient_as_bucket_view=True, static_graph=True, **caps)
        built["torch_ddp"] = (ddp, adamw(ddp.parameters()))
        zddp = DistributedDataParallel(_tiny(), gradient_as_bucket_view=True, static_graph=True, **caps)
        zopt = ZeroRedundancyOptimizer(
            zddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, fused=True, parameters_as_bucket_view=True
        )
        built["torch_zero"] = (zddp, zopt)
        fsdp2 = _tiny()
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in fsdp2:  # the same units as gpudist's FSDPModel below: each Linear, then the root
            fully_shard(layer, mesh=mesh)
        fully_shard(fsdp2, mesh=mesh)
        built["torch_fsdp2"] = (fsdp2, adamw(fsdp2.parameters()))
    caps = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb, "first_bucket_mb": bucket_mb}
    for strategy, static in (("ddp", False), ("ddp", True), ("zero1", False), ("zero2", False), ("zero2", True)):
        config = gpudist.ShardingConfiguration(comm, static_graph=static, **caps)
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        model = model_cls(_tiny(), config)
        built[f"gpudist_{strategy}{'_static' if static else ''}"] = (model, opt_cls(adamw(model.parameters()), config))
    config = gpudist.ShardingConfiguration(comm, **caps)
    for strategy, wrap in (("zero3", {}), ("fsdp", {"auto_wrap_policy": {nn.Linear}})):  # a unit per Linear, both
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        model = model_cls(_tiny(), config, **wrap)
        built[f"gpudist_{strategy}"] = (model, opt_cls(adamw(model.parameters()), config))
    model_cls, opt_cls = DATA_PARALLEL_PAIRS["ddp"]
    model = model_cls(_tiny(), config)
    built["gpudist_ddp_int8"] = (
        model,
        GradientCompressionOptimizer(opt_cls(adamw(model.parameters()), config), config, "int8"),
    )
    return built


def _interleaved_phases(built: dict, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Per variant, host microseconds per step by phase (:func:`_phases`): medians over ``steps`` steps per round,
    then over ``rounds`` interleaved rounds (after three warm-up steps each), with the step's total and its backward's
    extra microseconds per parameter over the plain module's."""
    x = torch.randn(4, 8)
    phases = {name: _phases(model, opt, x) for name, (model, opt) in built.items()}

    def median_phases(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
        samples = [fn() for _ in range(steps)]
        return {k: statistics.median(s[k] for s in samples) for k in samples[0]}

    for fn in phases.values():  # warm-up: buckets built, kernels and allocations settled
        for _ in range(3):
            fn()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in phases}
    names = list(phases)
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            samples[name].append(median_phases(phases[name]))
    table = {name: {k: statistics.median(s[k] for s in rows) * 1e6 for k in rows[0]} for name, rows in samples.items()}
    for row in table.values():
        row["step_total_us"] = sum(row[k] for k in ("forward", "backward", "step", "zero_grad"))
        row["backward_extra_us_per_param"] = (row["backward"] - table["plain"]["backward"]) / TENSORS
    return table


def backward_section(rounds: int, steps: int) -> dict:
    import torch.distributed as dist

    from gpudist.comm import GlooCommunicationBackend

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        table = _interleaved_phases(_built(GlooCommunicationBackend()), rounds, steps)
    finally:
        dist.destroy_process_group()
    return {"model": f"{LAYERS} x Linear(8, 8): {TENSORS} parameters", "world_size": 1, "us": table}


# -- steps -------------------------------------------------------------------------------------------------------------

STEP_BUCKET_MB = 0.005
"""Bucket cap of the steps section: the 43 KB model in 8 buckets (gpudist) and about as many for torch DDP."""


class _SwitchedCommunicator:
    """Stands in for the simulated NCCL's communicator from before a strategy plans its collectives (a plan binds the
    communicator's method): forwards every call to it until :attr:`off`, then returns at once, counting the
    collectives (one more Python call per collective than the communicator itself: ~0.1 us)."""

    COLLECTIVES = frozenset({"allReduce", "reduceScatter", "allGather", "broadcast", "bcast", "reduce", "send", "recv"})

    def __init__(self, real):
        self.real, self.off = real, False
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name: str):
        real = getattr(self.real, name)
        if not callable(real):
            return real
        counted = name in self.COLLECTIVES

        def call(*args):
            if not self.off:
                return real(*args)
            if counted:
                self.calls[name] += 1
            return None

        return call


def _units(model: nn.Module) -> int:
    """What a strategy launches its gradient collectives by: buckets (DDP, ZeRO-1/2), units (ZeRO-3, FSDP)."""
    collective = getattr(model, "_collective", None)
    return len(collective.buckets) if collective is not None else len(model._groups)


def _timed_steps(built: dict, rounds: int, steps: int, launches: collections.Counter, nccl) -> dict:
    """:func:`_interleaved_phases` of ``built``, and per gpudist variant the launches and collectives of one more
    step, its strategy's units, and its glue (its step's microseconds over the plain module's) per unit and per
    parameter."""
    table = _interleaved_phases(built, rounds, steps)
    x = torch.randn(4, 8)
    for name, (model, opt) in built.items():
        launches.clear()
        nccl.calls.clear()
        table[name]["python_calls_per_step"] = _python_calls(_phases(model, opt, x))
        if not name.startswith("gpudist_"):
            continue
        units = _units(model)
        glue = table[name]["step_total_us"] - table["plain"]["step_total_us"]
        table[name].update(
            launches_per_step=sum(launches.values()),
            collectives_per_step=sum(nccl.calls.values()),
            units=units,
            glue_us_per_unit=glue / units,
            glue_us_per_param=glue / TENSORS,
            extra_python_calls_per_unit=(table[name]["python_calls_per_step"] - table["plain"]["python_calls_per_step"])
            / units,
        )
    return table


def _python_calls(fn: Callable[[], object]) -> int:
    """Python and C functions called from Python in one call of ``fn`` on this thread (autograd runs a CPU backward on
    the caller's thread, its hooks included): host work counted, not timed, so this noisy machine cannot blur it."""
    count = 0

    def profiler(frame, event, arg) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _step_rows(comm, rounds: int, steps: int, meet, launches: collections.Counter) -> dict | None:
    """The ``steps`` section on two ranks of the simulated NCCL: both build every strategy and take a first step
    together; then the communicator and the CUDA seam become no-ops (a collective needs no peer any more) and rank 0
    alone times the steady-state steps, every Triton launch a counted no-op, beside the torch peers on a Gloo group of
    its own (world size 1): what each strategy's step costs the host on the GPU's path."""
    import torch.distributed as dist

    saved = comm._comm, comm._rt
    comm._comm = nccl = _SwitchedCommunicator(comm._comm)
    if comm.rank == 0:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        built = _built(comm, STEP_BUCKET_MB, peers=comm.rank == 0)
        x = torch.randn(4, 8)
        for model, opt in built.values():  # plans and buffers made over the simulated NCCL, the ranks together
            _phases(model, opt, x)()
        meet.wait()
        nccl.off, comm._rt = True, _NullRuntime()
        table = _timed_steps(built, rounds, steps, launches, nccl) if comm.rank == 0 else None
    finally:
        if comm.rank == 0:
            dist.destroy_process_group()
        comm._comm, comm._rt = saved
    if table is None:
        return None
    return {
        "model": f"{LAYERS} x Linear(8, 8): {TENSORS} parameters, buckets of {STEP_BUCKET_MB} MB",
        "world_size": 2,
        "us": table,
    }


def steps_section(rounds: int, steps: int) -> dict:
    from gpudist.bench.host_calls import triton_launches_stubbed

    FakeNccl, run_nccl = _simulated_nccl()
    with triton_launches_stubbed() as launches:  # (for both rank threads)
        meet = threading.Barrier(2, timeout=900)
        return run_nccl(_step_rows, 2, FakeNccl(), rounds=rounds, steps=steps, meet=meet, launches=launches)[0]


# -- command -----------------------------------------------------------------------------------------------------------


def format_report(doc: dict) -> str:
    lines = [f"# host overhead, {doc['environment']['cpu']}, torch {doc['environment']['torch']}, {doc['date']}"]
    if "calls" in doc:
        lines.append(f"{'call':<34} {'us/call (median)':>16} {'min':>8} {'max':>8}")
        for name, r in doc["calls"].items():
            lines.append(f"{name:<34} {r['median']:>16.1f} {r['min']:>8.1f} {r['max']:>8.1f}")
    for section in ("backward", "steps"):
        if section not in doc:
            continue
        b = doc[section]
        lines.append(f"# {section}: per step, {b['model']}, world size {b['world_size']} (us, interleaved medians)")
        counted = section == "steps"
        lines.append(
            f"{'variant':<18} {'forward':>8} {'backward':>9} {'step':>8} {'zero':>6} {'total':>8} {'bwd/param':>10}"
            + (f" {'py calls':>8} {'launches':>8} {'colls':>6} {'units':>6} {'glue/unit':>10}" if counted else "")
        )
        for name, r in b["us"].items():
            line = (
                f"{name:<18} {r['forward']:>8.0f} {r['backward']:>9.0f} {r['step']:>8.0f} {r['zero_grad']:>6.0f} "
                f"{r['step_total_us']:>8.0f} {r['backward_extra_us_per_param']:>10.2f}"
            )
            if counted:
                line += f" {r['python_calls_per_step']:>8}"
            if counted and "units" in r:
                line += (
                    f" {r['launches_per_step']:>8} {r['collectives_per_step']:>6} {r['units']:>6} "
                    f"{r['glue_us_per_unit']:>10.1f}"
                )
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="calls,backward", help="comma-separated: calls, backward, steps")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median reported)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per measurement (calls section)")
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round (backward, steps)")
    parser.add_argument("--out", default=str(RESULTS / "host_overhead.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host work, not parallel kernels: one thread, as a rank sharing its cores would have
    env = environment()
    doc: dict = {"benchmark": "host_overhead", "date": env["date"], "environment": env, "settings": vars(args)}
    sections = args.sections.split(",")
    if "calls" in sections:
        doc["calls"] = calls_section(args.rounds, args.calls)
    if "backward" in sections:
        doc["backward"] = backward_section(args.rounds, args.steps)
    if "steps" in sections:
        doc["steps"] = steps_section(args.rounds, args.steps)
    print(format_report(doc))
    print(f"# wrote {atomic_write_json(args.out, doc)}")
    return doc


if __name__ == "__main__":
    main()
