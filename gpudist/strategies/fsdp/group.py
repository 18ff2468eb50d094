"""One parameter group of ZeRO-3/FSDP and its lifecycle in a training step (FSDP2's ``FSDPParamGroup``).

A :class:`ParamGroup` owns all of its per-step state: where it is in the step (a :class:`TrainingState`), its
gathered vector and the gather in flight, whether autograd holds it and whether its gradient arrived, the gradient
kept for the end of backward, and hpZ's secondary partition (:class:`SecondaryPartition`, a part it holds). Only its
named transitions change the state, each checked against the states it may come from:

=====================  ========================================  =================================================
transition             called by                                 does
=====================  ========================================  =================================================
``pre_forward``        its unit's forward pre-hook               gather (wait), install the views -> FORWARD
``post_forward``       its unit's forward hook (the root's:      reshard -> IDLE
                       the root's forward hook)
``pre_backward``       a gradient reaching its unit's output,    gather and install again, for a recomputation
                       or its unit's forward pre-hook in         (activation checkpointing) -> PRE_BACKWARD
                       backward (a recomputation)
``post_backward``      ``_Unshard.backward`` (its gradient)      reshard, reduce-scatter the gradient (or keep it
                                                                 for the end of backward) -> POST_BACKWARD
``finalize_backward``  the end-of-backward callback (deferred    reduce-scatter what it kept (zeros if nothing)
                       mode)
``reset``              after every backward, after one that      reshard, forget the step -> IDLE
                       failed half way
=====================  ========================================  =================================================

The fixed layout (which parameters, offsets, shard range) is its :class:`~.layout.GroupLayout`, immutable.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from ...comm import CommunicationBackend
from .layout import GroupLayout

__all__ = ["ParamGroup", "SecondaryPartition", "TrainingState"]


class TrainingState(enum.Enum):
    """Where a :class:`ParamGroup` is in the training step."""

    IDLE = "idle"
    """Sharded, outside its unit's forward: between steps, and after its forward (autograd may hold it then)."""
    FORWARD = "forward"
    """Gathered and installed in its modules, for its unit's forward."""
    PRE_BACKWARD = "pre_backward"
    """Gathered and installed again before its gradient, so that a recomputed forward finds its parameters."""
    POST_BACKWARD = "post_backward"
    """Its gradient arrived in this backward: resharded, the gradient reduce-scattered or kept for the end."""


_IDLE, _FORWARD, _PRE, _POST = TrainingState
_FROM = {
    "pre_forward": (_IDLE, _FORWARD),  # FORWARD: a forward that raised left it installed; a new one starts over
    "post_forward": (_FORWARD,),
    "pre_backward": (_IDLE, _PRE, _POST),
    "post_backward": (_IDLE, _PRE, _POST),
    "finalize_backward": (_IDLE, _PRE, _POST),
}
"""The states each transition may start from; anything else is a step out of order (a bug in the caller)."""


class SecondaryPartition:
    """hpZ (ZeRO++'s hierarchical partitioning): this rank's ``1/L`` of a unit's gathered vector, kept from forward
    so that backward gathers the unit inside the node (over ``group``, ``L`` ranks) instead of over the world.

    Args:
        group: The node's ranks (``topology.intra``), ``L`` of them; ``L`` divides the shard group's size.
    """

    __slots__ = ("group", "partition")

    def __init__(self, group: CommunicationBackend):
        self.group = group
        self.partition: torch.Tensor | None = None
        """This rank's part of the gathered vector, or None (none kept: backward gathers over the world)."""

    def keep(self, full: torch.Tensor) -> None:
        """Keep this rank's ``1/L`` of ``full`` (``N/L`` padded shards: ``L`` divides ``N``)."""
        size = full.numel() // self.group.world_size
        at = self.group.rank * size
        self.partition = full[at : at + size].clone()

    def drop(self) -> None:
        self.partition = None

    @property
    def nbytes(self) -> int:
        return 0 if self.partition is None else self.partition.numel() * self.partition.element_size()


