"""Sharded checkpoints that load at any world size into any strategy.

A checkpoint is a folder::

    manifest.json            format, strategy, world size, step, parameters (names, shapes, dtypes), buffers,
                             optimizer (class, param groups, per-parameter scalars such as Adam's step), and per
                             file its SHA-256, size and the pieces it holds; the manifest carries its own checksum
    rank-00000.safetensors   this rank's pieces: 1-D slices of flattened full tensors, no pickle
    ...

A piece is listed as ``[kind, name, start, n]``, or ``[kind, name, start, n, count, stride]`` for ``count`` runs of
``n`` elements ``stride`` apart stored as one tensor: the rows of a tensor-parallel rowwise shard (an ``[out, in]``
weight split by columns is ``out`` runs of ``in / tp``) take one entry, not one per row.

Everything is described in *canonical* coordinates: a piece is elements ``[start, start + n)`` of one full
parameter (or of its optimizer state such as ``exp_avg``), flattened. A strategy only has to say which pieces it
holds (:meth:`ShardedModel.checkpoint_segments`, and the owned ranges of a ZeRO optimizer), so a checkpoint
written by ZeRO-3 on 4 ranks loads into ZeRO-2 on 2 or DDP on 3: each rank reads the pieces it now needs from
whichever files hold them. Every element is written once: when several ranks hold copies of it (data-parallel
replicas, tensor ranks holding a replicated LayerNorm, pipeline stages sharing a tied embedding), the model's
:meth:`ShardedModel.checkpoint_share` says how many copies there are and which one this rank is, and the copies
split the writing (replicated strategies: rank r saves its ``shard_range`` of every tensor) or leave it to one
(the stage owning a tied parameter).

Saving is atomic: files go to a temporary folder beside the target, the manifest is written last, and the folder
is renamed into place. Loading reads and verifies every byte it needs (file checksums, shapes, names, coverage)
into fresh tensors, agrees with the other ranks that all of them succeeded, and only then copies into the model
and optimizer: a truncated, bit-flipped or mismatched checkpoint raises and changes nothing in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from .comm import CommunicationBackend, ReductionOperation, shard_range
from .fileio import atomic_write_bytes, atomic_write_json
from .flat import exchange_bytes
from .strategies.compression import GradientCompressionOptimizer, check_compress_mode
from .strategies.hybrid import HybridShardedOptimizer
from .strategies.model import ShardedModel, module_segments, module_table
from .strategies.optimizer import ShardedOptimizer, load_keeping_identity
from .strategies.zero import _FlatShardOptimizer

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWrite",
    "latest_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "remove_stale_staging",
    "save_checkpoint",
]

FORMAT = "gpudist.checkpoint.v2"
READABLE = ("gpudist.checkpoint.v1", FORMAT)
"""v2 added strided piece entries (``[kind, name, start, n, count, stride]``); v1 folders load unchanged."""
MANIFEST = "manifest.json"

Segments = list[tuple[int, int, str, int]]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, damaged, incomplete, or for another model/optimizer."""


@dataclass
class CheckpointInfo:
    """What :func:`load_checkpoint` restored besides tensors."""

    path: Path
    step: int
    world_size: int
    strategy: str
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------------
# What a rank holds


Share = Callable[[str, bool], "tuple[int, int] | None"]
"""``share(name, across_replicas)``: :meth:`ShardedModel.checkpoint_share` (``(copies, index)``, or None)."""


@dataclass
class _Parts:
    """What a rank holds of a model, and which of it it writes."""

    held: list[tuple[torch.Tensor, Segments]]
    share: Share
    buffers: list[tuple[str, torch.Tensor, bool]]  # (full name, tensor, whether this rank writes it)
    buffer_table: list[dict[str, Any]]
    strategy: str


