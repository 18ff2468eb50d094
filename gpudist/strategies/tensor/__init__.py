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
plan (``{"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}``; ``"layers.*.mlp.fc1"`` for every layer's; ``"auto"``: a
Hugging Face model's own plan from its config), keeping parameter names and the single-process initialization, and
runs data parallel over the ranks left over.
"""

from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    held_segments,
    vocab_parallel_cross_entropy,
)
from .mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from .model import TensorParallelModel, VocabParallelOutput
from .plans import HF_STYLES, PLAN_STYLES, Plan, apply_plan, expand_plan, hf_plan, validate_plan

__all__ = [
    "HF_STYLES",
    "PLAN_STYLES",
    "ColumnParallelLinear",
    "Plan",
    "RowParallelLinear",
    "TensorParallelModel",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "apply_plan",
    "copy_to_tensor_parallel",
    "expand_plan",
    "gather_from_tensor_parallel",
    "held_segments",
    "hf_plan",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "validate_plan",
    "vocab_parallel_cross_entropy",
]
