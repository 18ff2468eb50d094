"""The four paired autograd collectives of tensor parallelism: the only places it communicates.

Each takes its communicator explicitly and names its forward and backward collective (Megatron-LM's
``copy_to`` / ``reduce_from`` / ``scatter_to`` / ``gather_from`` the tensor-parallel region).
"""

from __future__ import annotations

import contextlib

import torch

from ...comm import CommunicationBackend, ReductionOperation

# ---------------------------------------------------------------------------------------------------------------------
# Paired autograd collectives


def activation_check(comm: CommunicationBackend):
    """The context for a collective of activations, whose shapes follow the batch rather than a layout checked when
    the model was wrapped: the cross-rank signature check where it is a host-side exchange (Gloo, MPI, in-memory:
    a rank fed another batch shape gets a named error instead of Gloo's abort), none where it would stop the host
    every op (NCCL: there, as in torch's tensor parallelism, every tensor-parallel rank must get the same batch)."""
    return comm.unchecked() if comm.check_syncs_host else contextlib.nullcontext()


def _all_reduce_sum(x: torch.Tensor, comm: CommunicationBackend) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # all_reduce works in place; autograd keeps x
    with activation_check(comm):
        comm.all_reduce(out, ReductionOperation.SUM)
    return out


def _all_gather_along(x: torch.Tensor, comm: CommunicationBackend, dim: int) -> torch.Tensor:
    parts = x.new_empty((comm.world_size, *x.shape))
    with activation_check(comm):
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
