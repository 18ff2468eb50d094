"""What the strategy benchmarks (``benchmarks/ddp.py``, ``benchmarks/zero.py``) share: the peers at their best and
at their defaults, the check that every variant trains the same function, interleaved timing with CPU time, and
the summary (medians, spread, ratios round by round).

Peers (``torch`` 2.13 on CPU; every optimizer is AdamW, lr 1e-4):

- torch DDP, best: ``gradient_as_bucket_view=True``, ``static_graph=True``, the same ``bucket_cap_mb`` as gpudist,
  ``AdamW(fused=True)``. Default: ``DistributedDataParallel(model)`` and ``AdamW()`` (the for-loop step on CPU).
  Measured here (2 Gloo ranks, 2 cores): the bucket views save 15% of the MLP step; ``static_graph`` is neutral
  (within +-3%, either sign); fused AdamW works on CPU and ``foreach=True`` is 1.7x slower than it on the MLP.
- ``ZeroRedundancyOptimizer``, best: ``optimizer_class=AdamW, fused=True, parameters_as_bucket_view=True`` over the
  best DDP (the bucket view saves 2-3%). ``overlap_with_ddp=True`` refuses Gloo ("may meet hangs"). Default:
  ``ZeroRedundancyOptimizer(optimizer_class=AdamW)`` over the default DDP.
- FSDP2 (``fully_shard`` on each unit, then on the root), best: ``AdamW(fused=True)``. Default: ``AdamW()``.
- DeepSpeed ZeRO-2/3 (only if ``import deepspeed`` works): over the same Gloo group, fp32, the client optimizer
  ``AdamW(fused=True)``, ``gradient_clipping=0`` (DeepSpeed clips at 1.0 by default; no other variant clips). Best:
  buckets of the same size as gpudist's (``reduce_bucket_size``, ``allgather_bucket_size`` /
  ``stage3_prefetch_bucket_size``) and ``overlap_comm`` on, measured faster than DeepSpeed's defaults on both
  workloads here (ZeRO-2 by 1.13-1.17x, ZeRO-3 by 1.23-1.40x). Default: ``{"stage": s}`` alone.

gpudist's wrappers get the same ``AdamW`` (``DDPOptimizer`` steps it as it is; the ZeRO optimizers step the owned
range with gpudist's fused kernel).

``LR``, ``adamw``, ``fsdp_units`` and ``gpudist_units`` are ``gpudist.bench.peers``' (re-exported here), which the
strategies part of ``gpudist bench gpu`` uses too.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import gpudist
from gpudist.bench import environment
from gpudist.bench.peers import LR, adamw, fsdp_units
from gpudist.bench.peers import gpudist_units as gpudist_units  # re-exported (ddp.py, zero.py, steps.py)
from gpudist.comm import ReductionOperation
from gpudist.fileio import atomic_write_json
from gpudist.strategies import DATA_PARALLEL_PAIRS

from . import workloads as W

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = {"mlp": 32, "gpt": 2, "gpt-deep": 2, "gpt-host": 2}
"""Samples per rank per step (GPT: sequences of 128 tokens)."""
TARGET = 1.05
"""gpudist must step at least this much faster than each best-configured peer (median over rounds)."""


@dataclass
class Variant:
    """One thing timed: ``step()`` runs one training step (or one analysis op) on this rank."""

    name: str
    role: str
    """"gpudist", "best" (a peer at its best settings: the targets), "default" (a peer at its defaults, reported
    beside) or "analysis" (no training function to check)."""
    label: str
    step: Callable[[], None]
    params: Callable[[], dict[str, torch.Tensor]] | None = None
    """The full parameters by name on every rank (collective for sharded variants); None for analysis variants."""
    settings: dict = field(default_factory=dict)
    phases: Callable[[], dict[str, float]] | None = None
    """One step, returning seconds per phase (forward, backward, step, zero_grad) for ``--phases``."""


def train_step(workload: str, model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        W.loss(workload, model, x, y).backward()
        opt.step()
        opt.zero_grad()

    return step


def phased_step(workload: str, model, opt, x, y, deepspeed: bool = False) -> Callable[[], dict[str, float]]:
    """One training step timed phase by phase (wall time; a collective counts in the phase that waits for it)."""

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        loss = W.loss(workload, model, x, y)
        t1 = time.perf_counter()
        if deepspeed:
            model.backward(loss)
        else:
            loss.backward()
        t2 = time.perf_counter()
        if deepspeed:
            model.step()
        else:
            opt.step()
        t3 = time.perf_counter()
        if not deepspeed:
            opt.zero_grad()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "zero_grad": t4 - t3}

    return step


def phase_times(comm, variants: list[Variant], steps: int) -> dict[str, dict[str, float]]:
    """Per variant and phase: the median over ``steps`` steps, averaged over ranks (each step after a barrier)."""
    names = [v.name for v in variants if v.phases is not None]
    keys = ("forward", "backward", "step", "zero_grad")
    out = torch.zeros(len(names), len(keys), dtype=torch.float64)
    for i, v in enumerate(v for v in variants if v.phases is not None):
        samples = []
        for _ in range(steps):
            comm.barrier()
            samples.append(v.phases())
        out[i] = torch.tensor([statistics.median(s[k] for s in samples) for k in keys], dtype=torch.float64)
    comm.all_reduce(out, ReductionOperation.AVERAGE)
    return {n: dict(zip(keys, out[i].tolist(), strict=True)) for i, n in enumerate(names)}


def format_phases(phases: dict[str, dict[str, float]]) -> str:
    lines = [
        f"# phases (median over steps, mean over ranks, ms): {'forward':>9} {'backward':>9} {'step':>9} "
        f"{'zero_grad':>9} {'sum':>9}"
    ]
    for name, p in phases.items():
        lines.append(
            f"{name:>48} {p['forward'] * 1e3:>9.1f} {p['backward'] * 1e3:>9.1f} {p['step'] * 1e3:>9.1f} "
            f"{p['zero_grad'] * 1e3:>9.1f} {sum(p.values()) * 1e3:>9.1f}"
        )
    return "\n".join(lines)


def plain_params(module: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {n: p.detach() for n, p in module.named_parameters()}


# -- gpudist -------------------------------------------------------------------------------------------------------


def transport(comm) -> str:
    """How a Gloo backend moves the collectives' bytes: ``"shm"`` (shared memory) or ``"tcp"``."""
    return "shm" if comm.shared_memory else "tcp"


