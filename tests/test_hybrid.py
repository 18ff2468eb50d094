"""HybridShardedModel + HybridShardedOptimizer (3D: pipeline x data x tensor) against single-process training.

Tolerance: the layouts differ from one process only in summation order (tensor-parallel matmuls and all-reduces,
micro-batch and replica sums), which Adam turns into update noise where a gradient is a near-cancelling sum. Every
result (parameters, losses, the clipping norm) is compared with single-process training in float64, within a
multiple of the float32 single-process run's own error (tests/tolerances.py). A wrong gradient moves parameters by
about the learning rate (1e-2); SGD catches a constant factor that Adam would normalise away.
"""

from __future__ import annotations

import pytest
import torch

from examples.lm import as_sequential, lm_loss, tinylm_plan
from gpudist import HybridShardedModel, HybridShardedOptimizer, ShardingConfiguration
from gpudist.testing import run_ranks

from .helpers import (
    HYBRID_STEPS,
    hybrid_batch,
    hybrid_check,
    hybrid_lm,
    hybrid_optimizer,
    hybrid_train,
)
from .tolerances import assert_matches_reference, reference_pair


@pytest.mark.parametrize(("zero_stage", "kind"), [(0, "sgd"), (1, "adamw"), (2, "adamw")])
def test_3d_2x2x2_matches_single_process(zero_stage, kind):
    """pp=2 x dp=2 x tp=2 on 8 in-memory ranks (TinyLM with its head tied to the embedding, heads and MLP split,
    vocabulary-parallel loss), with DDP, ZeRO-1 and ZeRO-2 in the data group: parameters gathered on every rank
    and the loss equal one process on the global batch. Catches gradient sync in the wrong order or group (a
    replica average over the tensor group, tied embedding/head not summed across the first and last stage with
    the same tensor rank), each replica reading the wrong slice, and ZeRO sharding over the wrong group."""
    hybrid_check(run_ranks(hybrid_train, 8, "inmemory", zero_stage=zero_stage, kind=kind), kind, 8)


@pytest.mark.parametrize(("pp", "tp"), [(1, 2), (2, 1)])
def test_3d_on_gloo(pp, tp):
    """1x2x2 (dp x tp) and 2x1x2 (pp x dp) over 4 Gloo processes, GPipe for the second: the same parity."""
    schedule = "gpipe" if pp == 2 else "1f1b"
    hybrid_check(run_ranks(hybrid_train, 4, "gloo", pp=pp, tp=tp, schedule=schedule), "adamw", 4)


def clipped_reference(max_grad_norm: float, dtype=torch.float32) -> tuple[torch.Tensor, list[float], float]:
    """SGD on one process with clip_grad_norm_; also the last step's gradient norm (before clipping)."""
    net = hybrid_lm().to(dtype)
    opt = hybrid_optimizer(net.parameters(), "sgd")
    losses, norm = [], None
    for step in range(HYBRID_STEPS):
        x, y = hybrid_batch(step)
        loss = lm_loss(net(x), y)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach(), losses, norm


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_3d_2x2x2_clips_to_the_global_gradient_norm(zero_stage):
    """max_grad_norm at 2x2x2 (in memory) with DDP and ZeRO-2 in the data group equals clip_grad_norm_ on one
    process over the global batch, with a limit small enough that every step clips, and SGD (Adam would hide
    the scale). Catches a norm over this rank's gradients only (each stage and tensor rank would clip by a
    different factor), a tensor-replicated parameter (LayerNorms, biases) counted once per tensor rank, the tied
    embedding/head counted on both stages, DDP's equal replicas all counted, and a norm taken before the replica
    average (the replicas' local norms are larger than their average's)."""
    (params32, losses32, norm32), (params64, losses64, norm64) = reference_pair(clipped_reference, 0.05)
    assert norm64 > 0.5  # the limit clips every step by a large factor
    results = run_ranks(hybrid_train, 8, "inmemory", zero_stage=zero_stage, kind="sgd", max_grad_norm=0.05)
    for params, losses, norm in results:
        assert_matches_reference(params, params32, params64, what="parameters")
        assert_matches_reference(losses, losses32, losses64, what="losses")
        assert_matches_reference([norm], [norm32], [norm64], what="gradient norm")


def bad_layouts(comm):
    config = ShardingConfiguration(comm)
    errors = []
    for call in (
        lambda: HybridShardedModel(hybrid_lm(), config, 3, 2, plan=tinylm_plan, blocks=as_sequential),
        lambda: HybridShardedModel(hybrid_lm(), config, 2, 2, 3, plan=tinylm_plan, blocks=as_sequential),
        lambda: HybridShardedModel(hybrid_lm(), config, 1, 2),
        lambda: HybridShardedModel(hybrid_lm(), config, 2, 1),
    ):
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        errors.append(str(info.value))
    model = HybridShardedModel(hybrid_lm(), config, 2, 2, plan=tinylm_plan, blocks=as_sequential)
    with pytest.raises(ValueError) as info:
        HybridShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config, 1, 2)
    errors.append(str(info.value))
    return errors


def test_bad_layouts_name_every_factor():
    """A product that does not match the world size names every factor; tensor parallelism without a plan,
    a non-sequential module without blocks=, and an optimizer with another layout than the model's are refused."""
    errors = run_ranks(bad_layouts, 4, "inmemory")[0]
    assert "pp(3) * tp(2) = 6 does not divide world_size(4)" in errors[0]
    assert "pp(2) * dp(3) * tp(2) = 12 != world_size(4)" in errors[1]
    assert "tensor_parallel_size=2 needs a plan" in errors[2]
    assert "pass blocks=" in errors[3]
    assert "pp=1 x dp=2 x tp=2 = 4 ranks differs from the model's pp=2 x dp=1 x tp=2 = 4 ranks" in errors[4]
