"""Megatron-style tensor parallelism: layers split within themselves over a tensor-parallel group.

A linear layer ``Y = X A^T + b`` (``A`` is torch's ``[out, in]`` weight) splits two ways (Shoeybi et al., 2019):

- column parallel: ``A`` and ``b`` split by output features; each rank computes its slice of ``Y`` from the
  full ``X``. Forward communicates nothing; backward all-reduces ``dX`` (every slice of ``A`` touches all of ``X``).
- row parallel: ``A`` split by input features; each rank multiplies its slice of ``X`` and the partial outputs
  are all-reduced; the (replicated) bias is added once, after the reduce.

A column layer feeding a row layer (an MLP; attention split by heads, then its output projection) costs one
all-reduce of the activations in forward and one in backward. The vocabulary splits the same way: the token
embedding by rows (:class:`VocabParallelEmbedding`), the output head by columns, and
:func:`vocab_parallel_cross_entropy` takes the loss from the split logits without ever gathering them.

Four paired autograd primitives are the only places that communicate; each takes its communicator explicitly
and names its forward and backward collective. :class:`TensorParallelModel` converts a module in place from a
plan (``{"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}``), keeping parameter names and the single-process
initialization, and runs data parallel over the ranks left over.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..comm import CommunicationBackend, ReductionOperation
from ..config import ShardingConfiguration
from ..flat import broadcast_tensors, reduce_gradients_in
from .base import ShardedModel, module_table, replica_share
from .layout import ParallelLayout, make_groups

__all__ = [
    "PLAN_STYLES",
    "ColumnParallelLinear",
    "HeadParallelBlock",
    "RowParallelLinear",
    "TensorParallelModel",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "apply_plan",
    "copy_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "tinylm_plan",
    "validate_plan",
    "vocab_parallel_cross_entropy",
]

# ---------------------------------------------------------------------------------------------------------------------
# Paired autograd collectives


def _all_reduce_sum(x: torch.Tensor, comm: CommunicationBackend) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place; autograd keeps x
    comm.all_reduce(out, ReductionOperation.SUM)
    return out


def _all_gather_along(x: torch.Tensor, comm: CommunicationBackend, dim: int) -> torch.Tensor:
    parts = x.new_empty((comm.world_size, *x.shape))
    comm.all_gather(x.contiguous(), parts)
    return torch.cat(parts.unbind(0), dim=dim)


def _own_slice(x: torch.Tensor, comm: CommunicationBackend, dim: int) -> torch.Tensor:
    size, n = x.shape[dim], comm.world_size
    if size % n:
        raise ValueError(
            f"scatter_to_tensor_parallel: dimension {dim} has size {size}, not divisible by the "
            f"tensor-parallel size {n}; make it a multiple of {n}"
        )
    return x.narrow(dim, comm.rank * (size // n), size // n).clone(memory_format=torch.contiguous_format)


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommunicationBackend) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_sum(grad, ctx.comm), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommunicationBackend) -> torch.Tensor:
        return _all_reduce_sum(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommunicationBackend, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _own_slice(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_along(grad, ctx.comm, ctx.dim), None, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommunicationBackend, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _all_gather_along(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_slice(grad, ctx.comm, ctx.dim), None, None


def copy_to_tensor_parallel(x: torch.Tensor, comm: CommunicationBackend) -> torch.Tensor:
    """forward: identity, backward: all-reduce (sum) of the gradient over ``comm``."""
    return x if comm.world_size == 1 else _CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x: torch.Tensor, comm: CommunicationBackend) -> torch.Tensor:
    """forward: all-reduce (sum) over ``comm``, backward: identity."""
    return x if comm.world_size == 1 else _ReduceFromTensorParallel.apply(x, comm)


def scatter_to_tensor_parallel(x: torch.Tensor, comm: CommunicationBackend, dim: int = -1) -> torch.Tensor:
    """forward: keep this rank's slice of ``dim``, backward: all-gather the gradient along ``dim``."""
    return x if comm.world_size == 1 else _ScatterToTensorParallel.apply(x, comm, dim % x.dim())


def gather_from_tensor_parallel(x: torch.Tensor, comm: CommunicationBackend, dim: int = -1) -> torch.Tensor:
    """forward: all-gather along ``dim`` (rank order), backward: keep this rank's slice of the gradient."""
    return x if comm.world_size == 1 else _GatherFromTensorParallel.apply(x, comm, dim % x.dim())


# ---------------------------------------------------------------------------------------------------------------------
# How a full tensor is split