def _model_parts(model: nn.Module, comm: CommunicationBackend | None) -> _Parts:
    if isinstance(model, ShardedModel):
        return _Parts(
            model.checkpoint_segments(),
            model.checkpoint_share,
            model.checkpoint_buffers(),
            model.buffer_table(),
            model.strategy,
        )
    if isinstance(model, nn.Module):
        # A plain module is whole on every rank of the optimizer's group (if any): rank r writes its shard_range of
        # every parameter, rank 0 the buffers, as for a replicated ShardedModel.
        rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
        buffers = list(model.named_buffers())
        table = [{"name": n, "shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")} for n, b in buffers]
        return _Parts(
            module_segments(model),
            lambda name, across=True: (world, rank) if across else (1, 0),
            [(n, b, rank == 0) for n, b in buffers],
            table,
            "module",
        )
    raise TypeError(f"checkpoints hold an nn.Module or a gpudist ShardedModel, got {type(model).__name__}")


def _param_table(model: nn.Module) -> list[dict[str, Any]]:
    return model.parameter_table() if isinstance(model, ShardedModel) else module_table(model)


def _canonical(segments: Segments, lo: int, hi: int):
    """The parts of ``[lo, hi)`` of a held tensor, as ``(position in the tensor, length, name, position in name)``."""
    for off, n, name, at in segments:
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            yield a, b - a, name, at + a - off


def _written(pieces, share: Share, across_replicas: bool) -> list[tuple[int, int, str, int]]:
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


def _flat_owned(opt: _FlatShardOptimizer, segmap: dict[int, Segments]):
    """A ZeRO optimizer's owned buffer in canonical coordinates: (owned position, length, name, position)."""
    # (the owned ranges are disjoint over the optimizer's ranks, the data-parallel replicas: copies elsewhere, as
    # tensor ranks' replicated LayerNorms, are narrowed by the model's checkpoint_share(name, False))
    layout = opt._flat.layout
    for start, length, at in opt._segment_spans():
        for i, p in enumerate(opt._flat_params):
            lo, hi = max(start, layout.offsets[i]), min(start + length, layout.offsets[i] + layout.numels[i])
            if lo < hi:
                base = layout.offsets[i]
                for pos, n, name, c in _canonical(segmap[id(p)], lo - base, hi - base):
                    yield at + (pos + base - start), n, name, c


def _torch_optimizer(opt) -> torch.optim.Optimizer:
    return opt.optimizer if isinstance(opt, ShardedOptimizer) else opt


def _state_holder(opt):
    """The optimizer object holding the state: a HybridShardedOptimizer's data-parallel optimizer (ZeRO or DDP)."""
    return opt.inner if isinstance(opt, HybridShardedOptimizer) else opt


def _hyper(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in groups]


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def _scalar(value) -> float | int | None:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _residual_spans(opt: GradientCompressionOptimizer, segmap: dict[int, Segments]):
    """Each compressed buffer's channel, with its elements in canonical coordinates: (buffer position, length,
    name, position in name)."""
    for key, channel in opt.hook.channels.items():
        spans = []
        for pos, length, param, at in opt.hook.buffers[key].spans:
            for ppos, n, name, c in _canonical(segmap.get(id(param), []), at, at + length):
                spans.append((pos + ppos - at, n, name, c))
        yield channel, spans


