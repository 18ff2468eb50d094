"""The capture part of ``gpudist bench gpu``: a whole DDP step captured as one CUDA graph (:func:`gpudist.capture`)
against the same step run eagerly and against torch DDP eager at its best, on host-bound workloads (the gpt model at
batch 8, where the host's issue time is most of the step's).

Per variant: the median step time (interleaved rounds, each at the slowest rank), the host's own milliseconds per
step call (nothing waited for: for the graph, the replay call and the batch copy), and, from two fresh copies of the
model stepped on the same batches, the largest difference between the eager and the replayed losses.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from .. import peers
from .. import workloads as W
from ..collectives import interleaved_times, on_nccl
from .common import GPUSettings, _error_text, _world

CAPTURE_WORKLOADS = ("gpt", "mlp")
"""The workloads the part runs: host-bound ones (small kernels, many of them), where capture pays."""

_LOSS_STEPS = 3


def capture_rows(
    comm,
    torch_group,
    device: torch.device,
    workload: str,
    batch: int,
    steps: int,
    rounds: int,
    overrides: dict,
    *,
    autocast: torch.dtype | None = None,
    optimizer: str = "adamw",
    graph=None,
) -> dict:
    """On every rank: torch DDP eager, gpudist DDP eager and gpudist DDP captured, on one seeded batch.
    ``optimizer``: ``adamw`` (fused, ``capturable=True`` for the captured step) or ``sgd`` (the CPU tier, where torch
    refuses ``capturable``); ``graph``: the graph factory :func:`gpudist.capture` takes (None: CUDA's)."""
    from torch.nn.parallel import DistributedDataParallel

    from ...capture import capture
    from ...config import ShardingConfiguration
    from ...strategies import DDPModel, DDPOptimizer

    generator = torch.Generator().manual_seed(1234 + comm.rank)
    x, y = (t.to(device) for t in W.batch(workload, batch, generator, **overrides))

    def loss_fn(model, x, y):
        cast = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with cast:
            return W.loss(workload, model, x, y)

    def make_optimizer(params, capturable: bool):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=peers.LR, momentum=0.9)
        if capturable:
            return torch.optim.AdamW(params, lr=peers.LR, fused=True, capturable=True)
        return peers.adamw(params, fused=True)

    def gpudist_pair():
        config = ShardingConfiguration(comm, bucket_cap_mb=25.0, static_graph=True)
        model = DDPModel(W.make(workload, **overrides).to(device), config)
        return model, DDPOptimizer(make_optimizer(model.parameters(), capturable=True), config)

    def eager(model, opt):
        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
            return loss

        return step

    ids = [device.index] if device.type == "cuda" else None
    torch_model = DistributedDataParallel(
        W.make(workload, **overrides).to(device),
        device_ids=ids,
        process_group=torch_group,
        bucket_cap_mb=25.0,
        gradient_as_bucket_view=True,
        static_graph=True,
    )
    variants = {"torch_ddp": eager(torch_model, make_optimizer(torch_model.parameters(), capturable=False))}
    variants["gpudist_ddp"] = eager(*gpudist_pair())
    graphed = capture(*gpudist_pair(), loss_fn, (x, y), graph=graph)
    variants["gpudist_ddp_graphed"] = lambda: graphed(x, y)

    # The same function, eager and replayed: two fresh copies stepped on the same batches.
    generator = torch.Generator().manual_seed(99 + comm.rank)
    batches = [tuple(t.to(device) for t in W.batch(workload, batch, generator, **overrides)) for _ in range(4)]
    model, opt = gpudist_pair()
    for _ in range(3):  # capture's warm-up steps, on its example batch
        opt.zero_grad(set_to_none=False)
        loss_fn(model, *batches[0]).backward()
        opt.step()
    eager_losses = []
    for b in batches[1:]:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model, *b)
        loss.backward()
        opt.step()
        eager_losses.append(float(loss.detach()))
    step = capture(*gpudist_pair(), loss_fn, batches[0], graph=graph)
    replayed_losses = [float(step(*b)) for b in batches[1:]]

    times = interleaved_times(comm, variants, steps, rounds)
    host = {}
    for name, fn in variants.items():
        _synchronize(device)
        seconds = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
        _synchronize(device)
        host[name] = statistics.median(seconds) * 1e3
    ratios = {f"torch_ddp/{name}": times["torch_ddp"] / times[name] for name in ("gpudist_ddp", "gpudist_ddp_graphed")}
    return {
        "workload": workload,
        "model": W.describe(W.make(workload, **overrides)),
        "batch_per_rank": batch,
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "optimizer": optimizer,
        "world_size": comm.world_size,
        "step_ms": {name: t * 1e3 for name, t in times.items()},
        "host_ms": host,
        "peer_over_gpudist": ratios,
        "replay_host_share": host["gpudist_ddp_graphed"] / host["gpudist_ddp"],
        "eager_losses": eager_losses,
        "replayed_losses": replayed_losses,
        "loss_max_abs_diff": max(abs(a - b) for a, b in zip(eager_losses, replayed_losses, strict=True)),
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _capture_body(gloo, nccl, settings: GPUSettings) -> list[dict]:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl", device_id=nccl.device)
    rows = []
    for workload in CAPTURE_WORKLOADS:
        try:
            rows.append(
                capture_rows(
                    nccl, group, nccl.device, workload, 8, settings.steps, settings.rounds, settings.model_overrides
                )
            )
        except Exception as e:  # the next workload still runs
            rows.append({"workload": workload, "error": _error_text(e)})
    return rows


def capture_part(settings: GPUSettings) -> dict:
    from ...launch import spawn

    world = _world(settings)
    rows = spawn(on_nccl, world, body=_capture_body, settings=settings, timeout=settings.timeouts["capture"])[0]
    return {
        "world_size": world,
        "variants": {
            "torch_ddp": "DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=25), "
            "AdamW(fused=True), eager",
            "gpudist_ddp": "DDPModel(static_graph=True) + DDPOptimizer(AdamW(fused=True, capturable=True)), eager",
            "gpudist_ddp_graphed": "the same, gpudist.capture: one CUDA graph per step",
        },
        "batch_per_rank": 8,
        "steps_per_round": settings.steps,
        "rounds": settings.rounds,
        "rows": rows,
    }
