"""Enumerating and ranking configurations: :func:`enumerate_configs` lists every way to run a model on ``world`` ranks,
each with the constructors' reason it cannot run; :func:`plan` predicts every one and ranks them into a
:class:`~gpudist.plan.PlanResult`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..strategies.layout import ParallelLayout
from ..strategies.pipeline.schedule import ALL_SCHEDULES, check_schedule, partition_blocks
from .calibrate import measure_cluster
from .cost import Prediction, predict
from .model import _DTYPES, CHECKPOINTING_MODES, PRESETS, Cluster, Config, ModelSpec, _dtype_name, _parse_bytes
from .report import PlanResult


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def checkpointing_modes(checkpointing: str | bool) -> tuple[str, ...]:
    """The activation checkpointing modes to try: "auto" all of :data:`CHECKPOINTING_MODES`, a mode only itself;
    ``True``/``False`` (the planner's former flag) mean "full"/"none"."""
    if isinstance(checkpointing, bool):
        return ("full",) if checkpointing else ("none",)
    if checkpointing == "auto":
        return CHECKPOINTING_MODES
    if checkpointing in CHECKPOINTING_MODES:
        return (checkpointing,)
    raise ValueError(f"checkpointing={checkpointing!r}; use auto or one of {', '.join(CHECKPOINTING_MODES)}")


def enumerate_configs(
    model: ModelSpec,
    world: int,
    global_batch: int,
    *,
    devices_per_node: int | None = None,
    checkpointing: str | bool = "auto",
    comm_dtypes: Sequence[str | None] = (None, "bf16"),
    compressions: Sequence[str | None] = (None, "int8"),
    bucket_mbs: Sequence[float] = (25.0,),
    micro_batch_factors: Sequence[int] = (1, 2, 4, 8),
) -> list[tuple[Config, str | None]]:
    """Every configuration for ``world`` ranks, each with the reason it cannot run (None when it can): every layout
    (strategy, dp x tp x pp, micro-batches, schedule, ZeRO stage, wire dtype, compression) once per activation
    checkpointing mode of ``checkpointing`` (:func:`checkpointing_modes`)."""
    modes = checkpointing_modes(checkpointing)
    out: list[tuple[Config, str | None]] = []
    gpn = devices_per_node or world
    for tp in _divisors(world):
        if tp > 1 and (tp > gpn or tp & (tp - 1)):
            continue  # tensor groups stay inside a node, in powers of two
        why_tp = None
        if tp > 1:
            if model.tp_check is None:
                why_tp = "no tensor-parallel plan for this model"
            else:
                try:
                    model.tp_check(tp)
                except (ValueError, TypeError) as e:
                    why_tp = str(e)
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            ParallelLayout.resolve(world, pp, tp, dp)  # the constructors' check of the factors
            why = why_tp
            if why is None and pp > 1:
                try:
                    partition_blocks(model.block_costs, pp)
                except ValueError as e:
                    why = str(e)
            if why is None and global_batch % dp:
                why = f"global batch {global_batch} does not split over dp={dp} replicas"
            base = dict(dp=dp, tp=tp, pp=pp)
            if tp == 1 and pp == 1:
                for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
                    for bucket in bucket_mbs:
                        for wire in comm_dtypes:
                            out.append((Config(strategy, bucket_mb=bucket, comm_dtype=wire, **base), why))
                        if strategy in ("ddp", "zero1", "zero2"):
                            for comp in compressions:
                                if comp is not None:
                                    out.append((Config(strategy, bucket_mb=bucket, compression=comp, **base), why))
                continue
            if pp == 1:
                out.append((Config("tensor", **base), why))
                continue
            per_replica = global_batch // dp if not global_batch % dp else 0
            strategy = "pipeline" if tp == 1 else "hybrid"
            stages = (0, 1, 2) if dp > 1 else (0,)
            for factor in micro_batch_factors:
                m = pp * factor
                why_m = why
                if why_m is None and (per_replica < m or per_replica % m):
                    why_m = f"batch per replica {per_replica} is not a multiple of micro_batches={m}"
                for schedule in ALL_SCHEDULES:
                    why_s = why_m
                    if why_s is None:
                        try:  # the constructors' checks: interleaved m a multiple of pp, dualpipev m >= 2 pp, blocks
                            v = check_schedule(schedule, pp, m, None)
                            partition_blocks(model.block_costs, pp * v)
                        except ValueError as e:
                            why_s = str(e)
                    for zs in stages:
                        cfg = Config(strategy, micro_batches=m, schedule=schedule, zero_stage=zs, **base)
                        out.append((cfg, why_s))
    return [(replace(cfg, checkpointing=mode), why) for cfg, why in out for mode in modes]


def _why(p: Prediction, budget: float) -> str:
    parts = p.time_parts
    total = p.step_time
    if not total or not math.isfinite(total):
        return ""
    main = max(parts, key=parts.get)
    share = parts[main] / total
    text = f"{main} {share:.0%}"
    if p.config.pp > 1:
        text += f", bubble {parts.get('bubble', 0) / total:.0%}"
    return text + f"; {p.memory['total'] / budget:.0%} of memory"


def _resolve_model(model: Any, seq_len: int | None, blocks, tp_plan) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return ModelSpec.preset(model, seq_len)
    if isinstance(model, dict):
        return ModelSpec.from_sizes(**({"seq_len": seq_len} if seq_len else {}), **model)
    if isinstance(model, nn.Module):
        return ModelSpec.from_module(model, seq_len=seq_len, blocks=blocks, tp_plan=tp_plan)
    if hasattr(model, "num_hidden_layers") or hasattr(model, "n_layer"):
        return ModelSpec.from_hf_config(model, seq_len=seq_len)
    raise TypeError(
        f"gpudist.plan: model must be an nn.Module, a Hugging Face config, a dict of sizes or a preset name "
        f"({', '.join(PRESETS)}), got {type(model).__name__}"
    )


def plan(
    model: Any,
    *,
    global_batch: int,
    nodes: int = 1,
    devices_per_node: int = 8,
    device_memory: float | str = "80GB",
    cluster: Cluster | None = None,
    dtype: str = "bf16",
    mixed_precision: bool = True,
    optimizer: str = "adam",
    checkpointing: str | bool = "auto",
    seq_len: int | None = None,
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    tp_plan: Any = None,
    measure: bool = False,
    comm_dtypes: Sequence[str | None] = (None, "bf16"),
    compressions: Sequence[str | None] = (None, "int8"),
    bucket_mbs: Sequence[float] = (25.0,),
    strategies: Sequence[str] | None = None,
) -> PlanResult:
    """Predict memory, traffic and step time of every way to train ``model`` on the cluster, ranked.

    Args:
        model: An ``nn.Module`` (exact parameter layout), a Hugging Face config, a dict of sizes for
            :meth:`ModelSpec.from_sizes` (layers, hidden, heads, kv_heads, ffn, vocab, seq_len), a preset name
            (:data:`PRESETS`) or a :class:`ModelSpec`.
        global_batch: Sequences per step over all ranks.
        nodes, devices_per_node, device_memory: The cluster (``"80GB"`` or bytes); ``cluster`` overrides them
            with every link parameter.
        dtype: The parameters' dtype, "fp32" or "bf16" (ZeRO keeps an fp32 master of the owned range for bf16).
        mixed_precision: Activations and matmuls in bf16 (else in ``dtype``).
        optimizer: "adam"/"adamw" (K = 2), "sgd" (momentum, K = 1) or "sgd-plain".
        checkpointing: Activation checkpointing, searched like the layout: "auto" tries "none", "selective" and
            "full" for every layout and ranks the fitting ones by step time; a mode forces it (``True``: "full").
            The memory and time of each: :func:`gpudist.plan.cost._activation_bytes`, ``_flops``, ``_host_time``.
        seq_len, blocks, tp_plan: For an ``nn.Module``: see :meth:`ModelSpec.from_module`.
        measure: Calibrate the cluster on this machine (:func:`measure_cluster`) instead of the given numbers.
        comm_dtypes, compressions, bucket_mbs: The wire dtypes, gradient compressions and bucket sizes tried.
        strategies: Only these strategies (default: all).

    Returns:
        A :class:`PlanResult`: ``.table()``, ``.best``, ``.code()``, ``.command()``, ``.to_json()``.
    """
    spec = _resolve_model(model, seq_len, blocks, tp_plan)
    if cluster is None:
        cluster = Cluster(nodes=nodes, devices_per_node=devices_per_node, device_memory=_parse_bytes(device_memory))
    if measure:
        cluster = measure_cluster(cluster)
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r}; use fp32, bf16 or fp16")
    param_dtype = _DTYPES[dtype]
    compute_dtype = torch.bfloat16 if mixed_precision and dtype == "fp32" else param_dtype
    if optimizer not in ("adam", "adamw", "sgd", "sgd-plain"):
        raise ValueError(f"optimizer={optimizer!r}; use adam, adamw, sgd (momentum) or sgd-plain")
    wires = [w for w in comm_dtypes if w is None or _DTYPES[w] != param_dtype]
    modes = checkpointing_modes(checkpointing)
    budget = cluster.device_memory * cluster.usable_memory
    preds = []
    configs = enumerate_configs(
        spec,
        cluster.world_size,
        global_batch,
        devices_per_node=cluster.devices_per_node,
        checkpointing=checkpointing,
        comm_dtypes=wires,
        compressions=compressions if param_dtype == torch.float32 else (None,),
        bucket_mbs=bucket_mbs,
    )
    for cfg, why in configs:
        if strategies is not None and cfg.strategy not in strategies:
            continue
        if why is not None:
            preds.append(Prediction(cfg, False, why))
            continue
        p = predict(
            cfg, spec, cluster, global_batch, param_dtype=param_dtype, compute_dtype=compute_dtype, optimizer=optimizer
        )
        if p.memory["total"] > budget:
            p.fits = False
            p.why = (
                f"needs {p.memory['total'] / 2**30:.1f} GiB per rank, over the {budget / 2**30:.1f} GiB budget "
                f"({cluster.usable_memory:.0%} of {cluster.device_memory / 1e9:.0f} GB)"
            )
        else:
            p.why = _why(p, budget)
        preds.append(p)
    recompute = CHECKPOINTING_MODES.index  # on a tie (a step bound by communication), the least recomputation
    preds.sort(
        key=lambda p: (not p.fits, p.step_time, p.memory.get("total", math.inf), recompute(p.config.checkpointing))
    )
    settings = {
        "dtype": dtype,
        "compute_dtype": _dtype_name(compute_dtype),
        "optimizer": optimizer,
        "checkpointing": "auto" if len(modes) > 1 else modes[0],
        "measured": measure,
    }
    return PlanResult(spec, cluster, global_batch, preds, settings)
