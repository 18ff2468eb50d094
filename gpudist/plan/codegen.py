"""A configuration as the library's wrappers: the Python a training script runs to build them
(:meth:`~gpudist.plan.PlanResult.code`), and :func:`build`, which builds the same wrappers here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .model import _DTYPES, Config


def _code_for(c: Config, settings: dict[str, Any]) -> str:
    opt = "torch.optim.AdamW(model.parameters(), lr=3e-4)"
    wire = (
        f", communication_dtype=torch.{_DTYPES[c.comm_dtype]}".replace("torch.torch.", "torch.") if c.comm_dtype else ""
    )
    lines = [
        "import torch, gpudist",
        "comm = gpudist.init()",
        f"config = gpudist.ShardingConfiguration(comm, bucket_cap_mb={c.bucket_mb:g}{wire})",
        *_checkpointing_lines(c.checkpointing),
    ]
    simple = {
        "ddp": ("DDPModel", "DDPOptimizer"),
        "zero1": ("ZeRO1Model", "ZeRO1Optimizer"),
        "zero2": ("ZeRO2Model", "ZeRO2Optimizer"),
        "zero3": ("ZeRO3Model", "ZeRO3Optimizer"),
        "fsdp": ("FSDPModel", "ZeRO3Optimizer"),
    }
    if c.strategy in simple:
        model_cls, opt_cls = simple[c.strategy]
        lines.append(f"model = gpudist.{model_cls}(net, config)")
        if c.compression:
            lines.append(f'opt = gpudist.GradientCompressionOptimizer({opt}, config, "{c.compression}")')
        else:
            lines.append(f"opt = gpudist.{opt_cls}({opt}, config)")
        lines.append("# loop: loss.backward(); opt.step(); opt.zero_grad()")
    elif c.strategy == "tensor":
        lines.append(f'model = gpudist.TensorParallelModel(net, config, plan="auto", tensor_parallel_size={c.tp})')
        lines.append(f"opt = {opt}")
    elif c.strategy == "pipeline":
        lines.append(
            f"model = gpudist.PipelineParallelModel(net, config, num_stages={c.pp}, "
            f'micro_batches={c.micro_batches}, schedule="{c.schedule}")'
        )
        lines.append(f"opt = {opt}")
        lines.append("# loop: model.train_step(x, y, loss_fn, opt)")
    else:
        lines.append(
            f"model = gpudist.HybridShardedModel(net, config, pipeline_parallel_size={c.pp}, "
            f'tensor_parallel_size={c.tp}, plan="auto", micro_batches={c.micro_batches}, schedule="{c.schedule}")'
        )
        lines.append(f"opt = gpudist.HybridShardedOptimizer({opt}, config, {c.pp}, {c.tp}, zero_stage={c.zero_stage})")
        lines.append("# loop: model.train_step(x, y, optimizer=opt)")
    return "\n".join(lines)


def _checkpointing_lines(mode: str) -> list[str]:
    """How to enable ``mode`` of activation checkpointing, as comments: gpudist's wrappers have no option for it;
    torch's checkpoint goes on each transformer block of ``net`` before the wrapper (torchtitan's order: tensor
    parallelism, then checkpointing, then data parallelism). FSDPModel and ZeRO3Model gather a unit again for its
    recomputation."""
    if mode == "none":
        return []
    each_block = "# for block in net.layers:  # each transformer block\n"
    if mode == "full":
        return [
            "# activation checkpointing, full (gpudist has no option for it; torch's, on net before wrapping it):",
            "# import functools; from torch.utils.checkpoint import checkpoint",
            each_block + "#     block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)",
            '# (a Hugging Face model: net.gradient_checkpointing_enable({"use_reentrant": False}))',
        ]
    return [
        "# activation checkpointing, selective (gpudist has no option for it; torch's selective checkpoint, on net",
        "# before wrapping it: the linear layers' outputs are kept, the rest, attention scores included, recomputed):",
        "# import functools; from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts",
        "# keep = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]",
        "# context = functools.partial(create_selective_checkpoint_contexts, keep)",
        each_block
        + "#     block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, context_fn=context)",
    ]


def build(
    config: Config,
    module: nn.Module,
    comm,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    tp_plan: Any = "auto",
    **sharding: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer wrappers of ``config`` around ``module`` on ``comm`` (collective: every rank).
    ``config.checkpointing`` is not applied (gpudist has no option for it): :meth:`PlanResult.code`'s comment says
    how.

    Args:
        config: A :class:`Config` (``plan(...).best.config``).
        module: The model to wrap.
        comm: The backend (``gpudist.init()``).
        optimizer: Makes the torch optimizer from parameters, e.g. ``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``.
        blocks, tp_plan: The pipeline's blocks and the tensor-parallel plan (as the wrappers take them).
        **sharding: More :class:`~gpudist.ShardingConfiguration` settings.
    """
    from .. import strategies as gpudist  # the wrappers, as the facade exports them (not the facade: it imports us)
    from ..config import ShardingConfiguration

    settings = dict(bucket_cap_mb=config.bucket_mb, first_bucket_mb=config.first_bucket_mb, **sharding)
    if config.comm_dtype:
        settings["communication_dtype"] = _DTYPES[config.comm_dtype]
    sc = ShardingConfiguration(comm, **settings)
    simple = {
        "ddp": (gpudist.DDPModel, gpudist.DDPOptimizer),
        "zero1": (gpudist.ZeRO1Model, gpudist.ZeRO1Optimizer),
        "zero2": (gpudist.ZeRO2Model, gpudist.ZeRO2Optimizer),
        "zero3": (gpudist.ZeRO3Model, gpudist.ZeRO3Optimizer),
        "fsdp": (gpudist.FSDPModel, gpudist.ZeRO3Optimizer),
    }
    if config.strategy in simple:
        model_cls, opt_cls = simple[config.strategy]
        model = model_cls(module, sc)
        if config.compression:
            return model, gpudist.GradientCompressionOptimizer(optimizer(model.parameters()), sc, config.compression)
        return model, opt_cls(optimizer(model.parameters()), sc)
    if config.strategy == "tensor":
        model = gpudist.TensorParallelModel(module, sc, tp_plan, tensor_parallel_size=config.tp)
        return model, optimizer(model.parameters())
    if config.strategy == "pipeline" and config.zero_stage == 0:
        model = gpudist.PipelineParallelModel(
            module,
            sc,
            num_stages=config.pp,
            micro_batches=config.micro_batches,
            schedule=config.schedule,
            blocks=blocks,
        )
        return model, optimizer(model.parameters())
    model = gpudist.HybridShardedModel(
        module,
        sc,
        pipeline_parallel_size=config.pp,
        tensor_parallel_size=config.tp,
        plan=tp_plan if config.tp > 1 else None,
        blocks=blocks,
        micro_batches=config.micro_batches,
        schedule=config.schedule,
    )
    opt = gpudist.HybridShardedOptimizer(
        optimizer(model.parameters()), sc, config.pp, config.tp, zero_stage=config.zero_stage
    )
    return model, opt