def other_transport(comm):
    """A new group of the same ranks on the other Gloo transport (``--transport-ab``), or None where this one cannot
    share memory (collective)."""
    import torch.distributed as dist

    other = type(comm)(dist.new_group(backend="gloo"), timeout=comm.timeout, shm=transport(comm) == "tcp")
    return other if transport(other) != transport(comm) else None


def gpudist_variant(
    comm, workload: str, x, y, strategy: str, bucket_mb: float, units=None, suffix: str = "", min_unit_numel: int = 0
) -> Variant:
    """gpudist's model wrapper and optimizer for ``strategy`` (ddp, zero1, zero2, fsdp, zero3), default config;
    ``suffix`` is appended to its name (``_shm``/``_tcp`` for the other transport's twin). DDP, ZeRO-1 and ZeRO-2
    with ``static_graph=True``, the promise torch DDP's best row makes too (one gradient hook per bucket); ZeRO-3
    and FSDP with ``min_unit_numel`` (units smaller than that merged into the enclosing one)."""
    static = strategy in ("ddp", "zero1", "zero2")
    config = gpudist.ShardingConfiguration(comm, bucket_cap_mb=bucket_mb, static_graph=static)
    net = W.make(workload)
    model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
    if strategy == "fsdp":
        model = model_cls(net, config, auto_wrap_policy=units, min_unit_numel=min_unit_numel)
    elif strategy == "zero3":
        model = model_cls(net, config, units=units, min_unit_numel=min_unit_numel)
    else:
        model = model_cls(net, config)
    # DDPOptimizer steps the torch optimizer it wraps, so it gets the peers' best one; the ZeRO optimizers step their
    # owned range with gpudist's fused kernel whatever flags the AdamW carries.
    opt = opt_cls(adamw(model.parameters(), fused=True), config)
    sharded = strategy in ("fsdp", "zero3")
    label = {
        "ddp": "DDPModel + DDPOptimizer",
        "zero1": "ZeRO1Model + ZeRO1Optimizer",
        "zero2": "ZeRO2Model + ZeRO2Optimizer",
        "fsdp": "FSDPModel + ZeRO3Optimizer",
        "zero3": "ZeRO3Model + ZeRO3Optimizer",
    }[strategy]
    settings = {
        "bucket_cap_mb": bucket_mb,
        "config": "ShardingConfiguration defaults"
        + (", static_graph=True" if static else "")
        + (f", min_unit_numel={min_unit_numel}" if min_unit_numel else ""),
        "optimizer": "AdamW",
        "transport": transport(comm),
    }
    if sharded:
        settings["units"] = len(model.units()) if hasattr(model, "units") else None
    params = model.full_state_dict if sharded else plain_params(model.module)
    return Variant(
        (f"gpudist_{strategy}" if strategy != "ddp" else "gpudist") + suffix,
        "gpudist",
        f"gpudist {label}",
        train_step(workload, model, opt, x, y),
        params,
        settings,
        phased_step(workload, model, opt, x, y),
    )


