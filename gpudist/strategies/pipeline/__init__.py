"""PipelineParallelModel: consecutive blocks of a model on consecutive ranks, fed micro-batch by micro-batch.

Each stage holds only its blocks. A training step splits this replica's batch into ``micro_batches`` pieces;
activations travel forward and their gradients backward with the backend's send/recv, in the order of the
schedule:

- ``"gpipe"``: every micro-batch forward, then every backward. Stage ``s`` keeps all ``m`` micro-batches'
  activations alive at once.
- ``"1f1b"`` (default): ``p - s - 1`` warm-up forwards, then one forward and one backward alternately, then the
  remaining backwards (PipeDream-flush, as Megatron-LM and ``torch.distributed.pipelining.Schedule1F1B``). Same
  bubble, ``(p - 1) / (m + p - 1)`` of the step, but stage ``s`` keeps at most ``p - s`` micro-batches in flight.
- ``"interleaved"``: interleaved 1F1B (Megatron-LM, ``ScheduleInterleaved1F1B``). The blocks are cut into ``p v``
  chunks and rank ``r`` holds chunks ``r, r + p, ...`` (``virtual_stages=v``, default 2); activations go round
  the ranks ``v`` times. Bubble ``(p - 1) / (v m + p - 1)``, for ``v`` times the messages; ``m`` must be a
  multiple of ``p``.
- ``"zero_bubble"`` (ZB-H1), ``"zbv"`` (ZB-V) and ``"dualpipev"`` (DualPipe-V): each backward split into the input's
  gradient (B) and the weights' (W, :mod:`.backward`), W deferred into the bubble. ZB-H1 keeps 1F1B's order and
  memory bound (``p`` micro-batches); the V schedules hold two chunks per rank, ``s`` and ``2 p - 1 - s`` (the loss
  on rank 0). At equal F, B and W costs the bubble is ``(p - 1) / (3 m + p - 1)`` (ZB-H1) and
  ``(p - 1) / (6 m + p - 1)`` (the V).

The loss is computed on the last stage (``loss_fn`` must average over its micro-batch, like
``F.cross_entropy``) and returned on every rank. Parameters shared between stages (a language model's tied
embedding and output head) are kept on each stage that uses them and their gradients are summed between those
stages after backward. With ``world_size = num_stages x d``, ``d`` replicas of the pipeline train on their own
slices of the batch and average gradients, stage by stage, at the end of the step.

Activations between stages may be tuples or dicts of tensors (a padding mask travels with the hidden states). A
decoder model needs no wrappers: a model adapter (:mod:`.adapters`: Hugging Face Llama-like models and GPT-2)
finds its block list and runs its own embeddings, side inputs (position ids, rotary embeddings, causal/padding
mask) and head on the right stages, and checkpoints keep the model's own parameter names.
"""

from .adapters import ADAPTERS, DecoderAdapter, GPT2Adapter, LlamaAdapter, register_adapter
from .model import PipelineParallelModel
from .p2p import StageLink
from .schedule import (
    ALL_SCHEDULES,
    DUALPIPE_V,
    INTERLEAVED,
    SCHEDULES,
    ZBV,
    ZERO_BUBBLE,
    partition_blocks,
    schedule_bubble,
    stage_schedule,
)

__all__ = [
    "ADAPTERS",
    "ALL_SCHEDULES",
    "DUALPIPE_V",
    "INTERLEAVED",
    "SCHEDULES",
    "ZBV",
    "ZERO_BUBBLE",
    "DecoderAdapter",
    "GPT2Adapter",
    "LlamaAdapter",
    "PipelineParallelModel",
    "StageLink",
    "partition_blocks",
    "register_adapter",
    "schedule_bubble",
    "stage_schedule",
]
