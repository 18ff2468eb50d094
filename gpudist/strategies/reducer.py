"""The gradient path every bucketed strategy shares: gradients arrive during backward, buckets launch in order, and
one callback finishes the step at the end of backward.

:class:`Reducer` is Megatron's bucket group done with gpudist's pieces. It owns what does not depend on the strategy:
a post-accumulate hook per parameter (one closure with its bucket and slot bound at wrap time, so the hot path looks
nothing up; with ``static_graph``, one per bucket once the order of arrival is known), the ready sets, the launch of
buckets strictly in index order on every rank, the list of collectives in flight, the end-of-backward callback and
the cleanup after a failed backward. What a bucket's gradients go through is a :class:`BucketCollective` the strategy
passes in: DDP and ZeRO-1 all-reduce (:class:`gpudist.strategies.ddp.AllReduceBuckets`), ZeRO-2 reduce-scatters
(:class:`gpudist.strategies.zero.ReduceScatterBuckets`). The model wrappers hold a reducer; none overrides another's
private methods.

:class:`EndOfBackward` is the one end-of-backward mechanism: the reducer, FSDP's units and the compression hook's
overlapped all-reduces each hold one.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import torch

from ..comm import Work
from ..flat import GradientBucket

__all__ = ["BucketCollective", "EndOfBackward", "Reducer"]

_grad = attrgetter("grad")
_NONES = repeat(None)


class EndOfBackward:
    """A function run once at the end of the current backward pass (autograd's ``queue_callback``), queued at most
    once per pass however many hooks ask for it.

    Args:
        fn: What runs at the end of backward; it runs once per :meth:`arm`-ed pass.
    """

    __slots__ = ("_fn", "queued")

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn
        self.queued = False
        """Whether the callback is queued for the running backward (it has not run yet)."""

    def arm(self) -> bool:
        """Queue the callback for the running backward unless it already is (call it from inside backward).

        Returns:
            True when this call queued it (the first of this backward), False when it already was.
        """
        if self.queued:
            return False
        self.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._run)
        return True

    def clear(self) -> None:
        """Forget a queued callback whose backward failed before running it (the next backward queues a new one)."""
        self.queued = False

    def _run(self) -> None:
        self.queued = False
        self._fn()


class BucketCollective:
    """What a strategy does with a bucket's gradients: the part of the gradient path that differs between DDP's
    all-reduce and ZeRO-2's reduce-scatter. A :class:`Reducer` calls it; subclasses fill in the verbs.

    Attributes:
        buckets: The buckets in launch order (index ``i`` at position ``i``), built by the subclass at wrap time.
        max_in_flight: How many launched collectives may be in flight before the oldest is finished during
            backward (each holding a full-size buffer), or None: all of them until the end of backward.
    """

    buckets: list[GradientBucket]
    max_in_flight: int | None = None

    def arrived(self, bucket: GradientBucket, j: int, param: torch.Tensor) -> None:
        """``param``'s gradient (slot ``j`` of ``bucket``) is complete for this backward (hot path: once per
        parameter inside autograd)."""

    def missing(self, bucket: GradientBucket, j: int, param: torch.Tensor) -> None:
        """``param`` got no gradient in this backward (``find_unused_parameters``): contribute zeros."""
        self.arrived(bucket, j, param)

    def launch(self, bucket: GradientBucket, earlier: list[tuple[GradientBucket, Work]]) -> Work:
        """Start the bucket's collective (every rank in the same bucket order); ``earlier`` are the ones in flight.

        Returns:
            The collective in flight (a completed :class:`~gpudist.comm.Work` when it ran synchronously).
        """
        raise NotImplementedError

    def finished(self, bucket: GradientBucket) -> None:
        """The bucket's collective completed: put the result where the gradients live."""

    def overlaps(self) -> bool:
        """Whether this backward launches buckets as they fill (False: all of them at its end). Asked once per
        backward, when its first gradient arrives."""
        return True

    def reset(self) -> None:
        """Drop per-step state after a step (or a backward that failed half way)."""