# -- torch -----------------------------------------------------------------------------------------------------------


def torch_ddp(workload: str, best: bool, bucket_mb: float) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    if best:
        return DistributedDataParallel(
            W.make(workload), bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, static_graph=True
        )
    return DistributedDataParallel(W.make(workload))


def torch_ddp_variant(workload: str, x, y, best: bool, bucket_mb: float) -> Variant:
    ddp = torch_ddp(workload, best, bucket_mb)
    opt = adamw(ddp.parameters(), fused=best)
    settings = (
        {
            "bucket_cap_mb": bucket_mb,
            "gradient_as_bucket_view": True,
            "static_graph": True,
            "optimizer": "AdamW(fused=True)",
        }
        if best
        else {
            "bucket_cap_mb": 25,
            "gradient_as_bucket_view": False,
            "static_graph": False,
            "optimizer": "AdamW() (for-loop on CPU)",
        }
    )
    label = "torch DDP, best settings" if best else "torch DDP, defaults"
    return Variant(
        "torch_best" if best else "torch_default",
        "best" if best else "default",
        label,
        train_step(workload, ddp, opt, x, y),
        plain_params(ddp.module),
        settings,
        phased_step(workload, ddp, opt, x, y),
    )


def torch_zero_variant(workload: str, x, y, best: bool, bucket_mb: float) -> Variant:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = torch_ddp(workload, best, bucket_mb)
    if best:
        opt = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True, parameters_as_bucket_view=True
        )
        settings = {
            "ddp": {"bucket_cap_mb": bucket_mb, "gradient_as_bucket_view": True, "static_graph": True},
            "optimizer": "ZeroRedundancyOptimizer(AdamW, fused=True, parameters_as_bucket_view=True)",
        }
    else:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        settings = {"ddp": "defaults", "optimizer": "ZeroRedundancyOptimizer(AdamW) defaults"}
    label = "torch DDP + ZeroRedundancyOptimizer, " + ("best settings" if best else "defaults")
    return Variant(
        "torch_zero_best" if best else "torch_zero_default",
        "best" if best else "default",
        label,
        train_step(workload, ddp, opt, x, y),
        plain_params(ddp.module),
        settings,
        phased_step(workload, ddp, opt, x, y),
    )


