"""Where ZeRO-3/FSDP's gradients go once a group has them: a reduce-scatter over the shard group into the shard's
``.grad`` (one flat buffer for all shards, so the optimizer steps it in place), and with HSDP an all-reduce of the
reduced shard over the replicas in between. Each stage keeps at most :data:`IN_FLIGHT` collectives in flight."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .collectives import Collectives
from .group import ParamGroup

__all__ = ["IN_FLIGHT", "GradientQueue"]

IN_FLIGHT = 2
"""Reduce-scatters (and replica all-reduces) in flight at a time, as FSDP2 keeps one: each holds its unit's full-size
send buffer, so waiting for all of them at the end of backward held a full copy of the gradients at the peak."""


class _InFlight:
    """Collectives in flight, oldest first: ``finish(*entry)`` runs for the oldest whenever more than
    :data:`IN_FLIGHT` are, and for all of them at the end of backward."""

    def __init__(self, finish: Callable[..., None]):
        self.entries: list[tuple] = []
        self._finish = finish

    def add(self, entry: tuple) -> None:
        self.entries.append(entry)
        while len(self.entries) > IN_FLIGHT:
            self._finish(*self.entries.pop(0))

    def finish_all(self) -> None:
        for entry in self.entries:
            self._finish(*entry)

    def clear(self) -> None:
        self.entries = []


class GradientQueue:
    """The gradient path of one ZeRO-3 wrapper for a backward: owns the reduce-scatters in flight, HSDP's replica
    all-reduces in flight (its stage exists only with a replica group) and the flat gradient buffer of the shards.

    Args:
        collectives: The wrapper's collectives.
        groups: Every group, in index order (the trainable ones share the flat gradient buffer when they agree in
            dtype and device).
        communication_dtype: The wire dtype of the reduce-scatters (``config.communication_dtype``), or None: the
            group's own.
        replicas: HSDP's number of replicas (1: plain ZeRO-3).
    """

    def __init__(
        self, collectives: Collectives, groups: list[ParamGroup], communication_dtype: torch.dtype | None, replicas: int
    ):
        self._collectives = collectives
        self._groups = groups
        self._wire_dtype = communication_dtype
        self._scale = 1.0 / (collectives.comm.world_size * replicas)
        """The padding's gradient is zero. HSDP: 1/(N R), the replicas' all-reduce then SUMs the averaged shards."""
        # Reduced gradients land in one flat buffer of every trainable shard, in shard order, so the optimizer steps
        # it in place; the shards' .grad are its slices (and keep it alive until zero_grad drops them).
        trainable = [g for g in groups if g.layout.requires_grad]
        self._grad_at: dict[int, int] | None = None
        self._grad_numel = 0
        if len({(g.layout.dtype, g.layout.device) for g in trainable}) == 1:
            self._grad_at = {}
            for g in trainable:
                self._grad_at[g.layout.index] = self._grad_numel
                self._grad_numel += g.layout.padded
        self._flat_grads: torch.Tensor | None = None
        self._scattering = _InFlight(self._scattered)
        self._replicating = None if collectives.replicate_group is None else _InFlight(self._replicated)
        """HSDP's stage: the reduced shards' all-reduces over the replicas."""

    @property
    def in_flight(self) -> bool:
        """Whether reduce-scatters of this backward are still in flight (a backward that failed half way)."""
        return bool(self._scattering.entries)

    def reduce(self, group: ParamGroup, grad_full: torch.Tensor) -> None:
        """Start reduce-scattering ``group``'s full gradient (finishing the oldest beyond :data:`IN_FLIGHT`)."""
        layout = group.layout
        wire_dtype = self._wire_dtype or layout.dtype
        sent = torch.empty(layout.gathered, dtype=wire_dtype, device=layout.device)
        # One tensor of the send buffer's size: a scaled copy (computed in fp32 for 16-bit types, rounded once into
        # the wire dtype, as the pack kernel would) with no pack's per-call checks.
        torch.mul(grad_full.reshape(-1), self._scale, out=sent)
        slot = self._grad_slot(group)
        if slot is not None and wire_dtype == layout.dtype:
            received = slot  # straight into the shard's gradient
        else:
            received = torch.empty(layout.padded, dtype=wire_dtype, device=layout.device)
        # the unit's layout agrees on every rank by construction; sent is the unit's own packed copy
        work = self._collectives.start_reduce_scatter(sent, received)
        self._scattering.add((group, received, slot, work))

    def _scattered(self, group: ParamGroup, received: torch.Tensor, slot: torch.Tensor | None, work) -> None:
        """Wait for ``group``'s reduce-scatter; HSDP: start its shard's all-reduce over the replicas, else put the
        result in the shard's gradient."""
        work.wait()
        if self._replicating is None:
            self._store(group, received, slot)
            return
        self._replicating.add((group, received, slot, self._collectives.start_replica_all_reduce(received)))

    def _replicated(self, group: ParamGroup, received: torch.Tensor, slot: torch.Tensor | None, work) -> None:
        work.wait()
        self._store(group, received, slot)

    @staticmethod
    def _store(group: ParamGroup, received: torch.Tensor, slot: torch.Tensor | None) -> None:
        shard = group.shard
        if slot is not None:
            if received is not slot:
                slot.copy_(received)  # a low-precision wire
            shard.grad = slot
        elif shard.grad is None:
            shard.grad = received.to(shard.dtype)
        else:
            shard.grad.add_(received)

    def _grad_slot(self, group: ParamGroup) -> torch.Tensor | None:
        """Where this backward's gradient of ``group``'s shard goes when the shard has none yet: its slice of the
        flat gradient buffer, allocated by the first reduce after every shard's gradient was dropped. None when the
        shard already has a gradient (accumulate into it) or the shards differ in dtype or device."""
        if self._grad_at is None or group.shard.grad is not None:
            return None
        if self._flat_grads is None:
            if any(g.shard.grad is not None for g in self._groups if g.layout.requires_grad):
                return None  # some gradients kept (set by hand?): do not take a new buffer for the rest
            self._flat_grads = torch.empty(self._grad_numel, dtype=group.layout.dtype, device=group.layout.device)
        at = self._grad_at[group.layout.index]
        return self._flat_grads[at : at + group.layout.padded]

    def finish(self) -> None:
        """The end of backward: wait for every reduce-scatter (and replica all-reduce), in order, and store."""
        self._scattering.finish_all()
        if self._replicating is not None:
            self._replicating.finish_all()

    def reset(self) -> None:
        """Forget this backward's collectives (done, or abandoned by a backward that failed half way)."""
        self._scattering.clear()
        if self._replicating is not None:
            self._replicating.clear()
        self._flat_grads = None  # the shards' .grad hold it from here on
