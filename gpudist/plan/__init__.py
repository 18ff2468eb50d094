"""``gpudist.plan``: which strategy, with which sizes, for a model on a cluster, with memory, traffic and step time.

The planner enumerates every layout of ``world = nodes x devices`` ranks (strategy, dp x tp x pp, ZeRO stage inside
3D, micro-batches and schedule, bucket size, wire dtype, compression), each with every activation checkpointing mode
(none, selective, full; ``checkpointing=`` forces one), and predicts, per rank:

- **memory by category**, the categories of ``model.get_model_metadata()["memory_per_rank"]``: parameters,
  gradients, optimizer state (the fp32 master of low-precision parameters is reported apart as ``master``; the
  library counts it inside ``optimizer_state``), buffers, communication buffers, plus activations (by schedule:
  1F1B keeps at most ``pp`` micro-batches in flight on stage 0, GPipe all ``m``; by checkpointing mode, after
  Korthikanti et al. 2022) and the transient peak (ZeRO-2's
  in-flight buckets, ZeRO-3/FSDP's gathered units). Padding (:func:`gpudist.flat.padded_shard`) is counted where
  the strategies allocate it and also reported on its own.
- **bytes per step** as the backend's counters count them (``bytes_per_step``: the payload of every collective,
  nccl-tests' "size"), and the bytes each rank puts on each link class (intra-node, inter-node) with ring
  algorithms.
- **step time** from a roofline compute model and an alpha-beta communication model, with the overlap each strategy
  achieves (DDP/ZeRO-1/2 hide their gradient buckets behind backward but not the last one; the ZeRO all-gather, the
  pipeline bubble and tensor-parallel all-reduces are exposed; ZeRO-3/FSDP prefetch hides gathers behind compute),
  recomputation's extra forward, and the host's time to issue the step where it exceeds the device's (calibrated
  on an H200 host).

Model states, padding and bytes are computed with the library's own functions (``assign_buckets``,
``partition_buckets``, ``padded_shard``, ``partition_blocks``), so for a model given as an ``nn.Module`` they are
exact (``tests/test_plan.py`` builds each layout and compares with the live counters). Activations and times are
estimates (docs/plan.md says what is and is not modelled). Validation is the constructors' own:
:func:`~gpudist.strategies.tensor.validate_plan` / ``require_divisible`` (tensor parallelism),
:func:`~gpudist.strategies.pipeline.partition_blocks` (stages), :meth:`ParallelLayout.resolve` (the factors).

The package, bottom up: :mod:`~gpudist.plan.model` (the model, the cluster, a configuration),
:mod:`~gpudist.plan.cost` (the memory and time model), :mod:`~gpudist.plan.codegen` (a configuration as code, and
:func:`build`), :mod:`~gpudist.plan.report` (:class:`PlanResult`: the table, code, command and JSON),
:mod:`~gpudist.plan.calibrate` (:func:`measure_cluster`), :mod:`~gpudist.plan.search` (:func:`enumerate_configs`,
:func:`plan`), :mod:`~gpudist.plan.cli` (``gpudist plan``).
"""

from .calibrate import measure_cluster
from .cli import add_arguments as add_arguments
from .cli import run_from_args as run_from_args
from .codegen import build
from .cost import Prediction, predict
from .model import PRESETS, Cluster, Config, ModelSpec, ParamSpec
from .model import TPLayer as TPLayer
from .report import PlanResult
from .search import enumerate_configs, plan

__all__ = [
    "PRESETS",
    "Cluster",
    "Config",
    "ModelSpec",
    "ParamSpec",
    "PlanResult",
    "Prediction",
    "build",
    "enumerate_configs",
    "measure_cluster",
    "plan",
    "predict",
]
