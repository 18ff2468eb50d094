"""A save that crashed between its two renames (the previous checkpoint moved aside, the new one not yet in place)
loses nothing: ``latest_checkpoint``, ``complete_checkpoints`` and ``load_checkpoint`` settle it themselves (the newest
complete folder goes back under the checkpoint's name, under the lock a save holds while it renames), so a restart
with plain calls resumes; ``remove_stale_staging`` then clears the hidden leftovers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

from gpudist import (
    CheckpointError,
    DDPModel,
    FSDPModel,
    ShardingConfiguration,
    ZeRO3Optimizer,
    latest_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from gpudist.checkpoint import remove_stale_staging
from gpudist.checkpoint.folders import _root_lock
from gpudist.testing import run_ranks

pytestmark = pytest.mark.faults


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


def _hidden(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.is_dir())


def test_a_complete_new_folder_is_put_in_place_by_latest_checkpoint(tmp_path):
    """Catches a restart that finds nothing after a crash between the renames (before, latest_checkpoint returned
    None until someone called remove_stale_staging, which only the elastic path did: the job restarted from scratch),
    and a recovery that deletes the new checkpoint whose manifest was written."""
    path = _crash_between_renames(tmp_path, new_complete=True)
    assert latest_checkpoint(tmp_path) == path and read_manifest(path)["step"] == 2
    assert _hidden(tmp_path) == [".ckpt.old-abc"]  # nothing deleted: the previous folder stays until cleared
    target = _model(0)
    load_checkpoint(path, target)
    assert torch.equal(target.weight, _model(2).weight)
    assert remove_stale_staging(tmp_path) == [tmp_path / ".ckpt.old-abc"] and _hidden(tmp_path) == []


def test_the_previous_folder_comes_back_when_the_new_one_is_incomplete(tmp_path):
    """Catches a load that fails (or a recovery that deletes the only complete copy, the previous checkpoint moved
    aside) when the new one never got its manifest: load_checkpoint itself rolls the overwrite back."""
    path = _crash_between_renames(tmp_path, new_complete=False)
    target = _model(0)
    info = load_checkpoint(path, target)
    assert info.step == 1 and torch.equal(target.weight, _model(1).weight)
    assert _hidden(tmp_path) == [".ckpt.tmp-def"]
    assert remove_stale_staging(tmp_path) == [tmp_path / ".ckpt.tmp-def"]
    assert latest_checkpoint(tmp_path) == path and read_manifest(path)["step"] == 1


_KILLED_SAVE = """
import os, signal, sys
import torch
import gpudist.checkpoint.write as ck
root = sys.argv[1]
torch.manual_seed(1)
ck.save_checkpoint(root + "/ckpt", torch.nn.Linear(3, 2), step=1)
renames = []
real = os.replace
def replace(src, dst):
    real(src, dst)
    if os.path.isdir(dst):  # the save's folder renames (not its file writes, which rename too)
        renames.append(dst)
    if len(renames) == int(sys.argv[2]):  # SIGKILL right after this folder rename
        os.kill(os.getpid(), signal.SIGKILL)
ck.os.replace = replace
torch.manual_seed(2)
ck.save_checkpoint(root + "/ckpt", torch.nn.Linear(3, 2), step=2)
"""


@pytest.mark.parametrize("renames", [1, 2], ids=["after-moving-the-old-aside", "after-both"])
def test_a_process_killed_between_the_renames_of_an_overwrite_loses_nothing(tmp_path, renames):
    """A real process SIGKILLed while overwriting its checkpoint, after the first rename (the previous folder moved
    aside, the new one complete in staging) and after both: a plain latest_checkpoint + load_checkpoint resumes
    from the new checkpoint (step 2), and the lock the dead saver held does not block the reader (the kernel
    releases it). Catches a restart that starts from scratch or waits for a lock nobody holds."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(tmp_path), str(renames)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == -9, proc.stderr  # killed where the test said, not failed before
    expected_hidden = [n for n in _hidden(tmp_path) if ".old-" in n]
    assert len(expected_hidden) == 1  # the previous folder was moved aside in both cases
    found = latest_checkpoint(tmp_path)
    assert found == tmp_path / "ckpt"
    target = _model(0)
    assert load_checkpoint(found, target).step == 2 and torch.equal(target.weight, _model(2).weight)