@dataclass(frozen=True)
class _Split:
    """A full tensor cut along ``dim`` over ``size`` ranks. The dimension is ``chunks`` equal blocks (3 for a fused
    q, k, v projection), each cut into ``size`` contiguous parts; rank r holds part r of every block, in order."""

    dim: int
    chunks: int = 1

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        shape, d = full.shape, self.dim
        per = shape[d] // (self.chunks * size)
        blocks = full.reshape(*shape[:d], self.chunks, size, per, *shape[d + 1 :])
        local = blocks.select(d + 1, rank).reshape(*shape[:d], self.chunks * per, *shape[d + 1 :])
        return local.clone(memory_format=torch.contiguous_format)

    def unshard(self, parts: torch.Tensor) -> torch.Tensor:
        """The full tensor from every rank's part stacked in rank order (``parts``: ``[size, *local shape]``)."""
        size, local, d = parts.shape[0], parts.shape[1:], self.dim
        per = local[d] // self.chunks
        blocks = parts.reshape(size, *local[:d], self.chunks, per, *local[d + 1 :]).movedim(0, d + 1)
        return blocks.reshape(*local[:d], self.chunks * size * per, *local[d + 1 :])

    def segments(self, local_shape: torch.Size, rank: int, size: int) -> list[tuple[int, int, int]]:
        """Where rank ``rank``'s part lies in the flattened full tensor: ``(offset in the part, length, offset in
        the full tensor)`` runs, ascending. A split along dim 0 is one run per block (``chunks`` runs); along a
        later dim, each index of the dims before it is a run of its own (a rowwise ``[out, in]`` weight: one run of
        ``in / size`` per output row, ``in`` apart). Runs that happen to be adjacent in both are merged."""
        d = self.dim
        outer = int(torch.Size(local_shape[:d]).numel()) * self.chunks
        run = local_shape[d] // self.chunks * int(torch.Size(local_shape[d + 1 :]).numel())
        runs: list[tuple[int, int, int]] = []
        for i in range(outer):
            at, full = i * run, (i * size + rank) * run
            if runs and runs[-1][0] + runs[-1][1] == at and runs[-1][2] + runs[-1][1] == full:
                runs[-1] = (runs[-1][0], runs[-1][1] + run, runs[-1][2])
            elif run:
                runs.append((at, run, full))
        return runs

    def __str__(self) -> str:
        return f"split along dim {self.dim}" + (f" in {self.chunks} blocks" if self.chunks > 1 else "")

    @torch.no_grad()
    def gather(self, local: torch.Tensor, comm: CommunicationBackend) -> torch.Tensor:
        parts = local.new_empty((comm.world_size, *local.shape))
        with comm.unchecked():  # every rank holds the same shard shape by construction
            comm.all_gather(local.detach().contiguous(), parts)
        return self.unshard(parts)


def held_segments(
    name: str, local: torch.Tensor, split: _Split | None, group: CommunicationBackend | None
) -> list[tuple[int, int, str, int]]:
    """The checkpoint segments (``ShardedModel.checkpoint_segments``) of ``local``, this rank's tensor of parameter
    ``name``: all of it when the parameter is not split, else its runs in the full parameter (``split`` over
    ``group``, the tensor-parallel group). The one rule :class:`TensorParallelModel` and the pipeline share."""
    if split is None:
        return [(0, local.numel(), name, 0)]
    return [(at, n, name, full) for at, n, full in split.segments(local.shape, group.rank, group.world_size)]


