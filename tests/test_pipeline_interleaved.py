"""Interleaved 1F1B (issue 26, item 1): ``p x v`` chunks, rank ``r`` holding chunks ``r, r + p, ...``,
activations going round the ranks ``v`` times (rank ``p - 1`` back to rank 0). The schedule's replay (bubble
``(p - 1) / (v m + p - 1)``, below 1F1B's; activations in flight), training parity with one process on the
global batch (in memory, with replicas, a tied embedding, over the simulated in-order NCCL, Gloo, changing
shapes), a Hugging Face Llama through its adapter with checkpoints under its own names, and the errors.

Parity tolerance: as tests/test_pipeline.py, a multiple of the float32 single-process run's own distance from the
float64 one (tests/tolerances.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gpudist
from examples.lm import lm_loss
from gpudist import PipelineParallelModel, ShardingConfiguration
from gpudist.strategies.pipeline import schedule_bubble, stage_schedule
from gpudist.testing import run_ranks

from .fakenccl import FakeNccl, run_nccl
from .helpers import check_training, pipeline_reference, pipeline_train, varying_batch
from .helpers_hf_pipeline import STEPS, batch, check_llama_pipeline, llama4
from .helpers_pipeline import construction_errors, deep, lm, lm_batch
from .tolerances import reference_pair


def in_flight_bound(p: int, v: int, rank: int, micro: int) -> int:
    """Megatron-LM's: the warm-up forwards plus the steady state's one, at most every chunk's micro-batches."""
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, micro * v)


# ---------------------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize(("p", "micro", "v"), [(2, 2, 2), (2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (3, 6, 3)])
def test_interleaved_replay_has_the_smaller_bubble_and_bounded_activations(p, micro, v):
    """Every rank runs each (micro-batch, chunk) forward and backward once, the forward first; the replay (forward
    cost 1 and backward 2 per stage, 1/v per chunk) does not deadlock and idles (p-1)/(v m + p - 1) of the step,
    below 1F1B's (p-1)/(m + p - 1); rank r keeps at most 2(p-r-1) + (v-1)p + 1 chunk activations alive. Catches
    a chunk order that breaks the ring's dependencies (the replay raises), one that serialises the rounds (a
    bubble no smaller than 1F1B's), a backward before its forward, and a warm-up that grows."""
    orders = [stage_schedule("interleaved", p, s, micro, v) for s in range(p)]
    everything = sorted((kind, m, c) for kind in "FB" for m in range(micro) for c in range(v))
    for order in orders:
        assert sorted(order) == everything
        assert all(order.index(("F", m, c)) < order.index(("B", m, c)) for _, m, c in everything)
    bubble = schedule_bubble(orders)
    assert bubble == pytest.approx((p - 1) / (v * micro + p - 1))
    assert bubble < schedule_bubble([stage_schedule("1f1b", p, s, micro) for s in range(p)])
    for s, order in enumerate(orders):
        alive = peak = 0
        for kind, _, _ in order:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        assert peak == in_flight_bound(p, v, s, micro)


