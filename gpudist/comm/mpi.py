"""MPI backend: CPU tensors between processes started by ``mpirun``/``mpiexec``/``srun``, through ``mpi4py``.

Tensors go to MPI as numpy views of their memory (no copy). Collectives run in issue order on one communication
thread per backend, with MPI's blocking calls: Open MPI's tuned blocking algorithms measured several times faster
than its non-blocking (``Iallreduce``...) ones (docs/results.md, "MPI"), which also only progress while someone
polls. So ``async_op=True``
overlaps for real (the thread communicates while the caller computes; mpi4py releases the GIL), and a blocking
op waits for the thread at most ``timeout`` seconds, then raises :class:`CommunicationTimeoutError` naming op,
group and rank and marks the backend unusable (the thread stays stuck in MPI: end the job with
:meth:`~MPICommunicationBackend.abort_job`).
Uneven reduce-scatter and all-gather shares use MPI's vector forms (no padding). Sub-groups are ``Comm.Split``.

MPI has no bf16 or fp16 reduction: those are reduced in fp32 and rounded once at the end (more accurate than a
transport that rounds after every addition). AVERAGE is SUM divided by the group size. Messages are counted in
elements, so one tensor may hold at most 2**31 - 1 elements (MPI's int count).

Like the Gloo backend, collectives first exchange a 14-int64 signature (``validate=True``) and raise
:class:`CollectiveMismatchError` on every rank before a mismatched op is sent. ``send``/``recv`` are MPI's
non-blocking point-to-point calls polled with the timeout (so a blocking ``send`` and the peer's ``recv`` can meet
in any order); the sender first learns the receiver's posted shape (the handshake of ``gpudist.comm.handshake``, on a
second thread: MPI_THREAD_MULTIPLE), and a mismatch raises on both ranks.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from .base import DEFAULT_TIMEOUT, CommunicationBackend
from .errors import CommunicationError, CommunicationTimeoutError, first_line
from .handshake import Handshake
from .reduction import ReductionOperation
from .shards import split_sizes
from .signature import Signature
from .work import Work

__all__ = ["MPICommunicationBackend"]

_PAYLOAD, _STATUS, _HANDSHAKE = 0, 1, 2
_NARROW = (torch.bfloat16, torch.float16)  # no MPI type: moved as int16 bits, reduced in fp32


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise CommunicationError(
            f"MPICommunicationBackend needs mpi4py and an MPI library ({e}); install them with "
            "`apt-get install openmpi-bin libopenmpi-dev` (or your cluster's MPI module) and "
            "`pip install 'gpudist[mpi]'`",
            op="init",
            group="world",
        ) from e
    return MPI


def _buffer(t: torch.Tensor):
    """A numpy view of ``t``'s memory (2-byte floats as int16 bits): what MPI reads or writes, no copy."""
    flat = t.detach().reshape(-1)
    return (flat.view(torch.int16) if flat.dtype in _NARROW else flat).numpy()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class MPICommunicationBackend(CommunicationBackend):
    """One rank of an MPI communicator (default ``MPI.COMM_WORLD``) exchanging CPU tensors.

    Start the processes with ``mpirun -np N python train.py`` and build the backend with ``gpudist.init("mpi")``
    or ``MPICommunicationBackend()``. Every op is given ``timeout`` seconds.

    Args:
        comm: An mpi4py communicator; None: ``MPI.COMM_WORLD``.
        timeout: Seconds every op may take (> 0).
        validate: Check across ranks, before each collective, that all called the same op with the same shape,
            dtype and root.
        group: The group's name, used in error messages.

    Raises:
        CommunicationError: When mpi4py (or an MPI library) is not installed.
        ValueError: When ``timeout`` is not positive.
    """

    name = "mpi"

    _abort_reason: str | None = None  # see abort
    _shut = False

    def __init__(self, comm=None, *, timeout: float = DEFAULT_TIMEOUT, validate: bool = True, group: str = "world"):
        MPI = _mpi()
        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)  # errors become MPI.Exception (a RuntimeError), not aborts
        super().__init__(self._comm.Get_rank(), self._comm.Get_size(), group, timeout)
        self.validate = validate
        self._ops = {
            ReductionOperation.SUM: MPI.SUM,
            ReductionOperation.AVERAGE: MPI.SUM,
            ReductionOperation.MAX: MPI.MAX,
            ReductionOperation.MIN: MPI.MIN,
            ReductionOperation.PRODUCT: MPI.PROD,
        }
        self._subgroups = 0
        self._handshake = Handshake(self.group, self.rank, f"gpudist-mpi-send-r{self.rank}")
        self._queue: queue.SimpleQueue | None = None  # the communication thread's work, started on first use
        self._abandoned: list[tuple[Sequence, Sequence]] = []  # see _poll

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # -- machinery ---------------------------------------------------------------------------------------------------

    def _poll(self, requests: Sequence, op: str, keep: Sequence = ()) -> None:
        """Complete ``requests``, or raise CommunicationTimeoutError once ``timeout`` seconds have passed (a
        CommunicationError at once when this rank aborted the group meanwhile). Requests given up on stay pending in
        MPI, so they and the buffers in ``keep`` are held for the backend's life: a message arriving later must not
        land in freed memory."""
        deadline, pause = time.monotonic() + self.timeout, 0.0
        while not self._MPI.Request.Testall(list(requests)):
            if self._abort_reason is not None or time.monotonic() > deadline:
                self._abandoned.append((requests, keep))
                if self._abort_reason is not None:
                    raise self._aborted(op)
                raise self._error(
                    f"timed out after {self.timeout:g}s: a peer never called {op}, hangs, or died",
                    op,
                    CommunicationTimeoutError,
                )
            time.sleep(pause)  # spin briefly, then back off to 1 ms so waiting ranks leave the cores to the others
            pause = min(max(pause * 2, 1e-5), 1e-3)

    def _work(self, requests: Sequence, op: str, then: Callable[[], None] | None = None, keep: Sequence = ()) -> Work:
        """A handle polling ``requests``. ``keep`` holds the buffers MPI reads or writes until the op completed:
        mpi4py does not keep a non-blocking collective's buffers alive, and a temporary freed early is corrupted."""

        def wait() -> None:
            self._poll(requests, op, keep_alive)
            if then is not None:
                then()
            keep_alive.clear()

        keep_alive = list(keep)

        return Work(wait, lambda: self._MPI.Request.Testall(list(requests)))

    def _gather_signatures(self, op: str, mine: torch.Tensor, everyone: torch.Tensor) -> None:
        self._comm.Allgather(_buffer(mine), _buffer(everyone))  # on the communication thread, before the op

    def _collective(self, sig: Signature, call: Callable[[], None], then: Callable[[], None] | None = None) -> Work:
        """Queue ``call`` (a blocking MPI collective) behind the ones before it on the communication thread, after
        the signature check; the Work waits for it at most ``timeout`` seconds from when it starts."""
        validate = self.validate  # as the caller's unchecked() block says now, not when the thread gets to it
        future: Future = Future()
        started: list[float] = []

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            if self._abort_reason is not None:  # left the group: enter no collective the peers may never join
                future.set_exception(self._aborted(sig.op))
                return
            started.append(time.monotonic())
            try:
                self._check(sig, validate)
                call()
                if then is not None:
                    then()
                future.set_result(None)
            except BaseException as e:  # handed to the waiter
                future.set_exception(e)

        if self._queue is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(self._queue,), name=f"gpudist-mpi-r{self.rank}", daemon=True
            ).start()
        self._queue.put(run)
        submitted = time.monotonic()

        def wait() -> None:
            while True:
                try:
                    return future.result(timeout=0.05)
                except TimeoutError:
                    pass
                if self._abort_reason is not None:
                    raise self._aborted(sig.op)
                begun = started[0] if started else None
                # Queued behind other ops: those time out first; a run that never starts is bounded by 2 timeouts.
                if (begun is not None and time.monotonic() - begun > self.timeout) or (
                    time.monotonic() - submitted > 2 * self.timeout
                ):
                    raise self._error(
                        f"timed out after {self.timeout:g}s: a peer never called {sig.op}, hangs, or died",
                        sig.op,
                        CommunicationTimeoutError,
                    )

        return Work(wait, future.done)

    def _aborted(self, op: str) -> CommunicationError:
        """The error of an op pending when :meth:`abort` was called."""
        return self._error(f"the group was aborted on this rank ({self._abort_reason}) while {op} was pending", op)

    @staticmethod
    def _serve(work: queue.SimpleQueue) -> None:
        while True:
            item = work.get()
            if item is None:
                return
            item()

    def _translate(self, error: BaseException, op: str) -> CommunicationError:
        text = first_line(error)
        return self._error(f"MPI error: {text}", op)

    def _reduced(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor MPI reduces in place of ``t``: itself, or an fp32 copy for bf16/fp16."""
        return t.detach().reshape(-1).float() if t.dtype in _NARROW else t.detach().reshape(-1)

    def _finish(self, result: torch.Tensor, target: torch.Tensor, op: ReductionOperation) -> Callable[[], None]:
        """After the reduction: divide for AVERAGE and write back into ``target`` when MPI worked on a copy."""

        def then() -> None:
            if op is ReductionOperation.AVERAGE:
                result.div_(self.world_size)
            if result.data_ptr() != target.data_ptr():
                target.view(-1).copy_(result)

        return then

    # -- the ops -----------------------------------------------------------------------------------------------------

    def _all_reduce(self, sig: Signature, tensor: torch.Tensor, op: ReductionOperation) -> Work:
        work = self._reduced(tensor)
        buf = _buffer(work)
        return self._collective(
            sig, lambda: self._comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._ops[op]), self._finish(work, tensor, op)
        )

    def _reduce_scatter(
        self, sig: Signature, inp: torch.Tensor, out: torch.Tensor, op: ReductionOperation, scratch_input: bool = False
    ) -> Work:
        counts = split_sizes(inp.numel(), self.world_size)
        send = self._reduced(inp)
        # MPI forbids overlapping send and receive buffers: the in-place form (out is inp's own range) receives into
        # a copy, as bf16/fp16 do anyway.
        if out.dtype in _NARROW or _overlap(send, out):
            recv = torch.empty(out.numel(), dtype=send.dtype)
        else:
            recv = out.view(-1)
        bufs = (_buffer(send), _buffer(recv))
        return self._collective(
            sig, lambda: self._comm.Reduce_scatter(*bufs, counts, op=self._ops[op]), self._finish(recv, out, op)
        )

    def _all_gather(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        counts = split_sizes(out.numel(), self.world_size)
        displs = [sum(counts[:r]) for r in range(self.world_size)]
        recv = _buffer(out)
        mine = out.view(-1)[displs[self.rank] : displs[self.rank] + counts[self.rank]]
        # In place when inp already is out's own range (ZeRO's updated shard); MPI then sends it from there.
        send = self._MPI.IN_PLACE if inp.numel() and inp.data_ptr() == mine.data_ptr() else _buffer(inp)
        return self._collective(sig, lambda: self._comm.Allgatherv(send, [recv, (counts, displs)]))

    def _broadcast(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        buf = _buffer(tensor)
        return self._collective(sig, lambda: self._comm.Bcast(buf, root=src))

    def _all_to_all(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        bufs = (_buffer(inp), _buffer(out))
        return self._collective(sig, lambda: self._comm.Alltoall(*bufs))

    def _barrier(self, sig: Signature) -> Work:
        return self._collective(sig, self._comm.Barrier)

    # Point-to-point, validated by the handshake of ``gpudist.comm.handshake``: the receiver tells the sender what it
    # posted on _HANDSHAKE, the sender answers with its own signature on _STATUS and the payload on _PAYLOAD. The
    # sender's half runs on the handshake's thread (MPI_THREAD_MULTIPLE), so a blocking send never waits for a recv
    # this rank posts later.

    def _send(self, sig: Signature, tensor: torch.Tensor, dst: int) -> Work:
        if not self.validate:
            buf = _buffer(tensor)
            return self._work([self._comm.Isend(buf, dst, _PAYLOAD)], "send", keep=(buf,))
        if self._MPI.Query_thread() != self._MPI.THREAD_MULTIPLE:
            raise self._error(
                "validated send needs MPI_THREAD_MULTIPLE (mpi4py's default); use validate=False "
                "or an MPI library built with thread support",
                "send",
            )

        def receive_expected(expected: torch.Tensor) -> None:
            buf = _buffer(expected)
            self._poll([self._comm.Irecv(buf, dst, _HANDSHAKE)], "send", (buf,))

        def answer(status: torch.Tensor, payload: torch.Tensor) -> None:
            bufs = (_buffer(status), _buffer(payload))
            requests = [self._comm.Isend(bufs[0], dst, _STATUS), self._comm.Isend(bufs[1], dst, _PAYLOAD)]
            self._poll(requests, "send", bufs)

        return self._handshake.send(sig, tensor, dst, receive_expected=receive_expected, answer=answer)

    def _recv(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        if not self.validate:
            buf = _buffer(tensor)
            return self._work([self._comm.Irecv(buf, src, _PAYLOAD)], "recv", keep=(buf,))

        def post(expected: torch.Tensor, status: torch.Tensor, payload: torch.Tensor) -> tuple:
            bufs = (_buffer(expected), _buffer(status), _buffer(payload))
            requests = [
                self._comm.Isend(bufs[0], src, _HANDSHAKE),
                self._comm.Irecv(bufs[1], src, _STATUS),
                self._comm.Irecv(bufs[2], src, _PAYLOAD),
            ]
            return requests, bufs

        (requests, bufs), check = self._handshake.recv(sig, tensor, src, post=post)
        return self._work(requests, "recv", then=check, keep=bufs)

    def _new_group(self, sig: Signature, ranks: list[int]) -> CommunicationBackend | None:
        self._subgroups += 1
        member = self.rank in ranks
        color = 0 if member else self._MPI.UNDEFINED
        split: list = []
        self._wait(
            self._collective(
                sig, lambda: split.append(self._comm.Split(color, ranks.index(self.rank) if member else 0))
            ),
            "new_group",
        )
        if not member:
            return None
        name = f"{self.group}/{self._subgroups}[{','.join(map(str, ranks))}]"
        return MPICommunicationBackend(split[0], timeout=self.timeout, validate=self.validate, group=name)

    def abort(self, reason: str | None = None) -> None:
        """Leave the group on this rank now, from any thread (:meth:`CommunicationBackend.abort`): every later op
        raises :class:`CommunicationError` quoting ``reason``, and so does the ``wait()`` of every op pending here,
        within 50 ms (its MPI call may stay in progress on the communication or send thread: MPI cannot cancel it).
        Peers are not told (MPI has no way to fail their ops short of ending the job): theirs that wait on this rank
        fail at their timeout. The job goes on; to end it (a rank stuck inside MPI after a timeout), call
        :meth:`abort_job`. Idempotent.

        Args:
            reason: Why, quoted in this rank's errors.
        """
        self._abort_reason = reason or "aborted"
        super().abort(self._abort_reason)

    def abort_job(self, code: int = 1) -> None:
        """End the whole MPI job now (``MPI_Abort``): the way out after a timeout left a rank stuck inside MPI.

        Args:
            code: The exit code MPI gives the job.
        """
        self._comm.Abort(code)

    def shutdown(self) -> None:
        """Stop the threads and free a sub-group's communicator (``COMM_WORLD`` stays for MPI's own finalize). Later
        ops raise :class:`CommunicationError`. Idempotent."""
        if self._shut:
            return
        self._shut = True
        if self._queue is not None:
            self._queue.put(None)
        self._handshake.close()
        if self._comm is not self._MPI.COMM_WORLD:
            self._comm.Free()
        super().shutdown()
