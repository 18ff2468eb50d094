"""Handles of ops in flight: :class:`Work` (an op started with ``async_op=True``) and :class:`PlannedCollective` (a
collective checked once, started every step)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import CommunicationError

__all__ = ["CoalescedCollectives", "PlannedCollective", "Work"]


class Work:
    """Handle of an op started with ``async_op=True``: ``wait()`` blocks until it completes (or raises its error).

    Args:
        wait_fn: Blocks until the op completes, raising its error; None: the op is already complete.
        done_fn: Whether the op has completed, without blocking; None: unknown until ``wait`` returns.
    """

    def __init__(self, wait_fn: Callable[[], None] | None = None, done_fn: Callable[[], bool] | None = None):
        self._wait_fn = wait_fn
        self._done_fn = done_fn
        self._finished = wait_fn is None
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Block until the op completes; later calls return (or raise) at once.

        Raises:
            CommunicationError: The op's error (or its subclasses :class:`CommunicationTimeoutError` and
                :class:`CollectiveMismatchError`), raised again by every later call.
        """
        if self._error is not None:
            raise self._error
        if self._finished:
            return
        try:
            self._wait_fn()
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._finished = True

    def is_completed(self) -> bool:
        """Whether the op has completed, without blocking.

        Returns:
            True once :meth:`wait` returned or raised, or when the transport reports the op done.
        """
        if self._finished:
            return True
        return bool(self._done_fn()) if self._done_fn is not None else False


class PlannedCollective:
    """One collective, checked when it was planned (``CommunicationBackend.plan_*``): :meth:`start` issues it and
    returns its :class:`Work`. What the backend's public op does on every call beyond the transport's own (argument
    checks, a signature, the unchecked context) happened once; what remains is the failure state, the byte counters
    and the transport's call. A plan on fixed buffers (:meth:`CommunicationBackend.plan_all_reduce`) starts with no
    argument; one of a fixed shape (:meth:`CommunicationBackend.plan_reduce_scatter`) takes its tensors per start.

    Args:
        backend: The :class:`~gpudist.comm.base.CommunicationBackend` that planned it (not annotated: ``base``
            imports this module, and the import graph has no cycle).
        op: The op's name, for its byte counter and errors.
        nbytes: The bytes every start moves, counted in the backend's ``stats``.
        launch: Issues the transport's call (given the start's tensors, if any) and returns its :class:`Work`.
    """

    __slots__ = ("_backend", "_launch", "_nbytes", "_op")

    def __init__(self, backend, op: str, nbytes: int, launch: Callable[..., Work]):
        self._backend, self._op, self._nbytes, self._launch = backend, op, nbytes, launch

    def start(self, *tensors: torch.Tensor) -> Work:
        """Issue the collective (asynchronously, as ``async_op=True``).

        Args:
            *tensors: Nothing for a plan on fixed buffers; the tensors of this start for a plan of a fixed shape
                (as its ``plan_*`` method says: not checked here).

        Returns:
            Its :class:`Work`; ``wait()`` raises what the op's ``wait`` would.

        Raises:
            CommunicationError: When the group is unusable after an earlier failure, or the transport failed.
        """
        backend, op = self._backend, self._op
        if backend._broken is not None:
            backend._raise_if_broken(op)
        backend.stats.record(op, self._nbytes)
        try:
            work = self._launch(*tensors)
        except RuntimeError as e:
            raise backend._failed(e, op) from (None if isinstance(e, CommunicationError) else e)
        return Work(lambda: backend._wait(work, op), work.is_completed)


class CoalescedCollectives:
    """Planned collectives issued together, each on the tensors bound to it when planned
    (:meth:`CommunicationBackend.plan_coalesced`): :meth:`start` issues them in order and returns one :class:`Work`
    for all. This default starts each plan and waits for every one; a transport that can issue them as one group
    overrides :meth:`start` (NCCL: one hand-off of the streams, one ncclGroupStart/End, one event).

    Args:
        backend: The backend that planned them.
        plans: ``(plan, tensors)`` pairs: each plan with the tensors its :meth:`PlannedCollective.start` takes.
    """

    __slots__ = ("_backend", "_plans")

    def __init__(self, backend, plans: list[tuple[PlannedCollective, tuple[torch.Tensor, ...]]]):
        self._backend, self._plans = backend, plans

    def __len__(self) -> int:
        return len(self._plans)

    def start(self) -> Work:
        """Issue every collective (asynchronously).

        Returns:
            One :class:`Work`: ``wait()`` waits for every collective and raises the first error.

        Raises:
            CommunicationError: As :meth:`PlannedCollective.start`.
        """
        works = [plan.start(*tensors) for plan, tensors in self._plans]

        def wait_all() -> None:
            for work in works:
                work.wait()

        return Work(wait_all, lambda: all(work.is_completed() for work in works))
