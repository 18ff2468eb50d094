"""ElasticOptimizer and asynchronous checkpoints: resume at another world size, crash safety, torchrun elastic.

Parity with uninterrupted training is against the elastic job's single-process training in float64, within a
multiple of the float32 run's own error (tests/tolerances.py): the world sizes differ only in summation order.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

import gpudist
from gpudist import read_manifest
from gpudist.checkpoint import CheckpointWrite, remove_stale_staging
from gpudist.elastic import elastic_classes
from gpudist.testing import elastic_job, free_port, run_ranks

from .helpers_elastic import reference
from .tolerances import assert_matches_reference, reference_pair

ROOT = Path(__file__).resolve().parents[1]


def _train(comm, root: str, until: int, every: int, zero_stage: int, finish: bool, lr_scaling=None):
    """Train the elastic job's model from the newest checkpoint under ``root`` up to step ``until``."""
    config = gpudist.ShardingConfiguration(comm)
    model = elastic_classes(zero_stage)[0](elastic_job.build_model(), config)
    opt = gpudist.ElasticOptimizer(
        elastic_job.make_optimizer(model.parameters()),
        config,
        Path(root),
        every,
        zero_stage=zero_stage,
        batch_size=elastic_job.GLOBAL_BATCH // comm.world_size,
        lr_scaling=lr_scaling,
        base_world_size=3 if lr_scaling else None,
    )
    start, lr = opt.step_count, opt.param_groups[0]["lr"]
    world, rank = comm.world_size, comm.rank
    while opt.step_count < until:
        x, y = elastic_job.batch(opt.step_count)
        nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    if finish:
        opt.finish()
    flat = model.gather_full_parameters()
    return start, flat, opt.history, opt.samples_seen, lr


@pytest.mark.faults
def test_restart_falls_back_to_an_older_checkpoint_when_the_newest_is_damaged(tmp_path):
    """Catches a restart that keeps failing on a damaged newest checkpoint (a rank file corrupted after it was
    committed) although an older intact one is kept: it must resume from the older one, on every rank, and say so."""
    from gpudist.checkpoint import complete_checkpoints

    run_ranks(_train, 2, "inmemory", root=str(tmp_path), until=7, every=3, zero_stage=1, finish=False)
    newest, older = complete_checkpoints(tmp_path)[:2]
    rank_file = next(newest.glob("rank-*.safetensors"))
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit flip: the manifest still passes, the file's checksum does not
    rank_file.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="skipping .* cannot be loaded"):
        results = run_ranks(_train, 2, "inmemory", root=str(tmp_path), until=7, every=3, zero_stage=1, finish=False)
    assert [start for start, *_ in results] == [read_manifest(older)["step"]] * 2


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_resume_at_other_world_sizes_equals_uninterrupted_training(tmp_path, zero_stage):
    """3 ranks train 7 steps (checkpoints at 3 and 6) and stop without finishing, as a crash would; 2 ranks resume from
    step 6 and train to 12; 3 ranks resume from 12 to 15. The result must equal single-process training for 15 steps, so
    no step was lost or applied twice and the AdamW state (sharded by ZeRO at stages 1-2, the parameters too at stage 3)
    was resharded 3 -> 2 -> 3 correctly. Catches resuming from a checkpoint that is not the newest, a step counter off
    by one, optimizer state dropped or misplaced on resharding, and samples_seen/history not carried over."""
    root = str(tmp_path / "ckpt")
    first = run_ranks(_train, 3, "inmemory", root=root, until=7, every=3, zero_stage=zero_stage, finish=False)
    assert first[0][0] == 0
    second = run_ranks(_train, 2, "inmemory", root=root, until=12, every=3, zero_stage=zero_stage, finish=True)
    assert [s[0] for s in second] == [6, 6]  # the newest committed checkpoint: step 6 (7's step was never saved)
    third = run_ranks(_train, 3, "inmemory", root=root, until=15, every=3, zero_stage=zero_stage, finish=True)
    assert [s[0] for s in third] == [12, 12, 12]
    expected = reference_pair(reference, 15)
    for _, flat, history, samples, _ in third:
        assert_matches_reference(flat, *expected)
        assert history == [[0, 3], [6, 2], [12, 3]]
        assert samples == 15 * elastic_job.GLOBAL_BATCH
    assert sorted(p.name for p in Path(root).iterdir()) == ["step-000000012", "step-000000015"]  # keep=2


