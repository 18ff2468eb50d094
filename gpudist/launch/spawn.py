"""Local ranks: :class:`WorkerPool` keeps ``world_size`` spawned processes joined in one group and runs functions on
all of them, returning each rank's result; :func:`spawn` is its one-shot form. ``gpudist.testing.run_ranks``, the
examples and the benchmarks are built on it."""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_any
from typing import Any

import torch

from ..comm import (
    DEFAULT_TIMEOUT,
    GlooCommunicationBackend,
)

__all__ = ["RanksFailedError", "WorkerPool", "shared_pool", "spawn"]


class RanksFailedError(RuntimeError):
    """One or more ranks raised, died or hung. ``failures`` maps rank -> traceback/reason; ``results`` holds
    the return values of the ranks that finished (None elsewhere).

    Args:
        failures: Rank -> its traceback or what happened to it.
        results: Every rank's return value, None where it failed.
    """

    def __init__(self, failures: dict[int, str], results: list[Any]):
        self.failures = dict(sorted(failures.items()))
        self.results = results
        # Root causes first: a rank that raised something other than a communication error, or died.
        order = sorted(
            self.failures,
            key=lambda r: (
                "CommunicationError" in self.failures[r] or "CommunicationTimeoutError" in self.failures[r],
                r,
            ),
        )
        body = "\n".join(f"--- rank {r} ---\n{self.failures[r].rstrip()}" for r in order)
        super().__init__(f"{len(self.failures)} of {len(results)} ranks failed (ranks {order}):\n{body}")


def _worker_main(
    rank: int, world_size: int, port: int, timeout: float, validate: bool, start_timeout: float, conn
) -> None:
    torch.set_num_threads(1)  # N ranks share the machine's cores; one intra-op thread each avoids oversubscription
    start = datetime.timedelta(seconds=start_timeout)
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, world_size, False, start)
        comm = GlooCommunicationBackend.create(
            rank, world_size, "127.0.0.1", port, timeout, validate, store=store, connect_timeout=start_timeout
        )
        conn.send_bytes(pickle.dumps(("ready", None, True)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), False)))
        os._exit(1)
    calls = 0
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not message:
            break
        calls += 1
        try:
            try:
                fn, args, kwargs = pickle.loads(message)  # may import fn's module: seconds on a loaded machine
            finally:  # (a rank that cannot unpickle still arrives, and reports its error below)
                store.set(_start_key(calls, rank), b"1")
            # Start together: every rank has its function in hand before any starts an op, so the op timeout
            # measures the function, not how long a peer took to import it (under the start-up deadline).
            store.wait([_start_key(calls, r) for r in range(world_size)], start)
            comm.stats.reset()  # each run starts from zero, as on a fresh backend
            reply = ("ok", fn(comm, *args, **kwargs), comm.healthy)
        except BaseException:
            reply = ("error", traceback.format_exc(), comm.healthy)
        try:
            data = pickle.dumps(reply)
        except Exception:
            data = pickle.dumps(("error", "result could not be pickled:\n" + traceback.format_exc(), comm.healthy))
        conn.send_bytes(data)
    # Skip interpreter teardown: Gloo's destructors abort the process when a peer already vanished.
    os._exit(0)


def _start_key(call: int, rank: int) -> str:
    return f"gpudist/pool/call{call}/rank{rank}"


def _listen_loopback() -> tuple[int, int]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    return listener.getsockname()[1], listener.detach()