def test_a_reader_does_not_move_the_folders_of_a_save_that_is_renaming(tmp_path):
    """While a save holds the lock between its two renames (the previous folder aside, the new one about to move),
    a reader waits for it instead of putting the previous folder back, which would make the save's second rename
    fail and lose the new checkpoint. Catches the settling done without the lock."""
    path = _crash_between_renames(tmp_path, new_complete=True)
    found: list = []
    with _root_lock(tmp_path):  # this thread is the save, between its renames
        reader = threading.Thread(target=lambda: found.append(latest_checkpoint(tmp_path)))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and not path.exists(), "the reader settled while the save held the lock"
        os.replace(tmp_path / ".ckpt.tmp-def", path)  # the save's second rename
    reader.join(30)
    assert found == [path] and read_manifest(path)["step"] == 2
    assert _hidden(tmp_path) == [".ckpt.old-abc"]


def test_an_overwrite_keeps_the_folder_complete_and_leaves_nothing_behind(tmp_path):
    """An overwrite that completes: the new checkpoint in place and nothing else beside it (no hidden folder, no lock
    file). Catches the previous folder left behind."""
    save_checkpoint(tmp_path / "ckpt", _model(1), step=1)
    save_checkpoint(tmp_path / "ckpt", _model(2), step=2)
    assert read_manifest(tmp_path / "ckpt")["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_lock_held_too_long_fails_with_a_clear_error(tmp_path, monkeypatch):
    """Every wait is bounded: a reader that must settle an interrupted save but cannot get the lock raises a
    CheckpointError naming the locked folder, instead of waiting forever."""
    import gpudist.checkpoint.folders as ck

    _crash_between_renames(tmp_path, new_complete=True)
    real = ck._root_lock
    monkeypatch.setattr(ck, "_root_lock", lambda root: real(root, timeout=0.2))
    with real(tmp_path):
        outcome: list = []

        def read():
            try:
                latest_checkpoint(tmp_path)
            except CheckpointError as e:
                outcome.append(str(e))

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(30)
    assert outcome and f"the checkpoint folder {tmp_path} is still locked after 0.2s" in outcome[0]


def _save_then_load_with(comm, root: str, fail: str):
    """Every rank saves a DDP model; then ``fail`` breaks rank 1's load verification with a KeyError, or rank 0's
    manifest write of a second save with a full disk. Returns each rank's error text (the patch is undone)."""
    import gpudist.checkpoint.format as ck_format
    import gpudist.checkpoint.write as ck_write

    model = DDPModel(_model(0), ShardingConfiguration(comm))
    path = save_checkpoint(f"{root}/ckpt", model, step=1)
    saved = ck_format.Reader.read, ck_write.atomic_write_json
    try:
        if fail == "load" and comm.rank == 1:

            def read(*args, **kwargs):
                raise KeyError("step")

            ck_format.Reader.read = read
        if fail == "save" and comm.rank == 0:

            def write(*args, **kwargs):
                raise OSError(28, "No space left on device")

            ck_write.atomic_write_json = write
        try:
            if fail == "load":
                load_checkpoint(path, model)
            else:
                save_checkpoint(path, model, step=2)
        except CheckpointError as e:
            return str(e)
        return "no error"
    finally:
        ck_format.Reader.read, ck_write.atomic_write_json = saved


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


# -- a partial load (issue 23, item 7) ---------------------------------------------------------------------------------


class _WithEmpty(nn.Module):
    """A zero-size parameter between two layers: no FSDP shard owns an element of it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.empty = nn.Parameter(torch.zeros(0, 5))
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.empty.sum()


def _x(step: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(step))


def _fsdp_save(comm, path: str):
    torch.manual_seed(0)
    config = ShardingConfiguration(comm)
    model = FSDPModel(_WithEmpty(), config)
    opt = ZeRO3Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(2):
        model(_x(step).chunk(comm.world_size)[comm.rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(path, model, opt, step=2)
    return model.gather_full_parameters()


def _plain_after_one_step(seed: int, opt_cls=torch.optim.AdamW):
    torch.manual_seed(seed)
    net = _WithEmpty()
    opt = opt_cls(net.parameters(), lr=1e-2)
    net(_x(9)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return net, opt


def test_fsdp_checkpoint_with_a_zero_size_parameter_loads_into_a_plain_module(tmp_path):
    """An FSDP checkpoint of a model with a zero-size parameter (no shard holds its `step`) loads into a plain module
    and AdamW: every parameter as saved, and the zero-size one's state gets its group's step. Catches the load that
    overwrote the parameters and then raised KeyError: 'step' from torch's loader."""
    saved = run_ranks(_fsdp_save, 2, "inmemory", path=str(tmp_path / "ckpt"))[0]
    net, opt = _plain_after_one_step(seed=1)
    load_checkpoint(tmp_path / "ckpt", net, opt)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in net.parameters()]), saved)
    assert {float(opt.state[p]["step"]) for p in net.parameters()} == {2.0}
    assert opt.state[net.empty]["exp_avg"].shape == (0, 5)
    net(_x(2)).pow(2).mean().backward()
    opt.step()  # and training goes on


