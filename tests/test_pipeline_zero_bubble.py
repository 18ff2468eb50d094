"""Zero-bubble schedules (issue 26): ZB-H1 (``schedule="zero_bubble"``), ZB-V (``"zbv"``) and DualPipe-V
(``"dualpipev"``), whose backwards are split into an input-gradient pass B and a weight-gradient pass W.

The schedule replay (bubble below 1F1B's for the same p and m, at several forward/B/W costs; ZB-H1's
``(p - 1) / (3 m + p - 1)`` and the V's ``(p - 1) / (6 m + p - 1)`` at equal costs; activations alive from F to W
per rank), the split backward itself against one ``backward()``, training parity with one process on the global
batch (in memory, with replicas, a tied embedding, ZB-H1 over the simulated in-order NCCL, in a pipeline x
tensor hybrid), a Hugging Face Llama with checkpoints under its own names, and the errors.

Parity tolerance: as tests/test_pipeline.py, a multiple of the float32 single-process run's own distance from the
float64 one (tests/tolerances.py).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpudist
from examples.lm import lm_loss
from gpudist import PipelineParallelModel, ShardingConfiguration
from gpudist.strategies.pipeline import ALL_SCHEDULES, schedule_bubble, stage_schedule
from gpudist.strategies.pipeline.backward import SplitBackward
from gpudist.strategies.pipeline.executor import exchange_plan, peer_streams
from gpudist.strategies.pipeline.schedule import activations_alive, holder, placement, virtual_stage
from gpudist.testing import run_ranks

from .fakenccl import AsyncRuntime, FakeNccl, count_host_syncs, run_nccl
from .helpers import check_training, global_batch, hybrid_check, hybrid_train, pipeline_reference, pipeline_train
from .helpers_hf_pipeline import STEPS, batch, check_llama_pipeline, llama4
from .helpers_pipeline import construction_errors, deep, lm, lm_batch
from .tolerances import reference_pair

NEW = ("zero_bubble", "zbv", "dualpipev")


def orders_of(schedule: str, p: int, m: int) -> list[list[tuple]]:
    return [stage_schedule(schedule, p, s, m) for s in range(p)]


def alive_peaks(orders: list[list[tuple]]) -> list[int]:
    """Per rank, the most micro-batch activations (of a chunk) alive at once (``activations_alive``)."""
    return [activations_alive(order)[0] for order in orders]


def memory_bound(schedule: str, p: int, m: int) -> int:
    """Chunk activations a rank may hold: ZB-H1 the 1F1B maximum, p (stage 0's, now on every stage, Qi et al.);
    the V holds two half-size chunks per rank, so 2 p is the same memory, and DualPipe-V one chunk more."""
    return {"zero_bubble": min(p, m), "zbv": min(2 * p, 2 * m), "dualpipev": 2 * p + 1}[schedule]


def grid(schedule: str) -> list[tuple[int, int]]:
    return [(p, m) for p in (2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12) if schedule != "dualpipev" or m >= 2 * p]


# ---------------------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("schedule", NEW)
def test_replay_runs_every_op_once_with_a_bubble_below_1f1b_and_bounded_memory(schedule):
    """For p = 2..4 and m = 1..12: every rank runs each (micro-batch, chunk) forward and backward once and each W
    once after its B; the replay does not deadlock; the bubble is below 1F1B's at equal compute for several
    forward/B/W costs; at F = B = W (forward 1, backward 2 of which W is 1) ZB-H1 idles (p-1)/(3m+p-1) for
    m >= p (the paper's (p-1)(T_F + T_B - T_W) per stage), and the V schedules (p-1)/(6m+p-1) for m >= 2p-1 (the
    last rank waits p-1 half-stage forwards before its first op, and nothing else); each rank holds at most
    ``memory_bound`` chunk activations. Catches a W run before its B or twice, a deferred W never run (the
    activation never freed), a V whose turn or chunk order breaks the dependencies, and a schedule that keeps
    more micro-batches alive than 1F1B's memory."""
    where = placement(schedule)
    chunks = (0, 1) if where == "v" else (None,)
    for p, m in grid(schedule):
        orders = orders_of(schedule, p, m)
        for order in orders:
            keys = [op[1:] for op in order]
            for c in chunks:
                for mb in range(m):
                    key = (mb,) if c is None else (mb, c)
                    assert [op[0] for op in order if op[1:] == key] in (["F", "B"], ["F", "B", "W"])
            assert len(keys) == len(order)
        for costs in [(1.0, 2.0, 1.0), (1.0, 2.0, 0.6), (1.0, 1.5, 1.0), (1.0, 3.0, 1.5)]:
            ours = schedule_bubble(orders, *costs, where=where)
            assert ours < schedule_bubble(orders_of("1f1b", p, m), *costs), (p, m, costs)
        equal = schedule_bubble(orders, 1.0, 2.0, 1.0, where=where)
        if schedule == "zero_bubble" and m >= p:
            assert equal == pytest.approx((p - 1) / (3 * m + p - 1))
        if where == "v" and m >= 2 * p - 1:
            assert equal == pytest.approx((p - 1) / (6 * m + p - 1))
        assert max(alive_peaks(orders)) <= memory_bound(schedule, p, m)
        if schedule == "zero_bubble":
            assert alive_peaks(orders) == [min(p, m)] * p


def test_replay_refuses_a_deadlocked_v():
    """A V order where rank 0 runs chunk 1's first forward before chunk 0's: the replay raises instead of
    reporting a bubble. Catches a replay that ignores the V's placement (it would see no dependency)."""
    orders = orders_of("zbv", 2, 4)
    first = orders[0].index(("F", 0, 1))
    orders[0] = [orders[0][first], *orders[0][:first], *orders[0][first + 1 :]]
    with pytest.raises(ValueError, match="deadlock"):
        schedule_bubble(orders, where="v")


# ------------------------------------------------------------------------------------------------- split backward


def _mlp_blocks() -> list[nn.Module]:
    return [nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 4)]


