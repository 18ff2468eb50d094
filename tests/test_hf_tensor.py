"""Tensor parallelism on Hugging Face models: ``plan="auto"`` (the model's own plan), ``*`` patterns, output
objects and ``labels=`` (issue 24, items 3 and 5).

Tolerances (tests/tolerances.py): every run on 2 in-memory ranks is compared with one process on the same global
batch in float64, within a multiple of the float32 single-process run's own distance from it
(:func:`assert_matches_reference`), so the bound follows this CPU's rounding; a wrong shard, a split head or a
missing collective moves results by orders of magnitude more. AdamW and SGD both appear: Adam hides a gradient
scaled by a constant (a replicated gradient summed over the tensor group), SGD does not.
"""

from __future__ import annotations

import copy
import dataclasses
import uuid

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpudist import InMemoryCommunicationBackend, ShardingConfiguration
from gpudist.strategies.tensor import TensorParallelModel, hf_plan, validate_plan
from gpudist.testing import RanksFailedError, run_ranks

from .helpers import flat
from .hf_models import VOCAB, requires_transformers, tiny_gpt2, tiny_llama, token_batch
from .tolerances import REFERENCE_FACTOR, assert_matches_reference, reference_pair, unit_roundoff

pytestmark = requires_transformers

STEPS = 4
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
}

LLAMA_WILDCARDS = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.*_proj": "colwise",  # gate_proj, up_proj, and down_proj but for the names below
    "model.layers.0.mlp.down_proj": "rowwise",
    "model.layers.1.mlp.down_proj": "rowwise",
    "lm_head": "vocab_output",
}
"""Llama's plan written by hand with patterns; a name without '*' wins over a pattern that matches it too."""


def lone_rank(world: int) -> ShardingConfiguration:
    """Rank 0 of a ``world``-rank group whose other ranks never come: any collective would time out (1 s), so an
    error raised here was raised before communicating."""
    return ShardingConfiguration(InMemoryCommunicationBackend(0, world, f"lone-{uuid.uuid4().hex}", timeout=1.0))


def next_tokens(x: torch.Tensor) -> torch.Tensor:
    """Targets for logits of ``x`` without shifting: the next token, -100 (ignored) after the last."""
    return F.pad(x[:, 1:], (0, 1), value=-100)


def train_inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels of global batch ``step``; a few labels are padding (-100), which the loss must ignore."""
    x = token_batch(step)
    labels = x.clone()
    labels[step % x.shape[0], : 5 + step] = -100
    return x, labels


# ---------------------------------------------------------------------------------------------- rank functions


def train_tp(comm, kv_heads, tied, plan, loss, opt_name, dtype=torch.float32):
    """``STEPS`` steps of tiny Llama on tp = world ranks (each the whole global batch); the model's own loss with
    ``labels=``, or ``train_step``'s default (the vocabulary-parallel cross-entropy of the output object's logits)."""
    net = tiny_llama(tied=tied, kv_heads=kv_heads, dtype=dtype)
    model = TensorParallelModel(net, ShardingConfiguration(comm), plan)
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = []
    for step in range(STEPS):
        x, labels = train_inputs(step)
        if loss == "labels":
            out = model(input_ids=x, labels=labels)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        else:
            losses.append(float(model.train_step(x, next_tokens(labels), optimizer=opt)))
    attn = model.module.model.layers[0].self_attn
    return {
        "losses": losses,
        "params": model.gather_full_parameters(),
        "predict": model.predict(token_batch(STEPS)).logits,
        "attention": (attn.head_dim, attn.num_key_value_groups, attn.q_proj.weight.shape[0]),
        "tied": model.module.lm_head.weight is model.module.model.embed_tokens.weight,
    }


def train_single_process(kv_heads, tied, loss, opt_name, dtype=torch.float32):
    """:func:`train_tp` on one process: the losses, the parameters and the logits on the next batch."""
    net = tiny_llama(tied=tied, kv_heads=kv_heads, dtype=dtype)
    opt = OPTIMIZERS[opt_name](net.parameters())
    losses = []
    for step in range(STEPS):
        x, labels = train_inputs(step)
        if loss == "labels":
            value = net(input_ids=x, labels=labels).loss
        else:
            value = F.cross_entropy(net(x).logits.flatten(0, 1), next_tokens(labels).flatten())
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return torch.tensor(losses, dtype=torch.float64), flat(net), net(token_batch(STEPS)).logits.detach()


def tp_predict_and_labels(comm):
    """One labelled forward on the split model: its loss and logits, and the parameters after an SGD step of lr 1
    (the full gradient, as a single process would apply it)."""
    model = TensorParallelModel(tiny_llama(), ShardingConfiguration(comm), "auto")
    x, labels = train_inputs(1)
    predicted = model.predict(x)
    out = model(input_ids=x, labels=labels)
    out.loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {
        "type": type(predicted).__name__,
        "predict": predicted.logits,
        "loss": out.loss.detach(),
        "logits": out.logits.detach(),
        "forward_shape": tuple(model(x).logits.shape),  # without labels: this rank's slice
        "params": model.gather_full_parameters(),
    }


def single_process_labels(dtype=torch.float32):
    net = tiny_llama(dtype=dtype)
    x, labels = train_inputs(1)
    out = net(input_ids=x, labels=labels)
    out.loss.backward()
    torch.optim.SGD(net.parameters(), lr=1.0).step()
    return out.loss.detach(), out.logits.detach(), flat(net)


# ---------------------------------------------------------------------------------------------- generic outputs


@dataclasses.dataclass
class LmOutput:
    logits: torch.Tensor
    hidden: torch.Tensor


class TinyHeadModel(nn.Module):
    """An embedding and an output layer over a vocabulary of 8, returning its logits as ``kind`` says."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.embed, self.head = kind, nn.Embedding(8, 4), nn.Linear(4, 8)

    def forward(self, ids):
        hidden = self.embed(ids)
        logits = self.head(hidden)
        if self.kind == "dict":
            return {"logits": logits, "hidden": hidden}
        if self.kind == "dataclass":
            return LmOutput(logits, hidden)
        return logits, hidden


