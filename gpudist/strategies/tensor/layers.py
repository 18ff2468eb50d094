"""Tensor-parallel layers: column- and row-parallel linears, the vocabulary-parallel embedding and loss, and a
head-parallel attention block; plus how a full tensor is split over the tensor group (:class:`Split`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ...comm import CommunicationBackend, ReductionOperation
from .mappings import (
    activation_check,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)

# How a full tensor is split


@dataclass(frozen=True)
class Split:
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
        comm.agreed.all_gather(local.detach().contiguous(), parts)
        return self.unshard(parts)


def held_segments(
    name: str, local: torch.Tensor, split: Split | None, group: CommunicationBackend | None
) -> list[tuple[int, int, str, int]]:
    """The checkpoint segments (``ShardedModel.checkpoint_segments``) of ``local``, this rank's tensor of parameter
    ``name``: all of it when the parameter is not split, else its runs in the full parameter (``split`` over
    ``group``, the tensor-parallel group). The one rule :class:`TensorParallelModel` and the pipeline share."""
    if split is None:
        return [(0, local.numel(), name, 0)]
    return [(at, n, name, full) for at, n, full in split.segments(local.shape, group.rank, group.world_size)]


def shard_parameter(p: nn.Parameter, split: Split, comm: CommunicationBackend) -> nn.Parameter:
    return nn.Parameter(split.shard(p.detach(), comm.rank, comm.world_size), requires_grad=p.requires_grad)


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def require_divisible(what: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(
            f"{what}={size} is not divisible by the tensor-parallel size {tp}; use a tensor-parallel "
            f"size that divides {size} ({divisors(size)}), or make it a multiple of {tp}"
        )


def check_column(what: str, out_features: int, chunks: int, tp: int) -> None:
    if chunks > 1 and out_features % chunks:
        raise ValueError(
            f"{what}: out_features={out_features} is not {chunks} equal blocks (a fused q, k, v "
            f"projection has 3 x d_model outputs); split it with 'colwise' instead"
        )
    require_divisible(
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
        check_type(linear, nn.Linear, cls.__name__)
        check_column(f"{cls.__name__}.from_linear", linear.out_features, chunks, comm.world_size)
        split = Split(0, chunks)
        bias = None if linear.bias is None else shard_parameter(linear.bias, split, comm)
        return cls(shard_parameter(linear.weight, split, comm), bias, comm, gather_output, chunks)

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
        check_type(linear, nn.Linear, cls.__name__)
        require_divisible(f"{cls.__name__}.from_linear: in_features", linear.in_features, comm.world_size)
        bias = None
        if linear.bias is not None:
            bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return cls(shard_parameter(linear.weight, Split(1), comm), bias, comm, input_is_parallel)

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
        check_type(emb, nn.Embedding, cls.__name__)
        unsupported = [k for k in ("max_norm", "sparse", "scale_grad_by_freq") if getattr(emb, k)]
        if unsupported:
            raise ValueError(
                f"{cls.__name__}.from_embedding: nn.Embedding option(s) {unsupported} are not supported "
                "with a vocabulary split; build the embedding without them"
            )
        require_divisible(f"{cls.__name__}.from_embedding: num_embeddings", emb.num_embeddings, comm.world_size)
        return cls(shard_parameter(emb.weight, Split(0), comm), comm, emb.padding_idx)

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
        x, t = logits.reshape(-1, part).to(torch.promote_types(logits.dtype, torch.float32)), targets.reshape(-1)
        top = x.max(-1).values
        with activation_check(comm):
            comm.all_reduce(top, ReductionOperation.MAX)
        shifted = x - top.unsqueeze(-1)  # exp() of it cannot overflow on any rank
        valid = t != ignore_index
        local = t - vocab_start
        mine = valid & (local >= 0) & (local < part)
        idx = local.masked_fill(~mine, 0)
        exp = shifted.exp()
        # One all-reduce for both sums over the vocabulary: sum of exp, and the target's logit (on one rank only).
        sums = torch.stack([exp.sum(-1), shifted.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)])
        with activation_check(comm):
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
    Computed in float32 (float64 logits in float64); every rank of ``comm`` returns the same loss.
    """
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits_shard.shape)} and targets "
            f"{tuple(targets.shape)} disagree; targets must have the logits' shape without the "
            "vocabulary dimension"
        )
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, comm, vocab_start, ignore_index)


def check_type(module: nn.Module, cls: type, what: str) -> None:
    if type(module) is not cls:
        raise TypeError(f"{what} converts an nn.{cls.__name__}, got {type(module).__name__}")


# ---------------------------------------------------------------------------------------------------------------------
