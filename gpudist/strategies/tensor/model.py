"""TensorParallelModel: converts a module in place from a plan and runs data parallel over the ranks left over."""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn

from ...comm import CommunicationBackend, ReductionOperation
from ...config import ShardingConfiguration
from ...flat import broadcast_tensors, reduce_gradients_in
from ..layout import ParallelLayout, make_groups
from ..model import ShardedModel, module_table, replica_share
from ..reducer import EndOfBackward
from .layers import divisors, held_segments, vocab_parallel_cross_entropy
from .mappings import gather_from_tensor_parallel
from .plans import Plan, apply_plan, validate_plan

# The model


def _logits_of(out: Any) -> torch.Tensor:
    """The logits in a model's output: the output itself (a tensor), or its ``logits`` entry (a dict, a Hugging Face
    ``ModelOutput``) or field (a dataclass)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, MutableMapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if dataclasses.is_dataclass(out) and isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    raise TypeError(
        f"the model's output is split by vocabulary, but it returned a {type(out).__name__} without logits in it; "
        "return the logits as a tensor, or a dict, dataclass or Hugging Face output (return_dict=True) with a "
        "'logits' entry"
    )


class VocabParallelOutput:
    """The loss and prediction of a model whose output layer may be split by vocabulary (``vocab_output``):
    needs ``vocab_start`` (None when the output is not split) and ``tensor_group``. Shared by
    :class:`TensorParallelModel` and :class:`~gpudist.HybridShardedModel`; put it before the ShardedModel base."""

    vocab_start: int | None
    tensor_group: CommunicationBackend

    def cross_entropy(self, logits_shard: Any, targets: torch.Tensor) -> torch.Tensor:
        """:func:`vocab_parallel_cross_entropy` of this model's split logits (a ``vocab_output`` plan) and full
        targets; flattens ``[b, t, V/tp]`` logits and ``[b, t]`` targets like ``F.cross_entropy`` on tokens.

        Collective within the tensor group.

        Args:
            logits_shard: This rank's logits, ``[..., V/tp]``: the model's output, or an output holding them under
                ``logits`` (a dict, dataclass or Hugging Face ``ModelOutput``). Targets are not shifted: for a
                causal LM pass the next tokens.
            targets: Full-vocabulary token ids, the logits' shape without the vocabulary dimension.

        Returns:
            The mean cross-entropy over tokens, a float32 scalar tensor, the same on every rank of the tensor group.

        Raises:
            ValueError: When the plan has no ``vocab_output`` layer, or the shapes of the logits and ``targets``
                disagree.
            TypeError: When ``logits_shard`` is neither a tensor nor an output holding ``logits``.
        """
        if self.vocab_start is None:
            raise ValueError(
                "cross_entropy needs a plan with a 'vocab_output' layer (the model's output split by "
                "vocabulary); this model's output is not split: use F.cross_entropy"
            )
        logits = _logits_of(logits_shard)
        return vocab_parallel_cross_entropy(logits, targets, self.tensor_group, self.vocab_start)

    def gather_logits(self, out: Any) -> Any:
        """``out`` with its vocabulary-split logits gathered into full ones (collective within the tensor group;
        differentiable: the gradient of the full logits goes back to this rank's slice). Unchanged when the output
        is not split.

        Args:
            out: The model's output: the logits, or a dict, dataclass or Hugging Face ``ModelOutput`` holding them
                under ``logits`` (a dict and a ``ModelOutput`` are updated in place, a dataclass replaced).

        Returns:
            ``out`` with full-vocabulary logits.

        Raises:
            TypeError: When the output is split but holds no ``logits`` (a tuple, say: which element is the
                logits cannot be told).
        """
        if self.vocab_start is None or out is None:
            return out
        full = gather_from_tensor_parallel(_logits_of(out), self.tensor_group, -1)
        if isinstance(out, torch.Tensor):
            return full
        if isinstance(out, MutableMapping):
            out["logits"] = full  # a ModelOutput sets its attribute too
            return out
        return dataclasses.replace(out, logits=full)

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """The base class's step; ``loss_fn`` None means :meth:`cross_entropy` (needs a ``vocab_output`` layer). A
        given ``loss_fn`` gets the module's output as it is (split logits with a ``vocab_output`` layer). The base
        class's errors (e.g. a loss that is not one element) pass through.

        Args:
            inputs: This rank's input batch (the same on every rank of a tensor group).
            targets: The matching targets.
            loss_fn: ``loss_fn(outputs, targets)`` returning a scalar loss tensor, or None for :meth:`cross_entropy`.
            optimizer: Stepped and zeroed after backward; None leaves the step to the caller.

        Returns:
            The loss as the base class's ``train_step`` returns it (a 0-dim tensor on the device).

        Raises:
            ValueError: When ``loss_fn`` is None without a ``vocab_output`` layer.
        """
        if loss_fn is None:
            if self.vocab_start is None:
                raise ValueError(
                    "train_step: pass loss_fn; only a plan with a 'vocab_output' layer has a default "
                    "loss (vocab_parallel_cross_entropy)"
                )
            loss_fn = self.cross_entropy
        return super().train_step(inputs, targets, loss_fn, optimizer)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The base class's prediction; a vocabulary-split output is gathered into full logits.

        Args:
            inputs: The model's input.

        Returns:
            The model's output, with full logits when the output layer is split by vocabulary (collective within
            the tensor group then): the output itself, or its ``logits`` (:meth:`gather_logits`).

        Raises:
            TypeError: When the output is split but holds no ``logits`` (:meth:`gather_logits`).
        """
        return self.gather_logits(super().predict(inputs))


class TensorParallelModel(VocabParallelOutput, ShardedModel):
    """Tensor (Megatron) parallelism: layers split within themselves over groups of ``tensor_parallel_size``
    consecutive ranks, converted in place from ``plan`` (module name -> style, see :data:`PLAN_STYLES`, or a
    function of the module such as :func:`tinylm_plan`); the ranks left over are data-parallel replicas.

    Shards: the planned layers' weights (1/tp each; LayerNorms, position embeddings and row-parallel biases stay
    replicated), so their gradients and optimizer state too. Communicates: an all-reduce of the activations per
    column/row pair in forward and another in backward, within the tensor group; with data parallelism, one
    all-reduce (average) of the local gradients per step over the data group, at the end of backward. Use it when
    a layer's weights or activations do not fit on one device; every rank of a tensor group gets the same inputs,
    each data-parallel replica its own slice of the batch.

    Train with a plain optimizer over ``model.parameters()`` (each rank steps its own shard): the collectives make
    every shard's gradient complete, and replicated parameters get identical gradients on the tensor group's
    ranks. ``loss.backward(); opt.step()`` is enough. With a ``vocab_output`` layer, ``model(x)`` returns logits
    split by vocabulary (this rank's ``[vocab_start, vocab_start + V/tp)``; inside the output object of a model
    that returns one): take the loss with :meth:`cross_entropy` (``train_step`` does when ``loss_fn`` is None);
    :meth:`predict` and :meth:`gather_logits` give full logits, and ``model(x, labels=y)`` (a Hugging Face model's
    own loss) gathers them in that forward, so the loss is the unsplit model's.
    Parameter names stay those of the module; :meth:`gather_full_parameters`, :meth:`full_state_dict` and
    ``save_model("x.safetensors")`` give the full, unsplit model; ``save_model("folder")`` and
    :func:`gpudist.save_checkpoint` write each element once (a shard divided among the replicas holding it, a
    replicated parameter among all ranks), loadable into any strategy and layout.

    Args:
        module: The full model (every rank builds the same one); its planned layers are converted in place.
        config: The settings of the wrapper; ``config.backend`` is the world group the layout divides.
        plan: Module name -> style (:data:`PLAN_STYLES`; ``*`` in a name matches one component of it, e.g.
            ``"layers.*.mlp.fc1"``), a function of the module returning one, or ``"auto"``: a Hugging Face model's
            own plan from its config (:func:`hf_plan`).
        tensor_parallel_size: Ranks per tensor group; it must divide the world size (None: the world size, no
            data parallelism).

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already wrapped, ``config`` is not a
            :class:`~gpudist.ShardingConfiguration`, or ``plan`` is not a non-empty mapping (or a function
            returning one) or maps a submodule to a style that does not convert its type.
        ValueError: When ``tensor_parallel_size`` is not an int >= 1 or does not divide the world size, a plan
            entry is invalid (unknown style, no such submodule, a size ``tensor_parallel_size`` does not divide,
            a tied parameter split two ways, attention heads or key/value heads that tp does not divide, a ``*``
            pattern matching nothing, ``"auto"`` on a model without a plan in its config), or ranks wrap modules
            whose parameter names, shapes or dtypes differ.
    """

    strategy = "tensor"

    def __init__(self, module: nn.Module, config, plan: Plan, tensor_parallel_size: int | None = None):
        if isinstance(config, ShardingConfiguration):  # otherwise the base class says what config must be
            world = config.backend.world_size
            tp = world if tensor_parallel_size is None else tensor_parallel_size
            if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and world % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide the world size {world}; use one of "
                    f"{divisors(world)} (the ranks left over form data-parallel replicas)"
                )
            self._setup = {"plan": plan, "layout": ParallelLayout.resolve(world, 1, tp)}
        super().__init__(module, config)

    # -- construction ----------------------------------------------------------------------------------------------

    def initialize_sharding(self) -> None:
        module, comm = self.module, self.comm
        layout: ParallelLayout = self._setup["layout"]
        tp = layout.tensor_parallel_size
        plan = self._setup["plan"]
        entries = validate_plan(module, plan, tp)  # before any communication
        self.layout = layout
        _, self.data_parallel_rank, self.tensor_parallel_rank = layout.coords(self.rank)
        self._table = module_table(module)
        self._check_same_model()
        broadcast_tensors(comm, [*module.parameters(), *module.buffers()])
        self.tensor_group = comm if tp == comm.world_size else make_groups(comm, layout.groups("tensor"))
        self.data_group = None
        if layout.data_parallel_size > 1:
            self.data_group = comm if tp == 1 else make_groups(comm, layout.groups("data"))

        self._splits, self._vocab_output = apply_plan(module, entries, self.tensor_group)
        self._keys = list(module.state_dict().keys())
        self._install_hooks()

    def _install_hooks(self) -> None:
        self._end = EndOfBackward(self._finish_backward)
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- layout ----------------------------------------------------------------------------------------------------

    @property
    def pipeline_parallel_rank(self) -> int:
        """Always 0: tensor parallelism has one pipeline stage."""
        return 0

    @property
    def pipeline_parallel_size(self) -> int:
        """Always 1: tensor parallelism has one pipeline stage."""
        return 1

    @property
    def tensor_parallel_size(self) -> int:
        """The number of ranks each planned layer is split over."""
        return self.layout.tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """The number of data-parallel replicas (the ranks left over)."""
        return self.layout.data_parallel_size

    @property
    def vocab_start(self) -> int | None:
        """First vocabulary id of this rank's logits (None without a ``vocab_output`` layer)."""
        return None if self._vocab_output is None else self.module.get_submodule(self._vocab_output).output_start

    def manages(self, param: torch.Tensor) -> bool:
        return any(param is p for p in self.module.parameters())

    def capture_refusal(self) -> str | None:
        """Tensor parallelism is not captured yet."""
        return "tensor parallelism is not captured yet; run it eagerly"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the converted module. With a ``vocab_output`` layer its logits are split by vocabulary, except in a
        call given ``labels`` (a Hugging Face model computing its own loss from them): the output layer then
        gathers full logits (each rank holds ``[..., V]`` for that call), so the model's loss and the returned
        logits are the unsplit model's; the gradient of the full logits goes back to each rank's slice."""
        self._end.clear()  # a backward that failed half way must not keep the next one from syncing
        if self._vocab_output is None or kwargs.get("labels") is None:
            return self.module(*args, **kwargs)
        head = self.module.get_submodule(self._vocab_output)
        head.gather_output = True
        try:
            return self.module(*args, **kwargs)
        finally:
            head.gather_output = False

    # -- training --------------------------------------------------------------------------------------------------

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        self._end.arm()

    def _finish_backward(self) -> None:
        self.synchronize_gradients()
        self._mark_step_bytes()

    @torch.no_grad()
    def synchronize_gradients(self) -> None:
        """Average every local gradient over the data-parallel group (backward already does it; averaging again is
        harmless, as the replicas then agree). Tensor-parallel gradients need nothing: the layers' collectives
        made each shard's gradient complete."""
        if self.data_group is not None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            reduce_gradients_in(self.data_group, params, ReductionOperation.AVERAGE)

    def _bytes_total(self) -> int:
        comms = {id(c): c for c in (self.comm, self.tensor_group, self.data_group) if c is not None}
        return sum(c.stats.total_bytes for c in comms.values())

    # -- full parameters -------------------------------------------------------------------------------------------

    def parameter_count(self) -> int:
        return sum(torch.Size(row["shape"]).numel() for row in self._table)

    def parameter_table(self) -> list[dict]:
        return copy.deepcopy(self._table)

    def _full(self, name: str) -> torch.Tensor:
        """The full value of parameter ``name`` (collective within the tensor group when it is split)."""
        local = self.module.get_parameter(name).detach()
        split = self._splits.get(name)
        return local if split is None else split.gather(local, self.tensor_group)

    def gather_full_parameters(self) -> torch.Tensor:
        """The unsplit module's parameters flattened in its ``parameters()`` order; identical on every rank.

        Collective within the tensor group.

        Returns:
            A 1-D tensor of :meth:`parameter_count` elements (empty without parameters).
        """
        if not self._table:
            return torch.empty(0)
        return torch.cat([self._full(row["name"]).reshape(-1) for row in self._table])

    @torch.no_grad()
    def _write(self, name: str, full: torch.Tensor) -> None:
        local, split = self.module.get_parameter(name), self._splits.get(name)
        tp = self.tensor_group
        local.copy_(full.view(local.shape) if split is None else split.shard(full, tp.rank, tp.world_size))

    def set_parameters(self, flat: torch.Tensor) -> None:
        """Overwrite every parameter from a full vector in the unsplit module's ``parameters()`` order (the same on
        every rank; each takes its shard).

        Args:
            flat: The unsplit module's parameters, as :meth:`gather_full_parameters` returns them.

        Raises:
            ValueError: When ``flat`` is not a 1-D tensor of :meth:`parameter_count` elements.
        """
        self._check_flat(flat)
        at = 0
        for row in self._table:
            n = torch.Size(row["shape"]).numel()
            self._write(row["name"], flat[at : at + n].view(row["shape"]))
            at += n

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit module's state (collective within the tensor group): what a single process would hold.

        Returns:
            The unsplit module's ``state_dict()`` keys mapped to full tensors (a tied parameter's other names to
            copies).
        """
        full: dict[str, torch.Tensor] = {}
        for row in self._table:
            value = full[row["name"]] = self._full(row["name"])
            for name in row["aliases"]:  # a copy each: safetensors refuses tensors that share memory
                full[name] = value.clone()
        buffers = {k: v.detach() for k, v in self.module.named_buffers()}
        return {k: full[k] if k in full else buffers[k] for k in self._keys}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for row in self._table:
            self._write(row["name"], state[row["name"]])
        for k, v in self.module.named_buffers():
            v.copy_(state[k])

    def clone(self) -> TensorParallelModel:
        """A new wrapper over a copy of the converted module, on the same groups (collective: every rank calls it).

        Returns:
            The new wrapper, sharing this one's ``config`` and communication groups.
        """
        shared = {id(x): x for x in (self.config, self.comm, self.tensor_group, self.data_group) if x is not None}
        twin = copy.deepcopy(self, shared)
        twin._install_hooks()  # deepcopy does not copy gradient hooks
        twin._optimizers = weakref.WeakSet()
        self.config._models.add(twin)
        return twin

    # -- checkpoints -----------------------------------------------------------------------------------------------

    shards_parameters = True

    def checkpoint_segments(self) -> list[tuple[torch.Tensor, list[tuple[int, int, str, int]]]]:
        """Each parameter this rank holds: a replicated one whole, a split one as its runs in the full parameter
        (:meth:`Split.segments`; one per row for a rowwise weight).

        Returns:
            ``(tensor, pieces)`` pairs, as :meth:`ShardedModel.checkpoint_segments`.
        """
        return [
            (
                p := self.module.get_parameter(row["name"]),
                held_segments(row["name"], p, self._splits.get(row["name"]), self.tensor_group),
            )
            for row in self._table
        ]

    def checkpoint_share(self, name: str, across_replicas: bool = True) -> tuple[int, int] | None:
        """Split parameters are written once per tensor rank (shared by the data-parallel replicas), unsplit ones
        (LayerNorms, row-parallel biases) once in all (shared by every rank): :func:`replica_share`.

        Args:
            name: A parameter's name in the unsplit module.
            across_replicas: False for state already split over the data-parallel replicas.

        Returns:
            ``(copies, index)``, as :meth:`ShardedModel.checkpoint_share`.
        """
        return replica_share(self.layout, self.rank, name in self._splits, across_replicas)

    # -- reporting -------------------------------------------------------------------------------------------------

    def get_model_metadata(self) -> dict[str, Any]:
        return {
            **super().get_model_metadata(),
            "layout": self.layout.describe(),
            "tensor_parallel_rank": self.tensor_parallel_rank,
            "data_parallel_rank": self.data_parallel_rank,
        }

    def extra_repr(self) -> str:
        return self.layout.describe()