def test_learning_rate_follows_the_world_size(tmp_path):
    """lr_scaling='linear' with base_world_size=3 gives lr x 2/3 on 2 ranks and the base lr back on 3 after a
    resume (the base lr comes from the checkpoint, not from the scaled value saved in the param groups). Catches
    scaling applied twice across restarts."""
    root = str(tmp_path / "ckpt")
    run_ranks(_train, 2, "inmemory", root=root, until=3, every=3, zero_stage=0, finish=True, lr_scaling="linear")
    again = run_ranks(
        _train, 2, "inmemory", root=root, until=4, every=3, zero_stage=0, finish=True, lr_scaling="linear"
    )
    assert again[0][4] == pytest.approx(0.01 * 2 / 3)
    back = run_ranks(_train, 3, "inmemory", root=root, until=5, every=3, zero_stage=0, finish=True, lr_scaling="linear")
    assert back[0][4] == pytest.approx(0.01)


def _write_then_fail(comm, root: str, failing_rank: int):
    model = gpudist.DDPModel(elastic_job.build_model(), gpudist.ShardingConfiguration(comm))
    gpudist.save_checkpoint(Path(root) / "good", model, step=1)
    pending = CheckpointWrite(Path(root) / "good", model, step=2, background=True)
    if comm.rank == failing_rank:
        pending.error = OSError("disk full (injected)")
    try:
        pending.wait()
    except gpudist.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.faults
def test_a_failed_write_on_one_rank_keeps_the_previous_checkpoint(tmp_path):
    """One rank's file cannot be written: every rank gets a CheckpointError naming it, and the checkpoint of the
    same name from before stays complete and loadable. Catches a commit that goes ahead with a missing file."""
    root = tmp_path / "ckpt"
    errors = run_ranks(_write_then_fail, 2, "inmemory", root=str(root), failing_rank=1)
    assert all(e is not None and "rank 1 failed" in e and "disk full" in e for e in errors)
    assert gpudist.read_manifest(root / "good")["step"] == 1
    assert gpudist.latest_checkpoint(root) == root / "good"


def _crash_during_save(comm, root: str):
    model = gpudist.DDPModel(elastic_job.build_model(), gpudist.ShardingConfiguration(comm))
    gpudist.save_checkpoint(Path(root) / "step-1", model, step=1)
    CheckpointWrite(Path(root) / "step-2", model, step=2, background=True)._thread.join()  # files, no commit
    return None


@pytest.mark.faults
def test_an_uncommitted_save_is_never_loaded(tmp_path):
    """A save whose files were written but that was never committed (the job died before the next step) is not a
    checkpoint: latest_checkpoint still returns the one before, and remove_stale_staging clears the leftovers.
    Catches a writer that publishes its folder before every rank's file and the manifest exist."""
    root = tmp_path / "ckpt"
    run_ranks(_crash_during_save, 2, "inmemory", root=str(root))
    assert gpudist.latest_checkpoint(root) == root / "step-1"
    assert len(remove_stale_staging(root)) == 1
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]


_BAD = {
    "every": {"checkpoint_every": 0},
    "scaling": {"lr_scaling": "cubic"},
    "stage": {"zero_stage": 4},
    "model": {},
    "plain-zero3": {"zero_stage": 3},
    "zero3-stage1": {"zero_stage": 1},
}


