"""The checkpoint format: its names and versions, the manifest (body, checksum, schema), how a rank's pieces are
packed into its file (strided runs) and read back (:class:`Reader`), and the vocabulary of canonical pieces
(:func:`canonical`, :func:`written`) that models and optimizers describe their state with. It knows no model,
optimizer or strategy; the folder layout is described in :mod:`gpudist.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from ..comm import shard_range

FORMAT = "gpudist.checkpoint.v2"
READABLE = ("gpudist.checkpoint.v1", FORMAT)
"""v2 added strided piece entries (``[kind, name, start, n, count, stride]``); v1 folders load unchanged."""
MANIFEST = "manifest.json"

Segments = list[tuple[int, int, str, int]]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, damaged, incomplete, or for another model/optimizer."""


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` restored besides tensors.

    Attributes:
        path: The checkpoint folder.
        step: The ``step`` it was saved with.
        world_size: The world size that wrote it.
        strategy: The strategy of the model that wrote it (``"module"`` for a plain ``nn.Module``).
        extra: The ``extra`` JSON it was saved with.
    """

    path: Path
    step: int
    world_size: int
    strategy: str
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------------
# Canonical pieces: what a rank holds, and which of it it writes


Share = Callable[[str, bool], "tuple[int, int] | None"]
"""``share(name, across_replicas)``: :meth:`ShardedModel.checkpoint_share` (``(copies, index)``, or None)."""


def canonical(segments: Segments, lo: int, hi: int):
    """The parts of ``[lo, hi)`` of a held tensor, as ``(position in the tensor, length, name, position in name)``."""
    for off, n, name, at in segments:
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            yield a, b - a, name, at + a - off


def written(pieces, share: Share, across_replicas: bool) -> list[tuple[int, int, str, int]]:
    """The parts of held ``pieces`` (``(position, length, name, position in name)``) that this rank writes.

    The ranks holding copies of a parameter's elements hold the same pieces of it (the same replica's shard, the
    same ZeRO-owned range, a whole replicated parameter); ``share(name, across_replicas)`` says how many they are
    and which this rank is (:meth:`ShardedModel.checkpoint_share`). The ``index``-th copy writes the ``index``-th
    :func:`shard_range` of those elements taken in canonical order, so each is written once and the copies write
    equal amounts (a rowwise shard's rows split between replicas); None: another rank writes them."""
    by_name: dict[str, list[tuple[int, int, str, int]]] = {}
    for piece in pieces:
        by_name.setdefault(piece[2], []).append(piece)
    out = []
    for name, held in by_name.items():
        part = share(name, across_replicas)
        if part is None:
            continue
        held.sort(key=lambda piece: piece[3])
        lo, hi = shard_range(sum(n for _, n, _, _ in held), *part)
        at = 0
        for pos, n, _, c in held:
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                out.append((pos + a - at, b - a, name, c + a - at))
            at += n
    return out


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


# ---------------------------------------------------------------------------------------------------------------------
# A rank's file and the manifest


def _pack_runs(pieces: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[list]]:
    """The tensors of a rank's file and their manifest entries. Pieces of one tensor of equal length at a fixed
    stride (the rows of a rowwise split: ``in / tp`` elements every ``in``) are stored as one tensor, listed once as
    ``[kind, name, start, n, count, stride]`` (elements ``start + k * stride + [0, n)`` for ``k < count``); any
    other piece as ``[kind, name, start, n]``. The file's tensor is named ``kind|name|start`` either way."""
    by_tensor: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
    for key, values in pieces.items():
        kind, name, start = key.rsplit("|", 2)
        by_tensor.setdefault((kind, name), []).append((int(start), values))
    stored: dict[str, torch.Tensor] = {}
    listed: list[list] = []
    for (kind, name), runs in by_tensor.items():
        runs.sort(key=lambda run: run[0])
        groups: list[list] = []  # [start, n, count, stride, [values]]
        for start, values in runs:
            g = groups[-1] if groups else None
            if g is not None and values.numel() == g[1] and (g[2] == 1 or start == g[0] + g[2] * g[3]):
                g[3] = start - g[0] if g[2] == 1 else g[3]
                g[2] += 1
                g[4].append(values)
            else:
                groups.append([start, values.numel(), 1, 0, [values]])
        for start, n, count, stride, values in groups:
            stored[f"{kind}|{name}|{start}"] = values[0] if count == 1 else torch.cat(values)
            listed.append([kind, name, start, n] if count == 1 else [kind, name, start, n, count, stride])
    return stored, listed


def _merged_body(body: dict[str, Any], infos: list[dict[str, Any]]) -> dict[str, Any]:
    """``body`` with every rank's file entry and the optimizer scalars of all ranks merged in."""
    merged: dict[str, dict[str, float]] = {}
    for i in infos:
        for name, values in i["scalars"].items():
            merged.setdefault(name, {}).update(values)
    body = dict(body)
    if body["optimizer"] is not None:
        body["optimizer"] = {**body["optimizer"], "scalars": merged}
    body["files"] = [{k: i[k] for k in ("file", "sha256", "bytes", "pieces") if k in i} for i in infos]
    return body


def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The verified manifest of the checkpoint folder at ``path``.

    Args:
        path: A checkpoint folder.

    Returns:
        The manifest's body: format, strategy, world size, step, extra, parameter and buffer tables, optimizer
        description and the files with their checksums and pieces.

    Raises:
        CheckpointError: When ``path`` is not a checkpoint folder: no manifest (e.g. an interrupted save), a
            damaged one (unreadable or its checksum does not match), or a format this gpudist cannot read.
    """
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"no checkpoint at {path}: {MANIFEST} is missing (an interrupted save leaves only a "
            "hidden .tmp folder, which is never read)"
        )
    try:
        doc = json.loads(file.read_text())
        body = doc["body"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file} is damaged (not a gpudist manifest): {e}") from None
    if doc.get("sha256") != _body_digest(body):
        raise CheckpointError(f"{file} is damaged: its checksum does not match its content")
    if not isinstance(body, dict) or body.get("format") not in READABLE:
        got = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise CheckpointError(f"{path} has format {got!r}; this gpudist reads {READABLE}")
    _check_schema(body, file)
    return body


_RANK_FILE = re.compile(r"rank-\d{5}\.safetensors")


def _check_schema(body: dict, file: Path) -> None:
    """Refuse a manifest whose fields have the wrong types or whose files are not plain names inside the folder
    (``../x``, absolute paths): the checksum is not keyed, so it shows damage, not tampering, and a manifest that
    passes it is still checked before anything is read through it."""

    def bad(what: str, value: Any, want: str) -> CheckpointError:
        return CheckpointError(f"{file} is malformed: {what} is {value!r}, expected {want}")

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for key, least in (("step", 0), ("world_size", 1)):
        if not integer(body.get(key)) or body[key] < least:
            raise bad(key, body.get(key), f"an integer >= {least}")
    for key in ("parameters", "buffers", "files"):
        if not isinstance(body.get(key), list):
            raise bad(key, body.get(key), "a list")
    for row in (*body["parameters"], *body["buffers"]):
        if not isinstance(row, dict) or not isinstance(row.get("name"), str) or not isinstance(row.get("shape"), list):
            raise bad("a parameter or buffer entry", row, "{name: str, shape: list, ...}")
    for entry in body["files"]:
        if not isinstance(entry, dict):
            raise bad("a file entry", entry, "an object")
        name = entry.get("file")
        if not isinstance(name, str) or not _RANK_FILE.fullmatch(name):
            raise bad("a file name", name, "rank-NNNNN.safetensors, inside the checkpoint folder")
        if not isinstance(entry.get("sha256"), str) or not integer(entry.get("bytes")) or entry["bytes"] < 0:
            raise bad(f"{name}'s sha256/bytes", (entry.get("sha256"), entry.get("bytes")), "a hex digest and a size")
        pieces = entry.get("pieces")
        if not isinstance(pieces, list) or not all(
            isinstance(p, list)
            and len(p) in (4, 6)
            and isinstance(p[0], str)
            and isinstance(p[1], str)
            and all(integer(v) and v >= 0 for v in p[2:])
            for p in pieces
        ):
            raise bad(f"{name}'s pieces", pieces, "[kind, name, start, n] or [kind, name, start, n, count, stride]")


class Reader:
    """Reads canonical ranges from a checkpoint's files, verifying each file's checksum once."""

    def __init__(self, path: Path, body: dict):
        self.path, self.body = path, body
        # (kind, name) -> (start, n, count, stride, file): ``count`` runs of n elements, ``stride`` apart
        self.index: dict[tuple[str, str], list[tuple[int, int, int, int, int]]] = {}
        for f, entry in enumerate(body["files"]):
            for kind, name, start, n, *strided in entry["pieces"]:
                count, stride = strided if strided else (1, n)
                self.index.setdefault((kind, name), []).append((start, n, count, max(stride, 1), f))
        self.files: dict[int, dict[str, torch.Tensor]] = {}

    def _file(self, f: int) -> dict[str, torch.Tensor]:
        if f not in self.files:
            entry = self.body["files"][f]
            file = self.path / entry["file"]
            if file.is_symlink() or not file.is_file():
                what = "a symbolic link (rank files are read only from inside the folder)" if file.is_symlink() else ""
                raise CheckpointError(f"{self.path}: {entry['file']} is {what or 'missing'}")
            size = file.stat().st_size
            if size != entry["bytes"]:  # before reading: an appended or sparse file must not be read whole
                raise CheckpointError(
                    f"{file} is truncated or damaged: {size} bytes, the manifest says {entry['bytes']}"
                )
            data = file.read_bytes()
            if len(data) != entry["bytes"]:
                raise CheckpointError(
                    f"{file} is truncated or damaged: {len(data)} bytes, the manifest says {entry['bytes']}"
                )
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CheckpointError(f"{file} is damaged: its SHA-256 does not match the manifest (bit flip?)")
            try:
                tensors = st_load(data)
            except Exception as e:  # safetensors raises several types for garbled input
                raise CheckpointError(f"{file} is damaged: {e}") from None
            for kind, name, start, n, *strided in entry["pieces"]:
                got = tensors.get(f"{kind}|{name}|{start}")
                if got is None or got.numel() != n * (strided[0] if strided else 1):
                    raise CheckpointError(
                        f"{file} does not hold the {kind} piece of {name!r} at {start} that the "
                        "manifest lists (the file and manifest come from different saves?)"
                    )
            self.files[f] = tensors
        return self.files[f]

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.index

    def read(self, kind: str, name: str, start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(n, dtype=dtype, device="cpu")
        covered = 0
        for s0, m, count, stride, f in self.index.get((kind, name), []):
            # the runs k that overlap [start, start + n): s0 + k * stride < start + n and s0 + k * stride + m > start
            first, last = max(0, (start - s0 - m) // stride + 1), min(count - 1, (start + n - s0 - 1) // stride)
            for k in range(first, last + 1):
                s = s0 + k * stride
                a, b = max(start, s), min(start + n, s + m)
                piece = self._file(f)[f"{kind}|{name}|{s0}"]
                out[a - start : b - start].copy_(piece[k * m + a - s : k * m + b - s])
                covered += b - a
        if covered != n:
            raise CheckpointError(
                f"{self.path} lacks {kind} elements of {name!r} in [{start}, {start + n}): "
                f"{covered} of {n} present (incomplete checkpoint)"
            )
        return out