class _Reused(nn.Module):
    """A weight used on both sides of the input's path, and an output computed from a parameter alone."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(4, 4), nn.Linear(4, 4), nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.b(torch.tanh(self.a(x))) * self.scale)))
        return h, self.scale * 2


@pytest.mark.parametrize(("build", "whole"), [(lambda: nn.Sequential(*_mlp_blocks()), False), (_Reused, True)])
def test_split_backward_equals_one_backward(build, whole):
    """The input pass gives the input's gradient and leaves every ``.grad`` untouched; the weight pass then gives
    the parameters' gradients of one ``autograd.grad`` over everything (an MLP: restarted at the boundary nodes;
    a weight used twice around the input's path: the whole-backward fallback, which restarting would double
    count). Catches an input pass that also accumulates weight gradients (the W would add them twice), a weight
    pass that walks on down the input's path (lower layers counted twice), and a missed parameter-only output."""
    torch.manual_seed(0)
    net = build()
    x = torch.randn(3, 4, requires_grad=True)
    outputs = net(x)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    grads = [torch.randn_like(t) for t in outputs]
    params = list(net.parameters())
    want = torch.autograd.grad(outputs, [x, *params], grads, retain_graph=True)
    part = SplitBackward(outputs, grads, [x], params)
    (dx,) = part.input_pass()
    assert part.whole is whole
    assert all(p.grad is None for p in params)
    torch.testing.assert_close(dx, want[0])
    part.weight_pass()
    for p, g in zip(params, want[1:], strict=True):
        torch.testing.assert_close(p.grad, g)


