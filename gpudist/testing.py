"""Run one function on N ranks of any backend: the harness of gpudist's tests and benchmarks."""

from __future__ import annotations

import socket
import threading
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from .comm import InMemoryCommunicationBackend
from .launch import RanksFailedError, shared_pool

__all__ = ["RanksFailedError", "free_port", "run_ranks"]

TEST_TIMEOUT = 60.0
"""Default per-op timeout of run_ranks: long enough for a slow 2-core CI machine, short enough to fail fast."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "inmemory",
    *,
    timeout: float = TEST_TIMEOUT,
    device: str = "cpu",
    validate: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(comm, **kwargs)`` on every rank of a ``world_size`` group; return the results in rank order.

    ``backend="inmemory"`` runs the ranks as threads of this process (``device`` picks where tensors live);
    ``backend="gloo"`` runs them in spawned processes that are kept and reused by later calls with the same
    ``world_size``/``timeout``/``validate`` (``fn`` and ``kwargs`` must then pickle: define ``fn`` at module
    level); each call starts with zeroed ``comm.stats``. ``timeout`` bounds every communication op in seconds.
    An exception, death or hang on any rank raises :class:`RanksFailedError` carrying that rank's traceback
    (root causes listed first).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "inmemory":
        return _run_threads(fn, world_size, timeout, device, kwargs)
    if backend == "gloo":
        if device != "cpu":
            raise ValueError(f"the gloo backend works on CPU tensors; got device={device!r}")
        return shared_pool(world_size, timeout=timeout, validate=validate).run(fn, **kwargs)
    raise ValueError(f"run_ranks: unknown backend {backend!r}; use 'inmemory' or 'gloo'")


def _run_threads(fn: Callable[..., Any], world_size: int, timeout: float, device: str, kwargs: dict) -> list[Any]:
    group = f"run_ranks-{uuid.uuid4().hex[:12]}"
    comms = [None] * world_size
    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        try:
            comm = comms[rank] = InMemoryCommunicationBackend(rank, world_size, group, timeout, device)
            results[rank] = fn(comm, **kwargs)
        except BaseException as e:
            with lock:
                failures[rank] = traceback.format_exc()
            comm = comms[rank]
            if comm is not None:  # release the other ranks now instead of after the timeout
                comm.abort(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"{group}-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    limit = timeout + 60.0
    for r, t in enumerate(threads):
        t.join(limit)
        if t.is_alive():
            failures.setdefault(r, f"rank {r} did not return within {limit:g}s (hung outside communication?)")
    if failures:
        raise RanksFailedError(failures, results)
    return results




def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT in tests and examples)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
