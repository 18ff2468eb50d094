"""A save that crashed between its two renames (the previous checkpoint moved aside, the new one not yet in place)
loses nothing: the recovery that jobs run at start-up (``remove_stale_staging``) puts the newest complete folder
back under the checkpoint's name, so ``latest_checkpoint`` finds it."""

from __future__ import annotations

import os

import torch
from torch import nn

from gpudist import (
    CheckpointError,
    DDPModel,
    ShardingConfiguration,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from gpudist.checkpoint import remove_stale_staging
from gpudist.testing import run_ranks


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


def _crash_between_renames(root, new_complete: bool):
    """A checkpoint at root/ckpt (step 1) being overwritten by step 2: the old folder already moved aside, the new
    one still in staging (its manifest written, or not yet)."""
    path = save_checkpoint(root / "ckpt", _model(1), step=1)
    staged = save_checkpoint(root / "next", _model(2), step=2)
    os.replace(path, root / ".ckpt.old-abc")
    os.replace(staged, root / ".ckpt.tmp-def")
    if not new_complete:
        (root / ".ckpt.tmp-def" / "manifest.json").unlink()  # the crash came before rank 0 wrote it
    return path


def test_a_complete_new_folder_is_put_in_place(tmp_path):
    """Catches recovery deleting the new checkpoint whose manifest was written, and the previous one with it: before,
    both hidden folders were removed and the job restarted from scratch."""
    path = _crash_between_renames(tmp_path, new_complete=True)
    assert latest_checkpoint(tmp_path) is None  # what a restart saw before recovery
    removed = remove_stale_staging(tmp_path)
    assert latest_checkpoint(tmp_path) == path and read_manifest(path)["step"] == 2
    assert removed == [tmp_path / ".ckpt.old-abc"]
    target = _model(0)
    load_checkpoint(path, target)
    assert torch.equal(target.weight, _model(2).weight)


def test_the_previous_folder_comes_back_when_the_new_one_is_incomplete(tmp_path):
    """Catches recovery deleting the only complete copy (the previous checkpoint moved aside) when the new one never
    got its manifest."""
    path = _crash_between_renames(tmp_path, new_complete=False)
    removed = remove_stale_staging(tmp_path)
    assert latest_checkpoint(tmp_path) == path and read_manifest(path)["step"] == 1
    assert removed == [tmp_path / ".ckpt.tmp-def"]


def _save_then_load_with(comm, root: str, fail: str):
    """Every rank saves a DDP model; then ``fail`` breaks rank 1's load verification with a KeyError, or rank 0's
    manifest write of a second save with a full disk. Returns each rank's error text (the patch is undone)."""
    import gpudist.checkpoint as ck

    model = DDPModel(_model(0), ShardingConfiguration(comm))
    path = save_checkpoint(f"{root}/ckpt", model, step=1)
    saved = ck.Reader.read, ck.atomic_write_json
    try:
        if fail == "load" and comm.rank == 1:

            def read(*args, **kwargs):
                raise KeyError("step")

            ck.Reader.read = read
        if fail == "save" and comm.rank == 0:

            def write(*args, **kwargs):
                raise OSError(28, "No space left on device")

            ck.atomic_write_json = write
        try:
            if fail == "load":
                load_checkpoint(path, model)
            else:
                save_checkpoint(path, model, step=2)
        except CheckpointError as e:
            return str(e)
        return "no error"
    finally:
        ck.Reader.read, ck.atomic_write_json = saved


def test_any_error_in_a_load_reaches_every_rank(tmp_path):
    """Catches a rank leaving the load on an error that is not a CheckpointError (a KeyError from a malformed
    field, a MemoryError, an OSError) before the cross-rank verdict: the other ranks waited there for the full
    timeout. Now every rank raises a CheckpointError at once, naming the rank and the error."""
    errors = run_ranks(_save_then_load_with, 2, "gloo", timeout=30, root=str(tmp_path), fail="load")
    assert "rank 1 could not load" in errors[0]
    assert "KeyError" in errors[1]


def test_a_full_disk_at_commit_reaches_every_rank(tmp_path):
    """Catches rank 0 failing to write the manifest (a full disk) and leaving before the final barrier: the others
    waited for the timeout and the staging folder stayed on the full disk. Now every rank raises a CheckpointError
    naming the error, the staging folder is gone, and the previous checkpoint is intact."""
    errors = run_ranks(_save_then_load_with, 2, "gloo", timeout=30, root=str(tmp_path), fail="save")
    assert all("No space left on device" in e for e in errors), errors
    assert read_manifest(tmp_path / "ckpt")["step"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
