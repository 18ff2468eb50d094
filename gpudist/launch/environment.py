"""Joining a group from the launcher's environment: :func:`init` reads torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), Open MPI's (``OMPI_COMM_WORLD_*``), MPICH/Intel
MPI's (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``) or Slurm's (``SLURM_PROCID``, ``SLURM_NTASKS``) and returns this
rank's backend."""

from __future__ import annotations

import atexit
import fcntl
import importlib.util
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

import torch

from ..comm import (
    DEFAULT_TIMEOUT,
    CommunicationBackend,
    CommunicationError,
    GlooCommunicationBackend,
    InMemoryCommunicationBackend,
)
from ..topology import Topology, detect_layout

__all__ = ["BACKENDS", "LaunchEnvironment", "available_backends", "detect_environment", "init", "interface_for"]

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


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_for(address: str) -> str | None:
    """The name of this host's network interface that traffic to ``address`` leaves from (Linux, IPv4).

    Asks the kernel's routing table which local address reaches ``address`` (a UDP socket's ``connect`` sends
    nothing), then which interface holds that address.

    Args:
        address: A host name or IPv4 address (e.g. ``MASTER_ADDR``).

    Returns:
        The interface name (``"eth0"``, ``"lo"``, ...), or None when it cannot be told (no route, IPv6, not
        Linux).
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
        if ipaddress.ip_address(local).is_loopback:
            return "lo"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue  # no IPv4 address on this interface
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except (OSError, ValueError, AttributeError):
        return None
    return None


def _choose_interface(env: LaunchEnvironment, interface: str | None) -> None:
    """Point Gloo's sockets at ``interface`` (or ``GPUDIST_SOCKET_IFNAME``, or the interface that reaches
    ``MASTER_ADDR`` unless ``GLOO_SOCKET_IFNAME`` is set); NCCL's (``NCCL_SOCKET_IFNAME``) only at a named one.

    Without it Gloo binds the address the host name resolves to, which on a multi-homed host (or in a network
    namespace) may be an interface the other hosts cannot reach."""
    chosen = interface or os.environ.get("GPUDIST_SOCKET_IFNAME") or None
    if chosen is None and env.world_size > 1:
        chosen = interface_for(env.master_addr)
    if chosen is None:
        return
    if interface is not None and chosen not in {name for _, name in socket.if_nameindex()}:
        raise ValueError(
            f"interface={interface!r} is not a network interface of this host "
            f"({', '.join(sorted(n for _, n in socket.if_nameindex()))})"
        )
    explicit = interface is not None or "GPUDIST_SOCKET_IFNAME" in os.environ
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = chosen
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", chosen)
    if explicit:  # NCCL picks its network (InfiniBand, sockets) well by itself; only a named interface overrides it
        os.environ["NCCL_SOCKET_IFNAME"] = chosen


def init(
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    *,
    validate: bool = True,
    connect_timeout: float | None = None,
    interface: str | None = None,
    ranks_per_node: int | None = None,
) -> CommunicationBackend:
    """This process's backend for the job its launcher started (torchrun, mpirun, srun, or a plain ``python``).

    ``backend="auto"`` picks NCCL when CUDA is available and CuPy's NCCL is installed, else Gloo (under mpirun
    too: the rank and size come from Open MPI's or MPICH's variables). ``backend="mpi"`` uses MPI itself
    (``mpirun`` must have started the processes; no rendezvous port). The rendezvous
    store listens on ``MASTER_ADDR`` (127.0.0.1 unless set) port ``MASTER_PORT`` (29500 unless set), bound to that
    address only (under torchrun the agent's store is used). ``timeout`` bounds every op in seconds;
    ``connect_timeout`` bounds the join, how long the first rank waits for the last to start (default: the longer
    of ``timeout`` and 300 s); ``validate`` turns on the cross-rank consistency check.

    Across hosts, the ranks' own connections (Gloo's, NCCL's bootstrap) go over ``interface``; by default the one
    that reaches ``MASTER_ADDR`` (loopback on one host), unless ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` or
    ``GPUDIST_SOCKET_IFNAME`` say otherwise. The returned backend's ``topology`` (:class:`gpudist.Topology`) holds
    the node layout the launcher described (``ranks_per_node`` overrides it) and, on first use, the intra-node and
    inter-node groups (see docs/multihost.md).

    Args:
        backend: ``"auto"``, ``"nccl"``, ``"gloo"``, ``"mpi"`` or ``"inmemory"`` (a single process only).
        timeout: Seconds every op may take.
        validate: Check every collective's call signature across ranks.
        connect_timeout: Seconds to wait for every rank to join; None: the default above.
        interface: The network interface (``"eth0"``) the ranks connect to each other over; None: as above.
        ranks_per_node: Ranks on every node, overriding the launcher's variables; None: detect them.

    Returns:
        This rank's backend of the world group (Gloo: a wrapper of ``torch.distributed``'s default group when one
        is already initialized).

    Raises:
        ValueError: When ``backend`` is unknown, the launcher's variables are not integers or give a rank outside
            the world or an uneven node layout (:func:`gpudist.topology.detect_layout`), ``"inmemory"`` is asked
            for in a job of several processes, or ``interface`` is not an interface of this host.
        CommunicationError: When the chosen backend is unavailable here (no CUDA device, CuPy or mpi4py missing,
            ...), or joining the group failed (e.g. the rendezvous port is taken).
        CommunicationTimeoutError: When the other ranks did not join within ``connect_timeout``.
    """
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown backend {backend!r}; use 'auto' or one of {', '.join(BACKENDS)}")
    env = detect_environment()
    layout = detect_layout(env.rank, env.world_size, ranks_per_node=ranks_per_node)
    comm = _init_backend(backend, timeout, validate, connect_timeout, env, interface)
    comm.topology = Topology(comm, layout)
    return comm


def _init_backend(
    backend: str,
    timeout: float,
    validate: bool,
    connect_timeout: float | None,
    env: LaunchEnvironment,
    interface: str | None,
) -> CommunicationBackend:
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
    _choose_interface(env, interface)
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