def fsdp2_variant(workload: str, x, y, best: bool) -> Variant:
    from torch.distributed.fsdp import fully_shard

    model = W.make(workload)
    units = fsdp_units(workload, model)
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    opt = adamw(model.parameters(), fused=best)
    settings = {
        "units": len(units) + 1,
        "reshard_after_forward": True,
        "optimizer": "AdamW(fused=True)" if best else "AdamW() (for-loop on CPU)",
    }

    def params() -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach() for n, p in model.named_parameters()}

    label = "torch FSDP2 (fully_shard per unit and root), " + ("best settings" if best else "defaults")
    return Variant(
        "fsdp2_best" if best else "fsdp2_default",
        "best" if best else "default",
        label,
        train_step(workload, model, opt, x, y),
        params,
        settings,
        phased_step(workload, model, opt, x, y),
    )


# -- DeepSpeed (optional) -------------------------------------------------------------------------------------------


def deepspeed_status() -> str | None:
    """None if DeepSpeed imports here, else why it is skipped."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "skipped: deepspeed not installed"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # an install that cannot import here (missing ops, incompatible torch, ...)
        return f"skipped: import deepspeed failed: {type(e).__name__}: {e}"
    return None


def deepspeed_variant(comm, workload: str, x, y, stage: int, bucket_mb: float, tuned: bool = True) -> Variant:
    """A DeepSpeed engine at ZeRO ``stage`` over the Gloo group the ranks already share: with torch.distributed
    initialized, DeepSpeed's communication is a ``TorchBackend`` on that group (recorded as ``comm_backend``)."""
    os.environ.setdefault("RANK", str(comm.rank))
    os.environ.setdefault("LOCAL_RANK", str(comm.rank))
    os.environ.setdefault("WORLD_SIZE", str(comm.world_size))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(comm.world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    model = W.make(workload)
    elements = int(bucket_mb * (1 << 20)) // 4
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": elements}
    if stage == 2:
        zero["allgather_bucket_size"] = elements
    else:
        zero["stage3_prefetch_bucket_size"] = elements
    if not tuned:  # DeepSpeed's own defaults (buckets of 5e8 elements; stage 2 without overlap_comm)
        zero = {"stage": stage}
    # DeepSpeed clips gradients at norm 1.0 unless told otherwise (gradient_clipping defaults to 1.0 in 0.19), which
    # the other variants do not: off, so that it trains the same function (the check caught the difference).
    config = {
        "train_micro_batch_size_per_gpu": x.shape[0],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    linear = torch.nn.functional.linear
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=adamw(model.parameters(), fused=True), config=config, dist_init_required=False
    )
    # ZeRO-3 replaces torch.nn.functional.linear process-wide with its own autograd function (memory_efficient_linear,
    # "this will persist unless manually reset"), which would then run inside every other variant too: put torch's
    # back, and give DeepSpeed its own only while its steps run.
    own_linear, torch.nn.functional.linear = torch.nn.functional.linear, linear

    def own(fn: Callable):
        def run(*args):
            torch.nn.functional.linear = own_linear
            try:
                return fn(*args)
            finally:
                torch.nn.functional.linear = linear

        return run

    @own
    def step() -> None:
        engine.backward(W.loss(workload, engine, x, y))
        engine.step()

    def params() -> dict[str, torch.Tensor]:
        named = list(engine.module.named_parameters())
        if stage < 3:
            return {n: p.detach() for n, p in named}
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}

    settings = {
        "version": deepspeed.__version__,
        "zero_optimization": zero,
        "optimizer": "AdamW(fused=True) (client)",
        "comm_backend": type(deepspeed.comm.comm.cdb).__name__,
    }
    name, label = f"deepspeed_zero{stage}", f"DeepSpeed {deepspeed.__version__} ZeRO-{stage}, "
    name, label = (name, label + "tuned buckets, overlap_comm") if tuned else (name + "_default", label + "defaults")
    settings["memory_efficient_linear"] = own_linear is not linear
    return Variant(
        name,
        "best" if tuned else "default",
        label,
        step,
        params,
        settings,
        own(phased_step(workload, engine, None, x, y, deepspeed=True)),
    )