class WorkerPool:
    """``world_size`` spawned processes joined in one Gloo group, kept alive to run many functions.

    ``run(fn, *args, **kwargs)`` calls ``fn(comm, *args, **kwargs)`` on every rank (``fn`` and its arguments must
    pickle: define it at module level) and returns the results in rank order. A rank that raises, dies or does
    not return within ``call_timeout`` makes ``run`` raise :class:`RanksFailedError` with every rank's story; the
    pool then closes itself (its group may be inconsistent), and ``broken`` tells callers to make a new one.

    Args:
        world_size: The number of processes (ranks) to spawn.
        timeout: Seconds every communication op of the ranks may take.
        validate: Check every collective's call signature across ranks.
        start_timeout: Seconds to wait for the processes to start and join, and for every rank to receive each
            call's function.

    Raises:
        ValueError: When ``world_size < 1``.
        RanksFailedError: When a rank failed to start or to join the group (the pool is closed).
    """

    def __init__(
        self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT, validate: bool = True, start_timeout: float = 180.0
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout, self.validate = world_size, timeout, validate
        self.start_timeout = start_timeout
        self.broken = False
        self._calls = 0
        port, fd = _listen_loopback()
        # The parent hosts the rendezvous store (bound to loopback) so no rank races for a port.
        self._store = torch.distributed.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            True,
            datetime.timedelta(seconds=start_timeout),
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=False,
        )
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (rank, world_size, port, timeout, validate, start_timeout, child)
            proc = ctx.Process(target=_worker_main, args=args, daemon=True, name=f"gpudist-rank{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        _, failures = self._collect(start_timeout, grace=start_timeout)
        if failures:
            self.close()
            raise RanksFailedError(failures, [None] * world_size)

    def run(self, fn: Callable[..., Any], *args: Any, call_timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(comm, *args, **kwargs)`` on every rank, ``comm`` being that rank's Gloo backend.

        Args:
            fn: A picklable function (defined at module level).
            *args: Positional arguments after ``comm``; they must pickle.
            call_timeout: Seconds to wait for every rank's result; None: the pool's ``timeout`` plus 60.
            **kwargs: Keyword arguments; they must pickle.

        Returns:
            Every rank's return value, in rank order.

        Raises:
            RuntimeError: When the pool was closed (after a failure, or by :meth:`close`).
            RanksFailedError: When a rank raised, died or did not return in time (the pool is closed).
        """
        if self.broken:
            raise RuntimeError("this WorkerPool was closed after a failure; create a new one")
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(payload)
        self._calls += 1
        self._await_start(self._calls)
        results, failures = self._collect(call_timeout or self.timeout + 60.0, grace=self.timeout + 10.0)
        if failures:
            self.close()
            raise RanksFailedError(failures, results)
        return results

    def _await_start(self, call: int) -> None:
        """Wait (up to ``start_timeout``) until every rank has unpickled call ``call``, so that the call's own deadline
        counts from when all ranks run it; return early when a rank replies or dies (``_collect`` reports it)."""
        keys = [_start_key(call, r) for r in range(self.world_size)]
        deadline = time.monotonic() + self.start_timeout
        waitables = self._conns + [p.sentinel for p in self._procs]
        while not self._store.check(keys) and time.monotonic() < deadline:
            if wait_any(waitables, timeout=0.005):
                return

    def _collect(self, limit: float, grace: float) -> tuple[list[Any], dict[int, str]]:
        """Gather one reply per rank. After the first failure the others get ``grace`` seconds to report theirs."""
        results: list[Any] = [None] * self.world_size
        failures: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + limit
        unhealthy = False
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for r in pending:
                    failures[r] = f"rank {r} did not return within {limit:g}s (hung or deadlocked)"
                break
            waitables = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            for ready in wait_any(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                if ready is conn or conn.poll():
                    try:
                        status, value, healthy = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        status, value, healthy = "error", None, False
                    unhealthy |= not healthy
                    if status == "ok" or status == "ready":
                        results[rank] = value
                    else:
                        failures[rank] = value or self._death(rank)
                else:
                    failures[rank] = self._death(rank)
                pending.discard(rank)
            if failures:
                deadline = min(deadline, time.monotonic() + grace)
        if unhealthy and not failures:
            self.close()  # results are fine, but the group is not reusable
        return results, failures

    def _death(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=5)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"rank {rank} (pid {proc.pid}) died ({how}) without returning a result"

    def close(self) -> None:
        """Stop the processes (those that do not exit are killed); the pool cannot run anything afterwards."""
        self.broken = True
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    validate: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` fresh Gloo processes; results in rank order.

    Args:
        fn: A picklable function (defined at module level), called with each rank's backend first.
        world_size: The number of processes.
        *args: Positional arguments after ``comm``; they must pickle.
        timeout: Seconds every communication op may take.
        validate: Check every collective's call signature across ranks.
        **kwargs: Keyword arguments; they must pickle.

    Returns:
        Every rank's return value, in rank order.

    Raises:
        ValueError: When ``world_size < 1``.
        RanksFailedError: When a rank failed to start, raised, died or did not return in time.
    """
    with WorkerPool(world_size, timeout=timeout, validate=validate) as pool:
        return pool.run(fn, *args, **kwargs)


_POOLS: dict[tuple, WorkerPool] = {}


def shared_pool(
    world_size: int, *, timeout: float = DEFAULT_TIMEOUT, validate: bool = True, max_pools: int = 6
) -> WorkerPool:
    """A process-wide pool for these settings, reused across calls (respawned after a failure).

    Args:
        world_size: The number of processes.
        timeout: Seconds every communication op may take.
        validate: Check every collective's call signature across ranks.
        max_pools: The most pools kept alive; the least recently used is closed to make room.

    Returns:
        The pool for ``(world_size, timeout, validate)``.

    Raises:
        ValueError: When ``world_size < 1``.
        RanksFailedError: When a new pool's ranks failed to start.
    """
    key = (world_size, float(timeout), validate)
    pool = _POOLS.get(key)
    if pool is not None and not pool.broken:
        _POOLS[key] = _POOLS.pop(key)  # most recently used last
        return pool
    _POOLS.pop(key, None)
    while len(_POOLS) >= max_pools:
        _POOLS.pop(next(iter(_POOLS))).close()
    pool = _POOLS[key] = WorkerPool(world_size, timeout=timeout, validate=validate)
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
