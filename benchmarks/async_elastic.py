"""Stragglers and failures: AsyncSGDOptimizer vs DDP with one slow worker, and elastic recovery under torchrun.

    python -m benchmarks.async_elastic [--world 3] [--seconds 6] [--step-ms 20] [--staleness 2] [--rounds 3]
                                       [--skip-elastic] [--kills 2]

Two measurements, one JSON (``benchmarks/results/async_elastic.json``):

1. Throughput with one worker 2x slower. ``--world`` Gloo processes (spawned, 127.0.0.1) train the same MLP on
   batches of 32; every step a worker also sleeps ``--step-ms`` (the last rank twice that: the straggler), so
   the step times are known whatever the core count. DDP (DDPModel + DDPOptimizer) runs in lockstep at the
   straggler's pace; AsyncSGDOptimizer (``--staleness``) lets the others run ahead. Each run lasts
   ``--seconds``; throughput = samples whose gradients were applied per second (for async: gradients the
   shards accepted; dropped ones do not count). Ratio = async / DDP, median over ``--rounds`` rounds that
   alternate the two (target >= 1.5). The final training loss of both is reported too (async trades staleness
   for speed).
2. Recovery. ``gpudist.testing.elastic_job`` under 3 torchrun agents (``--nnodes=2:3``, c10d rendezvous, checkpoints
   every 5 steps); one node is killed ``--kills`` times (a new one joins after each recovery). Per kill: seconds
   from the kill to the first step done at the new world size (detect + restart + rendezvous + reload), and the
   steps redone (last step reached before the kill minus the checkpoint step resumed from).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import gpudist
from gpudist.bench import environment
from gpudist.fileio import atomic_write_json
from gpudist.testing import elastic_job, free_port, run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_RATIO = 1.5
"""Async throughput / DDP throughput with one worker 2x slower, that AsyncSGDOptimizer must reach."""
BATCH = 32


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x = torch.randn(BATCH, 32, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).tanh()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def _throughput(comm, strategy: str, seconds: float, step_s: float, staleness: int) -> dict:
    """One rank's run: steps done, samples applied, final loss. The last rank is the straggler (2x step time)."""
    torch.set_num_threads(1)
    slow = comm.rank == comm.world_size - 1
    pause = step_s * (2 if slow else 1)
    config = gpudist.ShardingConfiguration(comm)
    if strategy == "ddp":
        model = gpudist.DDPModel(_model(), config)
        opt = gpudist.DDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), config)
    else:
        model = _model()
        opt = gpudist.AsyncSGDOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), config, max_staleness=staleness
        )
    comm.barrier()
    start = time.perf_counter()
    steps, losses = 0, []
    while True:
        if strategy == "ddp":  # lockstep: every rank must agree to go on (rank 0's clock decides)
            go = torch.tensor([1.0 if time.perf_counter() - start < seconds else 0.0])
            comm.broadcast(go, src=0)
            if not go.item():
                break
        elif time.perf_counter() - start >= seconds:
            break
        x, y = _data(comm.rank, steps)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        time.sleep(pause)
        opt.step()
        opt.zero_grad()
        steps += 1
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    out = {"rank": comm.rank, "steps": steps, "seconds": elapsed, "final_loss": statistics.fmean(losses[-10:])}
    if strategy == "async":
        opt.finish()
        out["accepted"] = opt.stats["accepted"]  # this rank's shard: every accepted gradient reaches every shard
        out["dropped"] = opt.stats["dropped"]
        out["max_staleness_seen"] = opt.stats["max_staleness_seen"]
    return out


def measure_throughput(world: int, seconds: float, step_ms: float, staleness: int, rounds: int) -> dict:
    rows = []
    for r in range(rounds):
        row = {"round": r}
        for strategy in ("ddp", "async") if r % 2 == 0 else ("async", "ddp"):
            results = run_ranks(
                _throughput,
                world,
                "gloo",
                strategy=strategy,
                seconds=seconds,
                step_s=step_ms / 1e3,
                staleness=staleness,
                timeout=120,
            )
            span = max(x["seconds"] for x in results)
            applied = results[0]["steps"] * world if strategy == "ddp" else results[0]["accepted"]
            row[strategy] = {
                "samples_per_s": applied * BATCH / span,
                "steps_per_rank": [x["steps"] for x in results],
                "final_loss": statistics.fmean(x["final_loss"] for x in results),
            }
            if strategy == "async":
                row[strategy]["dropped"] = results[0]["dropped"]
                row[strategy]["max_staleness_seen"] = max(x["max_staleness_seen"] for x in results)
        row["ratio"] = row["async"]["samples_per_s"] / row["ddp"]["samples_per_s"]
        rows.append(row)
        print(
            f"round {r}: DDP {row['ddp']['samples_per_s']:8.0f} samples/s (steps {row['ddp']['steps_per_rank']}), "
            f"async {row['async']['samples_per_s']:8.0f} samples/s (steps {row['async']['steps_per_rank']}, dropped "
            f"{row['async']['dropped']}), ratio {row['ratio']:.2f}"
        )
    ratios = [row["ratio"] for row in rows]
    return {
        "world": world,
        "seconds": seconds,
        "step_ms": step_ms,
        "straggler_step_ms": 2 * step_ms,
        "max_staleness": staleness,
        "batch_per_rank": BATCH,
        "rounds": rows,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "target": TARGET_RATIO,
        "target_met": statistics.median(ratios) >= TARGET_RATIO,
    }


