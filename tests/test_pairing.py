"""How a model wrapper and its optimizer pair up: named explicitly (``Optimizer(inner, model)``) or found through the
configuration both were built from (``Optimizer(inner, config)``, the idiom of the README's loop).

Both forms must give bit-identical training (the same code runs once paired); pairing must never make an optimizer
reduce gradients the model already reduced, and the model's memory report must count its own optimizer's state.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpudist
from gpudist import ShardingConfiguration
from gpudist.strategies import DATA_PARALLEL_PAIRS
from gpudist.testing import run_ranks

from .helpers import OPTIMIZERS, STAGES, STEPS, batch, fresh_net, initial_state

PAIRS = {0: DATA_PARALLEL_PAIRS["ddp"], **STAGES}


def train(comm, state, stage, explicit):
    config = ShardingConfiguration(comm, bucket_cap_mb=0.0001, first_bucket_mb=0.00002)
    model_cls, opt_cls = PAIRS[stage]
    model = model_cls(fresh_net(state), config)
    cls, kw = OPTIMIZERS["adamw"]
    if explicit:  # named pairing must not depend on the configuration's lookup: take the model out of it
        config._models.discard(model)
    opt = opt_cls(cls(model.parameters(), **kw), model if explicit else config)
    for step in range(STEPS):
        x, y = batch(step, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {
        "params": model.gather_full_parameters(),
        "bytes": model.last_step_bytes,
        "paired": opt.model() is model,
        "reported": model.memory_per_rank()["optimizer_state"],
        "state_bytes": opt.state_bytes(),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_explicit_pairing_trains_exactly_as_config_pairing(stage):
    """Catches an optimizer that does not recognise a model handed to it explicitly: it would reduce the gradients
    a second time (DDP/ZeRO-1: a different average; ZeRO-2/3: no full gradients left to reduce), so the parameters
    would differ from the config-paired run, which is itself checked against single-process training in
    tests/test_zero.py. Also catches a model whose memory report misses its paired optimizer's state."""
    state = initial_state()
    named = run_ranks(train, 2, "inmemory", state=state, stage=stage, explicit=True)
    found = run_ranks(train, 2, "inmemory", state=state, stage=stage, explicit=False)
    for a, b in zip(named, found, strict=True):
        assert a["paired"] and b["paired"]
        assert torch.equal(a["params"], b["params"])
        assert a["bytes"] == b["bytes"]
        assert a["reported"] == a["state_bytes"] > 0


def pair_with_foreign_parameters(comm):
    config = ShardingConfiguration(comm)
    model = gpudist.ZeRO2Model(torch.nn.Linear(4, 3), config)
    other = torch.nn.Linear(4, 3)
    gpudist.ZeRO2Optimizer(torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1), model)


def test_explicit_pairing_rejects_parameters_the_model_does_not_hold():
    """Catches an optimizer built over another module's parameters and paired with a model by mistake: it would step
    gradients nobody reduced. The error names the first foreign parameter's index and the fix."""
    with pytest.raises(gpudist.testing.RanksFailedError, match=r"2 parameter\(s\).*first at index 2.*model.parameters"):
        run_ranks(pair_with_foreign_parameters, 1, "inmemory")


def test_optimizer_rejects_what_is_neither_a_config_nor_a_model():
    """Catches a bad second argument reaching the strategy code (an AttributeError deep inside) instead of a clear
    error naming both accepted kinds."""
    with pytest.raises(TypeError, match="ShardingConfiguration or the ShardedModel"):
        gpudist.DDPOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), object())