def _residual_pieces(
    opt: GradientCompressionOptimizer, segmap: dict[int, Segments], rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """Error-feedback residuals as checkpoint pieces. A worker residual is per rank (``residual.worker.<rank>``, the
    whole buffer); server residuals are one canonical tensor split over the ranks (``residual.server``)."""
    pieces: dict[str, torch.Tensor] = {}
    for channel, spans in _residual_spans(opt, segmap):
        worker, server = channel.worker_residual(), channel.server_residual()
        for pos, n, name, c in spans:
            if worker is not None:
                pieces[f"residual.worker.{rank}|{name}|{c}"] = worker[pos : pos + n].detach().cpu().clone()
            if server is not None:
                start, values = server
                a, b = max(pos, start), min(pos + n, start + values.numel())
                if a < b:
                    piece = values[a - start : b - start]
                    pieces[f"residual.server|{name}|{c + a - pos}"] = piece.detach().cpu().clone()
    meta = {
        "compressor": repr(opt.compressor),
        "steps": opt.hook.steps,
        "world_size": world,
        "error_feedback": opt.hook.error_feedback,
        "compress": opt.compress,
    }
    return pieces, meta


def _optimizer_pieces(
    opt, segmap: dict[int, Segments], share: Share, rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]], dict]:
    """This rank's optimizer state pieces ({key: tensor}), per-parameter scalars, and a description. State held by
    several ranks (replicated, or a tied parameter's on two stages) is written once, as the parameters are."""
    opt = _state_holder(opt)
    if isinstance(opt, GradientCompressionOptimizer):
        target = opt.inner if opt.inner is not None else opt.optimizer
        pieces, scalars, desc = _optimizer_pieces(target, segmap, share, rank, world)
        residuals, meta = _residual_pieces(opt, segmap, rank, world)
        return {**pieces, **residuals}, scalars, {**desc, "compression": meta}
    pieces: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}

    def put(key: str, name: str, at: int, values: torch.Tensor) -> None:
        pieces[f"state.{key}|{name}|{at}"] = values.detach().reshape(-1).contiguous().cpu().clone()

    if isinstance(opt, _FlatShardOptimizer):
        owned = _written(_flat_owned(opt, segmap), share, False)  # the owned pieces this rank writes
        tensors = dict(opt._state)
        if not opt._master_is_view:
            tensors["master"] = opt._master
        for pos, n, name, c in owned:
            for key, t in tensors.items():
                put(key, name, c, t[pos : pos + n])
        if opt._inner is not None:  # generic path: per-view state of the wrapped optimizer's class
            for view, piece in zip(opt._views, opt._pieces, strict=True):
                state = opt._inner.state.get(view, {})
                for pos, n, name, c in owned:
                    a, b = max(pos, piece.owned_offset), min(pos + n, piece.owned_offset + piece.length)
                    if a >= b:
                        continue
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and value.shape == view.shape and key != "step":
                            lo, hi = a - piece.owned_offset, b - piece.owned_offset
                            put(key, name, c + a - pos, value.reshape(-1)[lo:hi])
                        elif (s := _scalar(value)) is not None:
                            scalars.setdefault(name, {})[key] = s
        else:
            for g, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    for _, _, name, _ in segmap.get(id(p), []):
                        scalars.setdefault(name, {})["step"] = opt._steps[g]
        kind = type(opt.optimizer).__name__
        return pieces, scalars, {"class": kind, "groups": _hyper(opt.param_groups)}
    torch_opt = _torch_optimizer(opt)
    for group in torch_opt.param_groups:
        for p in group["params"]:
            state = torch_opt.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and key != "step":
                    flat = value.reshape(-1)
                    for pos, n, name, c in _written(_canonical(segmap.get(id(p), []), 0, p.numel()), share, True):
                        put(key, name, c, flat[pos : pos + n])
                elif (s := _scalar(value)) is not None:
                    for _, _, name, _ in segmap.get(id(p), []):
                        scalars.setdefault(name, {})[key] = s
    return pieces, scalars, {"class": type(torch_opt).__name__, "groups": _hyper(torch_opt.param_groups)}


# ---------------------------------------------------------------------------------------------------------------------
# Saving


