"""The capture part of ``gpudist bench gpu``: a whole DDP, ZeRO-2 and FSDP step captured as one CUDA graph each
(:func:`gpudist.capture`), against the same steps run eagerly and against their torch peers eager at their best
(DDP; DDP + ZeroRedundancyOptimizer; FSDP2), on host-bound workloads (the gpt model at batch 8, where the host's
issue time is most of the step's).

Per variant: the median step time (interleaved rounds, each at the slowest rank), the host's own milliseconds per
step call (nothing waited for: for the graph, the replay call and the batch copy), on the gpt workload the GPU's
busy share of a profiled run of its steps, and, from two fresh copies of the model stepped on the same batches, the
largest difference between the eager and the replayed losses.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

import torch

from .. import peers
from .. import workloads as W
from ..collectives import interleaved_times
from .common import GPUSettings, PartClock, _error_text, _world, part_rows

CAPTURE_WORKLOADS = ("gpt", "mlp", "gpt-host")
"""The workloads the part runs: host-bound ones (small kernels, many of them), where capture pays; ``gpt-host``
(0.3M parameters in 292 tensors) is the most host-bound, the CPU benchmarks' host-bound model."""

CAPTURED = {"ddp": "torch_ddp", "zero2": "torch_zero", "fsdp": "fsdp2"}
"""The strategies captured, each with its torch peer (eager, at its best)."""


