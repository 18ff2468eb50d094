"""A small live elastic job (gpudist.live) for tests and benchmarks: the elastic job's model and global batches,
trained by :class:`~gpudist.live.LiveElasticTrainer` over Gloo.

Every worker appends JSON lines to ``DIR/worker-ID.jsonl`` (``step``: a step done, with the world size, generation
and time; ``generation``: one entry of ``trainer.events``) and writes its final parameters to ``DIR/final-ID.pt``.
``--die STEP:WHERE`` makes the worker SIGKILL itself at step STEP in ``forward``, ``backward`` (while the later
layers' gradient buckets are being all-reduced), ``optimizer`` (inside the torch optimizer's step), ``heal`` (while
forming the next generation after a failure, once its group has connected) or ``admission`` (in a generation that
admits a newcomer, after it was decided, before its group connects).

    python -m gpudist.live --nproc 3 -- python -m gpudist.testing.live_job --dir /tmp/run --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from ..live import Generation, LiveElasticTrainer
from . import elastic_job

POINTS = ("forward", "backward", "optimizer", "heal", "admission")
TINY_BUCKETS = {"bucket_cap_mb": 0.0005, "first_bucket_mb": 0.0005}
"""Buckets of ~130 fp32 elements: the MLP's gradients go out in several all-reduces during backward."""


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    """Calls ``kill`` when the trainer reaches ``step`` at ``where`` (one of :data:`POINTS`); installed through the
    model and optimizer factories, so they follow the trainer into every generation."""

    def __init__(self, step: int | None, where: str | None, kill=die):
        if where is not None and where not in POINTS:
            raise ValueError(f"where={where!r}; use one of {POINTS}")
        self.step, self.where, self.kill = step, where, kill
        self.trainer = None
        self.forming = False

    def at(self, where: str) -> None:
        t = self.trainer
        if where == self.where and t is not None and t.step_count == self.step:
            self.kill()

    def connecting(self, g) -> None:
        """Called by :class:`FaultyTrainer` before it connects generation ``g``'s group: kills at ``admission`` when
        ``g`` admits a newcomer (it has survivors and someone new)."""
        if g.survivors and len(g.members) > len(g.survivors):
            self.at("admission")

    def build_module(self) -> nn.Module:
        module = elastic_job.build_model()
        if self.where == "backward":  # the first layer's gradient is the last computed: the others are in flight
            module[0].weight.register_hook(lambda grad: self.at("backward"))
        if self.forming:
            self.at("heal")
        return module

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        opt = elastic_job.make_optimizer(params)
        opt.register_step_pre_hook(lambda *_: self.at("optimizer"))
        return opt

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.at("forward")
        return nn.functional.mse_loss(outputs, targets, reduction="sum")


class FaultyTrainer(LiveElasticTrainer):
    """A trainer that tells its :class:`Faults` (``faults=``) when it is about to connect a generation's group."""

    def __init__(self, *args, faults: Faults, **kwargs):
        self.faults = faults
        super().__init__(*args, **kwargs)

    def _group(self, g: Generation):
        self.faults.connecting(g)
        return super()._group(g)


def main() -> None:
    from ..live import Membership

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--min-size", type=int, default=2, help="workers the first generation waits for")
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--redundancy", default=None, choices=["buddy"], help="buddy mirrors of ZeRO shards")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of simulated work per step")
    parser.add_argument("--timeout", type=float, default=10.0, help="collective timeout in seconds")
    parser.add_argument("--failure-timeout", type=float, default=1.0, help="heartbeat silence that means dead")
    parser.add_argument("--die", default=None, help="STEP:WHERE, where in forward|backward|optimizer|heal")
    parser.add_argument("--hold", default=None, help="STEP:N: at STEP wait until N join requests were made")
    parser.add_argument(
        "--wait-for", default=None, help="start only once this file exists (a replacement started early)"
    )
    args = parser.parse_args()
    while args.wait_for and not Path(args.wait_for).exists():
        time.sleep(0.05)
    torch.set_num_threads(1)  # workers share the machine's cores
    root = Path(args.dir)
    step, where = (int(args.die.split(":")[0]), args.die.split(":")[1]) if args.die else (None, None)
    faults = Faults(step, where)
    membership = Membership.connect(min_size=args.min_size, failure_timeout=args.failure_timeout)
    log = (root / f"worker-{membership.id}.jsonl").open("a")

    def write(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    trainer = FaultyTrainer(
        faults.build_module,
        faults.build_optimizer,
        membership,
        root / "checkpoints",
        args.every,
        zero_stage=args.zero_stage,
        timeout=args.timeout,
        config_options=TINY_BUCKETS,
        redundancy=args.redundancy,
        faults=faults,
    )
    faults.trainer, faults.forming = trainer, True
    written = 0
    hold_step, hold_joins = map(int, args.hold.split(":")) if args.hold else (None, 0)
    while trainer.step_count < args.steps:
        time.sleep(args.sleep)
        deadline = time.monotonic() + 300
        while trainer.step_count == hold_step and membership.store.add("joins", 0) < hold_joins:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no join request within 300s at step {hold_step}")
            time.sleep(0.02)
        trainer.train_step(elastic_job.batch, faults.loss)
        for event in trainer.events[written:]:
            write({"event": "generation", "pid": os.getpid(), **event})
        written = len(trainer.events)
        g = trainer.generation
        write(
            {
                "event": "step",
                "pid": os.getpid(),
                "step": trainer.step_count,
                "world": len(g.members),
                "gen": g.number,
                "time": time.time(),
            }
        )
    trainer.finish()
    flat = trainer.model.gather_full_parameters()  # collective; ZeRO-3's module holds no parameters between steps
    state = sum(trainer.model.memory_per_rank().values())
    final = {"params": flat, "events": trainer.events, "id": membership.id, "state_bytes": state}
    torch.save({**final, "buddy_bytes": trainer.buddy_bytes}, root / f"final-{membership.id}.pt")
    trainer.close()


if __name__ == "__main__":
    main()
