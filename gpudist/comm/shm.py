"""Shared-memory collectives for the Gloo backend when every rank of a group runs on one host.

Gloo on loopback moves every byte through the kernel's TCP stack (a copy into the socket and one out of it, on both
sides, plus the syscalls and thread wake-ups). Ranks on one host can instead meet in one ``/dev/shm`` region: each
copies its data into its own slot, each reduces its 1/N slice of all slots, and each copies the result out. Only
``all_reduce``, ``reduce_scatter``, ``all_gather`` and ``broadcast`` go this way; point-to-point, ``all_to_all``,
``barrier`` and the signature check stay on Gloo.

Region (one per group, :data:`REGION_BYTES_PER_RANK` x (N + 1) plus a 4 KiB header; 6 MiB + 4 KiB at N = 2): two
slot sets, each N slots of :data:`CHUNK_BYTES` and a result area of the same size. Rank 0 creates the file, reserves
its pages (a ``/dev/shm`` too small for them fails here and the group stays on TCP, rather than a SIGBUS later), and
every rank maps it in whole, then rank 0 unlinks it at once, so nothing is left in ``/dev/shm`` whatever happens to
the processes later. The region is transport memory, like Gloo's socket buffers: it is mapped when the group forms,
before any model exists, and counted in every rank's RSS from then on.

Synchronization: each rank owns one 64-byte line of the header holding how many sync points it has passed and one
holding its wake-up semaphore (a process-shared POSIX semaphore: a futex). A sync point stores this rank's count,
posts every peer's semaphore, and waits until every peer's count reaches it: re-reading for up to :data:`_SPIN`, then
sleeping on its own semaphore until a peer posts (x86's store order makes a peer's data visible before its count; the
channel is used only on x86-64). Chunks alternate between the two slot sets, across ops, so one sync point per chunk
suffices: write own slot of set ``k % 2``, sync, then reduce own slice of those slots into the set's result area (or
read the peers' slots); an all-reduce reads chunk ``k``'s result after the next sync point (one more closes the op).
Slot set ``k % 2`` is written again only for chunk ``k + 2``, after the sync point of chunk ``k + 1``, which every
rank reaches only once it is done reading chunk ``k``; the result areas likewise. A wait gives up after the
backend's ``timeout`` (:class:`CommunicationTimeoutError`), at once when a peer process is gone or a peer marked the
channel failed (:class:`CommunicationError`); a failing rank marks it, so no peer waits out the full timeout.

Ops run on one worker thread per group in issue order (``async_op=True`` returns at once: DDP starts bucket
all-reduces during backward); torch's copies and reductions release the GIL.

The sums may add in another order than Gloo's ring, but every rank copies the same result, so results agree
bit for bit across ranks.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import CommunicationError, CommunicationTimeoutError, op_error
from .reduction import ReductionOperation
from .shards import shard_range
from .work import Work

__all__ = ["CHUNK_BYTES", "ENV", "SharedMemoryChannel", "host_identity", "shm_requested"]

ENV = "GPUDIST_SHM"
"""Environment switch: ``0`` keeps every Gloo group on TCP, ``1`` asks for shared memory where the ranks share a
host; unset: :data:`DEFAULT`."""

DEFAULT = True
"""Whether single-host Gloo groups use shared memory when neither the caller nor :data:`ENV` says. On: measured
faster than TCP for large all-reduces and for training steps on an idle machine, and at parity with a third busy
process on the cores (``docs/results.md``, "Shared-memory transport", has the runs)."""

CHUNK_BYTES = 1 << 20
"""Bytes of one slot: the most one rank contributes per chunk. Each chunk costs a sync point, a wait for the slowest
rank, so tiny chunks lose (256 KiB ones made a 19 MiB all-reduce slower than Gloo's TCP on a loaded 2-core machine);
large ones fall out of the cache between copy-in, reduction and copy-out. Measured on an idle 2-core machine, a 26 MB
fp32 all-reduce / reduce-scatter / all-gather of 2 ranks (median of 22, wall ms): chunks of 512 KiB 7.8 / 6.8 / 6.1,
1 MiB 6.7 / 5.3 / 6.7, 2 MiB 7.1 / 4.7 / 5.1 (with two sync points per chunk and one slot set of 2 MiB: 7.0 / 6.5 /
6.1). 1 MiB keeps the region at the size one set of 2 MiB slots had: it is resident in every rank of every group."""

REGION_BYTES_PER_RANK = 2 * CHUNK_BYTES

_LINE = 64  # one cache line per rank's counter, so ranks never write the same line
_MAGIC = 0x67707364_73686D31  # "gpdsshm1"
_POLL_PID_EVERY = 0.2  # seconds between checks that the peer processes still exist
_SPIN = 1e-4  # seconds a waiter re-reads before it starts sleeping
_MAX_SLEEP = 2e-4  # without semaphores (a libc lacking them): the longest sleep between re-reads


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _semaphores():
    """libc's ``sem_post``, ``sem_timedwait`` and ``sem_trywait`` (process-shared POSIX semaphores: a futex, so a
    waiter sleeps in the kernel until a peer posts), or None where this libc lacks them (then waits poll)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        post, timedwait, trywait, init = libc.sem_post, libc.sem_timedwait, libc.sem_trywait, libc.sem_init
    except (OSError, AttributeError):
        return None
    post.argtypes = trywait.argtypes = [ctypes.c_void_p]
    timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    post.restype = timedwait.restype = trywait.restype = init.restype = ctypes.c_int
    return post, timedwait, trywait, init


