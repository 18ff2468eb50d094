"""TensorParallelModel and its pieces against the unsplit single-process math.

Tolerances (tests/tolerances.py). Primitives: exact; their inputs are multiples of 0.5 below 2^10, so every sum
is exact in fp32 in any order. Layers: against float64, within the rounding bound of their longest fp32 sum in any
order (row-parallel partial products summed across ranks, BLAS's own blocking): ``sum_rtol(n)`` times the same
computation on absolute values. Embedding lookups are exact. The vocabulary-parallel cross-entropy is held to the
bound of a max-shifted log-sum-exp derived in :func:`cross_entropy_bounds`. Training parity (TinyLM, the MLP):
against single-process training in float64, within a multiple of the float32 single-process run's own error, so
the bound follows this CPU's rounding. AdamW divides each gradient by its running RMS, so summation order reaches
the update unscaled where a gradient is a near-cancelling sum; the float32 reference is exposed to the same, and a
real bug moves parameters by about lr = 1e-2 in one step. SGD is there because Adam hides a gradient scaled by a
constant (e.g. a replicated gradient summed over the tensor group); SGD does not.
"""

from __future__ import annotations

import copy
import math
import uuid

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from examples import lm
from gpudist import InMemoryCommunicationBackend, ShardingConfiguration
from gpudist.strategies.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelModel,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from gpudist.testing import run_ranks

from .helpers import (
    TP_LM,
    TP_OPTIMIZERS,
    TP_STEPS,
    flat,
    tp_lm_batch,
    tp_single_process_lm,
    tp_train_lm,
)
from .tolerances import assert_matches_reference, reference_pair, sum_rtol, unit_roundoff


def assert_rounding(got: torch.Tensor, exact: torch.Tensor, magnitude, n: int, what: str) -> None:
    """Every element of ``got`` (fp32) within ``sum_rtol(n) * magnitude`` of the float64 ``exact``: an fp32 sum of
    ``n`` terms in any order, ``magnitude`` being the same sum of absolute values (Higham, section 4.2)."""
    err = (got.detach().double() - exact).abs()
    bound = sum_rtol(n) * torch.as_tensor(magnitude, dtype=torch.float64)
    worst = int((err - bound).argmax())
    got_err, limit = float(err.flatten()[worst]), float(bound.broadcast_to(err.shape).flatten()[worst])
    assert bool((err <= bound).all()), f"{what}: |got - float64| = {got_err:.3g} exceeds {limit:.3g}"


def cross_entropy_bounds(logits: torch.Tensor, tokens: int) -> tuple[float, float]:
    """Absolute rounding bounds of an fp32 mean cross-entropy over ``tokens`` tokens of ``logits`` ``[..., V]``
    (the loss, and each logit's gradient), max-shifted and summed in any order (F.cross_entropy, or the vocabulary
    split). With u = 2^-24 and Z = max |logit|: z - max rounds by u|z - max| <= 2Zu and exp adds 2u (1 ulp), so
    each exp term is within a relative alpha = (2Z + 2)u; their V-term sum S within rho = alpha + sum_rtol(V)
    (1 + alpha). log S lies in [0, log V]: it is within rho (1 + 2 rho) + 2u log V; the target's shifted logit is
    off by 2Zu, and subtracting it rounds once more (|loss| <= log V + 2Z). The mean adds sum_rtol(T) of the
    largest loss and the division u of it. The gradient (softmax - onehot) / T: a softmax entry (<= 1) is within
    2 rho + u relative; the subtraction, the 1/T and the product round 3 times more."""
    u = unit_roundoff(torch.float32)
    v, z = logits.shape[-1], float(logits.abs().max())
    alpha = (2 * z + 2) * u
    rho = alpha + sum_rtol(v) * (1 + alpha)
    largest = math.log(v) + 2 * z
    per_token = rho * (1 + 2 * rho) + 2 * u * math.log(v) + u * (2 * z + largest)
    return per_token + (sum_rtol(tokens) + u) * largest, (2 * rho + 4 * u) / tokens


