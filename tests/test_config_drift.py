"""Settings that differ between ranks are refused at wrap time, naming the setting, before any step's traffic.

The steps' collectives run without a per-op cross-rank check (layouts agree by construction; on NCCL a check is an
all-gather and a host sync per op), so everything that shapes them is compared once, when the model is wrapped. On
Gloo a size mismatch inside an unchecked op aborts the process (SIGABRT, "Received data size doesn't match expected
size"): these tests catch a setting left out of the wrap-time comparison.
"""

from __future__ import annotations

import pytest
import torch

import gpudist
from gpudist import ShardingConfiguration
from gpudist.strategies import DATA_PARALLEL_PAIRS
from gpudist.testing import RanksFailedError, run_ranks

from .helpers import fresh_net, initial_state

pytestmark = pytest.mark.faults

DRIFTS = {
    "communication_dtype": torch.bfloat16,
    "bucket_cap_mb": 0.0001,
    "first_bucket_mb": 0.00002,
    "gradient_as_bucket_view": False,
    "max_grad_norm": 1.0,
}


def wrap_with_drift(comm, state, strategy, setting):
    """Rank 1 changes one setting; every rank wraps the same model."""
    kwargs = {setting: DRIFTS[setting]} if comm.rank == 1 else {}
    model_cls, _ = DATA_PARALLEL_PAIRS[strategy]
    model_cls(fresh_net(state), ShardingConfiguration(comm, **kwargs))


@pytest.mark.parametrize("setting", list(DRIFTS))
@pytest.mark.parametrize("strategy", list(DATA_PARALLEL_PAIRS))
def test_a_setting_that_differs_between_ranks_is_named_at_wrap_time(strategy, setting):
    """Catches a traffic-shaping setting missing from the wrap-time comparison: the ranks would build different
    buckets, wire dtypes or reductions and the first step would mismatch (abort, hang or silently diverge)."""
    with pytest.raises(RanksFailedError, match=rf"has {setting}=.* but rank \d has"):
        run_ranks(wrap_with_drift, 2, "inmemory", state=initial_state(), strategy=strategy, setting=setting)


def test_communication_dtype_drift_on_gloo_raises_instead_of_aborting():
    """The case seen abort a Gloo process (SIGABRT in gloo::EnforceNotMet): one rank with a bf16 wire. Both ranks
    raise a ValueError naming communication_dtype; no process dies."""
    with pytest.raises(RanksFailedError, match=r"communication_dtype=") as failure:
        run_ranks(wrap_with_drift, 2, "gloo", state=initial_state(), strategy="ddp", setting="communication_dtype")
    assert "ValueError" in str(failure.value)


def pipeline_with_micro_batches(comm):
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(2)))
    micro = 2 if comm.rank == 0 else 4
    gpudist.PipelineParallelModel(blocks, ShardingConfiguration(comm), micro_batches=micro)


def test_pipeline_micro_batches_that_differ_are_named():
    """Catches ranks of one pipeline with different micro-batch counts: the stages would exchange different numbers
    of messages and fail inside the user's loss or hang, instead of naming micro_batches."""
    with pytest.raises(RanksFailedError, match=r"has micro_batches=\d but rank \d has \d"):
        run_ranks(pipeline_with_micro_batches, 2, "inmemory")
