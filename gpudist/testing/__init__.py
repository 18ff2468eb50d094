"""Run one function on N ranks of any backend: the harness of gpudist's tests and benchmarks."""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..comm import InMemoryCommunicationBackend
from ..launch import RanksFailedError, shared_pool

__all__ = ["RanksFailedError", "free_port", "mpi_launcher", "mpi_unavailable", "run_ranks"]

TEST_TIMEOUT = 60.0
"""Default per-op timeout of run_ranks: long enough for a slow 2-core CI machine, short enough to fail fast."""
START_TIMEOUT = 180.0
"""Seconds the harness waits for every rank to start (spawn, import torch and the test's module) before the op
timeout applies: start-up speed depends on the machine's load, which no test should."""


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

    ``backend="inmemory"`` runs the ranks as threads of this process (``device`` picks where tensors live), each
    running its own backward (``torch.autograd.set_multithreading_enabled(False)``: on a CUDA device the ranks would
    otherwise share autograd's device thread and deadlock in gradient hooks that communicate);
    ``backend="gloo"`` runs them in spawned processes that are kept and reused by later calls with the same
    ``world_size``/``timeout``/``validate`` (``fn`` and ``kwargs`` must then pickle: define ``fn`` at module
    level); each call starts with zeroed ``comm.stats``. ``backend="mpi"`` starts ``mpirun -np world_size`` for
    the call (same pickling rule; see :func:`mpi_launcher`). ``timeout`` bounds every communication op in seconds.
    An exception, death or hang on any rank raises :class:`RanksFailedError` carrying that rank's traceback
    (root causes listed first).

    Args:
        fn: Called as ``fn(comm, **kwargs)`` on every rank, ``comm`` being that rank's backend.
        world_size: The number of ranks (>= 1).
        backend: ``"inmemory"``, ``"gloo"`` or ``"mpi"``.
        timeout: Seconds every communication op may take.
        device: Where the tensors live: ``"cpu"``, or (in-memory backend only) a CUDA device.
        validate: Check every collective's call signature across ranks (Gloo and MPI; the in-memory backend
            always checks).
        **kwargs: Passed to ``fn``.

    Returns:
        Every rank's return value, in rank order.

    Raises:
        ValueError: When ``world_size < 1``, ``backend`` is unknown, or ``device`` is not ``"cpu"`` for Gloo or
            MPI.
        RanksFailedError: When a rank raised, died or hung.
        RuntimeError: (MPI) When there is no ``mpirun``/``mpiexec`` on the PATH or mpi4py is not installed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "inmemory":
        return _run_threads(fn, world_size, timeout, device, kwargs)
    if backend == "gloo":
        if device != "cpu":
            raise ValueError(f"the gloo backend works on CPU tensors; got device={device!r}")
        return shared_pool(world_size, timeout=timeout, validate=validate).run(fn, **kwargs)
    if backend == "mpi":
        if device != "cpu":
            raise ValueError(f"the mpi backend works on CPU tensors; got device={device!r}")
        return _run_mpi(fn, world_size, timeout, validate, kwargs)
    raise ValueError(f"run_ranks: unknown backend {backend!r}; use 'inmemory', 'gloo' or 'mpi'")


def _run_threads(fn: Callable[..., Any], world_size: int, timeout: float, device: str, kwargs: dict) -> list[Any]:
    group = f"run_ranks-{uuid.uuid4().hex[:12]}"
    comms = [None] * world_size
    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        try:
            # Each rank runs its own backward on its own thread. With autograd's default, CUDA backward work of every
            # thread runs on one shared device thread, where a rank blocked in a gradient hook's collective holds up
            # the hooks of the ranks it waits for: DDP deadlocked on an H200 in its first backward (2026-11-28).
            with torch.autograd.set_multithreading_enabled(False):
                comm = comms[rank] = InMemoryCommunicationBackend(rank, world_size, group, timeout, device)
                results[rank] = fn(comm, **kwargs)
        except BaseException as e:
            with lock:
                failures[rank] = traceback.format_exc()
            comm = comms[rank]
            if comm is not None:  # release the other ranks now instead of after the timeout
                comm.abort(f"{type(e).__name__}: {e}")

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"{group}-rank{r}", daemon=True) for r in range(world_size)
    ]
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


