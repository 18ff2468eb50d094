"""The models every strategy benchmark trains, so that speed and memory figures refer to the same workloads.

- ``mlp``: 19 hidden Linear(1024, 1024) + ReLU and a Linear(1024, 10) head: 20.0M parameters in 40 tensors, the
  repository's long-standing benchmark model (few large tensors: communication and optimizer bound).
- ``gpt``: a GPT-style decoder (pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, learned positions,
  tied output head). The default, 6 layers of width 384 with a vocabulary of 8192 and 256 positions, has 13.9M
  parameters in 76 tensors; ``gpt-deep`` (24 layers of width 192) has 12.2M in 292 tensors, where per-tensor
  overheads dominate. ``gpt-small`` (4 layers of width 128, a vocabulary of 4096, sequences of 64) has 1.3M: the
  strategy steps of the pytest-benchmark tier (``benchmarks/test_strategies.py``), sized so that the tier runs in
  minutes. ``gpt-host`` (24 layers of width 32, a vocabulary of 256, sequences of 16) has 0.3M parameters in the same
  292 tensors: its compute is negligible, so a step's time is the libraries' own host work
  (``benchmarks/host_overhead.py``). ``gpt-d1024`` (12 layers of width 1024, a vocabulary of 32768, sequences of
  512) has 185.2M parameters in 148 tensors: the GPU's model, trained under bf16 autocast by ``gpudist bench gpu``
  (the H200 run of 2026-11-28 timed a 217M GPT of this shape with an untied head).

``make(name, **overrides)`` builds one (seeded, so every rank and every variant starts from the same values) and
``batch(name, size, generator)`` gives its inputs and targets; ``loss(name, model, inputs, targets)`` the training
loss.

They live in the package (not in the repository's ``benchmarks/``, which re-exports them as ``benchmarks.workloads``)
because the installed ``gpudist bench gpu`` trains them too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "WORKLOADS", "GPTConfig", "batch", "describe", "loss", "make", "mlp"]


def mlp(width: int = 1024, depth: int = 19, classes: int = 10) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 6
    width: int = 384
    heads: int = 6
    vocab: int = 8192
    positions: int = 256
    seq: int = 128


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width)
        self.fc1 = nn.Linear(c.width, 4 * c.width)
        self.fc2 = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.positions, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


WORKLOADS = {
    "mlp": {},
    "gpt": {"layers": 6, "width": 384, "heads": 6},
    "gpt-deep": {"layers": 24, "width": 192, "heads": 6},
    "gpt-small": {"layers": 4, "width": 128, "heads": 4, "vocab": 4096, "seq": 64},
    "gpt-host": {"layers": 24, "width": 32, "heads": 2, "vocab": 256, "positions": 64, "seq": 16},
    "gpt-d1024": {"layers": 12, "width": 1024, "heads": 16, "vocab": 32768, "positions": 512, "seq": 512},
}


def _gpt_config(name: str, overrides: dict) -> GPTConfig:
    return GPTConfig(**{**WORKLOADS[name], **overrides})


def make(name: str, seed: int = 0, **overrides) -> nn.Module:
    """The workload ``name`` with fresh parameters drawn from ``seed`` (same values on every call)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; use one of {', '.join(WORKLOADS)}")
    torch.manual_seed(seed)
    return mlp(**overrides) if name == "mlp" else GPT(_gpt_config(name, overrides))


def batch(name: str, size: int, generator: torch.Generator | None = None, **overrides):
    """``size`` samples of inputs and targets for workload ``name``."""
    if name == "mlp":
        width = overrides.get("width", 1024)
        classes = overrides.get("classes", 10)
        return torch.randn(size, width, generator=generator), torch.randint(0, classes, (size,), generator=generator)
    c = _gpt_config(name, overrides)
    tokens = torch.randint(0, c.vocab, (size, c.seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss(name: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def describe(model: nn.Module) -> dict:
    """Parameter count (tied weights once) and tensor count."""
    params = list(model.parameters())  # deduplicated by nn.Module
    return {"parameters": sum(p.numel() for p in params), "tensors": len(params)}
