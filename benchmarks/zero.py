"""ZeRO-1/2/3 and FSDP: gpudist vs torch's and DeepSpeed's at their best settings (defaults beside), same models, data
and Gloo processes, interleaved round by round. (Memory: ``python -m benchmarks.memory``, measured from live
storages; the wrappers' own reports cannot see a leak.)

    python -m benchmarks.zero [--workload mlp|gpt|gpt-deep ...] [--world-size 2] [--rounds 20] [--steps 2]

Variants (``benchmarks/peers.py`` has the peers' exact settings; AdamW lr 1e-4 everywhere):

- ``gpudist_zero1`` (``ZeRO1Model`` + ``ZeRO1Optimizer``) and ``gpudist_zero2`` (``ZeRO2Model`` + ``ZeRO2Optimizer``),
  both against ``torch_zero_best``: ``ZeroRedundancyOptimizer(AdamW, fused=True, parameters_as_bucket_view=True)``
  over ``DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True)`` (torch has no ZeRO-2 of its own).
  ``torch_zero_default``: ``ZeroRedundancyOptimizer(AdamW)`` over ``DistributedDataParallel(model)``.
- ``gpudist_fsdp`` (``FSDPModel`` + ``ZeRO3Optimizer``; units: each Linear of the MLP, each block of the GPT) against
  ``fsdp2_best`` (``fully_shard`` on the same units and the root, ``AdamW(fused=True)``); ``fsdp2_default``: the same
  with ``AdamW()``. On the GPT also ``gpudist_zero3`` (``ZeRO3Model``: a unit per module holding parameters, as
  DeepSpeed ZeRO-3 gathers); on the MLP that is the same as ``gpudist_fsdp``.
- ``deepspeed_zero2`` / ``deepspeed_zero3`` (tuned: gpudist's bucket size, ``overlap_comm``) and their ``_default``
  twins when ``import deepspeed`` works (else recorded as skipped).

Each training variant first takes two steps from the same initial values on the same batches and is compared with a
local reference (the ``check`` columns). Results: ``benchmarks/results/zero_<workload>_gloo_w<N>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from gpudist.bench import environment
from gpudist.fileio import atomic_write_json
from gpudist.launch import spawn

from . import peers
from . import workloads as W

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = {"mlp": 32, "gpt": 2, "gpt-deep": 2}
"""Samples per rank per step (GPT: sequences of 128 tokens)."""


def bench_rank(comm, workload: str, batch: int, steps: int, rounds: int, bucket_mb: float, deepspeed: bool,
               phase_steps: int = 0, only: list[str] | None = None) -> dict:
    torch.manual_seed(0)
    batches = peers.rank_batches(workload, batch, comm.world_size)
    x, y = batches[comm.rank]
    units = peers.gpudist_units(workload)
    factories = {
        "gpudist_zero1": lambda: peers.gpudist_variant(comm, workload, x, y, "zero1", bucket_mb),
        "gpudist_zero2": lambda: peers.gpudist_variant(comm, workload, x, y, "zero2", bucket_mb),
        "torch_zero_best": lambda: peers.torch_zero_variant(workload, x, y, best=True, bucket_mb=bucket_mb),
        "torch_zero_default": lambda: peers.torch_zero_variant(workload, x, y, best=False, bucket_mb=bucket_mb),
        "gpudist_fsdp": lambda: peers.gpudist_variant(comm, workload, x, y, "fsdp", bucket_mb, units=units),
        "gpudist_zero3": lambda: peers.gpudist_variant(comm, workload, x, y, "zero3", bucket_mb),
        "fsdp2_best": lambda: peers.fsdp2_variant(workload, x, y, best=True),
        "fsdp2_default": lambda: peers.fsdp2_variant(workload, x, y, best=False),
        "deepspeed_zero2": lambda: peers.deepspeed_variant(comm, workload, x, y, 2, bucket_mb),
        "deepspeed_zero2_default": lambda: peers.deepspeed_variant(comm, workload, x, y, 2, bucket_mb, tuned=False),
        "deepspeed_zero3": lambda: peers.deepspeed_variant(comm, workload, x, y, 3, bucket_mb),
        "deepspeed_zero3_default": lambda: peers.deepspeed_variant(comm, workload, x, y, 3, bucket_mb, tuned=False),
    }
    if workload == "mlp":  # ZeRO3Model's default units (each module holding parameters) are the MLP's Linears
        del factories["gpudist_zero3"]
    if not deepspeed:
        factories = {k: v for k, v in factories.items() if not k.startswith("deepspeed")}
    variants = [make() for name, make in factories.items() if only is None or name in only]
    rss_built = peers.max_rss_mib()
    checks = peers.check_same_function(comm, workload, batches, variants)
    for v in variants:  # warm-up (every variant also took the check's steps)
        v.step()
    rounds_data = peers.interleaved_rounds(comm, {v.name: v.step for v in variants}, steps, rounds)
    phases = peers.phase_times(comm, variants, phase_steps) if phase_steps else None
    return {"rounds": rounds_data, "checks": checks, "variants": peers.describe_variants(variants),
            "phases": phases, "max_rss_mib": {"after_build": rss_built, "end": peers.max_rss_mib()}}  # fmt: skip


def comparisons_for(rounds: dict, summary: dict) -> list[dict]:
    """Targets: ZeRO-1 and ZeRO-2 against the ZeRO-1 peer (torch has no ZeRO-2) and DeepSpeed ZeRO-2; gpudist's FSDP
    (its ZeRO-3 at the recommended units) against FSDP2 and DeepSpeed ZeRO-3. Beside: ``ZeRO3Model``'s per-module
    units (DeepSpeed's granularity) and the peers at their defaults."""
    pairs = [("gpudist_zero1", "torch_zero_best", True), ("gpudist_zero2", "torch_zero_best", True),
             ("gpudist_zero2", "deepspeed_zero2", True), ("gpudist_fsdp", "fsdp2_best", True),
             ("gpudist_fsdp", "deepspeed_zero3", True), ("gpudist_zero3", "fsdp2_best", False),
             ("gpudist_zero3", "deepspeed_zero3", False), ("gpudist_zero1", "torch_zero_default", False),
             ("gpudist_zero2", "deepspeed_zero2_default", False), ("gpudist_fsdp", "fsdp2_default", False),
             ("gpudist_fsdp", "deepspeed_zero3_default", False)]  # fmt: skip
    return [peers.compare(rounds, summary, ours, peer, target) for ours, peer, target in pairs
            if ours in summary and peer in summary]  # fmt: skip


def run(workload: str, args) -> dict:
    n = args.world_size
    batch = args.batch or BATCH[workload]
    skipped = None if args.no_deepspeed else peers.deepspeed_status()
    if args.no_deepspeed:
        skipped = "skipped: --no-deepspeed"
    res_all = spawn(bench_rank, n, workload=workload, batch=batch, steps=args.steps, rounds=args.rounds,
                    bucket_mb=args.bucket_mb, deepspeed=skipped is None, phase_steps=args.phases,
                    only=args.only, timeout=1800.0)  # fmt: skip
    res = res_all[0]
    info = W.describe(W.make(workload))
    summary = peers.summarize(res["rounds"])
    comparisons = comparisons_for(res["rounds"], summary)
    doc = {"benchmark": "zero", "backend": "gloo", "world_size": n, "workload": workload, "model": info,
           "settings": {**vars(args), "batch": batch, "workload": workload, "optimizer": f"AdamW lr {peers.LR}"},
           "environment": environment(), "variants": res["variants"], "summary": summary, "comparisons": comparisons,
           "best_peers": {"zero1": "torch_zero_best", "zero2": ["torch_zero_best", "deepspeed_zero2"],
                          "fsdp": ["fsdp2_best", "deepspeed_zero3"]},
           "target_ratio": peers.TARGET, "deepspeed": skipped or "ran", "checks": res["checks"],
           "rounds": res["rounds"], "phases": res["phases"],
           "max_rss_mib_per_rank": [r["max_rss_mib"] for r in res_all],
           "memory_note": "all variants live in the same processes, so the RSS is their sum (fine for speed, not a "
                          "memory measurement)"}  # fmt: skip
    title = (f"# ZeRO and FSDP, workload {workload} ({info['parameters'] / 1e6:.1f}M parameters in {info['tensors']} "
             f"tensors), gloo world {n}, batch {batch}/rank, AdamW; {args.rounds} rounds x {args.steps} steps, "
             f"order rotated; DeepSpeed: {skipped or 'ran'}")  # fmt: skip
    print(peers.format_tables(title, res["variants"], summary, res["checks"], comparisons))
    if res["phases"]:
        print(peers.format_phases(res["phases"]))
    print(f"# max RSS per rank {max(r['end'] for r in doc['max_rss_mib_per_rank']):.0f} MiB (all variants in one "
          "process)")
    out = Path(args.out.format(workload=workload)) if args.out else RESULTS / f"zero_{workload}_gloo_w{n}.json"
    print(f"# wrote {atomic_write_json(out, doc)}")
    return doc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["mlp", "gpt"], choices=list(W.WORKLOADS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help=f"samples per rank per step (default {BATCH})")
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of gpudist and of the peers")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even if it is installed")
    parser.add_argument("--only", type=lambda t: t.split(","), default=None,
                        help="comma-separated variant names to run (development and profiling)")
    parser.add_argument("--phases", type=int, default=0, metavar="STEPS",
                        help="also time forward, backward, step and zero_grad of each variant over STEPS steps")
    parser.add_argument("--out", default=None, help="JSON path; {workload} is replaced by the workload's name")
    args = parser.parse_args(argv)
    for workload in args.workload:
        run(workload, args)


if __name__ == "__main__":
    main()
