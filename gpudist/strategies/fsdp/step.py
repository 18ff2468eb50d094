"""What a ZeRO-3 wrapper's groups share in a step: the wrapper's :class:`Phase`, the order units ran in (for
prefetching), the saved-tensor hooks, the gradient queue and the end of backward. The hooks on the wrapped module
call :class:`Step`'s methods, which call the groups' transitions (:mod:`.group`)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ...config import ShardingConfiguration
from ..reducer import EndOfBackward
from .collectives import Collectives
from .gradients import GradientQueue
from .group import ParamGroup, SecondaryPartition, TrainingState
from .layout import GroupLayout

__all__ = ["Phase", "Step"]


class Phase(enum.Enum):
    """What the wrapper's forward hooks do now."""

    SHARDED = "sharded"
    """Units gather for their forward and reshard after it (between steps, in forward, until backward starts)."""
    BACKWARD = "backward"
    """A backward reached this step's outputs and has not finished: a unit's forward is a recomputation."""
    SUMMONED = "summoned"
    """Inside ``full_parameters()``: the module holds its full parameters; the hooks stand aside."""


def hook_gradients(output: Any, hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever a gradient reaches a tensor of ``output`` (tensors in tuples, lists and dicts, e.g. a
    Hugging Face ``ModelOutput``) that autograd tracks."""
    if not torch.is_grad_enabled():
        return
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                item.register_hook(lambda grad: hook())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, Mapping):
            stack.extend(item.values())


class _SavedParam:
    """What autograd keeps for a saved view of a gathered group: where it points, not the memory."""

    __slots__ = ("group", "offset", "size", "stride")

    def __init__(self, group: ParamGroup, t: torch.Tensor):
        self.group, self.size, self.stride, self.offset = group, t.size(), t.stride(), t.storage_offset()


class SavedParams:
    """The saved-tensor hooks: autograd saves views of gathered vectors as :class:`_SavedParam` (the gathered memory
    is not kept from forward to backward), and backward gathers the group again when it first unpacks one.

    Args:
        step: The step whose prefetch order backward follows.
    """

    def __init__(self, step: Step):
        self._step = step
        self._live: dict[int, ParamGroup] = {}
        """Gathered vectors by storage address (registered by the groups while gathered)."""

    def register(self, group: ParamGroup) -> None:
        self._live[group.full.untyped_storage().data_ptr()] = group

    def unregister(self, group: ParamGroup) -> None:
        self._live.pop(group.full.untyped_storage().data_ptr(), None)

    def pack(self, t: torch.Tensor):
        try:
            group = self._live.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested, ...)
            return t
        if group is None or t.dtype != group.layout.dtype:
            return t
        return _SavedParam(group, t)

    def unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        group = saved.group
        fresh = not group.is_gathered
        full = group.wait_for_unshard()
        if fresh:
            self._step.prefetch_after(group, backward=True)
        return full.as_strided(saved.size, saved.stride, saved.offset)


class Step:
    """The wrapper's groups and what they share in a step.

    Owns the :class:`Phase`, the unit order (``order``: the groups in the order the last forward gathered them;
    reversed in backward, it is the prefetch order), the saved-tensor hooks, the gradient queue and the end-of-backward
    callback. The wrapped module's hooks call :meth:`root_pre_forward`, :meth:`unit_pre_forward`,
    :meth:`unit_post_forward`, :meth:`root_post_forward` and :meth:`unit_pre_backward`; a group's ``post_backward``
    calls :meth:`enter_backward`; the end of backward runs :meth:`finalize_backward`.

    Args:
        config: The wrapper's configuration (deferred mode: ``find_unused_parameters`` or no overlap).
        collectives: The wrapper's collectives.
        groups: ``(layout, shard)`` per group, in index order.
        units: The units' names, the root ``""`` first.
        secondary_group: hpZ's node group (each group gets a :class:`SecondaryPartition` over it), or None.
        replicas: HSDP's number of replicas (1 without).
        on_finish: Called after every backward that reached the end (the step's byte count).
        owner: The wrapper's class name, for errors.
    """

    def __init__(
        self,
        config: ShardingConfiguration,
        collectives: Collectives,
        groups: list[tuple[GroupLayout, nn.Parameter]],
        units: list[str],
        secondary_group,
        replicas: int,
        on_finish: Callable[[], None],
        owner: str,
    ):
        self.config = config
        self.collectives = collectives
        self.phase = Phase.SHARDED
        self.saved = SavedParams(self)
        self.groups = [
            ParamGroup(layout, shard, self, None if secondary_group is None else SecondaryPartition(secondary_group))
            for layout, shard in groups
        ]
        self.unit_groups: dict[str, list[ParamGroup]] = {u: [] for u in units}
        for group in self.groups:
            self.unit_groups[group.layout.unit].append(group)
        self.gradients = GradientQueue(collectives, self.groups, config.communication_dtype, replicas)
        self._order: list[ParamGroup] = []
        self._after: tuple[dict, dict] = ({}, {})
        """Per group (None: before the first), the one after it in :attr:`order`, forward and reversed (backward)."""
        self._seen: dict[ParamGroup, None] = {}
        """The groups this forward gathered so far, in order (a dict: a set that keeps the order)."""
        self._end = EndOfBackward(self.finalize_backward)
        self._on_finish = on_finish
        self._owner = owner

    @property
    def deferred(self) -> bool:
        """Gradients are reduce-scattered at the end of backward (every trainable group, used or not), not as each
        arrives."""
        return self.config.find_unused_parameters or not self.config.overlap_communication

    @property
    def failed_half_way(self) -> bool:
        """A backward left work behind (it raised before its end-of-backward callback ran)."""
        return self.gradients.in_flight or self._end.queued or self.phase is Phase.BACKWARD

    @property
    def order(self) -> list[ParamGroup]:
        """The groups in the order the last forward gathered them."""
        return self._order

    @order.setter
    def order(self, groups: list[ParamGroup]) -> None:
        self._order = list(groups)
        chains = (self._order, self._order[::-1])
        self._after = tuple(dict(zip([None, *chain], chain, strict=False)) for chain in chains)

    def prefetch_after(self, group: ParamGroup | None, backward: bool) -> None:
        """Start gathering the group that came after ``group`` (None: the first) in the last forward's order
        (reversed in backward; there only a trainable one). A lookup: nothing here grows with the group count."""
        after = self._after[backward].get(group)
        if after is not None and (not backward or after.layout.requires_grad):
            after.unshard()

    # -- forward (the wrapped module's hooks) -----------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        """The wrapped module's forward starts (from the wrapper's ``forward``, or called directly, e.g. by
        ``generate()``)."""
        if self.phase is not Phase.SHARDED:
            return
        self._seen = {}
        for group in self.groups:
            group.start_forward()
        self.unit_pre_forward("")

    def unit_pre_forward(self, unit: str) -> None:
        """``unit``'s forward starts: its groups gather (in backward: a recomputation) and the next is prefetched."""
        if self.phase is Phase.SUMMONED:
            return
        groups = self.unit_groups[unit]
        if self.phase is Phase.BACKWARD:  # recomputed for activation checkpointing: its gradient reshards it
            self._pre_backward(groups)
            return
        for group in groups:
            group.pre_forward()
            self._seen[group] = None
        if groups or unit == "":  # the root may hold nothing: then the first unit is next
            self.prefetch_after(groups[-1] if groups else None, backward=False)

    def unit_post_forward(self, unit: str, output: Any) -> None:
        """``unit``'s forward ended: its groups reshard, and a gradient reaching its output starts its backward."""
        if self.phase is not Phase.SHARDED:
            return
        for group in self.unit_groups[unit]:
            group.post_forward()
        hook_gradients(output, lambda: self.unit_pre_backward(unit))

    def root_post_forward(self) -> None:
        """The wrapped module's forward ended: the root's groups end theirs, the order is this forward's."""
        if self.phase is not Phase.SHARDED:
            return
        self.end_forward()
        self.order = self._seen

    def end_forward(self) -> None:
        """Every group out of its forward (the root's; any a forward that raised left) and resharded (anything
        prefetched but not used)."""
        for group in self.groups:
            if group.state is TrainingState.FORWARD:
                group.post_forward()
            else:
                group.reshard()

    # -- backward ---------------------------------------------------------------------------------------------------

    def unit_pre_backward(self, unit: str) -> None:
        """Gradients reached ``unit``'s output: backward is under way, and the unit is gathered now, before its own
        backward, so that a recomputation of its forward (activation checkpointing) finds its parameters. As
        FSDP2's pre-backward hook. The root's parameters are gathered as autograd asks for them (``unpack``)."""
        self.enter_backward()
        if unit:
            self._pre_backward(self.unit_groups[unit])

    def _pre_backward(self, groups: list[ParamGroup]) -> None:
        with torch.enable_grad():
            for group in groups:
                group.pre_backward()
        if groups:
            self.prefetch_after(groups[-1], backward=True)

    def enter_backward(self) -> None:
        """Queue the end-of-backward callback once, on the backward that reached this forward's outputs (not on a
        re-entrant checkpoint's inner backward, which would end first), and mark backward as under way."""
        if self.phase is Phase.SHARDED:
            self.phase = Phase.BACKWARD
        self._end.arm()

    def finalize_backward(self) -> None:
        """The end of backward: deferred mode reduce-scatters every trainable group now; otherwise a group autograd
        held that got no gradient is an error (ranks would disagree on the reduce-scatters). Then every collective
        is waited for, in order, and the step forgotten."""
        try:
            if not any(g.gradient_arrived for g in self.groups):
                pass  # this backward reached no parameter (e.g. torch.autograd.grad for the inputs): nothing to reduce
            elif self.deferred:
                for group in self.groups:
                    group.finalize_backward()
            else:
                missed = [g for g in self.groups if g.missed_gradient]
                if missed:
                    names = [n for g in missed for n in g.layout.names][:5]
                    raise RuntimeError(
                        f"{self._owner}: parameters used in forward got no gradient in this backward "
                        f"({', '.join(names)}), so ranks cannot agree on the reduce-scatters; pass "
                        "ShardingConfiguration(find_unused_parameters=True), or set requires_grad=False on them"
                    )
            self.gradients.finish()
        finally:
            self.reset()
        self._on_finish()

    def reset(self) -> None:
        """Forget the step: after its backward, or before a forward when a backward failed half way."""
        for group in self.groups:
            group.reset()
        self.gradients.reset()
        self._end.clear()
        if self.phase is Phase.BACKWARD:
            self.phase = Phase.SHARDED

    # -- full parameters --------------------------------------------------------------------------------------------

    def summon(self) -> Phase:
        """Enter ``full_parameters()``: the hooks stand aside. Returns the phase to restore."""
        if self.phase is Phase.SUMMONED:
            raise RuntimeError(f"{self._owner}.full_parameters() is already open; it does not nest")
        previous, self.phase = self.phase, Phase.SUMMONED
        return previous

    def unsummon(self, previous: Phase) -> None:
        """Leave ``full_parameters()`` (the wrapper puts the shards' placeholders back)."""
        self.phase = previous
