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
    hook_cells = [c.cell_contents for h in reducer._handles.values() for c in (_hook_of(h).__closure__ or ())]
    assert not any(isinstance(c, nn.Module) for c in hook_cells)


def _hook_of(handle):
    return handle.hooks_dict_ref()[handle.id]


# -- static_graph: one hook per bucket once the order is known ---------------------------------------------------------


class _Layers(nn.Module):
    """Linear layers in a row; the ones in ``skip`` are left out of forward (their parameters get no gradient)."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        g = torch.Generator().manual_seed(0)  # not the global generator, which rank threads share
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.skip: set[int] = set()

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = torch.tanh(layer(x))
        return x


_MODELS = {"ddp": DDPModel, "zero1": ZeRO1Model, "zero2": ZeRO2Model}
_CAP = 0.0004  # MiB: two Linear(8, 8) per bucket


def _train(comm, strategy: str, static: bool, steps: int = 6, set_to_none: bool = True) -> dict:
    config = ShardingConfiguration(comm, bucket_cap_mb=_CAP, first_bucket_mb=_CAP, static_graph=static)
    model = _MODELS[strategy](_Layers(), config)
    opt = gpudist.strategies.DATA_PARALLEL_PAIRS[strategy][1](torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    g = torch.Generator().manual_seed(1 + comm.rank)
    hooks = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        hooks.append(len(model._reducer._handles))
    reducer = model._reducer
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "hooks": hooks,
        "buckets": len(reducer.buckets),
        "thinnable": sorted(b.index for b in reducer.buckets if not b.on_arrival),
        "thinned": sorted(reducer.thinned),
    }


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_static_graph_keeps_one_hook_per_bucket_and_the_same_result(strategy, set_to_none):
    """Catches a static graph that keeps a hook per parameter (no host time saved), thins before two backward
    passes agreed, thins a bucket that has work per gradient, or launches a bucket before its gradients are all
    there (the parameters would differ from the run with a hook per parameter, which is bit-for-bit the same
    arithmetic)."""
    plain = run_ranks(_train, 2, "inmemory", strategy=strategy, static=False, set_to_none=set_to_none)
    static = run_ranks(_train, 2, "inmemory", strategy=strategy, static=True, set_to_none=set_to_none)
    for a, b in zip(plain, static, strict=True):
        assert a["buckets"] > 2 and b["thinnable"] and b["thinned"] == b["thinnable"], b
        params, buckets = len(a["params"]), b["buckets"]
        assert a["hooks"] == [params] * len(a["hooks"])
        # a hook on every parameter through the second backward (the order is learned from two), then one per bucket
        assert b["hooks"] == [params] + [buckets] * (len(b["hooks"]) - 1), b["hooks"]
        for x, y in zip(a["params"], b["params"], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _changed_graph(comm, strategy: str, drop: str) -> str:
    """Three steps with every layer, then one that leaves out the layer holding a bucket's hooked (last) gradient,
    or another of its gradients."""
    config = ShardingConfiguration(
        comm, bucket_cap_mb=_CAP, first_bucket_mb=_CAP, static_graph=True, find_unused_parameters=True
    )
    net = _Layers()
    model = _MODELS[strategy](net, config)
    opt = gpudist.strategies.DATA_PARALLEL_PAIRS[strategy][1](torch.optim.SGD(model.parameters(), lr=0.1), config)
    x = torch.randn(4, 8)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    reducer = model._reducer
    index, last = next((i, j) for (i, j) in reducer._handles if i in reducer.thinned and i > 0)
    bucket = reducer.buckets[index]
    hooked = bucket.params[last]
    other = next(p for p in bucket.params if p is not hooked and not any(p is q for q in net.layers[0].parameters()))
    target = hooked if drop == "hooked" else other
    net.skip = {k for k, layer in enumerate(net.layers) if any(target is p for p in layer.parameters())}
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="static_graph=True") as caught:
        model(x).sum().backward()
    return str(caught.value)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
@pytest.mark.parametrize("drop", ["hooked", "other"])
def test_static_graph_refuses_a_backward_that_changed(strategy, drop):
    """Catches a thinned bucket reduced with a gradient that never came: zeros (or a stale view) would be averaged
    in silently where the hook on its last gradient stands for all of them. Whether the missing gradient is the
    hooked one (seen at the end of backward) or another (seen when the hooked one arrives), the error names
    static_graph and the way out."""
    for message in run_ranks(_changed_graph, 1, "inmemory", strategy=strategy, drop=drop):
        assert "ShardingConfiguration(static_graph=False)" in message, message


def test_a_comm_hook_hooks_every_parameter_again():
    """Catches thinned hooks surviving a change of the buckets' plans: registering a comm hook may give buckets
    work per gradient, so the reducer hooks every parameter again and relearns the order."""
    comm = InMemoryCommunicationBackend(0, 1)
    config = ShardingConfiguration(comm, bucket_cap_mb=_CAP, first_bucket_mb=_CAP, static_graph=True)
    model = DDPModel(_Layers(), config)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(torch.randn(2, 8)).sum().backward()
    params = sum(1 for _ in model.parameters())
    assert model._reducer.thinned and len(model._reducer._handles) < params

    class Average:
        def all_reduce(self, index, data):
            return None

    model.register_comm_hook(Average())
    assert not model._reducer.thinned and len(model._reducer._handles) == params
