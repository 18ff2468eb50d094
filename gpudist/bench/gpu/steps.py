"""The step parts of ``gpudist bench gpu``: whole training steps against torch's peers (strategies), and where a
step's time goes (profile)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .. import peers
from .. import workloads as W
from ..collectives import (
    interleaved_times,
)
from .common import GPUSettings, _cupy_nccl, _error_text, _world, part_rows

# -- part: strategy step times ---------------------------------------------------------------------------------------


def _strategy_variants(
    comm,
    torch_group,
    device: torch.device,
    workload: str,
    batch: int,
    overrides: dict,
    autocast: torch.dtype | None = None,
) -> tuple[dict[str, Callable[[], None]], dict[str, torch.Tensor], dict[str, str]]:
    """(name -> one training step, name -> its last loss, name -> why it could not be built): gpudist DDP, ZeRO-2 and
    FSDP over ``comm``, torch DDP, DDP + ZeroRedundancyOptimizer and FSDP2 over ``torch_group``, each from the same
    seeded model with fused AdamW, stepping on the same ``batch`` samples (each rank its own, seeded by its rank, as
    benchmarks/peers.py; forward and loss under ``autocast`` to that dtype when given, as such models are trained).
    A variant that fails to build on any rank is left out on every rank."""
    generator = torch.Generator().manual_seed(1234 + comm.rank)
    x, y = (t.to(device) for t in W.batch(workload, batch, generator, **overrides))
    from torch.nn.parallel import DistributedDataParallel

    from ...config import ShardingConfiguration
    from ...strategies import DATA_PARALLEL_PAIRS

    def net():
        return W.make(workload, **overrides).to(device)

    def gpudist_pair(strategy: str):
        # static_graph where the peer promises it too (torch DDP below): one gradient hook per bucket
        config = ShardingConfiguration(comm, bucket_cap_mb=25.0, static_graph=strategy != "fsdp")
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        wrap = {"auto_wrap_policy": peers.gpudist_units(workload)} if strategy == "fsdp" else {}
        model = model_cls(net(), config, **wrap)
        return model, opt_cls(peers.adamw(model.parameters(), fused=True), config)

    def ddp_module():
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(
            net(),
            device_ids=ids,
            process_group=torch_group,
            bucket_cap_mb=25.0,
            gradient_as_bucket_view=True,
            static_graph=True,
        )

    def torch_ddp():
        model = ddp_module()
        return model, peers.adamw(model.parameters(), fused=True)

    def torch_zero():
        model = ddp_module()
        return model, peers.zero_redundancy(model.parameters(), torch_group)

    def fsdp2():
        model = peers.fully_sharded(workload, net(), torch_group, device)
        return model, peers.adamw(model.parameters(), fused=True)

    builders = {
        "gpudist_ddp": lambda: gpudist_pair("ddp"),
        "torch_ddp": torch_ddp,
        "gpudist_zero2": lambda: gpudist_pair("zero2"),
        "torch_zero": torch_zero,
        "gpudist_fsdp": lambda: gpudist_pair("fsdp"),
        "fsdp2": fsdp2,
    }
    built, errors = {}, {}
    for name, build in builders.items():
        try:
            built[name] = build()
        except Exception as e:
            errors[name] = _error_text(e)
    # Every rank must time the same variants, or their collectives would pair up wrongly.
    ok = torch.tensor([name in built for name in builders], dtype=torch.float32, device=comm.device)
    comm.all_reduce(ok, "min")
    for name, flag in zip(builders, ok.tolist(), strict=True):
        if not flag and name in built:
            del built[name]
            errors[name] = "failed on another rank"

    losses: dict[str, torch.Tensor] = {}

    def forward(model) -> torch.Tensor:
        if autocast is None:
            return W.loss(workload, model, x, y)
        with torch.autocast(device.type, dtype=autocast):
            return W.loss(workload, model, x, y)

    def step_of(name, model, opt):
        def step(phases: dict[str, float] | None = None) -> None:
            """One step; ``phases``: add the host seconds of each phase (nothing waits for the device, so on a
            host-bound step these are where the step's time goes)."""
            t0 = time.perf_counter()
            loss = forward(model)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            t4 = time.perf_counter()
            losses[name] = loss.detach()
            if phases is not None:
                for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    phases[phase] = phases.get(phase, 0.0) + seconds

        return step

    return {name: step_of(name, *pair) for name, pair in built.items()}, losses, errors


PHASES = ("forward", "backward", "step", "zero_grad")
"""The phases of a training step whose host time the profile part reports."""

PEERS = (("gpudist_ddp", "torch_ddp"), ("gpudist_zero2", "torch_zero"), ("gpudist_fsdp", "fsdp2"))


def strategy_rows(
    comm,
    torch_group,
    device: torch.device,
    workload: str,
    batch: int,
    steps: int,
    rounds: int,
    overrides: dict,
    autocast: torch.dtype | None = None,
) -> dict:
    """On every rank: median step time of each variant (interleaved rounds, each at its slowest rank), the loss each
    reached after the same number of steps (the variants train the same function, so these agree to rounding),
    and peer time / gpudist time (> 1: gpudist faster). ``autocast``: forward and loss under that dtype."""
    steps_by_name, losses, errors = _strategy_variants(comm, torch_group, device, workload, batch, overrides, autocast)
    times = interleaved_times(comm, steps_by_name, steps, rounds) if steps_by_name else {}
    final = {name: float(loss) for name, loss in losses.items()}
    spread = (max(final.values()) - min(final.values())) / abs(statistics.mean(final.values())) if final else None
    return {
        "workload": workload,
        "model": W.describe(W.make(workload, **overrides)),
        "batch_per_rank": batch,
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "world_size": comm.world_size,
        "step_ms": {name: t * 1e3 for name, t in times.items()},
        "final_loss": final,
        "final_loss_relative_spread": spread,
        "peer_over_gpudist": {
            f"{peer}/{ours}": times[peer] / times[ours] for ours, peer in PEERS if {ours, peer} <= set(times)
        },
        "errors": errors,
    }


def _strategies_body(gloo, nccl, settings: GPUSettings) -> list[dict]:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl", device_id=nccl.device)
    rows = []
    for workload in settings.workloads:
        batch = settings.batch.get(workload, 8)
        overrides = settings.model_overrides
        autocast = settings.autocast.get(workload)
        try:
            rows.append(
                strategy_rows(
                    nccl,
                    group,
                    nccl.device,
                    workload,
                    batch,
                    settings.steps,
                    settings.rounds,
                    overrides,
                    None if autocast is None else getattr(torch, autocast),
                )
            )
        except Exception as e:  # the next workload still runs (unless the groups are broken: then it fails too)
            rows.append({"workload": workload, "error": _error_text(e)})
    return rows


def strategies_part(settings: GPUSettings) -> dict:
    world = _world(settings)
    rows = part_rows(settings, "strategies", _strategies_body, world)
    return {
        "world_size": world,
        "peers": {
            "torch_ddp": "DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=25) "
            "over torch's NCCL group, AdamW(fused=True)",
            "fsdp2": "fully_shard per unit (each Linear of the MLP, each GPT block) and the root, AdamW(fused=True)",
            "torch_zero": "the same DDP + ZeroRedundancyOptimizer(AdamW, fused=True, parameters_as_bucket_view=True)",
            "gpudist_ddp": "DDPModel + DDPOptimizer(AdamW(fused=True)), 25 MiB buckets, gpudist's NCCL backend",
            "gpudist_zero2": "ZeRO2Model + ZeRO2Optimizer(AdamW), 25 MiB buckets, gpudist's NCCL backend",
            "gpudist_fsdp": "FSDPModel (same units) + ZeRO3Optimizer, gpudist's NCCL backend",
        },
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "steps_per_round": settings.steps,
        "rounds": settings.rounds,
        "rows": rows,
    }


# -- part: where a step's time goes -----------------------------------------------------------------------------------

PROFILE_WORKLOAD = "gpt-d1024"
ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
"""The profiled model: the 185M GPT under bf16 autocast, where the host's share of a step shows."""


def _busy_share(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of ``[start, end]`` covered by the union of ``intervals`` (a GPU's kernels: its busy time)."""
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start) if end > start else 0.0


def kernel_busy_share(events) -> float | None:
    """The GPU's busy share of a profiled span (``torch.profiler``'s events): the union of its kernels' intervals over
    the span of the host's events, or None when no kernel was recorded (a CPU run)."""
    host = [e.time_range for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    if not kernels or not host:
        return None
    return _busy_share(kernels, min(r.start for r in host), max(r.end for r in host))


def profile_rows(
    comm,
    torch_group,
    device: torch.device,
    workload: str,
    batch: int,
    steps: int,
    overrides: dict,
    autocast: torch.dtype | None = None,
) -> dict:
    """Per variant of the strategies part: milliseconds per step wall (synchronized) and to issue (the host's loop
    alone, nothing waited for), CPU milliseconds per step inside ``AccumulateGrad`` (where per-parameter hooks run,
    on the thread that launches backward), the GPU's busy share of a profiled step (union of kernel intervals over
    the wall), and the operators with the most self CPU time. One variant after the other, ``steps`` each."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    steps_by_name, _, errors = _strategy_variants(comm, torch_group, device, workload, batch, overrides, autocast)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows = {}
    for name, step in steps_by_name.items():
        for _ in range(2):
            step()
        sync()
        phases: dict[str, float] = {}
        start = time.perf_counter()
        for _ in range(steps):
            step(phases)
        issued = time.perf_counter()
        sync()
        done = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync()
        events = list(prof.events())
        host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        first = min(e.time_range.start for e in host)
        last = max(e.time_range.end for e in host)
        top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
        accumulate = [e for e in host if e.name == ACCUMULATE_GRAD]  # not the engine's evaluate_function around it
        rows[name] = {
            "wall_ms": (done - start) / steps * 1e3,
            "issue_ms": (issued - start) / steps * 1e3,
            "host_ms": {phase: seconds / steps * 1e3 for phase, seconds in phases.items()},
            "profiled_wall_ms": (last - first) / steps / 1e3,
            "accumulate_grad_cpu_ms": sum(e.cpu_time_total for e in accumulate) / steps / 1e3,
            "accumulate_grad_calls": len(accumulate) / steps,
            "gpu_busy_share": kernel_busy_share(events),
            "top_self_cpu_ms": {a.key: round(a.self_cpu_time_total / steps / 1e3, 3) for a in top},
        }
    return {
        "workload": workload,
        "batch_per_rank": batch,
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "steps": steps,
        "variants": rows,
        "errors": errors,
    }


def _profile_body(gloo, nccl, settings: GPUSettings) -> dict:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl", device_id=nccl.device)
    autocast = settings.autocast.get(PROFILE_WORKLOAD)
    return profile_rows(
        nccl,
        group,
        nccl.device,
        PROFILE_WORKLOAD,
        settings.batch.get(PROFILE_WORKLOAD, 8),
        settings.steps,
        settings.model_overrides,
        None if autocast is None else getattr(torch, autocast),
    )


def profile_part(settings: GPUSettings) -> dict:
    """One profiled run of each strategy variant on the 185M GPT under bf16 autocast (world 1 over NCCL): where a
    step's host time goes, and how much of the step the GPU is busy."""
    _cupy_nccl()
    return part_rows(settings, "profile", _profile_body, 1)
