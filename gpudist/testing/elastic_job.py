"""A small elastic training job for tests and benchmarks: run one copy per torchrun agent.

Every step trains an MLP on a fixed global batch (split over however many ranks there are), so the final model
does not depend on the sequence of world sizes, and a single process can compute the expected result
(:func:`reference`). Rank 0 appends one JSON line per step to ``DIR/status.jsonl`` (step, world size, pid, time)
and, at the end, writes the final parameters and history to ``DIR/final.pt``.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo -m gpudist.testing.elastic_job --dir /tmp/run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4 and 6 ranks


_INIT_LOCK = threading.Lock()


def build_model() -> nn.Module:
    """The same initial weights every time, also when in-memory ranks (threads sharing torch's global RNG) build
    it at once; the caller's RNG state is left as it was."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def wrap(module: nn.Module, config, zero_stage: int) -> nn.Module:
    """The model wrapper that pairs with ``ElasticOptimizer(zero_stage=...)`` (see ``elastic_classes``)."""
    from gpudist.elastic import elastic_classes

    return elastic_classes(zero_stage)[0](module, config)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same whatever the world size: this is the data position)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def reference(steps: int) -> torch.Tensor:
    """Single-process training on the global batch: what the elastic job must end with."""
    model = build_model()
    opt = make_optimizer(model.parameters())
    for step in range(steps):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ---------------------------------------------------------------------------------------------------------------------
# Driving it under torchrun (tests and benchmarks): agents of one worker each, status, node loss


def launch_agent(
    port: int,
    root: Path,
    log: Path,
    *,
    steps: int,
    every: int,
    sleep: float,
    nnodes: str = "2:3",
    max_restarts: int = 5,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """One torchrun agent (one worker) joining the c10d rendezvous on 127.0.0.1:``port``, in a session of its own
    (so :func:`kill_node` can take it down with its worker)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=gpudist-elastic-job",
        "--rdzv-conf=join_timeout=90,last_call_timeout=3",
        "--monitor-interval=0.2",
        "-m",
        "gpudist.testing.elastic_job",
        "--dir",
        str(root),
        "--steps",
        str(steps),
        "--every",
        str(every),
        "--sleep",
        str(sleep),
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )


def read_status(root: Path) -> list[dict]:
    """The events rank 0 logged so far (``start``: step resumed from and world size; ``step``: step done)."""
    path = Path(root) / "status.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def kill_node(agent: subprocess.Popen) -> None:
    """A node is lost: its agent and its worker (torchrun starts the worker in a session of its own) die at once."""
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    os.killpg(agent.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def wait_for(predicate, what: str, agents: list[subprocess.Popen], logs: list[Path], limit: float = 90.0) -> float:
    """Poll ``predicate`` until true (returns the time.time() it became true); on timeout kill the agents and raise
    with the tails of their logs."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return time.time()
        time.sleep(0.05)
    for a in agents:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
    raise TimeoutError(f"timed out after {limit:g}s waiting for {what}\n{tails}")


def main() -> None:
    import gpudist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoints, status.jsonl and final.pt go here")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds of simulated work per step")
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=20.0, help="collective timeout in seconds")
    args = parser.parse_args()
    root = Path(args.dir)
    comm = gpudist.init("gloo", timeout=args.timeout)
    config = gpudist.ShardingConfiguration(comm)
    model = wrap(build_model(), config, args.zero_stage)
    world, rank = comm.world_size, comm.rank
    opt = gpudist.ElasticOptimizer(
        make_optimizer(model.parameters()),
        config,
        root / "checkpoints",
        args.every,
        zero_stage=args.zero_stage,
        batch_size=GLOBAL_BATCH // world,
    )
    status = root / "status.jsonl"
    if rank == 0:
        with status.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "event": "start",
                        "step": opt.step_count,
                        "world": world,
                        "pid": os.getpid(),
                        "time": time.time(),
                        "restored": None if opt.restored is None else opt.restored.step,
                    }
                )
                + "\n"
            )
    while opt.step_count < args.steps:
        x, y = batch(opt.step_count)
        loss = nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        time.sleep(args.sleep)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with status.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "event": "step",
                            "step": opt.step_count,
                            "world": world,
                            "pid": os.getpid(),
                            "time": time.time(),
                        }
                    )
                    + "\n"
                )
    opt.finish()
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        torch.save({"params": flat, "history": opt.history, "samples_seen": opt.samples_seen}, root / "final.pt")


if __name__ == "__main__":
    main()
