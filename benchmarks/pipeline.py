"""Pipeline parallelism: gpudist's schedules vs torch.distributed.pipelining's (1F1B: Schedule1F1B, interleaved 1F1B:
ScheduleInterleaved1F1B, ZB-H1: ScheduleInterleavedZeroBubble with one stage per rank, ZB-V: ScheduleZBVZeroBubble,
DualPipe-V: ScheduleDualPipeV), and the bubble vs theory.

    python -m benchmarks.pipeline [--micro-batches 4,8] [--steps 3] [--rounds 5] [--width 1024] [--depth 8]
                                  [--batch 128] [--bubble-stages 2,4] [--bubble-micro 1,2,4,8] [--t-forward-ms 10]
                                  [--virtual-stages 2]

Two measurements, one JSON (``benchmarks/results/pipeline.json``):

1. Throughput on 2 stages (world 2, Gloo, spawned processes on 127.0.0.1, one intra-op thread each since the two
   ranks share the cores). The model is ``make_model`` (``benchmarks.workloads.mlp`` from seed 0: an MLP of
   ``--depth`` Linear+ReLU pairs and a 10-class head, as an ``nn.Sequential``) cut after ``depth/2`` hidden layers:
   gpudist gets ``balance=[k, n-k]`` and torch a ``PipelineStage`` on the same half, from the same initial weights.
   Same batch, micro-batch count, loss (cross-entropy, mean over the micro-batch, gradients averaged over micro-
   batches on both sides) and optimizer (SGD); one iteration = forward + backward + ``step()`` + ``zero_grad()``. The
   variants take turns round by round on the same processes (``gpudist.bench.interleaved_times``), each round at the
   slowest rank's pace; times are the median round. Ratio = torch step / gpudist step in the same round, median over
   rounds (> 1: gpudist faster; target >= 1.0); pairing within a round keeps other processes' load on this shared
   machine out of it, and the min-max over rounds shows what is left. Sanity check: both pipelines and a single-
   process reference on the full batch give the same loss on the first two steps (the second checks the gradients and
   the optimizer step too). Interleaved (``--virtual-stages`` v chunks per rank, default 2): the same model cut
   into 2v chunks of equal hidden layers (the head on the last), rank r holding chunks r, r + 2, ...: gpudist
   ``schedule="interleaved"`` with ``balance`` the chunk sizes, torch ``ScheduleInterleaved1F1B`` over v
   ``PipelineStage``s per rank on the same chunks; its ratio is torch interleaved / gpudist interleaved. The V
   schedules (``zbv``, ``dualpipev``): 4 chunks, rank r holding chunks r and 3 - r (the loss on rank 0), the same
   chunks for torch's; ZB-H1 the 1F1B split. DualPipe-V runs for m >= 4 only (both sides need m >= 2p).
2. Bubble: blocks whose forward sleeps ``t_f`` and backward ``2 t_f`` (on a 2x4 tensor with one trainable scalar)
   make every stage's compute take a known time that runs in parallel whatever the core count, so ``p`` ranks on
   2 cores measure the schedule, not CPU contention. One block per stage, ranks as threads of this process
   (in-memory backend; ``--bubble-backend gloo`` uses processes), both gpudist schedules, ``p`` stages x ``m``
   micro-batches. Measured bubble = 1 - mean over stages of ``last_schedule["busy_s"]`` / the step's span
   (``max`` over stages of ``last_schedule["step_s"]``: stage 0 starts first and runs the last backward, while
   the last stage's clock stops ``(p - 1) t_b`` early), against theory (p - 1)/(m + p - 1). Also reported: the
   bubble from wall time, 1 - m (t_f + t_b) / ``train_step`` wall time (which adds the optimizer step, and
   counts sleep overshoot and Python overhead as bubble), and the activations each stage held at once
   (``max_in_flight``; 1F1B <= p - s, GPipe = m). Interleaved: ``p v`` blocks sleeping ``t_f / v`` (the same
   compute per stage, in v chunks), for ``m`` a multiple of ``p``; theory (p - 1)/(v m + p - 1); its
   ``max_in_flight`` counts chunk activations (bound ``2 (p - s - 1) + (v - 1) p + 1``, at most ``v m``). A block's
   backward sleeps ``t_f`` on the input's path and ``t_f`` on the weight's, so the zero-bubble schedules' split
   backwards take ``t_f`` each pass (F = B = W); their theory is the schedule replay at those costs
   (``schedule_bubble``: (p - 1)/(3 m + p - 1) for ZB-H1 with m >= p, (p - 1)/(6 m + p - 1) for the V with
   m >= 2p - 1) and their bound the activations the order keeps alive from F to W.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from gpudist import PipelineParallelModel
from gpudist.bench import environment, interleaved_times
from gpudist.fileio import atomic_write_json
from gpudist.launch import spawn
from gpudist.strategies.pipeline import schedule_bubble, stage_schedule
from gpudist.strategies.pipeline.schedule import activations_alive, placement
from gpudist.testing import run_ranks

from . import workloads

RESULTS = Path(__file__).resolve().parent / "results"
NEW_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")
TARGET_RATIO = 1.0
"""torch Schedule1F1B step / gpudist 1F1B step that gpudist must reach."""


# ---------------------------------------------------------------------------------------------------------------------
# 1. Throughput against torch.distributed.pipelining on Gloo


def make_model(width: int, depth: int) -> torch.nn.Module:
    """The same MLP in every process (seed 0): ``depth`` Linear+ReLU pairs of ``width``, then a 10-way head."""
    torch.manual_seed(0)
    return workloads.mlp(width, depth)


def batch_of(width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)


def reference_losses(width: int, depth: int, batch: int, lr: float, steps: int = 2) -> list[float]:
    """Single-process SGD on the full batch: the losses both pipelines must reproduce."""
    model = make_model(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = batch_of(width, batch)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def chunk_counts(depth: int, chunks: int) -> list[int]:
    """Modules per chunk of ``make_model``: equal numbers of (Linear, ReLU) pairs, the head with the last."""
    pairs = [depth // chunks + (1 if c < depth % chunks else 0) for c in range(chunks)]
    return [2 * n for n in pairs[:-1]] + [2 * pairs[-1] + 1]


TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",  # with one stage per rank: ZB-H1
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""The torch.distributed.pipelining schedule each gpudist schedule is measured against."""
V_SHAPED = ("zbv", "dualpipev")


