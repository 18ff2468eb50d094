"""Hugging Face models (and TinyLM) under ZeRO-3/FSDP: training with and without activation checkpointing against one
process on the global batch, checkpointing's memory saving measured from live allocations, tied weights in
``.safetensors`` files, and ``device``/``dtype``/``generate()`` on a wrapped model.

Parity uses tests/tolerances.py: single-process training in float64, within a multiple of the float32 run's own error.
Activation checkpointing recomputes the same arithmetic, so it has the same reference as training without it.
"""

from __future__ import annotations

import json
import warnings
import weakref

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from examples.lm import TinyLM, lm_loss
from gpudist import (
    DDPModel,
    DDPOptimizer,
    FSDPModel,
    ShardingConfiguration,
    ZeRO2Model,
    ZeRO2Optimizer,
    ZeRO3Model,
    ZeRO3Optimizer,
)
from gpudist.testing import run_ranks

from .helpers import flat, lm_batch
from .hf_models import (
    HF_MODELS,
    SEQ,
    VOCAB,
    hf_loss,
    hf_single_process,
    requires_transformers,
    tiny_gpt2,
    tiny_llama,
    token_batch,
)
from .tolerances import assert_matches_reference, reference_pair

pytestmark = requires_transformers

STEPS = 3
WRAPPERS = {"zero3": ZeRO3Model, "fsdp": FSDPModel}


