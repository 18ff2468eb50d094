"""The communication contract every gpudist backend implements: :class:`CommunicationBackend`.

One contract, four transports. Every public method of :class:`CommunicationBackend` validates its
arguments locally (device, contiguity, dtype, sizes, rank range) *before* anything is sent, counts the
bytes it moves in :attr:`CommunicationBackend.stats`, and turns transport failures into
:class:`CommunicationError` naming the op, the group and the rank. Backends only implement the
transport (``_all_reduce`` and friends) and a cross-rank consistency check of the call signature, and say
what they can do through the contract's declared capabilities (:attr:`~CommunicationBackend.shared_memory`,
:meth:`~CommunicationBackend.abort`, :meth:`~CommunicationBackend.shutdown` and the transport properties), so
nothing above ``gpudist.comm`` needs to ask which transport it holds.

What the contract is made of lives beside it, one job per module: ``errors`` (the errors), ``reduction``
(:class:`ReductionOperation`), ``shards`` (the uneven-size rule, :func:`split_sizes` and :func:`shard_range`),
``stats`` (byte counters), ``work`` (:class:`Work`, :class:`PlannedCollective`), ``signature`` (what ranks agree
on, and the mismatch errors), ``agreed`` (:class:`AgreedOps`) and ``handshake`` (the point-to-point handshake of
the CPU process transports).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

import torch

from .agreed import AgreedOps
from .errors import CollectiveMismatchError, CommunicationError, op_error
from .reduction import ReductionOperation
from .shards import _share
from .signature import _DTYPE_CODES, SIGNATURE_LEN, Signature, mismatch_error, stable_hash
from .stats import CommStats
from .work import CoalescedCollectives, PlannedCollective, Work

__all__ = ["DEFAULT_TIMEOUT", "CommunicationBackend"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a collective may wait for its peers before raising :class:`CommunicationTimeoutError`."""