class _Unshard(torch.autograd.Function):
    """Forward: the group's gathered vector (as a view autograd tracks). Backward: its full gradient, handed to the
    group's ``post_backward``."""

    @staticmethod
    def forward(ctx, group: ParamGroup, shard: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return group.full.view_as(group.full)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.group.post_backward(grad_full)
        return None, None


class ParamGroup:
    """One flat vector of a unit, sharded over the ranks, and its state in the current step.

    Args:
        layout: Its fixed layout.
        shard: This rank's padded shard (the ``nn.Parameter`` the optimizer steps).
        step: The :class:`~.step.Step` its transitions report to (its collectives, saved-tensor hooks, gradient queue
            and end of backward); not imported here, which the step module imports.
        secondary: hpZ's part, or None.
    """

    def __init__(self, layout: GroupLayout, shard: nn.Parameter, step: Any, secondary: SecondaryPartition | None):
        self.layout = layout
        self.shard = shard
        self.secondary = secondary
        self._step = step
        self.state = TrainingState.IDLE
        self.full: torch.Tensor | None = None
        """The gathered vector (every rank's padded shard), while gathered or being gathered."""
        self._gathering = None
        """The gather in flight filling ``full`` (the backend's async handle), or None."""
        self.in_graph = False
        """An autograd graph of this step holds the gathered parameters (so a gradient is due)."""
        self.gradient_arrived = False
        """A gradient reached the group in this backward."""
        self._kept_gradient: torch.Tensor | None = None
        """Deferred mode: this backward's full gradient, reduce-scattered by :meth:`finalize_backward`."""
        self._empty = torch.empty(0, dtype=layout.dtype, device=layout.device)
        """What the modules' parameter attributes hold while resharded (made once: a reshard allocates nothing)."""

    def __repr__(self) -> str:
        return f"ParamGroup({self.layout.index}, unit={self.layout.unit!r}, {self.state.name})"

    # -- the gathered vector ----------------------------------------------------------------------------------------

    def unshard(self) -> None:
        """Start gathering (a prefetch): from every rank's shard, or with hpZ, once this step's forward kept the
        secondary partitions, from those inside the node (the same values: they are dropped when the next forward
        starts and when the gradient is reduced, before any shard can change). Nothing if gathered or gathering."""
        if self.full is not None or self._gathering is not None:
            return
        layout, collectives = self.layout, self._step.collectives
        full = torch.empty(layout.gathered, dtype=layout.dtype, device=layout.device)
        secondary = self.secondary
        if secondary is not None and secondary.partition is not None:
            self._gathering = collectives.start_all_gather(secondary.group, secondary.partition, full)
        else:
            self._gathering = collectives.start_all_gather(collectives.comm, self.shard.detach(), full)
        self.full = full

    @property
    def is_gathered(self) -> bool:
        """Whether the gathered vector is there (gathered and waited for)."""
        return self.full is not None and self._gathering is None

    def wait_for_unshard(self) -> torch.Tensor:
        """The gathered vector, gathering it first if needed. With hpZ, a forward whose backward will gather keeps
        the secondary partition here."""
        self.unshard()
        if self._gathering is not None:
            work, self._gathering = self._gathering, None
            work.wait()
            self._step.saved.register(self)
            secondary = self.secondary
            keeps = secondary is not None and secondary.partition is None
            if keeps and self.layout.requires_grad and torch.is_grad_enabled():  # a forward whose backward gathers
                secondary.keep(self.full)
        return self.full

    def reshard(self) -> None:
        """Drop the gathered vector (memory returns once autograd's saved views are gone: they are not kept)."""
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None
        if self.full is not None:
            self._step.saved.unregister(self)
            self.full = None
        empty = self._empty
        for owners in self.layout.places:
            for mod, attr in owners:
                # A plain attribute (the parameter left mod._parameters at wrap time): written into the instance
                # dict directly, as nn.Module.__setattr__ would after its checks, per tensor per unit and pass.
                mod.__dict__[attr] = empty

    def _install(self) -> None:
        """Gather and point the modules' parameter attributes at views of the vector; with autograd recording, the
        views come through :class:`_Unshard`, whose backward brings the gradient."""
        layout = self.layout
        full = self.wait_for_unshard()
        if layout.requires_grad and torch.is_grad_enabled():
            full = _Unshard.apply(self, self.shard)
            self.in_graph = True
        views = full[: layout.total].split(layout.numels)  # the padding at the end is no parameter's
        for view, owners, shape in zip(views, layout.places, layout.shapes, strict=True):
            view = view.view(shape)
            for mod, attr in owners:
                mod.__dict__[attr] = view  # as in reshard

    # -- the lifecycle ----------------------------------------------------------------------------------------------

    def _transition(self, name: str, to: TrainingState) -> None:
        allowed = _FROM[name]
        if self.state not in allowed:
            raise RuntimeError(
                f"{self!r}: {name} out of order, in state {self.state.name} (it follows "
                f"{' or '.join(s.name for s in allowed)}); the hooks of a ZeRO-3 wrapper drive its groups, do not "
                "call the transitions by hand"
            )
        self.state = to

    def pre_forward(self) -> None:
        """Its unit's forward starts: gather (waiting for a prefetch) and install the parameters."""
        self._transition("pre_forward", TrainingState.FORWARD)
        self._install()

    def post_forward(self) -> None:
        """Its unit's forward ended: reshard (autograd's saved views record where they point, not the memory)."""
        self._transition("post_forward", TrainingState.IDLE)
        self.reshard()

    def pre_backward(self) -> None:
        """Backward is about to need the group (a gradient reached its unit's output, or its unit is recomputed):
        gather and install it as :class:`_Unshard` outputs (the caller enables grad), so that a recomputed forward
        saves the tensors the first one saved (a re-entrant checkpoint also backpropagates through them). Once per
        backward until its gradient reshards it."""
        if self.state is TrainingState.PRE_BACKWARD:
            return  # installed already
        self._transition("pre_backward", TrainingState.PRE_BACKWARD)
        self._install()

    def post_backward(self, grad_full: torch.Tensor) -> None:
        """Autograd has the group's full gradient: reshard, and reduce-scatter it now (or, in deferred mode, keep it
        for :meth:`finalize_backward`)."""
        self._transition("post_backward", TrainingState.POST_BACKWARD)
        self._step.enter_backward()
        self.reshard()  # backward is done with this group's parameters
        self.gradient_arrived = True
        if self._step.deferred:
            kept = self._kept_gradient
            self._kept_gradient = grad_full if kept is None else kept + grad_full
            return
        self._reduce(grad_full)

    def finalize_backward(self) -> None:
        """Deferred mode, at the end of backward: reduce-scatter the gradient kept (zeros if none came: every rank
        reduces every trainable group, whichever it used)."""
        self._transition("finalize_backward", self.state)
        if not self.layout.requires_grad:
            return
        grad = self._kept_gradient
        if grad is None:
            layout = self.layout
            grad = torch.zeros(layout.gathered, dtype=layout.dtype, device=layout.device)
        self._reduce(grad)
        self._kept_gradient = None

    def reset(self) -> None:
        """Forget the step (after its backward, or one that failed half way): resharded, IDLE."""
        self.reshard()
        self.state = TrainingState.IDLE
        self.in_graph = self.gradient_arrived = False
        self._kept_gradient = None
        if self.secondary is not None:
            self.secondary.drop()

    def start_forward(self) -> None:
        """The wrapped module's forward starts: a secondary partition kept by a forward that had no backward may be
        stale."""
        if self.secondary is not None:
            self.secondary.drop()

    @property
    def missed_gradient(self) -> bool:
        """Autograd held the group in this step, and no gradient came in this backward."""
        return self.in_graph and not self.gradient_arrived

    def _reduce(self, grad_full: torch.Tensor) -> None:
        self._step.gradients.reduce(self, grad_full)
        if self.secondary is not None:
            self.secondary.drop()  # backward is done with this group
