"""Communication backends: one contract (:class:`CommunicationBackend`), several transports."""

from .base import (
    DEFAULT_TIMEOUT,
    CollectiveMismatchError,
    CommStats,
    CommunicationBackend,
    CommunicationError,
    CommunicationTimeoutError,
    OpStats,
    ReductionOperation,
    Work,
    shard_range,
    split_sizes,
)
from .gloo import GlooCommunicationBackend
from .inmemory import InMemoryCommunicationBackend

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveMismatchError",
    "CommStats",
    "CommunicationBackend",
    "CommunicationError",
    "CommunicationTimeoutError",
    "GlooCommunicationBackend",
    "InMemoryCommunicationBackend",
    "OpStats",
    "ReductionOperation",
    "Work",
    "shard_range",
    "split_sizes",
]
