"""The capture part of ``gpudist bench gpu``: a whole DDP step and a whole ZeRO-2 step captured as one CUDA graph
each (:func:`gpudist.capture`), against the same steps run eagerly and against their torch peers eager at their best
(DDP; DDP + ZeroRedundancyOptimizer), on host-bound workloads (the gpt model at batch 8, where the host's issue time
is most of the step's).

Per variant: the median step time (interleaved rounds, each at the slowest rank), the host's own milliseconds per
step call (nothing waited for: for the graph, the replay call and the batch copy), and, from two fresh copies of the
model stepped on the same batches, the largest difference between the eager and the replayed losses.
"""

from __future__ import annotations

import contextlib
import functools
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


CAPTURED = {"ddp": "torch_ddp", "zero2": "torch_zero"}
"""The strategies captured, each with its torch peer (eager, at its best)."""


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
    """On every rank, per captured strategy (DDP, ZeRO-2): its torch peer eager, the gpudist step eager and the same
    step captured, on one seeded batch. ``optimizer``: ``adamw`` (``capturable=True`` for gpudist's steps, eager or
    captured: the same function; ZeRO-2's learning rate a device tensor) or ``sgd`` (the CPU tier, where torch
    refuses ``capturable``); ``graph``: the graph factory :func:`gpudist.capture` takes (None: CUDA's)."""
    from torch.nn.parallel import DistributedDataParallel

    from ...capture import capture
    from ...config import ShardingConfiguration
    from ...strategies import DATA_PARALLEL_PAIRS

    generator = torch.Generator().manual_seed(1234 + comm.rank)
    x, y = (t.to(device) for t in W.batch(workload, batch, generator, **overrides))

    def loss_fn(model, x, y):
        cast = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with cast:
            return W.loss(workload, model, x, y)

    def gpudist_pair(strategy: str):
        config = ShardingConfiguration(comm, bucket_cap_mb=25.0, static_graph=True)
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        model = model_cls(W.make(workload, **overrides).to(device), config)
        params = model.parameters()
        if optimizer == "sgd":
            inner = torch.optim.SGD(params, lr=peers.LR, momentum=0.9)
        elif strategy == "ddp":  # torch's fused AdamW steps it: capturable keeps its count on the device
            inner = torch.optim.AdamW(params, lr=peers.LR, fused=True, capturable=True)
        else:  # gpudist's fused step: counts, bias corrections and the learning rate on the device
            inner = torch.optim.AdamW(params, lr=torch.tensor(peers.LR, device=device), capturable=True)
        return model, opt_cls(inner, config)

    def eager(model, opt):
        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            loss.backward()
            opt.step()
            return loss

        return step

    def torch_module():
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(
            W.make(workload, **overrides).to(device),
            device_ids=ids,
            process_group=torch_group,
            bucket_cap_mb=25.0,
            gradient_as_bucket_view=True,
            static_graph=True,
        )

    sgd = {"optimizer_class": torch.optim.SGD, "momentum": 0.9} if optimizer == "sgd" else {}
    ddp, zero = torch_module(), torch_module()
    variants = {
        "torch_ddp": eager(ddp, torch.optim.SGD(ddp.parameters(), lr=peers.LR, momentum=0.9) if sgd
                           else peers.adamw(ddp.parameters(), fused=True)),
        "torch_zero": eager(zero, peers.zero_redundancy(zero.parameters(), torch_group, **sgd)),
    }  # fmt: skip
    losses = {}
    for strategy in CAPTURED:
        variants[f"gpudist_{strategy}"] = eager(*gpudist_pair(strategy))
        graphed = capture(*gpudist_pair(strategy), loss_fn, (x, y), graph=graph)
        variants[f"gpudist_{strategy}_graphed"] = functools.partial(graphed, x, y)
        losses[strategy] = _eager_and_replayed(gpudist_pair, strategy, loss_fn, workload, batch, overrides, device,
                                               graph, comm.rank)  # fmt: skip

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
    ratios = {
        f"{peer}/{name}": times[peer] / times[name]
        for strategy, peer in CAPTURED.items()
        for name in (f"gpudist_{strategy}", f"gpudist_{strategy}_graphed")
    }
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
        "replay_host_share": {s: host[f"gpudist_{s}_graphed"] / host[f"gpudist_{s}"] for s in CAPTURED},
        "losses": losses,
        "loss_max_abs_diff": max(
            abs(a - b) for r in losses.values() for a, b in zip(r["eager"], r["replayed"], strict=True)
        ),
    }


def _eager_and_replayed(gpudist_pair, strategy, loss_fn, workload, batch, overrides, device, graph, rank) -> dict:
    """The same function, eager and replayed: two fresh copies of ``strategy``'s pair stepped on the same batches
    (after capture's warm-up steps on its example batch), their losses."""
    from ...capture import capture

    generator = torch.Generator().manual_seed(99 + rank)
    batches = [tuple(t.to(device) for t in W.batch(workload, batch, generator, **overrides)) for _ in range(4)]
    model, opt = gpudist_pair(strategy)
    eager = []
    for i, b in enumerate([batches[0]] * 3 + batches[1:]):
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model, *b)
        loss.backward()
        opt.step()
        if i >= 3:
            eager.append(float(loss.detach()))
    step = capture(*gpudist_pair(strategy), loss_fn, batches[0], graph=graph)
    return {"eager": eager, "replayed": [float(step(*b)) for b in batches[1:]]}


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
            "torch_zero": "the same DDP + ZeroRedundancyOptimizer(AdamW, fused=True, parameters_as_bucket_view=True), "
            "eager",
            "gpudist_ddp": "DDPModel(static_graph=True) + DDPOptimizer(AdamW(fused=True, capturable=True)), eager",
            "gpudist_ddp_graphed": "the same, gpudist.capture: one CUDA graph per step",
            "gpudist_zero2": "ZeRO2Model(static_graph=True) + ZeRO2Optimizer(AdamW(lr=tensor, capturable=True)), eager",
            "gpudist_zero2_graphed": "the same, gpudist.capture: one CUDA graph per step",
        },
        "batch_per_rank": 8,
        "steps_per_round": settings.steps,
        "rounds": settings.rounds,
        "rows": rows,
    }
