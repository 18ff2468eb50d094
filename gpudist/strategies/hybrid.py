"""HybridShardedModel: 3D parallelism, pipeline x data x tensor (seeds: HybridShardedModel).

Composed one step at a time, in torchtitan's order: the ranks are laid out as ``pp x dp x tp``
(:class:`~.layout.ParallelLayout`, tensor fastest); the module's planned layers are split over the tensor group
(:mod:`.tensor`); the module's blocks are split into pipeline stages (:mod:`.pipeline`); data-parallel replicas
average gradients last, in the data group (the model itself, or a :class:`~gpudist.HybridShardedOptimizer` with
ZeRO-1/ZeRO-2 in that group).

:class:`HybridShardedOptimizer` is the optimizer side: it steps this rank's part of the model with a data-parallel
optimizer (replicated, ZeRO-1 or ZeRO-2) over the data-parallel group and clips by the global norm over all groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import kernels
from ..comm import CommunicationBackend, ReductionOperation
from ..config import ShardingConfiguration
from ..topology import Topology
from .layout import ParallelLayout, make_groups
from .model import ShardedModel, module_table
from .optimizer import DataParallelWrapper
from .pipeline import PipelineParallelModel
from .pipeline.adapters import BlocksArg, PipelineParts, find_adapter, pipeline_parts
from .tensor import Plan, VocabParallelOutput, apply_plan, validate_plan
from .zero import data_parallel_optimizer

__all__ = ["HybridShardedModel", "HybridShardedOptimizer"]


class HybridShardedModel(VocabParallelOutput, PipelineParallelModel):
    """3D parallelism: ``pipeline_parallel_size`` stages x ``data_parallel_size`` replicas (-1: the ranks left
    over) x ``tensor_parallel_size``-way split layers.

    ``plan`` (needed when ``tensor_parallel_size > 1``) names the layers to split, as for
    :class:`~gpudist.TensorParallelModel` (e.g. ``tinylm_plan`` in examples/lm.py). ``blocks`` turns the
    (converted) module into the ``nn.Sequential`` the pipeline splits (e.g. ``examples/lm.py``'s ``as_sequential``);
    without it the module must be an ``nn.Sequential``, a decoder model a model adapter recognises (Hugging Face
    Llama, GPT-2: see :class:`~gpudist.PipelineParallelModel`), or ``pipeline_parallel_size`` 1.

    Train with :meth:`train_step` on every rank; each replica passes its own slice of the batch, the ranks of one
    replica the same slice. ``loss_fn=None`` uses the vocabulary-parallel cross-entropy when the plan has a
    ``vocab_output`` layer (full logits are never gathered). Gradients are made whole in order: tensor-parallel
    collectives inside backward, accumulation over micro-batches, shared parameters summed between stages, then
    the average over replicas. Memory per rank: the stage's parameters split by the tensor group (optimizer state
    further split over replicas with ZeRO), plus the 1F1B activations in flight. Communication: activation
    all-reduces in the tensor group per layer, activations and their gradients between stages per micro-batch, one
    gradient all-reduce (or ZeRO reduce-scatter + all-gather) per step in the data group; :meth:`link_bytes` counts
    them per link class (intra-node, inter-node) by where each group's ranks sit.

    Args:
        module: The full model (every rank builds the same one): an ``nn.Sequential`` (or list of blocks) to
            pipeline, or any module with ``blocks``.
        config: The settings shared with the paired optimizer; ``config.backend`` is the world group the layout
            divides.
        pipeline_parallel_size: Pipeline stages.
        tensor_parallel_size: Ranks each planned layer is split over.
        data_parallel_size: Replicas of the pipeline; -1: the ranks left over.
        plan: Module name -> style (``PLAN_STYLES``), or a function of the module returning one; needed when
            ``tensor_parallel_size > 1``.
        blocks: A function of the converted module returning its blocks in order (an ``nn.Sequential`` or a
            sequence of modules), or the dotted name of a decoder model's block list; needed when
            ``pipeline_parallel_size > 1`` and ``module`` is neither a sequence nor a model an adapter recognises.
        micro_batches: Micro-batches per training step; each replica's batch size must be divisible by it.
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved"``, ``"zero_bubble"``, ``"zbv"`` or ``"dualpipev"``, as
            for :class:`~gpudist.PipelineParallelModel`.
        balance: How blocks are split into stages: ``"parameters"``, ``"uniform"``, or a list of blocks per stage.
        virtual_stages: Chunks per rank with ``schedule="interleaved"`` (None: 2).

    Raises:
        TypeError: When ``config`` is not a :class:`~gpudist.ShardingConfiguration`, ``module`` is not an
            ``nn.Module`` or is already wrapped, ``pipeline_parallel_size > 1`` without ``blocks`` for a module
            that is neither an ``nn.Sequential`` nor a model an adapter recognises, or ``plan`` is not a non-empty
            mapping (or a function returning one) or maps a submodule to a style that does not convert its type.
        ValueError: When a size is not an int >= 1 (``data_parallel_size``: or -1) or the sizes do not multiply to
            the world size, ``tensor_parallel_size > 1`` without a plan, ``schedule`` or ``micro_batches`` is
            invalid, ``balance`` does not fit the blocks (or there are more stages than blocks), a plan entry is
            invalid (unknown style, no such submodule, a size ``tensor_parallel_size`` does not divide, a tied
            parameter split two ways), the blocks hold parameters the module does not name, ranks wrap
            modules whose parameter names, shapes or dtypes differ, or (when ``config.backend.topology`` gives
            the node layout, as after ``gpudist.init()``) a tensor-parallel group spans nodes
            (:meth:`~.layout.ParallelLayout.check_tensor_groups_within_nodes`).
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
        blocks: BlocksArg = None,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        balance: str | Sequence[int] = "parameters",
        virtual_stages: int | None = None,
    ):
        if not isinstance(config, ShardingConfiguration):
            raise TypeError(f"config must be a gpudist.ShardingConfiguration, got {type(config).__name__}")
        layout = ParallelLayout.resolve(
            config.backend.world_size, pipeline_parallel_size, tensor_parallel_size, data_parallel_size
        )
        topology = config.backend.topology  # gpudist.init() sets it: then the node layout is known
        if topology is not None:
            layout.check_tensor_groups_within_nodes(topology.layout)
        if tensor_parallel_size > 1 and plan is None:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} needs a plan naming the layers to split, "
                "e.g. plan=examples/lm.py's tinylm_plan or {'mlp.fc1': 'colwise', 'mlp.fc2': "
                "'rowwise'}"
            )
        try:
            self._adapter = find_adapter(module, blocks, "HybridShardedModel")
        except TypeError as e:
            if pipeline_parallel_size > 1:
                raise TypeError(
                    f"pipeline_parallel_size={pipeline_parallel_size}: {e} (e.g. examples/lm.py's as_sequential)"
                ) from None
            self._adapter = None  # one stage: the module is its one block
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
        self._set_schedule(schedule, layout.pipeline_parallel_size, micro_batches, virtual_stages)
        if isinstance(module, (list, tuple)):
            module = nn.Sequential(*module)
        self._setup = {"layout": layout, "balance": balance, "plan": plan, "blocks": blocks}
        ShardedModel.__init__(self, module, config)

    def _prepare(self, module: nn.Module) -> tuple[PipelineParts, list[dict]]:
        """Split the planned layers over the tensor group (in place), then return the parts to pipeline."""
        table = module_table(module)  # the full shapes, before splitting
        plan, tp = self._setup["plan"], self.layout.tensor_parallel_size
        entries = validate_plan(module, plan(module) if callable(plan) else plan, tp) if plan is not None else []
        self.tensor_group = make_groups(self.comm, self.layout.groups("tensor"))
        self._splits, output = apply_plan(module, entries, self.tensor_group) if entries else ({}, None)
        self.vocab_start = None if output is None else module.get_submodule(output).output_start
        return pipeline_parts(module, self._setup["blocks"], self._adapter), table

    def link_groups(self) -> list[tuple[CommunicationBackend, tuple[int, ...]]]:
        """This rank's groups (pipeline, data, tensor, and one per set of stages sharing tied parameters), each with
        its ranks in ``config.backend``: what :meth:`~gpudist.Topology.link_bytes` classes by node."""
        return [(group, group.parent_ranks) for group in {id(g): g for g in self._groups}.values()]

    def link_bytes(self, topology: Topology | None = None) -> dict[str, int]:
        """Payload bytes counted so far per link class, this model's groups included: ``topology.link_bytes(
        self.link_groups())``. Each group counts under ``"intra"`` when its ranks share a node, ``"inter"`` when
        each is on another node, ``"world"`` otherwise (as the world group, which carries the optimizer's clipping
        norm). Take differences between two calls for a step's bytes. Collective the first time (it builds the
        topology's groups, :meth:`~gpudist.Topology.groups`).

        Args:
            topology: The node layout of ``config.backend``; None: ``config.backend.topology`` (``gpudist.init()``
                sets it).

        Raises:
            ValueError: When no topology is given and the backend has none.
        """
        topology = self.comm.topology if topology is None else topology
        if topology is None:
            raise ValueError(
                "HybridShardedModel.link_bytes: config.backend has no topology (gpudist.init() sets one); pass "
                "topology=gpudist.Topology(comm, ranks_per_node=...)"
            )
        return topology.link_bytes(self.link_groups())

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> float:
        """The pipelined step; ``loss_fn`` None: the vocabulary-parallel cross-entropy with a ``vocab_output``
        layer, else the model adapter's loss (a Hugging Face causal LM's, ``targets`` being its labels).

        Raises:
            ValueError: When ``loss_fn`` is None for an adapted model whose head is split by vocabulary (its
                labels are not shifted the way :meth:`cross_entropy` expects: pass a loss).
        """
        if loss_fn is None and self._adapter is not None:
            if self.vocab_start is not None:
                raise ValueError(
                    "HybridShardedModel.train_step: pass loss_fn for a model adapter with a vocabulary-split head, "
                    "e.g. lambda logits, labels: model.cross_entropy(logits[:, :-1], labels[:, 1:])"
                )
            loss_fn = self._adapter.loss
        return super().train_step(inputs, targets, loss_fn, optimizer)


