"""Saving: :func:`save_checkpoint` and :class:`CheckpointWrite` (atomic; the files written in the background if
asked), and what a rank captures of a model and optimizer (:func:`_capture`, which :mod:`gpudist.checkpoint.snapshot`
shares).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from ..comm import CommunicationBackend
from ..fileio import atomic_write_bytes, atomic_write_json
from ..flat import exchange_bytes
from .folders import _discard, _root_lock
from .format import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    _body_digest,
    _jsonable,
    _merged_body,
    _pack_runs,
    canonical,
    written,
)
from .protocol import _comm_of, _model_parts, _param_table, optimizer_pieces


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