# ------------------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize(("world", "micro"), [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_interleaved_matches_single_process_training(world, micro):
    """2 and 4 ranks, v=2 (4 and 8 chunks), 4 and 8 micro-batches, 3 Adam steps in memory: parameters and the
    loss on every rank equal one process on the global batch; each rank holds its chunks r and r + p and keeps
    within the in-flight bound. Catches chunks placed contiguously instead of round-robin, an activation from
    rank p-1 not going back to rank 0 (the wrap-around), a chunk's gradient sent to the wrong chunk or
    micro-batch, and the loss taken from a chunk other than the last."""
    want = reference_pair(pipeline_reference, build=deep)
    results = run_ranks(pipeline_train, world, "inmemory", micro=micro, schedule="interleaved", build=deep)
    for rank, (params, losses, peak, blocks) in enumerate(results):
        check_training(params, losses, want)
        assert blocks == [(i * 8 // (2 * world), (i + 1) * 8 // (2 * world)) for i in range(2 * world)]
        assert peak == in_flight_bound(world, 2, rank, micro)


def test_interleaved_with_replicas_and_tied_embedding():
    """2 stages x 2 replicas (world 4) of the 8-block MLP, and TinyLM (embedding tied to the head, which sit on
    chunk 0 of rank 0 and the last chunk of rank 1) on 2 ranks: both equal one process. Catches replicas averaged
    over the wrong group with chunks, and a tied parameter's gradients not summed between the chunks holding it."""
    want = reference_pair(pipeline_reference, build=deep)
    for params, losses, _, _ in run_ranks(
        pipeline_train, 4, "inmemory", stages=2, micro=2, schedule="interleaved", build=deep
    ):
        check_training(params, losses, want)
    want = reference_pair(pipeline_reference, build=lm, batch=lm_batch, loss_fn=lm_loss)
    for params, losses, _, _ in run_ranks(
        pipeline_train, 2, "inmemory", micro=2, schedule="interleaved", build=lm, batch=lm_batch, loss_fn=lm_loss
    ):
        check_training(params, losses, want)


@pytest.mark.parametrize(("world", "micro"), [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_interleaved_over_nccl_matches_one_process(world, micro):
    """Over the simulated NCCL (p2p in issue order: a receive posted before its peer can match it hangs): each
    receive posted when needed with the sends before it, the ring's wrap-around included. Catches a deadlock
    between the last rank's sends to rank 0 and rank 0's receives, and at p=2 (activations and gradients on one
    pair of ranks) receives posted in another order than the peer sends."""
    want = reference_pair(pipeline_reference, build=deep)
    for params, losses, _, _ in run_nccl(
        pipeline_train, world, FakeNccl(timeout=20), micro=micro, schedule="interleaved", build=deep
    ):
        check_training(params, losses, want)


def varying_training(comm, virtual_stages: int = 2):
    config = ShardingConfiguration(comm)
    model = PipelineParallelModel(
        deep(), config, micro_batches=4, schedule="interleaved", virtual_stages=virtual_stages
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        x, y = varying_batch(step)
        losses.append(model.train_step(x, y, F.mse_loss, opt))
        model.predict(x[:3])  # its own shape messages round the ring in between
    return model.gather_full_parameters(), losses


@pytest.mark.parametrize(("backend", "virtual_stages"), [("inmemory", 2), ("gloo", 2), ("nccl", 3)])
def test_interleaved_shape_changes_between_steps(backend, virtual_stages):
    """Batches of 16, 8, 8, 24 with predict() between steps, 2 ranks (Gloo: real processes; simulated NCCL with
    v=3, 6 chunks): each chunk's first activation is posted with last step's spec of that chunk (not on NCCL),
    so each changed spec is met by dummies; training equals one process. Catches the guess of one chunk used for
    another, a receive posted after a guess before the guess is checked (out of order on the peer's stream), a
    step's spec messages read in the wrong group on NCCL, and predict() not going round the ring."""
    want = reference_pair(pipeline_reference, steps=4, build=deep, batch=varying_batch)
    if backend == "nccl":
        results = run_nccl(varying_training, 2, FakeNccl(timeout=20), virtual_stages=virtual_stages)
    else:
        results = run_ranks(varying_training, 2, backend, virtual_stages=virtual_stages)
    for params, losses in results:
        check_training(params, losses, want)


# ------------------------------------------------------------------------------------------------- Hugging Face


def llama_training(comm, save_to: Path):
    model = PipelineParallelModel(llama4(), ShardingConfiguration(comm), micro_batches=4, schedule="interleaved")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = [model.train_step(*batch(step, padded=True), None, opt) for step in range(STEPS)]
    gpudist.save_checkpoint(save_to, model, opt)
    return model.full_state_dict(), losses, model.stage_blocks


def test_hf_llama_interleaved_matches_single_process_and_checkpoints(tmp_path):
    """A tied 4-layer Llama as it is, 2 ranks x 2 chunks of one layer (embedding glue on rank 0's first chunk, norm
    and head on rank 1's last), a left-padded batch: parameters under the model's own names and per-step losses
    equal one process; the checkpoint lists the model's names and loads into the plain model. Catches the glue
    run on every chunk of a rank (the embedding applied twice, the head on rank 1's first chunk), the padding mask
    or rotary inputs lost on the way round the ring, and chunk-prefixed names ("0.layers...") in checkpoints."""
    pytest.importorskip("transformers")
    results = run_ranks(llama_training, 2, "inmemory", save_to=tmp_path / "pipe")
    assert [blocks for _, _, blocks in results] == [[(0, 1), (1, 2), (2, 3), (3, 4)]] * 2
    check_llama_pipeline(results, tmp_path / "pipe")


# ------------------------------------------------------------------------------------------------------------ errors


def test_interleaved_refuses_bad_settings_up_front():
    """micro_batches not a multiple of the stage count (Megatron-LM's requirement: rounds of p micro-batches per
    chunk) is refused at construction naming the fix; so are virtual_stages=1 with interleaved and
    virtual_stages with another schedule. Catches a schedule built anyway (its rounds would not line up and
    a rank would wait for a micro-batch that never comes)."""
    settings = [
        {"micro_batches": 3, "schedule": "interleaved"},
        {"micro_batches": 4, "schedule": "interleaved", "virtual_stages": 1},
        {"micro_batches": 4, "schedule": "1f1b", "virtual_stages": 2},
    ]
    errors = run_ranks(construction_errors, 2, "inmemory", settings=settings)[0]
    assert "micro_batches a multiple of num_stages=2, got micro_batches=3; use 4" in errors[0]
    assert "virtual_stages=1 must be an int >= 2" in errors[1]
    assert "virtual_stages=2 needs schedule='interleaved'" in errors[2]
