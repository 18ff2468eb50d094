"""The memory and time model: :func:`predict` gives one configuration's memory by category, bytes per step and step
time on its most loaded rank (a :class:`Prediction`); what is counted and what each strategy overlaps is in
:mod:`gpudist.plan`'s docstring."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..flat import assign_buckets, padded_shard, vector_align
from ..kernels import FlatLayout
from ..strategies.pipeline.schedule import (
    activations_alive,
    check_schedule,
    holder,
    partition_blocks,
    placement,
    schedule_bubble,
    stage_schedule,
    virtual_stage,
)
from .model import _DTYPES, Cluster, Config, ModelSpec, ParamSpec

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


@dataclass
class Prediction:
    """Per-rank predictions for one configuration (the most loaded rank: pipeline stage 0)."""

    config: Config
    fits: bool
    why: str
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes by category (see :mod:`gpudist.plan`'s docstring); ``total`` is the peak."""
    bytes_per_step: int = 0
    """What the rank's ``get_model_metadata()["bytes_per_step"]`` counts (stage 0's for a pipeline)."""
    bytes_by_stage: list[int] = field(default_factory=list)
    link_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes this rank sends per step on each link class with ring algorithms (``intra``, ``inter``)."""
    step_time: float = math.inf
    time_parts: dict[str, float] = field(default_factory=dict)
    """Seconds by part; they sum to ``step_time``. ``host``: the host's issue time the device's parts do not hide."""
    host_time: float = 0.0
    """Seconds the host takes to issue the step (:func:`_host_time`), hidden or not."""

    def row(self) -> dict[str, Any]:
        return {
            "config": self.config.describe(),
            **asdict(self.config),
            "fits": self.fits,
            "why": self.why,
            "memory": self.memory,
            "bytes_per_step": self.bytes_per_step,
            "bytes_by_stage": self.bytes_by_stage,
            "link_bytes": self.link_bytes,
            "step_time_s": self.step_time if math.isfinite(self.step_time) else None,
            "time_parts_s": self.time_parts,
            "host_time_s": self.host_time,
        }


class _Meta:
    """What assign_buckets reads of a parameter: numel, element size, dtype and device (no memory)."""

    __slots__ = ("_numel", "device", "dtype")

    def __init__(self, numel: int, dtype: torch.dtype):
        self._numel, self.dtype, self.device = numel, dtype, "meta"

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return _BYTES[self.dtype]


def _buckets(
    numels: list[int], dtype: torch.dtype, bucket_mb: float, first_mb: float = 1.0, aligned: bool = False
) -> list[int]:
    """Elements of each gradient bucket in launch order (DDP/ZeRO-1/ZeRO-2's :func:`assign_buckets`); ``aligned``:
    with DDP's padding, every gradient at a 16-byte start (:func:`~gpudist.flat.vector_align`)."""
    return list(_bucket_sizes(tuple(numels), dtype, bucket_mb, first_mb, aligned))


@functools.lru_cache(maxsize=4096)  # a plan asks for the same layouts once per checkpointing mode
def _bucket_sizes(
    numels: tuple[int, ...], dtype: torch.dtype, bucket_mb: float, first_mb: float, aligned: bool
) -> tuple[int, ...]:
    metas = [_Meta(n, dtype) for n in numels]
    groups = assign_buckets(metas, int(bucket_mb * (1 << 20)), int(first_mb * (1 << 20)))
    align = vector_align(dtype) if aligned else 1
    return tuple(FlatLayout([(numels[i],) for i in sorted(g)], align).total for g in groups)


def _ring(op: str, payload: float, n: int) -> float:
    """Bytes one rank sends for a ring collective of ``payload`` (the counter's bytes) over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return payload * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)


def _comm_time(op: str, payload: float, n: int, bw: float, lat: float, calls: int = 1) -> float:
    if n <= 1 or payload <= 0:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return _ring(op, payload, n) / bw + steps * lat * calls


def _compressed_payload(kind: str, numel: int, n: int) -> float:
    """Counted bytes of one compressed all-reduce of ``numel`` fp32 gradients (docs/strategies.md's wire formats)."""
    if kind.startswith("topk"):
        ratio = float(kind.partition(":")[2] or 0.01)
        return n * 8 * max(1, int(ratio * numel))  # all-gather of (values, indices)
    per = {"int8": 1 + 4 / 256, "1bit": 1 / 8 + 4 / 256}.get(kind, 4)
    return 2 * numel * per  # all-to-all of compressed chunks, then an all-gather of the reduced ones


@dataclass
class _Work:
    """Inputs of one prediction."""

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    optimizer: str
    chunked: bool


def predict(
    config: Config,
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    optimizer: str = "adam",
) -> Prediction:
    """Memory by category, bytes per step and step time of ``config`` on the most loaded rank (see
    :mod:`gpudist.plan`'s docstring). ``optimizer``: "adam" (K = 2 state tensors; fused in ZeRO, torch's with a
    ``step`` tensor per parameter elsewhere), "sgd" (momentum, K = 1) or "sgd-plain" (K = 0)."""
    w = _Work(
        model, cluster, global_batch, param_dtype, compute_dtype or param_dtype, optimizer, cluster.chunked_overlap
    )
    if config.strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        return _predict_data_parallel(config, w)
    return _predict_model_parallel(config, w)


def _k(optimizer: str) -> int:
    return {"adam": 2, "adamw": 2, "sgd": 1, "sgd-plain": 0}[optimizer]


def _activation_bytes(
    w: _Work, cfg: Config, samples: int, layers: int, with_logits: bool, recomputed_samples: int | None = None
) -> float:
    """Activations autograd keeps for ``samples`` sequences through ``layers`` transformer blocks, by
    ``cfg.checkpointing`` mode, divided by tp where the layers are split (no sequence parallelism).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4) count, per
    block and per ``s b h`` (tokens x hidden) at 16-bit activations: ``34 + 5 a s / h`` bytes without recomputation,
    ``34`` with selective recomputation and ``2`` (the block's input) with full recomputation. The ``5 a s / h`` term
    is the attention core's score-sized tensors (a heads x s x s per sequence: softmax output 2 bytes, dropout mask
    1, dropout output 2); selective recomputation drops exactly it and re-runs the core in backward. Here:

    - ``linear``: what a block keeps outside the attention core, the planner's own count (unchanged here) of
      ``5 + (12 + 3 ffn / h) / tp`` elements per token and hidden in the activation dtype. For a 4h MLP at 16 bits
      that is 58 bytes per s b h where Korthikanti count 34 (10 + 24 / tp): the planner's count is the more
      generous one, and neither is checked against a measurement;
    - ``core``: the attention core's scores, ``(2 x dtype bytes + 1) x heads x s`` bytes per token over tp (5 a s /
      h per s b h at 16 bits; a model without attention dropout keeps less), kept only by eager attention. A fused
      ("flash") attention keeps no scores (its backward recomputes them), so under it ``core`` is 0 and selective
      recomputation saves nothing;
    - none: ``layers x (linear + core)``; selective: ``layers x linear`` plus one block's core while it is
      recomputed; full: ``layers x`` the block input (Korthikanti's 2 s b h: one element per token and hidden) plus
      one block's ``linear + core`` while it is recomputed (of ``recomputed_samples`` sequences: one micro-batch).

    With ``with_logits``, the logits and the loss's float32 softmax (``vocab / tp x (dtype + 4)`` bytes per token).
    """
    m, a = w.model, _BYTES[w.compute_dtype]
    s, h, t = m.seq_len, max(m.hidden, 1), cfg.tp
    tokens = samples * s

    def block(n_tokens: float) -> tuple[float, float]:
        linear = n_tokens * h * a * (5 + (12 + 3 * m.ffn / h) / t)
        core = n_tokens * (2 * a + 1) * m.heads * s / t if m.attention == "eager" else 0.0
        return linear, core

    linear, core = block(tokens)
    one_linear, one_core = block((recomputed_samples if recomputed_samples is not None else samples) * s)
    if cfg.checkpointing == "full":
        kept = layers * tokens * h * a + (one_linear + one_core if layers else 0.0)
    elif cfg.checkpointing == "selective":
        kept = layers * linear + (one_core if layers else 0.0)
    else:
        kept = layers * (linear + core)
    if with_logits and m.vocab:
        kept += tokens * m.vocab / t * (a + 4)  # the logits and the loss's float32 softmax
    return kept


def _flops(w: _Work, cfg: Config, samples: float, params: float) -> tuple[float, float]:
    """Training FLOPs (all, and the forward's) for ``samples`` sequences through ``params`` parameters.

    Per token: 2 per parameter forward, 4 backward (6 in all), and the attention core's ``4 L h s`` forward (QK^T
    and scores x V, 2 s h each per layer), three times that with its backward; ``L`` scaled to the share of
    parameters (a pipeline stage's). Recomputation adds one forward of what it recomputes (Korthikanti et al. 2022,
    section 5): full recomputes the whole block (8 instead of 6 per parameter, and the core's forward again);
    selective only the core's forward, ``4 L h s`` per token: 2% of a 185M GPT's step at s = 512, 5% of a 7B
    Llama's at s = 4096.
    """
    m = w.model
    tokens = samples * m.seq_len
    core_forward = 4 * m.layers * m.hidden * m.seq_len * (params / max(m.numel, 1))
    forward = tokens * (2 * params + core_forward)
    total = tokens * (6 * params + 3 * core_forward)
    if cfg.checkpointing == "full":
        total += forward
    elif cfg.checkpointing == "selective":
        total += tokens * core_forward
    return total, forward


# Host (CPU) time to issue one step's work, calibrated on one H200 host (docs/results.md, "On a GPU", evening slot
# run 2 of 2026-11-28: gpt-d1024, the 185M GPT of 12 blocks, batch 8 x 512, bf16 autocast, world size 1, host
# milliseconds per step by phase with nothing waited for; torch 2.11.0+cu130, Intel Xeon host).
HOST_FORWARD_PER_LAYER = 5.07e-3 / 12
"""Seconds to issue one block's forward for one micro-batch: gpudist DDP's forward, 5.07 ms, over its 12 blocks (the
embedding, head and loss are not measured apart: they are charged to the blocks)."""
HOST_BACKWARD_PER_LAYER = 11.50e-3 / 12
"""One block's backward: gpudist DDP's 11.50 ms (its 148 gradient hooks, 2.4 ms of it, included) over 12 blocks."""
HOST_STEP = (0.86 + 0.02) * 1e-3
"""The optimizer step and zero_grad of gpudist DDP (0.86 and 0.02 ms; FSDP's were 0.84 and 0.13)."""
HOST_PER_UNIT = ((17.18 + 23.33 + 0.84 + 0.13) - (5.07 + 11.50 + 0.86 + 0.02)) * 1e-3 / 13
"""A ZeRO-3/FSDP unit's gathers, hooks and releases (1.85 ms per step): gpudist FSDP's host time over DDP's, 41.48
against 17.45 ms, over its 13 units (12 blocks and the root). ZeRO-3's per-module units are assumed to cost the
same (not measured)."""
HOST_PER_OP = 10.1e-6
"""One eager torch op (``x.add_(1)``: 10.1 us on the H200 host of the morning run,
benchmarks/results/gpu_h200_2026-11-28/README.md): selective recomputation re-issues the attention call per block."""
HOST_PER_CALL = 20.0e-6
"""One collective or pipeline message: gpudist's NCCL all-reduce function, 20.0 us of host per call (docs/results.md,
"Host microseconds per call", evening run 3; 12.2 us through a plan)."""


def _host_time(cfg: Config, cluster: Cluster, layers: int, passes: int, units: int = 0, calls: int = 0) -> float:
    """Seconds the host takes to issue one step: per micro-batch (``passes``) each of the rank's ``layers`` blocks
    forward and backward, and again forward for full recomputation (one op for selective; torch.utils.checkpoint's
    own Python is not measured), the optimizer step, each ZeRO-3/FSDP unit (:data:`HOST_PER_UNIT`, its collectives
    included) and each other collective call or pipeline message (:data:`HOST_PER_CALL`).

    The host issues asynchronously, ahead of the device, so a step takes the longer of the two: the predictions
    charge ``max(0, host - device)`` as ``host`` time. The anchor (gpt-d1024 under gpudist DDP on one H200, fp32
    parameters, bf16 autocast) is predicted at 17.5 ms (host 17.45 ms over the device model's 15.1 ms; 15.1 ms
    without this term); measured 18.3-26.3 ms for gpudist DDP and 21.3-25.9 ms for torch DDP over three runs
    (docs/plan.md, "Measured prediction errors"). Scaled by ``cluster.host_scale``.
    """
    recompute = {"full": HOST_FORWARD_PER_LAYER, "selective": HOST_PER_OP}.get(cfg.checkpointing, 0.0)
    per_layer = HOST_FORWARD_PER_LAYER + HOST_BACKWARD_PER_LAYER + recompute
    issue = passes * layers * per_layer + HOST_STEP + units * HOST_PER_UNIT + calls * HOST_PER_CALL
    return cluster.host_scale * issue


def _add_host(pred: Prediction, host: float) -> None:
    """``pred``'s host time, and its step time: device parts plus the host time they do not hide."""
    device = sum(v for k, v in pred.time_parts.items() if k != "overhead")
    pred.host_time = host
    pred.time_parts["host"] = max(0.0, host - device)
    pred.step_time = sum(pred.time_parts.values())


def _links(cfg: Config, cluster: Cluster) -> dict[str, tuple[str, float, float]]:
    """For each group (tensor, data, pipeline): its link class, bandwidth and latency, from the layout (tensor
    fastest, then data, then pipeline; consecutive ranks share a node)."""
    gpn = cluster.devices_per_node
    out = {}
    for group, span in (("tensor", cfg.tp), ("data", cfg.tp * cfg.dp), ("pipeline", cfg.tp * cfg.dp * cfg.pp)):
        inter = span > gpn and cluster.nodes > 1
        out[group] = (
            ("inter", cluster.inter_bandwidth, cluster.inter_latency)
            if inter
            else ("intra", cluster.intra_bandwidth, cluster.intra_latency)
        )
    return out


def _data_parallel_traffic(
    w: _Work, cfg: Config, numels: list[int], n: int
) -> tuple[int, dict[str, float], list[tuple[str, float, int]]]:
    """Counted bytes, memory extras and the collectives (op, payload, calls) of DDP/ZeRO-1/ZeRO-2 over ``n`` ranks
    for a flat list of trainable parameters (one data-parallel group's view of them)."""
    pbytes = _BYTES[w.param_dtype]
    wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
    aligned = cfg.strategy == "ddp"  # DDPModel's buckets (hybrid's DDPOptimizer and ZeRO pack theirs back to back)
    buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb, aligned)
    numel = sum(numels)
    ops: list[tuple[str, float, int]] = []
    counted = 0
    extra: dict[str, float] = {}
    if n <= 1:
        return 0, extra, ops
    stage = {"ddp": 0, "zero1": 1, "zero2": 2}.get(cfg.strategy, cfg.zero_stage)
    if cfg.compression:
        payload = sum(_compressed_payload(cfg.compression, b, n) for b in buckets)
        ops.append(("all_reduce_sync", payload / 2, len(buckets)))
        counted += int(payload)
    elif stage == 2:
        rs = sum(n * padded_shard(b, n) * wire for b in buckets)
        ops.append(("reduce_scatter", rs, len(buckets)))
        counted += rs
    else:
        ar = (sum(buckets) if aligned else numel) * wire
        ops.append(("all_reduce", ar, len(buckets)))
        counted += ar
    if stage == 1:
        shard = padded_shard(numel, n)
        gather = n * shard * pbytes
        ops.append(("all_gather", gather, 1))
        counted += gather + 8
    elif stage == 2:
        gather = numel * pbytes if w.chunked else sum(n * padded_shard(b, n) * pbytes for b in buckets)
        ops.append(("all_gather", gather, len(buckets)))
        counted += gather + 8
    return counted, extra, ops


def _predict_data_parallel(cfg: Config, w: _Work) -> Prediction:
    m, cl, n = w.model, w.cluster, cfg.dp
    numels = [p.numel for p in m.params]
    numel = sum(numels)
    pbytes = _BYTES[w.param_dtype]
    lowp = pbytes < 4
    k = _k(w.optimizer)
    mem: dict[str, float] = {"buffers": m.buffer_bytes}
    padding = 0
    units = 0  # ZeRO-3/FSDP's gathered units (host time)
    if cfg.strategy in ("ddp", "zero1", "zero2"):
        counted, _, ops = _data_parallel_traffic(w, cfg, numels, n)
        if cfg.strategy == "ddp":
            buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb, aligned=True)
            mem["parameters"] = numel * pbytes
            mem["gradients"] = sum(buckets) * pbytes  # the buckets, each gradient at a 16-byte start
            torch_state = k * numel * pbytes + (4 * m.param_tensors if w.optimizer.startswith("adam") else 0)
            mem["optimizer_state"] = torch_state
            mem["master"] = 0
            wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
            mem["communication_buffers"] = sum(buckets) * wire if wire != pbytes else 0
        else:
            buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb)
            if cfg.strategy == "zero1":
                owned = padded_shard(numel, n)
                padding = n * owned - numel
                mem["parameters"] = (numel + padding) * pbytes
                mem["gradients"] = (numel + padding) * pbytes
            else:
                owned = sum(padded_shard(b, n) for b in buckets)
                padding = owned * n - numel
                mem["parameters"] = numel * pbytes
                mem["gradients"] = owned * pbytes
                wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
                # up to three bucket-sized send buffers during backward (two reduce-scatters in flight, one filling)
                mem["transient"] = sum(sorted((n * padded_shard(b, n) * wire for b in buckets), reverse=True)[:3])
            state_bytes = 4 if lowp else pbytes
            mem["optimizer_state"] = k * owned * state_bytes
            mem["master"] = owned * 4 if lowp else 0
        if cfg.compression:
            residual = numel * 4 + (0 if cfg.compression.startswith("topk") else -(-numel // n) * 4)
            mem["communication_buffers"] = mem.get("communication_buffers", 0) + residual
    else:  # zero3 / fsdp: one flat vector per unit, padded shards
        groups: dict[str, int] = {}
        for p in m.params:
            key = p.unit if cfg.strategy == "fsdp" else p.module
            groups[key] = groups.get(key, 0) + p.numel
        if cfg.strategy == "fsdp":  # the root first, then the units in order
            order = [""] + [u for u in dict.fromkeys(p.unit for p in m.params) if u]
        else:
            order = list(dict.fromkeys(p.module for p in m.params))
        sizes = [groups.get(u, 0) for u in order if groups.get(u, 0)]
        shards = [padded_shard(s, n) for s in sizes]
        units = len(shards)
        owned = sum(shards)
        padding = owned * n - numel
        wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
        mem["parameters"] = owned * pbytes
        mem["gradients"] = owned * pbytes
        mem["optimizer_state"] = k * owned * (4 if lowp else pbytes)
        mem["master"] = owned * 4 if lowp else 0
        mem["transient"] = sum(sorted((n * s * pbytes for s in shards), reverse=True)[:2]) + max(
            [n * s * wire for s in shards] or [0]
        )
        gathered = sum(n * s for s in shards)
        counted = (2 * gathered * pbytes + gathered * wire + 8) if n > 1 else 0
        ops = [("all_gather", 2 * gathered * pbytes, 2 * len(shards)), ("reduce_scatter", gathered * wire, len(shards))]
    samples = w.global_batch / n
    mem["activations"] = _activation_bytes(w, cfg, math.ceil(samples), m.layers, True)
    mem["padding"] = padding * pbytes
    pred = Prediction(cfg, True, "", bytes_per_step=int(counted))
    pred.bytes_by_stage = [pred.bytes_per_step]
    link, bw, lat = _links(cfg, cl)["data"]
    pred.link_bytes = {"intra": 0, "inter": 0}
    comm_times = {}
    for op, payload, calls in ops:
        base = op.removesuffix("_sync")
        pred.link_bytes[link] += int(_ring(base, payload, n))
        comm_times[op] = comm_times.get(op, 0.0) + _comm_time(base, payload, n, bw, lat, calls)
    flops, forward_flops = _flops(w, cfg, samples, numel)
    compute = flops / cl.device_flops
    backward = (flops - forward_flops) / cl.device_flops
    opt_bytes = (
        mem["optimizer_state"] + mem["master"] + 3 * mem["gradients"] / max(1, n if cfg.strategy != "ddp" else 1)
    )
    optimizer_time = opt_bytes * 2 / cl.memory_bandwidth
    if cfg.strategy in ("zero3", "fsdp"):
        comm = sum(comm_times.values())
        first = comm / max(1, 2 * len(ops))
        exposed = max(0.0, comm - compute) + first
        parts = {"compute": compute, "exposed_comm": exposed, "optimizer": optimizer_time}
    else:
        grad_comm = comm_times.get("all_reduce", 0.0) + comm_times.get("reduce_scatter", 0.0)
        nbuckets = max(1, len(_buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb)))
        hidden = max(0.0, grad_comm - grad_comm / nbuckets - backward)  # the last bucket is never hidden
        exposed = hidden + grad_comm / nbuckets + comm_times.get("all_reduce_sync", 0.0)
        exposed += comm_times.get("all_gather", 0.0)
        if cfg.compression:
            exposed += numel * 4 * 3 / cl.memory_bandwidth  # compress, decompress, error feedback passes
        parts = {"compute": compute, "exposed_comm": exposed, "optimizer": optimizer_time}
    parts["overhead"] = cl.step_overhead
    pred.time_parts = parts
    calls = 0 if units else sum(c for _, _, c in ops)  # a unit's cost holds its gathers and reduce-scatter
    _add_host(pred, _host_time(cfg, cl, m.layers, 1, units, calls))
    pred.memory = _finish_memory(mem)
    return pred


def _finish_memory(mem: dict[str, float]) -> dict[str, int]:
    out = {k: int(v) for k, v in mem.items()}
    state = ("parameters", "gradients", "optimizer_state", "master", "buffers", "communication_buffers")
    out["model_states"] = sum(out.get(k, 0) for k in state)
    out["total"] = out["model_states"] + sum(out.get(k, 0) for k in ("activations", "transient", "flat_padding"))
    return out


def _chunks_of(schedule: str, pp: int) -> int:
    """Chunks per rank the pipeline runs ``schedule`` with (interleaved: its default 2; the V: 2)."""
    return check_schedule(schedule, pp, 2 * pp, None)


def _stage_blocks(m: ModelSpec, pp: int, schedule: str = "1f1b") -> list[list[tuple[int, int]]]:
    """Per rank, the ``[first, end)`` blocks of each of its chunks (virtual stages placed as the schedule does)."""
    return _chunk_bounds(tuple(m.block_costs), pp, schedule)


@functools.lru_cache(maxsize=1024)
def _chunk_bounds(costs: tuple[int, ...], pp: int, schedule: str) -> list[list[tuple[int, int]]]:
    v = _chunks_of(schedule, pp)
    counts = partition_blocks(list(costs), pp * v)
    bounds = [(sum(counts[:u]), sum(counts[: u + 1])) for u in range(pp * v)]
    return [[bounds[virtual_stage(placement(schedule), pp, s, c)] for c in range(v)] for s in range(pp)]


def _stage_params(m: ModelSpec, pp: int, schedule: str = "1f1b") -> list[list[ParamSpec]]:
    """Each stage's parameters (a tied parameter on every stage that uses it), as the pipeline splits them."""
    return _split_params(tuple(m.params), tuple(m.block_costs), pp, schedule)


@functools.lru_cache(maxsize=1024)
def _split_params(
    params: tuple[ParamSpec, ...], costs: tuple[int, ...], pp: int, schedule: str
) -> list[list[ParamSpec]]:
    return [
        [p for p in params if any(lo <= b < hi for lo, hi in chunks for b in (p.block, *p.tied_blocks))]
        for chunks in _chunk_bounds(costs, pp, schedule)
    ]


@functools.cache
def _orders(schedule: str, pp: int, micro: int) -> tuple[list[list[tuple]], float, list[tuple[int, int, int]]]:
    """Every rank's op order, its bubble at equal F, B and W (forward 1, backward 2: ``schedule_bubble``), and each
    rank's messages (:func:`_messages`)."""
    v = _chunks_of(schedule, pp)
    orders = [stage_schedule(schedule, pp, s, micro, v) for s in range(pp)]
    where = placement(schedule)
    return orders, schedule_bubble(orders, 1.0, 2.0, 1.0, where), _messages(orders, where)


@functools.lru_cache(maxsize=4096)
def _alive(schedule: str, pp: int, micro: int, stage: int, layers: tuple[int, ...]) -> tuple[int, list[int]]:
    """``activations_alive`` of ``stage``'s op order (:func:`_orders`)."""
    return activations_alive(_orders(schedule, pp, micro)[0][stage], list(layers))


def _tp_numel(params: list[ParamSpec], tp: int) -> list[int]:
    return [p.numel // tp if p.split else p.numel for p in params]


def _messages(orders: list[list[tuple]], where: str) -> list[tuple[int, int, int]]:
    """Per rank, the pipeline messages it sends or receives in a step: spec messages (one per chunk and peer),
    activation and gradient tensors (one hidden-state tensor each), and the loss's hops (:func:`loss_path`)."""
    p = len(orders)
    v = 1 + max((op[2] for order in orders for op in order if len(op) == 3), default=0)
    count = [[0, 0, 0] for _ in range(p)]
    for q, order in enumerate(orders):
        for op in order:
            u = virtual_stage(where, p, q, op[2] if len(op) == 3 else 0)
            if op[0] == "W" or (op[0] == "F" and u == p * v - 1) or (op[0] == "B" and u == 0):
                continue
            to = holder(where, p, u + 1 if op[0] == "F" else u - 1)[0]
            if to != q:
                for r in (q, to):
                    count[r][0] += op[0] == "F" and op[1] == 0
                    count[r][1] += 1
    source = holder(where, p, p * v - 1)[0]
    for r in range(p):
        count[r][2] += (r != source) + (0 <= r + (1 if source == 0 else -1) < p)
    return [tuple(c) for c in count]


def _predict_model_parallel(cfg: Config, w: _Work) -> Prediction:
    """Pipeline, tensor and hybrid: per stage (stage 0 is reported: it holds the most activations under 1F1B)."""
    m, cl = w.model, w.cluster
    pp, tp, dp = cfg.pp, cfg.tp, cfg.dp
    pbytes = _BYTES[w.param_dtype]
    abytes = _BYTES[w.compute_dtype]
    lowp = pbytes < 4
    k = _k(w.optimizer)
    stages = _stage_params(m, pp, cfg.schedule) if pp > 1 else [list(m.params)]
    links = _links(cfg, cl)
    per_replica = w.global_batch // dp
    micro = max(1, cfg.micro_batches)
    mb = per_replica // micro if pp > 1 else per_replica
    tokens_mb = mb * m.seq_len
    counts = partition_blocks(m.block_costs, pp) if pp > 1 else [len(m.block_costs)]  # tensor bytes: one chunk each
    chunk_blocks = _stage_blocks(m, pp, cfg.schedule) if pp > 1 else [[(0, len(m.block_costs))]]
    v = len(chunk_blocks[0])
    where = placement(cfg.schedule)
    if pp > 1:
        _, bubble_fraction, messages = _orders(cfg.schedule, pp, micro)
    last_rank = holder(where, pp, pp * v - 1)[0] if pp > 1 else 0
    preds: list[Prediction] = []
    for s, params in enumerate(stages):
        numels = _tp_numel(params, tp)
        numel = sum(numels)
        mem: dict[str, float] = {"buffers": m.buffer_bytes / pp}
        padding = 0
        if cfg.zero_stage == 0:
            mem["parameters"] = numel * pbytes
            mem["gradients"] = numel * pbytes
            mem["optimizer_state"] = k * numel * pbytes + (4 * len(params) if w.optimizer.startswith("adam") else 0)
            mem["master"] = 0
        else:
            buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb)
            if cfg.zero_stage == 1:
                owned = padded_shard(numel, dp)
                padding = dp * owned - numel
                mem["parameters"] = numel * pbytes  # the module's parameters: the flat buffer's padding apart
                mem["gradients"] = numel * pbytes
                mem["flat_padding"] = padding * pbytes
            else:
                owned = sum(padded_shard(b, dp) for b in buckets)
                padding = dp * owned - numel
                mem["parameters"] = numel * pbytes
                mem["gradients"] = numel * pbytes + owned * pbytes
            mem["optimizer_state"] = k * owned * (4 if lowp else pbytes)
            mem["master"] = owned * 4 if lowp else 0
        mem["padding"] = padding * pbytes
        # activations: per chunk, its layers times the micro-batches the schedule keeps alive there (from F to W, or
        # to a whole B: 1F1B min(pp - s, m), GPipe all m), at the rank's peak
        layers = [sum(1 for b in range(lo, hi) if b in m.layer_blocks) for lo, hi in chunk_blocks[s]]
        if pp == 1:
            mem["activations"] = _activation_bytes(w, cfg, mb, m.layers, True)
        else:
            peak, alive = _alive(cfg.schedule, pp, micro, s, tuple(layers))
            head = alive[holder(where, pp, pp * v - 1)[1]] if s == last_rank else 0
            if cfg.schedule in ("1f1b", "gpipe"):  # one chunk: its in-flight micro-batches, one block recomputed
                mem["activations"] = _activation_bytes(w, cfg, mb * alive[0], layers[0], s == last_rank, mb)
            else:
                mem["activations"] = _activation_bytes(w, cfg, mb, peak, False) + (
                    _activation_bytes(w, cfg, mb * head, 0, True) if head else 0
                )
        layers_here = sum(layers)
        # -- counted bytes (the rank's own counters: sends and receives, the tensor group's, the data group's)
        counted = 0
        ops: list[tuple[str, str, float, int]] = []  # (group, op, payload, calls)
        if pp > 1:
            act = tokens_mb * m.hidden * abytes
            specs, tensors, hops = messages[s]  # spec messages, activations and gradients, loss hops in or out
            counted += specs * 128 * 8 + tensors * act + hops * 8
            ops.append(("pipeline", "p2p", tensors * act / 2, 2 * micro * v))
            rank_of = {b: r for r, chunks in enumerate(chunk_blocks) for lo, hi in chunks for b in range(lo, hi)}
            tied = [p for p in params if len({rank_of[b] for b in (p.block, *p.tied_blocks)}) > 1]
            if tied:
                tied_numel = sum(_tp_numel(tied, tp))
                counted += tied_numel * pbytes
                ops.append(("pipeline", "all_reduce", tied_numel * pbytes, 1))
            if s == last_rank and dp > 1:
                counted += 8
        if tp > 1:
            tp_bytes = _tensor_parallel_bytes(m, tokens_mb, abytes, tp, s, len(stages), counts)
            counted += tp_bytes * micro if pp > 1 else tp_bytes
            ops.append(("tensor", "all_reduce", tp_bytes * (micro if pp > 1 else 1), 4 * max(1, layers_here) * micro))
        if dp > 1:
            if cfg.zero_stage == 0:
                counted += numel * pbytes
                ops.append(("data", "all_reduce", numel * pbytes, 1))
            else:
                inner = replace(cfg, strategy={1: "zero1", 2: "zero2"}[cfg.zero_stage], comm_dtype=None)
                c, _, dops = _data_parallel_traffic(w, inner, numels, dp)
                if cfg.zero_stage == 1:  # the inner optimizer reduce-scatters the padded flat buffer itself
                    c = 2 * dp * padded_shard(numel, dp) * pbytes + 8
                counted += c
                ops += [("data", op, payload, calls) for op, payload, calls in dops]
        pred = Prediction(cfg, True, "", bytes_per_step=int(counted))
        pred.memory = _finish_memory(mem)
        pred.link_bytes = {"intra": 0, "inter": 0}
        comm_time: dict[str, float] = {}
        for group, op, payload, calls in ops:
            link, bw, lat = links[group]
            size = {"pipeline": pp, "tensor": tp, "data": dp}[group]
            if op == "p2p":
                pred.link_bytes[link] += int(payload / 2)
                comm_time[group] = comm_time.get(group, 0.0) + payload / 2 / bw + calls * lat
            else:
                pred.link_bytes[link] += int(_ring(op, payload, size))
                comm_time[group] = comm_time.get(group, 0.0) + _comm_time(op, payload, size, bw, lat, calls)
        stage_params = sum(p.numel for p in params) / tp
        compute = _flops(w, cfg, per_replica, stage_params)[0] / cl.device_flops
        # the schedule's idle share at equal F, B, W (1F1B, GPipe: (p - 1) / (m + p - 1), so (p - 1) / m of compute)
        bubble = compute * bubble_fraction / (1 - bubble_fraction) if pp > 1 else 0.0
        optimizer_time = (mem["optimizer_state"] + mem["master"] + 3 * numel * pbytes) * 2 / cl.memory_bandwidth
        pred.time_parts = {
            "compute": compute,
            "bubble": bubble,
            "exposed_comm": sum(comm_time.values()),
            "optimizer": optimizer_time,
            "overhead": cl.step_overhead,
        }
        calls = sum(c for _, _, _, c in ops)
        _add_host(pred, _host_time(cfg, cl, layers_here, micro if pp > 1 else 1, calls=calls))
        preds.append(pred)
    first = preds[0]
    first.bytes_by_stage = [p.bytes_per_step for p in preds]
    first.step_time = max(p.step_time for p in preds)
    worst = max(preds, key=lambda p: p.memory["total"])
    first.memory = worst.memory if worst.memory["total"] > first.memory["total"] else first.memory
    return first


def _tensor_parallel_bytes(
    m: ModelSpec, tokens: int, abytes: int, tp: int, stage: int, stages: int, counts: list[int]
) -> int:
    """Counted bytes of one micro-batch's tensor-parallel all-reduces on ``stage``: a column-parallel layer
    all-reduces its input's gradient (backward), a row-parallel layer its output (forward), the vocabulary
    embedding its output, the vocabulary-parallel loss two values per token (max; sum and target logit)."""
    per_block = 0
    for layer in m.tp_layers:
        if layer.style in ("colwise", "colwise_qkv"):
            per_block += tokens * layer.in_features * abytes
        elif layer.style == "rowwise":
            per_block += tokens * layer.out_features * abytes
    per_layer = per_block / max(m.layers, 1)  # tp_layers lists every block's layers
    # blocks of this stage that are transformer layers
    if stages > 1:
        lo = sum(counts[:stage])
        hi = lo + counts[stage]
        layers_here = sum(1 for b in range(lo, hi) if b in m.layer_blocks)
    else:
        layers_here = m.layers
    total = round(per_layer * layers_here)
    styles = {layer.style for layer in m.tp_layers}
    if stage == 0 and "vocab" in styles:
        total += tokens * m.hidden * abytes
    if stage == stages - 1 and "vocab_output" in styles:
        total += tokens * m.hidden * abytes + tokens * 3 * 4
    return int(total)
