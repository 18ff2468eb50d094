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

import torch

from gpudist.launch import spawn

from . import peers
from . import workloads as W


def bench_rank(
    comm,
    workload: str,
    batch: int,
    steps: int,
    rounds: int,
    bucket_mb: float,
    analysis: bool,
    phase_steps: int = 0,
    only: list[str] | None = None,
    transport_ab: bool = False,
) -> dict:
    torch.manual_seed(0)
    batches = peers.rank_batches(workload, batch, comm.world_size)
    x, y = batches[comm.rank]
    variants = [
        peers.gpudist_variant(comm, workload, x, y, "ddp", bucket_mb),
        peers.torch_ddp_variant(workload, x, y, best=True, bucket_mb=bucket_mb),
        peers.torch_ddp_variant(workload, x, y, best=False, bucket_mb=bucket_mb),
    ]
    other = peers.other_transport(comm) if transport_ab else None
    if other is not None:
        suffix = "_" + peers.transport(other)
        variants.insert(1, peers.gpudist_variant(other, workload, x, y, "ddp", bucket_mb, suffix=suffix))
    if analysis:
        local = W.make(workload)
        local_opt = peers.adamw(local.parameters(), fused=True)
        params = sum(p.numel() for p in local.parameters())
        flat = torch.zeros(params)

        def allreduce_alone() -> None:  # the same bytes in buckets of the same size, no compute to hide behind
            with comm.unchecked():
                for chunk in flat.split(int(bucket_mb * (1 << 20)) // 4):
                    comm.all_reduce(chunk, "average")

        variants += [
            peers.Variant(
                "local_step",
                "analysis",
                "the same step, no communication",
                peers.train_step(workload, local, local_opt, x, y),
                phases=peers.phased_step(workload, local, local_opt, x, y),
            ),
            peers.Variant(
                "allreduce_alone", "analysis", "P bytes all-reduced in the same buckets, alone", allreduce_alone
            ),
        ]
    variants = [v for v in variants if only is None or v.name in only]
    res = peers.measure(comm, workload, batches, variants, steps, rounds, phase_steps)
    res["step_bytes"] = None
    if variants[0].name == "gpudist":
        before = comm.stats.total_bytes
        variants[0].step()
        res["step_bytes"] = comm.stats.total_bytes - before
    return res


def comparisons(rounds: dict, summary: dict) -> list[dict]:
    """gpudist (the default transport) against the peers; with ``--transport-ab`` its twin on the other transport
    against torch_best and against it."""
    pairs = [("gpudist", "torch_best", True), ("gpudist", "torch_default", False)]
    pairs += [(twin, peer, False) for twin in ("gpudist_shm", "gpudist_tcp") for peer in ("torch_best", "gpudist")]
    return [
        peers.compare(rounds, summary, ours, peer, target)
        for ours, peer, target in pairs
        if ours in summary and peer in summary
    ]


def run(workload: str, args) -> dict:
    n = args.world_size
    batch = args.batch or peers.BATCH[workload]
    res_all = spawn(
        bench_rank,
        n,
        workload=workload,
        batch=batch,
        steps=args.steps,
        rounds=args.rounds,
        bucket_mb=args.bucket_mb,
        analysis=not args.no_analysis,
        phase_steps=args.phases,
        only=args.only,
        transport_ab=args.transport_ab,
        timeout=1800.0,
    )
    doc = peers.document("ddp", workload, args, batch, res_all, comparisons)
    doc["best_peer"] = "torch_best"
    info, step_bytes, notes = doc["model"], res_all[0]["step_bytes"], []
    s = {k: v["median_s"] for k, v in doc["summary"].items()}
    if {"gpudist", "local_step", "allreduce_alone"} <= set(s):
        overlap = (s["local_step"] + s["allreduce_alone"] - s["gpudist"]) / s["allreduce_alone"]
        doc["overlap_fraction"] = max(0.0, min(1.0, overlap))
        doc["overlap_raw"] = overlap
        notes.append(f"# overlap of communication with backward: {doc['overlap_fraction']:.0%} (raw {overlap:.2f})")
    doc["bytes_per_step_payload"] = step_bytes
    doc["bytes_per_step_ring_estimate"] = step_bytes * 2 * (n - 1) / n if step_bytes else None
    doc["bytes_per_step_formula"] = 2 * (n - 1) / n * info["parameters"] * 4
    if step_bytes:
        notes.append(
            f"# bytes per step per rank (ring): {doc['bytes_per_step_ring_estimate'] / 2**20:.2f} MiB; "
            f"formula 2(N-1)/N x P = {doc['bytes_per_step_formula'] / 2**20:.2f} MiB"
        )
    title = (
        f"# DDP, workload {workload} ({info['parameters'] / 1e6:.1f}M parameters in {info['tensors']} tensors), "
        f"gloo world {n}, batch {batch}/rank, AdamW; {args.rounds} rounds x {args.steps} steps, order rotated"
    )
    return peers.report(doc, title, notes, args)


def main(argv: list[str] | None = None) -> None:
    parser = peers.arguments(__doc__, "gpudist's and torch_best's bucket size")
    parser.add_argument("--no-analysis", action="store_true", help="skip local_step and allreduce_alone")
    args = parser.parse_args(argv)
    for workload in args.workload:
        run(workload, args)


if __name__ == "__main__":
    main()
