"""HybridShardedModel: 3D parallelism, pipeline x data x tensor (seeds: HybridShardedModel).

Composed one step at a time, in torchtitan's order: the ranks are laid out as ``pp x dp x tp``
(:class:`~.layout.ParallelLayout`, tensor fastest); the module's planned layers are split over the tensor group
(:mod:`.tensor`); the module's blocks are split into pipeline stages (:mod:`.pipeline`); data-parallel replicas
average gradients last, in the data group (the model itself, or a :class:`~gpudist.HybridShardedOptimizer` with
ZeRO-1/ZeRO-2 in that group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from ..config import ShardingConfiguration
from .base import ShardedModel, module_table
from .layout import ParallelLayout, make_groups
from .pipeline import SCHEDULES, PipelineParallelModel
from .tensor import Plan, VocabParallelOutput, apply_plan, validate_plan

__all__ = ["HybridShardedModel"]


class HybridShardedModel(VocabParallelOutput, PipelineParallelModel):
    """3D parallelism: ``pipeline_parallel_size`` stages x ``data_parallel_size`` replicas (-1: the ranks left
    over) x ``tensor_parallel_size``-way split layers.

    ``plan`` (needed when ``tensor_parallel_size > 1``) names the layers to split, as for
    :class:`~gpudist.TensorParallelModel` (e.g. ``gpudist.models.tensor.tinylm_plan``). ``blocks`` turns the
    (converted) module into the ``nn.Sequential`` the pipeline splits (e.g. ``examples/lm.py``'s ``as_sequential``);
    without it the module must be an ``nn.Sequential``, or ``pipeline_parallel_size`` 1.

    Train with :meth:`train_step` on every rank; each replica passes its own slice of the batch, the ranks of one
    replica the same slice. ``loss_fn=None`` uses the vocabulary-parallel cross-entropy when the plan has a
    ``vocab_output`` layer (full logits are never gathered). Gradients are made whole in order: tensor-parallel
    collectives inside backward, accumulation over micro-batches, shared parameters summed between stages, then
    the average over replicas. Memory per rank: the stage's parameters split by the tensor group (optimizer state
    further split over replicas with ZeRO), plus the 1F1B activations in flight. Communication: activation
    all-reduces in the tensor group per layer, activations and their gradients between stages per micro-batch, one
    gradient all-reduce (or ZeRO reduce-scatter + all-gather) per step in the data group.
    """

    strategy = "hybrid"

    def __init__(
        self,
        module: nn.Module,
        config: ShardingConfiguration,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = -1,
        *,
        plan: Plan | None = None,
        blocks: Callable[[nn.Module], nn.Sequential | Sequence[nn.Module]] | None = None,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        balance: str | Sequence[int] = "parameters",
    ):
        if not isinstance(config, ShardingConfiguration):
            raise TypeError(f"config must be a gpudist.ShardingConfiguration, got {type(config).__name__}")
        layout = ParallelLayout.resolve(
            config.backend.world_size, pipeline_parallel_size, tensor_parallel_size, data_parallel_size
        )
        if tensor_parallel_size > 1 and plan is None:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs a plan naming the layers to split, "
                "e.g. plan=gpudist.models.tensor.tinylm_plan or {'mlp.fc1': 'colwise', 'mlp.fc2': "
                "'rowwise'}"
            )
        if blocks is None and pipeline_parallel_size > 1 and not isinstance(module, (nn.Sequential, list, tuple)):
            raise TypeError(
                f"pipeline_parallel_size={pipeline_parallel_size} splits an nn.Sequential; "
                f"{type(module).__name__} is not one: pass blocks=, a function returning the module's "
                "blocks in order (e.g. examples/lm.py's as_sequential)"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; use one of {SCHEDULES}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
        if isinstance(module, (list, tuple)):
            module = nn.Sequential(*module)
        self._setup = {"layout": layout, "balance": balance, "plan": plan, "blocks": blocks}
        self.micro_batches, self.schedule = micro_batches, schedule
        ShardedModel.__init__(self, module, config)

    def _prepare(self, module: nn.Module) -> tuple[nn.Sequential, list[dict]]:
        """Split the planned layers over the tensor group (in place), then return the blocks to pipeline."""
        table = module_table(module)  # the full shapes, before splitting
        plan, tp = self._setup["plan"], self.layout.tensor_parallel_size
        entries = validate_plan(module, plan(module) if callable(plan) else plan, tp) if plan is not None else []
        self.tensor_group = make_groups(self.comm, self.layout.groups("tensor"))
        self._splits, output = apply_plan(module, entries, self.tensor_group) if entries else ({}, None)
        self.vocab_start = None if output is None else module.get_submodule(output).output_start
        blocks = self._setup["blocks"]
        seq = blocks(module) if blocks is not None else module
        if isinstance(seq, (list, tuple, nn.ModuleList)):
            seq = nn.Sequential(*seq)
        if not isinstance(seq, nn.Sequential):
            seq = nn.Sequential(module)  # one block: pipeline_parallel_size is 1 (checked in __init__)
        return seq, table
