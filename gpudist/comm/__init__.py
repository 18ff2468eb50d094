"""Communication backends: one contract (:class:`CommunicationBackend`), several transports."""

from .base import (
    DEFAULT_TIMEOUT,
    AgreedOps,
    CollectiveMismatchError,
    CommStats,
    CommunicationBackend,
    CommunicationError,
    CommunicationTimeoutError,
    OpStats,
    PlannedCollective,
    ReductionOperation,
    Work,
    shard_range,
    split_sizes,
    stable_hash,
)
from .gloo import GlooCommunicationBackend
from .inmemory import InMemoryCommunicationBackend

__all__ = [
    "DEFAULT_TIMEOUT",
    "AgreedOps",
    "CollectiveMismatchError",
    "CommStats",
    "CommunicationBackend",
    "CommunicationError",
    "CommunicationTimeoutError",
    "GlooCommunicationBackend",
    "InMemoryCommunicationBackend",
    "MPICommunicationBackend",
    "NCCLCommunicationBackend",
    "OpStats",
    "PlannedCollective",
    "ReductionOperation",
    "Work",
    "shard_range",
    "split_sizes",
    "stable_hash",
]


_OPTIONAL = {"MPICommunicationBackend": ".mpi", "NCCLCommunicationBackend": ".nccl"}


def __getattr__(name: str):
    """The MPI and NCCL backends import on first use: mpi4py and CuPy are optional extras."""
    if name in _OPTIONAL:
        import importlib

        return getattr(importlib.import_module(_OPTIONAL[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
