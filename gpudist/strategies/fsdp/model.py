"""The ZeRO-3/FSDP model wrappers: :class:`ZeRO3Model` and :class:`FSDPModel` (its FSDP naming and wrap policy).

The wrapper cuts the module into units and groups (:mod:`.layout`, once), holds the :class:`~.step.Step` its groups
share, registers the forward hooks that drive it, and answers everything outside the step: full parameters,
checkpoints, clipping, memory."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ... import kernels
from ...comm import CommunicationBackend
from ...flat import broadcast_tensors
from ..model import ShardedModel, model_fingerprint, same_on_every_rank
from .collectives import Collectives, ShardReplicaGroup
from .group import ParamGroup
from .layout import UnitSpec, expose_device_and_dtype, group_layouts, merge_small_units, unit_names
from .step import Phase, Step, hook_gradients

__all__ = ["FSDPModel", "ZeRO3Model"]


class ZeRO3Model(ShardedModel):
    """ZeRO stage 3: parameters, gradients and optimizer state all split 1/N; parameters gathered per unit.

    ``units`` picks the submodules gathered together: module names or objects, module classes, or a predicate
    ``(name, module) -> bool``; by default every submodule that holds parameters itself (DeepSpeed ZeRO-3's
    granularity). Bigger units mean fewer, larger collectives and more memory in flight.

    ``model.parameters()`` yields this rank's shards (1-D); build the optimizer from them and pair it with
    :class:`gpudist.ZeRO3Optimizer` (fused Adam/AdamW/SGD over the shards, global-norm clipping), or use any
    torch optimizer directly (then clip with :meth:`clip_grad_norm_`). Outside forward the module's parameter
    attributes are empty; :meth:`gather_full_parameters` and :meth:`full_state_dict` give the full values.
    Every rank must run the same units in the same order (as for FSDP).

    Activation checkpointing (``torch.utils.checkpoint``, re-entrant or not, around a unit's call or inside it, and
    Hugging Face's ``gradient_checkpointing_enable()``) works on units: when gradients reach a unit's output, the
    unit is gathered before its backward (as FSDP2's pre-backward hook does), so the recomputed forward finds its
    parameters; it is released with its gradient's reduce-scatter, and adds no communication. Checkpointed code
    must not use the root's parameters (those of no unit): make the checkpointed modules units, e.g. with
    :class:`FSDPModel`'s default policy, every block of an ``nn.ModuleList``.

    The wrapped module can still be called directly (e.g. by Hugging Face's ``generate()``): every unit, the root
    included, is gathered for its forward and released after it. Its ``device`` and ``dtype`` properties, where its
    class has them (Hugging Face models), answer from the shards, so the module's class becomes a subclass of the
    same name, as FSDP2 does. :meth:`full_parameters` gathers everything for a ``with`` block instead.

    Hybrid sharding (HSDP): with ``replicate_group``, ``config.backend`` is the shard group (a node's ranks,
    ``topology.intra``) and ``replicate_group`` the ranks holding the same shard on the other nodes
    (``topology.inter``). Each unit's gradient is reduce-scattered in the shard group, then its shard all-reduced
    over the replicas; every rank starts from the values of rank 0 of both groups. Only the small all-reduce of
    P/N crosses the slow link, instead of all of FSDP's ``3 (N-1)/N x P`` over the whole world. Checkpoints are
    written by every rank of every replica (the replicas of a shard each write a part of it, so every element once)
    and load into any strategy and layout, as every checkpoint does.

    hpZ (ZeRO++'s hierarchical partitioning, ``secondary_group``): parameters sharded over the whole world as in
    plain ZeRO-3, but when forward gathers a unit (over the world) each rank keeps its ``1/L`` of the gathered vector
    (``secondary_group`` = the ``L`` ranks of its node, ``topology.intra``), and backward re-gathers the unit from
    those inside the node. One of the three world collectives of P per step moves onto the node's links; memory
    grows by the secondary partitions, ``P/L`` per rank between forward and the unit's gradient (all units kept
    after forward, each dropped once its gradient is reduced). The gradient reduce-scatter still runs over the
    world (ZeRO++'s qgZ, quantized gradients, is not implemented).

    Args:
        module: The ``nn.Module`` to wrap; every rank must build the same architecture. Its parameters take rank
            0's values and are replaced by this rank's shards.
        config: The settings shared with the paired optimizer; ``config.backend`` is the group the parameters
            are sharded over.
        units: The gathering units, as described above: module names or objects, module classes (a class or a
            tuple of them), or a predicate ``(name, module) -> bool``; None: every submodule that holds
            parameters itself.
        replicate_group: HSDP's replica group (this rank's peers holding the same shard), as described above;
            None: plain ZeRO-3 over ``config.backend``.
        secondary_group: ZeRO++'s hpZ, as described above: the node's ranks (``topology.intra``), whose number
            divides ``config.backend``'s; exclusive with ``replicate_group``. None: backward gathers over
            ``config.backend`` as forward does.
        min_unit_numel: Units that would gather fewer elements are merged, innermost first, into the nearest
            enclosing unit (or the root): a LayerNorm or a bias-only module then costs no collectives of its own.
            Each unit costs three collectives per step (two gathers, a reduce-scatter), and on a host-bound step or
            a slow link their count, not their bytes, sets the time; DeepSpeed ZeRO-3 leaves parameters under its
            ``stage3_param_persistence_threshold`` (100K elements) unpartitioned for the same reason. 0 (default):
            every unit stays.

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already wrapped, ``config`` is not a
            :class:`~gpudist.ShardingConfiguration`, or ``replicate_group`` or ``secondary_group`` is not a gpudist
            backend.
        ValueError: When ``min_unit_numel`` is not an int >= 0, a unit named in ``units`` is not a submodule of
            ``module``, ranks wrap modules whose parameter names, shapes or dtypes differ (in either group),
            ``replicate_group`` or ``secondary_group`` works on another device type than ``config.backend``, both
            are given, or ``secondary_group``'s size does not divide ``config.backend``'s.
    """

    strategy = "zero3"

    def __init__(
        self,
        module: nn.Module,
        config,
        units: UnitSpec = None,
        *,
        replicate_group: CommunicationBackend | None = None,
        secondary_group: CommunicationBackend | None = None,
        min_unit_numel: int = 0,
    ):
        if isinstance(min_unit_numel, bool) or not isinstance(min_unit_numel, int) or min_unit_numel < 0:
            raise ValueError(
                f"{type(self).__name__}: min_unit_numel={min_unit_numel!r} must be an int >= 0 (elements; 0 keeps "
                "every unit, e.g. 100_000 merges units smaller than that into the enclosing one)"
            )
        self._unit_spec = units
        self._min_unit_numel = min_unit_numel
        self._picked: list[str] | None = None
        """The units picked (``units``, then ``min_unit_numel``), fixed the first time they are asked for, before
        wrapping moves the parameters out of the modules (a pick after it would see modules holding nothing)."""
        backend = getattr(config, "backend", None)
        for name, group, example in (
            ("replicate_group", replicate_group, "topology.inter"),
            ("secondary_group", secondary_group, "topology.intra"),
        ):
            if group is None:
                continue
            if not isinstance(group, CommunicationBackend):
                raise TypeError(
                    f"{name} must be a gpudist CommunicationBackend (e.g. {example}), got {type(group).__name__}"
                )
            if backend is not None and group.device.type != backend.device.type:
                raise ValueError(
                    f"{name} works on {group.device.type} tensors but config.backend on "
                    f"{backend.device.type}; build both groups from one world backend"
                )
        if secondary_group is not None:
            if replicate_group is not None:
                raise ValueError(
                    "secondary_group (hpZ) and replicate_group (HSDP) together: HSDP already gathers inside the node; "
                    "pass one of them (hpZ: shard over the world, config.backend = the world group)"
                )
            if backend is not None and backend.world_size % secondary_group.world_size:
                raise ValueError(
                    f"secondary_group has {secondary_group.world_size} ranks, which does not divide config.backend's "
                    f"{backend.world_size}; pass the node's group (topology.intra)"
                )
        self.replicate_group = replicate_group
        """HSDP's replica group, or None (plain ZeRO-3/FSDP)."""
        self.secondary_group = secondary_group
        """hpZ's group (the node's ranks) that backward gathers over from the secondary partitions, or None."""
        super().__init__(module, config)

    def capture_refusal(self) -> str | None:
        """Why a captured graph could not replay this step, or None. Sharding over ``config.backend`` alone captures;
        HSDP's replica group and hpZ's secondary group run collectives that :func:`gpudist.capture` neither pauses
        (their watchdogs would query events inside capture) nor compares across ranks: refused until proven.

        Returns:
            The reason and the way out, or None.
        """
        extra = "replicate_group (HSDP)" if self.replicate_group is not None else None
        if self.secondary_group is not None:
            extra = "secondary_group (hpZ)"
        if extra is None:
            return None
        return (
            f"its {extra} runs collectives over another group, which capture neither pauses nor checks; "
            f"build {type(self).__name__} without it to capture, or run it eagerly"
        )

    @property
    def replicas(self) -> int:
        """How many copies of each shard there are: ``replicate_group``'s size (1 without one)."""
        return 1 if self.replicate_group is None else self.replicate_group.world_size

    # -- construction ---------------------------------------------------------------------------------------------

    def _unit_names(self) -> list[str]:
        if self._picked is None:
            names = unit_names(self._unit_spec, self.module, type(self).__name__)
            self._picked = merge_small_units(names, self.module, self._min_unit_numel)
        return list(self._picked)

    def traffic_settings(self) -> dict[str, Any]:
        """The base settings, plus the units (each is gathered and reduce-scattered as one collective)."""
        units = list(dict.fromkeys(self._unit_names()))
        secondary = None if self.secondary_group is None else self.secondary_group.world_size
        return {**super().traffic_settings(), "units": units, "replicas": self.replicas, "secondary": secondary}

    def initialize_sharding(self) -> None:
        module, comm = self.module, self.comm
        self._keys = list(module.state_dict().keys())
        self._check_same_model()
        if self.replicate_group is not None:  # every replica starts from rank 0's values, like every shard
            if not same_on_every_rank(self.replicate_group, model_fingerprint(module)):
                raise ValueError(
                    f"{type(self).__name__}: the replicas in replicate_group wrap modules whose parameter names, "
                    "shapes or dtypes differ; every rank must build the same model before wrapping it"
                )
            broadcast_tensors(self.replicate_group, [*module.parameters(), *module.buffers()])
        broadcast_tensors(comm, [*module.parameters(), *module.buffers()])
        units = [""] + [n for n in dict.fromkeys(self._unit_names()) if n]  # the root first, then pre-order
        layouts, slots, self._param_names = group_layouts(module, units, self.world_size, self.rank)
        self._collectives = Collectives(comm, self.replicate_group)
        self._step = Step(
            self.config,
            self._collectives,
            layouts,
            units,
            self.secondary_group,
            self.replicas,
            self._mark_step_bytes,
            type(self).__name__,
        )
        self._groups = self._step.groups
        self._param_slot: list[tuple[ParamGroup, int]] = [(self._groups[i], j) for i, j in slots]
        """Per parameter of the wrapped module's ``parameters()`` (tied ones once): its group and position there."""
        for group in self._groups:
            self.register_parameter(f"shard_{group.layout.index}", group.shard)
        for group in self._groups:
            for owners in group.layout.places:
                for mod, attr in owners:
                    del mod._parameters[attr]
            group.reshard()
        self._shard_ids = {id(g.shard) for g in self._groups}
        step = self._step
        self._hooks = [
            module.register_forward_pre_hook(lambda m, a: step.root_pre_forward()),
            module.register_forward_hook(lambda m, a, o: step.root_post_forward()),
        ]
        modules = dict(module.named_modules())
        for name in units[1:]:
            sub = modules[name]
            self._hooks.append(sub.register_forward_pre_hook(lambda m, a, name=name: step.unit_pre_forward(name)))
            self._hooks.append(sub.register_forward_hook(lambda m, a, o, name=name: step.unit_post_forward(name, o)))
        self._units = units
        self._wrapped_class = type(module)
        expose_device_and_dtype(module, [g.shard for g in self._groups])

    # -- forward and backward -------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        step = self._step
        if step.phase is Phase.SUMMONED:  # inside full_parameters(): the module holds its full parameters
            return self.module(*args, **kwargs)
        if step.failed_half_way:
            step.reset()
        with torch.autograd.graph.saved_tensors_hooks(step.saved.pack, step.saved.unpack):
            try:
                out = self.module(*args, **kwargs)  # the module's hooks gather and reshard (Step.root_pre_forward)
            finally:
                step.end_forward()  # also after a forward that raised
        hook_gradients(out, lambda: step.unit_pre_backward(""))
        return out

    def _bytes_total(self) -> int:
        extra = sum(g.stats.total_bytes for g in (self.replicate_group, self.secondary_group) if g is not None)
        return super()._bytes_total() + extra

    def synchronize_gradients(self) -> None:
        """Nothing to do: backward leaves every shard's ``.grad`` the global average of its range."""

    def manages(self, param: torch.Tensor) -> bool:
        return id(param) in self._shard_ids

    # -- full parameters --------------------------------------------------------------------------------------------

    def _module_params(self) -> list[nn.Parameter]:
        return [g.shard for g in self._groups]

    def parameter_count(self) -> int:
        return sum(g.layout.total for g in self._groups)

    @torch.no_grad()
    def _full_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, full tensor) per parameter in the wrapped module's ``parameters()`` order (collective)."""
        vectors = [self._collectives.gather_full(g.shard, g.layout.gathered) for g in self._groups]
        out = []
        for name, (group, j) in zip(self._param_names, self._param_slot, strict=True):
            layout = group.layout
            at = layout.offsets[j]
            out.append((name, vectors[layout.index][at : at + layout.numels[j]].view(layout.shapes[j])))
        return out

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[nn.Module]:
        """Every parameter of the wrapped module gathered and registered on it again, for the ``with`` block; the
        shards are restored at its end (collective on entry: every rank enters it).

        Inside, the module is an ordinary one: ``module.parameters()``, ``state_dict()``, Hugging Face's
        ``device``, ``dtype`` and ``generate()`` all work, with no gathering per call. The parameters are full
        copies that do not require grad, and changes made to them are discarded on exit: it is for inference,
        generation and inspection, not for training. Costs the full model's memory while it is open.

        Yields:
            The wrapped module.

        Raises:
            RuntimeError: When it is already open (it does not nest).
        """
        if self._step.phase is Phase.SUMMONED:
            raise RuntimeError(f"{type(self).__name__}.full_parameters() is already open; it does not nest")
        for (_, full), (group, j) in zip(self._full_params(), self._param_slot, strict=True):
            param = nn.Parameter(full, requires_grad=False)
            for mod, attr in group.layout.places[j]:
                mod.__dict__.pop(attr, None)  # the empty placeholder between forwards
                mod._parameters[attr] = param
        previous = self._step.summon()
        try:
            yield self.module
        finally:
            self._step.unsummon(previous)
            for group in self._groups:
                for owners in group.layout.places:
                    for mod, attr in owners:
                        mod._parameters.pop(attr, None)
                group.reshard()

    def gather_full_parameters(self) -> torch.Tensor:
        params = self._full_params()
        return torch.cat([t.reshape(-1) for _, t in params]) if params else torch.empty(0)

    @torch.no_grad()
    def set_parameters(self, flat: torch.Tensor) -> None:
        self._check_flat(flat)
        at = 0
        for group, j in self._param_slot:
            numel = group.layout.numels[j]
            self._write_param(group, j, flat[at : at + numel])
            at += numel

    @staticmethod
    def _write_param(group: ParamGroup, j: int, values: torch.Tensor) -> None:
        """Copy the part of one parameter's flattened ``values`` that falls in this rank's shard."""
        part = group.layout.in_shard(j)
        if part is not None:
            at, n, c = part
            group.shard.data[at : at + n].copy_(values.reshape(-1)[c : c + n])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for names, (_, t) in zip(self._all_names(), self._full_params(), strict=True):
            for name in names:
                tensors[name] = t
        tensors.update({k: v.detach() for k, v in self.module.named_buffers()})
        return {k: tensors[k] for k in self._keys}

    def _all_names(self) -> list[list[str]]:
        return [group.layout.names[j].split(",") for group, j in self._param_slot]

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for names, (group, j) in zip(self._all_names(), self._param_slot, strict=True):
            self._write_param(group, j, state[names[0]])
        for k, v in self.module.named_buffers():
            if k in state:  # non-persistent buffers (e.g. rotary frequencies) are in no state dict
                v.copy_(state[k])

    def clone(self) -> ZeRO3Model:
        """A new wrapper (same class and units) around a copy of the module holding the current full values.

        Collective: every rank calls it (the full values are gathered).

        Returns:
            The new wrapper, built with the same ``config``.
        """
        twin = copy.deepcopy(self.module)
        twin.__class__ = self._wrapped_class  # without the device/dtype properties this wrapper gave it
        for sub in twin.modules():  # the copy must not call this wrapper's gathering hooks
            for handle in self._hooks:
                sub._forward_pre_hooks.pop(handle.id, None)
                sub._forward_hooks.pop(handle.id, None)
        with torch.no_grad():
            for names, (group, _), (_, t) in zip(self._all_names(), self._param_slot, self._full_params(), strict=True):
                param = nn.Parameter(t.clone(), requires_grad=group.layout.requires_grad)
                for name in names:
                    owner, _, attr = name.rpartition(".")
                    sub = twin.get_submodule(owner)
                    sub.__dict__.pop(attr, None)
                    sub.register_parameter(attr, param)
        return type(self)(
            twin,
            self.config,
            self._units[1:],
            replicate_group=self.replicate_group,
            secondary_group=self.secondary_group,
        )

    shards_parameters = True

    def parameter_table(self) -> list[dict]:
        return [
            {
                "name": names[0],
                "aliases": names[1:],
                "shape": list(group.layout.shapes[j]),
                "dtype": str(group.layout.dtype).removeprefix("torch."),
            }
            for names, (group, j) in zip(self._all_names(), self._param_slot, strict=True)
        ]

    def checkpoint_segments(self) -> list[tuple[torch.Tensor, list[tuple[int, int, str, int]]]]:
        out = []
        for group in self._groups:
            segments = []
            for j, names in enumerate(group.layout.names):
                part = group.layout.in_shard(j)
                if part is not None:
                    at, n, c = part
                    segments.append((at, n, names.split(",")[0], c))
            out.append((group.shard, segments))
        return out

    def checkpoint_share(self, name: str, across_replicas: bool = True) -> tuple[int, int]:
        """HSDP: the ``replicas`` ranks holding this rank's shard (and, stepping the same gradients, the same
        optimizer state) split the writing of it, each the ``replicate_group.rank``-th part; plain ZeRO-3: this rank
        alone holds its shard."""
        if self.replicate_group is None:
            return 1, 0
        return self.replicate_group.world_size, self.replicate_group.rank

    def checkpoint_buffers(self) -> list[tuple[str, torch.Tensor, bool]]:
        first = self.replicate_group is None or self.replicate_group.rank == 0
        return [(n, b, first and self.rank == 0) for n, b in self.module.named_buffers()]

    @property
    def checkpoint_group(self):
        """The ranks a checkpoint is written over: ``comm``; HSDP: every rank of every replica (shard rank ``s`` of
        replica ``r`` as rank ``r x shards + s``), so each writes its own file and rank 0 of replica 0 the
        manifest."""
        if self.replicate_group is None:
            return self.comm
        if self._mesh is None:
            self._mesh = ShardReplicaGroup(self.comm, self.replicate_group)
        return self._mesh

    _mesh: ShardReplicaGroup | None = None

    # -- gradients and reports ------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every shard's gradient so the global L2 norm (over all ranks) is at most ``max_norm`` (collective).
        For plain torch optimizers; ZeRO3Optimizer clips by itself.

        Args:
            max_norm: The largest global L2 norm the gradients may have.

        Returns:
            The global norm before clipping.
        """
        grads = [g.shard.grad for g in self._groups if g.shard.grad is not None]
        total = torch.zeros(1, dtype=torch.float64, device=self.comm.device)
        for grad in grads:
            total += kernels.squared_norm(grad).double()
        self._collectives.sum_over_shards(total)
        norm = float(total.sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1.0:
            for grad in grads:
                grad.mul_(scale)
        return norm

    def memory_per_rank(self) -> dict[str, int]:
        mem = super().memory_per_rank()
        gathered = sum(g.full.numel() * g.full.element_size() for g in self._groups if g.full is not None)
        mem["gathered_parameters"] = gathered
        if self.secondary_group is not None:
            mem["secondary_parameters"] = sum(g.secondary.nbytes for g in self._groups)
        return mem

    def units(self) -> list[str]:
        """Names of the gathering units ("" is the root), in construction order.

        Returns:
            A new list of the units' module names, the root's ``""`` first.
        """
        return list(self._units)

    def extra_repr(self) -> str:
        replicas = f", replicas={self.replicas}" if self.replicate_group is not None else ""
        if self.secondary_group is not None:
            replicas += f", secondary={self.secondary_group.world_size}"
        return f"world_size={self.world_size}{replicas}, units={len(self._units)}, groups={len(self._groups)}"


class FSDPModel(ZeRO3Model):
    """Fully sharded data parallel: the ZeRO-3 mechanism with FSDP's naming and wrap policy.

    ``auto_wrap_policy`` picks the units as in FSDP: a set of module classes (e.g. ``{Block}``), a predicate
    ``(name, module) -> bool``, or None for each entry of every ``nn.ModuleList`` (torchtitan's choice:
    ``fully_shard`` per transformer block, the root for the rest). Pair it with :class:`gpudist.ZeRO3Optimizer`.

    Args:
        module: The ``nn.Module`` to wrap; every rank must build the same architecture.
        config: The settings shared with the paired optimizer; ``config.backend`` is the group the parameters
            are sharded over.
        auto_wrap_policy: The units, as described above (a set or list of module classes, a predicate, or None);
            anything else :class:`ZeRO3Model`'s ``units`` takes is accepted too.
        replicate_group: HSDP: the replica group, with ``config.backend`` the shard group (see
            :class:`ZeRO3Model`), e.g. ``FSDPModel(net, ShardingConfiguration(topo.intra), replicate_group=
            topo.inter)``; None: plain FSDP.
        secondary_group: hpZ (see :class:`ZeRO3Model`), e.g. ``FSDPModel(net, ShardingConfiguration(comm),
            secondary_group=topo.intra)``; None: backward gathers over ``config.backend``.
        min_unit_numel: Units smaller than this many elements merge into the enclosing unit (see
            :class:`ZeRO3Model`); 0: every unit stays.

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already wrapped, or ``config`` is not a
            :class:`~gpudist.ShardingConfiguration`.
        ValueError: When a unit named in ``auto_wrap_policy`` is not a submodule of ``module``, ranks wrap
            modules whose parameter names, shapes or dtypes differ, or ``min_unit_numel`` is not an int >= 0.
    """

    strategy = "fsdp"

    def __init__(
        self,
        module: nn.Module,
        config,
        auto_wrap_policy: UnitSpec = None,
        *,
        replicate_group: CommunicationBackend | None = None,
        secondary_group: CommunicationBackend | None = None,
        min_unit_numel: int = 0,
    ):
        if auto_wrap_policy is None:
            lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
            members = {id(child) for lst in lists for child in lst}
            auto_wrap_policy = lambda name, m: id(m) in members
        elif isinstance(auto_wrap_policy, (set, frozenset, list)):
            classes = [c for c in auto_wrap_policy if isinstance(c, type)]
            auto_wrap_policy = tuple(classes) if len(classes) == len(auto_wrap_policy) else list(auto_wrap_policy)
        super().__init__(
            module,
            config,
            units=auto_wrap_policy,
            replicate_group=replicate_group,
            secondary_group=secondary_group,
            min_unit_numel=min_unit_numel,
        )
