"""Sharded checkpoints: save with one strategy at world size N, load with another at M, continue, and match an
uninterrupted run; damaged or mismatched checkpoints refused with nothing changed in memory.

"Match" is tests/test_zero.py's tolerance: single-process training in float64, within a multiple of the float32
run's own error (the strategies differ from it only in summation order); loaded parameters must be bit-identical.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import gpudist
from examples.lm import lm_loss
from gpudist import CheckpointError, DDPModel, DDPOptimizer, ShardingConfiguration, load_checkpoint, save_checkpoint
from gpudist.strategies import DATA_PARALLEL_PAIRS
from gpudist.testing import RanksFailedError, run_ranks

from .helpers import (
    OPTIMIZERS,
    STAGES,
    flat,
    fresh_net,
    initial_state,
    lm_batch,
    optimizer_kw,
    reference_kw,
    single_process,
    tiny_lm,
    train_steps,
)
from .tolerances import assert_matches_reference, reference_pair

PAIRS = {**STAGES, "ddp": DATA_PARALLEL_PAIRS["ddp"]}


def build(comm, state, stage, opt_name, seed_shift=0.0):
    config = ShardingConfiguration(comm)
    net = fresh_net(state)
    if seed_shift:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(seed_shift)  # a different starting point: loading must overwrite every element
    model_cls, opt_cls = PAIRS[stage]
    model = model_cls(net, config)
    return model, opt_cls(OPTIMIZERS[opt_name][0](model.parameters(), **optimizer_kw(opt_name)), config)


def save_after(comm, state, path, stage, opt_name, steps):
    model, opt = build(comm, state, stage, opt_name)
    train_steps(model, opt, steps, comm.rank, comm.world_size)
    save_checkpoint(path, model, opt, step=steps, extra={"data_position": steps * 12})
    return model.gather_full_parameters()


def load_and_continue(comm, state, path, stage, opt_name, steps):
    model, opt = build(comm, state, stage, opt_name, seed_shift=0.5)
    lr = opt.param_groups[0]["lr"]
    if isinstance(lr, torch.Tensor):
        lr.fill_(123.0)  # a tensor learning rate is filled in place (a captured graph reads this one)
    info = load_checkpoint(path, model, opt)
    if isinstance(lr, torch.Tensor):
        assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(OPTIMIZERS[opt_name][1]["lr"])
    assert info.extra == {"data_position": info.step * 12}
    loaded = model.gather_full_parameters()
    train_steps(model, opt, steps, comm.rank, comm.world_size, start=info.step)
    return loaded, model.gather_full_parameters()


CASES = [  # (saved by, at N, loaded into, at M, optimizer)
    (3, 4, 2, 2, "adam"),
    (3, 4, "ddp", 3, "adam"),
    (1, 2, 3, 3, "sgd"),
    ("ddp", 2, "fsdp", 4, "adamw"),
    (2, 3, 1, 2, "rmsprop"),  # no fused kernel: the wrapped optimizer's per-view state, resharded
    ("fsdp", 3, 3, 1, "rmsprop"),
    (2, 2, 3, 3, "adamw-capturable-tensor-lr"),  # step counts on the device, a tensor learning rate
]


@pytest.mark.parametrize(("saved", "n", "loaded", "m", "opt_name"), CASES)
def test_resharded_checkpoint_continues_like_an_uninterrupted_run(tmp_path, saved, n, loaded, m, opt_name):
    """Catches optimizer state or parameters put at the wrong offsets when shards change (world size and strategy
    differ between save and load), a lost step count (Adam's bias correction), and pieces missing from the files:
    5 steps, save, load elsewhere, 5 more steps must equal 10 uninterrupted single-process steps."""
    state = initial_state()
    path = tmp_path / "ckpt"
    at_save = run_ranks(save_after, n, "inmemory", state=state, path=path, stage=saved, opt_name=opt_name, steps=5)
    results = run_ranks(
        load_and_continue, m, "inmemory", state=state, path=path, stage=loaded, opt_name=opt_name, steps=10
    )
    expected = reference_pair(single_process, state, OPTIMIZERS[opt_name][0], **reference_kw(opt_name))
    for loaded_params, final in results:
        assert torch.equal(loaded_params, at_save[0])
        assert_matches_reference(final, *expected)
    manifest = gpudist.read_manifest(path)
    assert manifest["world_size"] == n and len(manifest["files"]) == n and manifest["step"] == 5
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json"] + [f"rank-{r:05d}.safetensors" for r in range(n)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folders left behind"


@pytest.mark.parametrize(
    ("saved_with", "loaded_with"),
    [("adamw", "adamw-capturable-tensor-lr"), ("adamw-capturable-tensor-lr", "adamw")],
    ids=["host-to-device", "device-to-host"],
)
def test_step_counts_move_between_host_and_device_through_a_checkpoint(tmp_path, saved_with, loaded_with):
    """AdamW's step counts saved by a ZeRO-2 optimizer that keeps them on the host load into a ZeRO-1 one built with
    ``capturable=True`` (counts and a tensor learning rate on the device), and back: 5 steps, save, load, 5 more
    equal 10 uninterrupted single-process steps. Catches a count (Adam's bias correction) or learning rate lost or
    misread when it changes sides, or a tensor learning rate saved as something a number cannot load."""
    state = initial_state()
    path = tmp_path / "ckpt"
    run_ranks(save_after, 2, "inmemory", state=state, path=path, stage=2, opt_name=saved_with, steps=5)
    results = run_ranks(load_and_continue, 2, "inmemory", state=state, path=path, stage=1, opt_name=loaded_with,
                        steps=10)  # fmt: skip
    expected = reference_pair(single_process, state, torch.optim.AdamW, **reference_kw("adamw"))
    for _, final in results:
        assert_matches_reference(final, *expected)


@pytest.mark.slow
def test_resharded_checkpoint_over_gloo(tmp_path):
    """Catches a save that only works when ranks share memory (threads): ZeRO-3 on 2 Gloo processes, DDP on 3."""
    state = initial_state()
    path = str(tmp_path / "ckpt")
    run_ranks(save_after, 2, "gloo", state=state, path=path, stage=3, opt_name="adam", steps=5)
    results = run_ranks(load_and_continue, 3, "gloo", state=state, path=path, stage="ddp", opt_name="adam", steps=10)
    expected = reference_pair(single_process, state, torch.optim.Adam, lr=1e-2)
    for _, final in results:
        assert_matches_reference(final, *expected)


def test_plain_module_and_torch_optimizer_roundtrip(tmp_path):
    """Catches the unwrapped path (no gpudist wrapper, no backend): a plain module and torch optimizer save and load
    into ZeRO-2 at 2 ranks."""
    state = initial_state()
    net = fresh_net(state)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    train_steps(net, opt, 5)
    save_checkpoint(tmp_path / "plain", net, opt, step=5, extra={"data_position": 60})
    results = run_ranks(
        load_and_continue, 2, "inmemory", state=state, path=tmp_path / "plain", stage=2, opt_name="adam", steps=10
    )
    expected = reference_pair(single_process, state, torch.optim.Adam, lr=1e-2)
    for _, final in results:
        assert_matches_reference(final, *expected)


def try_load(comm, state, path, stage="ddp", opt_name="adam", model_kw=None):
    model, opt = build(comm, state, stage, opt_name, seed_shift=0.5)
    before = model.gather_full_parameters().clone()
    opt_before = json.dumps({k: str(v) for k, v in opt.state_dict().items()}, sort_keys=True)
    try:
        load_checkpoint(path, model, opt)
        error = None
    except CheckpointError as e:
        error = str(e)
    unchanged = torch.equal(model.gather_full_parameters(), before) and opt_before == json.dumps(
        {k: str(v) for k, v in opt.state_dict().items()}, sort_keys=True
    )
    return error, unchanged


@pytest.fixture
def saved(tmp_path):
    state = initial_state()
    path = tmp_path / "ckpt"
    run_ranks(save_after, 2, "inmemory", state=state, path=path, stage=3, opt_name="adam", steps=2)
    return state, path


def damage(path, how):
    if how == "truncated":
        f = path / "rank-00001.safetensors"
        f.write_bytes(f.read_bytes()[:-100])
    elif how == "bit flip":
        f = path / "rank-00001.safetensors"
        raw = bytearray(f.read_bytes())
        raw[-5] ^= 0x08
        f.write_bytes(bytes(raw))
    elif how == "missing file":
        (path / "rank-00001.safetensors").unlink()
    elif how == "manifest edited":
        doc = json.loads((path / "manifest.json").read_text())
        doc["body"]["step"] = 99
        (path / "manifest.json").write_text(json.dumps(doc))
    elif how == "no manifest":
        (path / "manifest.json").unlink()


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", "truncated"),
        ("bit flip", "SHA-256 does not match"),
        ("missing file", "is missing"),
        ("manifest edited", "checksum does not match its content"),
        ("no manifest", "no checkpoint"),
    ],
)
@pytest.mark.faults
@pytest.mark.parametrize("stage", ["ddp", 3])
def test_damaged_checkpoint_is_refused_and_nothing_changes(saved, how, message, stage):
    """Catches a damaged checkpoint loading silently, or loading half way (some tensors or some ranks changed).
    With ZeRO-3 at 2 ranks, rank 0 never reads rank 1's file: it must still refuse because rank 1 did."""
    state, path = saved
    damage(path, how)
    results = run_ranks(try_load, 2, "inmemory", state=state, path=path, stage=stage)
    for rank, (error, unchanged) in enumerate(results):
        assert error is not None and unchanged, (rank, error)
    assert any(message in error for error, _ in results), [e for e, _ in results]


@pytest.mark.faults
def test_mismatched_checkpoint_is_refused(saved, tmp_path):
    """Catches loading into another architecture or another optimizer class (state that does not fit)."""
    state, path = saved
    results = run_ranks(try_load, 2, "inmemory", state=state, path=path, stage=2, opt_name="sgd")
    assert all("holds Adam state" in e and unchanged for e, unchanged in results)

    def other_model(comm):
        config = ShardingConfiguration(comm)
        model = DDPModel(torch.nn.Linear(7, 5), config)
        try:
            load_checkpoint(path, model)
        except CheckpointError as e:
            return str(e)

    assert all("does not match the model" in e for e in run_ranks(other_model, 2, "inmemory"))


@pytest.mark.faults
def test_interrupted_save_leaves_the_previous_checkpoint(saved, tmp_path):
    """Catches a save that overwrites in place: a crash half way must leave the previous checkpoint loadable and
    never be picked as the latest."""
    state, path = saved
    shutil.copytree(path, tmp_path / ".ckpt.tmp-crashed")  # what a save killed before its rename leaves
    (tmp_path / ".ckpt.tmp-crashed" / "manifest.json").unlink()
    assert gpudist.latest_checkpoint(tmp_path) == path
    results = run_ranks(load_and_continue, 2, "inmemory", state=state, path=path, stage=3, opt_name="adam", steps=3)
    assert len(results) == 2
    with pytest.raises(RanksFailedError, match="extra must be JSON"):
        run_ranks(
            lambda comm: save_checkpoint(
                path, DDPModel(fresh_net(state), ShardingConfiguration(comm)), extra={"x": object()}
            ),
            1,
            "inmemory",
        )
    assert gpudist.read_manifest(path)["step"] == 2
    assert flat(fresh_net(state)).numel() == sum(
        int(torch.Size(p["shape"]).numel()) for p in gpudist.read_manifest(path)["parameters"]
    )


def lm_run(comm, path, stage, start, stop, save_at=None):
    from gpudist import FSDPModel, ZeRO2Model, ZeRO2Optimizer, ZeRO3Optimizer

    config = ShardingConfiguration(comm)
    model_cls, opt_cls = {2: (ZeRO2Model, ZeRO2Optimizer), "fsdp": (FSDPModel, ZeRO3Optimizer)}[stage]
    model = model_cls(tiny_lm(torch.bfloat16), config)
    opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    if start:
        load_checkpoint(path, model, opt)
    for step in range(start, stop):
        model.train_step(*lm_batch(step, comm.rank, comm.world_size), lm_loss, opt)
        if step + 1 == save_at:
            save_checkpoint(path, model, opt, step=save_at)
    return model.gather_full_parameters()


def test_bf16_training_resumes_from_the_fp32_master(tmp_path):
    """Catches a checkpoint of bf16 training that drops the fp32 master copy (resuming from rounded bf16 values
    changes every later update): ZeRO-2 saves, FSDP resumes, and the result equals the uninterrupted ZeRO-2 run
    bit for bit."""
    path = tmp_path / "bf16"
    uninterrupted = run_ranks(lm_run, 2, "inmemory", path=path, stage=2, start=0, stop=6, save_at=3)
    resumed = run_ranks(lm_run, 2, "inmemory", path=path, stage="fsdp", start=3, stop=6)
    assert "state.master" in {p[0] for f in gpudist.read_manifest(path)["files"] for p in f["pieces"]}
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert torch.equal(a, b)


def test_save_model_to_a_folder_is_a_resharding_checkpoint(tmp_path):
    """Catches save_model/load_model of a sharded strategy writing only this rank's shard or needing the same world
    size: ZeRO-3 at 3 ranks saves a folder, DDP at 2 loads it."""
    state = initial_state()

    def save(comm):
        model, _ = build(comm, state, 3, "adam")
        model.save_model(tmp_path / "model")
        return model.gather_full_parameters()

    def load(comm):
        model, _ = build(comm, state, "ddp", "adam", seed_shift=0.5)
        model.load_model(tmp_path / "model")
        return model.gather_full_parameters()

    saved = run_ranks(save, 3, "inmemory")[0]
    assert gpudist.read_manifest(tmp_path / "model")["optimizer"] is None
    for params in run_ranks(load, 2, "inmemory"):
        assert torch.equal(params, saved)


def _save_plain(comm, state, path, opt_name):
    config = ShardingConfiguration(comm)
    net = fresh_net(state)
    opt_cls = {"ddp": DDPOptimizer, "zero1": gpudist.ZeRO1Optimizer}[opt_name]
    opt = opt_cls(torch.optim.AdamW(net.parameters(), lr=1e-2), config)
    train_steps(net, opt, 2, comm.rank, comm.world_size)
    save_checkpoint(path, net, opt, step=2)
    return flat(net)


@pytest.mark.parametrize("opt_name", ["ddp", "zero1"])
def test_plain_module_with_a_sharded_optimizer_writes_each_element_once(tmp_path, opt_name):
    """An unwrapped module under a DDP/ZeRO-1 optimizer is whole on every rank: the ranks must split its writing.
    Catches every rank writing every parameter (and buffer): the files double, and the load refuses them as
    covering each element twice."""
    state = initial_state()
    saved = run_ranks(_save_plain, 2, "inmemory", state=state, path=tmp_path / "ck", opt_name=opt_name)[0]
    body = gpudist.read_manifest(tmp_path / "ck")
    written = sum(n for f in body["files"] for kind, _, _, n, *_ in f["pieces"] if kind == "param")
    assert written == saved.numel()
    net = fresh_net(state)
    load_checkpoint(tmp_path / "ck", net)
    assert torch.equal(flat(net), saved)