class _Rewired(nn.Module):
    """Builds another graph on each call: ``a`` then ``b``; ``b`` then ``a`` (the same node types, the weights on
    the other boundaries); ``a`` on both sides of the input's path (the whole-backward fallback)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(4, 4), nn.Linear(4, 4), 0

    def forward(self, x):
        first, second = [(self.a, self.b), (self.b, self.a), (self.a, self.a)][self.calls % 3]
        self.calls += 1
        return second(torch.tanh(first(x)))


def test_split_backward_follows_a_graph_that_changes_between_micro_batches():
    """The boundary analysis is cached by the graph's shape; a chunk whose graph changes between micro-batches
    (weights swapped between the same nodes, or one weight used twice) must get the plan of the graph it built.
    Catches a cache keyed on less than the whole shape (the node types, the node count, without the parameters'
    places): a stale plan restarts at a boundary towards the wrong weights (a weight left without its gradient)
    or restarts where the whole backward is needed (a weight counted twice)."""
    torch.manual_seed(0)
    net = _Rewired()
    params = list(net.parameters())
    for call in range(6):
        x = torch.randn(3, 4, requires_grad=True)
        (out,) = outputs = [net(x)]
        grads = [torch.randn_like(out)]
        want = torch.autograd.grad(outputs, [x, *params], grads, retain_graph=True, allow_unused=True)
        part = SplitBackward(outputs, grads, [x], params)
        (dx,) = part.input_pass()
        assert part.whole is (call % 3 == 2)
        torch.testing.assert_close(dx, want[0])
        part.weight_pass()
        for p, g in zip(params, want[1:], strict=True):
            torch.testing.assert_close(p.grad, g)
            p.grad = None


# ------------------------------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("schedule", NEW)
@pytest.mark.parametrize(("world", "micro"), [(2, 4), (4, 8)])
def test_matches_single_process_training(schedule, world, micro):
    """2 and 4 ranks, 3 Adam steps of the 8-block MLP in memory (gradients accumulated over the micro-batches):
    parameters and the loss on every rank equal one process on the global batch; the V places chunks r and
    2p-1-r on rank r; each rank keeps exactly the activations the schedule's replay says. Catches a W never run
    or run twice (a missing or doubled weight gradient), a deferred W computed from a later micro-batch's graph, a
    V's activation sent the wrong way or its turn on rank p-1 lost, and the loss read on the wrong rank."""
    want = reference_pair(pipeline_reference, build=deep)
    results = run_ranks(pipeline_train, world, "inmemory", micro=micro, schedule=schedule, build=deep)
    v = 2 if schedule != "zero_bubble" else 1
    counts = [8 // (world * v)] * (world * v)
    spans = [(sum(counts[:u]), sum(counts[: u + 1])) for u in range(world * v)]
    for params, losses, _, blocks in results:
        check_training(params, losses, want)
        assert blocks == spans
    assert [r[2] for r in results] == alive_peaks(orders_of(schedule, world, micro))


@pytest.mark.parametrize("schedule", NEW)
def test_with_replicas_and_tied_embedding(schedule):
    """2 stages x 2 replicas (world 4), and TinyLM (embedding tied to the head) on 2 ranks: both equal one
    process. In the V the embedding (chunk 0) and the head (chunk 1) both sit on rank 0, so the tied weight gets
    both chunks' gradients there. Catches replicas averaged over the wrong group, a W's gradient landing after
    the replica average, and the tied weight's two gradients not both accumulated."""
    want = reference_pair(pipeline_reference, build=deep)
    for params, losses, _, _ in run_ranks(
        pipeline_train, 4, "inmemory", stages=2, micro=4, schedule=schedule, build=deep
    ):
        check_training(params, losses, want)
    want = reference_pair(pipeline_reference, build=lm, batch=lm_batch, loss_fn=lm_loss)
    for params, losses, _, _ in run_ranks(
        pipeline_train, 2, "inmemory", micro=4, schedule=schedule, build=lm, batch=lm_batch, loss_fn=lm_loss
    ):
        check_training(params, losses, want)


def test_zbv_predict_goes_down_and_up_the_v():
    """predict() of an untrained ZB-V model on 2 ranks equals the plain model's output on every rank. Catches
    sends whose direction assumes a ring (chunk 1's activations go to rank r-1) and a prediction broadcast from
    rank p-1 instead of rank 0, which holds the V's last chunk."""
    x = global_batch(0)[0]
    for got in run_ranks(predicting, 2, "inmemory", x=x):
        torch.testing.assert_close(got, deep()(x))


def predicting(comm, x):
    model = PipelineParallelModel(deep(), ShardingConfiguration(comm), micro_batches=4, schedule="zbv")
    return model.predict(x)


@pytest.mark.parametrize("schedule", NEW)
def test_over_nccl_matches_one_process(schedule):
    """ZB-H1, ZB-V and DualPipe-V over the simulated NCCL (p2p in issue order, a send waits for its receive),
    p = 2, 3, 4, one step: equals one process. Catches sends and receives issued in an order some pair of ranks
    does not share (the V's ranks send both ways: posting each receive just before its op deadlocks there), a W
    op given a message, and a receive posted after the op that reads it."""
    want = reference_pair(pipeline_reference, build=deep, steps=1)
    for world, micro in [(2, 4), (3, 8), (4, 8)]:
        fake = FakeNccl(timeout=20)
        results = run_nccl(pipeline_train, world, fake, micro=micro, schedule=schedule, build=deep, steps=1)
        for params, losses, _, _ in results:
            check_training(params, losses, want)


def _spec_reads(schedule: str, p: int) -> list[int]:
    """Per rank, its chunks whose input comes from another rank: each reads that step's spec message on the host."""
    where = placement(schedule)
    reads = [0] * p
    for u in range(1, 2 * p):
        (r, _), (before, _) = holder(where, p, u), holder(where, p, u - 1)
        reads[r] += r != before
    return reads


def v_on_a_device(comm, schedule):
    model = PipelineParallelModel(deep(), ShardingConfiguration(comm), micro_batches=8, schedule=schedule)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        with count_host_syncs() as syncs:
            losses.append(model.train_step(*global_batch(step), F.mse_loss, opt))
    return model.gather_full_parameters(), losses, syncs.total


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_on_an_asynchronous_device_reads_only_its_spec_messages(schedule):
    """ZB-V and DualPipe-V on 3 ranks over the simulated NCCL on a GPU-like device (ops run only when waited for;
    buffers checked while in flight): 3 steps equal one process, and a steady-state step's host syncs are the spec
    messages a rank reads (one per chunk fed by another rank: 1 on the end ranks, 2 on the middle one, as
    interleaved; the 1F1B budget of tests/test_gpu_model.py, 1, holds at p = 2). Catches an activation read before
    its receive ran, a send buffer reused while in flight, and any other host sync added to the V's step."""
    want = reference_pair(pipeline_reference, build=deep)
    fake = FakeNccl(timeout=30)
    results = run_nccl(v_on_a_device, 3, fake, runtime=AsyncRuntime, schedule=schedule)
    assert fake.stream_errors == []
    for params, losses, _ in results:
        check_training(params, losses, want)
    assert [syncs for _, _, syncs in results] == _spec_reads(schedule, 3)


def _issue_in_order(schedule: str, p: int, m: int) -> bool:
    """Whether every rank can issue :func:`exchange_plan`'s groups where a group's sends complete only once taken
    and its receives only once sent (NCCL, as tests/fakenccl.py), the executor's way: a group per op, cut before
    a chunk's first activation (its spec message is read first). Each message carries its stream item, checked
    against the one the receiver expects."""
    where = placement(schedule)
    v = 2 if where == "v" or schedule == "interleaved" else 1
    orders = [stage_schedule(schedule, p, s, m, v) for s in range(p)]
    groups = []
    for r in range(p):
        streams, spec, mine = peer_streams(orders, r, where), set(), [[]]
        for events in exchange_plan(orders, r, where):
            for event in events:
                if event[0] == "send":
                    kind, mb, *chunk = orders[r][event[1]]
                    u = virtual_stage(where, p, r, chunk[0] if chunk else 0)
                    to, c = holder(where, p, u + 1 if kind == "F" else u - 1)
                    items = ([("meta", c)] if mb == 0 else []) + [("act", mb, c)] if kind == "F" else [("grad", mb, c)]
                    mine[-1] += [("send", to, item) for item in items]
                    continue
                item = streams[event[1]][event[2]]
                if item[0] == "act" and item[2] not in spec:
                    spec.add(item[2])
                    mine.append([])
                mine[-1].append(("recv", event[1], item))
            mine.append([])
        groups.append([g for g in mine if g])
    channels: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
    at, started, taken = [0] * p, [False] * p, set()
    while any(at[r] < len(groups[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if at[r] == len(groups[r]):
                continue
            group = groups[r][at[r]]
            if not started[r]:
                for op in group:
                    if op[0] == "send":
                        channels[(r, op[1])].append((id(op), op[2]))
                started[r], progressed = True, True
            while True:
                pending = [op for op in group if op[0] == "recv" and id(op) not in taken]
                if not pending or not channels[(pending[0][1], r)]:
                    break
                sent, item = channels[(pending[0][1], r)].popleft()
                assert item == pending[0][2], (r, item, pending[0][2])
                taken.update((sent, id(pending[0])))
                progressed = True
            if all(id(op) in taken for op in group):
                at[r], started[r], progressed = at[r] + 1, False, True
        if not progressed:
            return False
    return True


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
def test_exchange_plan_issues_in_one_order_every_rank_can_follow(schedule):
    """For p = 2..5 and m = 1..2p+1 (those each schedule takes), the groups each rank issues under p2p in issue
    order (:func:`exchange_plan`) complete without a deadlock, each receive matching the item its peer sent. Catches
    a plan that orders two ranks' messages differently (the V at every p), a send issued before an earlier
    receive of its group's order, and a receive planned after the op that reads it (the plan raises)."""
    for p in range(2, 6):
        for m in range(1, 2 * p + 2):
            if (schedule == "interleaved" and m % p) or (schedule == "dualpipev" and m < 2 * p):
                continue
            assert _issue_in_order(schedule, p, m), (p, m)


def test_zbv_in_pipeline_by_tensor_hybrid():
    """HybridShardedModel, pp=2 x tp=2 (world 4), TinyLM with heads and MLP split and the vocabulary-parallel
    loss, ZeRO-1: equals one process. Catches a split backward that runs the tensor-parallel all-reduces of the
    input's gradient again in the weight pass (ranks would disagree or double the gradient)."""
    hybrid_check(run_ranks(hybrid_train, 4, "inmemory", pp=2, tp=2, dp=1, schedule="zbv"), "adamw", 4)


# ------------------------------------------------------------------------------------------------- Hugging Face


def llama_training(comm, save_to, schedule):
    model = PipelineParallelModel(llama4(), ShardingConfiguration(comm), micro_batches=4, schedule=schedule)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = [model.train_step(*batch(step, padded=True), None, opt) for step in range(STEPS)]
    gpudist.save_checkpoint(save_to, model, opt)
    return model.full_state_dict(), losses


def test_hf_llama_dualpipev_matches_single_process_and_checkpoints(tmp_path):
    """A tied 4-layer Llama as it is on 2 ranks under DualPipe-V (one layer per chunk, the embedding and the head
    both on rank 0), a left-padded batch: parameters under the model's own names and the
    per-step losses equal one process; the checkpoint lists the model's names and loads into the plain model.
    Catches rotary inputs or the padding mask lost at the V's turn, the adapter's glue run on the wrong chunk,
    and chunk-prefixed names in checkpoints."""
    pytest.importorskip("transformers")
    results = run_ranks(llama_training, 2, "inmemory", save_to=tmp_path / "pipe", schedule="dualpipev")
    check_llama_pipeline(results, tmp_path / "pipe")


# ------------------------------------------------------------------------------------------------------------ errors


def test_bad_settings_are_refused_up_front():
    """DualPipe-V with fewer than 2p micro-batches, a V with other than 2 chunks per rank, ZB-H1 with chunks and an
    unknown name are refused at construction, naming the value and the fix. Catches a schedule built anyway:
    DualPipe-V's steady state would start before both warm-ups end (a rank waits for a micro-batch that never
    comes)."""
    settings = [
        {"micro_batches": 3, "schedule": "dualpipev"},
        {"micro_batches": 4, "schedule": "zbv", "virtual_stages": 3},
        {"micro_batches": 4, "schedule": "zero_bubble", "virtual_stages": 2},
        {"micro_batches": 4, "schedule": "zb-h2"},
    ]
    errors = run_ranks(construction_errors, 2, "inmemory", settings=settings)[0]
    assert "needs micro_batches >= 2 x num_stages = 4, got micro_batches=3; use 4 or more" in errors[0]
    assert "virtual_stages=3: schedule='zbv' holds exactly 2 chunks per rank" in errors[1]
    assert "virtual_stages=2 needs schedule='interleaved' (got 'zero_bubble')" in errors[2]
    assert "schedule='zb-h2'; use one of" in errors[3] and "'zero_bubble', 'zbv', 'dualpipev'" in errors[3]


def test_traffic_settings_differ_between_schedules():
    """The schedule decides every message of a step, so ranks wrapping with different schedules are refused when
    the model is wrapped rather than hanging later. Catches a new schedule left out of the compared settings."""
    errors = run_ranks(mixed_schedules, 2, "inmemory")
    assert any("schedule" in e for e in errors if e)


def mixed_schedules(comm):
    try:
        PipelineParallelModel(deep(), ShardingConfiguration(comm), micro_batches=4, schedule=("zbv", "1f1b")[comm.rank])
    except ValueError as e:
        return str(e)
    return None