def predict_generic(comm, net):
    model = TensorParallelModel(copy.deepcopy(net), ShardingConfiguration(comm), {"head": "vocab_output"})
    out = model.predict(torch.tensor([[1, 7, 3]]))
    return out["logits"] if net.kind == "dict" else out.logits


class HeadCountAttention(nn.Module):
    """Self-attention that reshapes with its head count (``self.num_heads``), as older transformers models do."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 4, 3
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(12, 12, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(12, 12)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def head_count_attention(comm, net, x):
    plan = {"*_proj": "colwise", "o_proj": "rowwise"}
    model = TensorParallelModel(copy.deepcopy(net), ShardingConfiguration(comm), plan)
    return model.predict(x), model.module.num_heads


# ---------------------------------------------------------------------------------------------- tests


@pytest.fixture(autouse=True, scope="module")
def _templates():
    """Build the models once on the main thread: transformers' lazy imports are not safe from rank threads."""
    for kv_heads in (2, 4):
        for tied in (False, True):
            tiny_llama(tied=tied, kv_heads=kv_heads)
    tiny_gpt2()


@pytest.mark.parametrize(
    ("kv_heads", "tied", "plan", "loss", "opt_name"),
    [
        (2, False, "auto", "labels", "sgd"),
        (4, True, "auto", "train_step", "adamw"),
        (2, True, LLAMA_WILDCARDS, "labels", "sgd"),
    ],
    ids=["gqa-auto-labels-sgd", "mha-tied-auto-train_step-adamw", "gqa-tied-wildcards-labels-sgd"],
)
def test_llama_trains_like_one_process(kv_heads, tied, plan, loss, opt_name):
    """Catches plan="auto" not reading the config's plan (or the head from the model class's), a key/value head
    count left global after the split, q/k/v split into partial heads, the tied head losing its tie to the
    embedding shard, a ``labels=`` loss taken on half the vocabulary (it raised), ``train_step`` not finding the
    logits in the output object, and predict() returning half-vocabulary logits: 4 steps on tp=2 equal one process
    on the global batch, and predict() gives its full logits inside the CausalLMOutputWithPast."""
    results = run_ranks(train_tp, 2, "inmemory", kv_heads=kv_heads, tied=tied, plan=plan, loss=loss, opt_name=opt_name)
    (losses32, params32, logits32), (losses64, params64, logits64) = reference_pair(
        train_single_process, kv_heads, tied, loss, opt_name
    )
    for r in results:
        assert_matches_reference(r["losses"], losses32, losses64, what="losses")
        assert_matches_reference(r["params"], params32, params64, what="parameters")
        assert_matches_reference(r["predict"], logits32, logits64, what="predict logits")
        assert r["attention"] == (16, 4 // kv_heads, 4 // 2 * 16), "head_dim, groups, local query rows"
        assert r["tied"] == tied
        assert torch.equal(r["params"], results[0]["params"]), "ranks gathered different full vectors"


def test_llama_trains_in_float64():
    """Catches a float64 model trained at float32 precision somewhere in tensor parallelism (the vocabulary-parallel
    cross-entropy computed in float32, as it was; a float32 gather or buffer): 4 steps on tp=2 in float64 equal one
    float64 process within the float32 reference's own error scaled to float64 rounding (times u64 / u32 = 2^-29:
    the same computation, rounded 2^29 times finer)."""
    results = run_ranks(
        train_tp,
        2,
        "inmemory",
        kv_heads=4,
        tied=True,
        plan="auto",
        loss="train_step",
        opt_name="adamw",
        dtype=torch.float64,
    )
    (losses32, params32, logits32), (losses64, params64, logits64) = reference_pair(
        train_single_process, 4, True, "train_step", "adamw"
    )
    factor = REFERENCE_FACTOR * unit_roundoff(torch.float64) / unit_roundoff(torch.float32)
    for r in results:
        assert r["params"].dtype == r["predict"].dtype == torch.float64
        assert_matches_reference(r["losses"], losses32, losses64, factor=factor, what="float64 losses")
        assert_matches_reference(r["params"], params32, params64, factor=factor, what="float64 parameters")
        assert_matches_reference(r["predict"], logits32, logits64, factor=factor, what="float64 predict logits")


def test_predict_and_labels_give_the_unsplit_models_outputs():
    """Catches predict() leaving the output object's logits split ((8, 16, 128) for a vocabulary of 256), and
    ``labels=`` with the vocabulary-split head failing ("Expected input batch_size ...") or giving another loss or
    gradient than the unsplit model's (padding labels -100 ignored): one labelled forward and SGD step on tp=2
    equal one process's; a forward without labels still returns this rank's slice."""
    results = run_ranks(tp_predict_and_labels, 2, "inmemory")
    (loss32, logits32, params32), (loss64, logits64, params64) = reference_pair(single_process_labels)
    for r in results:
        assert r["type"] == "CausalLMOutputWithPast"
        assert r["forward_shape"] == (8, 16, VOCAB // 2)
        assert_matches_reference(r["predict"], logits32, logits64, what="predict logits")
        assert_matches_reference(r["logits"], logits32, logits64, what="labels= logits")
        assert_matches_reference(r["loss"], loss32, loss64, what="labels= loss")
        assert_matches_reference(r["params"], params32, params64, what="parameters after one step")


@pytest.mark.parametrize("kind", ["dict", "dataclass"])
def test_predict_gathers_logits_in_dicts_and_dataclasses(kind):
    """Catches predict() gathering only bare tensors: a dict's or a dataclass's ``logits`` come back full."""
    net = TinyHeadModel(kind)  # built here: rank threads would share torch's global generator
    expected = copy.deepcopy(net).double()(torch.tensor([[1, 7, 3]]))
    expected = expected["logits"] if kind == "dict" else expected.logits
    for logits in run_ranks(predict_generic, 2, "inmemory", net=net):
        assert logits.shape == (1, 3, 8)
        assert_matches_reference(logits, expected.float(), expected, what="logits")


def test_predict_refuses_a_tuple_it_cannot_read():
    """Catches predict() silently returning split logits when the output is a tuple (which element is the logits
    cannot be told): it raises naming the fix."""
    with pytest.raises(
        RanksFailedError,
        match=r"TypeError: .*split by vocabulary, but it returned a tuple without logits in it; return the logits as",
    ):
        run_ranks(predict_generic, 2, "inmemory", net=TinyHeadModel("tuple"))


def test_head_counts_become_local():
    """Catches an attention module that reshapes with ``self.num_heads`` keeping the global count after its
    projections are split (a reshape error), through a ``*`` pattern plan: tp=2 equals the unsplit module."""
    x = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(3))
    net = HeadCountAttention()  # built here: rank threads would share torch's global generator
    expected32, expected64 = net(x).detach(), copy.deepcopy(net).double()(x.double()).detach()
    for out, heads in run_ranks(head_count_attention, 2, "inmemory", net=net, x=x):
        assert heads == 2
        assert_matches_reference(out, expected32, expected64, what="attention output")


def test_wildcards_expand_and_conflicts_are_named():
    """Catches '*' crossing a dot or matching nothing silently, and two patterns giving one module different
    styles without an exact name to settle it."""
    model = tiny_llama()
    entries = dict(validate_plan(model, LLAMA_WILDCARDS, 2))
    assert entries == dict(validate_plan(model, "auto", 2)), "the hand-written patterns are Llama's own plan"
    assert entries["model.layers.1.mlp.down_proj"] == "rowwise"  # the exact name, not 'mlp.*_proj'
    assert len(entries) == 2 * 7 + 2
    with pytest.raises(ValueError, match=r"plan pattern 'layers\.\*\.mlp\.up_proj' matches no submodule"):
        validate_plan(model, {"layers.*.mlp.up_proj": "colwise"}, 2)  # relative to the base model: no match here
    with pytest.raises(ValueError, match=r"plan pattern 'model\.\*\.up_proj' matches no submodule"):
        validate_plan(model, {"model.*.up_proj": "colwise"}, 2)  # '*' is one component, not a path
    with pytest.raises(ValueError, match=r"both match 'model.layers.0.mlp.up_proj'; name it without '\*'"):
        validate_plan(model, {"model.layers.*.mlp.*": "colwise", "model.layers.*.mlp.up_proj": "rowwise"}, 2)


def test_auto_plan_does_not_need_transformers_merged_plan():
    """Catches plan="auto" working only where transformers merged the plans on the instance (``model._tp_plan``,
    absent before transformers 5 or without ``post_init``): from ``config.base_model_tp_plan``, prefixed with the
    base model's name, and the class's head plan, it is the same plan."""
    model = tiny_llama()
    merged = hf_plan(model)
    del model._tp_plan  # the class's own (the head only) shows through
    assert hf_plan(model) == merged
    assert merged["lm_head"] == "vocab_output" and merged["model.embed_tokens"] == "vocab"
    assert merged["model.layers.*.self_attn.k_proj"] == "colwise"


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (
            "auto",
            r"plan='auto' on LlamaForCausalLM: num_key_value_heads=2 is not divisible by the tensor-parallel size 4, "
            r"so a key/value head would be split across ranks \(grouped-query attention: 4 query heads share 2 "
            r"key/value heads\); use a tensor-parallel size that divides .*: 1, 2$",
        ),
        (
            LLAMA_WILDCARDS,
            r"'model.layers.0.self_attn.k_proj' \(colwise\): heads \(out_features 32 / head_dim 16\)=2 is not "
            r"divisible by the tensor-parallel size 4; use a tensor-parallel size that divides 2 \(1, 2\)",
        ),
    ],
    ids=["auto", "hand-written"],
)
def test_split_key_value_heads_fail_before_communicating(plan, match):
    """Catches a plan that splits a key/value head across ranks (2 key/value heads, tp=4: k_proj's 32 outputs
    divide by 4, its heads do not) passing validation and failing later in the model's reshape: it raises naming
    the tensor-parallel sizes that work, on a lone rank whose peers never come (so before any collective)."""
    with pytest.raises(ValueError, match=match):
        TensorParallelModel(tiny_llama(kv_heads=2), lone_rank(4), plan)


def test_auto_refuses_models_without_a_plan():
    """Catches plan="auto" on GPT-2 (no base_model_tp_plan; Conv1D layers with q, k, v fused, which no style
    converts) converting nothing or failing obscurely: it raises saying why and which strategies train it."""
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has a GPT2Config without one \(its layers are "):
        hf_plan(tiny_gpt2())
    with pytest.raises(ValueError, match=r"train it with DDP, ZeRO, FSDP or a pipeline instead"):
        TensorParallelModel(tiny_gpt2(), lone_rank(2), "auto")
    with pytest.raises(ValueError, match=r"TinyHeadModel has no config; pass a plan dict"):
        TensorParallelModel(TinyHeadModel("dict"), lone_rank(2), "auto")