class CommunicationBackend(ABC):
    """A group of ``world_size`` ranks that exchange torch tensors; this object is one rank's view of it.

    Every op takes contiguous tensors on the backend's device. Collective ops (all but ``send``/``recv``) must
    be called by every rank of the group in the same order with the same shape, dtype and root: a backend
    checks this and raises :class:`CommunicationError` on every rank, naming the rank that differed, before
    anything is sent. With ``async_op=True`` an op returns a :class:`Work` whose ``wait()`` completes it; the
    input must not be changed and the output not read before then. Without it, ops return ``None`` once done.
    An async op's errors that arise after it started (a timeout, a transport failure) are raised by ``wait()``.

    Args:
        rank: This rank in the group, ``0..world_size-1``.
        world_size: The number of ranks in the group (>= 1).
        group: The group's name, used in error messages.
        timeout: Seconds an op may wait for its peers (> 0).

    Raises:
        ValueError: When ``world_size < 1``, ``rank`` is out of range, or ``timeout`` is not positive.
    """

    #: Name of the transport ("inmemory", "gloo", "nccl", "mpi").
    name: str = "abstract"

    #: True where point-to-point ops execute in issue order and block what follows until their peer matches them
    #: (NCCL on a CUDA stream). There a receive posted ahead of time stalls this rank's later work, so schedules
    #: post receives only when needed and group crossing sends and receives with :meth:`batch_send_recv`.
    ordered_p2p: bool = False

    #: True where AVERAGE costs no more than SUM (the transport divides while it reduces: ncclAvg). Elsewhere it is
    #: SUM and then a division pass, so callers that touch the data anyway fold the 1/N into that pass and send SUM.
    averages_in_transport: bool = False

    #: Whether a strategy should send a large update in chunks, each while the next is computed. It pays where the
    #: transport progresses ops on its own threads and small ops are cheap (Gloo, MPI, in-memory); not on NCCL, where
    #: ZeRO's chunks of uneven shares become per-rank broadcasts, each a kernel launch, and one all-gather on the
    #: communication stream (which overlaps whatever compute is enqueued after it) is best.
    chunked_overlap: bool = True

    #: Whether the cross-rank signature check of a validated op stops the host until the device catches up (NCCL:
    #: an all-gather on the device, read back by the host). Per-step collectives whose shapes follow the data rather
    #: than a layout checked at wrap time (tensor-parallel activations) are checked only where this is False.
    check_syncs_host: bool = False

    #: Whether the collectives are this process's own copying and adding through memory the ranks share, on a worker
    #: thread of its own, rather than a NIC's, the kernel's or a device's work: Gloo's shared-memory path
    #: (``gpudist.comm.shm``) only. There overlapping them with backward just makes the two share the cores, so DDP
    #: launches its buckets at the end of backward instead. False everywhere else, the in-memory transport included
    #: (its ranks are threads of one test process; strategies keep their real schedule on it).
    shared_memory: bool = False

    #: Where the ranks sit (a ``gpudist.Topology``: node layout, intra- and inter-node groups). ``gpudist.init()``
    #: sets it on the world group's backend; None on backends built otherwise (build one with
    #: ``gpudist.Topology(comm, ranks_per_node=...)``).
    topology = None

    def __init__(self, rank: int, world_size: int, group: str, timeout: float):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}; ranks are 0..{world_size - 1}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.timeout = float(timeout)
        self.stats = CommStats()
        self._broken: CommunicationError | None = None

    # -- what a transport provides ---------------------------------------------------------------------------------

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device type the tensors of this backend live on (``cpu`` or ``cuda``)."""

    @abstractmethod
    def _all_reduce(self, sig: Signature, tensor: torch.Tensor, op: ReductionOperation) -> Work: ...

    @abstractmethod
    def _reduce_scatter(
        self, sig: Signature, inp: torch.Tensor, out: torch.Tensor, op: ReductionOperation, scratch_input: bool = False
    ) -> Work: ...

    @abstractmethod
    def _all_gather(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work: ...

    @abstractmethod
    def _broadcast(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work: ...

    @abstractmethod
    def _send(self, sig: Signature, tensor: torch.Tensor, dst: int) -> Work: ...

    @abstractmethod
    def _recv(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work: ...

    @abstractmethod
    def _all_to_all(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work: ...

    @abstractmethod
    def _barrier(self, sig: Signature) -> Work: ...

    @abstractmethod
    def _new_group(self, sig: Signature, ranks: list[int]) -> CommunicationBackend | None: ...

    def _gather_signatures(self, op: str, mine: torch.Tensor, everyone: torch.Tensor) -> None:
        """All-gather ``mine`` (``SIGNATURE_LEN`` int64 on CPU) into ``everyone`` (world x that), within the timeout.
        Transports that check signatures with a round trip (:meth:`_check`) provide it."""
        raise NotImplementedError

    def _check(self, sig: Signature, validate: bool | None = None) -> None:
        """Raise CollectiveMismatchError on every rank unless all ranks pass the same signature (when validating;
        ``validate`` overrides ``self.validate``, for transports that run the check later on another thread)."""
        if not (self.validate if validate is None else validate) or self.world_size == 1:
            return
        mine = torch.tensor(sig.encode(), dtype=torch.int64)
        everyone = torch.empty(self.world_size * SIGNATURE_LEN, dtype=torch.int64)
        self._gather_signatures(sig.op, mine, everyone)
        self.stats.record_check(everyone.numel() * 8)
        rows = everyone.view(self.world_size, SIGNATURE_LEN)
        if not bool((rows == mine).all()):
            error = mismatch_error([Signature.decode(r) for r in rows.tolist()], group=self.group, rank=self.rank)
            if error is None:  # rows that decode alike (an unknown code): still a mismatch, named by the raw rows
                error = CollectiveMismatchError(
                    f"{sig.op} mismatch on group '{self.group}': the ranks' encoded signatures differ "
                    f"({rows.tolist()}); every rank must call the same op with the same shape, dtype and root "
                    f"(raised on rank {self.rank}, before anything was sent)",
                    op=sig.op,
                    group=self.group,
                    rank=self.rank,
                )
            raise error

    def _translate(self, error: BaseException, op: str) -> CommunicationError:
        """Map a transport's native exception to a CommunicationError (backends refine this)."""
        return self._error(f"{type(error).__name__}: {error}", op)

    # -- the public ops ----------------------------------------------------------------------------------------------

    def all_reduce(
        self, tensor: torch.Tensor, op: ReductionOperation | str = ReductionOperation.SUM, *, async_op: bool = False
    ) -> Work | None:
        """Combine ``tensor`` over all ranks with ``op``, in place, on every rank.

        Args:
            tensor: A contiguous tensor on the backend's device, overwritten with the result.
            op: The reduction (a name is parsed by :meth:`ReductionOperation.parse`); AVERAGE needs a floating-point
                tensor.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor, its dtype is not supported, or ``op`` is AVERAGE of an
                integer dtype.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``op`` is not a reduction.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype or reduction (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        op = ReductionOperation.parse(op)
        self._check_tensor("all_reduce", tensor)
        self._check_reduction("all_reduce", op, tensor.dtype)
        sig = Signature("all_reduce", tensor.dtype, tuple(tensor.shape), op)
        nbytes = tensor.numel() * tensor.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._all_reduce(sig, tensor, op))

    def plan_all_reduce(
        self, tensor: torch.Tensor, op: ReductionOperation | str = ReductionOperation.SUM
    ) -> PlannedCollective:
        """An all-reduce of ``tensor`` (in place, as :meth:`all_reduce`) checked now and issued later, as often as
        needed, by :meth:`PlannedCollective.start`: for a buffer that every step reduces (a gradient bucket), whose
        shape agrees on every rank by construction. A start does no argument check, builds nothing and skips the
        cross-rank signature check (as inside :meth:`unchecked`): the transport's call and its bookkeeping only.

        Args:
            tensor: A contiguous tensor on the backend's device, reduced in place at every start; it must keep its
                storage for the plan's life.
            op: The reduction, as for :meth:`all_reduce`.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`all_reduce`, now rather than at a start.
        """
        op = ReductionOperation.parse(op)
        self._check_tensor("all_reduce", tensor)
        self._check_reduction("all_reduce", op, tensor.dtype)
        return self._planned_all_reduce(tensor, op)

    def _planned_all_reduce(self, tensor: torch.Tensor, op: ReductionOperation) -> PlannedCollective:
        """The plan of a checked all-reduce: each start calls the transport's ``_all_reduce`` without the cross-rank
        signature check (agreed when planned); transports with a leaner call override this."""
        sig = Signature("all_reduce", tensor.dtype, tuple(tensor.shape), op)
        return self._planned(sig, tensor.numel() * tensor.element_size(), lambda: self._all_reduce(sig, tensor, op))

    def _planned(self, sig: Signature, nbytes: int, call: Callable[..., Work]) -> PlannedCollective:
        """The generic plan: each start runs the transport's ``call`` (its arguments bound, or passed per start)
        with the cross-rank signature check off, as inside :meth:`unchecked`."""

        def launch(*tensors: torch.Tensor) -> Work:
            previous, self.validate = self.validate, False
            try:
                return call(*tensors)
            finally:
                self.validate = previous

        return PlannedCollective(self, sig.op, nbytes, launch)

    def plan_reduce_scatter(
        self,
        numel: int,
        dtype: torch.dtype,
        op: ReductionOperation | str = ReductionOperation.SUM,
        *,
        scratch_input: bool = False,
    ) -> PlannedCollective:
        """A reduce-scatter of ``numel`` elements of ``dtype`` (as :meth:`reduce_scatter`) checked now and issued
        later by :meth:`PlannedCollective.start` ``(inp, out)``, on new buffers each time (ZeRO-2's send buffer of a
        bucket, made and freed every step). A start checks nothing about its tensors: ``inp`` must be a contiguous
        ``numel``-element tensor of ``dtype`` on the backend's device and ``out`` this rank's share
        (:func:`split_sizes`) of the same, as the caller's construction guarantees, and every rank's plan must
        agree (the cross-rank signature check is skipped, as inside :meth:`unchecked`).

        Args:
            numel: Elements of every start's ``inp`` (>= 0).
            dtype: Their dtype.
            op: The reduction, as for :meth:`reduce_scatter`.
            scratch_input: As for :meth:`reduce_scatter`, at every start.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`reduce_scatter` for such tensors, now rather than at a start.
        """
        op = ReductionOperation.parse(op)
        self._check_plan("reduce_scatter", numel, dtype)
        self._check_reduction("reduce_scatter", op, dtype)
        return self._planned_reduce_scatter(numel, dtype, op, scratch_input)

    def _planned_reduce_scatter(
        self, numel: int, dtype: torch.dtype, op: ReductionOperation, scratch_input: bool
    ) -> PlannedCollective:
        """The plan of a checked reduce-scatter: each start calls the transport's ``_reduce_scatter`` without the
        cross-rank signature check; transports with a leaner call override this."""
        sig = Signature("reduce_scatter", dtype, (numel,), op)
        return self._planned(
            sig, numel * dtype.itemsize, lambda inp, out: self._reduce_scatter(sig, inp, out, op, scratch_input)
        )

    def reduce_scatter(
        self,
        inp: torch.Tensor,
        out: torch.Tensor,
        op: ReductionOperation | str = ReductionOperation.SUM,
        *,
        async_op: bool = False,
        scratch_input: bool = False,
    ) -> Work | None:
        """Combine ``inp`` over all ranks; rank r gets range r of the result (:func:`split_sizes`) in ``out``.

        ``out`` may be ``inp``'s own range r (the in-place form, as NCCL defines it). ``scratch_input=True`` says the
        caller has no further use for ``inp``: a transport whose reduce-scatter is an all-reduce (Gloo) then reduces
        ``inp`` in place instead of a copy of it, and ``inp`` holds garbage after (but for ``out``).

        Args:
            inp: This rank's contribution, a contiguous tensor on the backend's device (read as flat).
            out: Receives this rank's range of the result: ``split_sizes(inp.numel(), world_size)[rank]`` elements
                of ``inp``'s dtype, on ``inp``'s device.
            op: The reduction (a name is parsed by :meth:`ReductionOperation.parse`); AVERAGE needs a floating-point
                dtype.
            async_op: Return a :class:`Work` at once instead of waiting for completion.
            scratch_input: The caller has no further use for ``inp``, as described above.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``inp`` or ``out`` is not a tensor, their dtypes differ or are not supported, or
                ``op`` is AVERAGE of an integer dtype.
            ValueError: When a tensor is on another device (or they are on different ones) or not contiguous,
                ``out`` does not have this rank's share of elements, or ``op`` is not a reduction.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype or reduction (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        op = ReductionOperation.parse(op)
        self._check_pair("reduce_scatter", inp, out)
        self._check_reduction("reduce_scatter", op, inp.dtype)
        expected = _share(inp.numel(), self.world_size, self.rank)
        if out.numel() != expected:
            raise ValueError(
                f"reduce_scatter: out has {out.numel()} elements but rank {self.rank}'s share of {inp.numel()} "
                f"over {self.world_size} ranks is {expected} (first numel % world_size ranks get one more); "
                f"size out with gpudist.comm.split_sizes(inp.numel(), world_size)[rank]"
            )
        sig = Signature("reduce_scatter", inp.dtype, tuple(inp.shape), op)
        nbytes = inp.numel() * inp.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._reduce_scatter(sig, inp, out, op, scratch_input))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``inp`` in rank order into ``out`` (flat; uneven shares per :func:`split_sizes`).

        Args:
            inp: This rank's share: ``split_sizes(out.numel(), world_size)[rank]`` elements, contiguous, on the
                backend's device.
            out: Receives every rank's share in rank order (read as flat), of ``inp``'s dtype and device.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``inp`` or ``out`` is not a tensor, or their dtypes differ or are not supported.
            ValueError: When a tensor is on another device (or they are on different ones) or not contiguous, or
                ``inp`` does not have this rank's share of ``out``'s elements.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_pair("all_gather", inp, out)
        expected = _share(out.numel(), self.world_size, self.rank)
        if inp.numel() != expected:
            raise ValueError(
                f"all_gather: inp has {inp.numel()} elements but rank {self.rank}'s share of out ({out.numel()} "
                f"elements over {self.world_size} ranks) is {expected}; size inp with "
                f"gpudist.comm.split_sizes(out.numel(), world_size)[rank]"
            )
        sig = Signature("all_gather", out.dtype, tuple(out.shape))
        nbytes = out.numel() * out.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._all_gather(sig, inp, out))

    def plan_all_gather(self, numel: int, dtype: torch.dtype) -> PlannedCollective:
        """An all-gather into ``numel`` elements of ``dtype`` (as :meth:`all_gather`) checked now and issued later by
        :meth:`PlannedCollective.start` ``(inp, out)``, on the same buffers every time (ZeRO's updated parameters)
        or new ones (FSDP's gathered unit). As :meth:`plan_reduce_scatter`, a start checks nothing about its tensors:
        ``out`` must be a contiguous ``numel``-element tensor of ``dtype`` on the backend's device and ``inp`` this
        rank's share of it (:func:`split_sizes`).

        Args:
            numel: Elements of every start's ``out`` (>= 0).
            dtype: Their dtype.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`all_gather` for such tensors, now rather than at a start.
        """
        self._check_plan("all_gather", numel, dtype)
        return self._planned_all_gather(numel, dtype)

    def _planned_all_gather(self, numel: int, dtype: torch.dtype) -> PlannedCollective:
        sig = Signature("all_gather", dtype, (numel,))
        return self._planned(sig, numel * dtype.itemsize, lambda inp, out: self._all_gather(sig, inp, out))

    def _check_plan(self, op: str, numel: int, dtype: torch.dtype) -> None:
        """A plan by shape: ``numel`` a count and ``dtype`` one this backend carries (checked before anything is
        sent)."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"plan_{op}: numel must be an int >= 0, got {numel!r}")
        self._check_tensor(op, torch.empty(0, dtype=dtype, device=self.device), "tensors")

    def plan_broadcast(self, tensor: torch.Tensor, src: int) -> PlannedCollective:
        """A broadcast of ``tensor`` from ``src`` (as :meth:`broadcast`) checked now and issued later, as often as
        needed, by :meth:`PlannedCollective.start` (ZeRO's updated parameters, sent chunk by chunk). As
        :meth:`plan_all_reduce`, a start checks nothing; ``tensor`` must keep its storage for the plan's life.

        Returns:
            The plan.

        Raises:
            TypeError, ValueError: As :meth:`broadcast`, now rather than at a start.
        """
        self._check_tensor("broadcast", tensor)
        self._check_peer("broadcast", src, "src", allow_self=True)
        return self._planned_broadcast(tensor, src)

    def _planned_broadcast(self, tensor: torch.Tensor, src: int) -> PlannedCollective:
        sig = Signature("broadcast", tensor.dtype, tuple(tensor.shape), root=src)
        return self._planned(sig, tensor.numel() * tensor.element_size(), lambda: self._broadcast(sig, tensor, src))

    def plan_coalesced(self, plans: list[tuple[PlannedCollective, tuple[torch.Tensor, ...]]]) -> CoalescedCollectives:
        """Planned collectives (this backend's) issued together on fixed tensors, as ZeRO-2 gathers every bucket's
        updated parameters: :meth:`CoalescedCollectives.start` issues them in order and returns one Work. Where the
        transport can, they go as one group (NCCL: one hand-off of the streams, one ncclGroupStart/End, one event
        instead of one per collective). Every rank must coalesce the same collectives, in the same order.

        Args:
            plans: ``(plan, tensors)``: each plan from this backend's ``plan_*`` with the tensors its start takes
                (none for a plan on fixed buffers); they must keep their storage for the result's life.

        Returns:
            The coalesced collectives.

        Raises:
            ValueError: When a plan is another backend's.
        """
        for plan, _ in plans:
            if plan._backend is not self:
                raise ValueError(
                    f"plan_coalesced: a {plan._op} plan of another backend ({plan._backend!r}) given to {self!r}; "
                    "coalesce the plans of one group"
                )
        return self._coalesced(list(plans))

    def _coalesced(self, plans: list) -> CoalescedCollectives:
        return CoalescedCollectives(self, plans)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> Work | None:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank.

        Args:
            tensor: A contiguous tensor on the backend's device: the data on ``src``, overwritten elsewhere.
            src: The rank whose tensor every rank receives.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor or its dtype is not supported, or ``src`` is not an int.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``src`` is not a rank of the
                group.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype or root (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_tensor("broadcast", tensor)
        self._check_peer("broadcast", src, "src", allow_self=True)
        sig = Signature("broadcast", tensor.dtype, tuple(tensor.shape), root=src)
        nbytes = tensor.numel() * tensor.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._broadcast(sig, tensor, src))

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False) -> Work | None:
        """Send ``tensor`` to rank ``dst``, which must post a ``recv`` of the same shape and dtype.

        Not collective: only ``dst`` takes part.

        Args:
            tensor: A contiguous tensor on the backend's device; not to be changed before the send completes.
            dst: The receiving rank (not this one).
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor or its dtype is not supported, or ``dst`` is not an int.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``dst`` is not a rank of the
                group or is this rank.
            CollectiveMismatchError: When ``dst`` posted a receive of another shape or dtype (the payload is not
                delivered).
            CommunicationTimeoutError: When ``dst`` did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_tensor("send", tensor)
        self._check_peer("send", dst, "dst")
        sig = Signature("send", tensor.dtype, tuple(tensor.shape), root=dst)
        return self._run(sig, tensor.numel() * tensor.element_size(), async_op, lambda: self._send(sig, tensor, dst))

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Work | None:
        """Receive into ``tensor`` what rank ``src`` sends; a shape or dtype that differs from the send raises here.

        Not collective: only ``src`` takes part.

        Args:
            tensor: A contiguous tensor on the backend's device, shaped like the sent one; overwritten.
            src: The sending rank (not this one).
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``tensor`` is not a tensor or its dtype is not supported, or ``src`` is not an int.
            ValueError: When ``tensor`` is on another device or not contiguous, or ``src`` is not a rank of the
                group or is this rank.
            CollectiveMismatchError: When ``src`` sent a tensor of another shape or dtype.
            CommunicationTimeoutError: When ``src`` did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_tensor("recv", tensor)
        self._check_peer("recv", src, "src")
        # The signature is the one the matching send carries, so the two compare directly.
        sig = Signature("send", tensor.dtype, tuple(tensor.shape), root=self.rank)
        return self._run(
            sig,
            tensor.numel() * tensor.element_size(),
            async_op,
            lambda: self._recv(sig, tensor, src),
            stat_name="recv",
        )

    def batch_send_recv(
        self, sends: Sequence[tuple[torch.Tensor, int]] = (), recvs: Sequence[tuple[torch.Tensor, int]] = ()
    ) -> Work:
        """Post the ``(tensor, dst)`` sends and ``(tensor, src)`` receives together and return one :class:`Work`
        for all of them (wait on it before reading a received tensor or changing a sent one). They progress
        concurrently (on NCCL: one group call), so two ranks that each send to the other and receive from it in
        one batch cannot deadlock, as they can with separate blocking ops where p2p runs in issue order
        (:attr:`ordered_p2p`). Every tensor and peer is checked before anything is posted.

        Args:
            sends: ``(tensor, dst)`` pairs, as for :meth:`send`.
            recvs: ``(tensor, src)`` pairs, as for :meth:`recv`.

        Returns:
            One :class:`Work` for all of them; its ``wait()`` raises what :meth:`send` and :meth:`recv` raise once
            started (a mismatch, a timeout, a transport failure).

        Raises:
            TypeError: When a tensor is not a tensor or its dtype is not supported, or a peer is not an int.
            ValueError: When a tensor is on another device or not contiguous, or a peer is not a rank of the group
                or is this rank.
        """
        sends, recvs = [(t, int(d)) for t, d in sends], [(t, int(s)) for t, s in recvs]
        for tensor, dst in sends:
            self._check_tensor("send", tensor)
            self._check_peer("send", dst, "dst")
        for tensor, src in recvs:
            self._check_tensor("recv", tensor)
            self._check_peer("recv", src, "src")
        return self._batch_send_recv(sends, recvs)

    def _batch_send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> Work:
        """Transports where separately posted async ops already progress concurrently just post them all."""
        works = [self.send(t, dst, async_op=True) for t, dst in sends]
        works += [self.recv(t, src, async_op=True) for t, src in recvs]

        def wait() -> None:
            for work in works:
                work.wait()

        return Work(wait, lambda: all(w.is_completed() for w in works))

    def all_to_all(self, inp: torch.Tensor, out: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """Split ``inp`` into ``world_size`` equal parts; part j goes to rank j; ``out``'s part i comes from rank i.

        Args:
            inp: A contiguous tensor on the backend's device (read as flat), its size a multiple of ``world_size``.
            out: Receives the parts; same size, dtype and device as ``inp``.
            async_op: Return a :class:`Work` at once instead of waiting for completion.

        Returns:
            A :class:`Work` with ``async_op=True``, else None once done.

        Raises:
            TypeError: When ``inp`` or ``out`` is not a tensor, or their dtypes differ or are not supported.
            ValueError: When a tensor is on another device (or they are on different ones) or not contiguous, or
                ``inp`` and ``out`` differ in size or their size is not a multiple of ``world_size``.
            CollectiveMismatchError: When the ranks' calls differ in shape, dtype (checked while
                :attr:`validate` is on; raised on every rank before anything is sent).
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        self._check_pair("all_to_all", inp, out)
        if inp.numel() != out.numel() or inp.numel() % self.world_size:
            raise ValueError(
                f"all_to_all: inp ({inp.numel()} elements) and out ({out.numel()}) must have the same size, "
                f"divisible by world_size {self.world_size}; pad both to a multiple of the world size"
            )
        sig = Signature("all_to_all", inp.dtype, tuple(inp.shape))
        nbytes = inp.numel() * inp.element_size()
        return self._run(sig, nbytes, async_op, lambda: self._all_to_all(sig, inp, out))

    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier.

        Raises:
            CollectiveMismatchError: When another rank called a different op at this point.
            CommunicationTimeoutError: When a rank did not enter within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure.
        """
        sig = Signature("barrier")
        self._run(sig, 0, False, lambda: self._barrier(sig))

    def new_group(self, ranks: Sequence[int]) -> CommunicationBackend | None:
        """A backend for the sub-group ``ranks`` (ranks of this group; rank i of the new group is ``ranks[i]``).

        Collective: every rank of this group calls it with the same list. Members get the sub-group's backend,
        the other ranks ``None``.

        Args:
            ranks: Distinct ranks of this group, in the new group's rank order.

        Returns:
            The sub-group's backend on its members (same transport, timeout and validation), else None.

        Raises:
            ValueError: When ``ranks`` is empty, has duplicates, or holds a rank outside this group.
            CollectiveMismatchError: When the ranks of this group passed different lists.
            CommunicationTimeoutError: When a rank did not take part within the backend's timeout.
            CommunicationError: When the transport failed, or the group is unusable after an earlier failure (or,
                Gloo, the backend wraps a process group whose store it does not know).
        """
        ranks = [int(r) for r in ranks]
        if not ranks:
            raise ValueError("new_group: ranks is empty; pass the ranks of this group that form the sub-group")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group: ranks {ranks} contain duplicates")
        for r in ranks:
            self._check_peer("new_group", r, "ranks", allow_self=True)
        sig = Signature("new_group", extra=stable_hash(ranks))
        self._raise_if_broken("new_group")
        with self._failures("new_group"):
            group = self._new_group(sig, ranks)
        if group is not None:
            group.parent_ranks = tuple(ranks)
        return group

    # -- state -------------------------------------------------------------------------------------------------------

    #: This group's ranks in the group :meth:`new_group` made it from (rank i of this group is entry i); None for a
    #: group made otherwise (a world group).
    parent_ranks: tuple[int, ...] | None = None

    #: Whether collectives first check across ranks that all called the same op with the same shape/dtype/root.
    #: Backends where the check costs a round trip (Gloo) honour it; the in-memory backend checks for free always.
    validate: bool = True

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[CommunicationBackend]:
        """Skip the cross-rank consistency check for ops issued inside the block.

        For code whose shapes agree on every rank by construction (gradient buckets laid out from the same model
        and checked once): saves one small-message round trip per op. A mismatch inside the block is not caught.

        Yields:
            This backend.
        """
        previous, self.validate = self.validate, False
        try:
            yield self
        finally:
            self.validate = previous

    @property
    def agreed(self) -> AgreedOps:
        """This group's ops for calls that agree on every rank by construction: a strategy's per-step traffic over
        buffers laid out from a model whose names, shapes and dtypes were checked across ranks when it was wrapped,
        or a scalar every rank reduces. Each op runs without the cross-rank signature check, as inside
        :meth:`unchecked` (saving its small-message round trip); a mismatch there is not caught. Anything else (the
        group's own attributes) reads through to the backend.

        Returns:
            The group's :class:`AgreedOps` (one per backend).
        """
        ops = self.__dict__.get("_agreed")
        if ops is None:
            ops = self.__dict__["_agreed"] = AgreedOps(self)
        return ops

    @property
    def healthy(self) -> bool:
        """False once an op failed in a way that leaves the group unusable (timeout, dead peer)."""
        return self._broken is None

    # -- leaving the group ------------------------------------------------------------------------------------------

    def abort(self, reason: str | None = None) -> None:
        """Leave the group now, from any thread (a heartbeat watch's, a failed op's handler): what a survivor of a
        failure calls on the old group before it forms the next one. From then on every op of this backend raises
        :class:`CommunicationError` quoting ``reason``: the later ones, and the ``wait()`` of those pending here as soon
        as the transport can release them. Transports that can also make the peers' ops that wait on this rank fail at
        once, rather than at their timeout, do so (Gloo shuts down its connections, NCCL aborts its communicator, an
        in-memory group fails on every member); MPI cannot (see its ``abort``). It never waits for a peer and never
        ends the process. Idempotent (the first reason stays); :meth:`shutdown` still releases what the group holds.

        The default marks this backend broken, so later ops raise; transports override it to release pending ops.

        Args:
            reason: Why, quoted in this rank's errors.
        """
        self._mark_broken(self._error(f"the group was aborted on this rank: {reason or 'aborted'}", "abort"))

    def shutdown(self) -> None:
        """Release what this rank holds of the group (threads, connections, communicators, shared memory), once it is
        no longer used: at the end of a job, or a retired generation's group in live mode. Later ops raise
        :class:`CommunicationError`. Idempotent.

        The default holds nothing to release (the in-memory transport) and only marks the backend shut down."""
        if self._broken is None:
            self._broken = CommunicationError(
                f"group {self.group!r} was shut down", op="shutdown", group=self.group, rank=self.rank
            )

    # -- captured graphs (gpudist.capture) ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """A CUDA graph is being captured on the current stream: the ops issued inside are recorded into it, not run.
        A transport that watches its ops from another thread stops looking while capture is under way (a query of
        an event recorded inside capture, from any thread, invalidates it) and keeps what the graph records with the
        graph. The default has nothing to watch."""
        yield

    def watch_graph(self, what: str) -> None:
        """A captured graph was just replayed on the current stream: time it as one op named ``what``, so that a
        replay that hangs (a peer that died inside it) fails with :class:`CommunicationTimeoutError` naming ``what``,
        this group and rank, like any op. The default has nothing to watch."""
        return None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, group={self.group!r}, "
            f"timeout={self.timeout:g})"
        )

    # -- helpers shared by all backends ------------------------------------------------------------------------------

    def _error(self, detail: str, op: str, cls: type[CommunicationError] = CommunicationError) -> CommunicationError:
        return op_error(detail, op, self.group, self.rank, cls)

    def _mark_broken(self, error: CommunicationError) -> CommunicationError:
        if self._broken is None and not isinstance(error, CollectiveMismatchError):
            self._broken = error
        return error

    def _raise_if_broken(self, op: str) -> None:
        if self._broken is not None:
            raise self._error(  # of the same class, so `except CommunicationTimeoutError` sees a watchdog's timeout
                f"the group is unusable since an earlier failure ({self._broken}); create a new backend/process group",
                op,
                type(self._broken),
            )

    def _run(
        self, sig: Signature, nbytes: int, async_op: bool, start: Callable[[], Work], stat_name: str | None = None
    ) -> Work | None:
        op = stat_name or sig.op
        if self._broken is not None:
            self._raise_if_broken(op)
        self.stats.record(op, nbytes)
        try:  # as _failures, inline: every collective passes here (not a generator context manager: more calls)
            work = start()
        except RuntimeError as e:
            raise self._failed(e, op) from (None if isinstance(e, CommunicationError) else e)
        if async_op:
            return Work(lambda: self._wait(work, op), work.is_completed)
        self._wait(work, op)
        return None

    def _wait(self, work: Work, op: str) -> None:
        try:  # as _failures, inline
            work.wait()
        except RuntimeError as e:
            raise self._failed(e, op) from (None if isinstance(e, CommunicationError) else e)

    def _failed(self, error: RuntimeError, op: str) -> CommunicationError:
        """The CommunicationError a transport's ``error`` stands for (translated unless it is one already),
        remembered where it leaves the group unusable."""
        return self._mark_broken(error if isinstance(error, CommunicationError) else self._translate(error, op))

    @contextlib.contextmanager
    def _failures(self, op: str) -> Iterator[None]:
        """Turn transport exceptions into CommunicationError and remember failures that break the group."""
        try:
            yield
        except RuntimeError as e:
            raise self._failed(e, op) from (None if isinstance(e, CommunicationError) else e)

    def _check_tensor(self, op: str, tensor: torch.Tensor, what: str = "tensor") -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != self.device.type:
            fix = (
                "move it to CPU (tensor.cpu()) or use NCCLCommunicationBackend"
                if tensor.device.type == "cuda"
                else f"move it to {self.device.type} (tensor.to('{self.device.type}'))"
            )
            raise ValueError(
                f"{op}: {what} on {tensor.device} but backend {type(self).__name__} works on {self.device.type} "
                f"tensors; {fix}"
            )
        if tensor.dtype not in _DTYPE_CODES:
            supported = ", ".join(str(d).removeprefix("torch.") for d in _DTYPE_CODES)
            raise TypeError(f"{op}: dtype {tensor.dtype} is not supported; use one of {supported}")
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {what} (shape {tuple(tensor.shape)}) is not contiguous; pass tensor.contiguous()")

    def _check_pair(self, op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
        self._check_tensor(op, inp, "inp")
        self._check_tensor(op, out, "out")
        if inp.dtype != out.dtype:
            raise TypeError(f"{op}: inp is {inp.dtype} but out is {out.dtype}; both must have the same dtype")
        if inp.device != out.device:
            raise ValueError(f"{op}: inp is on {inp.device} but out on {out.device}; put both on one device")

    def _check_reduction(self, op_name: str, op: ReductionOperation, dtype: torch.dtype) -> None:
        if op is ReductionOperation.AVERAGE and not dtype.is_floating_point:
            raise TypeError(
                f"{op_name}: AVERAGE of {dtype} is not defined (integer division would truncate); "
                f"use SUM and divide, or a floating-point tensor"
            )

    def _check_peer(self, op: str, peer: int, what: str, allow_self: bool = False) -> None:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"{op}: {what} must be an int rank, got {peer!r}")
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"{op}: {what}={peer} is out of range for group '{self.group}' of {self.world_size} ranks "
                f"(valid: 0..{self.world_size - 1})"
            )
        if peer == self.rank and not allow_self:
            raise ValueError(f"{op}: {what}={peer} is this rank itself; a rank cannot {op} to/from itself")