def _comm_of(model, optimizer) -> CommunicationBackend | None:
    if isinstance(model, ShardedModel):
        return model.comm
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.comm
    return None


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (and ``optimizer``'s state) as a checkpoint folder at ``path`` (collective: every rank calls
    it; ``path`` must be on a file system every rank sees). Replaces an existing checkpoint at ``path`` only once
    the new one is complete. ``extra`` (JSON) travels in the manifest, e.g. the data position."""
    return CheckpointWrite(path, model, optimizer, step=step, extra=extra, background=False).wait()


class CheckpointWrite:
    """One checkpoint being written; :func:`save_checkpoint` is ``CheckpointWrite(...).wait()``.

    Constructing it (collective) copies this rank's pieces to host memory and agrees on a staging folder; the files
    are then serialized, hashed and written, in a background thread when ``background=True``, while training goes
    on. :meth:`wait` (collective) joins the writer, and rank 0 writes the manifest and renames the folder into place
    only if every rank's file was written: a crash at any point leaves the previous checkpoints as they were and at
    most a hidden ``.NAME.tmp-*`` folder that is never read (:func:`remove_stale_staging` clears them).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int = 0,
        extra: dict[str, Any] | None = None,
        background: bool = True,
    ):
        self.path = Path(path)
        self.comm = _comm_of(model, optimizer)
        rank, world = (self.comm.rank, self.comm.world_size) if self.comm is not None else (0, 1)
        self.rank, self.world = rank, world
        if extra is not None and not _jsonable(extra):
            raise TypeError(f"extra must be JSON-serializable, got {extra!r}")
        parts = _model_parts(model, self.comm)
        table = _param_table(model)
        pieces: dict[str, torch.Tensor] = {}
        for tensor, segments in parts.held:
            flat = tensor.detach().reshape(-1)
            for pos, n, name, c in _written(_canonical(segments, 0, flat.numel()), parts.share, True):
                pieces[f"param|{name}|{c}"] = flat[pos : pos + n].contiguous().cpu().clone()
        for name, b, writes in parts.buffers:
            if writes:
                pieces[f"buffer|{name}|0"] = b.detach().reshape(-1).contiguous().cpu().clone()
        scalars, opt_desc = {}, None
        if optimizer is not None:
            segmap = {id(t): segs for t, segs in parts.held}
            opt_pieces, scalars, opt_desc = _optimizer_pieces(optimizer, segmap, parts.share, rank, world)
            pieces.update({k: v.cpu().clone() for k, v in opt_pieces.items()})
        self.body = {
            "format": FORMAT,
            "strategy": parts.strategy,
            "world_size": world,
            "step": int(step),
            "extra": extra or {},
            "parameters": table,
            "buffers": parts.buffer_table,
            "optimizer": opt_desc,
        }
        self.scalars = scalars
        token = uuid.uuid4().hex[:12]
        if self.comm is not None:  # one temporary folder name for all ranks: rank 0's
            token = exchange_bytes(self.comm, token.encode())[0].decode()
        self.token = token
        self.staging = self.path.with_name(f".{self.path.name}.tmp-{token}")
        self.info: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._write, args=(pieces,), daemon=True, name=f"gpudist-checkpoint-{rank}"
            )
            self._thread.start()
        else:
            self._write(pieces)
        self._done = False

    def _write(self, pieces: dict[str, torch.Tensor]) -> None:
        try:
            stored, listed = _pack_runs(pieces)
            data = st_save(stored, metadata={"format": FORMAT, "rank": str(self.rank)})
            filename = f"rank-{self.rank:05d}.safetensors"
            atomic_write_bytes(self.staging / filename, data)
            self.info = {
                "file": filename,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "pieces": listed,
                "scalars": self.scalars,
            }
        except BaseException as e:  # reported to every rank by wait()
            self.error = e

    def done(self) -> bool:
        """Whether this rank's file is written (``wait`` will not block on the writer)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Finish (collective): every rank's file written, then the manifest and the rename by rank 0."""
        if self._done:
            return self.path
        if self._thread is not None:
            self._thread.join()
        mine = {"error": f"{type(self.error).__name__}: {self.error}"} if self.error is not None else self.info
        infos = (
            [json.loads(b) for b in exchange_bytes(self.comm, json.dumps(mine).encode())]
            if self.comm is not None
            else [mine]
        )
        self._done = True
        failed = [(r, i["error"]) for r, i in enumerate(infos) if "error" in i]
        if failed:
            if self.rank == 0:
                shutil.rmtree(self.staging, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint {self.path} was not written: rank {failed[0][0]} failed: "
                f"{failed[0][1]}; the previous checkpoints are untouched"
            )
        if self.rank == 0:
            merged: dict[str, dict[str, float]] = {}
            for i in infos:
                for name, values in i["scalars"].items():
                    merged.setdefault(name, {}).update(values)
            body = dict(self.body)
            if body["optimizer"] is not None:
                body["optimizer"] = {**body["optimizer"], "scalars": merged}
            body["files"] = [{k: i[k] for k in ("file", "sha256", "bytes", "pieces")} for i in infos]
            atomic_write_json(self.staging / MANIFEST, {"body": body, "sha256": _body_digest(body)})
            old = self.path.with_name(f".{self.path.name}.old-{self.token}")
            if self.path.exists():
                os.replace(self.path, old)
            os.replace(self.staging, self.path)
            shutil.rmtree(old, ignore_errors=True)
        if self.comm is not None:
            self.comm.barrier()
        return self.path


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