# -- checks and timing ----------------------------------------------------------------------------------------------


def rank_batches(workload: str, batch: int, world_size: int, seed: int = 1234) -> list[tuple]:
    """Every rank's batch (rank r's comes from generator seed + r), so that any rank can compute the reference."""
    return [W.batch(workload, batch, torch.Generator().manual_seed(seed + r)) for r in range(world_size)]


def check_same_function(comm, workload: str, batches: list[tuple], variants: list[Variant], steps: int = 2) -> dict:
    """Take ``steps`` steps of every variant from the identical initial values and compare the full parameters with
    a local reference (one model, fused AdamW, the loss averaged over every rank's batch, which is the function
    data-parallel training of equal batches computes). Returns per variant the max |difference| and the mean
    |difference| relative to the mean |update| of the reference."""
    ref = W.make(workload)
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = adamw(ref.parameters(), fused=True)
    for _ in range(steps):
        total = sum(W.loss(workload, ref, x, y) for x, y in batches) / len(batches)
        total.backward()
        opt.step()
        opt.zero_grad()
    want = dict(ref.named_parameters())
    update = sum(float((want[n].detach() - init[n]).abs().sum()) for n in want)
    out = {}
    for v in variants:
        if v.params is None:
            continue
        for _ in range(steps):
            v.step()
        got = v.params()
        diff_max, diff_sum, per_tensor = 0.0, 0.0, {}
        for n, w in want.items():
            d = (got[n].reshape(w.shape).to(w.dtype) - w.detach()).abs()
            diff_max, diff_sum = max(diff_max, float(d.max())), diff_sum + float(d.sum())
            per_tensor[n] = float(d.sum()) / max(float((w.detach() - init[n]).abs().sum()), 1e-30)
        worst = max(per_tensor, key=per_tensor.get)
        out[v.name] = {
            "max_abs_diff": diff_max,
            "relative_diff": diff_sum / max(update, 1e-30),
            "worst_tensor": worst,
            "worst_tensor_relative_diff": per_tensor[worst],
            "ok": diff_sum / max(update, 1e-30) < 1e-2,
        }
    return out


def interleaved_rounds(comm, variants: dict[str, Callable[[], object]], steps: int, rounds: int) -> dict:
    """Per variant and round: seconds per step of the slowest rank, and CPU seconds per step (``process_time``: every
    thread of the process, Gloo's included), the system part of it and the minor page faults, averaged over ranks.
    Every round runs each variant ``steps`` times after a barrier; the order rotates by one each round, so no
    variant always follows the same one."""
    names = list(variants)
    wall = torch.zeros(len(names), rounds, dtype=torch.float64)
    cpu = torch.zeros(3, len(names), rounds, dtype=torch.float64)  # CPU seconds, of which system, page faults
    for r in range(rounds):
        for k in range(len(names)):
            i = (r + k) % len(names)
            fn = variants[names[i]]
            comm.barrier()
            u0, t0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
            for _ in range(steps):
                fn()
            wall[i, r] = (time.perf_counter() - t0) / steps
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu[:, i, r] = (
                torch.tensor(
                    [time.process_time() - c0, u1.ru_stime - u0.ru_stime, u1.ru_minflt - u0.ru_minflt],
                    dtype=torch.float64,
                )
                / steps
            )
    comm.all_reduce(wall, ReductionOperation.MAX)
    comm.all_reduce(cpu, ReductionOperation.AVERAGE)
    return {
        n: {
            "wall": wall[i].tolist(),
            "cpu": cpu[0, i].tolist(),
            "sys": cpu[1, i].tolist(),
            "faults": cpu[2, i].tolist(),
        }
        for i, n in enumerate(names)
    }


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(rounds: dict) -> dict:
    out = {}
    for name, r in rounds.items():
        wall, cpu = r["wall"], r["cpu"]
        q1, q3 = quartiles(wall)
        out[name] = {
            "median_s": statistics.median(wall),
            "min_s": min(wall),
            "max_s": max(wall),
            "q1_s": q1,
            "q3_s": q3,
            "cpu_median_s": statistics.median(cpu),
            "sys_median_s": statistics.median(r["sys"]),
            "faults_median": statistics.median(r["faults"]),
            "cpu_per_wall": statistics.median(c / w for c, w in zip(cpu, wall, strict=True)),
        }
    return out


