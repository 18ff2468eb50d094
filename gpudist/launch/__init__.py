"""Starting gpudist: join a group from the launcher's environment (:func:`init`), or spawn local ranks
(:class:`WorkerPool`, :func:`spawn`)."""

from .environment import BACKENDS, LaunchEnvironment, available_backends, detect_environment, init, interface_for
from .spawn import RanksFailedError, WorkerPool, shared_pool, spawn

__all__ = [
    "BACKENDS",
    "LaunchEnvironment",
    "RanksFailedError",
    "WorkerPool",
    "available_backends",
    "detect_environment",
    "init",
    "interface_for",
    "shared_pool",
    "spawn",
]
