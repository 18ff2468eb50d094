"""Joining a group from the launcher's environment: :func:`init` reads torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), Open MPI's (``OMPI_COMM_WORLD_*``), MPICH/Intel
MPI's (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``) or Slurm's (``SLURM_PROCID``, ``SLURM_NTASKS``) and returns this
rank's backend."""

from __future__ import annotations

import atexit
import importlib.util
import os
from dataclasses import dataclass

import torch

from ..comm import (
    DEFAULT_TIMEOUT,
    CommunicationBackend,
    CommunicationError,
    GlooCommunicationBackend,
    InMemoryCommunicationBackend,
)

__all__ = ["BACKENDS", "LaunchEnvironment", "available_backends", "detect_environment", "init"]

BACKENDS = ("inmemory", "gloo", "nccl", "mpi")


@dataclass(frozen=True)
class LaunchEnvironment:
    """Where this process sits in the job, as its launcher described it.

    Attributes:
        rank: This process's rank in the job.
        world_size: The number of processes in the job.
        local_rank: Its rank on this machine (picks its GPU).
        master_addr: The rendezvous address (``MASTER_ADDR``, else 127.0.0.1).
        master_port: The rendezvous port (``MASTER_PORT``, else 29500).
        launcher: ``"torchrun"``, ``"openmpi"``, ``"mpich"``, ``"slurm"`` or ``"none"``.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "openmpi", "mpich", "slurm" or "none"


def _int_env(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        if name in env and env[name].strip():
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return None


def detect_environment(environ: dict[str, str] | None = None) -> LaunchEnvironment:
    """Rank, world size and rendezvous address from torchrun's, mpirun's or Slurm's variables (rank 0 of 1 if none).

    Args:
        environ: The variables to read; None: ``os.environ``.

    Returns:
        Where this process sits, and which launcher said so (``"none"`` without one).

    Raises:
        ValueError: When a variable that should hold an integer does not, or the rank is not in
            ``0..world_size-1``.
    """
    env = dict(os.environ if environ is None else environ)
    launchers = [
        ("torchrun", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",)),
        ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
        ("mpich", ("PMI_RANK", "PMIX_RANK"), ("PMI_SIZE",), ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID")),
        ("slurm", ("SLURM_PROCID",), ("SLURM_NTASKS",), ("SLURM_LOCALID",)),
    ]
    rank, world, local, launcher = 0, 1, 0, "none"
    for name, rank_vars, world_vars, local_vars in launchers:
        r, w = _int_env(env, *rank_vars), _int_env(env, *world_vars)
        if r is not None and w is not None:
            rank, world, launcher = r, w, name
            local = _int_env(env, *local_vars)
            local = rank if local is None else local
            break
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{launcher} environment gives rank {rank} of world size {world}; rank must be in 0..world-1")
    port = _int_env(env, "MASTER_PORT")
    return LaunchEnvironment(
        rank, world, local, env.get("MASTER_ADDR", "127.0.0.1"), 29500 if port is None else port, launcher
    )


def available_backends() -> dict[str, str]:
    """Each backend name mapped to "available" or the reason it is not.

    Returns:
        ``{"inmemory": ..., "gloo": ..., "nccl": ..., "mpi": ...}``.
    """
    gloo = "available" if torch.distributed.is_available() else "torch.distributed is not built in this torch"
    out = {"inmemory": "available", "gloo": gloo}
    if importlib.util.find_spec("gpudist.comm.nccl") is None:
        out["nccl"] = "not in this gpudist version yet"
    elif not torch.cuda.is_available():
        out["nccl"] = "no CUDA device"
    elif importlib.util.find_spec("cupy") is None:
        out["nccl"] = "cupy missing: pip install 'gpudist[cuda12]' or 'gpudist[cuda13]'"
    else:
        out["nccl"] = "available"
    if importlib.util.find_spec("gpudist.comm.mpi") is None:
        out["mpi"] = "not in this gpudist version yet"
    elif importlib.util.find_spec("mpi4py") is None:
        out["mpi"] = "mpi4py missing: pip install 'gpudist[mpi]'"
    else:
        out["mpi"] = "available"
    return out


def init(
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    *,
    validate: bool = True,
    connect_timeout: float | None = None,
) -> CommunicationBackend:
    """This process's backend for the job its launcher started (torchrun, mpirun, srun, or a plain ``python``).

    ``backend="auto"`` picks NCCL when CUDA is available and CuPy's NCCL is installed, else Gloo (under mpirun
    too: the rank and size come from Open MPI's or MPICH's variables). ``backend="mpi"`` uses MPI itself
    (``mpirun`` must have started the processes; no rendezvous port). The rendezvous
    store listens on ``MASTER_ADDR`` (127.0.0.1 unless set) port ``MASTER_PORT`` (29500 unless set).
    ``timeout`` bounds every op in seconds; ``connect_timeout`` bounds the join, how long the first rank waits for
    the last to start (default: the longer of ``timeout`` and 300 s); ``validate`` turns on the cross-rank
    consistency check.

    Args:
        backend: ``"auto"``, ``"nccl"``, ``"gloo"``, ``"mpi"`` or ``"inmemory"`` (a single process only).
        timeout: Seconds every op may take.
        validate: Check every collective's call signature across ranks.
        connect_timeout: Seconds to wait for every rank to join; None: the default above.

    Returns:
        This rank's backend of the world group (Gloo: a wrapper of ``torch.distributed``'s default group when one
        is already initialized).

    Raises:
        ValueError: When ``backend`` is unknown, the launcher's variables are not integers or give a rank outside
            the world, or ``"inmemory"`` is asked for in a job of several processes.
        CommunicationError: When the chosen backend is unavailable here (no CUDA device, CuPy or mpi4py missing,
            ...), or joining the group failed (e.g. the rendezvous port is taken).
        CommunicationTimeoutError: When the other ranks did not join within ``connect_timeout``.
    """
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown backend {backend!r}; use 'auto' or one of {', '.join(BACKENDS)}")
    env = detect_environment()
    available = available_backends()
    if backend == "auto":
        backend = "nccl" if available["nccl"] == "available" else "gloo"
    if available[backend] != "available":
        raise CommunicationError(
            f"backend '{backend}' is unavailable: {available[backend]}", op="init", group="world", rank=env.rank
        )
    if backend == "inmemory":
        if env.world_size != 1:
            raise ValueError(
                f"the in-memory backend runs ranks as threads of one process, but the launcher started "
                f"{env.world_size} processes; use backend='gloo', or gpudist.testing.run_ranks for threads"
            )
        return InMemoryCommunicationBackend(0, 1, group=f"init-{os.getpid()}", timeout=timeout)
    if backend == "mpi":
        from ..comm.mpi import MPICommunicationBackend

        return MPICommunicationBackend(timeout=timeout, validate=validate)
    if backend == "nccl":
        from ..comm.nccl import NCCLCommunicationBackend

        device = env.local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(device)
        return NCCLCommunicationBackend.create(
            env.rank,
            env.world_size,
            env.master_addr,
            env.master_port,
            device=device,
            timeout=timeout,
            validate=validate,
            connect_timeout=connect_timeout,
        )
    if torch.distributed.is_initialized():
        return GlooCommunicationBackend(timeout=timeout, validate=validate)
    backend = GlooCommunicationBackend.create(
        env.rank, env.world_size, env.master_addr, env.master_port, timeout, validate, connect_timeout=connect_timeout
    )
    # Tear the process group down while the interpreter is still whole: one left to static destruction aborted a
    # torchrun worker at exit once ("terminate called without an active exception"), under heavy load.
    atexit.register(backend.shutdown)
    return backend


# ---------------------------------------------------------------------------------------------------------------------
# Local multi-process execution
