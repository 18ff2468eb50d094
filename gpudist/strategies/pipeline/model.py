"""PipelineParallelModel: runs a stage's share of the schedule (the executor), on :class:`StageLink`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from ...comm import ReductionOperation
from ...config import ShardingConfiguration
from ...flat import exchange_bytes, reduce_gradients_in
from ..layout import ParallelLayout, make_groups
from ..model import ShardedModel, module_table, replica_share
from ..tensor import held_segments
from .adapters import BlocksArg, DecoderAdapter, PipelineParts, find_adapter, pipeline_parts
from .executor import StepExecutor
from .p2p import META_LEN, StageLink, flatten_activation, unflatten_activation
from .schedule import (
    check_schedule,
    holder,
    partition_blocks,
    placement,
    stage_schedule,
    virtual_stage,
)

__all__ = ["PipelineParallelModel"]


def call_block(block: nn.Module, x: Any) -> Any:
    """``block`` applied to the previous block's output: a tensor as its argument, a tuple as its positional
    arguments, a dict as its keyword arguments."""
    if isinstance(x, tuple):
        return block(*x)
    if isinstance(x, dict):
        return block(**x)
    return block(x)


class _Stage(nn.Module):
    """One stage: its blocks, named by their index in the model's block list ("3", not "0"), and with a model
    adapter the glue it runs (``embed_tokens`` on the first stage, ``norm``/``lm_head`` on the last, ...)."""

    def __init__(
        self,
        blocks: dict[int, nn.Module],
        glue: dict[str, nn.Module],
        adapter: DecoderAdapter | None,
        first: bool,
        last: bool,
    ):
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)
        for name, module in glue.items():
            self.add_module(name, module)
        self.block_names = [str(index) for index in blocks]
        self.adapter, self.is_first, self.is_last = adapter, first, last

    def forward(self, x: Any) -> Any:
        blocks = [self._modules[name] for name in self.block_names]
        if self.adapter is not None:
            return self.adapter.run_stage(self, blocks, x, self.is_first, self.is_last)
        for block in blocks:
            x = call_block(block, x)
        return x


class PipelineParallelModel(ShardedModel):
    """Pipeline parallelism: ``module``'s blocks split into ``num_stages`` stages of consecutive blocks, one per
    rank (``num_stages`` defaults to the world size; a smaller count that divides it makes
    ``world_size / num_stages`` data-parallel replicas of the pipeline).

    The blocks are ``module`` itself when it is an ``nn.Sequential`` or a list of blocks; those ``blocks(module)``
    returns; or, for a decoder model a :mod:`model adapter <.adapters>` recognises (Hugging Face Llama, Mistral,
    Qwen2/3 and GPT-2 causal LMs), its own block list (``model.layers``, ``transformer.h``, or the dotted name
    ``blocks`` gives), with the model's glue run as its ``forward`` does: the embeddings on the first stage, the
    position ids, rotary embeddings and causal/padding mask on every stage, the final norm and head on the last.
    Pass such a model's ``input_ids`` (or a dict with ``attention_mask``, ``position_ids``) as inputs and its
    ``labels`` as targets: ``loss_fn=None`` is the model's causal-LM loss.

    Stages are balanced by parameter count (``balance="parameters"``), ``"uniform"`` in block count, or given as a
    list of blocks per stage. A block gets the previous block's output: a tensor as its argument, a tuple as its
    positional arguments, a dict as its keyword arguments (integer tensors such as a padding mask travel with the
    activations; gradients only for the tensors that need one). Train with :meth:`train_step`, which runs the
    ``schedule`` ("1f1b", "gpipe", "interleaved", "zero_bubble", "zbv" or "dualpipev") over ``micro_batches``
    micro-batches and returns the global batch's loss on every rank; ``forward`` runs the whole pipeline without
    gradients (``predict``) and returns the output on every rank. Memory: each rank holds its stage's parameters,
    gradients and optimizer state, plus the activations of the micro-batches in flight (at most ``num_stages -
    stage`` with 1F1B, all of them with GPipe; interleaved: at most ``2 (p - s - 1) + (v - 1) p + 1`` chunk
    activations, each ``1/v`` of a stage's; ZB-H1 ``p`` on every stage; ZB-V ``2 p`` half-size chunk activations,
    DualPipe-V ``2 p + 1``, alive until their W). Communication per step: each micro-batch's activation and its
    gradient across every stage boundary (``v`` times round the ring of ranks, interleaved, rank ``p - 1`` sending
    back to rank 0).

    A stage may hold no parameters (a split that leaves it only activations, say): it still runs its part of every
    step, and warns at construction, since a torch optimizer refuses its empty parameter list (build none there).

    Saving: :meth:`full_state_dict` and ``save_model("x.safetensors")`` give the full module on every rank
    (collective); checkpoint folders (``save_model("folder")``, :func:`gpudist.save_checkpoint`, with a plain
    optimizer over ``model.parameters()``) hold each element once under the full module's names (a Hugging Face
    model's own names: they load into the unwrapped model, and back), a tied parameter written by the first stage
    holding it, and load into any strategy and stage count.

    Args:
        module: The full model: an ``nn.Sequential`` or a list (or ``nn.ModuleList``) of blocks, a model with
            ``blocks``, or a decoder model an adapter recognises; every rank builds the same one and keeps only its
            stage's part.
        config: The settings shared with the optimizer; ``config.backend`` is the world group.
        num_stages: Pipeline stages; it must divide the world size (None: the world size, no replicas).
        micro_batches: Micro-batches per training step; each replica's batch size must be divisible by it.
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved"``, ``"zero_bubble"`` (ZB-H1), ``"zbv"`` or
            ``"dualpipev"`` (:mod:`gpudist.strategies.pipeline`).
        balance: ``"parameters"``, ``"uniform"``, or a list of blocks per stage (per chunk, interleaved).
        blocks: A function of ``module`` returning its blocks in order (an ``nn.Sequential`` or a list; names stay
            ``module``'s), or the dotted name of a decoder model's block list; None: ``module`` is the sequence, or
            an adapter finds the block list.
        virtual_stages: Chunks per rank with ``schedule="interleaved"`` (None: 2); only 1 or None otherwise.

    Raises:
        TypeError: When ``module`` is neither a sequence of blocks nor a model an adapter recognises (the error
            names what each adapter looked for) and ``blocks`` is not given.
        ValueError: When ``schedule`` is unknown, ``micro_batches`` is not an int >= 1, ``num_stages`` does not
            divide the world size, there are more stages than blocks or ``balance`` does not fit them, ranks
            wrap modules whose parameter names, shapes or dtypes differ, or (interleaved) ``micro_batches`` is not
            a multiple of ``num_stages``.
    """

    strategy = "pipeline"
    virtual_stages = 1

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module],
        config: ShardingConfiguration,
        num_stages: int | None = None,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        balance: str | Sequence[int] = "parameters",
        *,
        blocks: BlocksArg = None,
        virtual_stages: int | None = None,
    ):
        if isinstance(module, (list, tuple, nn.ModuleList)):
            module = nn.Sequential(*module)
        self._adapter = find_adapter(module, blocks, "PipelineParallelModel")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
        world = config.backend.world_size
        layout = ParallelLayout.resolve(world, num_stages or world)
        self._set_schedule(schedule, layout.pipeline_parallel_size, micro_batches, virtual_stages)
        self._setup = {
            "layout": layout,
            "balance": balance,
            "blocks": blocks,
        }
        super().__init__(module, config)

    def _set_schedule(self, schedule: str, num_stages: int, micro_batches: int, virtual_stages: int | None) -> None:
        """Check the schedule settings (:func:`check_schedule`) and keep them.

        Raises:
            ValueError: As :func:`check_schedule`.
        """
        self.virtual_stages = check_schedule(schedule, num_stages, micro_batches, virtual_stages)
        self.micro_batches, self.schedule, self.placement = micro_batches, schedule, placement(schedule)

    # -- construction ----------------------------------------------------------------------------------------------

    def _prepare(self, module: nn.Module) -> tuple[PipelineParts, list[dict]]:
        """The parts to split and the full model's parameter table (names, shapes), before any splitting.
        HybridShardedModel converts tensor-parallel layers here."""
        self._splits: dict[str, Any] = {}  # parameter name -> how tensor parallelism cut it (none here)
        self.tensor_group = None
        return pipeline_parts(module, self._setup["blocks"], self._adapter), module_table(module)

    @property
    def adapter(self) -> DecoderAdapter | None:
        """The model adapter running the model's glue (None for a sequence of blocks)."""
        return self._adapter

    def traffic_settings(self) -> dict[str, Any]:
        """The base settings, plus the schedule, the micro-batch count and the stage balance (they decide every
        message of a step)."""
        return {
            **super().traffic_settings(),
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "balance": str(self._setup.get("balance")),
            "adapter": self._adapter.family if self._adapter is not None else None,
        }

    def initialize_sharding(self) -> None:
        self._check_same_model()
        layout: ParallelLayout = self._setup["layout"]
        self.layout = layout
        self.pipeline_parallel_rank, self.data_parallel_rank, self.tensor_parallel_rank = layout.coords(self.rank)
        root = self.module
        parts, self._table = self._prepare(root)
        blocks = parts.blocks
        num_stages, v = layout.pipeline_parallel_size, self.virtual_stages
        chunks = num_stages * v  # virtual stages: chunk c of rank s is virtual_stage(placement, p, s, c)
        where = self.placement
        seen: set[int] = set()
        costs = []
        for i, block in enumerate(blocks):  # a parameter shared with an earlier block costs nothing more
            modules = [
                *(parts.first.values() if i == 0 else ()),
                block,
                *(parts.last.values() if i == len(blocks) - 1 else ()),
            ]
            params = [p for m in modules for p in m.parameters()]
            costs.append(sum(p.numel() for p in dict.fromkeys(params) if id(p) not in seen))
            seen.update(id(p) for p in params)
        counts = partition_blocks(costs, chunks, self._setup["balance"])
        starts = [sum(counts[:s]) for s in range(len(counts))]
        self.stage_blocks = [(a, a + c) for a, c in zip(starts, counts, strict=True)]
        """``[first, end)`` block indices of every stage (of every virtual stage, interleaved)."""

        def chunk_modules(u: int) -> dict[str, nn.Module]:
            """Virtual stage ``u``'s modules: glue (first, every, last) and blocks, by name in the chunk."""
            a, b = self.stage_blocks[u]
            out = dict(parts.first) if u == 0 else {}
            out |= {str(i): blocks[i] for i in range(a, b)} | parts.every
            return out | (parts.last if u == chunks - 1 else {})

        def stage_modules(s: int) -> dict[str, nn.Module]:
            """Rank ``s``'s modules, over its chunks."""
            return {
                name: m for c in range(v) for name, m in chunk_modules(virtual_stage(where, num_stages, s, c)).items()
            }

        # Where each parameter of the full model lives: its name (hence offset and shape in the full vector) and
        # the stages that hold it. The first holder owns it in gather_full_parameters.
        self._name_of = {id(root.get_parameter(row["name"])): row["name"] for row in self._table}
        self._place, offset = {}, 0
        for row in self._table:
            numel = torch.Size(row["shape"]).numel()
            self._place[row["name"]], offset = (offset, numel, torch.Size(row["shape"])), offset + numel
        self._full_numel = offset
        holders: dict[int, list[int]] = {}
        stage_params = []
        for s in range(num_stages):
            stage_params.append(list(dict.fromkeys(p for m in stage_modules(s).values() for p in m.parameters())))
            for p in stage_params[s]:
                holders.setdefault(id(p), []).append(s)
        unplaced = [
            f"{name}.{n}"
            for s in range(num_stages)
            for name, m in stage_modules(s).items()
            for n, p in m.named_parameters()
            if id(p) not in self._name_of
        ]
        if unplaced:
            raise ValueError(
                f"{type(self).__name__}: the blocks hold parameters the module does not name "
                f"({unplaced[:3]}); build the blocks from the module's own layers"
            )
        outside = [row["name"] for row in self._table if id(root.get_parameter(row["name"])) not in holders]
        if outside:
            raise ValueError(
                f"{type(self).__name__}: {len(outside)} parameters of the module are in none of the blocks "
                f"({outside[:3]}); every parameter must belong to a block, or it would never train or be saved"
            )
        self._stage_names = [
            [self._name_of[id(p)] for p in stage_params[s] if holders[id(p)][0] == s] for s in range(num_stages)
        ]
        """Names of the parameters each stage owns, in the order it sends them in gather_full_parameters."""
        self._stage_numel = [sum(self._place[n][1] for n in names) for names in self._stage_names]
        # Buffers (and the state_dict keys) of the full model, and the stage that saves each: the first holding it.
        self._state_keys = list(root.state_dict().keys())
        self._buffer_rows = [
            {"name": n, "shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
            for n, b in root.named_buffers()
        ]
        buffer_names = {id(b): n for n, b in root.named_buffers()}
        buffer_stage: dict[int, int] = {}
        for s in range(num_stages):
            for module in stage_modules(s).values():
                for buf in module.buffers():
                    buffer_stage.setdefault(id(buf), s)

        stage = self.pipeline_parallel_rank

        def chunk(u: int) -> _Stage:
            a, b = self.stage_blocks[u]
            glue = {name: m for name, m in chunk_modules(u).items() if not name.isdigit()}
            return _Stage({i: blocks[i] for i in range(a, b)}, glue, parts.adapter, first=u == 0, last=u == chunks - 1)

        # several chunks: in a list, their parameters named "c.<block>..." here (checkpoints use full names)
        if v == 1:
            self.module = chunk(stage)
        else:
            self.module = nn.ModuleList(chunk(virtual_stage(where, num_stages, stage, c)) for c in range(v))
        params = list(self.module.parameters())
        self._stage_params = params
        if not params:
            blocks_held = [self.stage_blocks[virtual_stage(where, num_stages, stage, c)] for c in range(v)]
            warnings.warn(
                f"{type(self).__name__}: stage {stage} holds no parameters (blocks {blocks_held} as [first, end)); "
                "it trains nothing, and torch optimizers refuse an empty parameter list: on this rank build the "
                "optimizer only when list(model.parameters()) is non-empty, and call train_step without one",
                stacklevel=4,  # the user's PipelineParallelModel(...) line
            )
        self._local_names = {self._name_of[id(p)]: n for n, p in self.module.named_parameters()}
        self._owned_names = set(self._stage_names[stage])
        self._stage_buffers = [
            (buffer_names[id(buf)], buf, buffer_stage[id(buf)] == stage)
            for buf in self.module.buffers()
            if id(buf) in buffer_names
        ]
        """(name in the full model, buffer, whether this stage owns it) of every buffer this stage holds."""

        pp_groups = layout.groups("pipeline")
        self.pipeline_group = make_groups(self.comm, pp_groups)
        self.data_group = make_groups(self.comm, layout.groups("data"))
        # Tied parameters: one group per set of stages sharing parameters, per (data, tensor) position.
        tied_sets = sorted({tuple(h) for h in holders.values() if len(h) > 1})
        self._tied: list[tuple[Any, list[nn.Parameter]]] = []
        for stages in tied_sets:
            group = make_groups(self.comm, [[ranks[s] for s in stages] for ranks in pp_groups], required=False)
            if stage in stages:
                shared = [p for p in params if tuple(holders[id(p)]) == stages]
                self._tied.append((group, shared))
        self.last_schedule: dict[str, Any] = {}
        self.link = StageLink(self.pipeline_group, self.pipeline_parallel_rank, self.comm.device)
        self.reduce_data_parallel = True
        """Whether the model averages gradients over replicas (False once a HybridShardedOptimizer does it)."""
        self._groups = [g for g in (self.pipeline_group, self.data_group, self.tensor_group) if g is not None]
        self._groups += [group for group, _ in self._tied]

    # -- sizes and ranks ---------------------------------------------------------------------------------------------

    @property
    def pipeline_parallel_size(self) -> int:
        """The number of pipeline stages."""
        return self.layout.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """The number of replicas of the pipeline."""
        return self.layout.data_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        """The number of ranks each split layer is split over (1 without tensor parallelism)."""
        return self.layout.tensor_parallel_size

    @property
    def num_stages(self) -> int:
        """The number of pipeline stages (:attr:`pipeline_parallel_size`)."""
        return self.layout.pipeline_parallel_size

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs the first stage (the one that reads the inputs)."""
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last stage (the one that computes the loss): rank ``p - 1``, or rank 0 with a
        V-shaped schedule (``"zbv"``, ``"dualpipev"``)."""
        last = self.num_stages * self.virtual_stages - 1
        return self.pipeline_parallel_rank == holder(self.placement, self.num_stages, last)[0]

    def _bytes_total(self) -> int:
        return sum(group.stats.total_bytes for group in {id(g): g for g in self._groups}.values())

    def manages(self, param: torch.Tensor) -> bool:
        return any(param is p for p in self._stage_params)

    def counts_in_norm(self, param: torch.Tensor) -> bool:
        """Whether this rank counts ``param``'s gradient in the full model's gradient norm: only the stage that
        owns it counts it (the first of the stages sharing a tied parameter; their gradients are summed, hence
        equal), and a parameter tensor parallelism did not split only on tensor rank 0 (its copies on the other
        tensor ranks are equal); a split one everywhere (each rank its shard). Replicas are the optimizer's.

        Args:
            param: A parameter of this stage.

        Returns:
            Whether this rank adds ``param``'s squared gradient to the norm (False for a tensor this stage does
            not hold).
        """
        name = self._name_of.get(id(param))
        if name is None or name not in self._stage_names[self.pipeline_parallel_rank]:
            return False
        return name in self._splits or self.tensor_parallel_rank == 0

    # -- training ----------------------------------------------------------------------------------------------------

    def _micro(self, value: Any, what: str) -> list[Any]:
        """``value`` (a tensor, or a tuple/dict of tensors with the batch first) as ``micro_batches`` pieces."""
        try:
            spec, tensors = flatten_activation(value)
        except TypeError:
            raise TypeError(
                f"PipelineParallelModel.train_step: {what} must be a tensor, or a tuple or dict of tensors, got "
                f"{type(value).__name__}"
            ) from None
        for t in tensors:
            if t.dim() == 0 or t.shape[0] % self.micro_batches:
                raise ValueError(
                    f"PipelineParallelModel.train_step: {what} has batch size {t.shape[0] if t.dim() else 0}, not "
                    f"a multiple of micro_batches={self.micro_batches}; pass a batch divisible by it (each "
                    "micro-batch must have the same size so their mean losses average to the batch's)"
                )
        pieces = [t.chunk(self.micro_batches) for t in tensors]
        return [unflatten_activation(spec, [p[m] for p in pieces]) for m in range(self.micro_batches)]

    def _loss_fn(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Callable[[Any, Any], torch.Tensor]:
        if loss_fn is not None:
            return loss_fn
        if self._adapter is None:
            raise TypeError(
                "PipelineParallelModel.train_step: pass loss_fn(outputs, targets); only a model a model adapter "
                "splits (a Hugging Face causal LM) has a default loss"
            )
        return self._adapter.loss

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """One pipelined step on this replica's batch (every stage of the replica passes the same ``inputs`` and
        ``targets``; only the first stage reads ``inputs``, only the last ``targets``). Gradients are accumulated
        over the micro-batches, summed over stages for shared parameters and averaged over replicas; then
        ``optimizer.step()`` and ``zero_grad()`` if given. Returns the global batch's mean loss (over micro-batches
        and replicas) on every rank.

        Messages and their order: :mod:`.executor`.

        Args:
            inputs: This replica's input batch (a tensor, or a tuple or dict of tensors split along their first
                dimension: a decoder's ``input_ids``, ``attention_mask``, ``position_ids``); read on the first stage
                only.
            targets: This replica's targets (a tensor, tuple or dict, split the same way; a decoder's ``labels``);
                read on the last stage only.
            loss_fn: ``loss_fn(outputs, targets)`` of one micro-batch, returning a scalar loss averaged over it;
                None: the adapter's loss (the model's causal-LM loss, with ``-100`` labels ignored: with padding,
                give every micro-batch the same number of counted tokens for the mean to be the batch's).
            optimizer: Stepped and zeroed after the gradients are complete; None leaves the step to the caller.

        Returns:
            The global batch's mean loss, the same on every rank: a 0-dim float64 tensor on the device that reads as
            a number (``float(loss)``); it stays there, so the step makes no host sync for it.

        Raises:
            TypeError: When ``inputs`` (first stage) or ``targets`` (last stage) is not a tensor, tuple or dict of
                tensors, a stage's blocks return anything else, or ``loss_fn`` is None without a model adapter.
            ValueError: When the batch size is not a multiple of ``micro_batches``, ``loss_fn`` does not return a
                one-element tensor, or a stage's output cannot be sent (an unsupported dtype, or micro-batches of
                different shapes).
        """
        self.train()
        first, last = self.is_first_stage, self.is_last_stage
        p, v = self.num_stages, self.virtual_stages
        executor = StepExecutor(
            self._chunks(),
            self.link,
            [stage_schedule(self.schedule, p, s, self.micro_batches, v) for s in range(p)],
            self.micro_batches,
            inputs=self._micro(inputs, "inputs") if first else None,
            targets=self._micro(targets, "targets") if last else None,
            loss_fn=self._loss_fn(loss_fn) if last else loss_fn,
            data_group=self.data_group if self.data_parallel_size > 1 else None,
            where=self.placement,
        )
        loss = executor.run()
        self.last_schedule = executor.report()
        self.synchronize_gradients()
        self._mark_step_bytes()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        return loss.reshape(())

    def _chunks(self) -> list[nn.Module]:
        """This rank's chunks in order (one without interleaving)."""
        return list(self.module) if self.virtual_stages > 1 else [self.module]

    @torch.no_grad()
    def synchronize_gradients(self) -> None:
        """Sum shared parameters' gradients over the stages holding them, then average over replicas."""
        for group, shared in self._tied:
            reduce_gradients_in(group, shared, ReductionOperation.SUM)
        if self.data_parallel_size > 1 and self.reduce_data_parallel:
            reduce_gradients_in(self.data_group, self._stage_params, ReductionOperation.AVERAGE)

    # -- inference ---------------------------------------------------------------------------------------------------

    def capture_refusal(self) -> str | None:
        """A pipeline's schedule exchanges activations point to point per micro-batch: not captured."""
        return "a pipeline's schedule exchanges activations point to point per micro-batch; run it eagerly"

    def forward(self, inputs: Any) -> Any:
        """The whole model's output for ``inputs`` (on every rank), without gradients; train with train_step.

        Args:
            inputs: The input batch (read on the first stage only).

        Returns:
            The last stage's output (a tensor, tuple or dict of tensors: an adapted decoder's logits), broadcast
            to every rank.

        Raises:
            RuntimeError: When called in training mode with gradients enabled (use :meth:`train_step`,
                :meth:`predict` or ``torch.no_grad()``).
            TypeError: When a stage's blocks return something other than a tensor, tuple or dict of tensors.
            ValueError: When a stage's output cannot be sent (an unsupported dtype).
        """
        if torch.is_grad_enabled() and self.training:
            raise RuntimeError(
                "PipelineParallelModel: call train_step(inputs, targets, loss_fn, optimizer) to train "
                "(the backward pass is scheduled across ranks); forward runs without gradients, e.g. "
                "in predict() or under torch.no_grad()"
            )
        pending: list = []
        p, stage = self.num_stages, self.pipeline_parallel_rank
        last = holder(self.placement, p, p * self.virtual_stages - 1)[0]
        with torch.no_grad():
            for c, chunk in enumerate(self._chunks()):  # once round the ring per chunk, or down and up a V
                u = virtual_stage(self.placement, p, stage, c)
                if u > 0 and holder(self.placement, p, u - 1)[0] != stage:  # else the previous chunk's output
                    y = self.link.recv_activation(holder(self.placement, p, u - 1)[0] - stage)
                y = chunk(inputs if u == 0 else y)
                if u < p * self.virtual_stages - 1 and holder(self.placement, p, u + 1)[0] != stage:
                    self.link.send_activation(y, pending, holder(self.placement, p, u + 1)[0] - stage)
            for work, _ in pending:
                work.wait()
            if self.is_last_stage:
                meta = self.link.encode_spec(self.link.check_sendable(y))
            else:
                meta = torch.zeros(META_LEN, dtype=torch.int64, device=self.comm.device)
            self.pipeline_group.broadcast(meta, last)
            spec = self.link.decode_spec(meta)
            if self.is_last_stage:
                out = [t.contiguous() for t in flatten_activation(y)[1]]
            else:
                out = [torch.empty(shape, dtype=dtype, device=self.comm.device) for shape, dtype in spec.buffers]
            for t in out:
                self.pipeline_group.broadcast(t, last)
        return unflatten_activation(spec, out)

    # -- parameters as one flat vector -------------------------------------------------------------------------------

    def parameter_count(self) -> int:
        return self._full_numel

    def parameter_table(self) -> list[dict]:
        return self._table

    def _full_value(self, name: str) -> torch.Tensor:
        """The full value of parameter ``name`` held here (gathered over the tensor group when it is split)."""
        local = self.module.get_parameter(self._local_names[name]).detach()
        split = self._splits.get(name)
        return local if split is None else split.gather(local, self.tensor_group)

    def gather_full_parameters(self) -> torch.Tensor:
        """The full model's parameters in its ``parameters()`` order, identical on every rank (collective).

        Returns:
            A 1-D tensor of :meth:`parameter_count` elements on the backend's device: float64 when any stage holds
            float64 parameters, else float32.
        """
        width = max(self._stage_numel)
        names = self._stage_names[self.pipeline_parallel_rank]
        f64 = any(p.dtype == torch.float64 for p in self.module.parameters())
        wide = torch.tensor([int(f64)], dtype=torch.int64, device=self.comm.device)
        self.pipeline_group.all_reduce(wide, ReductionOperation.MAX)  # one dtype on every stage for the gather
        dtype = torch.float64 if bool(wide) else torch.float32
        mine = torch.zeros(width, dtype=dtype, device=self.comm.device)
        if names:
            own = torch.cat([self._full_value(n).reshape(-1).to(dtype) for n in names])
            mine[: own.numel()] = own
        everyone = torch.empty(width * self.num_stages, dtype=dtype, device=self.comm.device)
        self.pipeline_group.all_gather(mine, everyone)
        out = torch.empty(self._full_numel, dtype=dtype, device=self.comm.device)
        for s, stage_names in enumerate(self._stage_names):
            at = s * width
            for n in stage_names:
                offset, numel, _ = self._place[n]
                out[offset : offset + numel] = everyone[at : at + numel]
                at += numel
        return out

    def set_parameters(self, flat: torch.Tensor) -> None:
        """Overwrite this stage's parameters (shared ones included) from the full vector (same on every rank).

        Args:
            flat: The full model's parameters, as :meth:`gather_full_parameters` returns them.

        Raises:
            ValueError: When ``flat`` is not a 1-D tensor of the full model's parameter count.
        """
        self._check_flat(flat)
        for name in self._local_names:
            offset, numel, shape = self._place[name]
            self._write_full(name, flat[offset : offset + numel].view(shape))

    @torch.no_grad()
    def _write_full(self, name: str, full: torch.Tensor) -> None:
        """Overwrite this rank's tensor of parameter ``name`` from its full value (taking its shard when split)."""
        split, local = self._splits.get(name), self.module.get_parameter(self._local_names[name])
        full, tp = full.to(local.device), self.tensor_group
        local.copy_(full if split is None else split.shard(full, tp.rank, tp.world_size))

    def clone(self) -> ShardedModel:
        """Not supported: each rank holds only its stage.

        Raises:
            NotImplementedError: Always; build a new ``PipelineParallelModel`` from the full module instead.
        """
        raise NotImplementedError(
            "PipelineParallelModel holds one stage per rank; build a new one from the full module to copy it"
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full module's state (parameters under every name, buffers), as a single process would hold it, on
        every rank (collective): each stage contributes the parameters and buffers it owns, gathered over its
        tensor group when split, and the stages exchange them over the pipeline group.

        Returns:
            The full module's ``state_dict()`` keys mapped to full tensors on the backend's device.

        Raises:
            RuntimeError: When the module holds parameters or buffers outside the blocks the pipeline was built
                from.
        """
        mine = {name: self._full_value(name).cpu().clone() for name in self._stage_names[self.pipeline_parallel_rank]}
        mine |= {name: buf.detach().cpu().clone() for name, buf, owned in self._stage_buffers if owned}
        full: dict[str, torch.Tensor] = {}
        for payload in exchange_bytes(self.pipeline_group, st_save(mine)):
            full.update(st_load(payload))
        aliases = {alias: row["name"] for row in self._table for alias in row["aliases"]}
        missing = [k for k in self._state_keys if k not in full and aliases.get(k) not in full]
        if missing:
            raise RuntimeError(
                f"PipelineParallelModel.full_state_dict: no stage holds {missing[:5]} (entries of the "
                "module outside the blocks the pipeline was built from)"
            )
        device = self.comm.device
        return {k: (full[k] if k in full else full[aliases[k]].clone()).to(device) for k in self._state_keys}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a full (unsplit) state into this stage: its parameters (this rank's shard when split) and buffers.

        Args:
            state: The full module's state, as :meth:`full_state_dict` returns it (at least every parameter and
                buffer of this stage, under its full-model name).
        """
        for name in self._local_names:
            self._write_full(name, state[name])
        for name, buf, _ in self._stage_buffers:
            buf.copy_(state[name])

    # -- checkpoints (gpudist.checkpoint) ----------------------------------------------------------------------------

    def checkpoint_segments(self) -> list[tuple[torch.Tensor, list[tuple[int, int, str, int]]]]:
        """Every parameter of this stage (tied ones too, so that loading fills them) under its full-model name:
        whole, or its runs in the full parameter when tensor parallelism split it.

        Returns:
            ``(tensor, pieces)`` pairs, as :meth:`ShardedModel.checkpoint_segments`.
        """
        return [
            (
                p := self.module.get_parameter(local_name),
                held_segments(name, p, self._splits.get(name), self.tensor_group),
            )
            for name, local_name in self._local_names.items()
        ]

    def checkpoint_share(self, name: str, across_replicas: bool = True) -> tuple[int, int] | None:
        """Only the stage owning a parameter writes it (a tied one: the first stage holding it), its copies over the
        replicas and unsplit tensor ranks taking turns (:func:`replica_share`).

        Args:
            name: A parameter's name in the full module.
            across_replicas: False for state already split over the data-parallel replicas.

        Returns:
            ``(copies, index)`` as :meth:`ShardedModel.checkpoint_share`, or None when another stage owns ``name``.
        """
        if name not in self._owned_names:
            return None
        return replica_share(self.layout, self.rank, name in self._splits, across_replicas)

    def buffer_table(self) -> list[dict]:
        return [dict(row) for row in self._buffer_rows]

    def checkpoint_buffers(self) -> list[tuple[str, torch.Tensor, bool]]:
        """This stage's buffers under their full-model names, written by the owning stage's first rank.

        Returns:
            ``(name in the full module, tensor, whether this rank writes it)`` per buffer.
        """
        first = self.data_parallel_rank == 0 and self.tensor_parallel_rank == 0
        return [(name, buf, owned and first) for name, buf, owned in self._stage_buffers]

    def get_model_metadata(self) -> dict[str, Any]:
        meta = super().get_model_metadata()
        meta.update(
            {
                "layout": self.layout.describe(),
                "stage": self.pipeline_parallel_rank,
                "stage_blocks": self.stage_blocks[self.pipeline_parallel_rank]
                if self.virtual_stages == 1
                else [
                    self.stage_blocks[virtual_stage(self.placement, self.num_stages, self.pipeline_parallel_rank, c)]
                    for c in range(self.virtual_stages)
                ],
                "schedule": self.schedule,
                "virtual_stages": self.virtual_stages,
                "micro_batches": self.micro_batches,
                "stage_parameter_count": sum(p.numel() for p in self._stage_params),
            }
        )
        return meta