def lone_rank(world: int) -> ShardingConfiguration:
    """Rank 0 of a ``world``-rank group whose other ranks never come: any collective would time out (1 s), so an
    error raised here instead was raised before communicating."""
    return ShardingConfiguration(InMemoryCommunicationBackend(0, world, f"lone-{uuid.uuid4().hex}", timeout=1.0))


# ---------------------------------------------------------------------------------------------- rank functions


def check_primitives(comm):
    n, r = comm.world_size, comm.rank

    def per_rank(i: int, shape=(4, 6)) -> torch.Tensor:  # rank i's input: differs per rank so sums mean something
        return torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) * (i + 1) + 0.5 * i

    def run(fn, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(upstream)
        return y.detach(), x.grad

    everyone = [per_rank(i) for i in range(n)]  # multiples of 0.5 below 2^10: sums are exact in any order
    y, g = run(lambda x: copy_to_tensor_parallel(x, comm), everyone[r], everyone[r] * 3)
    torch.testing.assert_close(y, everyone[r], rtol=0, atol=0)
    torch.testing.assert_close(g, sum(everyone) * 3, rtol=0, atol=0)
    y, g = run(lambda x: reduce_from_tensor_parallel(x, comm), everyone[r], everyone[0])
    torch.testing.assert_close(y, sum(everyone), rtol=0, atol=0)
    torch.testing.assert_close(g, everyone[0], rtol=0, atol=0)
    full = per_rank(0, (6, 6))
    for dim in (0, -1):
        local = [part.contiguous() for part in full.chunk(n, dim)]
        upstream = [per_rank(i, (6, 6)).chunk(n, dim)[i] for i in range(n)]  # each rank's own gradient slice
        y, g = run(lambda x, dim=dim: scatter_to_tensor_parallel(x, comm, dim), full, upstream[r])
        torch.testing.assert_close(y, local[r], rtol=0, atol=0)
        torch.testing.assert_close(g, torch.cat(upstream, dim), rtol=0, atol=0)
        y, g = run(lambda x, dim=dim: gather_from_tensor_parallel(x, comm, dim), local[r], full * 2)
        torch.testing.assert_close(y, full, rtol=0, atol=0)
        torch.testing.assert_close(g, (full * 2).chunk(n, dim)[r], rtol=0, atol=0)


def check_layers(comm):
    """Each layer on tp ranks against its torch counterpart in float64: outputs, input gradients and this rank's
    slice of the weight gradients (sliced here by hand, independently of the library's split). Each is an fp32 sum
    of at most 15 products plus a bias, however split across ranks: at most 16 roundings on any term's path (its
    product, 15 additions), compared within ``sum_rtol(17)`` of the same computation on absolute values (weights,
    inputs and upstream gradients)."""
    n, r = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(0)  # the same full layers and data on every rank
    x = torch.randn(3, 5, 8, generator=g)
    upstream = torch.randn(3, 5, 12, generator=g)
    rows = slice(r * 12 // n, (r + 1) * 12 // n)
    terms = 17

    def grads(module: nn.Module, inp: torch.Tensor, up: torch.Tensor):
        inp = inp.clone().requires_grad_(True)
        out = module(inp)
        out.backward(up)
        return out.detach(), inp.grad

    def exact(module: nn.Module, inp: torch.Tensor, up: torch.Tensor, absolute: bool = False):
        """``grads`` and the weight gradients of a float64 copy of ``module`` (with ``absolute``: on |weights|,
        |inputs| and |upstream|, which gives the magnitudes sum |a_i b_i| of every output)."""
        twin = copy.deepcopy(module).double()
        if absolute:
            with torch.no_grad():
                for p in twin.parameters():
                    p.abs_()
        lift = (lambda t: t.double().abs()) if absolute else (lambda t: t.double())
        out, dx = grads(twin, lift(inp), lift(up))
        return out, dx, twin.weight.grad, None if twin.bias is None else twin.bias.grad

    full = nn.Linear(8, 12)
    with torch.no_grad():
        full.weight.copy_(torch.randn(12, 8, generator=g))
        full.bias.copy_(torch.randn(12, generator=g))
    ref, mag = exact(full, x, upstream), exact(full, x, upstream, absolute=True)
    for gather in (False, True):
        col = ColumnParallelLinear.from_linear(full, comm, gather_output=gather)
        y, dx = grads(col, x, upstream if gather else upstream[..., rows])
        part = slice(None) if gather else rows
        assert_rounding(y, ref[0][..., part], mag[0][..., part], terms, "column output")
        assert_rounding(dx, ref[1], mag[1], terms, "column input gradient")  # all-reduced over the slices
        assert_rounding(col.weight.grad, ref[2][rows], mag[2][rows], terms, "column weight gradient")
        assert_rounding(col.bias.grad, ref[3][rows], mag[3][rows], terms, "column bias gradient")
    # Fused q, k, v: rank r holds the r-th part of each of the 3 blocks of 4 outputs.
    qkv = ColumnParallelLinear.from_linear(full, comm, gather_output=True, chunks=3)
    y, dx = grads(qkv, x, upstream)
    assert_rounding(y, ref[0], mag[0], terms, "qkv output")
    assert_rounding(dx, ref[1], mag[1], terms, "qkv input gradient")
    mine = [torch.cat([block[r * 4 // n : (r + 1) * 4 // n] for block in w.split(4)]) for w in (ref[2], mag[2])]
    assert_rounding(qkv.weight.grad, *mine, terms, "qkv weight gradient")

    full = nn.Linear(12, 8)
    with torch.no_grad():
        full.weight.copy_(torch.randn(8, 12, generator=g))
        full.bias.copy_(torch.randn(8, generator=g))
    wide = torch.randn(3, 5, 12, generator=g)
    up8 = torch.randn(3, 5, 8, generator=g)
    ref, mag = exact(full, wide, up8), exact(full, wide, up8, absolute=True)
    row = RowParallelLinear.from_linear(full, comm, input_is_parallel=False)  # scatters the full input itself
    y, dx = grads(row, wide, up8)
    assert_rounding(y, ref[0], mag[0], terms, "row output")
    assert_rounding(dx, ref[1], mag[1], terms, "row input gradient")
    assert_rounding(row.weight.grad, ref[2][:, rows], mag[2][:, rows], terms, "row weight gradient")
    assert_rounding(row.bias.grad, ref[3], mag[3], terms, "row bias gradient")
    row = RowParallelLinear.from_linear(full, comm)  # input arrives split
    y, dx = grads(row, wide[..., rows], up8)
    assert_rounding(y, ref[0], mag[0], terms, "row output (split input)")
    assert_rounding(dx, ref[1][..., rows], mag[1][..., rows], terms, "row input gradient (split input)")

    emb = nn.Embedding(12, 6, padding_idx=5)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(12, 6, generator=g))
    ids = torch.tensor([[0, 5, 11, 3], [7, 5, 2, 11]])
    up6 = torch.randn(2, 4, 6, generator=g)
    ref = emb(ids)
    ref.backward(up6)
    vocab = VocabParallelEmbedding.from_embedding(emb, comm)
    out = vocab(ids)
    out.backward(up6)
    # Exact: a lookup plus zeros from the other ranks; each row's gradient sums at most 2 upstream rows (id 11),
    # and a + b rounds the same in either order.
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(vocab.weight.grad, emb.weight.grad[rows], rtol=0, atol=0)  # padding row: no gradient

    logits = torch.randn(2, 7, 12, generator=g) * 4
    targets = torch.randint(0, 12, (2, 7), generator=g)
    targets[0, 2] = targets[1, 6] = -100  # ignored tokens count for nothing, as in F.cross_entropy
    full_logits = logits.double().requires_grad_(True)
    ref_loss = F.cross_entropy(full_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    shard = logits[..., rows].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, targets, comm, vocab_start=rows.start)
    loss.backward()
    loss_bound, grad_bound = cross_entropy_bounds(logits, tokens=int((targets != -100).sum()))
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=0, atol=loss_bound)
    torch.testing.assert_close(shard.grad.double(), full_logits.grad[..., rows], rtol=0, atol=grad_bound)


def train_mlp(comm, state, tp):
    net = Mlp()
    net.load_state_dict(state)
    model = TensorParallelModel(net, ShardingConfiguration(comm), {"fc1": "colwise", "fc2": "rowwise"}, tp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(TP_STEPS):
        x, y = mlp_batch(step)
        model.train_step(x, y, F.mse_loss, opt)
    return {
        "params": model.gather_full_parameters(),
        "predict": model.predict(mlp_batch(0)[0]),
        "shapes": [tuple(p.shape) for p in model.parameters()],
    }


def save_trained(comm, path):
    model = TensorParallelModel(lm.TinyLM(**TP_LM), ShardingConfiguration(comm), lm.tinylm_plan)
    opt = TP_OPTIMIZERS["adamw"](model.parameters())
    x, y = tp_lm_batch()
    for _ in range(2):
        model.train_step(x, y, optimizer=opt)
    model.save_model(path / "tp.safetensors")
    model.save_model(path / "folder")  # a checkpoint folder: each rank writes its share
    twin = model.with_parameters(torch.zeros(model.parameter_count()))
    assert twin.gather_full_parameters().abs().sum() == 0, "with_parameters did not set the clone"
    twin.train_step(x, y, optimizer=TP_OPTIMIZERS["sgd"](twin.parameters()))  # the clone trains on its own
    return {"params": model.gather_full_parameters(), "predict": model.predict(x)}


def load_saved(comm, path):
    loaded = []
    for saved in ("tp.safetensors", "folder"):
        model = TensorParallelModel(lm.TinyLM(**{**TP_LM, "seed": 1}), ShardingConfiguration(comm), lm.tinylm_plan)
        model.load_model(path / saved)
        loaded.append(model.gather_full_parameters())
    return loaded


# ---------------------------------------------------------------------------------------------- a generic model


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.fc2(torch.tanh(self.fc1(x))))


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(10, 6, generator=g), torch.randn(10, 5, generator=g)


def single_process_mlp(state: dict, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP trained like :func:`train_mlp` on one process; its parameters and its prediction on step 0's batch."""
    net = Mlp()
    net.load_state_dict(state)
    net.to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(TP_STEPS):
        x, y = mlp_batch(step)
        F.mse_loss(net(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
        opt.zero_grad()
    return flat(net), net(mlp_batch(0)[0].to(dtype)).detach()


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 3])
def test_primitives_forward_and_backward(world):
    """Catches a primitive whose backward is not its forward's pair (copy <-> all-reduce, scatter <-> gather), a
    gather/scatter that mixes up rank order or the dimension, and an all-reduce that mutates autograd's input."""
    run_ranks(check_primitives, world, "inmemory")


def test_primitives_on_a_group_of_one_return_the_input():
    """Catches a group of one that still builds autograd nodes or calls the backend."""
    comm = InMemoryCommunicationBackend(0, 1, f"solo-{uuid.uuid4().hex}")
    x = torch.ones(3, 4)
    for fn in (
        copy_to_tensor_parallel,
        reduce_from_tensor_parallel,
        scatter_to_tensor_parallel,
        gather_from_tensor_parallel,
    ):
        assert fn(x, comm) is x
    assert comm.stats.total_calls == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_torch(tp):
    """Catches a wrong shard (rows vs columns, q/k/v blocks not split per head), a bias added on every rank before
    the reduce, an embedding that does not mask other ranks' ids or ignores padding_idx, and a cross-entropy whose
    backward is not (softmax - onehot) / tokens on the shard or that counts ignored tokens."""
    run_ranks(check_layers, tp, "inmemory")


@pytest.mark.parametrize(
    ("backend", "tp", "opt_name"),
    [
        ("inmemory", 2, "adamw"),
        ("inmemory", 4, "adamw"),
        ("gloo", 2, "adamw"),
        ("inmemory", 2, "sgd"),
        ("inmemory", 4, "sgd"),
    ],
)
def test_tinylm_matches_single_process(backend, tp, opt_name):
    """Catches heads split across q/k/v inconsistently, the tied head losing its tie to the embedding shard, a
    replicated gradient summed over the tensor group (SGD sees it), and extra or missing collectives: 5 steps
    on tp ranks equal one process on the same batch, every rank gathers the same full vector, and the bytes per
    step are exactly the activation all-reduces (per block 2 forward + 2 backward, embedding, head, loss)."""
    x, y = tp_lm_batch()
    results = run_ranks(tp_train_lm, tp, backend, tp=tp, opt_name=opt_name, x=x, y=y)
    (losses32, params32), (losses64, params64) = reference_pair(tp_single_process_lm, opt_name)
    tokens, activation = x.numel(), x.numel() * TP_LM["d_model"] * 4
    for rank, r in enumerate(results):
        assert_matches_reference(r["params"], params32, params64, what="parameters")
        assert_matches_reference(r["losses"], losses32, losses64, what="losses")
        assert torch.equal(r["params"], results[0]["params"]), "ranks gathered different full vectors"
        assert r["ranks"] == (0, 1, 0, 1, rank, tp)
        assert r["meta"]["bytes_per_step"] == activation * (4 * TP_LM["n_layers"] + 2) + tokens * 3 * 4
        assert r["meta"]["parameter_count"] == params64.numel()


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_tensor_times_data_parallel_matches_single_process(opt_name):
    """Catches data-parallel replicas not averaging (or summing) their gradients, the idiomatic
    ``loss.backward(); opt.step()`` loop skipping that average, and tensor groups that are not consecutive ranks:
    tp=2 x dp=2, each replica on its half of the global batch, equals one process on the whole batch."""
    x, y = tp_lm_batch()
    results = run_ranks(tp_train_lm, 4, "inmemory", tp=2, opt_name=opt_name, x=x, y=y, idiomatic=True)
    (losses32, params32), (losses64, params64) = reference_pair(tp_single_process_lm, opt_name)
    for rank, r in enumerate(results):
        assert_matches_reference(r["params"], params32, params64, what="parameters")
        assert torch.equal(r["params"], results[0]["params"])
        assert r["ranks"] == (0, 1, rank // 2, 2, rank % 2, 2)
        assert r["losses"] == results[rank ^ 1]["losses"], "the two ranks of a tensor group disagree on the loss"
        tokens, activation = x.numel() // 2, x.numel() // 2 * TP_LM["d_model"] * 4
        grads = r["local_numel"] * 4  # one average of the local gradients over the data group
        assert r["meta"]["bytes_per_step"] == activation * (4 * TP_LM["n_layers"] + 2) + tokens * 3 * 4 + grads
    global_losses = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"], strict=True)]
    assert_matches_reference(global_losses, losses32, losses64, what="losses")


@pytest.mark.parametrize("tp", [2, 4])
def test_generic_plan_on_an_mlp(tp):
    """Catches a generic plan that does not convert by name, shards of the wrong shape, and predict() on a model
    without a vocabulary output gathering anyway: {"fc1": "colwise", "fc2": "rowwise"} trains like one process."""
    torch.manual_seed(0)
    state = Mlp().state_dict()
    results = run_ranks(train_mlp, tp, "inmemory", state=state, tp=tp)
    (params32, predict32), (params64, predict64) = reference_pair(single_process_mlp, state)
    for r in results:
        assert_matches_reference(r["params"], params32, params64, what="parameters")
        assert_matches_reference(r["predict"], predict32, predict64, what="predict")
        assert r["shapes"] == [(16 // tp, 6), (16 // tp,), (5, 16 // tp), (5,), (5,), (5,)]


def test_full_state_saves_loads_across_layouts_and_clones(tmp_path):
    """Catches a .safetensors export (or a checkpoint folder) holding shards instead of the full model (or losing
    the tied head), loading that cannot take another tp size, clone() sharing parameters with the original, and
    predict() returning split logits: trained on tp=2, loaded by a plain TinyLM and by tp=4, equal everywhere."""
    trained = run_ranks(save_trained, 2, "inmemory", path=tmp_path)
    plain = lm.TinyLM(**{**TP_LM, "seed": 2})
    plain.load_state_dict(load_file(tmp_path / "tp.safetensors"))
    assert plain.head.weight is plain.tok.weight
    torch.testing.assert_close(flat(plain), trained[0]["params"], rtol=0, atol=0)
    logits32, logits64 = (model(tp_lm_batch()[0]).detach() for model in (plain, copy.deepcopy(plain).double()))
    assert_matches_reference(trained[0]["predict"], logits32, logits64, what="predict")
    for from_file, from_folder in run_ranks(load_saved, 4, "inmemory", path=tmp_path):
        torch.testing.assert_close(from_file, trained[0]["params"], rtol=0, atol=0)
        torch.testing.assert_close(from_folder, trained[0]["params"], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("world", "tp", "make", "plan", "match"),
    [
        (
            2,
            None,
            lambda: lm.TinyLM(**{**TP_LM, "vocab": 63}),
            lm.tinylm_plan,
            r"'tok' \(vocab\): vocabulary size \(num_embeddings\)=63 is not divisible by the tensor-parallel size 2",
        ),
        (
            4,
            None,
            lambda: lm.TinyLM(**{**TP_LM, "d_model": 48, "n_heads": 6}),
            lm.tinylm_plan,
            r"'blocks.0' \(heads\): n_heads=6 is not divisible by the tensor-parallel size 4; .* \(1, 2, 3, 6\)",
        ),
        (
            2,
            None,
            lambda: nn.Sequential(nn.Linear(4, 13), nn.Linear(13, 2)),
            {"0": "colwise", "1": "rowwise"},
            r"'0' \(colwise\): out_features=13 is not divisible by the tensor-parallel size 2",
        ),
        (
            4,
            3,
            Mlp,
            {"fc1": "colwise", "fc2": "rowwise"},
            r"tensor_parallel_size=3 does not divide the world size 4; use one of 1, 2, 4",
        ),
        (2, None, Mlp, {"fc1": "colwise", "fc3": "rowwise"}, r"plan names 'fc3', which is not a submodule of Mlp"),
        (2, None, Mlp, {"fc1": "diagonal"}, r"plan entry 'fc1': unknown style 'diagonal'; use one of colwise, "),
        (
            2,
            None,
            lambda: lm.TinyLM(**TP_LM),
            lambda m: {**lm.tinylm_plan(m), "blocks.0.qkv": "colwise"},
            r"'blocks.0' \(heads\): .* must also map 'blocks.0.qkv' to 'colwise_qkv'",
        ),
        (
            2,
            None,
            lambda: lm.TinyLM(**TP_LM),
            {"head": "vocab_output"},
            r"tok.weight and head.weight are one \(tied\) parameter, but the plan splits them differently",
        ),
    ],
    ids=["vocab", "heads", "features", "world", "name", "style", "qkv-pairing", "tied"],
)
def test_bad_plans_fail_before_communicating(world, tp, make, plan, match):
    """Catches a tp size that does not divide the vocabulary, the heads, a layer or the world, and unknown names or
    styles, slipping through to a shape error or a hang: each raises a ValueError naming the value and the fix on
    a lone rank whose peers never come (any collective would time out instead)."""
    with pytest.raises(ValueError, match=match):
        TensorParallelModel(make(), lone_rank(world), plan, tensor_parallel_size=tp)


def test_layer_constructors_check_divisibility():
    """Catches from_linear/from_embedding splitting unevenly (silently dropping rows) when used without a model."""
    comm = lone_rank(4).backend
    with pytest.raises(ValueError, match="out_features=6 is not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 6), comm)
    with pytest.raises(ValueError, match="in_features=6 is not divisible"):
        RowParallelLinear.from_linear(nn.Linear(6, 4), comm)
    with pytest.raises(ValueError, match="num_embeddings=10 is not divisible"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(10, 4), comm)
    with pytest.raises(TypeError, match=r"converts an nn\.Linear, got Embedding"):
        ColumnParallelLinear.from_linear(nn.Embedding(8, 4), comm)
