"""``gpudist.plan``'s step-time model against measured steps: every strategy on 2 Gloo ranks on this machine.

    python -m benchmarks.plan [--steps 6] [--batch 16] [--out benchmarks/results/plan.json]

1. Calibrate the cluster on this machine (:func:`gpudist.plan.measure_cluster`: all-reduces of 4 KiB and 4 MiB on 2
   Gloo ranks for latency and bandwidth, a matmul for FLOP/s, an add for memory bandwidth), and the per-step
   overhead no term models (Python dispatch of a small model) from one single-process step of the same model
   minus its predicted compute.
2. For each configuration (DDP, ZeRO-1/2/3, FSDP, pipeline pp=2 m=4 1F1B, tensor tp=2) build it with
   :func:`gpudist.plan.build` on 2 spawned Gloo ranks (one intra-op thread each), train ``--steps`` steps after 2
   warm-up steps, and take the median step (the slower rank's). Report predicted vs measured and the relative error.

Model: examples/lm.py's TinyLM (412k parameters, d=128, 2 blocks, 4 heads, seq 64), fp32, AdamW, global batch 16.
Predicted bytes per step are checked exactly against the counters by tests/test_plan.py; this benchmark is about
time only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from examples.lm import TinyLM, as_sequential, lm_loss, tinylm_plan
from gpudist.bench import environment
from gpudist.fileio import atomic_write_json
from gpudist.plan import Config, ModelSpec, build, measure_cluster, predict
from gpudist.testing import run_ranks

RESULTS = Path(__file__).parent / "results"
CONFIGS = [
    Config("ddp", dp=2),
    Config("zero1", dp=2),
    Config("zero2", dp=2),
    Config("zero3", dp=2),
    Config("fsdp", dp=2),
    Config("pipeline", dp=1, pp=2, micro_batches=4),
    Config("tensor", dp=1, tp=2),
]


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (size, 65), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, opt, config: Config, x, y) -> None:
    if config.strategy == "pipeline":
        model.train_step(x, y, lm_loss, opt)
        return
    loss = model.cross_entropy(model(x), y) if config.strategy == "tensor" else lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def measure_rank(comm, config: Config, steps: int, global_batch: int) -> list[float]:
    """One rank's step times (after 2 warm-up steps)."""
    torch.set_num_threads(1)
    model, opt = build(
        config, TinyLM(), comm, lambda ps: torch.optim.AdamW(ps, lr=1e-3), blocks=as_sequential, tp_plan=tinylm_plan
    )
    replicas = config.dp
    rank = getattr(model, "data_parallel_rank", comm.rank)
    times = []
    for step in range(steps + 2):
        x, y = batch(step, global_batch)
        n = global_batch // replicas
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        comm.barrier()
        start = time.perf_counter()
        _step(model, opt, config, x, y)
        times.append(time.perf_counter() - start)
    return times[2:]


def single_process_step(global_batch: int, steps: int) -> float:
    torch.set_num_threads(1)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 2):
        x, y = batch(step, global_batch // 2)
        start = time.perf_counter()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    spec = ModelSpec.from_module(TinyLM(), blocks=as_sequential, tp_plan=tinylm_plan)
    cluster = measure_cluster()
    # One rank's share of the batch on one process: what the compute model does not see is per-step overhead.
    plain = single_process_step(args.batch, args.steps)
    one = predict(Config("ddp", dp=1), spec, cluster, args.batch // 2, compute_dtype=torch.float32)
    overhead = max(0.0, plain - one.step_time)
    cluster = cluster.__class__(**{**cluster.__dict__, "step_overhead": overhead})
    rows = []
    for config in CONFIGS:
        pred = predict(config, spec, cluster, args.batch, compute_dtype=torch.float32)
        per_rank = run_ranks(measure_rank, 2, "gloo", config=config, steps=args.steps, global_batch=args.batch)
        measured = statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
        error = (pred.step_time - measured) / measured
        rows.append(
            {
                "config": config.describe(),
                "predicted_s": pred.step_time,
                "measured_s": measured,
                "error": error,
                "predicted_parts_s": pred.time_parts,
                "bytes_per_step": pred.bytes_per_step,
            }
        )
        print(
            f"{config.describe():<24} predicted {pred.step_time * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms  "
            f"error {error:+.0%}"
        )
    errors = [abs(r["error"]) for r in rows]
    doc = {
        "benchmark": "plan",
        "model": "TinyLM (412k parameters), fp32, AdamW",
        "global_batch": args.batch,
        "steps": args.steps,
        "cluster_measured": cluster.__dict__,
        "single_process_step_s": plain,
        "rows": rows,
        "mean_abs_error": statistics.mean(errors),
        "max_abs_error": max(errors),
        "environment": environment(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"mean |error| {doc['mean_abs_error']:.0%}, max {doc['max_abs_error']:.0%}")
    out = Path(args.out) if args.out else RESULTS / "plan.json"
    print(f"# wrote {atomic_write_json(out, doc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
