"""Loading: :func:`load_checkpoint`, which every rank reads and verifies before anything in memory changes
(:func:`_load`, which :func:`~gpudist.checkpoint.snapshot.load_snapshots` shares).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..comm import ReductionOperation
from .folders import settle_interrupted
from .format import CheckpointError, CheckpointInfo, Reader, canonical, read_manifest
from .protocol import _comm_of, _model_parts, _param_table, stage_optimizer


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