class HybridShardedOptimizer(DataParallelWrapper):
    """Steps a :class:`~gpudist.HybridShardedModel`'s parameters: each rank holds its pipeline stage's
    tensor-parallel shards, and the optimizer runs data parallelism in the model's data group last, after the
    model made gradients whole over the tensor group, the micro-batches and the stages.

    ``zero_stage``: 0 averages gradients with an all-reduce and keeps the full optimizer state on every replica
    (DDP); 1 (default) shards the optimizer state over the replicas (ZeRO-1: reduce-scatter, step the owned
    part, all-gather the parameters); 2 also frees the gradients this replica does not own (ZeRO-2). The sizes
    must be the model's layout (the seeds' signature; ``-1`` takes the ranks left over).

    ``config.max_grad_norm`` clips to the L2 norm of the whole model's gradient, as
    ``torch.nn.utils.clip_grad_norm_`` on one process: after the replica average, every rank sums the squares it
    owns (its tensor shards of split parameters, tensor rank 0 the unsplit ones, the first holding stage a tied
    parameter; with ZeRO its range of the replicas' average, with DDP replica 0), and one 8-byte all-reduce over
    all ranks gives the norm. With ZeRO a non-finite norm skips the step on every rank, as ZeRO does.

    Args:
        optimizer: A ``torch.optim.Optimizer`` over the ``HybridShardedModel``'s ``parameters()``.
        config: The configuration the model was built from.
        pipeline_parallel_size: The model's pipeline stages.
        tensor_parallel_size: The model's tensor-parallel size.
        data_parallel_size: The model's replicas; -1: the ranks left over.
        zero_stage: 0, 1 or 2, as described above.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already wrapped), ``config`` is
            not a ``ShardingConfiguration``, or no ``HybridShardedModel`` built from ``config`` manages the
            optimizer's parameters.
        ValueError: When ``zero_stage`` is not 0, 1 or 2, the sizes are invalid or differ from the model's
            layout, or (ZeRO) the data-parallel optimizer refuses the parameters (no trainable parameter, mixed
            dtypes or devices, or layouts that differ between replicas).
    """

    strategy = "hybrid"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: ShardingConfiguration,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = -1,
        *,
        zero_stage: int = 1,
    ):
        super().__init__(optimizer, config)
        inner_class = data_parallel_optimizer(zero_stage)
        model = self.model()
        if not isinstance(model, HybridShardedModel):
            raise TypeError(
                "HybridShardedOptimizer steps a HybridShardedModel built from the same config; build the "
                "model first and pass torch.optim.X(model.parameters()) here"
            )
        layout = ParallelLayout.resolve(
            self.comm.world_size, pipeline_parallel_size, tensor_parallel_size, data_parallel_size
        )
        if layout != model.layout:
            raise ValueError(
                f"HybridShardedOptimizer: {layout.describe()} differs from the model's "
                f"{model.layout.describe()}; pass the model's sizes"
            )
        self.zero_stage = zero_stage
        data_config = dataclasses.replace(config, backend=model.data_group)
        self.inner = inner_class(optimizer, data_config)
        if config.max_grad_norm is not None:  # the inner optimizer sees the data group only: it clips (and ZeRO
            self.inner.gradient_norm_fn = self._global_norm  # skips non-finite steps) with the whole model's norm
        model.reduce_data_parallel = False  # the inner optimizer averages (or reduce-scatters) over replicas
        self._norm: torch.Tensor | None = None
        if zero_stage == 0:  # the replicas' averaged gradients are equal: replica 0 counts them
            first = model.data_parallel_rank == 0
            self._norm_params = [p for p in self._params() if p.requires_grad and first and model.counts_in_norm(p)]
        else:  # each replica counts its own range of the flat gradient, [lo, hi) of the inner optimizer's buffer
            self._norm_spans = self._owned_spans(model)

    def _owned_spans(self, model: HybridShardedModel) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        for p, _, at, length in self.inner.owned_ranges():
            if model.counts_in_norm(p):
                if spans and spans[-1][1] == at:
                    spans[-1] = (spans[-1][0], at + length)
                else:
                    spans.append((at, at + length))
        return spans

    @property
    def last_grad_norm(self) -> float:
        """The whole model's gradient norm in the last step (NaN before the first, or without ``max_grad_norm``).
        Reading it waits for the device: the step itself keeps the norm there."""
        return math.nan if self._norm is None else float(self._norm.reshape(()))

    def _global_norm(self) -> torch.Tensor:
        """The whole model's gradient norm, from the squares this rank counts (collective over all ranks), as a
        1-element float64 tensor on the device (the inner optimizer clips and skips with it there)."""
        if self.zero_stage == 0:
            grads = [p.grad.reshape(-1) for p in self._norm_params if p.grad is not None]
        else:
            grads = [self.inner.owned_gradient[lo:hi] for lo, hi in self._norm_spans]
        total = torch.zeros(1, dtype=torch.float64, device=self.comm.device)
        for g in grads:
            total += kernels.squared_norm(g.contiguous()).double()
        self.comm.agreed.all_reduce(total, ReductionOperation.SUM)
        self._norm = total.sqrt_()
        return self._norm

    def step(self, closure=None):
        """Step the data-parallel optimizer (collective): average or reduce-scatter over the replicas, clip by the
        whole model's norm when ``config.max_grad_norm`` is set, update, and (ZeRO) all-gather the parameters.

        Args:
            closure: Re-evaluates the model and returns the loss; None: use the gradients already computed.

        Returns:
            The closure's loss, or None without a closure.
        """
        return self.inner.step(closure)
