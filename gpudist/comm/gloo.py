"""Gloo backend: CPU tensors between processes (one machine or many), over ``torch.distributed``'s Gloo.

gpudist calls the ``ProcessGroupGloo`` object directly (no ``torch.distributed`` wrapper per call) and gives
every op an explicit timeout, so a peer that hangs or dies raises :class:`CommunicationError` within
``timeout`` seconds.

Consistency check: Gloo aborts the whole process (SIGABRT from its I/O thread, not an exception) when ranks
pass different sizes or dtypes to a collective, and a ``recv`` larger than the matching ``send`` silently
receives a short message (both seen with torch 2.13). With ``validate=True`` (the default) every collective
first exchanges a 14-int64 signature among the ranks (one small all-gather) and raises
:class:`CollectiveMismatchError` on every rank before the real op is sent; point-to-point ops exchange the
receiver's expected shape before the payload (``gpudist.comm.handshake``), and a mismatch raises on both ranks. The
check costs one small-message latency per op (measured in ``benchmarks/collectives.py``); ``validate=False``, or
``with comm.unchecked():`` around ops whose shapes agree by construction, removes it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .base import DEFAULT_TIMEOUT, CommunicationBackend
from .errors import CommunicationError, CommunicationTimeoutError, first_line
from .handshake import Handshake
from .reduction import ReductionOperation
from .shards import shard_range
from .shm import SharedMemoryChannel, shm_requested
from .signature import Signature
from .work import Work

try:  # the option structs moved between modules across torch releases; both names exist in 2.11-2.13
    from torch.distributed.distributed_c10d import (
        AllgatherOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
    )
except ImportError:  # pragma: no cover
    from torch._C._distributed_c10d import (
        AllgatherOptions,
        AllreduceOptions,
        AllToAllOptions,
        BarrierOptions,
        BroadcastOptions,
    )

__all__ = ["GlooCommunicationBackend", "create_store", "is_loopback", "join_timeout"]

_TORCH_OPS = {
    ReductionOperation.SUM: dist.ReduceOp.SUM,
    ReductionOperation.AVERAGE: dist.ReduceOp.AVG,
    ReductionOperation.MAX: dist.ReduceOp.MAX,
    ReductionOperation.MIN: dist.ReduceOp.MIN,
    ReductionOperation.PRODUCT: dist.ReduceOp.PRODUCT,
}


def _socket_fds() -> dict[int, int]:
    """This process's sockets, ``{fd: inode}`` (Linux ``/proc``; empty elsewhere)."""
    fds = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            fds[int(name)] = int(link[8:-1])
    return fds


