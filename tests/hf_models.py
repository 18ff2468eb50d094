"""Tiny Hugging Face models built from a config (no download), shared by the tests of the HF path.

``transformers`` is the ``hf`` extra (``pip install -e ".[hf]"``); CI installs it. Where it is missing, the tests
that need it skip with that reason (``requires_transformers``).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import threading

import pytest
import torch

from .helpers import flat

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
requires_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="needs transformers (the hf extra: pip install -e '.[hf]')"
)

VOCAB, SEQ = 256, 16

_TEMPLATES: dict[tuple, torch.nn.Module] = {}
_LOCK = threading.Lock()  # transformers' lazy imports are not thread-safe: in-memory ranks are threads


def _quiet() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)


def tiny_llama(tied: bool = False, kv_heads: int = 2, dtype: torch.dtype = torch.float32, layers: int = 2):
    """A 2-layer Llama (hidden 64, 4 query heads, ``kv_heads`` key/value heads: grouped-query attention at 2),
    vocabulary 256. Built once per shape from seed 0 and copied, so ranks (threads) and references start equal."""
    key = ("llama", tied, kv_heads, layers)
    with _LOCK:
        return copy.deepcopy(_llama_template(key)).to(dtype)


def _llama_template(key: tuple) -> torch.nn.Module:
    _, tied, kv_heads, layers = key
    if key not in _TEMPLATES:
        _quiet()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            _TEMPLATES[key] = LlamaForCausalLM(config)
    return _TEMPLATES[key]


def tiny_gpt2(dtype: torch.dtype = torch.float32, layers: int = 2):
    """A 2-layer GPT-2 (n_embd 64, 4 heads, tied embedding and head, no dropout), vocabulary 256, positions 64."""
    key = ("gpt2", layers)
    with _LOCK:
        return copy.deepcopy(_gpt2_template(key)).to(dtype)


def _gpt2_template(key: tuple) -> torch.nn.Module:
    _, layers = key
    if key not in _TEMPLATES:
        _quiet()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=2,
            resid_pdrop=0.0,  # no dropout: strategies are compared with one process, value for value
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            _TEMPLATES[key] = GPT2LMHeadModel(config)
    return _TEMPLATES[key]


def token_batch(step: int, rank: int = 0, world: int = 1, size: int = 8) -> torch.Tensor:
    """Rank ``rank``'s slice of global batch ``step``: ``size`` sequences of ``SEQ`` tokens (global batch when
    ``world`` is 1), the same on every call."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(3, VOCAB, (size, SEQ), generator=g)
    per = size // world
    return tokens[rank * per : (rank + 1) * per]


HF_MODELS = {
    "llama-gqa": lambda dtype=torch.float32: tiny_llama(kv_heads=2, dtype=dtype),
    "llama-tied": lambda dtype=torch.float32: tiny_llama(tied=True, kv_heads=4, dtype=dtype),
    "gpt2": lambda dtype=torch.float32: tiny_gpt2(dtype=dtype),
}
"""The models the strategy tests train: Llama with grouped-query attention (untied), Llama tied, GPT-2 (tied)."""


def hf_loss(net, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss on ``tokens`` (labels = inputs; the model shifts them)."""
    return net(input_ids=tokens, labels=tokens).loss


def hf_single_process(name: str, dtype: torch.dtype = torch.float32, steps: int = 3) -> torch.Tensor:
    """AdamW (lr 3e-3, weight decay 0.1) on one process over each step's global batch: the flat parameters after
    ``steps`` steps, the reference every strategy test compares with."""
    net = HF_MODELS[name](dtype)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(steps):
        hf_loss(net, token_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return flat(net)
