"""Checkpoint folders of the pipeline, tensor-parallel and hybrid (pp x dp x tp) models: resuming in the same layout
is bit-identical to not stopping; loading into another layout or strategy gives the saved full parameters and
optimizer state; every canonical element is written once; damaged or foreign checkpoints are refused.

All cases train examples/lm.py's TinyLM (tied embedding and head, replicated LayerNorms and position embedding,
rowwise ``proj``/``out`` weights, a fused ``qkv`` split in 3 chunks) with AdamW, against one unsharded process:
in float64, within a multiple of the float32 run's own error (tests/tolerances.py), since the layouts differ from
it only in summation order."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import gpudist
from examples.lm import TinyLM, as_sequential, lm_loss, tinylm_plan
from gpudist import (
    CheckpointError,
    DDPModel,
    DDPOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
    PipelineParallelModel,
    ShardingConfiguration,
    TensorParallelModel,
    load_checkpoint,
    save_checkpoint,
)
from gpudist.testing import run_ranks

from .helpers import hybrid_batch
from .placement import run_checked
from .tolerances import assert_matches_reference, reference_pair


def net(seed: int = 0, n_layers: int = 2) -> TinyLM:
    return TinyLM(32, 16, n_layers=n_layers, n_heads=2, seq_len=8, seed=seed)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def build(
    comm, kind: str, seed: int = 0, pp: int = 1, tp: int = 1, zero: int = 0, n_layers: int = 2, seq: bool = False
):
    """``kind`` ("module", "ddp", "pipeline", "tensor", "hybrid") around TinyLM(seed), with its AdamW. A plain
    pipeline splits ``as_sequential(TinyLM)``, whose parameters are named "0.tok.weight", ...: ``seq`` gives a module
    or DDP model the same names (the hybrid model keeps TinyLM's through its ``blocks`` argument)."""
    module = as_sequential(net(seed, n_layers)) if seq else net(seed, n_layers)
    if kind == "module":
        return module, adamw(module.parameters())
    config = ShardingConfiguration(comm)
    if kind == "ddp":
        model = DDPModel(module, config)
        return model, DDPOptimizer(adamw(model.parameters()), config)
    if kind == "pipeline":  # the documented usage: a plain optimizer over this stage's parameters
        blocks = module if seq else as_sequential(module)
        model = PipelineParallelModel(blocks, config, num_stages=pp, micro_batches=2)
        return model, adamw(model.parameters())
    if kind == "tensor":  # the same, over this rank's shards
        model = TensorParallelModel(module, config, tinylm_plan, tensor_parallel_size=tp)
        return model, adamw(model.parameters())
    model = HybridShardedModel(
        module, config, pp, tp, plan=tinylm_plan if tp > 1 else None, blocks=as_sequential, micro_batches=2
    )
    return model, HybridShardedOptimizer(adamw(model.parameters()), config, pp, tp, zero_stage=zero)


def train(model, opt, kind: str, steps: range) -> None:
    """Steps of the global batch ``hybrid_batch(step)`` (12 sequences): each data-parallel replica takes its slice."""
    for step in steps:
        x, y = hybrid_batch(step, 12)
        if kind == "module":
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            continue
        dp = model.world_size if kind == "ddp" else model.data_parallel_size
        d = model.rank if kind == "ddp" else model.data_parallel_rank
        n = x.shape[0] // dp
        x, y = x[d * n : (d + 1) * n], y[d * n : (d + 1) * n]
        model.train_step(
            x, y, None if kind in ("tensor", "hybrid") and model.tensor_parallel_size > 1 else lm_loss, opt
        )


def full(model) -> torch.Tensor:
    if isinstance(model, gpudist.ShardedModel):
        return model.gather_full_parameters().cpu()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def reference(steps: int, dtype=torch.float32) -> torch.Tensor:
    module = net().to(dtype)
    opt = adamw(module.parameters())
    train(module, opt, "module", range(steps))
    return full(module)


def written_once(path) -> dict[str, int]:
    """Checks the manifest lists every element of every parameter and Adam moment exactly once over all files
    (overlaps would double the sums) and at most 3 entries per tensor and file (the rows of a rowwise shard are
    one strided entry, not one each); returns the number of strided entries and the files' total bytes."""
    body = gpudist.read_manifest(path)
    numel = {row["name"]: torch.Size(row["shape"]).numel() for row in body["parameters"]}
    totals: dict[tuple[str, str], int] = {}
    strided = 0
    for entry in body["files"]:
        per_tensor: dict[tuple[str, str], int] = {}
        for kind, name, _, n, *runs in entry["pieces"]:
            totals[(kind, name)] = totals.get((kind, name), 0) + n * (runs[0] if runs else 1)
            per_tensor[(kind, name)] = per_tensor.get((kind, name), 0) + 1
            strided += bool(runs)
        assert max(per_tensor.values()) <= 3, per_tensor
    kinds = {k for k, _ in totals}
    assert kinds == {"param", "state.exp_avg", "state.exp_avg_sq"}, kinds
    for kind in kinds:
        assert {name: totals.get((kind, name)) for name in numel} == numel, kind
    return {"strided": strided, "bytes": sum(entry["bytes"] for entry in body["files"])}


# ---------------------------------------------------------------------------------------------------- same layout


def resume(comm, kind, path, **kw):
    """2 steps, save, 2 more; then a fresh (differently initialized) model and optimizer load and do the same 2."""
    model, opt = build(comm, kind, **kw)
    train(model, opt, kind, range(2))
    save_checkpoint(path, model, opt, step=2)
    train(model, opt, kind, range(2, 4))
    model2, opt2 = build(comm, kind, seed=1, **kw)
    info = load_checkpoint(path, model2, opt2)
    train(model2, opt2, kind, range(info.step, 4))
    return full(model), full(model2)


SAME = {  # name: (kind, world, build arguments)
    "pipeline-2": ("pipeline", 2, {"pp": 2}),
    "tensor-tp2-dp2": ("tensor", 4, {"tp": 2}),
    "hybrid-pp2-tp2-zero0": ("hybrid", 4, {"pp": 2, "tp": 2, "zero": 0}),
    "hybrid-pp2-dp2-tp2-zero2": ("hybrid", 8, {"pp": 2, "tp": 2, "zero": 2}),
}


@pytest.mark.parametrize("case", list(SAME))
def test_resume_in_the_same_layout_is_bit_identical(tmp_path, case):
    """Catches a piece loaded into the wrong place or not at all (a rowwise weight's rows, a tied head on the last
    stage, a replicated LayerNorm on tensor rank 1, a ZeRO-2 replica's Adam moments, the step count), and any
    element written twice or never (the manifest's per-parameter totals must equal the parameter sizes: replicas,
    tensor ranks holding a LayerNorm and stages sharing the embedding must not each write it)."""
    kind, world, kw = SAME[case]
    path = tmp_path / "ckpt"
    for uninterrupted, resumed in run_ranks(resume, world, "inmemory", kind=kind, path=path, **kw):
        assert torch.equal(uninterrupted, resumed)
    stats = written_once(path)
    assert (stats["strided"] > 0) == (kw.get("tp", 1) > 1), stats  # rowwise rows (and qkv chunks) when split
    data = 3 * 4 * sum(p.numel() for p in net().parameters())  # parameters and 2 Adam moments, fp32
    assert data < stats["bytes"] < data + 40_000, stats  # safetensors headers only: nothing written twice


# ---------------------------------------------------------------------------------------------------- resharding


def save_after(comm, kind, path, steps, **kw):
    model, opt = build(comm, kind, **kw)
    train(model, opt, kind, range(steps))
    save_checkpoint(path, model, opt, step=steps)
    return full(model)


def load_and_continue(comm, kind, path, steps, **kw):
    model, opt = build(comm, kind, seed=1, **kw)
    info = load_checkpoint(path, model, opt)
    loaded = full(model)
    train(model, opt, kind, range(info.step, steps))
    return loaded, full(model)


CASES = [  # (saved by, world, kwargs), (loaded into, world, kwargs)
    (("hybrid", 4, {"pp": 2, "tp": 2, "zero": 0}), ("ddp", 3, {})),
    (("hybrid", 4, {"pp": 2, "tp": 2, "zero": 2}), ("module", 1, {})),
    (("module", 1, {"seq": True}), ("pipeline", 2, {"pp": 2})),
    (("pipeline", 3, {"pp": 3}), ("ddp", 3, {"seq": True})),
    (("ddp", 2, {}), ("hybrid", 4, {"pp": 2, "tp": 2, "zero": 1})),
    (("tensor", 2, {"tp": 2}), ("tensor", 4, {"tp": 2})),
    (("hybrid", 4, {"pp": 2, "zero": 2}), ("tensor", 2, {"tp": 2})),
]


@pytest.mark.parametrize(("saved", "loaded"), CASES, ids=lambda c: f"{c[0]}{c[1]}")
def test_load_into_another_layout(tmp_path, saved, loaded):
    """Catches resharding errors between layouts: a rowwise split's rows read from the wrong offsets, a chunked
    qkv's blocks swapped, a tied or replicated parameter read from a copy that was never written, Adam moments
    or the step count left behind when the optimizer class changes wrapper (ZeRO-2 inside a data group -> plain
    torch AdamW, DDP -> ZeRO-1). The loaded parameters must equal the saved model's exactly, and one more step
    must match unsharded training."""
    (kind, n, kw), (kind2, m, kw2) = saved, loaded
    path = tmp_path / "ckpt"
    at_save = run_ranks(save_after, n, "inmemory", kind=kind, path=path, steps=2, **kw)[0]
    want = reference_pair(reference, 3)
    for params, final in run_ranks(load_and_continue, m, "inmemory", kind=kind2, path=path, steps=3, **kw2):
        assert torch.equal(params, at_save)
        assert_matches_reference(final, *want)
    written_once(path)


def test_hybrid_checkpoint_over_gloo(tmp_path):
    """Catches a save that works only when ranks share memory (threads): a 2-stage hybrid model with ZeRO-1 on 2
    Gloo processes saves; one unwrapped process loads it and continues like unsharded training."""
    path = str(tmp_path / "ckpt")
    at_save = run_ranks(save_after, 2, "gloo", kind="hybrid", path=path, steps=2, pp=2, zero=1)[0]
    [(params, final)] = run_ranks(load_and_continue, 1, "inmemory", kind="module", path=path, steps=3)
    assert torch.equal(params, at_save)
    assert_matches_reference(final, *reference_pair(reference, 3))


# ---------------------------------------------------------------------------------------------------- bad input


def try_load(comm, path, kind="hybrid", n_layers=2, **kw):
    model, opt = build(comm, kind, seed=1, n_layers=n_layers, **kw)
    before = full(model)
    state = json.dumps({k: str(v) for k, v in opt.state_dict().items()}, sort_keys=True)
    error = None
    try:
        load_checkpoint(path, model, opt)
    except CheckpointError as e:
        error = str(e)
    after = json.dumps({k: str(v) for k, v in opt.state_dict().items()}, sort_keys=True)
    return error, torch.equal(before, full(model)) and state == after


def test_damaged_or_foreign_checkpoint_is_refused(tmp_path):
    """Catches a tensor-parallel or pipeline load that skips the checks: a checkpoint of another architecture
    (3 blocks) must be refused by name, and a bit flip in one rank's file must leave every rank unchanged (rank 0
    never reads the file with the flip, but must refuse because another rank did)."""
    path = tmp_path / "ckpt"
    run_ranks(save_after, 2, "inmemory", kind="tensor", path=path, steps=1, tp=2, n_layers=3)
    for error, unchanged in run_ranks(try_load, 4, "inmemory", path=path, pp=2, tp=2):
        assert "does not match the model" in error and "blocks.2" in error and unchanged
    run_ranks(save_after, 2, "inmemory", kind="tensor", path=path, steps=1, tp=2)
    raw = bytearray((path / "rank-00001.safetensors").read_bytes())
    raw[-5] ^= 0x08
    (path / "rank-00001.safetensors").write_bytes(bytes(raw))
    results = run_ranks(try_load, 4, "inmemory", path=path, pp=2, tp=2)
    assert all(error is not None and unchanged for error, unchanged in results), results
    assert any("SHA-256 does not match" in error for error, _ in results)


# ---------------------------------------------------------------------------------------------------- full state


def export(comm, path, kind, pp, tp, twin_pp):
    model, opt = build(comm, kind, pp=pp, tp=tp)
    train(model, opt, kind, range(1))
    model.save_model(path / "model.safetensors")
    state = model.full_state_dict()
    twin, _ = build(comm, kind, seed=1, pp=twin_pp)
    twin.load_model(path / "model.safetensors")
    return full(model), {k: v.cpu() for k, v in state.items()}, full(twin)


@pytest.mark.parametrize(("world", "kind", "pp", "tp", "twin_pp"), [(3, "pipeline", 3, 1, 1), (4, "hybrid", 2, 2, 4)])
def test_pipeline_full_state_dict_and_export(tmp_path, world, kind, pp, tp, twin_pp):
    """Catches a pipeline's full_state_dict that misses another stage's parameters, the tied head's second name,
    a tensor-parallel shard instead of the full matrix, or differs between ranks: the exported file loads into the
    unsharded module (strict load_state_dict) with the saved parameters, and into a pipeline of another depth."""
    results = run_ranks(export, world, "inmemory", path=tmp_path, kind=kind, pp=pp, tp=tp, twin_pp=twin_pp)
    plain = as_sequential(net(seed=1)) if kind == "pipeline" else net(seed=1)
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"))
    for params, state, reloaded in results:
        assert torch.equal(full(plain), params) and torch.equal(reloaded, params)
        assert state.keys() == plain.state_dict().keys()
        assert all(torch.equal(v, plain.state_dict()[k]) for k, v in state.items())


_BN = torch.nn.Sequential(
    torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)
)


