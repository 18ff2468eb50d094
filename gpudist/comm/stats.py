"""Byte and call counters: what every op of a backend moved (:attr:`CommunicationBackend.stats`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CommStats", "OpStats"]


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Per-op call and byte counters of one backend (one rank of one group).

    ``bytes`` is the op's payload as nccl-tests counts "size": the tensor for ``all_reduce``, ``broadcast``,
    ``send`` and ``recv``; the input of ``reduce_scatter`` and ``all_to_all``; the output of ``all_gather``.
    The consistency checks gpudist runs before ops are counted apart, in ``check_calls``/``check_bytes``.
    """

    ops: dict[str, OpStats] = field(default_factory=dict)
    check_calls: int = 0
    check_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _sequence: list | None = field(default=None, repr=False, compare=False)

    def record(self, op: str, nbytes: int) -> None:
        with self._lock:
            entry = self.ops.get(op)
            if entry is None:
                entry = self.ops[op] = OpStats()
            entry.calls += 1
            entry.bytes += nbytes
            if self._sequence is not None:
                self._sequence.append((op, nbytes))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[str, int]]]:
        """The ops counted while inside, in order, as ``(op, bytes)`` pairs (what a captured graph holds: the ranks
        compare it before the first replay).

        Yields:
            The list, filled as ops are counted.
        """
        sequence: list[tuple[str, int]] = []
        with self._lock:
            outer, self._sequence = self._sequence, sequence
        try:
            yield sequence
        finally:
            with self._lock:
                self._sequence = outer

    def record_check(self, nbytes: int) -> None:
        with self._lock:
            self.check_calls += 1
            self.check_bytes += nbytes

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.ops.values())

    @property
    def total_calls(self) -> int:
        return sum(s.calls for s in self.ops.values())

    def bytes_of(self, op: str) -> int:
        return self.ops[op].bytes if op in self.ops else 0

    def reset(self) -> None:
        with self._lock:
            self.ops.clear()
            self.check_calls = self.check_bytes = 0

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "ops": {k: {"calls": v.calls, "bytes": v.bytes} for k, v in sorted(self.ops.items())},
                "total_bytes": sum(s.bytes for s in self.ops.values()),
                "check_calls": self.check_calls,
                "check_bytes": self.check_bytes,
            }