def _bad(comm, case: str, root: str):
    config = gpudist.ShardingConfiguration(comm)
    module = gpudist.ZeRO3Model(nn.Linear(4, 2), config) if case == "zero3-stage1" else nn.Linear(4, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    gpudist.ElasticOptimizer(opt, config, root, model=None if case == "model" else module, **_BAD[case])


@pytest.mark.parametrize(
    "case,message",
    [
        ("every", "checkpoint_every=0"),
        ("scaling", "lr_scaling='cubic'"),
        ("stage", r"zero_stage=4; use 0 .* or 3 \(ZeRO-3\)"),
        ("model", "needs the model it checkpoints"),
        ("plain-zero3", "zero_stage=3 with a Linear: .* build the model as ZeRO3Model"),
        ("zero3-stage1", "zero_stage=1 with a ZeRO3Model: .* build the model as DDPModel"),
    ],
)
def test_bad_input_is_refused(tmp_path, case, message):
    """Bad settings raise an error naming the value and the fix, before anything is read or written. Catches a
    ZeRO-3 model stepped by a stage-0-2 optimizer (it would treat the shards as whole parameters) or a ZeRO-3
    optimizer over an unsharded model, refused only later or with a message naming neither."""
    with pytest.raises(gpudist.testing.RanksFailedError, match=message):
        run_ranks(_bad, 1, "inmemory", case=case, root=str(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# Real torchrun elastic launch: 3 agents of one worker each; one is killed; a new one joins.


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_torchrun_elastic_kill_one_of_three_then_scale_back_up(tmp_path):
    """Three torchrun agents (one worker each, --nnodes=2:3) train with checkpoints every 4 steps; one node is
    killed mid-training, the other two restart at world size 2 from the newest checkpoint and go on; a new node
    joins, and all three finish. The final model must equal single-process training on the same global batches,
    so no step was applied twice or lost, and each restart redoes at most checkpoint_every + 1 steps. Catches
    stale rendezvous state between rounds, resuming from an incomplete checkpoint, and resharding errors."""
    steps, every = 40, 4
    root = tmp_path / "run"
    root.mkdir()
    logs = [tmp_path / f"agent{i}.log" for i in range(4)]
    port = free_port()
    launch = functools.partial(elastic_job.launch_agent, port, root, steps=steps, every=every, sleep=0.15, cwd=ROOT)
    status = functools.partial(elastic_job.read_status, root)
    agents = [launch(logs[0])]
    # The first agent must host the rendezvous store (it is never killed): the others start once it listens, however
    # long its start takes on a loaded machine (a fixed 1 s head start let another agent win the port when slow).
    elastic_job.wait_for(lambda: _listening(port), "the first agent's rendezvous store", agents, logs, limit=120)
    agents += [launch(logs[i]) for i in (1, 2)]
    try:
        elastic_job.wait_for(
            lambda: any(s["event"] == "step" and s["world"] == 3 and s["step"] >= 10 for s in status()),
            "10 steps at world size 3",
            agents,
            logs,
        )
        elastic_job.kill_node(agents[2])
        killed_at = max(s["step"] for s in status())
        elastic_job.wait_for(
            lambda: any(s["event"] == "step" and s["world"] == 2 and s["step"] >= killed_at + 6 for s in status()),
            "6 steps at world size 2",
            agents,
            logs,
        )
        agents.append(launch(logs[3]))
        survivors = [a for i, a in enumerate(agents) if i != 2]
        elastic_job.wait_for(
            lambda: all(a.poll() is not None for a in survivors), "the agents to finish", agents, logs, limit=150
        )
        codes = [a.returncode for a in survivors]
        assert codes == [0, 0, 0], "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    final = torch.load(root / "final.pt")
    assert_matches_reference(final["params"], *reference_pair(reference, steps))
    worlds = [w for _, w in final["history"]]
    assert worlds[0] == 3 and 2 in worlds and worlds[-1] == 3, final["history"]
    # Steps redone after each restart: the last step reached before it minus the step it resumed from.
    events = status()
    for i, e in enumerate(events):
        if e["event"] == "start" and i > 0:
            reached = max(s["step"] for s in events[:i] if s["event"] == "step")
            assert 0 <= reached - e["step"] <= every + 1, (reached, e)
    assert final["samples_seen"] == steps * elastic_job.GLOBAL_BATCH


def _scheduler_then_load(comm, root: str):
    config = gpudist.ShardingConfiguration(comm)
    first = nn.Linear(4, 2)
    opt = gpudist.DDPOptimizer(torch.optim.SGD(first.parameters(), lr=1.0, momentum=0.9), config)
    first(torch.ones(1, 4)).sum().backward()
    opt.step()
    gpudist.save_checkpoint(Path(root) / "c", first, opt, step=1)
    second = nn.Linear(4, 2)
    opt2 = gpudist.DDPOptimizer(torch.optim.SGD(second.parameters(), lr=1.0, momentum=0.9), config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5**s)
    gpudist.load_checkpoint(Path(root) / "c", second, opt2)
    opt2.step()
    sched.step()
    inner = opt2.optimizer
    return (
        inner.param_groups[0]["lr"],
        inner.param_groups is opt2.param_groups,
        inner.state is opt2.state,
        len(inner.state),
    )


def test_scheduler_built_before_a_load_still_drives_the_optimizer(tmp_path):
    """torch's load_state_dict replaces the optimizer's param_groups and state objects; the loader must keep them,
    or an LR scheduler built before load_checkpoint (as the elastic example does) sets lr in dicts nobody reads
    and wrappers lose the momentum buffers. Catches that disconnection."""
    lr, same_groups, same_state, entries = run_ranks(_scheduler_then_load, 1, "inmemory", root=str(tmp_path))[0]
    assert lr == 0.5 and same_groups and same_state and entries == 2
