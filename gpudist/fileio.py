"""Atomic file writes: readers see the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_json"]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_json(path: str | os.PathLike, doc: object) -> Path:
    """:func:`atomic_write_bytes` of ``doc`` as indented JSON."""
    return atomic_write_bytes(path, (json.dumps(doc, indent=2, default=str) + "\n").encode())
