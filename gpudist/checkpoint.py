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
holds (the model through :class:`CheckpointableModel`, the optimizer through :class:`CheckpointableOptimizer`), so
a checkpoint written by ZeRO-3 on 4 ranks loads into ZeRO-2 on 2 or DDP on 3: each rank reads the pieces it now
needs from whichever files hold them. Every element is written once: when several ranks hold copies of it (data-parallel
replicas, tensor ranks holding a replicated LayerNorm, pipeline stages sharing a tied embedding), the model's
:meth:`ShardedModel.checkpoint_share` says how many copies there are and which one this rank is, and the copies
split the writing (replicated strategies: rank r saves its ``shard_range`` of every tensor) or leave it to one
(the stage owning a tied parameter).

This module is the format and its I/O: it knows no strategy. The strategies implement the two protocols with the
vocabulary defined here (canonical pieces, :func:`written`, :class:`Reader`); a plain ``nn.Module`` and a plain torch
optimizer are described here, parameter by parameter.

Saving is atomic: files go to a temporary folder beside the target, the manifest is written last, and the folder
is renamed into place (over an existing one: the old folder is moved aside first, and a crash between the two
renames is finished or rolled back by the next reader, under a lock the save holds while it renames). Loading reads
and verifies every byte it needs (file checksums, shapes, names, coverage) into fresh tensors, agrees with the
other ranks that all of them succeeded, and only then copies into the model and optimizer: a truncated, bit-flipped
or mismatched checkpoint raises and changes nothing in memory.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from .comm import CommunicationBackend, ReductionOperation, shard_range
from .fileio import atomic_write_bytes, atomic_write_json
from .flat import exchange_bytes

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWrite",
    "CheckpointableModel",
    "CheckpointableOptimizer",
    "Reader",
    "Segments",
    "Share",
    "canonical",
    "complete_checkpoints",
    "frame_length",
    "frame_snapshot",
    "group_hyperparameters",
    "latest_checkpoint",
    "load_checkpoint",
    "load_keeping_identity",
    "load_snapshots",
    "module_segments",
    "module_table",
    "optimizer_pieces",
    "put_piece",
    "read_manifest",
    "remove_stale_staging",
    "save_checkpoint",
    "saved_optimizer",
    "scalar_of",
    "settle_interrupted",
    "snapshot_frame",
    "snapshot_state",
    "stage_optimizer",
    "stage_torch_optimizer",
    "torch_optimizer_pieces",
    "written",
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
    if isinstance(model, CheckpointableModel):
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
    return model.parameter_table() if isinstance(model, CheckpointableModel) else module_table(model)


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


def group_hyperparameters(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in groups]


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def scalar_of(value) -> float | int | None:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------------------------------------------------------
# The protocol: what a model and an optimizer say about the state they hold
#
# gpudist's wrappers describe themselves (ShardedModel's checkpoint_* methods, ShardedOptimizer's checkpoint_pieces
# and stage_checkpoint); a plain nn.Module and a plain torch optimizer are described here, parameter by parameter.
# This module knows no strategy: it sits below them, and they build on its vocabulary (canonical pieces, written,
# Reader).


@runtime_checkable
class CheckpointableModel(Protocol):
    """What a model tells a checkpoint (:class:`gpudist.ShardedModel` implements it for every strategy).

    The checkpoint is written over ``comm`` (one file per rank, rank 0 commits), or over the model's optional
    ``checkpoint_group`` when its state spans more ranks than ``comm`` (HSDP: the shard group x the replica group;
    it needs only ``rank``, ``world_size``, ``device``, ``all_reduce`` and ``all_gather``)."""

    strategy: str
    comm: CommunicationBackend

    def parameter_table(self) -> list[dict]: ...
    def checkpoint_segments(self) -> list[tuple[torch.Tensor, Segments]]: ...
    def checkpoint_share(self, name: str, across_replicas: bool = True) -> tuple[int, int] | None: ...
    def buffer_table(self) -> list[dict]: ...
    def checkpoint_buffers(self) -> list[tuple[str, torch.Tensor, bool]]: ...


