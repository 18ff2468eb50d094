"""A save that crashed between its two renames (the previous checkpoint moved aside, the new one not yet in place)
loses nothing: the recovery that jobs run at start-up (``remove_stale_staging``) puts the newest complete folder
back under the checkpoint's name, so ``latest_checkpoint`` finds it."""

from __future__ import annotations

import os

import torch
from torch import nn

from gpudist import latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint
from gpudist.checkpoint import remove_stale_staging


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
