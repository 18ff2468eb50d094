"""Memory per rank MEASURED from outside the wrappers, against the formulas, the self-reports and PyTorch's own.

    python -m benchmarks.memory [--workload mlp|gpt|gpt-deep] [--world-sizes 1,2,4,8] [--steps 3] [--batch 8]

Each variant runs in its own fresh set of Gloo processes (one per rank), so one variant's peak RSS or leftovers
never reach another's. On every rank, after a warm-up step on a tiny model (what the process sets up once, such as
torch._dynamo's import on the first optimizer, is not the model's memory) and a baseline, it records at each phase
(after wrapping, then after backward, ``opt.step()`` and ``opt.zero_grad()`` of every step):

- ``census``: bytes of live tensor storages, each once (:func:`gpudist.memory.storage_census`), minus the baseline;
- ``allocated``: glibc's count of live ``malloc`` bytes (:func:`gpudist.memory.allocated_bytes`), minus the baseline:
  it also sees buffers only C++ holds, and non-tensor memory (Python objects, the c10d flight recorder's entries);
- the self-reports, for gpudist: ``sum(model.memory_per_rank().values())`` and ``opt.state_bytes()``;
- the formula (fp32, AdamW: K = 2; P = parameter bytes): DDP P + P + 2P; ZeRO-1 P + P + 2P/N; ZeRO-2 P + P/N + 2P/N;
  ZeRO-3/FSDP P/N + P/N (from backward to ``zero_grad``) + 2P/N. Optimizer state exists from construction for
  gpudist's ZeRO optimizers, from the first step for torch's optimizers (gpudist DDP steps a torch AdamW).

The census sees only storages some Python object reaches: torch DDP's gradient buckets exist from construction but
only in C++ until the first backward makes ``param.grad`` views of them, so torch DDP's census reads 0.5x at ``wrap``
while its allocator column shows the missing P. Before each census, two ``torch.distributed`` barriers give Gloo's
worker threads the moment they take to let go of a finished op (tests/test_memory.py explains).

And the peak RSS (``VmHWM``) from just before the model is built (reset there with ``/proc/self/clear_refs``) to the
end of the last step, and the absolute peak. Variants (AdamW(fused=True) wherever torch steps):

- ``gpudist_ddp``, ``gpudist_zero1``, ``gpudist_zero2``, ``gpudist_zero3`` (a unit per module with parameters),
  ``gpudist_fsdp`` (a unit per Linear on ``mlp``, per block on ``gpt``), with their gpudist optimizers;
- ``torch_ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)``; ``torch_zero1``: the same DDP with
  ``ZeroRedundancyOptimizer(optimizer_class=AdamW, fused=True)``; ``torch_fsdp2``: ``fully_shard`` per Linear
  (``mlp``) or block (``gpt``), then the root.

Writes ``benchmarks/results/memory_<workload>_gloo.json`` (with ``gpudist.bench.environment()``).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
from torch import nn

import gpudist
from gpudist.bench import environment
from gpudist.fileio import atomic_write_json
from gpudist.launch import spawn
from gpudist.memory import allocated_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes, storage_census

from . import workloads as W

RESULTS = Path(__file__).resolve().parent / "results"
LR = 1e-4
GPUDIST = ("gpudist_ddp", "gpudist_zero1", "gpudist_zero2", "gpudist_zero3", "gpudist_fsdp")
TORCH = ("torch_ddp", "torch_zero1", "torch_fsdp2")
STRATEGY = {
    "gpudist_ddp": "ddp",
    "gpudist_zero1": "zero1",
    "gpudist_zero2": "zero2",
    "gpudist_zero3": "zero3",
    "gpudist_fsdp": "fsdp",
    "torch_ddp": "ddp",
    "torch_zero1": "zero1",
    "torch_fsdp2": "fsdp",
}
"""The formula each variant is held to."""
PEERS = {
    "gpudist_ddp": "torch_ddp",
    "gpudist_zero1": "torch_zero1",
    "gpudist_fsdp": "torch_fsdp2",
    "gpudist_zero3": "torch_fsdp2",
}


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, fused=True)


def units(workload: str, model: nn.Module) -> list[nn.Module]:
    """The modules FSDP-style variants gather as one unit: each Linear of the MLP, each block of the GPT."""
    if workload == "mlp":
        return [m for m in model.modules() if isinstance(m, nn.Linear)]
    return list(model.blocks)


def build(comm, workload: str, variant: str, model: nn.Module):
    """(model, optimizer) of ``variant`` around ``model``; collective."""
    if variant.startswith("gpudist_"):
        config = gpudist.ShardingConfiguration(comm)
        strategy = STRATEGY[variant]
        if strategy == "fsdp":
            wrapped = gpudist.FSDPModel(model, config, auto_wrap_policy=units(workload, model))
        else:
            cls = {
                "ddp": gpudist.DDPModel,
                "zero1": gpudist.ZeRO1Model,
                "zero2": gpudist.ZeRO2Model,
                "zero3": gpudist.ZeRO3Model,
            }[strategy]
            wrapped = cls(model, config)
        opt_cls = {
            "ddp": gpudist.DDPOptimizer,
            "zero1": gpudist.ZeRO1Optimizer,
            "zero2": gpudist.ZeRO2Optimizer,
            "zero3": gpudist.ZeRO3Optimizer,
            "fsdp": gpudist.ZeRO3Optimizer,
        }[strategy]
        return wrapped, opt_cls(adamw(wrapped.parameters()), config)
    if variant == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in units(workload, model):
            fully_shard(unit)
        fully_shard(model)
        return model, adamw(model.parameters())
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if variant == "torch_ddp":
        return ddp, adamw(ddp.parameters())
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True)


def formula(variant: str, phase: str, p_bytes: float, n: int) -> dict[str, float]:
    """Bytes a rank should hold at ``phase`` (see the module docstring)."""
    strategy = STRATEGY[variant]
    lazy_state = variant.startswith("torch_") or variant == "gpudist_ddp"  # torch's optimizers: state at step 1
    state_div = 1 if strategy == "ddp" else n
    state = 0.0 if lazy_state and phase in ("wrap", "backward 1") else 2 * p_bytes / state_div
    if strategy in ("ddp", "zero1"):
        return {"parameters": p_bytes, "gradients": p_bytes, "optimizer_state": state}
    if strategy == "zero2":
        return {"parameters": p_bytes, "gradients": p_bytes / n, "optimizer_state": state}
    grads = p_bytes / n if phase.startswith(("backward", "step")) else 0.0
    return {"parameters": p_bytes / n, "gradients": grads, "optimizer_state": state}


def warm_up(comm, workload: str, variant: str) -> None:
    """One step of ``variant`` on a tiny model of the same kind: imports and one-time setup happen here, before the
    baseline. (Not the full-size model: its freed memory would stay in malloc's heap and hide part of the peak.)"""
    tiny = (
        W.make("mlp", width=16, depth=1)
        if workload == "mlp"
        else W.make(workload, layers=1, width=24, heads=2, vocab=64, positions=16)
    )
    x, y = (
        W.batch("mlp", 2, width=16)
        if workload == "mlp"
        else W.batch(workload, 2, layers=1, width=24, heads=2, vocab=64, positions=16, seq=8)
    )
    model, opt = build(comm, workload, variant, tiny)
    W.loss(workload, model, x, y).backward()
    opt.step()
    opt.zero_grad()


def retire_in_flight(comm) -> None:
    """Gloo's backend keeps its last 8 work objects (and their tensors); tiny collectives push the warm-up's out."""
    one = torch.zeros(1)
    for _ in range(16):
        comm.all_reduce(one)


def rank_main(comm, workload: str, variant: str, steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    x, y = W.batch(workload, batch, torch.Generator().manual_seed(1000 + comm.rank))
    warm_up(comm, workload, variant)
    retire_in_flight(comm)
    gc.collect()
    gc.freeze()  # the baseline: each census then walks only objects made since (milliseconds, not a second)
    try:
        return _phases(comm, workload, variant, steps, x, y)
    finally:
        gc.unfreeze()


def _phases(comm, workload: str, variant: str, steps: int, x, y) -> dict:
    reset = reset_peak_rss()
    rss0 = rss_bytes()
    base, base_alloc = storage_census(), allocated_bytes()
    model = W.make(workload)
    p_bytes = W.describe(model)["parameters"] * 4
    model, opt = build(comm, workload, variant, model)
    phases: dict[str, dict] = {}

    def record(phase: str) -> None:
        for _ in range(2):  # Gloo's worker threads drop a finished op a moment after wait(): measure what is held
            torch.distributed.barrier()  # torch's own: it cannot push anything out of what gpudist's backend keeps
        census, alloc = storage_census(), allocated_bytes()
        row = {
            "census": census.total - base.total,
            "allocated": None if alloc is None else alloc - base_alloc,
            "formula": sum(formula(variant, phase, p_bytes, comm.world_size).values()),
        }
        if variant.startswith("gpudist_"):
            row["reported"] = sum(model.memory_per_rank().values())
            row["state_bytes"] = opt.state_bytes()
        phases[phase] = row

    record("wrap")
    start = time.perf_counter()
    for step in range(1, steps + 1):
        W.loss(workload, model, x, y).backward()
        record(f"backward {step}")
        opt.step()
        record(f"step {step}")
        opt.zero_grad()
        record(f"zero_grad {step}")
    return {
        "phases": phases,
        "parameter_bytes": p_bytes,
        "peak_rss": peak_rss_bytes(),
        "rss_at_reset": rss0,
        "peak_reset": reset,
        "seconds": time.perf_counter() - start,
    }


def run_variant(workload: str, variant: str, n: int, steps: int, batch: int) -> dict:
    """One variant on ``n`` fresh Gloo processes; per-rank results folded into the worst rank per phase."""
    ranks = spawn(rank_main, n, workload=workload, variant=variant, steps=steps, batch=batch, timeout=600.0)
    phases = {}
    for phase in ranks[0]["phases"]:
        rows = [r["phases"][phase] for r in ranks]
        worst = max(rows, key=lambda row: row["census"] / row["formula"])
        out = {
            "formula": worst["formula"],
            "census": worst["census"],
            "census_ratio": worst["census"] / worst["formula"],
            "allocated": worst["allocated"],
            "allocated_minus_census_max": max(
                (row["allocated"] - row["census"] for row in rows if row["allocated"] is not None), default=None
            ),
        }
        if "reported" in worst:
            out["reported"] = worst["reported"]
            out["reported_minus_census_max"] = max(abs(row["reported"] - row["census"]) for row in rows)
            out["state_bytes"] = worst["state_bytes"]
        phases[phase] = out
    return {
        "variant": variant,
        "world_size": n,
        "parameter_bytes": ranks[0]["parameter_bytes"],
        "phases": phases,
        "peak_rss_max": max(r["peak_rss"] for r in ranks),
        "peak_rss_growth_max": max(r["peak_rss"] - r["rss_at_reset"] for r in ranks),
        "peak_reset_worked": all(r["peak_reset"] for r in ranks),
        "seconds_max": max(r["seconds"] for r in ranks),
    }


def format_rows(rows: list[dict], steps: int) -> list[str]:
    last = [f"backward {steps}", f"step {steps}", f"zero_grad {steps}"]
    head = (
        f"{'variant':>14} {'N':>2} {'wrap':>6} {'bwd':>6} {'step':>6} {'zero':>6} {'max':>6} {'alloc-cen':>9} "
        f"{'rep-cen':>8} {'peak RSS':>9} {'growth':>8} {'vs peer':>7}"
    )
    lines = [
        "# live storages / formula (worst rank; wrap, and the last step's phases), allocator minus census and "
        "self-report minus census (MiB, worst rank), peak RSS and its growth from just before the model "
        "was built (MiB, worst rank); vs peer: growth / the torch peer's growth",
        head,
    ]
    growth = {(r["variant"], r["world_size"]): r["peak_rss_growth_max"] for r in rows}
    mib = 1 << 20
    for r in rows:
        ph = r["phases"]
        cells = [
            ph["wrap"]["census_ratio"],
            *(ph[p]["census_ratio"] for p in last),
            max(v["census_ratio"] for v in ph.values()),
        ]
        gap = max((v["allocated_minus_census_max"] or 0) for v in ph.values()) / mib
        rep = max(v.get("reported_minus_census_max", 0) for v in ph.values()) / mib
        peer = PEERS.get(r["variant"])
        vs = growth.get((peer, r["world_size"])) if peer else None
        ratio = f"{r['peak_rss_growth_max'] / vs:7.2f}" if vs else f"{'':>7}"
        rep_cell = f"{rep:8.1f}" if r["variant"].startswith("gpudist_") else f"{'-':>8}"
        lines.append(
            f"{r['variant']:>14} {r['world_size']:>2} "
            + " ".join(f"{c:6.3f}" for c in cells)
            + f" {gap:9.1f} {rep_cell} {r['peak_rss_max'] / mib:9.0f} {r['peak_rss_growth_max'] / mib:8.0f} "
            + ratio
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp", choices=list(W.WORKLOADS))
    parser.add_argument("--world-sizes", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step (GPT: sequences)")
    parser.add_argument("--variants", default=",".join(GPUDIST + TORCH))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    worlds = [int(w) for w in args.world_sizes.split(",")]
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(GPUDIST + TORCH))
    if unknown:
        parser.error(f"unknown variants {unknown}; use some of {', '.join(GPUDIST + TORCH)}")
    info = W.describe(W.make(args.workload))
    print(
        f"# memory per rank, {args.workload} ({info['parameters'] / 1e6:.1f}M parameters, {info['tensors']} "
        f"tensors), gloo, AdamW, {args.steps} steps of batch {args.batch} per rank; each variant in fresh "
        "processes"
    )
    rows = []
    started = time.perf_counter()
    for n in worlds:
        for variant in variants:
            t = time.perf_counter()
            rows.append(run_variant(args.workload, variant, n, args.steps, args.batch))
            print(f"#   {variant} N={n}: {time.perf_counter() - t:.0f} s", flush=True)
    lines = format_rows(rows, args.steps)
    print("\n".join(lines))
    doc = {
        "benchmark": "memory",
        "workload": args.workload,
        "backend": "gloo",
        "settings": vars(args),
        "environment": environment(),
        "parameters": info["parameters"],
        "tensors": info["tensors"],
        "formulas": {
            "ddp": "P + P + 2P",
            "zero1": "P + P + 2P/N",
            "zero2": "P + P/N + 2P/N",
            "zero3/fsdp": "P/N + P/N (backward..step) + 2P/N",
        },
        "rows": rows,
        "table": lines,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out) if args.out else RESULTS / f"memory_{args.workload}_gloo.json"
    print(f"# wrote {atomic_write_json(out, doc)}")


if __name__ == "__main__":
    main()