class CaptureBench:
    """What every variant of one workload shares: the seeded batch, the loss, and the builders of gpudist's pairs
    and torch's DDP module (each from the same seeded model)."""

    def __init__(self, comm, torch_group, device, workload, batch, overrides, autocast, optimizer, graph):
        self.comm, self.torch_group, self.device = comm, torch_group, device
        self.workload, self.batch, self.overrides = workload, batch, overrides
        self.autocast, self.optimizer, self.graph = autocast, optimizer, graph
        generator = torch.Generator().manual_seed(1234 + comm.rank)
        self.x, self.y = (t.to(device) for t in W.batch(workload, batch, generator, **overrides))

    def loss_fn(self, model, x, y):
        dtype = self.autocast
        cast = torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with cast:
            return W.loss(self.workload, model, x, y)

    def net(self):
        return W.make(self.workload, **self.overrides).to(self.device)

    def gpudist_pair(self, strategy: str):
        from ...config import ShardingConfiguration
        from ...strategies import DATA_PARALLEL_PAIRS

        # static_graph where the peer promises it too (torch DDP): one gradient hook per bucket
        config = ShardingConfiguration(self.comm, bucket_cap_mb=25.0, static_graph=strategy != "fsdp")
        model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
        wrap = {"auto_wrap_policy": peers.gpudist_units(self.workload)} if strategy == "fsdp" else {}
        model = model_cls(self.net(), config, **wrap)
        params = model.parameters()
        if self.optimizer == "sgd":
            inner = torch.optim.SGD(params, lr=peers.LR, momentum=0.9)
        elif strategy == "ddp":  # torch's fused AdamW steps it: capturable keeps its count on the device
            inner = torch.optim.AdamW(params, lr=peers.LR, fused=True, capturable=True)
        else:  # gpudist's fused step: counts, bias corrections and the learning rate on the device
            inner = torch.optim.AdamW(params, lr=torch.tensor(peers.LR, device=self.device), capturable=True)
        return model, opt_cls(inner, config)

    def captured(self, model, opt, warmup: int = 3):
        """``model`` and ``opt``'s step captured (:func:`gpudist.capture`), as a call on the seeded batch."""
        from ...capture import capture

        step = capture(model, opt, self.loss_fn, (self.x, self.y), warmup=warmup, graph=self.graph)
        return functools.partial(step, self.x, self.y)

    def torch_module(self, net=None):
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(
            net if net is not None else self.net(),
            device_ids=ids,
            process_group=self.torch_group,
            bucket_cap_mb=25.0,
            gradient_as_bucket_view=True,
            static_graph=True,
        )

    def eager(self, model, opt):
        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = self.loss_fn(model, self.x, self.y)
            loss.backward()
            opt.step()
            return loss

        return step

    def measure(self, variants: dict, steps: int, rounds: int) -> tuple[dict, dict]:
        """Step times (interleaved rounds, slowest rank) and the host's median milliseconds per step call."""
        times = interleaved_times(self.comm, variants, steps, rounds)
        host = {}
        for name, fn in variants.items():
            _synchronize(self.device)
            seconds = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - t0)
            _synchronize(self.device)
            host[name] = statistics.median(seconds) * 1e3
        return {name: t * 1e3 for name, t in times.items()}, host

    def busy_shares(self, variants: dict, steps: int) -> dict[str, float | None]:
        """Per variant, the GPU's busy share of ``steps`` steps run back to back under ``torch.profiler`` and
        synchronized (:func:`~gpudist.bench.gpu.steps.kernel_busy_share`; None without CUDA kernels): one minus the
        share the GPU waits for the host."""
        from torch.profiler import ProfilerActivity, profile

        from .steps import kernel_busy_share

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        shares = {}
        for name, fn in variants.items():
            _synchronize(self.device)
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    fn()
                _synchronize(self.device)
            shares[name] = kernel_busy_share(prof.events())
        return shares

    def describe(self) -> dict:
        return {
            "workload": self.workload,
            "model": W.describe(W.make(self.workload, **self.overrides)),
            "batch_per_rank": self.batch,
            "autocast": None if self.autocast is None else str(self.autocast).removeprefix("torch."),
            "optimizer": self.optimizer,
            "world_size": self.comm.world_size,
        }


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
    busy: bool = False,
) -> dict:
    """On every rank, per captured strategy (DDP, ZeRO-2, FSDP): its torch peer eager, the gpudist step eager and the
    same step captured, on one seeded batch. ``optimizer``: ``adamw`` (``capturable=True`` for gpudist's steps, eager or
    captured: the same function; ZeRO-2's learning rate a device tensor) or ``sgd`` (the CPU tier, where torch
    refuses ``capturable``); ``graph``: the graph factory :func:`gpudist.capture` takes (None: CUDA's); ``busy``: also
    profile each variant for the GPU's busy share of its steps (:meth:`CaptureBench.busy_shares`)."""
    bench = CaptureBench(comm, torch_group, device, workload, batch, overrides, autocast, optimizer, graph)
    sgd = {"optimizer_class": torch.optim.SGD, "momentum": 0.9} if optimizer == "sgd" else {}

    def torch_optimizer(model):
        return (
            torch.optim.SGD(model.parameters(), lr=peers.LR, momentum=0.9)
            if sgd
            else peers.adamw(model.parameters(), fused=True)
        )

    ddp, zero = bench.torch_module(), bench.torch_module()
    fsdp = peers.fully_sharded(workload, bench.net(), torch_group, device)
    variants = {
        "torch_ddp": bench.eager(ddp, torch_optimizer(ddp)),
        "torch_zero": bench.eager(zero, peers.zero_redundancy(zero.parameters(), torch_group, **sgd)),
        "fsdp2": bench.eager(fsdp, torch_optimizer(fsdp)),
    }
    losses = {}
    for strategy in CAPTURED:
        variants[f"gpudist_{strategy}"] = bench.eager(*bench.gpudist_pair(strategy))
        variants[f"gpudist_{strategy}_graphed"] = bench.captured(*bench.gpudist_pair(strategy))
        losses[strategy] = _eager_and_replayed(bench, strategy)
    step_ms, host = bench.measure(variants, steps, rounds)
    shares = bench.busy_shares(variants, steps) if busy else None
    ratios = {
        f"{peer}/{name}": step_ms[peer] / step_ms[name]
        for strategy, peer in CAPTURED.items()
        for name in (f"gpudist_{strategy}", f"gpudist_{strategy}_graphed")
    }
    return {
        **bench.describe(),
        "step_ms": step_ms,
        "host_ms": host,
        "peer_over_gpudist": ratios,
        "replay_host_share": {s: host[f"gpudist_{s}_graphed"] / host[f"gpudist_{s}"] for s in CAPTURED},
        "gpu_busy_share": shares,
        "losses": losses,
        "loss_max_abs_diff": max(
            abs(a - b) for r in losses.values() for a, b in zip(r["eager"], r["replayed"], strict=True)
        ),
    }


