"""gpudist DDP vs torch DDP at its best settings (and at its defaults, beside): same models, data and Gloo processes.

    python -m benchmarks.ddp [--workload mlp|gpt|gpt-deep ...] [--world-size 2] [--rounds 20] [--steps 2]

Variants, all interleaved round by round in the same processes (``benchmarks/peers.py`` has the peers' settings):

- ``gpudist``: ``DDPModel`` + ``DDPOptimizer(AdamW(fused=True))``, default ``ShardingConfiguration`` (25 MiB buckets).
- ``torch_best``: ``DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=25)`` +
  ``AdamW(fused=True)``: the peer the target (gpudist >= 1.05x) is measured against.
- ``torch_default``: ``DistributedDataParallel(model)`` + ``AdamW()``, reported beside (no claim rests on it).
- ``local_step`` (the same step with no communication) and ``allreduce_alone`` (the gradients' bytes all-reduced in
  buckets of the same size with nothing to hide behind) give the overlap of communication with backward:
  (local step + all-reduce alone - gpudist step) / all-reduce alone.

Every training variant first takes two steps from the same initial values on the same batches, and its parameters
are compared with a local reference that trains on all ranks' batches at once (the ``check`` columns). Reported per
variant: median step time over the rounds (each round at its slowest rank), min, max and IQR over the rounds, and the
CPU time per step (all threads of the process, averaged over ranks), its system part and the minor page faults;
``--phases N`` adds forward/backward/step/zero_grad times. Results go to
``benchmarks/results/ddp_<workload>_gloo_w<N>.json``.
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


def bench_rank(comm, workload: str, batch: int, steps: int, rounds: int, bucket_mb: float, analysis: bool,
               phase_steps: int = 0, only: list[str] | None = None) -> dict:
    torch.manual_seed(0)
    batches = peers.rank_batches(workload, batch, comm.world_size)
    x, y = batches[comm.rank]
    variants = [peers.gpudist_variant(comm, workload, x, y, "ddp", bucket_mb),
                peers.torch_ddp_variant(workload, x, y, best=True, bucket_mb=bucket_mb),
                peers.torch_ddp_variant(workload, x, y, best=False, bucket_mb=bucket_mb)]  # fmt: skip
    if analysis:
        local = W.make(workload)
        local_opt = peers.adamw(local.parameters(), fused=True)
        params = sum(p.numel() for p in local.parameters())
        flat = torch.zeros(params)

        def allreduce_alone() -> None:  # the same bytes in buckets of the same size, no compute to hide behind
            with comm.unchecked():
                for chunk in flat.split(int(bucket_mb * (1 << 20)) // 4):
                    comm.all_reduce(chunk, "average")

        variants += [peers.Variant("local_step", "analysis", "the same step, no communication",
                                   peers.train_step(workload, local, local_opt, x, y),
                                   phases=peers.phased_step(workload, local, local_opt, x, y)),
                     peers.Variant("allreduce_alone", "analysis", "P bytes all-reduced in the same buckets, alone",
                                   allreduce_alone)]  # fmt: skip
    variants = [v for v in variants if only is None or v.name in only]
    rss_built = peers.max_rss_mib()
    checks = peers.check_same_function(comm, workload, batches, variants)
    for v in variants:  # warm-up (the training variants also took the check's steps)
        v.step()
    rounds_data = peers.interleaved_rounds(comm, {v.name: v.step for v in variants}, steps, rounds)
    phases = peers.phase_times(comm, variants, phase_steps) if phase_steps else None
    step_bytes = None
    if variants[0].name == "gpudist":
        before = comm.stats.total_bytes
        variants[0].step()
        step_bytes = comm.stats.total_bytes - before
    return {"rounds": rounds_data, "checks": checks, "variants": peers.describe_variants(variants), "phases": phases,
            "step_bytes": step_bytes, "max_rss_mib": {"after_build": rss_built, "end": peers.max_rss_mib()}}


def run(workload: str, args) -> dict:
    n = args.world_size
    batch = args.batch or BATCH[workload]
    res_all = spawn(bench_rank, n, workload=workload, batch=batch, steps=args.steps, rounds=args.rounds,
                    bucket_mb=args.bucket_mb, analysis=not args.no_analysis, phase_steps=args.phases, only=args.only,
                    timeout=1800.0)  # fmt: skip
    res = res_all[0]
    info = W.describe(W.make(workload))
    summary = peers.summarize(res["rounds"])
    comparisons = [peers.compare(res["rounds"], summary, "gpudist", peer, target)
                   for peer, target in (("torch_best", True), ("torch_default", False))
                   if "gpudist" in summary and peer in summary]  # fmt: skip
    doc = {"benchmark": "ddp", "backend": "gloo", "world_size": n, "workload": workload, "model": info,
           "settings": {**vars(args), "batch": batch, "workload": workload, "optimizer": f"AdamW lr {peers.LR}"},
           "environment": environment(), "variants": res["variants"], "summary": summary, "comparisons": comparisons,
           "best_peer": "torch_best", "target_ratio": peers.TARGET, "checks": res["checks"], "rounds": res["rounds"],
           "max_rss_mib_per_rank": [r["max_rss_mib"] for r in res_all],
           "memory_note": "all variants live in the same processes, so the RSS is their sum (fine for speed, not a "
                          "memory measurement)"}  # fmt: skip
    s = {k: v["median_s"] for k, v in summary.items()}
    if {"gpudist", "local_step", "allreduce_alone"} <= set(s):
        overlap = (s["local_step"] + s["allreduce_alone"] - s["gpudist"]) / s["allreduce_alone"]
        doc["overlap_fraction"] = max(0.0, min(1.0, overlap))
        doc["overlap_raw"] = overlap
    doc["phases"] = res["phases"]
    doc["bytes_per_step_payload"] = res["step_bytes"]
    doc["bytes_per_step_ring_estimate"] = res["step_bytes"] * 2 * (n - 1) / n if res["step_bytes"] else None
    doc["bytes_per_step_formula"] = 2 * (n - 1) / n * info["parameters"] * 4
    title = (f"# DDP, workload {workload} ({info['parameters'] / 1e6:.1f}M parameters in {info['tensors']} tensors), "
             f"gloo world {n}, batch {batch}/rank, AdamW; {args.rounds} rounds x {args.steps} steps, order rotated")
    print(peers.format_tables(title, res["variants"], summary, res["checks"], comparisons))
    if "overlap_raw" in doc:
        print(f"# overlap of communication with backward: {doc['overlap_fraction']:.0%} (raw {doc['overlap_raw']:.2f})")
    if res["phases"]:
        print(peers.format_phases(res["phases"]))
    if res["step_bytes"]:
        print(f"# bytes per step per rank (ring): {doc['bytes_per_step_ring_estimate'] / 2**20:.2f} MiB; "
              f"formula 2(N-1)/N x P = {doc['bytes_per_step_formula'] / 2**20:.2f} MiB")  # fmt: skip
    print(f"# max RSS per rank {max(r['end'] for r in doc['max_rss_mib_per_rank']):.0f} MiB (all variants in one "
          "process)")
    out = Path(args.out.format(workload=workload)) if args.out else RESULTS / f"ddp_{workload}_gloo_w{n}.json"
    print(f"# wrote {atomic_write_json(out, doc)}")
    return doc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", default=["mlp", "gpt"], choices=list(W.WORKLOADS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help=f"samples per rank per step (default {BATCH})")
    parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="gpudist's and torch_best's bucket size")
    parser.add_argument("--no-analysis", action="store_true", help="skip local_step and allreduce_alone")
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
