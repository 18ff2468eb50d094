"""ZeRO-3 / FSDP: every rank stores 1/N of the parameters; each unit's parameters are gathered just in time.

The wrapped module is cut into *units* (chosen submodules; the root holds whatever no unit claims). A unit's
parameters live as one flat vector per (dtype, trainable) kind, and each rank stores only its shard of it, as an
``nn.Parameter`` of this wrapper: that is what ``model.parameters()`` yields and what the optimizer steps. Shards
are padded (:func:`gpudist.flat.padded_shard`): every rank's is the same size, a multiple of 16 elements, with
zeros after the vector's end, so each gather and reduce-scatter is one even collective and every shard starts
aligned for the kernels' 128-bit loads. The padding is never a parameter's, a checkpoint's or a norm's.

Around each unit's forward the full vector is all-gathered and the module's parameter attributes become views of
it; after the forward it is dropped. Autograd saves those views for backward:
a saved-tensor hook records *where* in the unit they point instead of keeping the memory, and backward
all-gathers the unit again when it first needs them. When all of a unit's gradients are in, one
reduce-scatter leaves each rank the average of its range, accumulated into the shard's ``.grad``. While a
unit computes, the next one (in the order the last forward used them; reversed in backward) is already
being gathered.

Per step and rank: two all-gathers and one reduce-scatter of P (``3 (N-1)/N x P`` on a ring); memory P/N for
parameters, gradients and optimizer state, plus the largest unit or two in flight.

HSDP (``replicate_group``): the same inside a shard group of N ranks (one node), and each reduce-scattered
gradient shard all-reduced over the R replicas of that shard (one rank per node): per step and rank ``3 (N-1)/N x
P`` on the fast links and ``2 (R-1)/R x P/N`` on the slow one, for memory P/N (FSDP2's ``fully_shard`` on a 2D
``(replicate, shard)`` DeviceMesh).

:class:`ZeRO3Optimizer` steps the shards in place (the model already reduce-scattered their gradients).

The package, bottom up: ``layout`` (the fixed part, decided at wrap time: units, groups, offsets, shard ranges),
``collectives`` (every all-gather, reduce-scatter and all-reduce it issues), ``group`` (a :class:`ParamGroup` owns its
per-step state, changed only by its named transitions through the :class:`TrainingState` lifecycle; hpZ's secondary
partition is a part it holds), ``gradients`` (the reduce-scatters in flight, HSDP's replica stage, the flat gradient
buffer), ``step`` (what the groups share: the wrapper's phase, the prefetch order, the saved-tensor hooks, the end of
backward; the module's hooks call it), ``model`` (the wrappers) and ``optimizer``.
"""

from .group import ParamGroup, TrainingState
from .layout import UnitSpec
from .model import FSDPModel, ZeRO3Model
from .optimizer import ZeRO3Optimizer

__all__ = ["FSDPModel", "ParamGroup", "TrainingState", "UnitSpec", "ZeRO3Model", "ZeRO3Optimizer"]