def compare(rounds: dict, summary: dict, ours: str, peer: str, target: bool) -> dict:
    """Speed ratio peer/ours (> 1: gpudist faster) from the medians, and round by round."""
    per_round = [p / o for o, p in zip(rounds[ours]["wall"], rounds[peer]["wall"], strict=True)]
    ratio = summary[peer]["median_s"] / summary[ours]["median_s"]
    cpu = summary[peer]["cpu_median_s"] / summary[ours]["cpu_median_s"]
    return {
        "gpudist": ours,
        "peer": peer,
        "ratio": ratio,
        "per_round_min": min(per_round),
        "per_round_median": statistics.median(per_round),
        "per_round_max": max(per_round),
        "rounds_below_1": sum(r < 1 for r in per_round),
        "rounds": len(per_round),
        "cpu_ratio": cpu,
        "target": TARGET if target else None,
        "met": (ratio >= TARGET) if target else None,
    }


def format_tables(title: str, variants: dict[str, dict], summary: dict, checks: dict, comparisons: list[dict]) -> str:
    head = (
        f"{'variant':<20} {'role':<8} {'median ms':>9} {'min':>7} {'max':>7} {'IQR':>13} {'cpu ms':>7} "
        f"{'cpu/wall':>8} {'sys ms':>6} {'faults':>6}  {'check max|d|':>12} {'rel':>8}  setting"
    )
    lines = [title, head]
    for name, s in summary.items():
        v = variants[name]
        c = checks.get(name)
        check = f"{c['max_abs_diff']:>12.2e} {c['relative_diff']:>8.1e}" if c else f"{'-':>12} {'-':>8}"
        iqr = f"{s['q1_s'] * 1e3:.1f}-{s['q3_s'] * 1e3:.1f}"
        lines.append(
            f"{name:<20} {v['role']:<8} {s['median_s'] * 1e3:>9.1f} {s['min_s'] * 1e3:>7.1f} "
            f"{s['max_s'] * 1e3:>7.1f} {iqr:>13} {s['cpu_median_s'] * 1e3:>7.1f} {s['cpu_per_wall']:>8.2f} "
            f"{s['sys_median_s'] * 1e3:>6.1f} {s['faults_median']:>6.0f}  {check}  {v['label']}"
        )
    lines.append(
        "# cpu: process CPU time per step (all threads), sys: its kernel part, faults: minor page faults per "
        "step (fresh memory the kernel zeroes); averaged over ranks"
    )
    lines.append(
        "# ratio = peer time / gpudist time (> 1: gpudist faster); rounds: min-max of the per-round ratio; "
        "cpu = peer CPU time / gpudist CPU time"
    )
    for c in comparisons:
        verdict = "" if c["target"] is None else ("  target >= 1.05: met" if c["met"] else "  target >= 1.05: MISSED")
        lines.append(
            f"{c['gpudist']:>14} vs {c['peer']:<20} {c['ratio']:.3f}  rounds {c['per_round_min']:.3f}-"
            f"{c['per_round_max']:.3f} ({c['rounds_below_1']}/{c['rounds']} below 1)  cpu {c['cpu_ratio']:.3f}"
            f"{verdict}"
        )
    return "\n".join(lines)


