"""A small elastic training job for tests and benchmarks: run one copy per torchrun agent.

Every step trains an MLP on a fixed global batch (split over however many ranks there are), so the final model
does not depend on the sequence of world sizes, and a single process can compute the expected result
(:func:`reference`). Rank 0 appends one JSON line per step to ``DIR/status.jsonl`` (step, world size, pid, time)
and, at the end, writes the final parameters and history to ``DIR/final.pt``.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo -m gpudist.elastic_job --dir /tmp/run
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4 and 6 ranks


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def wrap(module: nn.Module, config, zero_stage: int) -> nn.Module:
    """The model wrapper that pairs with ``ElasticOptimizer(zero_stage=...)``: ZeRO-2 frees gradients it does not
    own, so it needs its own model; stages 0 and 1 reduce gradients with DDP."""
    import gpudist

    return (gpudist.ZeRO2Model if zero_stage == 2 else gpudist.DDPModel)(module, config)


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
    opt = gpudist.ElasticOptimizer(make_optimizer(model.parameters()), config, root / "checkpoints", args.every,
                                   zero_stage=args.zero_stage, batch_size=GLOBAL_BATCH // world)  # fmt: skip
    status = root / "status.jsonl"
    if rank == 0:
        with status.open("a") as f:
            f.write(json.dumps({"event": "start", "step": opt.step_count, "world": world, "pid": os.getpid(),
                                "time": time.time(),
                                "restored": None if opt.restored is None else opt.restored.step}) + "\n")  # fmt: skip
    while opt.step_count < args.steps:
        x, y = batch(opt.step_count)
        loss = nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        time.sleep(args.sleep)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with status.open("a") as f:
                f.write(json.dumps({"event": "step", "step": opt.step_count, "world": world, "pid": os.getpid(),
                                    "time": time.time()}) + "\n")  # fmt: skip
    opt.finish()
    if rank == 0:
        flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        torch.save({"params": flat, "history": opt.history, "samples_seen": opt.samples_seen}, root / "final.pt")


if __name__ == "__main__":
    main()
