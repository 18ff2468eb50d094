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

import torch

from gpudist.launch import spawn

from . import peers

ZERO3_MIN_UNIT_NUMEL = 100_000
"""``ZeRO3Model``'s ``min_unit_numel`` in the ``gpudist_zero3_merged`` row: DeepSpeed ZeRO-3's default parameter
persistence threshold, in elements."""


def bench_rank(
    comm,
    workload: str,
    batch: int,
    steps: int,
    rounds: int,
    bucket_mb: float,
    deepspeed: bool,
    phase_steps: int = 0,
    only: list[str] | None = None,
    transport_ab: bool = False,
) -> dict:
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
        "gpudist_zero3_merged": lambda: peers.gpudist_variant(
            comm, workload, x, y, "zero3", bucket_mb, suffix="_merged", min_unit_numel=ZERO3_MIN_UNIT_NUMEL
        ),
        "fsdp2_best": lambda: peers.fsdp2_variant(workload, x, y, best=True),
        "fsdp2_default": lambda: peers.fsdp2_variant(workload, x, y, best=False),
        "deepspeed_zero2": lambda: peers.deepspeed_variant(comm, workload, x, y, 2, bucket_mb),
        "deepspeed_zero2_default": lambda: peers.deepspeed_variant(comm, workload, x, y, 2, bucket_mb, tuned=False),
        "deepspeed_zero3": lambda: peers.deepspeed_variant(comm, workload, x, y, 3, bucket_mb),
        "deepspeed_zero3_default": lambda: peers.deepspeed_variant(comm, workload, x, y, 3, bucket_mb, tuned=False),
    }
    if workload == "mlp":  # ZeRO3Model's default units (each module holding parameters) are the MLP's Linears
        del factories["gpudist_zero3"], factories["gpudist_zero3_merged"]
    if not deepspeed:
        factories = {k: v for k, v in factories.items() if not k.startswith("deepspeed")}
    other = peers.other_transport(comm) if transport_ab else None
    if other is not None:  # the ZeRO-1/2 twins on the other Gloo transport
        suffix = "_" + peers.transport(other)
        for strategy in ("zero1", "zero2"):
            factories[f"gpudist_{strategy}{suffix}"] = lambda s=strategy: peers.gpudist_variant(
                other, workload, x, y, s, bucket_mb, suffix=suffix
            )
    variants = [make() for name, make in factories.items() if only is None or name in only]
    return peers.measure(comm, workload, batches, variants, steps, rounds, phase_steps)


def comparisons_for(rounds: dict, summary: dict) -> list[dict]:
    """Targets: ZeRO-1 and ZeRO-2 against the ZeRO-1 peer (torch has no ZeRO-2) and DeepSpeed ZeRO-2; gpudist's FSDP
    (its ZeRO-3 at the recommended units) against FSDP2 and DeepSpeed ZeRO-3. Beside: ``ZeRO3Model``'s per-module
    units (DeepSpeed's granularity), the same with units under 100K elements merged, and the peers at their
    defaults."""
    pairs = [
        ("gpudist_zero1", "torch_zero_best", True),
        ("gpudist_zero2", "torch_zero_best", True),
        ("gpudist_zero2", "deepspeed_zero2", True),
        ("gpudist_fsdp", "fsdp2_best", True),
        ("gpudist_fsdp", "deepspeed_zero3", True),
        ("gpudist_zero3", "fsdp2_best", False),
        ("gpudist_zero3_merged", "fsdp2_best", False),
        ("gpudist_zero3_merged", "gpudist_zero3", False),
        ("gpudist_zero3", "deepspeed_zero3", False),
        ("gpudist_zero1", "torch_zero_default", False),
        ("gpudist_zero2", "deepspeed_zero2_default", False),
        ("gpudist_fsdp", "fsdp2_default", False),
        ("gpudist_fsdp", "deepspeed_zero3_default", False),
    ]
    pairs += [
        (f"gpudist_{s}_{t}", peer, False)
        for s in ("zero1", "zero2")
        for t in ("shm", "tcp")
        for peer in ("torch_zero_best", f"gpudist_{s}")
    ]
    return [
        peers.compare(rounds, summary, ours, peer, target)
        for ours, peer, target in pairs
        if ours in summary and peer in summary
    ]


def run(workload: str, args) -> dict:
    n = args.world_size
    batch = args.batch or peers.BATCH[workload]
    skipped = "skipped: --no-deepspeed" if args.no_deepspeed else peers.deepspeed_status()
    res_all = spawn(
        bench_rank,
        n,
        workload=workload,
        batch=batch,
        steps=args.steps,
        rounds=args.rounds,
        bucket_mb=args.bucket_mb,
        deepspeed=skipped is None,
        phase_steps=args.phases,
        only=args.only,
        transport_ab=args.transport_ab,
        timeout=1800.0,
    )
    doc = peers.document("zero", workload, args, batch, res_all, comparisons_for)
    doc["best_peers"] = {
        "zero1": "torch_zero_best",
        "zero2": ["torch_zero_best", "deepspeed_zero2"],
        "fsdp": ["fsdp2_best", "deepspeed_zero3"],
    }
    doc["deepspeed"] = skipped or "ran"
    info = doc["model"]
    title = (
        f"# ZeRO and FSDP, workload {workload} ({info['parameters'] / 1e6:.1f}M parameters in {info['tensors']} "
        f"tensors), gloo world {n}, batch {batch}/rank, AdamW; {args.rounds} rounds x {args.steps} steps, "
        f"order rotated; DeepSpeed: {skipped or 'ran'}"
    )
    return peers.report(doc, title, [], args)


def main(argv: list[str] | None = None) -> None:
    parser = peers.arguments(__doc__, "bucket size of gpudist and of the peers")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even if it is installed")
    args = parser.parse_args(argv)
    for workload in args.workload:
        run(workload, args)


if __name__ == "__main__":
    main()