def describe_variants(variants: list[Variant]) -> dict[str, dict]:
    return {v.name: {"role": v.role, "label": v.label, "settings": v.settings} for v in variants}


# -- what every strategy benchmark does around its variants -------------------------------------------------------


def measure(
    comm, workload: str, batches: list[tuple], variants: list[Variant], steps: int, rounds: int, phase_steps: int = 0
) -> dict:
    """On every rank: the same-function check, a warm-up step, the interleaved rounds, the phases if asked, and this
    rank's peak RSS after building and at the end."""
    rss_built = max_rss_mib()
    checks = check_same_function(comm, workload, batches, variants)
    for v in variants:  # warm-up (the training variants also took the check's steps)
        v.step()
    rounds_data = interleaved_rounds(comm, {v.name: v.step for v in variants}, steps, rounds)
    phases = phase_times(comm, variants, phase_steps) if phase_steps else None
    return {
        "rounds": rounds_data,
        "checks": checks,
        "variants": describe_variants(variants),
        "phases": phases,
        "max_rss_mib": {"after_build": rss_built, "end": max_rss_mib()},
    }


def arguments(doc: str, bucket_help: str) -> argparse.ArgumentParser:
    """The options every strategy benchmark takes; each adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["mlp", "gpt"], choices=list(W.WORKLOADS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help=f"samples per rank per step (default {BATCH})")
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help=bucket_help)
    parser.add_argument(
        "--only",
        type=lambda t: t.split(","),
        default=None,
        help="comma-separated variant names to run (development and profiling)",
    )
    parser.add_argument(
        "--phases",
        type=int,
        default=0,
        metavar="STEPS",
        help="also time forward, backward, step and zero_grad of each variant over STEPS steps",
    )
    parser.add_argument(
        "--transport-ab",
        action="store_true",
        help="also time gpudist over the other Gloo transport (shared memory or TCP) in the same rounds",
    )
    parser.add_argument("--out", default=None, help="JSON path; {workload} is replaced by the workload's name")
    return parser


def document(benchmark: str, workload: str, args, batch: int, res_all: list[dict], comparisons) -> dict:
    """The JSON every strategy benchmark writes, from rank 0's measurement (``comparisons(rounds, summary)`` picks
    the pairs)."""
    res = res_all[0]
    summary = summarize(res["rounds"])
    return {
        "benchmark": benchmark,
        "backend": "gloo",
        "world_size": args.world_size,
        "workload": workload,
        "model": W.describe(W.make(workload)),
        "settings": {**vars(args), "batch": batch, "workload": workload, "optimizer": f"AdamW lr {LR}"},
        "environment": environment(),
        "variants": res["variants"],
        "summary": summary,
        "comparisons": comparisons(res["rounds"], summary),
        "target_ratio": TARGET,
        "checks": res["checks"],
        "rounds": res["rounds"],
        "phases": res["phases"],
        "max_rss_mib_per_rank": [r["max_rss_mib"] for r in res_all],
        "memory_note": "all variants live in the same processes, so the RSS is their sum (fine for speed, not a "
        "memory measurement)",
    }


def report(doc: dict, title: str, notes: list[str], args) -> dict:
    """Print the tables, ``notes``, the phases and the RSS; write the JSON (``--out`` or the results folder)."""
    print(format_tables(title, doc["variants"], doc["summary"], doc["checks"], doc["comparisons"]))
    for line in notes:
        print(line)
    if doc["phases"]:
        print(format_phases(doc["phases"]))
    print(
        f"# max RSS per rank {max(r['end'] for r in doc['max_rss_mib_per_rank']):.0f} MiB (all variants in one process)"
    )
    name = f"{doc['benchmark']}_{doc['workload']}_gloo_w{doc['world_size']}.json"
    out = Path(args.out.format(workload=doc["workload"])) if args.out else RESULTS / name
    print(f"# wrote {atomic_write_json(out, doc)}")
    return doc
