"""Hugging Face models under the data-parallel strategies ZeRO-3/FSDP's file does not cover (DDP, ZeRO-1, ZeRO-2,
gradient compression) and under the 3D hybrid with the model's own tensor-parallel plan, each against one process on
the global batch, in float32 and float64; and checkpoints that move between strategies under the model's own names.

Parity uses tests/tolerances.py: single-process training in float64, within a multiple of the float32 run's own error
(for float64 runs, that bound scaled down to float64's unit roundoff).
"""

from __future__ import annotations

import pytest
import torch

import gpudist
from gpudist import GradientCompressionOptimizer, ShardingConfiguration
from gpudist.strategies import DATA_PARALLEL_PAIRS
from gpudist.testing import run_ranks

from .helpers import flat
from .hf_models import HF_MODELS, hf_loss, hf_single_process, requires_transformers, token_batch
from .tolerances import assert_matches_reference, reference_bound, reference_pair, unit_roundoff

pytestmark = requires_transformers

STEPS = 3
STRATEGIES = ["ddp", "zero1", "zero2", "compression"]


@pytest.fixture(autouse=True, scope="module")
def _templates():
    """Build the models on the main thread first (the ranks are threads that copy them)."""
    for build in HF_MODELS.values():
        build()


def train(comm, name: str, strategy: str, dtype=torch.float32, save: str | None = None) -> torch.Tensor:
    config = ShardingConfiguration(comm, bucket_cap_mb=0.05)  # several buckets
    model_cls, opt_cls = DATA_PARALLEL_PAIRS["ddp" if strategy == "compression" else strategy]
    model = model_cls(HF_MODELS[name](dtype), config)
    model.train()
    opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    if strategy == "compression":  # top-k of every element: lossless, so it must train as DDP does
        opt = GradientCompressionOptimizer(opt, config, "topk:1.0")
    for step in range(STEPS):
        hf_loss(model, token_batch(step, comm.rank, comm.world_size)).backward()
        opt.step()
        opt.zero_grad()
    if save is not None:
        gpudist.save_checkpoint(save, model, opt, step=STEPS)
    return model.gather_full_parameters()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_models_train_like_one_process(name, strategy):
    """Catches an HF model that a data-parallel strategy cannot drive or trains differently: a tied embedding/head
    averaged twice or in the wrong bucket, keyword inputs (``input_ids=``, ``labels=``) lost by the wrapper, an output
    object the wrapper does not pass through, GQA's repeated key/value heads' gradients. 2 ranks, 3 AdamW steps."""
    expected = reference_pair(hf_single_process, name)
    for params in run_ranks(train, 2, "inmemory", name=name, strategy=strategy):
        assert_matches_reference(params, *expected, what=f"{name} under {strategy}")


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_hf_model_trains_in_float64(strategy):
    """Catches a float64 HF model trained at float32 precision anywhere (a bucket, the optimizer state)."""
    ref32, ref64 = reference_pair(hf_single_process, "llama-gqa")
    bound = reference_bound(ref32, ref64) * unit_roundoff(torch.float64) / unit_roundoff(torch.float32)
    for params in run_ranks(train, 2, "inmemory", name="llama-gqa", strategy=strategy, dtype=torch.float64):
        assert params.dtype == torch.float64
        assert float((params - ref64).abs().max()) <= bound


def _hybrid(comm, dtype):
    config = ShardingConfiguration(comm)
    model = gpudist.HybridShardedModel(HF_MODELS["llama-gqa"](dtype), config, 2, 2, 2, plan="auto", micro_batches=2)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    opt = gpudist.HybridShardedOptimizer(inner, config, 2, 2, 2, zero_stage=1)
    loss_fn = lambda logits, labels: model.cross_entropy(logits[:, :-1], labels[:, 1:])  # HF's shifted loss
    d = model.data_parallel_rank
    for step in range(STEPS):
        ids = token_batch(step, d, model.data_parallel_size)
        model.train_step({"input_ids": ids}, ids, loss_fn, opt)
    return model.gather_full_parameters()


def test_hf_llama_under_3d_hybrid_with_its_own_plan():
    """Catches the pieces of the HF path failing together: the pipeline adapter's stages, the config's tensor-parallel
    plan (grouped-query attention split by heads), ZeRO-1 over the replicas. 2 stages x 2 replicas x 2 tensor ranks
    against one process on the global batch."""
    expected = reference_pair(hf_single_process, "llama-gqa")
    for params in run_ranks(_hybrid, 8, "inmemory", dtype=torch.float32):
        assert_matches_reference(params, *expected, what="llama under pp2 x dp2 x tp2")


def _load(comm, name: str, strategy: str, path: str) -> torch.Tensor:
    config = ShardingConfiguration(comm)
    model_cls, opt_cls = DATA_PARALLEL_PAIRS[strategy]
    model = model_cls(HF_MODELS[name](), config)
    opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    gpudist.load_checkpoint(path, model, opt)
    return model.gather_full_parameters()


@pytest.mark.parametrize(("saved", "loaded"), [("ddp", "zero3"), ("zero2", "fsdp")])
def test_hf_checkpoint_moves_between_strategies_under_the_models_names(tmp_path, saved, loaded):
    """Catches a checkpoint tied to the strategy that wrote it: saved by one strategy at 2 ranks, it loads into
    another at 3 ranks and into the plain HF model (by the model's own parameter names), with equal values."""
    path = str(tmp_path / "ckpt")
    trained = run_ranks(train, 2, "inmemory", name="llama-tied", strategy=saved, save=path)[0]
    for params in run_ranks(_load, 3, "inmemory", name="llama-tied", strategy=loaded, path=path):
        assert torch.equal(params, trained)
    net = HF_MODELS["llama-tied"]()
    gpudist.load_checkpoint(path, net, torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1))
    assert torch.equal(flat(net), trained)
    names = {entry["name"] for entry in gpudist.read_manifest(path)["parameters"]}
    assert names == {n for n, _ in net.named_parameters()}