def remove_stale_staging(root: str | os.PathLike) -> list[Path]:
    """Delete the hidden folders that interrupted saves left under ``root`` (``.NAME.tmp-*``, ``.NAME.old-*``).
    Call it only when no save is in progress (e.g. on rank 0 when a job starts). Returns what it removed."""
    root = Path(root)
    removed = []
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(".") and (".tmp-" in child.name or ".old-" in child.name) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed


def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The verified manifest of the checkpoint folder at ``path`` (raises CheckpointError when it is not one)."""
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
    if body.get("format") not in READABLE:
        raise CheckpointError(f"{path} has format {body.get('format')!r}; this gpudist reads {READABLE}")
    return body


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint folder under ``root`` with the highest step (None if there is none)."""
    best, best_step = None, None
    root = Path(root)
    if not root.is_dir():
        return None
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            step = read_manifest(child)["step"]
        except CheckpointError:
            continue
        if best_step is None or step > best_step:
            best, best_step = child, step
    return best


class _Reader:
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
            if not file.is_file():
                raise CheckpointError(f"{self.path}: {entry['file']} is missing")
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


def _check_model(body: dict, table: list[dict], buffers: list[tuple[str, torch.Tensor, bool]]) -> None:
    saved = {row["name"]: row for row in body["parameters"]}
    mine = {row["name"]: row for row in table}
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (was it saved from another architecture?)"
        )
    for name, row in mine.items():
        if saved[name]["shape"] != row["shape"]:
            raise CheckpointError(
                f"checkpoint does not match the model: {name} has shape {saved[name]['shape']} "
                f"in the checkpoint, {row['shape']} in the model"
            )
    saved_buffers = {b["name"]: b for b in body["buffers"]}
    for name, b, _ in buffers:
        if name not in saved_buffers or saved_buffers[name]["shape"] != list(b.shape):
            raise CheckpointError(f"checkpoint does not match the model: buffer {name} is missing or has another shape")


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo:
    """Load a folder from :func:`save_checkpoint` into ``model`` (and ``optimizer``), whatever strategy and world
    size wrote it (collective). Nothing in memory changes unless every rank read and verified all it needs."""
    path = Path(path)
    comm = _comm_of(model, optimizer)
    parts = _model_parts(model, comm)
    held = parts.held
    table = _param_table(model)
    apply: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, staged values)
    finish = None
    error: Exception | None = None
    try:
        body = read_manifest(path)
        _check_model(body, table, parts.buffers)
        reader = _Reader(path, body)
        for tensor, segments in held:
            flat = tensor.data.reshape(-1)
            for pos, n, name, c in _canonical(segments, 0, flat.numel()):
                # fp32 parameters take an fp32 master copy when the checkpoint has one (saved by bf16 training)
                kind = "state.master" if flat.dtype == torch.float32 and reader.has("state.master", name) else "param"
                apply.append((flat[pos : pos + n], reader.read(kind, name, c, n, flat.dtype)))
        for name, b, _ in parts.buffers:
            apply.append((b.data.reshape(-1), reader.read("buffer", name, 0, b.numel(), b.dtype)))
        if optimizer is not None:
            finish = _stage_optimizer(optimizer, body, reader, {id(t): s for t, s in held}, apply)
    except CheckpointError as e:
        error = e
    if comm is not None:  # all ranks apply, or none does
        verdict = torch.tensor([0 if error is None else 1, comm.rank if error is not None else -1], device=comm.device)
        comm.all_reduce(verdict, ReductionOperation.MAX)
        if error is None and verdict[0].item():
            raise CheckpointError(
                f"rank {verdict[1].item()} could not load {path} (see its error); nothing was changed on any rank"
            )
    if error is not None:
        raise error
    with torch.no_grad():
        for dest, values in apply:
            dest.copy_(values)
    if finish is not None:
        finish()
    return CheckpointInfo(path, body["step"], body["world_size"], body["strategy"], body.get("extra", {}))


