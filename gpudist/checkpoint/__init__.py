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

This package is the format and its I/O: it knows no strategy. The strategies implement the two protocols with the
vocabulary defined in :mod:`~gpudist.checkpoint.format` (canonical pieces, :func:`written`, :class:`Reader`); a plain
``nn.Module`` and a plain torch optimizer are described in :mod:`~gpudist.checkpoint.protocol`, parameter by
parameter.

Saving is atomic: files go to a temporary folder beside the target, the manifest is written last, and the folder
is renamed into place (over an existing one: the old folder is moved aside first, and a crash between the two
renames is finished or rolled back by the next reader, under a lock the save holds while it renames). Loading reads
and verifies every byte it needs (file checksums, shapes, names, coverage) into fresh tensors, agrees with the
other ranks that all of them succeeded, and only then copies into the model and optimizer: a truncated, bit-flipped
or mismatched checkpoint raises and changes nothing in memory.

Its modules, each importing only those before it:

* ``format``: names and versions, the manifest, a rank's file, :class:`Reader`, canonical pieces.
* ``protocol``: :class:`CheckpointableModel`, :class:`CheckpointableOptimizer`, and a plain module and torch optimizer
  described in their terms.
* ``folders``: complete checkpoints under a root, the lock a save renames under, interrupted saves settled or cleared.
* ``write``: :func:`save_checkpoint`, :class:`CheckpointWrite`.
* ``read``: :func:`load_checkpoint`.
* ``snapshot``: live mode's in-memory snapshots and frames, :func:`load_snapshots`.
"""

from .folders import complete_checkpoints, latest_checkpoint, remove_stale_staging, settle_interrupted
from .format import FORMAT as FORMAT
from .format import MANIFEST as MANIFEST
from .format import READABLE as READABLE
from .format import CheckpointError, CheckpointInfo, Reader, Segments, Share, canonical, read_manifest, written
from .protocol import (
    CheckpointableModel,
    CheckpointableOptimizer,
    group_hyperparameters,
    load_keeping_identity,
    module_segments,
    module_table,
    optimizer_pieces,
    put_piece,
    saved_optimizer,
    scalar_of,
    stage_optimizer,
    stage_torch_optimizer,
    torch_optimizer_pieces,
    update_group,
)
from .read import load_checkpoint
from .snapshot import frame_length, frame_snapshot, load_snapshots, snapshot_frame, snapshot_state
from .write import CheckpointWrite, save_checkpoint

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
    "update_group",
    "written",
]