_SEM = _semaphores()


def host_identity() -> tuple[int, int, int]:
    """``(boot id, network namespace, pid namespace)`` of this process as ints; 0 where unreadable.

    Ranks share a host for this transport when the first two agree: the same kernel boot and the same network
    namespace (namespaces simulate separate hosts in the multi-host tests, so ranks in different ones are kept on
    TCP even though they could share ``/dev/shm``). Peer processes are watched by pid only within one pid namespace.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = int(f.read().strip().replace("-", ""), 16) & ((1 << 62) - 1)
    except (OSError, ValueError):
        boot = 0

    def ino(path: str) -> int:
        try:
            return os.stat(path).st_ino
        except OSError:
            return 0

    return boot, ino("/proc/self/ns/net"), ino("/proc/self/ns/pid")


def shm_requested(flag: bool | None) -> bool:
    """Whether a group should try shared memory: ``flag`` when given, else :data:`ENV`, else :data:`DEFAULT`."""
    if flag is not None:
        return bool(flag)
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    return DEFAULT


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class SharedMemoryChannel:
    """One rank's side of a group's shared-memory region and its worker thread (see the module docstring).

    Build it with :meth:`open`, collectively; it returns None where the ranks do not all share a host.
    """

    def __init__(self, mm: mmap.mmap, rank: int, world_size: int, group: str, timeout: float, pids: list[int] | None):
        self.rank, self.world_size, self.group, self.timeout = rank, world_size, group, timeout
        self._mm = mm
        self._counters = memoryview(mm).cast("q")
        self._region = torch.frombuffer(mm, dtype=torch.uint8)
        self._data = self._region[_header_bytes(world_size) :]
        self._slot_bytes = self._data.numel() // (2 * (world_size + 1))
        self._views: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pids = pids  # peers' pids (index: rank), None when they live in another pid namespace
        self._seq = 0
        self._chunks = 0  # chunks moved so far, all ops together: which slot set the next one uses
        # Each rank's wake-up semaphore, in its own header line (the mapping outlives them: they hold it exported).
        self._sem_cells = [ctypes.c_char.from_buffer(mm, _sem_offset(world_size, r)) for r in range(world_size)]
        self._sems = [ctypes.addressof(cell) for cell in self._sem_cells] if _SEM is not None else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gpudist-shm-r{rank}")
        self.nbytes = len(mm)

    # -- setup -----------------------------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        allgather: Callable[[torch.Tensor], torch.Tensor],
        rank: int,
        world_size: int,
        group: str,
        timeout: float,
        requested: bool = True,
    ) -> SharedMemoryChannel | None:
        """Map a region shared by all ranks of the group, or return None on every rank when they cannot share one.

        Collective: every rank calls it, each saying whether it wants shared memory. All ranks must want it, run
        on x86-64, share the kernel boot and network namespace, and manage to map rank 0's file; otherwise every
        rank returns None (and the group stays on Gloo's TCP).

        Args:
            allgather: All-gathers a small int64 tensor over the group: returns ``world_size`` rows of it.
            rank: This rank in the group.
            world_size: Ranks in the group.
            group: The group's name, for errors.
            timeout: Seconds one sync point may wait for the peers.
            requested: This rank's wish (:func:`shm_requested`).

        Returns:
            This rank's channel, or None.
        """
        if world_size < 2:
            return None
        header = _header_bytes(world_size)
        size = header + (world_size + 1) * REGION_BYTES_PER_RANK
        want = requested and platform.machine().lower() in ("x86_64", "amd64")
        token = secrets.randbits(62)
        path = f"/dev/shm/gpudist-{os.getpid()}-{token:x}"
        mm = None
        if want and rank == 0:
            mm = _map(path, size, header, create=True)
            if mm is None:
                want = False
            elif _SEM is not None:  # process-shared (glibc's zeroed sem_t is a process-private one)
                for r in range(world_size):
                    cell = ctypes.c_char.from_buffer(mm, _sem_offset(world_size, r))
                    _SEM[3](ctypes.addressof(cell), 1, 0)
                    del cell
        try:
            boot, net, pidns = host_identity()
            rows = allgather(torch.tensor([int(want), boot, net, pidns, os.getpid(), token], dtype=torch.int64))
            rows = rows.view(world_size, -1).tolist()
            same_host = all(r[0] == 1 and r[1] == boot and r[2] == net and boot and net for r in rows)
            if same_host and rank != 0:
                mm = _map(f"/dev/shm/gpudist-{rows[0][4]}-{rows[0][5]:x}", size, header, create=False)
            if same_host:
                ok = allgather(torch.tensor([int(mm is not None)], dtype=torch.int64))
                same_host = bool(ok.all())
        finally:
            if rank == 0 and mm is not None:
                os.unlink(path)  # every rank has mapped it (or given up): nothing stays in /dev/shm
        if not same_host:
            return None
        pids = [r[4] for r in rows] if all(r[3] == pidns and pidns for r in rows) else None
        return cls(mm, rank, world_size, group, timeout, pids)

    # -- the ops (each returns a Work; they run in issue order on the worker thread) -------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReductionOperation) -> Work:
        return self._submit("all_reduce", self._all_reduce, tensor.view(-1), op)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReductionOperation) -> Work:
        return self._submit("reduce_scatter", self._reduce_scatter, inp.view(-1), out.view(-1), op)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor) -> Work:
        return self._submit("all_gather", self._all_gather, inp.view(-1), out.view(-1))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return self._submit("broadcast", self._broadcast, tensor.view(-1), src)

    def drain(self) -> None:
        """Wait until every op issued so far has finished (a Gloo barrier waits for the group's earlier ops too)."""
        self._worker.submit(lambda: None).result()

    def abort(self) -> None:
        """Mark the channel failed, from any thread: every rank's wait at a sync point, this rank's worker's
        included, fails at once. The region stays mapped until :meth:`close`."""
        self._mark_failed()

    def close(self) -> None:
        """Stop the worker and tell the peers this rank left (their waits then fail at once); unmap when unused."""
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._mark_failed()
        self._views.clear()
        self._counters.release()
        self._counters = self._region = self._data = self._mm = None

    # -- machinery ---------------------------------------------------------------------------------------------------

    def _submit(self, op: str, fn, *args) -> Work:
        def run() -> None:
            try:
                fn(op, *args)
            except BaseException:
                self._mark_failed()
                raise

        try:
            future = self._worker.submit(run)
        except RuntimeError as e:  # submit after close()
            raise self._error(f"the shared-memory channel is closed ({e})", op) from None
        return Work(future.result, future.done)

    def _error(self, detail: str, op: str, cls: type[CommunicationError] = CommunicationError) -> CommunicationError:
        return op_error(detail, op, self.group, self.rank, cls)

    def _mark_failed(self) -> None:
        if self._counters is not None and self._counters[self._abort_index] == 0:
            self._counters[self._abort_index] = self.rank + 1
            self._wake(range(self.world_size))  # a waiting peer (or this rank's worker) sees the mark at once

    def _dead_peers(self) -> list[int]:
        """The peers whose processes are gone (none known outside this pid namespace)."""
        if self._pids is None:
            return []
        return [r for r, pid in enumerate(self._pids) if r != self.rank and not _pid_alive(pid)]

    def _wake(self, ranks) -> None:
        """Post the wake-up semaphore of each of ``ranks`` (a hint: a waiter checks the counts again)."""
        if self._sems is not None:
            for r in ranks:
                _SEM[0](self._sems[r])

    def _doze(self, seconds: float) -> None:
        """Sleep until a peer posts this rank's semaphore or ``seconds`` pass."""
        if self._sems is None:
            time.sleep(min(seconds, _MAX_SLEEP))
            return
        deadline = time.time() + seconds
        _SEM[1](self._sems[self.rank], ctypes.byref(_Timespec(int(deadline), int(deadline % 1 * 1e9))))

    def _drain(self) -> None:
        """Take back the posts left over from sync points this rank did not sleep at (each peer posts at every one),
        so a later wait sleeps rather than spinning through them. A post taken here that belongs to a later sync
        point was made after its poster's count was stored, so that wait finds the count without sleeping."""
        if self._sems is not None:
            mine = self._sems[self.rank]
            while _SEM[2](mine) == 0:
                pass

    @property
    def _abort_index(self) -> int:
        return self.world_size * _LINE // 8

    def _sync(self, op: str) -> None:
        """Arrive at the next sync point and wait until every peer has arrived at it."""
        self._seq += 1
        seq, counters, step = self._seq, self._counters, _LINE // 8
        counters[self.rank * step] = seq
        self._wake(r for r in range(self.world_size) if r != self.rank)
        start = time.perf_counter()
        last_pid_check = start
        for peer in range(self.world_size):
            while counters[peer * step] < seq:
                now = time.perf_counter()
                failed = counters[self._abort_index]
                # A peer stores its count before it marks the channel closed or exits (x86 keeps stores in order),
                # so it may have arrived and then left between the read above and this one: read its count again.
                if failed and counters[peer * step] >= seq:
                    break
                if failed:
                    dead = self._dead_peers()
                    if dead:  # the rank that marked it saw a death first: name the dead one
                        raise self._error(
                            f"rank {dead[0]} (pid {self._pids[dead[0]]}) died while this rank waited (rank "
                            f"{failed - 1} marked the shared-memory channel failed)",
                            op,
                        )
                    raise self._error(
                        f"rank {failed - 1} of the shared-memory channel failed or shut down; the group is unusable",
                        op,
                    )
                if now - start > self.timeout:
                    raise self._error(
                        f"timed out after {self.timeout:g}s waiting for rank {peer} (shared memory): a peer never "
                        f"called {op}, hangs, or died",
                        op,
                        CommunicationTimeoutError,
                    )
                if self._pids is not None and now - last_pid_check > _POLL_PID_EVERY:
                    last_pid_check = now
                    if not _pid_alive(self._pids[peer]) and counters[peer * step] < seq:
                        raise self._error(f"rank {peer} (pid {self._pids[peer]}) died while this rank waited", op)
                if now - start > _SPIN:
                    self._doze(min(_POLL_PID_EVERY, max(self.timeout - (now - start), 0.0) + 1e-3))
        self._drain()

    def _slots(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(slots, results)`` of both slot sets viewed as ``dtype``: world_size x capacity and capacity elements."""
        if dtype not in self._views:
            per = self._slot_bytes // torch.empty((), dtype=dtype).element_size()
            sets = self._data.view(dtype)[: 2 * (self.world_size + 1) * per].view(2, self.world_size + 1, per)
            self._views[dtype] = (
                [sets[b, : self.world_size] for b in (0, 1)],
                [sets[b, self.world_size] for b in (0, 1)],
            )
        return self._views[dtype]

    def _reduce(self, parts: torch.Tensor, out: torch.Tensor, op: ReductionOperation) -> None:
        """``out`` = ``op`` over ``parts``' first dimension (the ranks' slots)."""
        if op in (ReductionOperation.SUM, ReductionOperation.AVERAGE):
            if parts.shape[0] == 2:
                torch.add(parts[0], parts[1], out=out)
            else:
                torch.sum(parts, dim=0, dtype=out.dtype, out=out)
            if op is ReductionOperation.AVERAGE:
                out.div_(self.world_size)
        elif op is ReductionOperation.MAX:
            torch.amax(parts, dim=0, out=out)
        elif op is ReductionOperation.MIN:
            torch.amin(parts, dim=0, out=out)
        else:
            torch.prod(parts, dim=0, dtype=out.dtype, out=out)

    def _buffer(self) -> int:
        """The slot set (0 or 1) of the next chunk: chunks alternate between two, across ops."""
        self._chunks += 1
        return self._chunks & 1

    def _all_reduce(self, op: str, flat: torch.Tensor, reduction: ReductionOperation) -> None:
        slots, results = self._slots(flat.dtype)
        capacity = slots[0].shape[1]
        unread = None  # (chunk, its result area, length): copied out after the next sync point
        for start in range(0, flat.numel(), capacity):
            chunk = flat[start : start + capacity]
            n, b = chunk.numel(), self._buffer()
            slots[b][self.rank, :n].copy_(chunk)
            self._sync(op)  # every slot of this chunk written, every share of the previous chunk reduced
            if unread is not None:
                unread[0].copy_(unread[1][: unread[2]])
            a, e = shard_range(n, self.world_size, self.rank)
            if e > a:
                self._reduce(slots[b][:, a:e], results[b][a:e], reduction)
            unread = chunk, results[b], n
        if unread is not None:
            self._sync(op)
            unread[0].copy_(unread[1][: unread[2]])

    def _reduce_scatter(self, op: str, inp: torch.Tensor, out: torch.Tensor, reduction: ReductionOperation) -> None:
        slots, _ = self._slots(inp.dtype)
        segment = slots[0].shape[1] // self.world_size  # the slot holds a segment of every rank's range
        ranges = [shard_range(inp.numel(), self.world_size, r) for r in range(self.world_size)]
        longest = max(b - a for a, b in ranges)
        for offset in range(0, longest, segment):
            mine = slots[self._buffer()]
            for r, (a, b) in enumerate(ranges):
                piece = inp[a + offset : min(b, a + offset + segment)]
                mine[self.rank, r * segment : r * segment + piece.numel()].copy_(piece)
            self._sync(op)
            a, b = ranges[self.rank]
            n = max(0, min(segment, b - a - offset))
            if n:
                base = self.rank * segment
                self._reduce(mine[:, base : base + n], out[offset : offset + n], reduction)

    def _all_gather(self, op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
        slots, _ = self._slots(inp.dtype)
        capacity = slots[0].shape[1]
        ranges = [shard_range(out.numel(), self.world_size, r) for r in range(self.world_size)]
        longest = max(b - a for a, b in ranges)
        mine = out[slice(*ranges[self.rank])]
        if mine.numel() and mine.data_ptr() != inp.data_ptr():  # in place when inp is out's own range
            mine.copy_(inp)
        for offset in range(0, longest, capacity):
            piece, these = inp[offset : offset + capacity], slots[self._buffer()]
            these[self.rank, : piece.numel()].copy_(piece)
            self._sync(op)
            for r, (a, b) in enumerate(ranges):
                n = max(0, min(capacity, b - a - offset))
                if r != self.rank and n:
                    out[a + offset : a + offset + n].copy_(these[r, :n])

    def _broadcast(self, op: str, flat: torch.Tensor, src: int) -> None:
        slots, _ = self._slots(flat.dtype)
        capacity = slots[0].shape[1]
        for start in range(0, flat.numel(), capacity):
            chunk, these = flat[start : start + capacity], slots[self._buffer()]
            if self.rank == src:
                these[src, : chunk.numel()].copy_(chunk)
            self._sync(op)
            if self.rank != src:
                chunk.copy_(these[src, : chunk.numel()])


def _header_bytes(world_size: int) -> int:
    """The header: a line per rank's sync count, one for the failure mark, a line per rank's wake-up semaphore; the
    magic number in its last 8 bytes."""
    return -(-((2 * world_size + 1) * _LINE + 8) // 4096) * 4096


def _sem_offset(world_size: int, rank: int) -> int:
    """Where rank ``rank``'s wake-up semaphore starts in the region."""
    return (world_size + 1 + rank) * _LINE


def _map(path: str, size: int, header: int, create: bool) -> mmap.mmap | None:
    """Map ``path`` (creating it, ``size`` bytes, with the magic number, if ``create``); None where that fails, or
    where the file found is not one rank 0 made (another ``/dev/shm``: an IPC-namespaced container)."""
    try:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_EXCL) if create else os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        if create:
            os.ftruncate(fd, size)
            # Reserve the pages now: a /dev/shm too small for them (a container's 64 MiB default) fails here, and
            # the group stays on TCP, instead of a SIGBUS at the first touch of a page the tmpfs cannot supply.
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size != size:
            return None
        # Mapped in now (MAP_POPULATE): transport memory is charged to the process when the group forms, not in
        # the middle of the first step.
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError:
        if create:
            os.unlink(path)
        return None
    finally:
        os.close(fd)
    words = memoryview(mm).cast("q")
    try:
        if create:
            words[header // 8 - 1] = _MAGIC
        elif words[header // 8 - 1] != _MAGIC:
            return None
    finally:
        words.release()
    return mm
