"""The composed gradient path: DDP, ZeRO-1 and ZeRO-2 hold one :class:`~gpudist.strategies.reducer.Reducer` with
their own bucket collective, and every strategy ends backward through one mechanism.

The numerical checks of each strategy are in test_ddp.py and test_zero.py; these tests pin the structure that made
them share one path, so a later change cannot quietly fork it again.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import gpudist
from gpudist import DDPModel, ShardingConfiguration, ZeRO1Model, ZeRO2Model
from gpudist.comm import InMemoryCommunicationBackend
from gpudist.strategies.ddp import AllReduceBuckets
from gpudist.strategies.reducer import BucketCollective, EndOfBackward, Reducer
from gpudist.strategies.zero import ReduceScatterBuckets
from gpudist.testing import run_ranks

PACKAGE = Path(gpudist.__file__).parent


def _private_methods(cls: type) -> set[str]:
    return {
        name
        for name, value in vars(cls).items()
        if name.startswith("_")
        and not name.startswith("__")
        and (inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod)))
    }


@pytest.mark.parametrize("cls", [ZeRO1Model, ZeRO2Model])
def test_zero_models_override_no_private_method_of_ddp(cls):
    """Catches the old shape coming back: ZeRO2Model overrode eight of DDPModel's private methods (_launch,
    _arrived, _after_reduce, _reset_step, ...), so a change to DDP's gradient path silently had to be mirrored there.
    Their differences now live in a BucketCollective; the model classes differ by class attributes and public
    methods only."""
    overridden = _private_methods(cls) & {n for k in DDPModel.__mro__ for n in _private_methods(k)}
    assert not overridden, f"{cls.__name__} overrides {sorted(overridden)}"


def test_each_strategy_picks_its_collective():
    """Catches a ZeRO model wired to the wrong gradient path (ZeRO-1 reduce-scattering, ZeRO-2 all-reducing)."""
    assert DDPModel._collective_type is AllReduceBuckets
    assert ZeRO1Model._collective_type is AllReduceBuckets
    assert ZeRO2Model._collective_type is ReduceScatterBuckets
    assert issubclass(AllReduceBuckets, BucketCollective) and issubclass(ReduceScatterBuckets, BucketCollective)


def test_one_end_of_backward_mechanism():
    """Catches a strategy queuing its own autograd callback again (four copies of the queue-once flag existed:
    DDP, FSDP, tensor parallel and the compression hook, each resetting it differently after a failed backward)."""
    sites = [
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if re.search(r"\bqueue_callback\(", path.read_text())
    ]
    assert sites == ["strategies/reducer.py"], sites


def _one_backward(comm, strategy: str) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    config = ShardingConfiguration(comm, bucket_cap_mb=0.00002, first_bucket_mb=0.00002)  # one bucket per tensor
    model = {"ddp": DDPModel, "zero1": ZeRO1Model, "zero2": ZeRO2Model}[strategy](net, config)
    reducer = model._reducer
    queued = []
    launched = []
    launch = reducer.collective.launch

    def spy(bucket, earlier):
        queued.append(reducer.end.queued)
        launched.append(bucket.index)
        return launch(bucket, earlier)

    reducer.collective.launch = spy
    model(torch.randn(3, 4)).sum().backward()
    return {
        "launched": launched,
        "buckets": len(reducer.buckets),
        "queued": queued,
        "after": reducer.end.queued,
        "pending": len(reducer.pending),
    }


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_buckets_launch_in_index_order_inside_one_backward(strategy):
    """Catches buckets launched out of index order (ranks would issue different collectives), a bucket launched
    twice or never, the end-of-backward callback not queued while they launch, or left queued / work left pending
    after it ran."""
    for r in run_ranks(_one_backward, 2, "inmemory", strategy=strategy):
        assert r["buckets"] > 1 and r["launched"] == list(range(r["buckets"])), r
        assert all(r["queued"]) and not r["after"] and r["pending"] == 0, r


def test_end_of_backward_runs_once_per_backward():
    """Catches the callback queued once per hook instead of once per backward, or not re-armed for the next one."""
    runs = []
    end = EndOfBackward(lambda: runs.append(1))
    w = torch.ones(3, requires_grad=True)
    v = torch.ones(3, requires_grad=True)

    def arm(_param: torch.Tensor) -> None:
        end.arm()

    for t in (w, v):
        t.register_post_accumulate_grad_hook(arm)
    for _ in range(2):
        (w * v).sum().backward()
    assert runs == [1, 1] and not end.queued


def test_reducer_is_a_plain_object_with_a_hook_per_parameter():
    """Catches hooks registered per bucket twice, or the reducer keeping a reference cycle through the model
    wrapper (the hooks bind their bucket and slot, not the nn.Module)."""
    comm = InMemoryCommunicationBackend(0, 1)
    model = DDPModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), ShardingConfiguration(comm))
    reducer = model._reducer
    assert isinstance(reducer, Reducer) and not isinstance(reducer, nn.Module)
    assert len(reducer._handles) == sum(1 for p in model.parameters() if p.requires_grad)
    hook_cells = [c.cell_contents for h in reducer._handles for c in (_hook_of(h).__closure__ or ())]
    assert not any(isinstance(c, nn.Module) for c in hook_cells)


def _hook_of(handle):
    return handle.hooks_dict_ref()[handle.id]
