"""Communication backends: one contract (:class:`CommunicationBackend`), several transports."""

from .agreed import AgreedOps
from .base import DEFAULT_TIMEOUT, CommunicationBackend
from .errors import CollectiveMismatchError, CommunicationError, CommunicationTimeoutError
from .gloo import GlooCommunicationBackend
from .inmemory import InMemoryCommunicationBackend
from .reduction import ReductionOperation
from .shards import shard_range, split_sizes
from .signature import stable_hash
from .stats import CommStats, OpStats
from .work import CoalescedCollectives, PlannedCollective, Work

__all__ = [
    "DEFAULT_TIMEOUT",
    "AgreedOps",
    "CoalescedCollectives",
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