def rank_chunks(schedule: str, rank: int, chunks: int) -> list[int]:
    """Virtual stages rank ``rank`` of 2 holds: round-robin, or down and back up a V."""
    return [rank, chunks - 1 - rank] if schedule in V_SHAPED else list(range(rank, chunks, 2))


def throughput_rank(
    comm,
    width: int,
    depth: int,
    batch: int,
    micro_batches: list[int],
    steps: int,
    rounds: int,
    lr: float,
    virtual_stages: int,
) -> dict:
    from torch.distributed import pipelining

    x, y = batch_of(width, batch)
    full = make_model(width, depth)
    cut = depth  # modules before the cut: depth/2 (Linear, ReLU) pairs; the rest and the head on stage 1
    stage = comm.rank
    variants, losses = {}, {}
    # 1f1b, zero_bubble: 2 stages; interleaved: 2v chunks, rank r holding chunks r, r + 2, ...; the V: 4 chunks,
    # rank r holding r and 3 - r
    setups = {
        "1f1b": [cut, len(full) - cut],
        "interleaved": chunk_counts(depth, 2 * virtual_stages),
        "zero_bubble": [cut, len(full) - cut],
        "zbv": chunk_counts(depth, 4),
        "dualpipev": chunk_counts(depth, 4),
    }
    for m in micro_batches:
        for schedule, counts in setups.items():
            if schedule == "dualpipev" and m < 4:
                continue  # both need m >= the 4 virtual stages
            ours = PipelineParallelModel(
                copy.deepcopy(full),
                gpudist.ShardingConfiguration(comm),
                micro_batches=m,
                schedule=schedule,
                balance=counts,
                virtual_stages=virtual_stages if schedule == "interleaved" else None,
            )
            ours_opt = torch.optim.SGD(ours.parameters(), lr=lr)
            starts, copied = [sum(counts[:c]) for c in range(len(counts))], copy.deepcopy(full)
            held = rank_chunks(schedule, stage, len(counts))
            chunks = [copied[starts[u] : starts[u] + counts[u]] for u in held]
            stages = [
                pipelining.PipelineStage(chunk, u, len(counts), torch.device("cpu"))
                for u, chunk in zip(held, chunks, strict=True)
            ]
            torch_class = getattr(pipelining, TORCH_SCHEDULES[schedule])
            theirs = torch_class(stages[0] if schedule == "1f1b" else stages, m, loss_fn=F.cross_entropy)
            theirs_opt = torch.optim.SGD([p for chunk in chunks for p in chunk.parameters()], lr=lr)
            first, last = 0 in held, len(counts) - 1 in held

            def ours_step(model=ours, opt=ours_opt) -> float:
                return model.train_step(x, y, F.cross_entropy, opt)

            def theirs_step(schedule=theirs, opt=theirs_opt, first=first, last=last) -> float | None:
                micro_losses: list[torch.Tensor] = []
                inputs = (x,) if first else ()
                if last:
                    schedule.step(*inputs, target=y, losses=micro_losses, return_outputs=False)
                else:
                    schedule.step(*inputs, return_outputs=False)
                opt.step()
                opt.zero_grad()
                return torch.stack(micro_losses).mean().item() if micro_losses else None

            steps_of = {"gpudist": [ours_step(), ours_step()], "torch": [theirs_step(), theirs_step()]}
            if last:
                losses.setdefault(m, {})[schedule] = steps_of
            tag = "" if schedule == "1f1b" else f"{schedule} "
            variants[f"gpudist {tag}m={m}"], variants[f"torch {tag}m={m}"] = ours_step, theirs_step
    mine = full[:cut] if stage == 0 else full[cut:]
    # One round per call so each round's times come back: ratios are taken within a round, where gpudist and torch
    # ran seconds apart, which keeps load from other processes on this shared machine out of them.
    rounds_s = [interleaved_times(comm, variants, steps, 1, warmup=i == 0) for i in range(rounds)]
    return {"rounds_s": rounds_s, "losses": losses, "stage_parameters": sum(p.numel() for p in mine.parameters())}