def _shard_parameter(p: nn.Parameter, split: _Split, comm: CommunicationBackend) -> nn.Parameter:
    return nn.Parameter(split.shard(p.detach(), comm.rank, comm.world_size), requires_grad=p.requires_grad)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _require_divisible(what: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(
            f"{what}={size} is not divisible by the tensor-parallel size {tp}; use a tensor-parallel "
            f"size that divides {size} ({_divisors(size)}), or make it a multiple of {tp}"
        )


def _check_column(what: str, out_features: int, chunks: int, tp: int) -> None:
    if chunks > 1 and out_features % chunks:
        raise ValueError(
            f"{what}: out_features={out_features} is not {chunks} equal blocks (a fused q, k, v "
            f"projection has 3 x d_model outputs); split it with 'colwise' instead"
        )
    _require_divisible(
        f"{what}: out_features" if chunks == 1 else f"{what}: width of each of its {chunks} blocks",
        out_features // chunks,
        tp,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Layers


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` (``[out, in]``) and ``b`` split by output features: rank r holds rows
    ``[r out/tp, (r+1) out/tp)``, or with ``chunks`` (a fused q, k, v: 3) that part of each of the equal blocks.

    Shards: the weight and the bias, 1/tp each. Communicates: nothing in forward (the input is copied to the group;
    its gradient is all-reduced in backward), plus an all-gather of ``Y`` with ``gather_output``. The output is this
    rank's slice of ``Y`` otherwise: feed it to a :class:`RowParallelLinear`, local attention heads, or
    :func:`vocab_parallel_cross_entropy` (an output head over the vocabulary).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: CommunicationBackend,
        gather_output: bool = False,
        chunks: int = 1,
    ):
        super().__init__()
        self.comm, self.gather_output, self.chunks = comm, gather_output, chunks
        self.weight = weight
        self.register_parameter("bias", bias)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0] * comm.world_size

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, comm: CommunicationBackend, gather_output: bool = False, chunks: int = 1
    ) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (same values as the full layer: convert after initializing)."""
        _check_type(linear, nn.Linear, cls.__name__)
        _check_column(f"{cls.__name__}.from_linear", linear.out_features, chunks, comm.world_size)
        split = _Split(0, chunks)
        bias = None if linear.bias is None else _shard_parameter(linear.bias, split, comm)
        return cls(_shard_parameter(linear.weight, split, comm), bias, comm, gather_output, chunks)

    @property
    def output_start(self) -> int:
        """The first output feature of the full layer this rank computes (its slice is contiguous when chunks=1)."""
        return self.comm.rank * self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)
        if not self.gather_output:
            return y
        y = gather_from_tensor_parallel(y, self.comm, -1)  # rank-major: (tp, chunks, per)
        if self.chunks > 1:
            tp = self.comm.world_size
            y = y.unflatten(-1, (tp, self.chunks, -1)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} ({self.weight.shape[0]} here), "
            f"chunks={self.chunks}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by input features: rank r holds columns ``[r in/tp, (r+1) in/tp)`` and
    multiplies its slice of ``X`` (``input_is_parallel``: it arrives split, as a :class:`ColumnParallelLinear`
    leaves it; otherwise the full ``X`` is scattered first).

    Shards: the weight, 1/tp; the bias is replicated and added once after the reduce. Communicates: one all-reduce
    of ``Y`` in forward; in backward nothing (an all-gather of ``dX`` when the input was scattered).
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: CommunicationBackend,
        input_is_parallel: bool = True,
    ):
        super().__init__()
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.weight = weight
        self.register_parameter("bias", bias)
        self.in_features, self.out_features = weight.shape[1] * comm.world_size, weight.shape[0]

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, comm: CommunicationBackend, input_is_parallel: bool = True
    ) -> RowParallelLinear:
        """This rank's shard of ``linear`` (same values as the full layer: convert after initializing)."""
        _check_type(linear, nn.Linear, cls.__name__)
        _require_divisible(f"{cls.__name__}.from_linear: in_features", linear.in_features, comm.world_size)
        bias = None
        if linear.bias is not None:
            bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return cls(_shard_parameter(linear.weight, _Split(1), comm), bias, comm, input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.comm, -1)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.weight.shape[1]} here), out_features={self.out_features}, "
            f"input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank r holds ids ``[r V/tp, (r+1) V/tp)``.

    Shards: the table, 1/tp (and its optimizer state). Communicates: one all-reduce of the output in forward (ids
    outside a rank's range look up zeros there, so the sum is the full lookup); nothing in backward. Pairs with an
    output head over the vocabulary that shares this shard (tied weights) and :func:`vocab_parallel_cross_entropy`.
    """

    def __init__(self, weight: nn.Parameter, comm: CommunicationBackend, padding_idx: int | None = None):
        super().__init__()
        self.comm, self.weight = comm, weight
        self.num_embeddings, self.embedding_dim = weight.shape[0] * comm.world_size, weight.shape[1]
        self.vocab_start = comm.rank * weight.shape[0]
        self.padding_idx = padding_idx

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, comm: CommunicationBackend) -> VocabParallelEmbedding:
        """This rank's rows of ``emb`` (same values as the full table: convert after initializing)."""
        _check_type(emb, nn.Embedding, cls.__name__)
        unsupported = [k for k in ("max_norm", "sparse", "scale_grad_by_freq") if getattr(emb, k)]
        if unsupported:
            raise ValueError(
                f"{cls.__name__}.from_embedding: nn.Embedding option(s) {unsupported} are not supported "
                "with a vocabulary split; build the embedding without them"
            )
        _require_divisible(f"{cls.__name__}.from_embedding: num_embeddings", emb.num_embeddings, comm.world_size)
        return cls(_shard_parameter(emb.weight, _Split(0), comm), comm, emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= rows)
        pad = self.padding_idx - self.vocab_start if self.padding_idx is not None else None
        out = F.embedding(
            local.masked_fill(outside, 0), self.weight, pad if pad is not None and 0 <= pad < rows else None
        )
        return reduce_from_tensor_parallel(out.masked_fill(outside.unsqueeze(-1), 0.0), self.comm)

    def extra_repr(self) -> str:
        end = self.vocab_start + self.weight.shape[0]
        return f"num_embeddings={self.num_embeddings} (ids {self.vocab_start}..{end - 1} here), {self.embedding_dim}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start, ignore_index):
        part = logits.shape[-1]
        x, t = logits.reshape(-1, part).float(), targets.reshape(-1)
        top = x.max(-1).values
        comm.all_reduce(top, ReductionOperation.MAX)
        shifted = x - top.unsqueeze(-1)  # exp() of it cannot overflow on any rank
        valid = t != ignore_index
        local = t - vocab_start
        mine = valid & (local >= 0) & (local < part)
        idx = local.masked_fill(~mine, 0)
        exp = shifted.exp()
        # One all-reduce for both sums over the vocabulary: sum of exp, and the target's logit (on one rank only).
        sums = torch.stack([exp.sum(-1), shifted.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)])
        comm.all_reduce(sums, ReductionOperation.SUM)
        losses = (sums[0].log() - sums[1]).masked_fill(~valid, 0.0)
        count = valid.sum()
        exp.div_(sums[0].unsqueeze(-1))  # this shard of softmax(logits)
        ctx.save_for_backward(exp, idx, mine, valid, count)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine, valid, count = ctx.saved_tensors
        g = softmax.clone()  # d loss / d logits = (softmax - onehot) / count, on this shard only
        g.scatter_add_(1, idx.unsqueeze(1), -mine.to(g.dtype).unsqueeze(1))
        g.mul_((valid.to(g.dtype) * (grad / count)).unsqueeze(-1))
        return g.to(ctx.dtype).view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    comm: CommunicationBackend,
    vocab_start: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over tokens (as ``F.cross_entropy``) from logits split by vocabulary over ``comm``.

    ``logits_shard`` (``[..., V/tp]``) holds full-vocabulary columns ``[vocab_start, vocab_start + V/tp)``;
    ``targets`` (``[...]``) are full-vocabulary ids; ``ignore_index`` targets count for nothing. The full logits
    are never gathered: two all-reduces of one value per token (the max; then the sum of exponentials together
    with the target's logit). Backward, ``(softmax - onehot) / tokens`` on the shard, communicates nothing.
    Computed in float32; every rank of ``comm`` returns the same loss.
    """
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits_shard.shape)} and targets "
            f"{tuple(targets.shape)} disagree; targets must have the logits' shape without the "
            "vocabulary dimension"
        )
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, comm, vocab_start, ignore_index)


_BLOCK_PARTS = ("ln1", "qkv", "proj", "ln2", "fc", "out")


class HeadParallelBlock(nn.Module):
    """A pre-LN transformer block laid out as examples/lm.py's ``Block`` (``x + proj(attn(ln1 x))``, then
    ``x + out(gelu(fc(ln2 x)))``) whose attention runs on this rank's ``n_heads / tp`` heads.

    Holds the block's own submodules under their names (the parameter names do not change); its ``qkv`` must be a
    :class:`ColumnParallelLinear` with 3 chunks (each rank's heads' q, k and v rows) and its ``proj`` a
    :class:`RowParallelLinear`; the MLP may be split (fc colwise, out rowwise) or not.
    """

    def __init__(self, block: nn.Module, tensor_parallel_size: int):
        super().__init__()
        for name, child in block.named_children():
            self.add_module(name, child)
        self.head_dim = block.qkv.in_features // block.n_heads
        self.n_heads = block.n_heads // tensor_parallel_size  # local heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, 3 local) -> 3 x (b, local heads, t, head_dim); this rank's q, k, v blocks are its heads'
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def extra_repr(self) -> str:
        return f"local_heads={self.n_heads}, head_dim={self.head_dim}"


def _check_type(module: nn.Module, cls: type, what: str) -> None:
    if type(module) is not cls:
        raise TypeError(f"{what} converts an nn.{cls.__name__}, got {type(module).__name__}")


# ---------------------------------------------------------------------------------------------------------------------
# Plans

PLAN_STYLES: dict[str, str] = {
    "colwise": "nn.Linear -> ColumnParallelLinear; its output stays split (feed a 'rowwise' layer)",
    "colwise_qkv": "fused q, k, v nn.Linear ([3 d, d]) -> ColumnParallelLinear holding the same heads' q, k and v",
    "rowwise": "nn.Linear -> RowParallelLinear; its input arrives split, its output is all-reduced",
    "vocab": "nn.Embedding -> VocabParallelEmbedding (table split by vocabulary rows)",
    "vocab_output": "the output nn.Linear over the vocabulary -> ColumnParallelLinear; the model's output is then "
    "logits split by vocabulary, for vocab_parallel_cross_entropy",
    "heads": "a block like examples/lm.py's Block -> HeadParallelBlock (n_heads / tp local heads; give its qkv "
    "'colwise_qkv' and its proj 'rowwise')",
}
"""The styles a tensor-parallel plan maps module names to, with what each does."""


def _style_split(style: str | None, attr: str) -> _Split | None:
    """How a parameter named ``attr`` of a module converted with ``style`` is split (None: replicated)."""
    if style in ("colwise", "vocab_output", "vocab"):
        return _Split(0)
    if style == "colwise_qkv":
        return _Split(0, 3)
    if style == "rowwise" and attr == "weight":
        return _Split(1)
    return None


def _convert(module: nn.Module, style: str, comm: CommunicationBackend) -> nn.Module:
    if style == "heads":
        return HeadParallelBlock(module, comm.world_size)
    if style == "vocab":
        return VocabParallelEmbedding.from_embedding(module, comm)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, comm)
    return ColumnParallelLinear.from_linear(module, comm, chunks=3 if style == "colwise_qkv" else 1)


def tinylm_plan(model: nn.Module) -> dict[str, str]:
    """The ready plan for examples/lm.py's ``TinyLM``: each block's attention split by heads (qkv colwise by head,
    proj rowwise) and its MLP (fc colwise, out rowwise); the token embedding split by vocabulary and the head, tied
    to it, a vocabulary-parallel output. Position embeddings and LayerNorms stay replicated. Needs tp to divide
    the vocabulary and every block's number of heads."""
    missing = [name for name in ("tok", "blocks", "head") if not hasattr(model, name)]
    if missing:
        raise ValueError(
            f"tinylm_plan expects examples/lm.py's TinyLM (tok, blocks, head); {type(model).__name__} "
            f"has no {missing}; write a plan dict for it (styles: {', '.join(PLAN_STYLES)})"
        )
    plan = {"tok": "vocab"}
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}": "heads",
            f"blocks.{i}.qkv": "colwise_qkv",
            f"blocks.{i}.proj": "rowwise",
            f"blocks.{i}.fc": "colwise",
            f"blocks.{i}.out": "rowwise",
        }
    return plan | {"head": "vocab_output"}


def validate_plan(module: nn.Module, plan: Mapping[str, str], tp: int) -> list[tuple[str, str]]:
    """The plan's (name, style) entries after checking every one against the module and tp (no communication)."""
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"plan must be a non-empty dict of module name -> style ({', '.join(PLAN_STYLES)}) or a "
            f"function returning one (e.g. tinylm_plan), got {plan!r}"
        )
    modules = dict(module.named_modules())
    for name, style in plan.items():
        if style not in PLAN_STYLES:
            raise ValueError(f"plan entry {name!r}: unknown style {style!r}; use one of {', '.join(PLAN_STYLES)}")
        if not isinstance(name, str) or not name or name not in modules:
            layers = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Embedding))]
            raise ValueError(
                f"plan names {name!r}, which is not a submodule of {type(module).__name__}; use names "
                f"from module.named_modules(), e.g. {layers[:6]}"
            )
        sub, what = modules[name], f"plan entry {name!r} ({style})"
        if style == "heads":
            absent = [p for p in (*_BLOCK_PARTS, "n_heads") if not hasattr(sub, p)]
            if absent or any(True for _ in sub.parameters(recurse=False)):
                raise TypeError(
                    f"{what}: needs a block laid out as examples/lm.py's Block (n_heads, "
                    f"{', '.join(_BLOCK_PARTS)}, no parameters of its own); {type(sub).__name__} lacks "
                    f"{absent or 'none, but has parameters of its own'}"
                )
            _require_divisible(f"{what}: n_heads", sub.n_heads, tp)
            for part, needed in (("qkv", "colwise_qkv"), ("proj", "rowwise")):
                if plan.get(f"{name}.{part}") != needed:
                    raise ValueError(
                        f"{what}: its attention runs on local heads, so the plan must also map "
                        f"'{name}.{part}' to '{needed}' (it maps it to "
                        f"{plan.get(f'{name}.{part}')!r})"
                    )
            continue
        expected = nn.Embedding if style == "vocab" else nn.Linear
        if type(sub) is not expected:
            raise TypeError(
                f"{what}: style {style!r} converts an {expected.__name__}, but {name!r} is a {type(sub).__name__}"
            )
        if style == "vocab":
            _require_divisible(f"{what}: vocabulary size (num_embeddings)", sub.num_embeddings, tp)
        elif style == "rowwise":
            _require_divisible(f"{what}: in_features", sub.in_features, tp)
        else:
            _check_column(what, sub.out_features, 3 if style == "colwise_qkv" else 1, tp)
    outputs = [n for n, s in plan.items() if s == "vocab_output"]
    if len(outputs) > 1:
        raise ValueError(f"plan maps {outputs} to 'vocab_output'; only the model's output layer can be one")
    # Tied parameters (a head sharing the embedding's matrix) must be split the same way wherever they are used.
    seen: dict[int, tuple[str, _Split | None]] = {}
    for owner, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            name, split = f"{owner}.{attr}" if owner else attr, _style_split(plan.get(owner), attr)
            first = seen.setdefault(id(p), (name, split))
            if first[1] != split:
                how = [str(s) if s is not None else "replicated" for s in (first[1], split)]
                raise ValueError(
                    f"{first[0]} and {name} are one (tied) parameter, but the plan splits them "
                    f"differently ({how[0]} vs {how[1]}); give both modules matching styles, e.g. "
                    "'vocab' for the embedding and 'vocab_output' for the head"
                )
    return list(plan.items())


def apply_plan(
    module: nn.Module, entries: list[tuple[str, str]], tensor_group: CommunicationBackend
) -> tuple[dict[str, _Split], str | None]:
    """Convert ``module``'s planned layers in place (``entries`` from :func:`validate_plan`) to their parallel
    versions over ``tensor_group``, keeping parameter names and ties. Returns how each split parameter (every name
    of it) is cut, and the name of the ``vocab_output`` layer (None without one)."""
    aliases: dict[int, list[str]] = {}
    splits: dict[str, _Split] = {}  # every name (aliases too) of a split parameter
    styles = dict(entries)
    for owner, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is not None:
                name = f"{owner}.{attr}" if owner else attr
                aliases.setdefault(id(p), []).append(name)
                if (split := _style_split(styles.get(owner), attr)) is not None:
                    splits[name] = split
    for name, style in sorted(entries, key=lambda e: e[1] == "heads"):  # leaves first, then their blocks
        parent, _, child = name.rpartition(".")
        owner = module.get_submodule(parent)
        owner.register_module(child, _convert(owner.get_submodule(child), style, tensor_group))
    for names in aliases.values():  # conversion gave each alias its own copy of a shard: tie them again
        first = module.get_parameter(names[0])
        for other in names[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)
    outputs = [n for n, s in entries if s == "vocab_output"]
    return splits, outputs[0] if outputs else None


# ---------------------------------------------------------------------------------------------------------------------
# The model

Plan = Mapping[str, str] | Callable[[nn.Module], Mapping[str, str]]


class VocabParallelOutput:
    """The loss and prediction of a model whose output layer may be split by vocabulary (``vocab_output``):
    needs ``vocab_start`` (None when the output is not split) and ``tensor_group``. Shared by
    :class:`TensorParallelModel` and :class:`~gpudist.HybridShardedModel`; put it before the ShardedModel base."""

    vocab_start: int | None
    tensor_group: CommunicationBackend

    def cross_entropy(self, logits_shard: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:func:`vocab_parallel_cross_entropy` of this model's split logits (a ``vocab_output`` plan) and full
        targets; flattens ``[b, t, V/tp]`` logits and ``[b, t]`` targets like ``F.cross_entropy`` on tokens."""
        if self.vocab_start is None:
            raise ValueError(
                "cross_entropy needs a plan with a 'vocab_output' layer (the model's output split by "
                "vocabulary); this model's output is not split: use F.cross_entropy"
            )
        return vocab_parallel_cross_entropy(logits_shard, targets, self.tensor_group, self.vocab_start)

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> float:
        """The base class's step; ``loss_fn`` None means :meth:`cross_entropy` (needs a ``vocab_output`` layer). A
        given ``loss_fn`` gets the module's output as it is (split logits with a ``vocab_output`` layer)."""
        if loss_fn is None:
            if self.vocab_start is None:
                raise ValueError(
                    "train_step: pass loss_fn; only a plan with a 'vocab_output' layer has a default "
                    "loss (vocab_parallel_cross_entropy)"
                )
            loss_fn = self.cross_entropy
        return super().train_step(inputs, targets, loss_fn, optimizer)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """The base class's prediction; a vocabulary-split output is gathered into full logits."""
        out = super().predict(inputs)
        if self.vocab_start is not None and isinstance(out, torch.Tensor):
            out = gather_from_tensor_parallel(out, self.tensor_group, -1)
        return out


class TensorParallelModel(VocabParallelOutput, ShardedModel):
    """Tensor (Megatron) parallelism: layers split within themselves over groups of ``tensor_parallel_size``
    consecutive ranks, converted in place from ``plan`` (module name -> style, see :data:`PLAN_STYLES`, or a
    function of the module such as :func:`tinylm_plan`); the ranks left over are data-parallel replicas.

    Shards: the planned layers' weights (1/tp each; LayerNorms, position embeddings and row-parallel biases stay
    replicated), so their gradients and optimizer state too. Communicates: an all-reduce of the activations per
    column/row pair in forward and another in backward, within the tensor group; with data parallelism, one
    all-reduce (average) of the local gradients per step over the data group, at the end of backward. Use it when
    a layer's weights or activations do not fit on one device; every rank of a tensor group gets the same inputs,
    each data-parallel replica its own slice of the batch.

    Train with a plain optimizer over ``model.parameters()`` (each rank steps its own shard): the collectives make
    every shard's gradient complete, and replicated parameters get identical gradients on the tensor group's
    ranks. ``loss.backward(); opt.step()`` is enough. With a ``vocab_output`` layer, ``model(x)`` returns logits
    split by vocabulary (this rank's ``[vocab_start, vocab_start + V/tp)``): take the loss with
    :meth:`cross_entropy` (``train_step`` does when ``loss_fn`` is None); :meth:`predict` gathers full logits.
    Parameter names stay those of the module; :meth:`gather_full_parameters`, :meth:`full_state_dict` and
    ``save_model("x.safetensors")`` give the full, unsplit model; ``save_model("folder")`` and
    :func:`gpudist.save_checkpoint` write each element once (a shard divided among the replicas holding it, a
    replicated parameter among all ranks), loadable into any strategy and layout.
    """

    strategy = "tensor"

    def __init__(self, module: nn.Module, config, plan: Plan, tensor_parallel_size: int | None = None):
        if isinstance(config, ShardingConfiguration):  # otherwise the base class says what config must be
            world = config.backend.world_size
            tp = world if tensor_parallel_size is None else tensor_parallel_size
            if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and world % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide the world size {world}; use one of "
                    f"{_divisors(world)} (the ranks left over form data-parallel replicas)"
                )
            self._setup = {"plan": plan, "layout": ParallelLayout.resolve(world, 1, tp)}
        super().__init__(module, config)

    # -- construction ----------------------------------------------------------------------------------------------

    def initialize_sharding(self) -> None:
        module, comm = self.module, self.comm
        layout: ParallelLayout = self._setup["layout"]
        tp = layout.tensor_parallel_size
        plan = self._setup["plan"]
        entries = validate_plan(module, plan(module) if callable(plan) else plan, tp)  # before any communication
        self.layout = layout
        _, self.data_parallel_rank, self.tensor_parallel_rank = layout.coords(self.rank)
        self._table = module_table(module)
        self._check_same_model()
        broadcast_tensors(comm, [*module.parameters(), *module.buffers()])
        self.tensor_group = comm if tp == comm.world_size else make_groups(comm, layout.groups("tensor"))
        self.data_group = None
        if layout.data_parallel_size > 1:
            self.data_group = comm if tp == 1 else make_groups(comm, layout.groups("data"))

        self._splits, self._vocab_output = apply_plan(module, entries, self.tensor_group)
        self._keys = list(module.state_dict().keys())
        self._install_hooks()

    def _install_hooks(self) -> None:
        self._callback_queued = False
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # -- layout ----------------------------------------------------------------------------------------------------

    @property
    def pipeline_parallel_rank(self) -> int:
        return 0

    @property
    def pipeline_parallel_size(self) -> int:
        return 1

    @property
    def tensor_parallel_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def vocab_start(self) -> int | None:
        """First vocabulary id of this rank's logits (None without a ``vocab_output`` layer)."""
        return None if self._vocab_output is None else self.module.get_submodule(self._vocab_output).output_start

    def manages(self, param: torch.Tensor) -> bool:
        return any(param is p for p in self.module.parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._callback_queued = False  # a backward that failed half way must not keep the next one from syncing
        return self.module(*args, **kwargs)

    # -- training --------------------------------------------------------------------------------------------------

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        self.synchronize_gradients()
        self._mark_step_bytes()

    @torch.no_grad()
    def synchronize_gradients(self) -> None:
        """Average every local gradient over the data-parallel group (backward already does it; averaging again is
        harmless, as the replicas then agree). Tensor-parallel gradients need nothing: the layers' collectives
        made each shard's gradient complete."""
        if self.data_group is not None:
            params = [p for p in self.module.parameters() if p.requires_grad]
            reduce_gradients_in(self.data_group, params, ReductionOperation.AVERAGE)

    def _bytes_total(self) -> int:
        comms = {id(c): c for c in (self.comm, self.tensor_group, self.data_group) if c is not None}
        return sum(c.stats.total_bytes for c in comms.values())

    # -- full parameters -------------------------------------------------------------------------------------------

    def parameter_count(self) -> int:
        return sum(torch.Size(row["shape"]).numel() for row in self._table)

    def parameter_table(self) -> list[dict]:
        return copy.deepcopy(self._table)

    def _full(self, name: str) -> torch.Tensor:
        """The full value of parameter ``name`` (collective within the tensor group when it is split)."""
        local = self.module.get_parameter(name).detach()
        split = self._splits.get(name)
        return local if split is None else split.gather(local, self.tensor_group)

    def gather_full_parameters(self) -> torch.Tensor:
        """The unsplit module's parameters flattened in its ``parameters()`` order; identical on every rank."""
        if not self._table:
            return torch.empty(0)
        return torch.cat([self._full(row["name"]).reshape(-1) for row in self._table])

    @torch.no_grad()
    def _write(self, name: str, full: torch.Tensor) -> None:
        local, split = self.module.get_parameter(name), self._splits.get(name)
        tp = self.tensor_group
        local.copy_(full.view(local.shape) if split is None else split.shard(full, tp.rank, tp.world_size))

    def set_parameters(self, flat: torch.Tensor) -> None:
        """Overwrite every parameter from a full vector in the unsplit module's ``parameters()`` order (the same on
        every rank; each takes its shard)."""
        count = self.parameter_count()
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != count:
            shape = tuple(flat.shape) if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise ValueError(
                f"set_parameters needs a 1-D tensor of {count} elements (the model's parameter count), got {shape}"
            )
        at = 0
        for row in self._table:
            n = torch.Size(row["shape"]).numel()
            self._write(row["name"], flat[at : at + n].view(row["shape"]))
            at += n

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit module's state (collective within the tensor group): what a single process would hold."""
        full: dict[str, torch.Tensor] = {}
        for row in self._table:
            value = full[row["name"]] = self._full(row["name"])
            for name in row["aliases"]:  # a copy each: safetensors refuses tensors that share memory
                full[name] = value.clone()
        buffers = {k: v.detach() for k, v in self.module.named_buffers()}
        return {k: full[k] if k in full else buffers[k] for k in self._keys}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for row in self._table:
            self._write(row["name"], state[row["name"]])
        for k, v in self.module.named_buffers():
            v.copy_(state[k])

    def clone(self) -> TensorParallelModel:
        """A new wrapper over a copy of the converted module, on the same groups (collective: every rank calls it)."""
        shared = {id(x): x for x in (self.config, self.comm, self.tensor_group, self.data_group) if x is not None}
        twin = copy.deepcopy(self, shared)
        twin._install_hooks()  # deepcopy does not copy gradient hooks
        self.config._models.add(twin)
        return twin

    # -- checkpoints -----------------------------------------------------------------------------------------------

    shards_parameters = True

    def checkpoint_segments(self) -> list[tuple[torch.Tensor, list[tuple[int, int, str, int]]]]:
        """Each parameter this rank holds: a replicated one whole, a split one as its runs in the full parameter
        (:meth:`_Split.segments`; one per row for a rowwise weight)."""
        return [
            (
                p := self.module.get_parameter(row["name"]),
                held_segments(row["name"], p, self._splits.get(row["name"]), self.tensor_group),
            )
            for row in self._table
        ]

    def checkpoint_share(self, name: str, across_replicas: bool = True) -> tuple[int, int] | None:
        """Split parameters are written once per tensor rank (shared by the data-parallel replicas), unsplit ones
        (LayerNorms, row-parallel biases) once in all (shared by every rank): :func:`replica_share`."""
        return replica_share(self.layout, self.rank, name in self._splits, across_replicas)

    # -- reporting -------------------------------------------------------------------------------------------------

    def get_model_metadata(self) -> dict[str, Any]:
        return {
            **super().get_model_metadata(),
            "layout": self.layout.describe(),
            "tensor_parallel_rank": self.tensor_parallel_rank,
            "data_parallel_rank": self.data_parallel_rank,
        }

    def extra_repr(self) -> str:
        return self.layout.describe()