@pytest.fixture(autouse=True)
def _quiet():
    """HF warns once per model that checkpointing turns the cache off, and that gradient_checkpointing_enable is the
    deprecated name; neither is what these tests check."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _enable_checkpointing(net, reentrant: bool | None) -> None:
    """HF's own activation checkpointing of every decoder layer (None: off). ``gradient_checkpointing_enable`` is
    the name users call (``activation_checkpointing_enable`` in transformers 5.x, same effect)."""
    if reentrant is not None:
        net.gradient_checkpointing_enable({"use_reentrant": reentrant})
    net.train()


def hf_train(comm, name: str, wrapper: str, reentrant: bool | None) -> torch.Tensor:
    config = ShardingConfiguration(comm)
    net = HF_MODELS[name]()
    _enable_checkpointing(net, reentrant)
    model = WRAPPERS[wrapper](net, config)
    opt = ZeRO3Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    for step in range(STEPS):
        hf_loss(model, token_batch(step, comm.rank, comm.world_size)).backward()
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters()


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "checkpointed", "checkpointed-reentrant"])
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_models_train_under_zero3_and_fsdp_with_activation_checkpointing(name, reentrant):
    """Catches the recomputed forward of a checkpointed layer running on the empty parameters gpudist leaves between
    forwards (``The size of tensor a (0) must match the size of tensor b (64)`` in backward), a recomputation whose
    gradient is lost or counted twice, and a re-entrant checkpoint's inner backward ending gpudist's backward early
    (units reduced before the others finished). FSDP's units are the decoder layers HF checkpoints (their hooks run
    outside the recomputation); ZeRO-3's are the Linear/Embedding/norm modules inside it (their hooks run again
    during it). Llama with grouped-query attention (untied), Llama tied, GPT-2 (tied); 2 ranks against one process."""
    expected = reference_pair(hf_single_process, name)
    for wrapper in WRAPPERS:
        for params in run_ranks(hf_train, 2, "inmemory", name=name, wrapper=wrapper, reentrant=reentrant):
            assert_matches_reference(params, *expected, what=f"{name} under {wrapper}, reentrant={reentrant}")


class CheckpointedLM(TinyLM):
    """TinyLM whose blocks run under ``torch.utils.checkpoint.checkpoint`` (the whole module call: the units'
    hooks run inside the checkpointed region, in forward and again in the recomputation)."""

    def __init__(self, reentrant: bool | None):
        super().__init__(vocab=37, d_model=16, n_layers=2, n_heads=2, seq_len=8, seed=3)  # tests.helpers.tiny_lm
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


def lm_single_process(dtype=torch.float32) -> torch.Tensor:
    net = CheckpointedLM(None).to(dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(STEPS):
        tokens, targets = lm_batch(step)
        lm_loss(net(tokens), targets).backward()
        opt.step()
        opt.zero_grad()
    return flat(net)


def lm_train(comm, wrapper: str, reentrant: bool) -> tuple[torch.Tensor, int, int]:
    """The parameters after training, the bytes this rank sent in the last step, and its shards' bytes."""
    config = ShardingConfiguration(comm)
    model = WRAPPERS[wrapper](CheckpointedLM(reentrant), config)
    opt = ZeRO3Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), config)
    for step in range(STEPS):
        before = comm.stats.total_bytes
        model.train_step(*lm_batch(step, comm.rank, comm.world_size), lm_loss, opt)
    sent = comm.stats.total_bytes - before
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    return model.gather_full_parameters(), sent, shards


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_around_units(reentrant):
    """Catches torch's re-entrant checkpoint breaking ZeRO-3/FSDP: its recomputation backpropagates in an inner
    backward, where gpudist queued its end-of-backward work, so that work ran after the first block (FSDP: failed
    with ``parameters used in forward got no gradient``; ZeRO-3: reset the wrapper mid-backward); and the
    recomputation (whose units' hooks run again) gathering more than backward needs: prefetching the next unit in
    forward order gathered a unit already done with. TinyLM (tied head) with each block under ``checkpoint``, 2 ranks
    against one process; per step, as without checkpointing, two all-gathers and one reduce-scatter of the padded
    shards (``3 N x shard bytes``) and the optimizer's 8-byte norm all-reduce: the recomputation reuses backward's
    gathers."""
    expected = reference_pair(lm_single_process)
    for wrapper in WRAPPERS:
        for params, sent, shards in run_ranks(lm_train, 2, "inmemory", wrapper=wrapper, reentrant=reentrant):
            assert_matches_reference(params, *expected, what=f"TinyLM under {wrapper}, reentrant={reentrant}")
            assert sent == 3 * 2 * shards + 8


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that operations create while the mode is on (in this thread), and their peak:
    each storage is counted once, from the operation that made it until it is freed (a weak reference to it dies).
    It sees what autograd keeps for backward, gathered parameters, gradients and communication buffers alike, and
    none of the library's own accounting."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._paused = False

    def skip_collectives(self, comm) -> None:
        """Do not count what ``comm`` (an in-memory backend) allocates inside its collectives: it computes each
        collective's result on whichever rank's thread arrives last, so it would land on either rank by timing (a
        real backend writes into the caller's output buffer)."""
        collective = comm._collective

        def paused(*args, **kwargs):
            self._paused = True
            try:
                return collective(*args, **kwargs)
            finally:
                self._paused = False

        comm._collective = paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, size = storage._cdata, storage.nbytes()
                if size and key not in self._refs:
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    self._refs[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._refs.pop(key, None)


MEMORY_LAYERS, MEMORY_BATCH = 4, 32


def _step_memory(model, tokens, mode: LiveBytes) -> tuple[int, int]:
    """(bytes live after forward: what autograd keeps for backward, and the loss; peak bytes over forward and
    backward) of one step."""
    with mode:
        loss = hf_loss(model, tokens)
        after_forward = mode.live
        loss.backward()
    return after_forward, mode.peak


def memory_fsdp(comm, reentrant: bool | None) -> tuple[int, int]:
    net = tiny_llama(layers=MEMORY_LAYERS)
    _enable_checkpointing(net, reentrant)
    model = FSDPModel(net, ShardingConfiguration(comm))
    tokens = token_batch(0, comm.rank, comm.world_size, size=MEMORY_BATCH)
    hf_loss(model, tokens).backward()  # the first step allocates the flat gradient buffer; measure the second
    mode = LiveBytes()
    mode.skip_collectives(comm)
    return _step_memory(model, tokens, mode)


def memory_single_process(reentrant: bool | None) -> tuple[int, int]:
    net = tiny_llama(layers=MEMORY_LAYERS)
    _enable_checkpointing(net, reentrant)
    tokens = token_batch(0, 0, 2, size=MEMORY_BATCH)  # one rank's share
    hf_loss(net, tokens).backward()
    return _step_memory(net, tokens, LiveBytes())


def test_checkpointing_lowers_peak_activation_memory_under_fsdp():
    """Catches activation checkpointing that runs under FSDP but saves no memory: gathered units kept alive by the
    checkpoint, or re-gathered for backward already in forward, or recomputed activations kept after their layer's
    backward. Measured from live allocations (``LiveBytes``), one 4-layer Llama step per rank at 2 ranks, HF's
    checkpointing non-reentrant and re-entrant:

    - after forward, exactly as many fewer bytes are live under FSDP as checkpointing saves on the unwrapped model
      with the same per-rank batch (allocation sizes are deterministic);
    - the step's peak drops by at least half of that saving. Without checkpointing the peak holds every layer's
      activations at once; with it, at most one layer's recomputed activations more than the layer inputs, so the
      drop is about (1 - 1/layers) = 3/4 of the saving; half leaves room for what backward holds at other times
      (gathered units, gradients, reduce-scatter buffers)."""
    modes = (None, False, True)
    single = {ckpt: memory_single_process(ckpt) for ckpt in modes}
    fsdp = {ckpt: run_ranks(memory_fsdp, 2, "inmemory", reentrant=ckpt) for ckpt in modes}
    for reentrant in modes[1:]:
        saving = single[None][0] - single[reentrant][0]
        assert saving > 0
        for plain, checkpointed in zip(fsdp[None], fsdp[reentrant], strict=True):
            assert plain[0] - checkpointed[0] == saving, (reentrant, plain, checkpointed, saving)
            assert plain[1] - checkpointed[1] >= saving / 2, (reentrant, plain, checkpointed, saving)


SAVE_MODELS = {  # (build, the tied weight's first name, its other name)
    "llama-tied": (lambda: tiny_llama(tied=True), "model.embed_tokens.weight", "lm_head.weight"),
    "gpt2": (tiny_gpt2, "transformer.wte.weight", "lm_head.weight"),
    "tinylm": (
        lambda: TinyLM(vocab=VOCAB, d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, seed=3),
        "tok.weight",
        "head.weight",
    ),
}
SAVE_STRATEGIES = {
    "ddp": (DDPModel, DDPOptimizer),
    "zero2": (ZeRO2Model, ZeRO2Optimizer),
    "fsdp": (FSDPModel, ZeRO3Optimizer),
}


def _forward_loss(model, name: str, tokens):
    if name == "tinylm":
        return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    return hf_loss(model, tokens)


def save_and_load(comm, name: str, strategy: str, path: str) -> dict:
    build, first, alias = SAVE_MODELS[name]
    model_cls, opt_cls = SAVE_STRATEGIES[strategy]
    config = ShardingConfiguration(comm)
    model = model_cls(build(), config)
    opt = opt_cls(torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    _forward_loss(model, name, token_batch(0, comm.rank, comm.world_size)).backward()  # values unlike a fresh model's
    opt.step()
    opt.zero_grad()
    saved = {k: v.clone() for k, v in model.full_state_dict().items()}
    model.save_model(path)
    fresh = model_cls(build(), config)
    fresh.load_model(path)
    loaded = {k: v.clone() for k, v in fresh.full_state_dict().items()}
    module = fresh.module
    if strategy == "fsdp":  # the shards hold each tied parameter once: its row names every alias
        row = next(r for r in fresh.parameter_table() if r["name"] == first)
        tied = alias in row["aliases"]
    else:
        tied = module.get_parameter(alias) is module.get_parameter(first)
    opt = opt_cls(torch.optim.AdamW(fresh.parameters(), lr=1e-2), config)  # and they stay equal when trained
    _forward_loss(fresh, name, token_batch(1, comm.rank, comm.world_size)).backward()
    opt.step()
    after = fresh.full_state_dict()
    return {"saved": saved, "loaded": loaded, "tied": tied, "equal_after_step": torch.equal(after[first], after[alias])}


@pytest.mark.parametrize("strategy", list(SAVE_STRATEGIES))
@pytest.mark.parametrize("name", list(SAVE_MODELS))
def test_tied_weights_save_to_safetensors_and_load_tied(tmp_path, name, strategy):
    """Catches ``save_model("x.safetensors")`` failing on tied weights (safetensors refuses tensors that share
    memory: ``Some tensors share memory``), a tied weight stored twice, and a load that unties it or leaves one name
    at its old value. 2 ranks: train a step, save, load into a fresh wrapper of the same strategy; every value
    equal, the weight stored once (the other name an alias in the header), still one parameter after loading."""
    build, first, alias = SAVE_MODELS[name]
    build()  # build the template here: transformers' lazy imports race in rank threads
    path = tmp_path / "model.safetensors"
    for r in run_ranks(save_and_load, 2, "inmemory", name=name, strategy=strategy, path=str(path)):
        assert r["saved"].keys() == r["loaded"].keys()
        for k, v in r["saved"].items():
            torch.testing.assert_close(r["loaded"][k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        assert r["tied"] and r["equal_after_step"]
    with safe_open(str(path), "pt") as f:
        stored = set(f.keys())
        assert first in stored and alias not in stored
        assert json.loads(f.metadata()["aliases"]) == {alias: first}


def generate(comm, prompt: torch.Tensor) -> dict:
    net = tiny_llama()
    model = FSDPModel(net, ShardingConfiguration(comm))
    out = {"device": net.device, "dtype": net.dtype}
    out["gathered_on_use"] = net.generate(prompt, max_new_tokens=4, do_sample=False)
    with model.full_parameters():
        out["full_count"] = sum(p.numel() for p in net.parameters())
        out["in_context"] = net.generate(prompt, max_new_tokens=4, do_sample=False)
    out["after_count"] = sum(p.numel() for p in net.parameters())
    out["held"] = model.memory_per_rank()["gathered_parameters"]
    return out


def test_device_dtype_and_generate_on_an_fsdp_wrapped_llama():
    """Catches ``net.device``, ``net.dtype`` and ``net.generate()`` raising StopIteration on a wrapped HF model (its
    parameters are the wrapper's shards, so ``next(net.parameters())`` has nothing), generation on the empty
    parameters left between forwards (the root's are gathered only by the wrapper's own forward), and
    ``full_parameters()`` leaving the full copies registered after the ``with`` block. Greedy decoding of 4 tokens
    must equal the unwrapped model's, gathering unit by unit and inside ``full_parameters()``."""
    reference = tiny_llama()
    prompt = token_batch(0, size=2)[:, :5]
    expected = reference.generate(prompt, max_new_tokens=4, do_sample=False)
    for r in run_ranks(generate, 2, "inmemory", prompt=prompt):
        assert r["device"] == torch.device("cpu") and r["dtype"] == torch.float32
        assert torch.equal(r["gathered_on_use"], expected) and torch.equal(r["in_context"], expected)
        assert r["full_count"] == sum(p.numel() for p in reference.parameters())
        assert r["after_count"] == 0 and r["held"] == 0