@runtime_checkable
class CheckpointableOptimizer(Protocol):
    """What an optimizer tells a checkpoint (:class:`gpudist.ShardedOptimizer` implements it for every strategy).

    ``segmap`` maps ``id(parameter)`` to the canonical pieces the model holds in it; ``share`` is the model's
    :meth:`~gpudist.ShardedModel.checkpoint_share`."""

    comm: CommunicationBackend

    def checkpoint_pieces(
        self, segmap: dict[int, Segments], share: Share, rank: int, world: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]], dict]:
        """This rank's state pieces (``{"state.KEY|name|start": values}``, each element written by one rank), the
        per-parameter scalars (``{name: {"step": 3}}``) and a description (``{"class": ..., "groups": ...}``)."""
        ...

    def stage_checkpoint(
        self, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Callable[[], None]:
        """Read (and verify) all this rank needs from ``reader``; append ``(destination, values)`` copies to
        ``apply``; return what installs the rest. Nothing may change before every rank has read successfully."""
        ...


def optimizer_pieces(opt, segmap: dict[int, Segments], share: Share, rank: int, world: int):
    """:meth:`CheckpointableOptimizer.checkpoint_pieces` of any optimizer, a plain torch one included."""
    if isinstance(opt, CheckpointableOptimizer):
        return opt.checkpoint_pieces(segmap, share, rank, world)
    return torch_optimizer_pieces(opt, segmap, share)


def stage_optimizer(opt, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list) -> Callable[[], None]:
    """:meth:`CheckpointableOptimizer.stage_checkpoint` of any optimizer, a plain torch one included."""
    if isinstance(opt, CheckpointableOptimizer):
        return opt.stage_checkpoint(body, reader, segmap, apply)
    return stage_torch_optimizer(opt, body, reader, segmap, apply)


def put_piece(pieces: dict[str, torch.Tensor], key: str, name: str, at: int, values: torch.Tensor) -> None:
    """Add ``values`` (elements ``[at, at + n)`` of optimizer state ``key`` of parameter ``name``) to ``pieces``."""
    pieces[f"state.{key}|{name}|{at}"] = values.detach().reshape(-1).contiguous().cpu().clone()


def torch_optimizer_pieces(torch_opt: torch.optim.Optimizer, segmap: dict[int, Segments], share: Share):
    """:func:`optimizer_pieces` of a torch optimizer whose state is per parameter, replicated like the parameters."""
    pieces: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}
    for group in torch_opt.param_groups:
        for p in group["params"]:
            state = torch_opt.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and key != "step":
                    flat = value.reshape(-1)
                    for pos, n, name, c in written(canonical(segmap.get(id(p), []), 0, p.numel()), share, True):
                        put_piece(pieces, key, name, c, flat[pos : pos + n])
                elif (s := scalar_of(value)) is not None:
                    for _, _, name, _ in segmap.get(id(p), []):
                        scalars.setdefault(name, {})[key] = s
    return pieces, scalars, {"class": type(torch_opt).__name__, "groups": group_hyperparameters(torch_opt.param_groups)}


def saved_optimizer(body: dict, reader: Reader, groups: list[dict], kind: str) -> tuple[dict, dict, list[str]]:
    """The checkpoint's optimizer record, checked against an optimizer of class ``kind`` with ``groups``: the record,
    its per-parameter scalars, and the state tensors' keys (``master`` aside)."""
    saved = body.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{reader.path} holds no optimizer state; load it with optimizer=None, or save one")
    if len(saved["groups"]) != len(groups):
        raise CheckpointError(
            f"{reader.path}: the checkpoint's optimizer has {len(saved['groups'])} parameter "
            f"group(s), this one {len(groups)}"
        )
    if saved["class"] != kind:
        raise CheckpointError(
            f"{reader.path}: the checkpoint holds {saved['class']} state, the optimizer is a "
            f"{kind}; build the same optimizer class, or load with optimizer=None"
        )
    keys = sorted({k.removeprefix("state.") for k, _ in reader.index if k.startswith("state.")} - {"master"})
    return saved, saved["scalars"], keys


