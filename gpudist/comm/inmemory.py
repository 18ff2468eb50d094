"""In-memory backend: the ranks are threads of one process.

Used by unit tests and to simulate large worlds (16-64 ranks) cheaply. Ranks meet in a registry keyed by
the group name; the k-th collective of every rank lands in slot k of the group. The last rank to arrive
checks that all signatures agree, computes the result once (new tensors, so no rank ever reads another
rank's input after that rank returned), and wakes the others, who copy their part out.

Reductions of float16/bfloat16 accumulate in float32 and round once (Gloo rounds after every addition,
so results may differ from Gloo's in the last bit).

On a CUDA device, autograd runs backward work on one engine thread per device, shared by every Python thread of the
process: a rank whose gradient hook blocks in a collective there would hold up the other ranks' backward, whose hooks
issue the ops it waits for. So a rank of more than one must run its own backward, on its own thread
(``torch.autograd.set_multithreading_enabled(False)`` in force where it is constructed); ``run_ranks`` does this.

Point-to-point: the k-th ``recv`` from a rank matches that rank's k-th ``send`` to this rank, in posting
order; as on Gloo, a send completes once the matching recv is posted. A shape/dtype mismatch raises
:class:`CollectiveMismatchError` on both ranks, naming both sides.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .base import DEFAULT_TIMEOUT, CommunicationBackend
from .errors import CommunicationError, CommunicationTimeoutError
from .reduction import ReductionOperation
from .shards import shard_range
from .signature import Signature, mismatch_error, p2p_mismatch_error
from .work import Work

__all__ = ["InMemoryCommunicationBackend"]


class _Slot:
    __slots__ = ("done", "error", "payloads", "readers_left", "result", "signatures")

    def __init__(self, world_size: int):
        self.signatures: dict[int, Signature] = {}
        self.payloads: dict[int, Any] = {}
        self.result: Any = None
        self.error = False
        self.done = False
        self.readers_left = world_size


class _GroupState:
    """What the ranks of one in-memory group share: collective slots, mailboxes and the failure state."""

    def __init__(self, name: str, world_size: int):
        self.name = name
        self.world_size = world_size
        self.cond = threading.Condition()
        self.slots: dict[int, _Slot] = {}
        self.mail: dict[tuple[int, int, int], dict[str, tuple[Signature, torch.Tensor | None]]] = {}
        self.sent: dict[tuple[int, int], int] = {}
        self.posted: dict[tuple[int, int], int] = {}
        self.joined: set[int] = set()
        self.broken: CommunicationError | None = None
        self.children: weakref.WeakSet[_GroupState] = weakref.WeakSet()  # groups new_group made from this one

    def fail(self, error: CommunicationError) -> None:
        """Break this group and every group made from it (an abort must release a rank waiting in a sub-group too:
        a pipeline's or a data-parallel group's); the first cause is kept."""
        with self.cond:
            if self.broken is None:
                self.broken = error
            self.cond.notify_all()
            children = list(self.children)
        for child in children:
            child.fail(error)


_REGISTRY: dict[str, _GroupState] = {}
_REGISTRY_LOCK = threading.Lock()


def _join(group: str, world_size: int, rank: int) -> _GroupState:
    with _REGISTRY_LOCK:
        state = _REGISTRY.get(group)
        if state is not None and state.broken is not None and state.broken.op != "abort":
            # A failed formation (a rank never joined, the others timed out): start afresh. A group a rank aborted
            # stays broken for the ranks still to join (their first op raises), or they would form a new group
            # without the rank that failed and wait for it until their timeout.
            state = None
        if state is None:
            state = _REGISTRY[group] = _GroupState(group, world_size)
        if state.world_size != world_size:
            raise ValueError(
                f"group '{group}' is forming with world_size {state.world_size} but rank {rank} asked for "
                f"{world_size}; every rank must pass the same world_size"
            )
        if rank in state.joined:
            raise ValueError(
                f"rank {rank} already joined group '{group}', which still waits for ranks "
                f"{sorted(set(range(world_size)) - state.joined)}; give each concurrent world its own group name"
            )
        state.joined.add(rank)
        if len(state.joined) == world_size:
            del _REGISTRY[group]  # formed: the next construction with this name starts a new group
        return state


def _reduce(tensors: list[torch.Tensor], op: ReductionOperation) -> torch.Tensor:
    stacked = torch.stack([t.reshape(-1) for t in tensors])
    dtype = stacked.dtype
    if dtype in (torch.float16, torch.bfloat16):
        stacked = stacked.float()
    if op is ReductionOperation.SUM:
        out = stacked.sum(0)
    elif op is ReductionOperation.AVERAGE:
        out = stacked.sum(0) / len(tensors)
    elif op is ReductionOperation.MAX:
        out = stacked.amax(0)
    elif op is ReductionOperation.MIN:
        out = stacked.amin(0)
    else:
        out = stacked.prod(0)
    return out.to(dtype)


class InMemoryCommunicationBackend(CommunicationBackend):
    """One rank of a group whose ranks are threads of this process.

    ``InMemoryCommunicationBackend(rank, world_size)`` in each of ``world_size`` threads forms a group; ranks
    meet by ``group`` name, so concurrent worlds need distinct names. ``device`` is where tensors must live
    (``"cpu"`` or a CUDA device, for the GPU test tier). Every collective checks that all ranks called the same
    op with the same shape, dtype and root, and otherwise raises on every rank naming the rank that differed.
    A rank that does not arrive within ``timeout`` seconds makes the waiting ranks raise
    :class:`CommunicationTimeoutError` naming it, and the group becomes unusable.

    Args:
        rank: This thread's rank, ``0..world_size-1``.
        world_size: The number of ranks (threads) in the group.
        group: The name the ranks meet by; concurrent worlds need distinct names.
        timeout: Seconds an op waits for the other ranks (> 0).
        device: Where the group's tensors live (``"cpu"`` or a CUDA device).

    Raises:
        ValueError: When ``world_size < 1``, ``rank`` is out of range or ``timeout`` is not positive, another
            rank of the forming group passed another ``world_size``, or this rank already joined it; or when
            ``device`` is not the CPU, ``world_size > 1`` and this thread runs backward on autograd's shared device
            thread (see the module doc: the ranks would deadlock in their first backward).
    """

    name = "inmemory"

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: str = "default",
        timeout: float = DEFAULT_TIMEOUT,
        device: str | torch.device = "cpu",
        *,
        _state: _GroupState | None = None,
    ):
        super().__init__(rank, world_size, group, timeout)
        self._device = torch.device(device)
        if self._device.type != "cpu" and world_size > 1 and torch.autograd.is_multithreading_enabled():
            raise ValueError(
                f"InMemoryCommunicationBackend(rank={rank}, world_size={world_size}, device={str(self._device)!r}): "
                "the ranks are threads of one process, and autograd runs every thread's backward on one shared "
                f"{self._device.type} device thread, where a rank waiting in a collective blocks the others' hooks "
                "(a deadlock in the first backward); construct and use each rank inside "
                "torch.autograd.set_multithreading_enabled(False), as gpudist.testing.run_ranks does"
            )
        self._state = _state if _state is not None else _join(group, world_size, rank)
        self._seq = 0

    @property
    def device(self) -> torch.device:
        return self._device

    # -- machinery ---------------------------------------------------------------------------------------------------

    def _group_failed(self, op: str) -> CommunicationError:
        cause = self._state.broken
        cls = CommunicationTimeoutError if isinstance(cause, CommunicationTimeoutError) else CommunicationError
        return self._error(f"the group failed: {cause}", op, cls)

    def _wait_until(self, op: str, ready: Callable[[], bool], deadline: float, missing: Callable[[], str]) -> None:
        """Wait on the group's condition (held by the caller) until ``ready()``, the group fails, or the deadline."""
        state = self._state
        while not ready():
            if state.broken is not None:
                raise self._group_failed(op)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = self._error(
                    f"timed out after {self.timeout:g}s waiting for {missing()}; a rank that never calls the op, "
                    f"hangs or died leaves the others here",
                    op,
                    CommunicationTimeoutError,
                )
                state.broken = error
                state.cond.notify_all()
                raise error
            state.cond.wait(remaining)

    def _collective(
        self, sig: Signature, payload: Any, compute: Callable[[list[Any]], Any], finish: Callable[[Any], None]
    ) -> Work:
        state, rank, seq = self._state, self.rank, self._seq
        self._seq += 1
        deadline = time.monotonic() + self.timeout
        with state.cond:
            if state.broken is not None:
                raise self._group_failed(sig.op)
            slot = state.slots.get(seq)
            if slot is None:
                slot = state.slots[seq] = _Slot(self.world_size)
            slot.signatures[rank] = sig
            slot.payloads[rank] = payload
            if len(slot.signatures) == self.world_size:
                signatures = [slot.signatures[r] for r in range(self.world_size)]
                if mismatch_error(signatures, group=self.group, rank=rank) is not None:
                    slot.error = True
                else:
                    slot.result = compute([slot.payloads[r] for r in range(self.world_size)])
                slot.payloads.clear()
                slot.done = True
                state.cond.notify_all()

        def missing() -> str:
            absent = sorted(set(range(self.world_size)) - set(slot.signatures))
            return f"ranks {absent} to call {sig.op} (op #{seq} of this group)"

        def wait() -> None:
            with state.cond:
                self._wait_until(sig.op, lambda: slot.done, deadline, missing)
                slot.readers_left -= 1
                if slot.readers_left == 0:
                    state.slots.pop(seq, None)
                if slot.error:
                    signatures = [slot.signatures[r] for r in range(self.world_size)]
                    raise mismatch_error(signatures, group=self.group, rank=rank)
                result = slot.result
            finish(result)

        return Work(wait, lambda: slot.done)

    # -- the ops -----------------------------------------------------------------------------------------------------

    def _all_reduce(self, sig: Signature, tensor: torch.Tensor, op: ReductionOperation) -> Work:
        return self._collective(sig, tensor, lambda ts: _reduce(ts, op), lambda r: tensor.view(-1).copy_(r))

    def _reduce_scatter(
        self, sig: Signature, inp: torch.Tensor, out: torch.Tensor, op: ReductionOperation, scratch_input: bool = False
    ) -> Work:
        start, end = shard_range(inp.numel(), self.world_size, self.rank)
        return self._collective(sig, inp, lambda ts: _reduce(ts, op), lambda r: out.view(-1).copy_(r[start:end]))

    def _all_gather(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        return self._collective(
            sig, inp, lambda ts: torch.cat([t.reshape(-1) for t in ts]), lambda r: out.view(-1).copy_(r)
        )

    def _broadcast(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        return self._collective(sig, tensor, lambda ts: ts[src].clone(), lambda r: tensor.copy_(r))

    def _all_to_all(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        n = self.world_size

        def compute(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            chunks = [t.reshape(-1).chunk(n) for t in ts]
            return [torch.cat([chunks[src][dst] for src in range(n)]) for dst in range(n)]

        return self._collective(sig, inp, compute, lambda r: out.view(-1).copy_(r[self.rank]))

    def _barrier(self, sig: Signature) -> Work:
        return self._collective(sig, None, lambda _: None, lambda _: None)

    def _new_group(self, sig: Signature, ranks: list[int]) -> CommunicationBackend | None:
        name = f"{self.group}/{self._seq}[{','.join(map(str, ranks))}]"
        box: list[_GroupState] = []
        self._collective(sig, None, lambda _: self._child_state(name, len(ranks)), box.append).wait()
        if self.rank not in ranks:
            return None
        return InMemoryCommunicationBackend(
            ranks.index(self.rank), len(ranks), name, self.timeout, self._device, _state=box[0]
        )

    def _child_state(self, name: str, world_size: int) -> _GroupState:
        child = _GroupState(name, world_size)
        self._state.children.add(child)  # (under the group's condition: called by the last rank to arrive)
        return child

    def _send(self, sig: Signature, tensor: torch.Tensor, dst: int) -> Work:
        return self._p2p(sig, tensor, self.rank, dst, "send")

    def _recv(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        return self._p2p(sig, tensor, src, self.rank, "recv")

    def _p2p(self, sig: Signature, tensor: torch.Tensor, src: int, dst: int, side: str) -> Work:
        """Match the k-th send from src to dst with the k-th recv posted by dst from src.

        Like Gloo, a send completes only once the matching recv is posted, so a program that would deadlock
        on Gloo deadlocks (and times out) here too; the payload is copied at post time.
        """
        state = self._state
        deadline = time.monotonic() + self.timeout
        peer = dst if side == "send" else src
        with state.cond:
            if state.broken is not None:
                raise self._group_failed(side)
            counters = state.sent if side == "send" else state.posted
            index = counters.get((src, dst), 0)
            counters[(src, dst)] = index + 1
            slot = state.mail.setdefault((src, dst, index), {})
            slot[side] = (sig, tensor.detach().clone() if side == "send" else None)
            state.cond.notify_all()
        other = "recv" if side == "send" else "send"

        def wait() -> None:
            with state.cond:
                self._wait_until(
                    side,
                    lambda: other in slot,
                    deadline,
                    lambda: f"rank {peer} to post the {other} matching message #{index} from rank {src} to rank {dst}",
                )
                (sent, data), (posted, _) = slot["send"], slot["recv"]
                if side == "recv":
                    state.mail.pop((src, dst, index), None)
            if (sent.dtype, sent.shape) != (posted.dtype, posted.shape):
                raise p2p_mismatch_error(self.group, self.rank, peer, sent=sent, posted=posted, side=side)
            if side == "recv":
                tensor.copy_(data)

        return Work(wait, lambda: other in slot)

    def abort(self, reason: str | None = None) -> None:
        """Fail the whole group, and every group :meth:`new_group` made from it, now: every rank waiting in (or later
        entering) an op of them raises CommunicationError. Idempotent (the first cause stays).

        Args:
            reason: Why, quoted in the other ranks' errors.
        """
        self._state.fail(
            CommunicationError(
                f"rank {self.rank} aborted the group: {reason or 'aborted'}",
                op="abort",
                group=self.group,
                rank=self.rank,
            )
        )