def _stage_optimizer(
    opt, body: dict, reader: _Reader, segmap: dict[int, Segments], apply: list[tuple[torch.Tensor, torch.Tensor]]
):
    """Read the optimizer state this rank needs; return a function that installs it (after the parameters)."""
    opt = _state_holder(opt)
    if isinstance(opt, GradientCompressionOptimizer):
        return _stage_compression(opt, body, reader, segmap, apply)
    saved = body.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{reader.path} holds no optimizer state; load it with optimizer=None, or save one")
    scalars: dict[str, dict] = saved["scalars"]
    groups = opt.param_groups
    if len(saved["groups"]) != len(groups):
        raise CheckpointError(
            f"{reader.path}: the checkpoint's optimizer has {len(saved['groups'])} parameter "
            f"group(s), this one {len(groups)}"
        )
    kind = type(opt.optimizer if isinstance(opt, ShardedOptimizer) else opt).__name__
    if saved["class"] != kind:
        raise CheckpointError(
            f"{reader.path}: the checkpoint holds {saved['class']} state, the optimizer is a "
            f"{kind}; build the same optimizer class, or load with optimizer=None"
        )
    keys = sorted({k.removeprefix("state.") for k, _ in reader.index if k.startswith("state.")} - {"master"})

    def first_name(group) -> str | None:
        return next((segs[0][2] for p in group["params"] if (segs := segmap.get(id(p)))), None)

    def step_of(group) -> int:
        name = first_name(group)
        return int(scalars.get(name, {}).get("step", 0)) if name is not None else 0

    if isinstance(opt, _FlatShardOptimizer):
        owned = list(_flat_owned(opt, segmap))
        targets = dict(opt._state)
        if set(keys) != set(targets) and opt._inner is None:
            raise CheckpointError(
                f"{reader.path}: the checkpoint's optimizer state has {keys or 'no tensors'}, "
                f"this {type(opt.optimizer).__name__} needs {sorted(targets)}"
            )
        for pos, n, name, c in owned:
            for key, t in targets.items():
                apply.append((t[pos : pos + n], reader.read(f"state.{key}", name, c, n, t.dtype)))
            if not opt._master_is_view and reader.has("state.master", name):  # fp32 beats a bf16 copy of it
                master = reader.read("state.master", name, c, n, torch.float32)
                apply.append((opt._master[pos : pos + n], master))
        inner_state = None
        if opt._inner is not None:
            inner_state = {}
            for i, (view, piece) in enumerate(zip(opt._views, opt._pieces, strict=True)):
                entry: dict[str, Any] = {}
                for key in keys:
                    values = torch.zeros(piece.length, dtype=torch.float32, device="cpu")
                    for pos, n, name, c in owned:
                        a, b = max(pos, piece.owned_offset), min(pos + n, piece.owned_offset + piece.length)
                        if a < b:
                            values[a - piece.owned_offset : b - piece.owned_offset] = reader.read(
                                f"state.{key}", name, c + a - pos, b - a, torch.float32
                            )
                    entry[key] = values.view_as(view)
                name = next(
                    (
                        nm
                        for pos, n, nm, c in owned
                        if pos < piece.owned_offset + piece.length and pos + n > piece.owned_offset
                    ),
                    None,
                )
                for key, value in scalars.get(name, {}).items():
                    entry[key] = torch.tensor(float(value), device="cpu")
                inner_state[i] = entry
        steps = [step_of(g) for g in groups]

        def finish() -> None:
            for group, hyper in zip(groups, saved["groups"], strict=True):
                group.update(hyper)
            opt._steps = steps
            if not any(reader.has("state.master", name) for _, _, name, _ in owned):
                opt._refresh_master()  # no fp32 copy saved: start from the loaded parameters
            if inner_state is not None:
                sd = opt._inner.state_dict()
                load_keeping_identity(opt._inner, {"state": inner_state, "param_groups": sd["param_groups"]})

        return finish
    torch_opt = _torch_optimizer(opt)
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in torch_opt.param_groups:
        for p in group["params"]:
            segs = segmap.get(id(p), [])
            entry = {}
            if segs:
                for key in keys:
                    values = torch.zeros(p.numel(), dtype=torch.float32, device="cpu")
                    for pos, n, name, c in _canonical(segs, 0, p.numel()):
                        values[pos : pos + n] = reader.read(f"state.{key}", name, c, n, torch.float32)
                    entry[key] = values.view_as(p)
                for key, value in scalars.get(segs[0][2], {}).items():
                    entry[key] = torch.tensor(float(value), device="cpu")
            if entry:
                state[index] = entry
            index += 1

    def finish_torch() -> None:
        sd = torch_opt.state_dict()
        groups_sd = [{**g, **hyper} for g, hyper in zip(sd["param_groups"], saved["groups"], strict=True)]
        load_keeping_identity(torch_opt, {"state": state, "param_groups": groups_sd})

    return finish_torch