def torch_graphed_row(bench: CaptureBench, steps: int, rounds: int) -> dict:
    """torch's own CUDA graphs on the same DDP step, where torch takes them, against torch DDP eager and gpudist's
    captured DDP step: the whole step captured as torch's recipe has it (DDP built on a side stream, 11 eager warm-up
    steps, capturable fused AdamW; captured through :func:`gpudist.capture`, which does for a plain module what
    ``torch.cuda.graph`` does), and ``torch.cuda.make_graphed_callables`` (forward and backward graphed, then wrapped
    in DDP; fused AdamW eager). A variant torch refuses is recorded with its error. Run in a part of its own: a
    capture that fails can leave the device's stream unusable. ``bench``'s optimizer and graph are gpudist's (the CPU
    tier, where both of torch's variants are refused, passes SGD and its simulated graph)."""
    device = bench.device
    ddp = bench.torch_module()
    variants = {
        "torch_ddp": bench.eager(ddp, peers.adamw(ddp.parameters(), fused=True)),
        "gpudist_ddp_graphed": bench.captured(*bench.gpudist_pair("ddp")),
    }
    errors = {}

    def whole_step():
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            model = bench.torch_module()
        torch.cuda.current_stream(device).wait_stream(side)
        opt = torch.optim.AdamW(model.parameters(), lr=peers.LR, fused=True, capturable=True)
        return bench.captured(model, opt, warmup=11)

    def graphed_callables():
        net = torch.cuda.make_graphed_callables(bench.net(), (bench.x,))
        model = bench.torch_module(net)
        return bench.eager(model, peers.adamw(model.parameters(), fused=True))

    for name, build in (("torch_ddp_graphed", whole_step), ("torch_ddp_graphed_callables", graphed_callables)):
        try:
            variants[name] = build()
        except Exception as e:  # torch refuses it here: recorded, the others still measured
            errors[name] = _error_text(e)
    step_ms, host = bench.measure(variants, steps, rounds)
    return {
        **bench.describe(),
        "step_ms": step_ms,
        "host_ms": host,
        "over_gpudist_graphed": {name: step_ms[name] / step_ms["gpudist_ddp_graphed"] for name in step_ms},
        "errors": errors,
    }


def _eager_and_replayed(bench: CaptureBench, strategy: str) -> dict:
    """The same function, eager and replayed: two fresh copies of ``strategy``'s pair stepped on the same batches
    (after capture's warm-up steps on its example batch), their losses."""
    from ...capture import capture

    generator = torch.Generator().manual_seed(99 + bench.comm.rank)
    batches = [
        tuple(t.to(bench.device) for t in W.batch(bench.workload, bench.batch, generator, **bench.overrides))
        for _ in range(4)
    ]
    model, opt = bench.gpudist_pair(strategy)
    eager = []
    for i, b in enumerate([batches[0]] * 3 + batches[1:]):
        opt.zero_grad(set_to_none=False)
        loss = bench.loss_fn(model, *b)
        loss.backward()
        opt.step()
        if i >= 3:
            eager.append(float(loss.detach()))
    step = capture(*bench.gpudist_pair(strategy), bench.loss_fn, batches[0], graph=bench.graph)
    return {"eager": eager, "replayed": [float(step(*b)) for b in batches[1:]]}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _capture_body(gloo, nccl, settings: GPUSettings) -> list[dict]:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl", device_id=nccl.device)
    rows, clock = [], PartClock(gloo, settings.timeouts["capture"], started=settings.part_started)
    for workload in CAPTURE_WORKLOADS:
        if not clock.fits():  # never run on a GPU yet: keep the rows measured rather than lose them all at the limit
            rows.append({"workload": workload, "error": "skipped: the part's time limit would not hold it"})
            continue
        try:
            rows.append(
                capture_rows(
                    nccl,
                    group,
                    nccl.device,
                    workload,
                    8,
                    settings.steps,
                    settings.rounds,
                    settings.model_overrides,
                    busy=workload == "gpt",  # (profiled on the workload only: the part's time limit)
                )
            )
        except Exception as e:  # the next workload still runs
            rows.append({"workload": workload, "error": _error_text(e)})
        clock.done()
    return rows