def _store_port(store: dist.Store) -> int | None:
    """The TCP port of the TCPStore under ``store`` (PrefixStores unwrapped), or None."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return getattr(store, "port", None)


@contextlib.contextmanager
def _borrowed_socket(fd: int) -> Iterator[socket.socket | None]:
    """The socket behind ``fd``, without taking it over (detached on exit, so its owner keeps it); None when the fd
    was closed meanwhile."""
    try:
        sock = socket.socket(fileno=fd)  # wraps the fd, no dup
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()


def _new_sockets(before: dict[int, int], store_port: int | None) -> frozenset[int]:
    """The inodes of the connected sockets opened since ``before`` (:func:`_socket_fds`), less those on the store's
    port (a store server in this process accepts its clients meanwhile; those connections are not the group's)."""
    old, new = set(before.values()), set()
    for fd, inode in _socket_fds().items():
        if inode in old:
            continue
        with _borrowed_socket(fd) as sock:
            if sock is None:  # closed meanwhile
                continue
            try:
                ports = {sock.getsockname()[1], sock.getpeername()[1]}
            except (OSError, IndexError, TypeError):  # a listener (no peer), or not an IP socket: not a connection
                continue
            if store_port is None or store_port not in ports:
                new.add(inode)
    return frozenset(new)


_HANDSHAKE_TAG = 1
"""Gloo's tag for the point-to-point handshake (status and payload go on tag 0): see ``gpudist.comm.handshake``."""

_PEER_GONE = (
    "Connection reset",
    "Connection closed",
    "Connection refused",
    "Broken pipe",
    "Read error",
    "Write error",
    "closed by peer",
    "Socket closed",
)


_EXIT_GRACE = 0.5
"""Seconds after the last Gloo op completed during which the interpreter does not finish (see ``_retain``): Gloo's
worker thread lets go of an op within microseconds of completing it, unless the machine is loaded and it waits for a
core; half a second covers that on a loaded 2-core CI machine."""
_last_completion = [-_EXIT_GRACE]


def _op_completed() -> None:
    _last_completion[0] = time.monotonic()


@atexit.register
def _let_gloo_threads_go() -> None:
    """At exit, give Gloo's worker threads the moment they need to let go of the last ops (sleeping releases the
    GIL they need to free the ops' tensors) before the interpreter finishes: a free during finalization aborts."""
    left = _last_completion[0] + _EXIT_GRACE - time.monotonic()
    if left > 0:
        time.sleep(left)


def join_timeout(timeout: float, connect_timeout: float | None) -> float:
    """Seconds a rank waits for its peers to join: ``connect_timeout``, or by default the longer of the op timeout
    and :data:`DEFAULT_TIMEOUT` (joining waits for the slowest process start, which no op timeout should bound)."""
    join = max(timeout, DEFAULT_TIMEOUT) if connect_timeout is None else connect_timeout
    if not join > 0:
        raise ValueError(f"connect_timeout must be a positive number of seconds, got {connect_timeout!r}")
    return float(join)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def create_store(master_addr: str, master_port: int, rank: int, world_size: int, timeout: float) -> dist.Store:
    """The rendezvous store: in-process for one rank, else a TCPStore hosted by rank 0.

    Rank 0 binds the listening socket itself, to ``master_addr`` only (TCPStore's own server listens on every
    interface), so a loopback ``MASTER_ADDR`` keeps the store off the network.
    """
    if world_size == 1:
        return dist.HashStore()
    delta = datetime.timedelta(seconds=timeout)
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Under torchrun the agent already hosts a store on MASTER_PORT: every rank joins it as a client, in
            # a namespace per restart attempt (as torch's env:// rendezvous does), so a restarted group never
            # reads the keys of the attempt before it.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            agent = dist.TCPStore(master_addr, master_port, world_size, False, delta)
            return dist.PrefixStore(f"/gpudist/attempt_{attempt}", agent)
        if rank == 0:
            listener = socket.create_server((master_addr, master_port), backlog=max(128, world_size))
            fd = listener.detach()  # owned by the store from here on
            return dist.TCPStore(
                master_addr,
                master_port,
                world_size,
                True,
                delta,
                wait_for_workers=True,
                master_listen_fd=fd,
                use_libuv=False,
            )
        return dist.TCPStore(master_addr, master_port, world_size, False, delta)
    except OSError as e:
        raise CommunicationError(
            f"rank {rank} could not open the rendezvous store at {master_addr}:{master_port}: {e}; "
            f"set MASTER_PORT to a free port",
            op="init",
            group="world",
            rank=rank,
        ) from e
    except RuntimeError as e:  # DistStoreError: peers did not show up in time
        raise CommunicationTimeoutError(
            f"rank {rank} of {world_size}: rendezvous at {master_addr}:{master_port} did not complete within "
            f"{timeout:g}s ({e}); a rank never joined (check that all {world_size} processes started and "
            f"agree on MASTER_ADDR/MASTER_PORT)",
            op="init",
            group="world",
            rank=rank,
        ) from e


class GlooCommunicationBackend(CommunicationBackend):
    """One rank of a Gloo process group: the CPU multi-process and multi-machine path.

    Wraps an existing ``torch.distributed`` process group (default: the initialized default group), or joins
    one from the environment with :meth:`from_env` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, as torchrun sets them). Every op is given ``timeout`` seconds.

    Args:
        process_group: An initialized ``torch.distributed`` process group with a Gloo backend for CPU tensors;
            None: the default (world) group.
        timeout: Seconds every op may take (> 0).
        validate: Check across ranks, before each collective, that all called the same op with the same shape,
            dtype and root (one small round trip per op).
        shm: Collective when not None: every rank says whether it wants ``all_reduce``, ``reduce_scatter``,
            ``all_gather`` and ``broadcast`` to go through a shared-memory region (``gpudist.comm.shm``); they do
            when all want it and share a host. None: plain Gloo, no exchange. Sub-groups inherit it.

    Raises:
        CommunicationError: When ``process_group`` is None and ``torch.distributed`` is not initialized.
        ValueError: When the process group has no Gloo backend for CPU tensors, or ``timeout`` is not positive.
    """

    name = "gloo"

    _sockets: frozenset[int] = frozenset()  # a joined group's TCP connections (socket inodes): see abort
    _abort_reason: str | None = None

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        validate: bool = True,
        _gloo: object | None = None,
        _store: dist.Store | None = None,
        _rank_world: tuple[int, int] | None = None,
        _group_name: str = "world",
        shm: bool | None = None,
    ):
        if _gloo is None:
            if process_group is None:
                if not dist.is_initialized():
                    raise CommunicationError(
                        "torch.distributed is not initialized; use GlooCommunicationBackend.from_env() or "
                        "gpudist.init(), or pass an initialized process group",
                        op="init",
                        group="world",
                    )
                process_group = dist.group.WORLD
            try:
                _gloo = process_group._get_backend(torch.device("cpu"))
            except RuntimeError as e:
                raise ValueError(
                    f"process group has no Gloo backend for CPU tensors ({e}); create it with backend='gloo'"
                ) from e
            if type(_gloo).__name__ != "ProcessGroupGloo":
                raise ValueError(f"process group's CPU backend is {type(_gloo).__name__}, not Gloo")
            _rank_world = (process_group.rank(), process_group.size())
            _group_name = "world" if process_group is dist.group.WORLD else (process_group.group_name or "pg")
            if _store is None and dist.is_initialized():
                _store = dist.distributed_c10d._get_default_store()
        super().__init__(*_rank_world, _group_name, timeout)
        self._gloo = _gloo
        self._store = _store
        self.validate = validate
        self._delta = datetime.timedelta(seconds=self.timeout)
        self._subgroups = 0
        self._handshake = Handshake(self.group, self.rank, f"gpudist-send-r{self.rank}")
        self._children: weakref.WeakSet[GlooCommunicationBackend] = weakref.WeakSet()
        self._in_flight: list = []  # see _retain
        self._in_flight_lock = threading.Lock()
        self._shm_wish = shm
        self._shm: SharedMemoryChannel | None = None
        if shm is not None:
            with self._failures("init"):
                self._shm = SharedMemoryChannel.open(
                    self._gather_rows, self.rank, self.world_size, self.group, self.timeout, shm
                )

    @classmethod
    def from_env(
        cls, timeout: float = DEFAULT_TIMEOUT, validate: bool = True, connect_timeout: float | None = None
    ) -> GlooCommunicationBackend:
        """Join (and initialize ``torch.distributed`` with) the Gloo group described by torchrun's variables.

        Args:
            timeout: Seconds every op may take.
            validate: Check every collective's call signature across ranks.
            connect_timeout: Seconds to wait for every rank to join (see :meth:`create`).

        Returns:
            This rank's backend of the world group.

        Raises:
            CommunicationError: When ``RANK`` or ``WORLD_SIZE`` is not set, or as :meth:`create` raises.
            CommunicationTimeoutError: When the group did not form within ``connect_timeout``.
            ValueError: As :meth:`create` raises.
        """
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in os.environ]
        if missing:
            raise CommunicationError(
                f"environment lacks {', '.join(missing)}; launch with torchrun or mpirun, or use gpudist.init(), "
                f"which also reads Open MPI's and MPICH's variables",
                op="init",
                group="world",
            )
        return cls.create(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29500")),
            timeout=timeout,
            validate=validate,
            connect_timeout=connect_timeout,
        )

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        timeout: float = DEFAULT_TIMEOUT,
        validate: bool = True,
        store: dist.Store | None = None,
        connect_timeout: float | None = None,
        shm: bool | None = None,
    ) -> GlooCommunicationBackend:
        """Initialize ``torch.distributed``'s default group with Gloo and return this rank's backend.

        ``connect_timeout`` bounds the join (rendezvous and Gloo's connections to every peer) in seconds: how long
        the first rank waits for the last one to start. It defaults to ``max(timeout, DEFAULT_TIMEOUT)``, so a
        short per-op ``timeout`` (fast failure detection) does not also fail a job whose ranks take a while to
        import torch on a loaded machine. Every op afterwards gets ``timeout``.

        Args:
            rank: This process's rank.
            world_size: The number of processes.
            master_addr: The address rank 0 hosts the rendezvous store on.
            master_port: That store's port.
            timeout: Seconds every op may take.
            validate: Check every collective's call signature across ranks.
            store: An existing ``torch.distributed`` store to rendezvous through; None: create one.
            connect_timeout: Seconds to wait for every rank to join, as described above.
            shm: Run the collectives through shared memory where every rank shares this host (see the class);
                None: ``GPUDIST_SHM`` (``0`` or ``1``), else ``gpudist.comm.shm.DEFAULT``.

        Returns:
            This rank's backend of the new default (world) group.

        Raises:
            CommunicationError: When ``torch.distributed`` is already initialized, or the rendezvous store could
                not be opened (e.g. the port is taken).
            CommunicationTimeoutError: When the other ranks did not join within ``connect_timeout``.
            ValueError: When ``rank`` is not in ``0..world_size-1``, or ``connect_timeout`` or ``timeout`` is not
                positive.
        """
        if dist.is_initialized():
            raise CommunicationError(
                "torch.distributed is already initialized; wrap the existing group with "
                "GlooCommunicationBackend(process_group) instead",
                op="init",
                group="world",
                rank=rank,
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} out of range for WORLD_SIZE={world_size}")
        if is_loopback(master_addr):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep Gloo's own sockets on loopback too
        join = join_timeout(timeout, connect_timeout)
        if store is None:
            store = create_store(master_addr, master_port, rank, world_size, join)
        try:
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=join)
            )
        except RuntimeError as e:
            raise CommunicationTimeoutError(
                f"rank {rank}: Gloo process group did not form within {join:g}s: {e}",
                op="init",
                group="world",
                rank=rank,
            ) from e
        return cls(dist.group.WORLD, timeout=timeout, validate=validate, _store=store, shm=shm_requested(shm))

    @classmethod
    def join_group(
        cls,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        name: str,
        timeout: float = DEFAULT_TIMEOUT,
        validate: bool = True,
        connect_timeout: float | None = None,
    ) -> GlooCommunicationBackend:
        """Form a new Gloo group of ``world_size`` ranks meeting on ``store``, outside ``torch.distributed``'s
        default group, so a process can leave a failed group and form another without leaving Python (live elastic
        training builds one per membership generation). Give each group a fresh namespace
        (``dist.PrefixStore(f"gen-{g}/", store)``): Gloo's connection keys must not meet an earlier group's.

        Args:
            store: Where the ranks exchange their addresses (every rank passes the same one).
            rank: This process's rank in the new group.
            world_size: The number of ranks in the new group.
            name: The group's name in errors (e.g. ``"live-gen-3"``).
            timeout: Seconds every op may take.
            validate: Check every collective's call signature across ranks.
            connect_timeout: Seconds to wait for every rank to connect (default: as :meth:`create`).

        Returns:
            This rank's backend of the new group.

        Raises:
            CommunicationTimeoutError: When a rank did not connect within ``connect_timeout`` (it died, or never
                called this).
            ValueError: When ``rank`` is not in ``0..world_size-1`` or a timeout is not positive.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} out of range for world_size={world_size}")
        join = join_timeout(timeout, connect_timeout)
        before = _socket_fds()
        try:
            pg = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=join))
            sockets = _new_sockets(before, _store_port(store))  # its connections
        except RuntimeError as e:
            raise CommunicationTimeoutError(
                f"rank {rank}: Gloo group {name!r} of {world_size} did not form within {join:g}s: {first_line(e)}",
                op="init",
                group=name,
                rank=rank,
            ) from e
        backend = cls(
            timeout=timeout, validate=validate, _gloo=pg, _store=store, _rank_world=(rank, world_size), _group_name=name
        )
        backend._sockets = sockets
        return backend

    def abort(self, reason: str | None = None) -> None:
        """Break the group now, from any thread: shut down the sending side of this rank's TCP connections of it (a
        group from :meth:`join_group`, on Linux). Every peer's pending op that reads from this rank fails at once (its
        Gloo closes the connection on the end of stream, which fails this rank's pending ops in turn), while data
        already on its way to this rank still arrives first. What a survivor of a failure
        calls before forming the next group: a Gloo op cannot be cancelled otherwise (``ProcessGroupGloo.abort``
        returns without failing a pending receive), and a survivor that waits on another survivor which already
        left the group would wait out the op timeout. Later ops raise :class:`CommunicationError` quoting
        ``reason``. Idempotent; :meth:`shutdown` still releases the group.

        Args:
            reason: Why, quoted in this rank's errors.
        """
        self._abort_reason = reason or "aborted"
        super().abort(self._abort_reason)
        shm = self._shm
        if shm is not None:  # a peer (or this rank's worker) waiting at a shared-memory sync point fails at once
            shm.abort()
        for fd, inode in _socket_fds().items():
            if inode not in self._sockets:
                continue
            with _borrowed_socket(fd) as sock, contextlib.suppress(OSError):  # Gloo may close it meanwhile
                if sock is not None and os.fstat(fd).st_ino == inode:  # not a new socket that reused the number
                    sock.shutdown(socket.SHUT_WR)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def shared_memory(self) -> bool:
        """Whether ``all_reduce``, ``reduce_scatter``, ``all_gather`` and ``broadcast`` go through a shared-memory
        region (``gpudist.comm.shm``) rather than TCP."""
        return self._shm is not None

    # -- machinery ---------------------------------------------------------------------------------------------------

    def _translate(self, error: BaseException, op: str) -> CommunicationError:
        text = first_line(error)
        # Gloo words its timeouts several ways: "Timed out waiting ...", "... timed out ...", and on the pair a wait
        # gave up on, "Application timeout caused pair closure".
        if any(s in text.lower() for s in ("timed out", "timeout")):
            return self._error(
                f"timed out after {self.timeout:g}s: a peer never called {op}, hangs, or died ({text})",
                op,
                CommunicationTimeoutError,
            )
        if self._abort_reason is not None:
            return self._error(f"the group was aborted on this rank ({self._abort_reason}): {text}", op)
        if any(s in text for s in _PEER_GONE):
            return self._error(
                f"a peer process closed its connection (it died, was killed or aborted the group): {text}", op
            )
        return self._error(text, op)

    def _gather_rows(self, mine: torch.Tensor) -> torch.Tensor:
        everyone = torch.empty(self.world_size * mine.numel(), dtype=mine.dtype)
        self._gather_signatures("init", mine, everyone)
        return everyone.view(self.world_size, -1)

    def _gather_signatures(self, op: str, mine: torch.Tensor, everyone: torch.Tensor) -> None:
        self._keep(self._gloo._allgather_base(everyone, mine, self._opts(AllgatherOptions))).wait()
        _op_completed()

    def _opts(self, cls, **fields):
        opts = cls()
        opts.timeout = self._delta
        for k, v in fields.items():
            setattr(opts, k, v)
        return opts

    def _keep(self, work):
        self._retain((work,))
        return work

    def _retain(self, works) -> None:
        """Hold the ops in flight, and let completed ones go at once (their tensors must not outlive them: a bucket's
        send buffer held here stayed alive after backward).

        Gloo's worker thread drops its reference to an op a moment after completing it; if that is the last one, it
        frees the op's tensors, which takes the GIL. That is harmless while the interpreter runs, but during its
        shutdown it kills the thread inside C++ and aborts the process ("terminate called without an active
        exception"; 1 in 8 three-rank torchrun runs of gpudist.testing.elastic_job, when nothing held the ops). So ops
        are
        held while in flight, and at exit :func:`_let_gloo_threads_go` waits out that moment after the last one.
        Called from the send thread too."""
        with self._in_flight_lock:
            kept = [w for w in self._in_flight if not w.is_completed()]
            if len(kept) < len(self._in_flight):
                _op_completed()
            self._in_flight = kept + list(works)

    def _release(self, works) -> None:
        _op_completed()
        done = {id(w) for w in works}
        with self._in_flight_lock:
            self._in_flight = [w for w in self._in_flight if id(w) not in done]

    def _work(self, *works, then=None, p2p: bool = False) -> Work:
        self._retain(works)
        # Point-to-point ops take no options struct, so their wait is given the op timeout here (Gloo's default
        # would be the group's, which is the longer join timeout for the world group).
        bound = (self._delta,) if p2p else ()

        def wait() -> None:
            for w in works:
                w.wait(*bound)
            self._release(works)
            if then is not None:
                then()

        return Work(wait, lambda: all(w.is_completed() for w in works))

    # -- the ops -----------------------------------------------------------------------------------------------------

    def _all_reduce(self, sig: Signature, tensor: torch.Tensor, op: ReductionOperation) -> Work:
        self._check(sig)
        if self._shm is not None:
            return self._shm.all_reduce(tensor, op)
        return self._work(self._gloo.allreduce([tensor], self._opts(AllreduceOptions, reduceOp=_TORCH_OPS[op])))

    # Gloo's own reduce-scatter and all-gather are the slow ones here: on 2-4 loopback processes
    # ``_reduce_scatter_base`` took about twice an all-reduce of the same buffer, and ``_allgather_base`` about three
    # times one broadcast per rank's range (docs/results.md, "Collectives"). So the
    # reduce-scatter all-reduces a scratch copy and keeps this rank's range, and the all-gather broadcasts each
    # rank's range straight into ``out``. Both take uneven ranges with no padding. ``python -m
    # benchmarks.collectives`` measures them against torch.distributed's calls in one run. A caller done with its
    # input (``scratch_input``: ZeRO-2's freshly packed bucket) has it reduced in place, without the copy.

    def _reduce_scatter(
        self, sig: Signature, inp: torch.Tensor, out: torch.Tensor, op: ReductionOperation, scratch_input: bool = False
    ) -> Work:
        self._check(sig)
        if self._shm is not None:
            return self._shm.reduce_scatter(inp, out, op)
        scratch = inp.view(-1) if scratch_input else inp.reshape(-1).clone()
        start, end = shard_range(scratch.numel(), self.world_size, self.rank)
        work = self._gloo.allreduce([scratch], self._opts(AllreduceOptions, reduceOp=_TORCH_OPS[op]))
        mine = scratch[start:end]
        if out.numel() == 0 or out.data_ptr() == mine.data_ptr():  # in place: out is inp's own range already
            return self._work(work)
        return self._work(work, then=lambda: out.view(-1).copy_(mine))

    def _all_gather(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        self._check(sig)
        if self._shm is not None:
            return self._shm.all_gather(inp, out)
        flat = out.view(-1)
        ranges = [shard_range(flat.numel(), self.world_size, r) for r in range(self.world_size)]
        mine = flat[slice(*ranges[self.rank])]
        if mine.numel() and mine.data_ptr() != inp.data_ptr():  # in place when inp is already out's own range
            mine.copy_(inp.view(-1))
        works = [
            self._gloo.broadcast([flat[start:end]], self._opts(BroadcastOptions, rootRank=r, rootTensor=0))
            for r, (start, end) in enumerate(ranges)
            if end > start
        ]
        return self._work(*works)

    def _broadcast(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        self._check(sig)
        if self._shm is not None:
            return self._shm.broadcast(tensor, src)
        return self._work(self._gloo.broadcast([tensor], self._opts(BroadcastOptions, rootRank=src, rootTensor=0)))

    def _all_to_all(self, sig: Signature, inp: torch.Tensor, out: torch.Tensor) -> Work:
        self._check(sig)
        return self._work(self._gloo.alltoall_base(out.view(-1), inp.view(-1), [], [], self._opts(AllToAllOptions)))

    def _barrier(self, sig: Signature) -> Work:
        self._check(sig)
        if self._shm is not None:  # like Gloo's barrier, which waits for the group's earlier ops
            self._shm.drain()
        return self._work(self._gloo.barrier(self._opts(BarrierOptions)))

    # Point-to-point with validation: Gloo completes a send only once the receiver posted its recv, and aborts on a
    # message longer than the posted buffer, so the sender first learns the receiver's shape: the handshake of
    # ``gpudist.comm.handshake``, on tag 1 (the handshake) and tag 0 (status and payload).

    def _send(self, sig: Signature, tensor: torch.Tensor, dst: int) -> Work:
        if not self.validate:
            return self._work(self._gloo.send([tensor], dst, 0), p2p=True)

        def receive_expected(expected: torch.Tensor) -> None:
            self._keep(self._gloo.recv([expected], dst, _HANDSHAKE_TAG)).wait(self._delta)

        def answer(status: torch.Tensor, payload: torch.Tensor) -> None:
            sent = self._keep(self._gloo.send([status], dst, 0))
            self._keep(self._gloo.send([payload], dst, 0)).wait(self._delta)
            sent.wait(self._delta)
            _op_completed()

        return self._handshake.send(sig, tensor, dst, receive_expected=receive_expected, answer=answer)

    def _recv(self, sig: Signature, tensor: torch.Tensor, src: int) -> Work:
        if not self.validate:
            return self._work(self._gloo.recv([tensor], src, 0), p2p=True)

        def post(expected: torch.Tensor, status: torch.Tensor, payload: torch.Tensor) -> tuple:
            return (
                self._gloo.send([expected], src, _HANDSHAKE_TAG),
                self._gloo.recv([status], src, 0),
                self._gloo.recv([payload], src, 0),
            )

        works, check = self._handshake.recv(sig, tensor, src, post=post)
        return self._work(*works, then=check, p2p=True)

    def _new_group(self, sig: Signature, ranks: list[int]) -> CommunicationBackend | None:
        self._check(sig)
        self._subgroups += 1
        if self.rank not in ranks:
            return None
        if self._store is None:
            raise CommunicationError(
                "this backend wraps a process group without a known store; create it with "
                "GlooCommunicationBackend.create()/from_env() or gpudist.init() to use new_group",
                op="new_group",
                group=self.group,
                rank=self.rank,
            )
        name = f"{self.group}/{self._subgroups}[{','.join(map(str, ranks))}]"
        store = dist.PrefixStore(f"gpudist:{name}/", self._store)
        pg = dist.ProcessGroupGloo(store, ranks.index(self.rank), len(ranks), self._delta)
        child = GlooCommunicationBackend(
            timeout=self.timeout,
            validate=self.validate,
            _gloo=pg,
            _store=store,
            _rank_world=(ranks.index(self.rank), len(ranks)),
            _group_name=name,
            shm=self._shm_wish,
        )
        self._children.add(child)
        return child

    def shutdown(self) -> None:
        """Stop the send thread, shut down the sub-groups made from this one, and release the Gloo process group
        (the default one too, if this backend wraps it). Later ops raise a CommunicationError.

        At exit no Gloo thread may be left to free an op's tensors during interpreter finalization (see ``_work``);
        torch itself keeps the world group alive after destroy_process_group() once torch.optim was imported."""
        for child in list(self._children):
            child.shutdown()
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._handshake.close()
        if self.group == "world" and dist.is_initialized():
            dist.destroy_process_group()
        self._gloo = None
        with self._in_flight_lock:
            held, self._in_flight = self._in_flight, []
        if held:
            # A finished op stays in Gloo's worker thread for a moment after wait() returns; give the threads time
            # to let go (no GIL needed while we hold a reference), then free the ops here, with the GIL.
            time.sleep(0.05)
            del held
        self._store = None
        super().shutdown()