def mpi_launcher(world_size: int) -> list[str]:
    """The ``mpirun`` command line that starts ``world_size`` processes here, or raise RuntimeError saying why not.

    Open MPI gets ``--oversubscribe`` (more ranks than cores is fine for tests) and, when running as root (CI
    containers), ``--allow-run-as-root``; MPICH's ``mpiexec`` takes neither.
    """
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise RuntimeError("no mpirun/mpiexec on PATH; install Open MPI (apt-get install openmpi-bin libopenmpi-dev)")
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError("mpi4py is not installed; pip install 'gpudist[mpi]'")
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    cmd = [mpirun, "-np", str(world_size)]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd


@functools.cache
def mpi_unavailable() -> str | None:
    """Why ``run_ranks(..., "mpi")`` cannot run here (no mpirun, no mpi4py), or None when it can."""
    try:
        mpi_launcher(2)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None


def _run_mpi(fn: Callable[..., Any], world_size: int, timeout: float, validate: bool, kwargs: dict) -> list[Any]:
    module = sys.modules.get(fn.__module__)
    roots = [os.getcwd()]
    if module is not None and getattr(module, "__file__", None):  # so the ranks import fn's module as we did
        roots.append(str(Path(module.__file__).resolve().parents[fn.__module__.count(".")]))
    with tempfile.TemporaryDirectory(prefix="gpudist-mpi-") as tmp:
        job = Path(tmp) / "job.pkl"
        main = sys.modules.get("__main__")
        main_path = getattr(main, "__file__", None) if fn.__module__ == "__main__" else None
        job.write_bytes(pickle.dumps(main_path) + pickle.dumps((fn, kwargs, timeout, validate)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [env.get("PYTHONPATH")])])
        # Containers often forbid the cross-memory-attach syscalls Open MPI's shared memory uses for large messages.
        env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        cmd = [*mpi_launcher(world_size), sys.executable, "-m", "gpudist.testing.mpi_rank", str(job)]
        limit = timeout + START_TIMEOUT + 60.0
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as e:
            raise RanksFailedError(
                {r: f"mpirun did not finish within {limit:g}s" for r in range(world_size)}, [None] * world_size
            ) from e
        results: list[Any] = [None] * world_size
        failures: dict[int, str] = {}
        for rank in range(world_size):
            path = Path(tmp) / f"rank-{rank}.pkl"
            if not path.exists():
                failures[rank] = (
                    f"rank {rank} wrote no result (mpirun exit code {proc.returncode})\n"
                    f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
                )
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "ok":
                results[rank] = value
            else:
                failures[rank] = value
        if failures:
            raise RanksFailedError(failures, results)
        return results


def _mpi_rank_main(job: str) -> None:
    """Entry of each process ``run_ranks(..., "mpi")`` starts: run the pickled function, pickle its result."""
    import torch

    from ..comm.mpi import MPICommunicationBackend

    torch.set_num_threads(1)  # ranks share the machine's cores
    comm, rank, finish = None, -1, None
    try:
        # The harness's own communicator: the start barrier below and the leaving barrier, under the start-up deadline.
        finish = MPICommunicationBackend(
            MPICommunicationBackend()._comm.Dup(), timeout=START_TIMEOUT, group="run_ranks"
        )
        with open(job, "rb") as f:
            main_path = pickle.load(f)
            if main_path is not None:  # fn lives in the launching script: load it as multiprocessing's spawn does
                import runpy
                import types

                main = types.ModuleType("__mp_main__")
                main.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
                sys.modules["__main__"] = sys.modules["__mp_main__"] = main
            fn, kwargs, timeout, validate = pickle.load(f)
        # Start together (mpirun starts the ranks, and they import torch and fn's module, at their own pace), so
        # ``timeout`` bounds fn's ops, not a peer's start-up.
        finish.barrier()
        comm = MPICommunicationBackend(timeout=timeout, validate=validate)
        rank = comm.rank
        reply = ("ok", fn(comm, **kwargs))
    except BaseException:
        reply = ("error", traceback.format_exc())
    if rank < 0:
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    out = Path(job).parent / f"rank-{rank}.pkl"
    try:
        data = pickle.dumps(reply)
    except Exception:
        data = pickle.dumps(("error", "result could not be pickled:\n" + traceback.format_exc()))
    out.write_bytes(data)
    # Leave together, then skip MPI_Finalize: after a failed or timed-out op, requests stay pending on the world
    # communicator and Finalize could wait for them forever. The barrier runs on a communicator of its own.
    if finish is not None:
        try:
            finish.barrier()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT in tests and examples)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