def stage_torch_optimizer(
    torch_opt: torch.optim.Optimizer, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list
) -> Callable[[], None]:
    """:func:`stage_optimizer` of a torch optimizer: its whole per-parameter state, installed by load_state_dict.

    The state is built and then loaded into a throwaway copy of the optimizer over meta tensors, so whatever torch's
    loader would refuse (a missing ``step``, ...) is found here, before anything is changed."""
    saved, scalars, keys = saved_optimizer(body, reader, torch_opt.param_groups, type(torch_opt).__name__)
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in torch_opt.param_groups:
        for p in group["params"]:
            segs = segmap.get(id(p), [])
            entry = {}
            if segs:
                for key in keys:
                    values = torch.zeros(p.numel(), dtype=torch.float32, device="cpu")
                    for pos, n, name, c in canonical(segs, 0, p.numel()):
                        values[pos : pos + n] = reader.read(f"state.{key}", name, c, n, torch.float32)
                    entry[key] = values.view_as(p)
                own = scalars.get(segs[0][2])
                if own is None and p.numel() == 0:  # no shard owns an element of it: its group's common scalars
                    own = _common_scalars(scalars, [s[0][2] for q in group["params"] if (s := segmap.get(id(q)))])
                for key, value in (own or {}).items():
                    entry[key] = torch.tensor(float(value), device="cpu")
            if entry:
                state[index] = entry
            index += 1
    _check_state_keys(state, torch_opt, segmap, reader.path)
    sd = torch_opt.state_dict()
    groups_sd = [{**g, **hyper} for g, hyper in zip(sd["param_groups"], saved["groups"], strict=True)]
    loaded = {"state": state, "param_groups": groups_sd}
    _try_load(torch_opt, loaded, reader.path)

    def finish() -> None:
        load_keeping_identity(torch_opt, loaded)

    return finish


def _common_scalars(scalars: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The scalars (``step``, ...) that every one of ``names`` that has any holds with the same value."""
    held = [scalars[n] for n in names if n in scalars]
    return {k: v for k, v in held[0].items() if all(h.get(k) == v for h in held)} if held else {}


def _check_state_keys(state: dict[int, dict[str, Any]], torch_opt, segmap: dict[int, Segments], path: Path) -> None:
    """Every parameter's staged state has the same keys: a parameter the checkpoint gave fewer (a scalar missing for
    it) is named here rather than failing in torch's loader or the next step()."""
    params = [p for g in torch_opt.param_groups for p in g["params"]]
    every = set().union(*(e.keys() for e in state.values())) if state else set()
    for i, entry in state.items():
        if entry.keys() != every:
            name = segmap[id(params[i])][0][2]
            raise CheckpointError(
                f"{path}: the optimizer state of {name!r} lacks {sorted(every - entry.keys())} that the other "
                "parameters have (a checkpoint written without them?)"
            )


def _try_load(torch_opt: torch.optim.Optimizer, state_dict: dict[str, Any], path: Path) -> None:
    """Load ``state_dict`` into a throwaway copy of ``torch_opt`` whose parameters are meta tensors (no memory, no
    copy), so a state that torch's loader or the optimizer's ``__setstate__`` refuses fails before anything changed:
    their failure would come after the optimizer had already dropped its old state."""
    probe = copy.copy(torch_opt)  # Optimizer.__getstate__: defaults, state, param_groups; no hooks
    probe.param_groups = [
        {**g, "params": [torch.empty_like(p, device="meta") for p in g["params"]]} for g in torch_opt.param_groups
    ]
    probe.state = collections.defaultdict(dict)
    try:
        probe.load_state_dict(state_dict)
    except Exception as e:
        raise CheckpointError(
            f"{path}: the optimizer state does not load into {type(torch_opt).__name__} ({type(e).__name__}: {e})"
        ) from e


def load_keeping_identity(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``, keeping its ``param_groups`` dicts and ``state`` mapping the same
    objects: torch's loader replaces them, which silently disconnects every wrapper sharing them and every LR
    scheduler built before the load (the scheduler would go on setting lr in dicts the optimizer no longer reads)."""
    groups, state = optimizer.param_groups, optimizer.state
    optimizer.load_state_dict(state_dict)
    for old, new in zip(groups, optimizer.param_groups, strict=True):
        old.update({k: v for k, v in new.items() if k != "params"})
    state.clear()
    state.update(optimizer.state)
    optimizer.param_groups, optimizer.state = groups, state


def module_table(module: nn.Module) -> list[dict]:
    """The parameter table of an unwrapped module (:meth:`gpudist.ShardedModel.parameter_table`): name, other names
    (tied parameters), shape and dtype of every parameter, in ``parameters()`` order."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return [
        {
            "name": name,
            "aliases": aliases[id(p)][1:],
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
        }
        for name, p in module.named_parameters()
    ]