def _stage_compression(
    opt: GradientCompressionOptimizer,
    body: dict,
    reader: _Reader,
    segmap: dict[int, Segments],
    apply: list[tuple[torch.Tensor, torch.Tensor]],
):
    """The wrapped optimizer's state, then the residuals. Saved at the same world size, each rank takes its own
    worker residual back; at another world size every rank takes the mean of the saved ones, which keeps the
    pending update ``mean_r(worker_r)`` unchanged. Server residuals are one tensor, resharded like parameters."""
    meta = (body.get("optimizer") or {}).get("compression")
    if meta is not None:
        check_compress_mode(opt, meta)
    finish_inner = _stage_optimizer(opt.inner if opt.inner is not None else opt.optimizer, body, reader, segmap, apply)
    rank, world = opt.comm.rank, opt.comm.world_size
    staged = []
    for channel, spans in _residual_spans(opt, segmap):
        worker = server = None
        if meta is not None and channel.worker is not None:
            saved_world = int(meta["world_size"])
            kinds = (
                [f"residual.worker.{rank}"]
                if saved_world == world
                else [f"residual.worker.{r}" for r in range(saved_world)]
            )
            worker = torch.zeros(channel.numel, dtype=torch.float32, device="cpu")
            for pos, n, name, c in spans:
                if all(reader.has(kind, name) for kind in kinds):
                    total = sum(reader.read(kind, name, c, n, torch.float32) for kind in kinds)
                    worker[pos : pos + n] = total / len(kinds)
        held = channel.server_residual()
        if meta is not None and held is not None:
            start, values = held
            server = torch.zeros(values.numel(), dtype=torch.float32, device="cpu")
            for pos, n, name, c in spans:
                a, b = max(pos, start), min(pos + n, start + values.numel())
                if a < b and reader.has("residual.server", name):
                    part = reader.read("residual.server", name, c + a - pos, b - a, torch.float32)
                    server[a - start : b - start] = part
        staged.append((channel, worker, server))

    def finish() -> None:
        finish_inner()
        for channel, worker, server in staged:
            channel.load_residuals(worker, server)
        if meta is not None:
            opt.hook.steps = int(meta["steps"])

    return finish


ShardedModel._checkpoint_io = (save_checkpoint, load_checkpoint)  # save_model/load_model of every strategy