class Reducer:
    """Buckets of gradients launched in index order as backward fills them, finished at the end of backward.

    Args:
        collective: What each bucket's gradients go through; its ``buckets``, in launch order, are the reducer's.
        on_unused: Called with the ``(bucket, slot)`` pairs that got no gradient in a backward, before they count
            as zeros; it raises when unused parameters are not allowed.
        on_finish: Called after every bucket of a backward was finished (the step's byte count).
        static_graph: The parameters that get a gradient, and the order their gradients arrive in, are the same in
            every backward (torch DDP's ``static_graph`` contract). After two backward passes in which the same
            gradient completed each bucket, a bucket with nothing to do per gradient (``on_arrival`` False) keeps
            only the hook on that last gradient: Python inside backward becomes O(buckets), not O(parameters). A
            backward that breaks the contract is refused where it can be seen (a bucket completed with a gradient
            still missing, or its last gradient never arriving), with an error naming the parameter; gradients that
            accumulate in place (``zero_grad(set_to_none=False)``, ``no_sync``) cannot be checked.
    """

    def __init__(
        self,
        collective: BucketCollective,
        on_unused: Callable[[list[tuple[GradientBucket, int]]], None],
        on_finish: Callable[[], None],
        *,
        static_graph: bool = False,
    ):
        self.collective = collective
        self.buckets = collective.buckets
        self.sync = True
        """False inside ``no_sync()``: gradients accumulate locally and nothing launches."""
        self.pending: list[tuple[GradientBucket, Work]] = []
        self.end = EndOfBackward(self.finish)
        self._on_unused = on_unused
        self._on_finish = on_finish
        self._next = 0
        self._overlap = True
        self.static_graph = static_graph
        self._completed_by: dict[int, int] = {}
        """Bucket index -> the slot whose gradient completed the bucket in this backward (filled by the hooks)."""
        self._previous: dict[int, int] | None = None
        """The same for the last backward that ran to its end, or None."""
        self.thinned: set[int] = set()
        """Indices of the buckets hooked on their last gradient alone (``static_graph``, after two backward passes
        completed every bucket in the same order)."""
        self._handles: dict[tuple[int, int], Any] = {}
        self._hook_all()

    def _hook_all(self) -> None:
        """A hook on every parameter (at wrap time, and again when the buckets' plans change)."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {
            (bucket.index, j): p.register_post_accumulate_grad_hook(self._hook(bucket, j))
            for bucket in self.buckets
            for j, p in enumerate(bucket.params)
        }
        self.thinned = set()
        self._previous = None
        self._learning = self.static_graph and self._thinnable()

    def _hook(self, bucket: GradientBucket, j: int) -> Callable[[torch.Tensor], None]:
        """The post-accumulate hook of slot ``j`` of ``bucket``: everything it needs is bound here, at wrap time (the
        hot path: once per parameter per backward, on autograd's thread)."""
        arrived = self.collective.arrived
        ready, size, end, index = bucket.ready, len(bucket.params), self.end, bucket.index
        completed_by = self._completed_by

        def on_grad_ready(param: torch.Tensor) -> None:
            if not self.sync:
                return
            if bucket.on_arrival:  # (False where the bucket's launch takes its gradients at once)
                arrived(bucket, j, param)
            if not end.queued:  # the first gradient of this backward: decide what holds for all of it
                end.arm()
                self._overlap = self.collective.overlaps()
            ready.add(j)
            if len(ready) == size:
                completed_by[index] = j
                if self._overlap:
                    self.launch_ready()

        return on_grad_ready

    def _bucket_hook(self, bucket: GradientBucket) -> Callable[[torch.Tensor], None]:
        """``static_graph``: the hook of the bucket's last gradient, which completes the whole bucket (the others'
        hooks are removed). It checks that no gradient of the bucket is still missing (``param.grad`` None after
        ``zero_grad(set_to_none=True)``), which a graph that changed would leave."""
        params, slots, ready, end = bucket.params, range(len(bucket.params)), bucket.ready, self.end

        def on_bucket_ready(param: torch.Tensor) -> None:
            if not self.sync:
                return
            if any(map(is_, map(_grad, params), _NONES)):  # (C loops: `None in list` would call Tensor.__eq__)
                self._refuse_changed_graph(bucket, [j for j, p in enumerate(params) if p.grad is None])
            if not end.queued:
                end.arm()
                self._overlap = self.collective.overlaps()
            ready.update(slots)
            if self._overlap:
                self.launch_ready()

        return on_bucket_ready

    def _refuse_changed_graph(self, bucket: GradientBucket, missing: list[int]) -> None:
        names = ", ".join(bucket.names[j] for j in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise RuntimeError(
            f"static_graph=True, but bucket {bucket.index} was complete with {len(missing)} gradient(s) not there "
            f"({names}): the parameters used in backward, or the order their gradients arrive in, changed after the "
            "first steps; build the model with ShardingConfiguration(static_graph=False)"
        )

    def _thin(self) -> None:
        """Keep only the completing hook of every bucket whose last gradient was the same in the last two backward
        passes and that has nothing to do per gradient."""
        done, before = self._completed_by, self._previous
        for bucket in self.buckets:
            index = bucket.index
            if index in self.thinned or bucket.on_arrival or index not in done or before.get(index) != done[index]:
                continue
            last = done[index]
            for j in range(len(bucket.params)):
                self._handles.pop((index, j)).remove()
            self._handles[(index, last)] = bucket.params[last].register_post_accumulate_grad_hook(
                self._bucket_hook(bucket)
            )
            self.thinned.add(index)

    def replan(self) -> None:
        """The buckets' plans changed (a comm hook was registered): hook every parameter again and relearn the
        order under ``static_graph``."""
        self._hook_all()

    def launch_ready(self) -> None:
        """Launch every bucket, in index order, whose gradients are all there and whose predecessors launched.

        Buckets start strictly in index order on every rank, whatever order their gradients arrive in, so all ranks
        issue the same collectives in the same sequence."""
        collective, pending, cap = self.collective, self.pending, self.collective.max_in_flight
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            pending.append((bucket, collective.launch(bucket, pending)))
            self._next += 1
            while cap is not None and len(pending) > cap:  # the oldest's buffers go back before more are taken
                done, work = pending.pop(0)
                work.wait()
                collective.finished(done)

    def finish(self) -> None:
        """The end of backward (autograd callback): count unused parameters as zeros, launch what is left, wait for
        every collective in order and let the collective write its results."""
        self.end.clear()
        try:
            self._complete_unused()
            self.launch_ready()
            for bucket, work in self.pending:
                work.wait()
                self.collective.finished(bucket)
            if self._learning:
                self._learn_order()
        finally:
            self.reset()
        self._on_finish()

    def _learn_order(self) -> None:
        """``static_graph``: compare which gradient completed each bucket with the last backward, and thin the hooks
        of the buckets where both agree; stop once no bucket is left to thin."""
        if self._previous is not None:
            self._thin()
            self._learning = self._thinnable()
        self._previous = dict(self._completed_by)  # (the hooks hold this dict: reset() empties it)

    def _thinnable(self) -> bool:
        """Whether some bucket could still keep one hook: not thinned yet, and nothing to do per gradient."""
        return any(b.index not in self.thinned and not b.on_arrival for b in self.buckets)

    def mark_all_ready(self) -> None:
        """Every slot ready now, its gradient taken where it is (for gradients produced outside a synced backward)."""
        collective = self.collective
        for bucket in self.buckets:
            for j, p in enumerate(bucket.params):
                if bucket.on_arrival:
                    collective.arrived(bucket, j, p)
                bucket.ready.add(j)

    def _complete_unused(self) -> None:
        """O(buckets) when every gradient arrived (the steady state); the slots are walked only in a bucket with
        some missing."""
        missing = [
            (b, j)
            for b in self.buckets
            if len(b.ready) < len(b.params)
            for j in range(len(b.params))
            if j not in b.ready
        ]
        if not missing:
            return
        for bucket, j in missing:
            if bucket.index in self.thinned:  # its last gradient, the one hooked, never came
                self._refuse_changed_graph(bucket, [j for b, j in missing if b is bucket])
        self._on_unused(missing)
        for bucket, j in missing:
            self.collective.missing(bucket, j, bucket.params[j])
            bucket.ready.add(j)

    @property
    def failed_half_way(self) -> bool:
        """Whether a backward left work behind (it raised before its end-of-backward callback ran)."""
        return bool(self.pending) or self.end.queued

    def reset(self) -> None:
        """Forget this step's progress (after the step, or after a backward that failed half way)."""
        for bucket in self.buckets:
            bucket.ready.clear()
        self.collective.reset()
        self.pending = []
        self._next = 0
        self._completed_by.clear()
        self.end.clear()