def throughput_row(args, m: int, schedule: str, rounds_s: list[dict], losses: dict, reference: list[float]) -> dict:
    """One row of part 1: ``schedule``'s gpudist and torch times at ``m`` micro-batches over the rounds."""
    tag = "" if schedule == "1f1b" else f"{schedule} "
    ours = statistics.median(r[f"gpudist {tag}m={m}"] for r in rounds_s)
    theirs = statistics.median(r[f"torch {tag}m={m}"] for r in rounds_s)
    ratios = sorted(r[f"torch {tag}m={m}"] / r[f"gpudist {tag}m={m}"] for r in rounds_s)
    mine = losses[schedule]
    error = max(abs(a - b) for name in ("gpudist", "torch") for a, b in zip(mine[name], reference, strict=True))
    return {
        "micro_batches": m,
        "schedule": schedule,
        "gpudist_step_s": ours,
        "torch_step_s": theirs,
        "gpudist_samples_per_s": args.batch / ours,
        "torch_samples_per_s": args.batch / theirs,
        "ratio_torch_vs_gpudist": statistics.median(ratios),
        "ratio_per_round": ratios,
        "losses": mine,
        "reference_losses": reference,
        "max_loss_error": error,
    }


def throughput(args) -> dict:
    res = spawn(
        throughput_rank,
        2,
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        micro_batches=args.micro_batches,
        steps=args.steps,
        rounds=args.rounds,
        lr=args.lr,
        virtual_stages=args.virtual_stages,
        timeout=600.0,
    )
    rounds_s = res[0]["rounds_s"]
    reference = reference_losses(args.width, args.depth, args.batch, args.lr)
    rows = [  # the rank holding the last stage has the losses (rank 0 in a V)
        throughput_row(args, m, schedule, rounds_s, {**res[0]["losses"][m], **res[1]["losses"][m]}, reference)
        for m in args.micro_batches
        for schedule in TORCH_SCHEDULES
        if schedule != "dualpipev" or m >= 4
    ]
    print(
        f"# 1. gpudist vs torch.distributed.pipelining (same schedule: {TORCH_SCHEDULES}; interleaved "
        f"v={args.virtual_stages}; the V 2 chunks per rank): gloo, 2 stages, MLP {args.width}x{args.depth}+head "
        f"({res[0]['stage_parameters'] / 1e6:.1f}M + {res[1]['stage_parameters'] / 1e6:.1f}M params), "
        f"batch {args.batch}, SGD; median of {args.rounds} rounds x {args.steps} steps"
    )
    print(
        f"{'micro':>6} {'schedule':>12} {'gpudist (ms)':>13} {'torch (ms)':>11} {'samples/s':>10} {'ratio':>7} "
        f"{'min-max':>11} {'loss step 1 gpudist/torch/ref':>32} {'max |loss err|':>15}"
    )
    for r in rows:
        first = f"{r['losses']['gpudist'][0]:.5f}/{r['losses']['torch'][0]:.5f}/{reference[0]:.5f}"
        print(
            f"{r['micro_batches']:>6} {r['schedule']:>12} {r['gpudist_step_s'] * 1e3:>13.1f} "
            f"{r['torch_step_s'] * 1e3:>11.1f} {r['gpudist_samples_per_s']:>10.0f} {r['ratio_torch_vs_gpudist']:>7.3f} "
            f"{r['ratio_per_round'][0]:>5.2f}-{r['ratio_per_round'][-1]:<5.2f} {first:>32} "
            f"{r['max_loss_error']:>15.2e}"
        )
    print(
        f"# ratio = torch step / gpudist step of the same schedule within a round, median over rounds (> 1: gpudist "
        f"faster; target >= {TARGET_RATIO}); 1-min load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    return {
        "model": {
            "width": args.width,
            "depth": args.depth,
            "split_blocks": [args.depth, args.depth + 1],
            "interleaved_chunk_modules": chunk_counts(args.depth, 2 * args.virtual_stages),
            "v_chunk_modules": chunk_counts(args.depth, 4),
            "stage_parameters": [r["stage_parameters"] for r in res],
        },
        "target_ratio": TARGET_RATIO,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------------------------------
# 2. Bubble with blocks of known cost


class _Sleep(torch.autograd.Function):
    """forward: sleep ``before``, return x; backward: sleep ``after``, return the gradient unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, before: float, after: float) -> torch.Tensor:
        ctx.after = after
        time.sleep(before)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.after)
        return grad, None, None


class SleepBlock(nn.Module):
    """A block whose forward takes ``seconds`` and backward twice that, without using a core: ``x * w`` with a
    sleep on the input's path (``seconds`` forward, ``seconds`` backward) and one on the weight's (``seconds``
    backward), so a split backward's input pass and weight pass each take half of it, as with F = B = W."""

    def __init__(self, seconds: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.seconds, self.seconds) * _Sleep.apply(self.weight, 0.0, self.seconds)


def chunks_per_rank(schedule: str, virtual_stages: int) -> int:
    return virtual_stages if schedule == "interleaved" else 2 if schedule in V_SHAPED else 1


def bubble_rank(comm, schedule: str, micro_batches: int, t_forward: float, steps: int, virtual_stages: int) -> dict:
    v = chunks_per_rank(schedule, virtual_stages)  # v chunks per stage, each 1/v of its compute
    model = PipelineParallelModel(
        nn.Sequential(*[SleepBlock(t_forward / v) for _ in range(comm.world_size * v)]),
        gpudist.ShardingConfiguration(comm),
        micro_batches=micro_batches,
        schedule=schedule,
        virtual_stages=v if schedule == "interleaved" else None,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.ones(2 * micro_batches, 4)
    model.train_step(x, x, F.mse_loss, opt)  # warm-up: the shape message, first-call overheads
    walls, busy, spans = [], [], []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        model.train_step(x, x, F.mse_loss, opt)
        walls.append(time.perf_counter() - start)
        busy.append(model.last_schedule["busy_s"])
        spans.append(model.last_schedule["step_s"])
    return {"wall_s": walls, "busy_s": busy, "step_s": spans, "max_in_flight": model.last_schedule["max_in_flight"]}


def bubble(args) -> dict:
    t_f = args.t_forward_ms / 1e3
    rows = []
    for p in args.bubble_stages:
        for m in args.bubble_micro:
            for schedule in ("1f1b", "gpipe", "interleaved", *NEW_SCHEDULES):
                v = chunks_per_rank(schedule, args.virtual_stages)
                if (m % p and schedule == "interleaved") or (schedule == "dualpipev" and m < 2 * p):
                    continue  # interleaved needs m a multiple of p, DualPipe-V m >= 2p
                res = run_ranks(
                    bubble_rank,
                    p,
                    args.bubble_backend,
                    timeout=120.0,
                    schedule=schedule,
                    micro_batches=m,
                    t_forward=t_f,
                    steps=args.bubble_steps,
                    virtual_stages=args.virtual_stages,
                )
                # per step: the span is the longest stage clock; the wall time the slowest rank's train_step
                per_step = [
                    (
                        1 - statistics.mean(r["busy_s"][i] for r in res) / max(r["step_s"][i] for r in res),
                        max(r["wall_s"][i] for r in res),
                    )
                    for i in range(args.bubble_steps)
                ]
                measured = statistics.median(b for b, _ in per_step)
                wall = statistics.median(w for _, w in per_step)
                orders = [stage_schedule(schedule, p, s, m, v) for s in range(p)]
                # the replay with F = B = W (forward t_f, backward 2 t_f): (p - 1) / (v m + p - 1) for the 1F1B
                # family, (p - 1) / (3 m + p - 1) for ZB-H1 (m >= p), (p - 1) / (6 m + p - 1) for the V (m >= 2p - 1)
                theory = schedule_bubble(orders, 1.0, 2.0, 1.0, where=placement(schedule))
                bound = [activations_alive(order)[0] for order in orders]
                rows.append(
                    {
                        "stages": p,
                        "micro_batches": m,
                        "schedule": schedule,
                        "virtual_stages": v,
                        "theory": theory,
                        "measured": measured,
                        "difference": measured - theory,
                        "wall_step_s": wall,
                        "measured_from_wall": 1 - m * 3 * t_f / wall,
                        "busy_per_micro_batch_s": [statistics.median(r["busy_s"]) / m for r in res],
                        "max_in_flight": [r["max_in_flight"] for r in res],
                        "max_in_flight_bound": bound,
                    }
                )
    print(
        f"\n# 2. bubble: sleep blocks t_f = {args.t_forward_ms:g} ms, t_b = 2 t_f, one block per stage, "
        f"{args.bubble_backend} backend; median of {args.bubble_steps} steps"
    )
    print(
        f"{'p':>2} {'m':>2} {'schedule':>11} {'theory':>7} {'measured':>9} {'diff':>7} {'from wall':>10} "
        f"{'step (ms)':>10}  max_in_flight per stage (bound)"
    )
    for r in rows:
        print(
            f"{r['stages']:>2} {r['micro_batches']:>2} {r['schedule']:>11} {r['theory']:>7.3f} {r['measured']:>9.3f} "
            f"{r['difference']:>+7.3f} {r['measured_from_wall']:>10.3f} {r['wall_step_s'] * 1e3:>10.1f}  "
            f"{r['max_in_flight']} ({r['max_in_flight_bound']})"
        )
    print("# measured = 1 - mean busy / span (stage clocks); from wall = 1 - m (t_f + t_b) / train_step wall time")
    measured = {(r["stages"], r["micro_batches"], r["schedule"]): r["measured"] for r in rows}
    comparison = [
        {"stages": p, "micro_batches": m, "schedule": schedule, "measured": value, "1f1b": measured[(p, m, "1f1b")]}
        for (p, m, schedule), value in measured.items()
        if schedule not in ("1f1b", "gpipe")
    ]
    for c in comparison:
        print(
            f"# p={c['stages']} m={c['micro_batches']}: measured bubble {c['schedule']} {c['measured']:.3f} vs 1f1b "
            f"{c['1f1b']:.3f} ({'below' if c['measured'] < c['1f1b'] else 'NOT below'})"
        )
    return {
        "vs_1f1b": comparison,
        "t_forward_s": t_f,
        "t_backward_s": 2 * t_f,
        "backend": args.bubble_backend,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8, help="hidden layers (even): depth/2 per stage")
    parser.add_argument("--batch", type=int, default=128, help="samples per step (divisible by every micro count)")
    parser.add_argument("--micro-batches", type=_ints, default=[4, 8], help="micro-batch counts >= 2, comma list")
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--bubble-stages", type=_ints, default=[2, 4])
    parser.add_argument("--bubble-micro", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--bubble-steps", type=int, default=5)
    parser.add_argument("--bubble-backend", choices=["inmemory", "gloo"], default="inmemory")
    parser.add_argument("--t-forward-ms", type=float, default=10.0, help="sleep per block forward (backward 2x)")
    parser.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank of the interleaved runs")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: throughput, bubble")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.depth % 2:
        parser.error(f"--depth={args.depth} must be even so both stages get depth/2 hidden layers")
    if bad := [m for m in args.micro_batches if m < 2 or m % 2 or args.batch % m]:
        parser.error(
            f"--micro-batches {bad}: each must be a multiple of 2 (the stage count: Schedule1F1B and both "
            f"interleaved schedules need it) and divide --batch={args.batch}"
        )
    if args.depth < 2 * args.virtual_stages:
        parser.error(f"--depth={args.depth} gives fewer hidden layers than the 2 x {args.virtual_stages} chunks")
    skip = set(args.skip.split(","))
    doc = {
        "benchmark": "pipeline",
        "settings": vars(args),
        "environment": environment(),
        "load_average_1min_at_start": os.getloadavg()[0],
    }
    torch.set_num_threads(1)  # as the workers: the reference losses and in-memory ranks on one thread each
    if "throughput" not in skip:
        doc["throughput"] = throughput(args)
    if "bubble" not in skip:
        doc["bubble"] = bubble(args)
    out = Path(args.out) if args.out else RESULTS / "pipeline.json"
    print(f"# wrote {atomic_write_json(out, doc)}")


if __name__ == "__main__":
    main()