def module_segments(module: nn.Module) -> list[tuple[torch.Tensor, Segments]]:
    """The checkpoint segments of an unwrapped module (:meth:`gpudist.ShardedModel.checkpoint_segments`): each
    parameter whole, under its first name."""
    return [(p, [(0, p.numel(), name, 0)]) for name, p in module.named_parameters()]


# ---------------------------------------------------------------------------------------------------------------------
# Saving


def _comm_of(model, optimizer) -> CommunicationBackend | None:
    if isinstance(model, CheckpointableModel):
        return getattr(model, "checkpoint_group", model.comm)
    if isinstance(optimizer, CheckpointableOptimizer):
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
    the new one is complete. ``extra`` (JSON) travels in the manifest, e.g. the data position.

    Args:
        path: The checkpoint folder to write (replaced if it exists).
        model: A gpudist ``ShardedModel``, or a plain ``nn.Module`` (whole on every rank of the optimizer's
            group, if any).
        optimizer: A gpudist or torch optimizer over ``model``'s parameters; None saves no optimizer state.
        step: The training step, recorded in the manifest (:func:`latest_checkpoint` picks the highest).
        extra: A JSON-serializable dict saved in the manifest and returned by :func:`load_checkpoint`.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        TypeError: When ``extra`` is not JSON-serializable, or ``model`` is not an ``nn.Module``.
        CheckpointError: When a rank could not write its file (raised on every rank; the previous checkpoints
            are untouched).
    """
    return CheckpointWrite(path, model, optimizer, step=step, extra=extra, background=False).wait()


def _capture(
    model: nn.Module,
    optimizer,
    comm: CommunicationBackend | None,
    step: int,
    extra: dict[str, Any] | None,
    clone: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]:
    """This rank's pieces (host copies; ``clone=False``: views of the live state where they are on the host, to be
    copied before the state changes), its optimizer scalars and the manifest body (without ``files``); no
    communication, so it also works on a group that has failed (:func:`snapshot_state`)."""
    take = (lambda t: t.cpu().clone()) if clone else (lambda t: t.cpu())
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    parts = _model_parts(model, comm)
    pieces: dict[str, torch.Tensor] = {}
    for tensor, segments in parts.held:
        flat = tensor.detach().reshape(-1)
        for pos, n, name, c in written(canonical(segments, 0, flat.numel()), parts.share, True):
            pieces[f"param|{name}|{c}"] = take(flat[pos : pos + n].contiguous())
    for name, b, writes in parts.buffers:
        if writes:
            pieces[f"buffer|{name}|0"] = take(b.detach().reshape(-1).contiguous())
    scalars, opt_desc = {}, None
    if optimizer is not None:
        segmap = {id(t): segs for t, segs in parts.held}
        opt_pieces, scalars, opt_desc = optimizer_pieces(optimizer, segmap, parts.share, rank, world)
        pieces.update({k: take(v) for k, v in opt_pieces.items()})
    body = {
        "format": FORMAT,
        "strategy": parts.strategy,
        "world_size": world,
        "step": int(step),
        "extra": extra or {},
        "parameters": _param_table(model),
        "buffers": parts.buffer_table,
        "optimizer": opt_desc,
    }
    return pieces, scalars, body


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


def snapshot_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0, extra: dict | None = None
) -> bytes:
    """This rank's part of a checkpoint of ``model`` and ``optimizer`` as bytes in memory, for sending to a peer
    (live healing) instead of writing a file. Not collective, so it works after the group failed: the pieces are
    in the coordinates of the group the model was built on (a replicated model's rank writes only its share; pass
    the plain module and torch optimizer for a whole copy). :func:`load_snapshots` loads any set of them that
    covers the state, at any world size.

    Args:
        model: A gpudist ``ShardedModel``, or a plain ``nn.Module`` (then written whole).
        optimizer: A gpudist or torch optimizer over ``model``'s parameters; None: no optimizer state.
        step: The training step recorded with it.
        extra: A JSON-serializable dict carried with it.

    Returns:
        A safetensors file's bytes whose metadata carries the manifest body.

    Raises:
        TypeError: When ``extra`` is not JSON-serializable, or ``model`` is not an ``nn.Module``.
    """
    stored, meta = _snapshot_parts(model, optimizer, step, extra, clone=True)
    return st_save(stored, metadata=meta)


def _snapshot_parts(
    model: nn.Module, optimizer, step: int, extra: dict | None, clone: bool
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a snapshot (:func:`_capture`'s, packed) and its safetensors metadata."""
    if extra is not None and not _jsonable(extra):
        raise TypeError(f"extra must be JSON-serializable, got {extra!r}")
    pieces, scalars, body = _capture(model, optimizer, _comm_of(model, optimizer), step, extra, clone)
    stored, listed = _pack_runs(pieces)
    meta = {"format": FORMAT, "body": json.dumps(body), "pieces": json.dumps(listed), "scalars": json.dumps(scalars)}
    return stored, meta


