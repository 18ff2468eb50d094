"""Checkpoints whose manifest passes its checksum but was written by someone else (the checksum is not keyed: it
detects damage, not tampering), and rank files that are not what the manifest says: each is refused with a
CheckpointError naming what is wrong, before anything is read through it, and the model is left as it was."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import pytest
import torch
from torch import nn

from gpudist import CheckpointError, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.faults


def _saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    path = save_checkpoint(tmp_path / "ckpt", model)
    return model, path


def _resign(path, edit) -> None:
    """Edit the manifest's body and give it a checksum that matches, as anyone can (sha256 of the sorted JSON)."""
    manifest = path / "manifest.json"
    doc = json.loads(manifest.read_text())
    edit(doc["body"])
    doc["sha256"] = hashlib.sha256(json.dumps(doc["body"], sort_keys=True).encode()).hexdigest()
    manifest.write_text(json.dumps(doc))


def _fresh() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _assert_refused(path, match: str) -> None:
    target = _fresh()
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, target)
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters(), strict=True)), "changed on refusal"


@pytest.mark.parametrize("name", ["../elsewhere/rank-00000.safetensors", "/etc/rank-00000.safetensors", "x.bin"])
def test_a_file_entry_outside_the_folder_is_refused(tmp_path, name):
    """Catches a manifest that makes the loader read a file outside the checkpoint folder (a relative escape or an
    absolute path) or a file that is not a rank file."""
    _, path = _saved(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    os.replace(path / "rank-00000.safetensors", tmp_path / "elsewhere" / "rank-00000.safetensors")

    def point_away(body):
        body["files"][0]["file"] = name

    _resign(path, point_away)
    _assert_refused(path, r"malformed: a file name is .* expected rank-NNNNN\.safetensors")


def test_a_symlinked_rank_file_is_refused(tmp_path):
    """Catches a rank file that is a link to a file outside the folder (read through the link, it would load data
    the folder does not hold)."""
    _, path = _saved(tmp_path)
    outside = tmp_path / "outside.safetensors"
    os.replace(path / "rank-00000.safetensors", outside)
    (path / "rank-00000.safetensors").symlink_to(outside)
    _assert_refused(path, "symbolic link")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("step", "three", r"step is 'three', expected an integer >= 0"),
        ("world_size", 0, r"world_size is 0, expected an integer >= 1"),
        ("files", {"file": "rank-00000.safetensors"}, r"files is .* expected a list"),
        ("parameters", [None], r"a parameter or buffer entry is None"),
    ],
)
def test_malformed_fields_are_named(tmp_path, field, value, match):
    """Catches a checksum-valid manifest with fields of the wrong type loading (``"step": "three"`` did) or failing
    later with a KeyError/TypeError that names nothing."""
    _, path = _saved(tmp_path)

    def set_field(body):
        body[field] = value

    _resign(path, set_field)
    _assert_refused(path, match)


def test_a_grown_rank_file_is_refused_by_its_size(tmp_path, monkeypatch):
    """Catches a rank file larger than the manifest says (appended to, or sparse) being read whole before its size
    is checked (+1 GiB of memory for a 1 GiB append; a MemoryError instead of a CheckpointError when memory is
    short, which reading a file over 512 MiB stands for here)."""
    read = pathlib.Path.read_bytes

    def short_of_memory(self):
        if self.stat().st_size > 1 << 29:
            raise MemoryError(f"reading {self} whole")
        return read(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", short_of_memory)
    _, path = _saved(tmp_path)
    with open(path / "rank-00000.safetensors", "ab") as f:
        f.truncate(f.tell() + (1 << 30))  # 1 GiB more, sparse: costs no disk, but would cost memory to read
    _assert_refused(path, r"truncated or damaged: \d+ bytes, the manifest says \d+")


def test_an_intact_checkpoint_still_loads(tmp_path):
    """The checks refuse nothing a save writes."""
    model, path = _saved(tmp_path)
    target = _fresh()
    load_checkpoint(path, target)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), target.parameters(), strict=True))