class AdamW(torch.optim.AdamW):
    """Named like the saved class, but its loader refuses every state (as torch's does a malformed one)."""

    def __setstate__(self, state):
        super().__setstate__(state)
        if state.get("state"):
            raise ValueError("this state does not suit me")


def test_an_optimizer_load_that_fails_changes_nothing(tmp_path):
    """When the optimizer's own loader refuses the checkpoint's state, load_checkpoint raises a CheckpointError and
    neither the parameters nor the optimizer's state changed. Catches the parameters copied before the optimizer
    state was built and tried (a partial load), and torch's loader failing after it had dropped the old state."""
    run_ranks(_fsdp_save, 2, "inmemory", path=str(tmp_path / "ckpt"))
    net, opt = _plain_after_one_step(seed=1, opt_cls=AdamW)
    params = [p.detach().clone() for p in net.parameters()]
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in net.parameters()}
    groups, state_map = opt.param_groups, opt.state
    with pytest.raises(CheckpointError, match="does not suit me"):
        load_checkpoint(tmp_path / "ckpt", net, opt)
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters(), strict=True)), "parameters changed"
    assert opt.param_groups is groups and opt.state is state_map
    for p in net.parameters():
        assert opt.state[p].keys() == state[p].keys() and all(
            torch.equal(opt.state[p][k], state[p][k]) for k in state[p]
        )


def test_snapshot_frame_loads_as_snapshot_state_does_and_rejects_damage():
    """A buddy-mirror frame (snapshot_frame: one copy per piece into a reused buffer) must load exactly what
    snapshot_state's bytes load: parameters, AdamW moments, step counts, the step and extra. Catches a frame whose
    tensors are misplaced or misaligned, a reused ``out`` buffer that keeps the previous step's values, and a damaged
    frame loaded silently."""
    from gpudist.checkpoint import frame_length, frame_snapshot, load_snapshots, snapshot_frame, snapshot_state

    torch.manual_seed(0)

    def trained(steps: int):
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=False))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(steps):
            model(torch.randn(4, 5)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = trained(2)
    frame = snapshot_frame(model, opt, step=2, extra={"live": {"samples_seen": 8}}, capacity=1 << 16)
    assert frame.numel() == 1 << 16 and frame_length(frame) < frame.numel()
    model(torch.randn(4, 5)).square().sum().backward()  # step 3, written into the same buffer
    opt.step()
    again = snapshot_frame(model, opt, step=3, extra={"live": {"samples_seen": 12}}, out=frame)
    assert again is frame
    for blob in (frame_snapshot(again), snapshot_state(model, opt, step=3, extra={"live": {"samples_seen": 12}})):
        fresh, fresh_opt = trained(0)
        info = load_snapshots([blob], fresh, fresh_opt)
        assert info.step == 3 and info.extra == {"live": {"samples_seen": 12}}
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b)
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
            s, t = opt.state[p], fresh_opt.state[q]
            assert torch.equal(s["exp_avg"], t["exp_avg"]) and torch.equal(s["exp_avg_sq"], t["exp_avg_sq"])
            assert float(s["step"]) == float(t["step"]) == 3
    damaged = again.clone()
    damaged[20:40] = ord("#")
    with pytest.raises(CheckpointError, match="snapshot frame is damaged"):
        frame_snapshot(damaged)