_FRAME_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // _FRAME_ALIGN) * _FRAME_ALIGN


def snapshot_frame(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    extra: dict | None = None,
    capacity: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`snapshot_state` as a frame: one uint8 host tensor to send every step (buddy mirrors), made with a single
    copy of each piece of the state and no serialization pass (``snapshot_state`` copies, packs and serializes: three
    passes over the state). :func:`frame_snapshot` turns a frame into ``snapshot_state``'s bytes when it is needed
    (a heal).

    Layout: an int64 payload length ``P``, an int64 header length ``H``, the header (JSON: the manifest metadata of
    ``snapshot_state`` and each tensor's name, dtype, shape and offset), then the tensors' bytes, each 16-byte aligned;
    ``frame_length(frame) = 8 + P`` bytes are used, the rest is room.

    Args:
        model, optimizer, step, extra: As :func:`snapshot_state`.
        capacity: The frame's size at least (room to grow, so frames of later steps keep one size).
        out: A frame to write into if it is large enough (reused: no fresh memory each step).

    Returns:
        The frame: ``out``, or a new tensor.

    Raises:
        TypeError: When ``extra`` is not JSON-serializable, or ``model`` is not an ``nn.Module``.
    """
    stored, meta = _snapshot_parts(model, optimizer, step, extra, clone=False)
    entries, offset = [], 0
    for name, t in stored.items():
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset = _aligned(offset + t.numel() * t.element_size())
    header = json.dumps({"meta": meta, "tensors": entries}).encode()
    data = _aligned(16 + len(header))
    size = max(data + offset, capacity)
    frame = out if out is not None and out.numel() >= size else torch.empty(size, dtype=torch.uint8)
    frame[:16] = torch.tensor([data + offset - 8, len(header)], dtype=torch.int64).view(torch.uint8)
    frame[16 : 16 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for (_, _, _, at), t in zip(entries, stored.values(), strict=True):
        n = t.numel() * t.element_size()
        frame[data + at : data + at + n].view(t.dtype).copy_(t.reshape(-1))
    return frame


def frame_length(frame: torch.Tensor) -> int:
    """The bytes of ``frame`` (:func:`snapshot_frame`) in use; more than ``frame.numel()`` when only its start was
    received (the snapshot outgrew the frames it was sent in)."""
    return 8 + int(frame[:8].view(torch.int64))


def frame_snapshot(frame: torch.Tensor) -> bytes:
    """The :func:`snapshot_state` bytes of a :func:`snapshot_frame`, for :func:`load_snapshots`.

    Raises:
        CheckpointError: When the frame is damaged.
    """
    try:
        payload, length = (int(v) for v in frame[:16].view(torch.int64))
        header = json.loads(frame[16 : 16 + length].numpy().tobytes())
        data = _aligned(16 + length)
        tensors = {}
        for name, dtype, shape, at in header["tensors"]:
            dtype = getattr(torch, dtype)
            n = math.prod(shape) * dtype.itemsize
            if data + at + n > 8 + payload:
                raise ValueError(f"tensor {name} ends past the payload")
            tensors[name] = frame[data + at : data + at + n].view(dtype).reshape(shape).clone()  # own storage each
        return st_save(tensors, metadata=header["meta"])
    except Exception as e:  # json, torch and the checks raise several types for garbled input
        raise CheckpointError(f"snapshot frame is damaged: {type(e).__name__}: {e}") from None


def load_snapshots(
    snapshots: list[bytes], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo:
    """Load the union of :func:`snapshot_state` results into ``model`` (and ``optimizer``), as
    :func:`load_checkpoint` loads a folder (collective; all ranks apply or none does): any strategy and world size.

    Args:
        snapshots: The snapshots whose pieces together cover what this rank needs (the same list on every rank,
            or at least lists that cover each rank's needs); the first one's manifest body is used.
        model: The gpudist ``ShardedModel`` or plain ``nn.Module`` to load into.
        optimizer: The optimizer to load the state into; None loads the model only.

    Returns:
        The snapshots' step, world size, strategy and ``extra`` (``path`` is ``"<memory>"``).

    Raises:
        CheckpointError: When the snapshots are malformed, do not match the model or optimizer, lack data this rank
            needs, or another rank could not load its own.
    """

    def source() -> tuple[dict, Reader]:
        if not snapshots:
            raise CheckpointError("no snapshot to load from")
        infos, files, bodies = [], {}, []
        for f, data in enumerate(snapshots):
            try:
                tensors = st_load(data)
                meta = _safetensors_metadata(data)
                infos.append({"pieces": json.loads(meta["pieces"]), "scalars": json.loads(meta["scalars"])})
                bodies.append(json.loads(meta["body"]))
            except Exception as e:  # safetensors and json raise several types for garbled input
                raise CheckpointError(f"snapshot {f} is damaged: {type(e).__name__}: {e}") from None
            files[f] = tensors
        body = _merged_body(bodies[0], infos)
        reader = Reader(Path("<memory>"), body)
        reader.files = files
        return body, reader

    return _load(Path("<memory>"), source, model, optimizer)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file held in ``data`` (its header is 8 bytes of length, then JSON)."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})


class CheckpointWrite:
    """One checkpoint being written; :func:`save_checkpoint` is ``CheckpointWrite(...).wait()``.

    Constructing it (collective) copies this rank's pieces to host memory and agrees on a staging folder; the files
    are then serialized, hashed and written, in a background thread when ``background=True``, while training goes
    on. :meth:`wait` (collective) joins the writer, and rank 0 writes the manifest and renames the folder into place
    only if every rank's file was written: a crash at any point leaves a loadable checkpoint under ``NAME`` (the new
    one or the previous one; a crash between the two renames of an overwrite is settled by the next reader,
    :func:`settle_interrupted`) and at most hidden ``.NAME.tmp-*``/``.NAME.old-*`` folders that are never read
    (:func:`remove_stale_staging` clears them).

    Args:
        path: The checkpoint folder to write (replaced if it exists, once the new one is complete).
        model: A gpudist ``ShardedModel``, or a plain ``nn.Module``.
        optimizer: A gpudist or torch optimizer over ``model``'s parameters; None saves no optimizer state.
        step: The training step, recorded in the manifest.
        extra: A JSON-serializable dict saved in the manifest.
        background: Serialize and write the files in a background thread (True) or before returning (False).

    Raises:
        TypeError: When ``extra`` is not JSON-serializable, or ``model`` is not an ``nn.Module``.
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
        pieces, self.scalars, self.body = _capture(model, optimizer, self.comm, step, extra)
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
        """Whether this rank's file is written (``wait`` will not block on the writer).

        Returns:
            True once the writer finished (successfully or not), or when writing was not in the background.
        """
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Finish (collective): every rank's file written, then the manifest and the rename by rank 0.

        Calling it again returns at once.

        Returns:
            The checkpoint's path.

        Raises:
            CheckpointError: When a rank could not write its file, or rank 0 could not write the manifest or move
                the folder into place (raised on every rank; the staging folder is removed and the previous
                checkpoint is untouched).
        """
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
        problem = ""
        if self.rank == 0:
            try:
                self._commit(infos)
            except Exception as e:  # a full disk, a permission: every rank must hear it, not wait at a barrier
                problem = f"{type(e).__name__}: {e}"
                shutil.rmtree(self.staging, ignore_errors=True)
        if self.comm is not None:  # rank 0's verdict, in place of a barrier
            problem = exchange_bytes(self.comm, problem.encode())[0].decode()
        if problem:
            raise CheckpointError(
                f"checkpoint {self.path} was not committed: rank 0 failed writing the manifest or renaming: "
                f"{problem}; the previous checkpoint is untouched (or put back by remove_stale_staging)"
            )
        return self.path

    def _commit(self, infos: list[dict]) -> None:
        """Rank 0: write the manifest into the staging folder, then move it into place, under the folder's lock so
        that no reader repairs (:func:`settle_interrupted`) between the two renames of a save that is alive."""
        body = _merged_body(self.body, infos)
        old = self.path.with_name(f".{self.path.name}.old-{self.token}")
        with _root_lock(self.path.parent):
            atomic_write_json(self.staging / MANIFEST, {"body": body, "sha256": _body_digest(body)})
            if self.path.exists():
                os.replace(self.path, old)
            os.replace(self.staging, self.path)
        _discard(old)


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
    """Clear what interrupted saves left under ``root`` (hidden ``.NAME.tmp-*`` and ``.NAME.old-*`` folders), after
    :func:`settle_interrupted` put back what a save interrupted between its two renames left. Call it only when no
    save is in progress (e.g. on rank 0 when a job starts): a save being written keeps its files in a ``.tmp``
    folder until it commits.

    Args:
        root: The folder holding checkpoint folders (nothing happens if it does not exist).

    Returns:
        The folders it removed (not the ones it put back).
    """
    root = Path(root)
    settle_interrupted(root)
    removed = []
    for folders in _hidden_folders(root).values():
        for child, _ in folders:
            _discard(child)
            removed.append(child)
    return removed


@contextlib.contextmanager
def _root_lock(root: Path, timeout: float = 60.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the folder ``root`` itself (no lock file is left beside the checkpoints), waiting
    at most ``timeout`` seconds for it. A save holds it across its manifest write and two renames, a reader while it
    settles an interrupted save; the kernel releases it when its holder dies."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"the checkpoint folder {root} is still locked after {timeout:g}s: a save there holds it while "
                        "it moves its folder into place (milliseconds); a process that hangs holding it must be ended"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _hidden_folders(root: Path) -> dict[str, list[tuple[Path, str]]]:
    """Per checkpoint name, the hidden folders interrupted saves left under ``root``: ``(folder, ".tmp-" or
    ".old-")`` (a save's staging folder, and the previous folder it moved aside)."""
    hidden: dict[str, list[tuple[Path, str]]] = {}
    if not root.is_dir():
        return hidden
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") and child.is_dir():
            kind = next((k for k in (".tmp-", ".old-") if k in child.name), None)
            if kind is not None:
                hidden.setdefault(child.name[1:].rsplit(kind, 1)[0], []).append((child, kind))
    return hidden


def settle_interrupted(root: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Finish, or roll back, saves under ``root`` that were interrupted between their two renames (the previous
    folder moved aside, the new one not yet in place), so that a crash there loses no checkpoint: for each checkpoint
    name (or only ``name``) whose folder is missing while a complete hidden one is there, the newest complete one
    (the highest step; the new folder before the previous one at the same step) goes back under the name. Nothing
    is deleted, and nothing happens where every folder is in place. :func:`latest_checkpoint`,
    :func:`complete_checkpoints` and :func:`load_checkpoint` call it, so a restart needs no helper call; it runs
    under a lock on ``root`` that a save holds while it renames, so it never moves a live save's folders.

    Args:
        root: The folder holding checkpoint folders.
        name: Only this checkpoint's folders (None: every name under ``root``).

    Returns:
        The checkpoint folders it put back.

    Raises:
        CheckpointError: When the lock stays held for a minute (a save that hangs between its renames).
    """
    root = Path(root)
    interrupted = {
        n: folders
        for n, folders in _hidden_folders(root).items()
        if (name is None or n == name) and not (root / n).exists()
    }
    restored: list[Path] = []
    if not interrupted:
        return restored
    with _root_lock(root):
        for n, folders in interrupted.items():
            if (root / n).exists():  # a save (or another reader) put it in place meanwhile
                continue
            complete = [(_step_of(folder), kind == ".tmp-", folder) for folder, kind in folders]
            complete = [c for c in complete if c[0] is not None]
            if complete:
                os.replace(max(complete)[2], root / n)
                restored.append(root / n)
    return restored


def _discard(folder: Path) -> None:
    """Remove a checkpoint folder that is not needed any more, its manifest first: a removal cut short leaves a
    folder without a manifest, which nothing takes for a complete checkpoint."""
    (folder / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def _step_of(folder: Path) -> int | None:
    """The step of the complete checkpoint ``folder`` (None: not complete)."""
    try:
        return read_manifest(folder)["step"]
    except CheckpointError:
        return None


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoint folders under ``root`` with a valid manifest, newest step first (hidden folders skipped).

    A save interrupted between its two renames is finished or rolled back first (:func:`settle_interrupted`).

    Args:
        root: The folder holding checkpoint folders.

    Returns:
        Those folders; empty when there is none (or ``root`` does not exist).

    Raises:
        CheckpointError: When an interrupted save is to be settled and the folder's lock stays held for a minute.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    settle_interrupted(root)
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            found.append((read_manifest(child)["step"], child.name, child))
        except CheckpointError:
            continue
    return [child for _, _, child in sorted(found, reverse=True)]


def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# Loading


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


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint folder under ``root`` with the highest step.

    Hidden folders (interrupted saves) and folders without a valid manifest are skipped, after a save interrupted
    between its two renames was finished or rolled back (:func:`settle_interrupted`).

    Args:
        root: The folder holding checkpoint folders.

    Returns:
        That folder, or None if there is none (or ``root`` does not exist).
    """
    found = complete_checkpoints(root)
    return found[0] if found else None


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
    size wrote it (collective). Nothing in memory changes unless every rank read and verified all it needs.

    A save of ``path`` interrupted between its two renames is finished or rolled back first
    (:func:`settle_interrupted`).

    Args:
        path: A checkpoint folder.
        model: The gpudist ``ShardedModel`` or plain ``nn.Module`` to load into.
        optimizer: The optimizer to load the saved state into; None loads the model only.

    Returns:
        The checkpoint's step, world size, strategy and ``extra``.

    Raises:
        TypeError: When ``model`` is not an ``nn.Module``.
        CheckpointError: When the checkpoint is missing, damaged or incomplete, does not match the model
            (parameter names or shapes, buffers) or the optimizer (no optimizer state, another class or number of
            parameter groups), or another rank could not load it.
    """
    path = Path(path)

    def source() -> tuple[dict, Reader]:
        if not path.exists():  # an overwrite of it interrupted between its renames: finish or roll it back
            settle_interrupted(path.parent, path.name)
        body = read_manifest(path)
        return body, Reader(path, body)

    return _load(path, source, model, optimizer)


def _load(path: Path, source: Callable[[], tuple[dict, Reader]], model: nn.Module, optimizer) -> CheckpointInfo:
    """:func:`load_checkpoint`'s body, reading the manifest and pieces through ``source`` (files or memory)."""
    comm = _comm_of(model, optimizer)
    parts = _model_parts(model, comm)
    held = parts.held
    table = _param_table(model)
    apply: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, staged values)
    finish = None
    error: Exception | None = None
    try:
        body, reader = source()
        _check_model(body, table, parts.buffers)
        for tensor, segments in held:
            flat = tensor.data.reshape(-1)
            for pos, n, name, c in canonical(segments, 0, flat.numel()):
                # fp32 parameters take an fp32 master copy when the checkpoint has one (saved by bf16 training)
                kind = "state.master" if flat.dtype == torch.float32 and reader.has("state.master", name) else "param"
                apply.append((flat[pos : pos + n], reader.read(kind, name, c, n, flat.dtype)))
        for name, b, _ in parts.buffers:
            apply.append((b.data.reshape(-1), reader.read("buffer", name, 0, b.numel(), b.dtype)))
        if optimizer is not None:
            finish = stage_optimizer(optimizer, body, reader, {id(t): s for t, s in held}, apply)
    except CheckpointError as e:
        error = e
    except Exception as e:  # anything else (a malformed field, memory, I/O) must reach the verdict too
        error = CheckpointError(f"{path} could not be read: {type(e).__name__}: {e}")
        error.__cause__ = e
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