def measure_recovery(kills: int, every: int = 5, sleep: float = 0.1) -> dict:
    steps = 30 + 25 * kills
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        root.mkdir()
        logs = [Path(tmp) / f"agent{i}.log" for i in range(3 + kills)]
        launch = functools.partial(elastic_job.launch_agent, free_port(), root, steps=steps, every=every, sleep=sleep)
        status = functools.partial(elastic_job.read_status, root)
        agents = [launch(logs[0])]
        time.sleep(1.0)  # the first agent hosts the rendezvous store: never the one killed
        agents += [launch(logs[1]), launch(logs[2])]
        victims, results = [1, 2], []
        try:
            since = time.time()
            for k in range(kills):
                elastic_job.wait_for(
                    lambda t=since: (
                        sum(e["event"] == "step" and e["world"] == 3 and e["time"] > t for e in status()) >= 8
                    ),
                    "8 steps at world 3",
                    agents,
                    logs,
                )
                time.sleep(every * sleep * 0.5)  # lands mid-interval: part of a checkpoint interval is at stake
                killed = time.time()
                elastic_job.kill_node(agents[victims[k % 2]])
                resumed_at = elastic_job.wait_for(
                    lambda t=killed: any(e["event"] == "step" and e["world"] == 2 and e["time"] > t for e in status()),
                    "a step at world 2",
                    agents,
                    logs,
                )
                events = status()
                start = next(e for e in events if e["event"] == "start" and e["time"] > killed)
                reached = max(e["step"] for e in events if e["event"] == "step" and e["time"] <= killed)
                results.append(
                    {
                        "kill": k,
                        "step_reached": reached,
                        "resumed_from": start["step"],
                        "steps_redone": reached - start["step"],
                        "recovery_s": resumed_at - killed,
                        "worker_started_s": start["time"] - killed,
                    }
                )  # restart + rendezvous + init + load
                print(
                    f"kill {k}: reached step {reached}, resumed from {start['step']} at world 2, "
                    f"{resumed_at - killed:.1f} s from kill to the first step ({start['time'] - killed:.1f} s to a "
                    "restored worker)"
                )
                agents.append(launch(logs[3 + k]))  # a new node joins
                victims[k % 2] = len(agents) - 1
                since = time.time()
            alive = [a for a in agents if a.poll() is None]
            elastic_job.wait_for(
                lambda: all(a.poll() is not None for a in alive), "the agents to finish", agents, logs, limit=240
            )
            final = torch.load(root / "final.pt")
            exact = torch.allclose(final["params"], elastic_job.reference(steps), atol=2e-6, rtol=1e-5)
        finally:
            for a in agents:
                if a.poll() is None:
                    os.killpg(a.pid, signal.SIGKILL)
    return {
        "steps": steps,
        "checkpoint_every": every,
        "step_sleep_s": sleep,
        "kills": results,
        "history": final["history"],
        "final_equals_single_process": exact,
        "recovery_s_median": statistics.median(r["recovery_s"] for r in results) if results else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--skip-elastic", action="store_true")
    parser.add_argument("--json", default=str(RESULTS / "async_elastic.json"))
    args = parser.parse_args(argv)
    doc = {
        "benchmark": "async_elastic",
        "environment": environment(),
        "throughput": measure_throughput(args.world, args.seconds, args.step_ms, args.staleness, args.rounds),
    }
    t = doc["throughput"]
    verdict = "met" if t["target_met"] else "NOT met"
    print(
        f"async / DDP throughput with one worker 2x slower: median {t['ratio_median']:.2f} (rounds "
        f"{t['ratio_min']:.2f}-{t['ratio_max']:.2f}), target {TARGET_RATIO}: {verdict}"
    )
    if not args.skip_elastic:
        doc["recovery"] = measure_recovery(args.kills)
        print(
            f"elastic: history {doc['recovery']['history']}, final model equals single-process training: "
            f"{doc['recovery']['final_equals_single_process']}"
        )
    atomic_write_json(args.json, doc)
    print(f"wrote {args.json}")
    return doc


if __name__ == "__main__":
    main()