def _capture_torch_body(gloo, nccl, settings: GPUSettings) -> list[dict]:
    import torch.distributed as dist

    group = dist.new_group(backend="nccl", device_id=nccl.device)
    bench = CaptureBench(nccl, group, nccl.device, "gpt", 8, settings.model_overrides, None, "adamw", None)
    return [{"torch_graphs": True, **torch_graphed_row(bench, settings.steps, settings.rounds)}]


VARIANTS = {
    "torch_ddp": "DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=25), "
    "AdamW(fused=True), eager",
    "torch_zero": "the same DDP + ZeroRedundancyOptimizer(AdamW, fused=True, parameters_as_bucket_view=True), eager",
    "fsdp2": "fully_shard per block and the root (FSDP2), AdamW(fused=True), eager",
    "gpudist_ddp": "DDPModel(static_graph=True) + DDPOptimizer(AdamW(fused=True, capturable=True)), eager",
    "gpudist_ddp_graphed": "the same, gpudist.capture: one CUDA graph per step",
    "gpudist_zero2": "ZeRO2Model(static_graph=True) + ZeRO2Optimizer(AdamW(lr=tensor, capturable=True)), eager",
    "gpudist_zero2_graphed": "the same, gpudist.capture: one CUDA graph per step",
    "gpudist_fsdp": "FSDPModel (a unit per block, resharding after forward) + its optimizer (AdamW(lr=tensor, "
    "capturable=True)), eager",
    "gpudist_fsdp_graphed": "the same, gpudist.capture: one CUDA graph per step",
    "torch_ddp_graphed": "torch DDP's whole step captured by torch's recipe: DDP built on a side stream, 11 warm-up "
    "steps, AdamW(fused=True, capturable=True)",
    "torch_ddp_graphed_callables": "make_graphed_callables(model) wrapped in DDP, AdamW(fused=True) eager",
}
"""What every variant of the capture parts is (the JSON's ``variants``)."""


def _part(settings: GPUSettings, name: str, body, variants: list[str]) -> dict:
    world = _world(settings)
    rows = part_rows(settings, name, body, world)
    return {
        "world_size": world,
        "variants": {v: VARIANTS[v] for v in variants},
        "batch_per_rank": 8,
        "steps_per_round": settings.steps,
        "rounds": settings.rounds,
        "rows": rows,
    }


def capture_part(settings: GPUSettings) -> dict:
    """gpudist's captured DDP, ZeRO-2 and FSDP steps against the same eager and their torch peers
    (:func:`capture_rows` on each of :data:`CAPTURE_WORKLOADS`)."""
    names = [*CAPTURED.values(), *(f"gpudist_{s}{g}" for s in CAPTURED for g in ("", "_graphed"))]
    return _part(settings, "capture", _capture_body, names)


def capture_torch_part(settings: GPUSettings) -> dict:
    """torch's own CUDA graphs against gpudist's captured DDP step (:func:`torch_graphed_row`), in a part of its own:
    a capture torch refuses may leave the device unusable, or hang, and must not cost the capture part its rows."""
    names = ["torch_ddp", "gpudist_ddp_graphed", "torch_ddp_graphed", "torch_ddp_graphed_callables"]
    return _part(settings, "capture-torch", _capture_torch_body, names)