def bn_save(comm, path):
    model = PipelineParallelModel(copy.deepcopy(_BN), ShardingConfiguration(comm), num_stages=2, micro_batches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(model.data_parallel_rank)  # each replica its batch
    model.train_step(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g), torch.nn.functional.mse_loss, opt)
    save_checkpoint(path, model, opt, step=1)
    return {k: v.cpu() for k, v in model.full_state_dict().items()}


def test_pipeline_buffers_are_saved_by_their_stage(tmp_path):
    """Catches a pipeline checkpoint that saves only rank 0's stage's buffers (BatchNorm statistics of later
    stages lost), under stage-local names, or once per replica: 2 stages x 2 replicas save, an unwrapped module
    loads every buffer and parameter as the first replica's full_state_dict holds them."""
    path = tmp_path / "bn"
    state = run_ranks(bn_save, 4, "inmemory", path=path)[0]
    body = gpudist.read_manifest(path)
    listed = [p[1] for f in body["files"] for p in f["pieces"] if p[0] == "buffer"]
    assert sorted(listed) == sorted(n for n, _ in _BN.named_buffers())  # each once, under its full name
    plain = copy.deepcopy(_BN)
    load_checkpoint(path, plain)
    assert all(torch.equal(v, state[k]) for k, v in plain.state_dict().items())
    assert not torch.equal(plain[3].running_mean, _BN[3].running_mean)  # the second stage's statistics moved


def save_load_export(comm, path):
    resume(comm, "hybrid", path / "ckpt", pp=2, tp=2, zero=2)
    export(comm, path, "hybrid", 2, 2, twin_pp=4)


def test_no_host_tensor_reaches_the_backend(tmp_path):
    """Catches checkpoint or full_state_dict code that makes a tensor without ``device=`` and hands it to a
    collective (tests/placement.py puts such tensors on ``meta``): NCCL would refuse it on a GPU job."""
    run_ranks(run_checked, 4, "inmemory", body=save_load_export, kwargs={"path": tmp_path})
