"""``gpudist.plan``: which strategy, with which sizes, for a model on a cluster, with memory, traffic and step time.

The planner enumerates every layout of ``world = nodes x devices`` ranks (strategy, dp x tp x pp, ZeRO stage inside
3D, micro-batches and schedule, bucket size, wire dtype, compression) and predicts, per rank:

- **memory by category**, the categories of ``model.get_model_metadata()["memory_per_rank"]``: parameters,
  gradients, optimizer state (the fp32 master of low-precision parameters is reported apart as ``master``; the
  library counts it inside ``optimizer_state``), buffers, communication buffers, plus activations (by schedule:
  1F1B keeps at most ``pp`` micro-batches in flight on stage 0, GPipe all ``m``) and the transient peak (ZeRO-2's
  in-flight buckets, ZeRO-3/FSDP's gathered units). Padding (:func:`gpudist.flat.padded_shard`) is counted where
  the strategies allocate it and also reported on its own.
- **bytes per step** as the backend's counters count them (``bytes_per_step``: the payload of every collective,
  nccl-tests' "size"), and the bytes each rank puts on each link class (intra-node, inter-node) with ring
  algorithms.
- **step time** from a roofline compute model and an alpha-beta communication model, with the overlap each strategy
  achieves (DDP/ZeRO-1/2 hide their gradient buckets behind backward but not the last one; the ZeRO all-gather, the
  pipeline bubble and tensor-parallel all-reduces are exposed; ZeRO-3/FSDP prefetch hides gathers behind compute).

Model states, padding and bytes are computed with the library's own functions (``assign_buckets``,
``partition_buckets``, ``padded_shard``, ``partition_blocks``), so for a model given as an ``nn.Module`` they are
exact (``tests/test_plan.py`` builds each layout and compares with the live counters). Activations and times are
estimates (docs/plan.md says what is and is not modelled). Validation is the constructors' own:
:func:`~gpudist.strategies.tensor.validate_plan` / ``require_divisible`` (tensor parallelism),
:func:`~gpudist.strategies.pipeline.partition_blocks` (stages), :meth:`ParallelLayout.resolve` (the factors).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .flat import assign_buckets, padded_shard, vector_align
from .kernels import FlatLayout
from .strategies.layout import ParallelLayout
from .strategies.pipeline.schedule import (
    ALL_SCHEDULES,
    activations_alive,
    check_schedule,
    holder,
    partition_blocks,
    placement,
    schedule_bubble,
    stage_schedule,
    virtual_stage,
)
from .strategies.tensor.layers import require_divisible

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

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------------------------------------------------
# The model: its parameters in parameters() order, and the shape numbers activations and traffic need


@dataclass(frozen=True)
class ParamSpec:
    """One parameter (a tied one once, at its first place in ``parameters()`` order)."""

    name: str
    numel: int
    block: int
    """Index of the pipeline block holding it (the first, for a tied parameter)."""
    unit: str
    """The FSDP unit (``FSDPModel``'s default policy: an entry of an ``nn.ModuleList``; "" is the root)."""
    module: str
    """The module that holds it itself (``ZeRO3Model``'s unit)."""
    split: bool = False
    """Whether tensor parallelism splits it over the tensor group (else each tensor rank holds all of it)."""
    tied_blocks: tuple[int, ...] = ()
    """Other pipeline blocks that use it (a head tied to the embedding)."""


@dataclass(frozen=True)
class TPLayer:
    """A layer tensor parallelism converts: its style and widths (for the activation all-reduces)."""

    style: str
    in_features: int
    out_features: int


@dataclass
class ModelSpec:
    """What the planner needs of a model. Build it with :meth:`from_module`, :meth:`from_hf_config`,
    :meth:`from_sizes` or :meth:`preset`."""

    name: str
    params: list[ParamSpec]
    block_costs: list[int]
    """Parameter count of each pipeline block (a parameter shared with an earlier block counts once, as the
    pipeline's balancer counts it)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    tp_layers: list[TPLayer] = field(default_factory=list)
    """Per transformer block the layers tensor parallelism converts; ``tp_head`` for the embedding and head."""
    tp_check: Callable[[int], None] | None = None
    """Raises ValueError naming why a tensor-parallel size cannot split this model (the constructors' check)."""
    buffer_bytes: int = 0
    param_tensors: int = 0
    """Parameter tensors (torch's Adam keeps a 4-byte ``step`` tensor for each)."""
    tensor_parallel_embed: bool = True
    """Whether the vocabulary embedding and head are split by vocabulary under tensor parallelism."""
    tied_head: bool = False
    layer_blocks: tuple[int, ...] = ()
    """Indices of the pipeline blocks that are transformer layers (their tensor-parallel collectives)."""

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    # -- constructors ---------------------------------------------------------------------------------------------

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        *,
        seq_len: int | None = None,
        blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
        tp_plan: Any = None,
        name: str | None = None,
    ) -> ModelSpec:
        """Describe an ``nn.Module`` exactly: every parameter (sizes, FSDP units, ZeRO-3 units, pipeline blocks).

        Args:
            module: The model (materialized or on the ``meta`` device).
            seq_len: Tokens per sequence (default: ``module.seq_len``, ``config.max_position_embeddings``, else 1).
            blocks: The pipeline's blocks (as ``PipelineParallelModel(blocks=...)``); default: the module itself
                when it is an ``nn.Sequential``, else the entries of its largest ``nn.ModuleList``, with the
                parameters before them in the first block and those after in the last.
            tp_plan: The tensor-parallel plan (as ``TensorParallelModel``'s ``plan``); default ``"auto"`` for a
                Hugging Face model. None: tensor parallelism is not planned.
            name: Shown in the table (default: the class name).
        """
        config = getattr(module, "config", None)
        if tp_plan is None and getattr(config, "base_model_tp_plan", None):
            tp_plan = "auto"
        named = list(module.named_parameters())
        owner = {}
        for mod_name, sub in module.named_modules():
            for _attr, p in sub._parameters.items():
                if p is not None:
                    owner.setdefault(id(p), mod_name)
        units = _fsdp_units(module)
        block_of, pipe_blocks = _block_index(module, blocks)
        uses: dict[int, set[int]] = {}
        for b, blk in enumerate(pipe_blocks):
            for p in blk.parameters():
                uses.setdefault(id(p), set()).add(b)
        splits = _tp_splits(module, tp_plan)
        params = []
        for n, p in named:
            blocks_of = sorted(uses.get(id(p), {block_of(n)}))
            params.append(
                ParamSpec(
                    n,
                    p.numel(),
                    blocks_of[0],
                    next((u for u in units if n.startswith(u + ".")), ""),
                    owner.get(id(p), ""),
                    n in splits,
                    tuple(blocks_of[1:]),
                )
            )
        seen: set[int] = set()
        costs = []
        for blk in pipe_blocks:
            costs.append(sum(p.numel() for p in dict.fromkeys(blk.parameters()) if id(p) not in seen))
            seen.update(id(p) for p in blk.parameters())
        hidden = _first_int(module, config, ("hidden_size", "n_embd", "d_model"), 0)
        heads = _first_int(module, config, ("num_attention_heads", "n_head", "n_heads"), 1)
        kv = _first_int(module, config, ("num_key_value_heads",), heads) or heads
        body = max((m for m in module.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
        body_ids = {id(b) for b in body} if body is not None else set()
        layer_blocks = tuple(i for i, b in enumerate(pipe_blocks) if id(b) in body_ids)
        layers = _first_int(module, config, ("num_hidden_layers", "n_layer"), len(layer_blocks) or len(pipe_blocks))
        if not hidden:
            hidden = _guess_hidden(module)
        vocab = _first_int(module, config, ("vocab_size",), 0)
        if not vocab:
            emb = [m for m in module.modules() if isinstance(m, nn.Embedding)]
            vocab = emb[0].num_embeddings if emb else 0
        seq = seq_len or getattr(module, "seq_len", None) or getattr(config, "max_position_embeddings", None) or 1
        tp_layers, tp_check = [], None
        if tp_plan is not None:
            tp_layers = _tp_layers(module, tp_plan)

            def tp_check(tp: int, module=module, plan=tp_plan) -> None:
                from .strategies.tensor.plans import validate_plan

                validate_plan(module, plan, tp)

        return cls(
            name=name or type(module).__name__,
            params=params,
            block_costs=costs,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv,
            ffn=_first_int(module, config, ("intermediate_size", "n_inner"), 4 * hidden) or 4 * hidden,
            vocab=vocab,
            seq_len=int(seq),
            tp_layers=tp_layers,
            tp_check=tp_check,
            buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
            param_tensors=len(named),
            tied_head=any(p.tied_blocks for p in params),
            layer_blocks=layer_blocks,
        )

    @classmethod
    def from_hf_config(cls, config: Any, *, seq_len: int | None = None, name: str | None = None) -> ModelSpec:
        """A Hugging Face decoder config (Llama-, Mistral-, Qwen- or GPT-2-like): sizes only, no weights."""
        get = lambda *keys, default=None: next(
            (getattr(config, k) for k in keys if getattr(config, k, None) is not None), default
        )
        hidden = get("hidden_size", "n_embd")
        heads = get("num_attention_heads", "n_head")
        gpt2 = getattr(config, "model_type", "") == "gpt2"
        return cls.from_sizes(
            layers=get("num_hidden_layers", "n_layer"),
            hidden=hidden,
            heads=heads,
            kv_heads=get("num_key_value_heads", default=heads),
            ffn=get("intermediate_size", "n_inner", default=4 * hidden),
            vocab=get("vocab_size"),
            seq_len=seq_len or get("max_position_embeddings", "n_positions", default=2048),
            tied=bool(get("tie_word_embeddings", default=gpt2)),
            gated=not gpt2,
            name=name or getattr(config, "model_type", "hf"),
        )

    @classmethod
    def from_sizes(
        cls,
        *,
        layers: int,
        hidden: int,
        heads: int,
        vocab: int,
        seq_len: int,
        kv_heads: int | None = None,
        ffn: int | None = None,
        tied: bool = False,
        gated: bool = True,
        name: str = "model",
    ) -> ModelSpec:
        """A decoder from its sizes: Llama's layout when ``gated`` (RMSNorm, q/k/v/o, SwiGLU gate/up/down, no
        biases), GPT-2's otherwise (LayerNorms, fused qkv and MLP with biases, learned positions)."""
        kv_heads = kv_heads or heads
        ffn = ffn or (int(8 * hidden / 3 + 255) // 256 * 256 if gated else 4 * hidden)
        head_dim = hidden // heads
        kv = kv_heads * head_dim
        params: list[ParamSpec] = []

        def add(name: str, numel: int, block: int, unit: str, split: bool, tied=()):
            params.append(ParamSpec(name, numel, block, unit, name.rpartition(".")[0], split, tied))

        add("embed_tokens.weight", vocab * hidden, 0, "", True, (layers + 1,) if tied else ())
        if not gated:
            add("wpe.weight", seq_len * hidden, 0, "", False)
        tp_layers: list[TPLayer] = []
        for i in range(layers):
            u, b = f"layers.{i}", i + 1
            if gated:
                add(f"{u}.input_layernorm.weight", hidden, b, u, False)
                add(f"{u}.self_attn.q_proj.weight", hidden * hidden, b, u, True)
                add(f"{u}.self_attn.k_proj.weight", kv * hidden, b, u, True)
                add(f"{u}.self_attn.v_proj.weight", kv * hidden, b, u, True)
                add(f"{u}.self_attn.o_proj.weight", hidden * hidden, b, u, True)
                add(f"{u}.post_attention_layernorm.weight", hidden, b, u, False)
                add(f"{u}.mlp.gate_proj.weight", ffn * hidden, b, u, True)
                add(f"{u}.mlp.up_proj.weight", ffn * hidden, b, u, True)
                add(f"{u}.mlp.down_proj.weight", ffn * hidden, b, u, True)
            else:
                add(f"{u}.ln_1.weight", hidden, b, u, False)
                add(f"{u}.ln_1.bias", hidden, b, u, False)
                add(f"{u}.attn.c_attn.weight", 3 * hidden * hidden, b, u, True)
                add(f"{u}.attn.c_attn.bias", 3 * hidden, b, u, True)
                add(f"{u}.attn.c_proj.weight", hidden * hidden, b, u, True)
                add(f"{u}.attn.c_proj.bias", hidden, b, u, False)
                add(f"{u}.ln_2.weight", hidden, b, u, False)
                add(f"{u}.ln_2.bias", hidden, b, u, False)
                add(f"{u}.mlp.c_fc.weight", ffn * hidden, b, u, True)
                add(f"{u}.mlp.c_fc.bias", ffn, b, u, True)
                add(f"{u}.mlp.c_proj.weight", ffn * hidden, b, u, True)
                add(f"{u}.mlp.c_proj.bias", hidden, b, u, False)
        if gated:
            tp_layers = [
                *(TPLayer("colwise", hidden, n) for n in (hidden, kv, kv)),
                TPLayer("rowwise", hidden, hidden),
                *(TPLayer("colwise", hidden, ffn) for _ in range(2)),
                TPLayer("rowwise", ffn, hidden),
            ]
        else:
            tp_layers = [
                TPLayer("colwise", hidden, 3 * hidden),
                TPLayer("rowwise", hidden, hidden),
                TPLayer("colwise", hidden, ffn),
                TPLayer("rowwise", ffn, hidden),
            ]
        tp_layers = [TPLayer("vocab", vocab, hidden), *(tp_layers * layers), TPLayer("vocab_output", hidden, vocab)]
        add("norm.weight", hidden, layers + 1, "", False)
        if not gated:
            add("norm.bias", hidden, layers + 1, "", False)
        if not tied:
            add("lm_head.weight", vocab * hidden, layers + 1, "", True)
        costs = [0] * (layers + 2)
        for p in params:
            costs[p.block] += p.numel

        def tp_check(tp: int) -> None:
            require_divisible(f"{name}: num_attention_heads", heads, tp)
            require_divisible(f"{name}: num_key_value_heads", kv_heads, tp)
            require_divisible(f"{name}: vocab_size", vocab, tp)
            require_divisible(f"{name}: intermediate_size", ffn, tp)

        return cls(
            name=name,
            params=params,
            block_costs=costs,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            ffn=ffn,
            vocab=vocab,
            seq_len=seq_len,
            tp_layers=tp_layers,
            tp_check=tp_check,
            param_tensors=len(params),
            tied_head=tied,
            layer_blocks=tuple(range(1, layers + 1)),
        )

    @classmethod
    def preset(cls, name: str, seq_len: int | None = None) -> ModelSpec:
        """A named size (:data:`PRESETS`), e.g. ``"llama-7b-like"``."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
        sizes = dict(PRESETS[name])
        if seq_len:
            sizes["seq_len"] = seq_len
        return cls.from_sizes(name=name, **sizes)


PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-like": dict(layers=12, hidden=768, heads=12, vocab=50257, seq_len=1024, ffn=3072, tied=True, gated=False),
    "gpt2-xl-like": dict(layers=48, hidden=1600, heads=25, vocab=50257, seq_len=1024, ffn=6400, tied=True, gated=False),
    "llama-1b-like": dict(
        layers=16, hidden=2048, heads=32, kv_heads=8, vocab=128256, seq_len=4096, ffn=8192, tied=True
    ),
    "llama-7b-like": dict(layers=32, hidden=4096, heads=32, kv_heads=32, vocab=32000, seq_len=4096, ffn=11008),
    "llama-13b-like": dict(layers=40, hidden=5120, heads=40, kv_heads=40, vocab=32000, seq_len=4096, ffn=13824),
    "llama-70b-like": dict(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=32000, seq_len=4096, ffn=28672),
}
"""Named model sizes (Llama-2 7B/13B/70B, Llama-3.2 1B, GPT-2 and GPT-2 XL shapes; sizes only, no weights)."""


def _first_int(module, config, keys, default):
    for source in (config, module):
        for k in keys:
            v = getattr(source, k, None) if source is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return default


def _guess_hidden(module: nn.Module) -> int:
    emb = [m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding)]
    if emb:
        return emb[0]
    lin = [m.in_features for m in module.modules() if isinstance(m, nn.Linear)]
    return max(lin) if lin else 1


def _fsdp_units(module: nn.Module) -> list[str]:
    """FSDPModel's default policy: each entry of every nn.ModuleList (outermost first) is a unit."""
    units: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and not any(name.startswith(u + ".") for u in units):
            units += [f"{name}.{k}" if name else k for k in sub._modules]
    return units


def _block_index(module: nn.Module, blocks) -> tuple[Callable[[str], int], list[nn.Module]]:
    """The pipeline blocks of ``module`` and, for a parameter name, the block holding it."""
    if blocks is not None:
        seq = list(blocks(module))
    elif isinstance(module, nn.Sequential):
        seq = list(module)
    else:
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            return (lambda n: 0), [module]
        body = max(lists, key=len)
        ids = {id(p) for p in body.parameters()}
        first = set()
        for p in module.parameters():
            if id(p) in ids:
                break
            first.add(id(p))
        rest = [p for p in module.parameters() if id(p) not in ids]
        pre = nn.ParameterList([p for p in rest if id(p) in first])
        post = nn.ParameterList([p for p in rest if id(p) not in first])
        seq = [pre, *body, post]
    index = {id(p): b for b, blk in reversed(list(enumerate(seq))) for p in blk.parameters()}
    named = dict(module.named_parameters())
    return (lambda n: index.get(id(named[n]), 0)), seq


def _tp_splits(module: nn.Module, plan) -> set[str]:
    """Names of the parameters the plan splits (every other one is replicated over the tensor group)."""
    if plan is None:
        return set()
    from .strategies.tensor.plans import expand_plan, hf_plan, style_split

    # style_split is the tensor-parallel constructors' own rule for which parameter a style splits: used here
    # rather than restated.
    styles = hf_plan(module) if plan == "auto" else plan(module) if callable(plan) else dict(plan)
    styles = expand_plan(module, styles)
    out = set()
    for owner, sub in module.named_modules():
        for attr, p in sub._parameters.items():
            if p is not None and style_split(styles.get(owner), attr) is not None:
                out.add(f"{owner}.{attr}" if owner else attr)
    return out


def _tp_layers(module: nn.Module, plan) -> list[TPLayer]:
    from .strategies.tensor.plans import expand_plan, hf_plan

    styles = hf_plan(module) if plan == "auto" else plan(module) if callable(plan) else dict(plan)
    styles = expand_plan(module, styles)
    out = []
    for name, style in styles.items():
        sub = module.get_submodule(name)
        if isinstance(sub, nn.Linear):
            out.append(TPLayer(style, sub.in_features, sub.out_features))
        elif isinstance(sub, nn.Embedding):
            out.append(TPLayer(style, sub.num_embeddings, sub.embedding_dim))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The cluster


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical devices, and the links between them."""

    nodes: int = 1
    devices_per_node: int = 8
    device_memory: float = 80e9
    """Bytes of memory per device."""
    device_flops: float = 400e12
    """Dense matmul FLOP/s per device in the compute dtype, as achieved (H100 bf16: ~400e12 of 989e12 peak)."""
    memory_bandwidth: float = 2.5e12
    """Bytes/s of device memory (the optimizer step and element-wise passes are bound by it)."""
    intra_bandwidth: float = 150e9
    """Bytes/s a rank's ring collectives reach inside a node (NVLink: bus bandwidth per GPU)."""
    inter_bandwidth: float = 25e9
    """Bytes/s per rank across nodes (e.g. one 200 Gb/s NIC per GPU)."""
    intra_latency: float = 10e-6
    inter_latency: float = 30e-6
    chunked_overlap: bool = False
    """Whether the transport sends ZeRO's updated range in per-rank chunks (Gloo, MPI, in-memory) rather than one
    all-gather (NCCL): it changes the counted bytes of the parameter gather (real elements vs padded shards)."""
    usable_memory: float = 0.9
    """Fraction of device memory a plan may use (allocator fragmentation, the framework's own, kernels' workspace)."""
    step_overhead: float = 0.0
    """Seconds per step that no term models (Python dispatch of a small model on CPU; calibrated by --measure)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


def _parse_bytes(text: str | float | int) -> float:
    if isinstance(text, (int, float)):
        return float(text)
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    if t and t[-1] in units:
        return float(t[:-1]) * units[t[-1]]
    return float(t)


# ---------------------------------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class Config:
    """One way to run: the strategy and every setting that changes memory, traffic or time."""

    strategy: str
    """ddp, zero1, zero2, zero3, fsdp, pipeline, tensor or hybrid."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    """The data-parallel optimizer inside pipeline/hybrid (0: replicated, 1: ZeRO-1, 2: ZeRO-2)."""
    micro_batches: int = 1
    schedule: str = "1f1b"
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    """The first (last layers') bucket's size, ``ShardingConfiguration.first_bucket_mb``."""
    comm_dtype: str | None = None
    """The gradients' wire dtype (None: the parameters')."""
    compression: str | None = None
    checkpointing: bool = False

    def describe(self) -> str:
        parts = [self.strategy, f"dp{self.dp}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts += [f"pp{self.pp}", f"m{self.micro_batches}", self.schedule]
        if self.strategy in ("pipeline", "hybrid") and self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.comm_dtype:
            parts.append(f"wire={self.comm_dtype}")
        if self.compression:
            parts.append(self.compression)
        return " ".join(parts)


@dataclass
class Prediction:
    """Per-rank predictions for one configuration (the most loaded rank: pipeline stage 0)."""

    config: Config
    fits: bool
    why: str
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes by category (see the module docstring); ``total`` is the peak."""
    bytes_per_step: int = 0
    """What the rank's ``get_model_metadata()["bytes_per_step"]`` counts (stage 0's for a pipeline)."""
    bytes_by_stage: list[int] = field(default_factory=list)
    link_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes this rank sends per step on each link class with ring algorithms (``intra``, ``inter``)."""
    step_time: float = math.inf
    time_parts: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "config": self.config.describe(),
            **asdict(self.config),
            "fits": self.fits,
            "why": self.why,
            "memory": self.memory,
            "bytes_per_step": self.bytes_per_step,
            "bytes_by_stage": self.bytes_by_stage,
            "link_bytes": self.link_bytes,
            "step_time_s": self.step_time if math.isfinite(self.step_time) else None,
            "time_parts_s": self.time_parts,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(
    model: ModelSpec,
    world: int,
    global_batch: int,
    *,
    devices_per_node: int | None = None,
    checkpointing: bool = False,
    comm_dtypes: Sequence[str | None] = (None, "bf16"),
    compressions: Sequence[str | None] = (None, "int8"),
    bucket_mbs: Sequence[float] = (25.0,),
    micro_batch_factors: Sequence[int] = (1, 2, 4, 8),
) -> list[tuple[Config, str | None]]:
    """Every configuration for ``world`` ranks, each with the reason it cannot run (None when it can)."""
    out: list[tuple[Config, str | None]] = []
    gpn = devices_per_node or world
    for tp in _divisors(world):
        if tp > 1 and (tp > gpn or tp & (tp - 1)):
            continue  # tensor groups stay inside a node, in powers of two
        why_tp = None
        if tp > 1:
            if model.tp_check is None:
                why_tp = "no tensor-parallel plan for this model"
            else:
                try:
                    model.tp_check(tp)
                except (ValueError, TypeError) as e:
                    why_tp = str(e)
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            ParallelLayout.resolve(world, pp, tp, dp)  # the constructors' check of the factors
            why = why_tp
            if why is None and pp > 1:
                try:
                    partition_blocks(model.block_costs, pp)
                except ValueError as e:
                    why = str(e)
            if why is None and global_batch % dp:
                why = f"global batch {global_batch} does not split over dp={dp} replicas"
            base = dict(dp=dp, tp=tp, pp=pp, checkpointing=checkpointing)
            if tp == 1 and pp == 1:
                for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
                    for bucket in bucket_mbs:
                        for wire in comm_dtypes:
                            out.append((Config(strategy, bucket_mb=bucket, comm_dtype=wire, **base), why))
                        if strategy in ("ddp", "zero1", "zero2"):
                            for comp in compressions:
                                if comp is not None:
                                    out.append((Config(strategy, bucket_mb=bucket, compression=comp, **base), why))
                continue
            if pp == 1:
                out.append((Config("tensor", **base), why))
                continue
            per_replica = global_batch // dp if not global_batch % dp else 0
            strategy = "pipeline" if tp == 1 else "hybrid"
            stages = (0, 1, 2) if dp > 1 else (0,)
            for factor in micro_batch_factors:
                m = pp * factor
                why_m = why
                if why_m is None and (per_replica < m or per_replica % m):
                    why_m = f"batch per replica {per_replica} is not a multiple of micro_batches={m}"
                for schedule in ALL_SCHEDULES:
                    why_s = why_m
                    if why_s is None:
                        try:  # the constructors' checks: interleaved m a multiple of pp, dualpipev m >= 2 pp, blocks
                            v = check_schedule(schedule, pp, m, None)
                            partition_blocks(model.block_costs, pp * v)
                        except ValueError as e:
                            why_s = str(e)
                    for zs in stages:
                        cfg = Config(strategy, micro_batches=m, schedule=schedule, zero_stage=zs, **base)
                        out.append((cfg, why_s))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Prediction


class _Meta:
    """What assign_buckets reads of a parameter: numel, element size, dtype and device (no memory)."""

    __slots__ = ("_numel", "device", "dtype")

    def __init__(self, numel: int, dtype: torch.dtype):
        self._numel, self.dtype, self.device = numel, dtype, "meta"

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return _BYTES[self.dtype]


def _buckets(
    numels: list[int], dtype: torch.dtype, bucket_mb: float, first_mb: float = 1.0, aligned: bool = False
) -> list[int]:
    """Elements of each gradient bucket in launch order (DDP/ZeRO-1/ZeRO-2's :func:`assign_buckets`); ``aligned``:
    with DDP's padding, every gradient at a 16-byte start (:func:`~gpudist.flat.vector_align`)."""
    metas = [_Meta(n, dtype) for n in numels]
    groups = assign_buckets(metas, int(bucket_mb * (1 << 20)), int(first_mb * (1 << 20)))
    align = vector_align(dtype) if aligned else 1
    return [FlatLayout([(numels[i],) for i in sorted(g)], align).total for g in groups]


def _ring(op: str, payload: float, n: int) -> float:
    """Bytes one rank sends for a ring collective of ``payload`` (the counter's bytes) over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return payload * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)


def _comm_time(op: str, payload: float, n: int, bw: float, lat: float, calls: int = 1) -> float:
    if n <= 1 or payload <= 0:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return _ring(op, payload, n) / bw + steps * lat * calls


def _compressed_payload(kind: str, numel: int, n: int) -> float:
    """Counted bytes of one compressed all-reduce of ``numel`` fp32 gradients (docs/strategies.md's wire formats)."""
    if kind.startswith("topk"):
        ratio = float(kind.partition(":")[2] or 0.01)
        return n * 8 * max(1, int(ratio * numel))  # all-gather of (values, indices)
    per = {"int8": 1 + 4 / 256, "1bit": 1 / 8 + 4 / 256}.get(kind, 4)
    return 2 * numel * per  # all-to-all of compressed chunks, then an all-gather of the reduced ones


@dataclass
class _Work:
    """Inputs of one prediction."""

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    optimizer: str
    chunked: bool


def predict(
    config: Config,
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype | None = None,
    optimizer: str = "adam",
) -> Prediction:
    """Memory by category, bytes per step and step time of ``config`` on the most loaded rank (see the module
    docstring). ``optimizer``: "adam" (K = 2 state tensors; fused in ZeRO, torch's with a ``step`` tensor per
    parameter elsewhere), "sgd" (momentum, K = 1) or "sgd-plain" (K = 0)."""
    w = _Work(
        model, cluster, global_batch, param_dtype, compute_dtype or param_dtype, optimizer, cluster.chunked_overlap
    )
    if config.strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        return _predict_data_parallel(config, w)
    return _predict_model_parallel(config, w)


def _k(optimizer: str) -> int:
    return {"adam": 2, "adamw": 2, "sgd": 1, "sgd-plain": 0}[optimizer]


def _activation_bytes(w: _Work, cfg: Config, samples: int, layers: int, with_logits: bool) -> float:
    """Activations autograd keeps for ``samples`` sequences through ``layers`` transformer blocks (Korthikanti et
    al. 2022 without sequence parallelism, flash-style attention: no s x s scores kept), divided by tp where the
    layers are split; with checkpointing each block keeps only its input, plus one block recomputed at a time."""
    m, a = w.model, _BYTES[w.compute_dtype]
    s, h, t = m.seq_len, max(m.hidden, 1), cfg.tp
    tokens = samples * s
    per_layer = tokens * h * a * (5 + (12 + 2 * m.ffn / h * 1.5) / t)
    kept = layers * tokens * h * a + per_layer if cfg.checkpointing else layers * per_layer
    if with_logits and m.vocab:
        kept += tokens * m.vocab / t * (a + 4)  # the logits and the loss's float32 softmax
    return kept


def _flops(w: _Work, cfg: Config, samples: float, params: float) -> float:
    """Training FLOPs for ``samples`` sequences through ``params`` parameters (6 per parameter per token, 8 with
    recomputation), plus attention's scores (12 L h s per token)."""
    m = w.model
    tokens = samples * m.seq_len
    per_param = 8 if cfg.checkpointing else 6
    attention = 12 * m.layers * m.hidden * m.seq_len * (params / max(m.numel, 1))
    return tokens * (per_param * params + attention)


def _links(cfg: Config, cluster: Cluster) -> dict[str, tuple[str, float, float]]:
    """For each group (tensor, data, pipeline): its link class, bandwidth and latency, from the layout (tensor
    fastest, then data, then pipeline; consecutive ranks share a node)."""
    gpn = cluster.devices_per_node
    out = {}
    for group, span in (("tensor", cfg.tp), ("data", cfg.tp * cfg.dp), ("pipeline", cfg.tp * cfg.dp * cfg.pp)):
        inter = span > gpn and cluster.nodes > 1
        out[group] = (
            ("inter", cluster.inter_bandwidth, cluster.inter_latency)
            if inter
            else ("intra", cluster.intra_bandwidth, cluster.intra_latency)
        )
    return out


def _data_parallel_traffic(
    w: _Work, cfg: Config, numels: list[int], n: int
) -> tuple[int, dict[str, float], list[tuple[str, float, int]]]:
    """Counted bytes, memory extras and the collectives (op, payload, calls) of DDP/ZeRO-1/ZeRO-2 over ``n`` ranks
    for a flat list of trainable parameters (one data-parallel group's view of them)."""
    pbytes = _BYTES[w.param_dtype]
    wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
    aligned = cfg.strategy == "ddp"  # DDPModel's buckets (hybrid's DDPOptimizer and ZeRO pack theirs back to back)
    buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb, aligned)
    numel = sum(numels)
    ops: list[tuple[str, float, int]] = []
    counted = 0
    extra: dict[str, float] = {}
    if n <= 1:
        return 0, extra, ops
    stage = {"ddp": 0, "zero1": 1, "zero2": 2}.get(cfg.strategy, cfg.zero_stage)
    if cfg.compression:
        payload = sum(_compressed_payload(cfg.compression, b, n) for b in buckets)
        ops.append(("all_reduce_sync", payload / 2, len(buckets)))
        counted += int(payload)
    elif stage == 2:
        rs = sum(n * padded_shard(b, n) * wire for b in buckets)
        ops.append(("reduce_scatter", rs, len(buckets)))
        counted += rs
    else:
        ar = (sum(buckets) if aligned else numel) * wire
        ops.append(("all_reduce", ar, len(buckets)))
        counted += ar
    if stage == 1:
        shard = padded_shard(numel, n)
        gather = n * shard * pbytes
        ops.append(("all_gather", gather, 1))
        counted += gather + 8
    elif stage == 2:
        gather = numel * pbytes if w.chunked else sum(n * padded_shard(b, n) * pbytes for b in buckets)
        ops.append(("all_gather", gather, len(buckets)))
        counted += gather + 8
    return counted, extra, ops


def _predict_data_parallel(cfg: Config, w: _Work) -> Prediction:
    m, cl, n = w.model, w.cluster, cfg.dp
    numels = [p.numel for p in m.params]
    numel = sum(numels)
    pbytes = _BYTES[w.param_dtype]
    lowp = pbytes < 4
    k = _k(w.optimizer)
    mem: dict[str, float] = {"buffers": m.buffer_bytes}
    padding = 0
    if cfg.strategy in ("ddp", "zero1", "zero2"):
        counted, _, ops = _data_parallel_traffic(w, cfg, numels, n)
        if cfg.strategy == "ddp":
            buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb, aligned=True)
            mem["parameters"] = numel * pbytes
            mem["gradients"] = sum(buckets) * pbytes  # the buckets, each gradient at a 16-byte start
            torch_state = k * numel * pbytes + (4 * m.param_tensors if w.optimizer.startswith("adam") else 0)
            mem["optimizer_state"] = torch_state
            mem["master"] = 0
            wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
            mem["communication_buffers"] = sum(buckets) * wire if wire != pbytes else 0
        else:
            buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb)
            if cfg.strategy == "zero1":
                owned = padded_shard(numel, n)
                padding = n * owned - numel
                mem["parameters"] = (numel + padding) * pbytes
                mem["gradients"] = (numel + padding) * pbytes
            else:
                owned = sum(padded_shard(b, n) for b in buckets)
                padding = owned * n - numel
                mem["parameters"] = numel * pbytes
                mem["gradients"] = owned * pbytes
                wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
                # up to three bucket-sized send buffers during backward (two reduce-scatters in flight, one filling)
                mem["transient"] = sum(sorted((n * padded_shard(b, n) * wire for b in buckets), reverse=True)[:3])
            state_bytes = 4 if lowp else pbytes
            mem["optimizer_state"] = k * owned * state_bytes
            mem["master"] = owned * 4 if lowp else 0
        if cfg.compression:
            residual = numel * 4 + (0 if cfg.compression.startswith("topk") else -(-numel // n) * 4)
            mem["communication_buffers"] = mem.get("communication_buffers", 0) + residual
    else:  # zero3 / fsdp: one flat vector per unit, padded shards
        groups: dict[str, int] = {}
        for p in m.params:
            key = p.unit if cfg.strategy == "fsdp" else p.module
            groups[key] = groups.get(key, 0) + p.numel
        if cfg.strategy == "fsdp":  # the root first, then the units in order
            order = [""] + [u for u in dict.fromkeys(p.unit for p in m.params) if u]
        else:
            order = list(dict.fromkeys(p.module for p in m.params))
        sizes = [groups.get(u, 0) for u in order if groups.get(u, 0)]
        shards = [padded_shard(s, n) for s in sizes]
        owned = sum(shards)
        padding = owned * n - numel
        wire = _BYTES[_DTYPES[cfg.comm_dtype]] if cfg.comm_dtype else pbytes
        mem["parameters"] = owned * pbytes
        mem["gradients"] = owned * pbytes
        mem["optimizer_state"] = k * owned * (4 if lowp else pbytes)
        mem["master"] = owned * 4 if lowp else 0
        mem["transient"] = sum(sorted((n * s * pbytes for s in shards), reverse=True)[:2]) + max(
            [n * s * wire for s in shards] or [0]
        )
        gathered = sum(n * s for s in shards)
        counted = (2 * gathered * pbytes + gathered * wire + 8) if n > 1 else 0
        ops = [("all_gather", 2 * gathered * pbytes, 2 * len(shards)), ("reduce_scatter", gathered * wire, len(shards))]
    samples = w.global_batch / n
    mem["activations"] = _activation_bytes(w, cfg, math.ceil(samples), m.layers, True)
    mem["padding"] = padding * pbytes
    pred = Prediction(cfg, True, "", bytes_per_step=int(counted))
    pred.bytes_by_stage = [pred.bytes_per_step]
    link, bw, lat = _links(cfg, cl)["data"]
    pred.link_bytes = {"intra": 0, "inter": 0}
    comm_times = {}
    for op, payload, calls in ops:
        base = op.removesuffix("_sync")
        pred.link_bytes[link] += int(_ring(base, payload, n))
        comm_times[op] = comm_times.get(op, 0.0) + _comm_time(base, payload, n, bw, lat, calls)
    compute = _flops(w, cfg, samples, numel) / cl.device_flops
    backward = compute * (2 / 3)
    opt_bytes = (
        mem["optimizer_state"] + mem["master"] + 3 * mem["gradients"] / max(1, n if cfg.strategy != "ddp" else 1)
    )
    optimizer_time = opt_bytes * 2 / cl.memory_bandwidth
    if cfg.strategy in ("zero3", "fsdp"):
        comm = sum(comm_times.values())
        first = comm / max(1, 2 * len(ops))
        exposed = max(0.0, comm - compute) + first
        parts = {"compute": compute, "exposed_comm": exposed, "optimizer": optimizer_time}
    else:
        grad_comm = comm_times.get("all_reduce", 0.0) + comm_times.get("reduce_scatter", 0.0)
        nbuckets = max(1, len(_buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb)))
        hidden = max(0.0, grad_comm - grad_comm / nbuckets - backward)  # the last bucket is never hidden
        exposed = hidden + grad_comm / nbuckets + comm_times.get("all_reduce_sync", 0.0)
        exposed += comm_times.get("all_gather", 0.0)
        if cfg.compression:
            exposed += numel * 4 * 3 / cl.memory_bandwidth  # compress, decompress, error feedback passes
        parts = {"compute": compute, "exposed_comm": exposed, "optimizer": optimizer_time}
    parts["overhead"] = cl.step_overhead
    pred.time_parts = parts
    pred.step_time = sum(parts.values())
    pred.memory = _finish_memory(mem)
    return pred


def _finish_memory(mem: dict[str, float]) -> dict[str, int]:
    out = {k: int(v) for k, v in mem.items()}
    state = ("parameters", "gradients", "optimizer_state", "master", "buffers", "communication_buffers")
    out["model_states"] = sum(out.get(k, 0) for k in state)
    out["total"] = out["model_states"] + sum(out.get(k, 0) for k in ("activations", "transient", "flat_padding"))
    return out


def _chunks_of(schedule: str, pp: int) -> int:
    """Chunks per rank the pipeline runs ``schedule`` with (interleaved: its default 2; the V: 2)."""
    return check_schedule(schedule, pp, 2 * pp, None)


def _stage_blocks(m: ModelSpec, pp: int, schedule: str = "1f1b") -> list[list[tuple[int, int]]]:
    """Per rank, the ``[first, end)`` blocks of each of its chunks (virtual stages placed as the schedule does)."""
    v = _chunks_of(schedule, pp)
    counts = partition_blocks(m.block_costs, pp * v)
    bounds = [(sum(counts[:u]), sum(counts[: u + 1])) for u in range(pp * v)]
    return [[bounds[virtual_stage(placement(schedule), pp, s, c)] for c in range(v)] for s in range(pp)]


def _stage_params(m: ModelSpec, pp: int, schedule: str = "1f1b") -> list[list[ParamSpec]]:
    """Each stage's parameters (a tied parameter on every stage that uses it), as the pipeline splits them."""
    return [
        [p for p in m.params if any(lo <= b < hi for lo, hi in chunks for b in (p.block, *p.tied_blocks))]
        for chunks in _stage_blocks(m, pp, schedule)
    ]


@functools.cache
def _orders(schedule: str, pp: int, micro: int) -> tuple[list[list[tuple]], float]:
    """Every rank's op order and its bubble at equal F, B and W (forward 1, backward 2: ``schedule_bubble``)."""
    v = _chunks_of(schedule, pp)
    orders = [stage_schedule(schedule, pp, s, micro, v) for s in range(pp)]
    return orders, schedule_bubble(orders, 1.0, 2.0, 1.0, placement(schedule))


def _tp_numel(params: list[ParamSpec], tp: int) -> list[int]:
    return [p.numel // tp if p.split else p.numel for p in params]


def _messages(orders: list[list[tuple]], where: str) -> list[tuple[int, int, int]]:
    """Per rank, the pipeline messages it sends or receives in a step: spec messages (one per chunk and peer),
    activation and gradient tensors (one hidden-state tensor each), and the loss's hops (:func:`loss_path`)."""
    p = len(orders)
    v = 1 + max((op[2] for order in orders for op in order if len(op) == 3), default=0)
    count = [[0, 0, 0] for _ in range(p)]
    for q, order in enumerate(orders):
        for op in order:
            u = virtual_stage(where, p, q, op[2] if len(op) == 3 else 0)
            if op[0] == "W" or (op[0] == "F" and u == p * v - 1) or (op[0] == "B" and u == 0):
                continue
            to = holder(where, p, u + 1 if op[0] == "F" else u - 1)[0]
            if to != q:
                for r in (q, to):
                    count[r][0] += op[0] == "F" and op[1] == 0
                    count[r][1] += 1
    source = holder(where, p, p * v - 1)[0]
    for r in range(p):
        count[r][2] += (r != source) + (0 <= r + (1 if source == 0 else -1) < p)
    return [tuple(c) for c in count]


def _predict_model_parallel(cfg: Config, w: _Work) -> Prediction:
    """Pipeline, tensor and hybrid: per stage (stage 0 is reported: it holds the most activations under 1F1B)."""
    m, cl = w.model, w.cluster
    pp, tp, dp = cfg.pp, cfg.tp, cfg.dp
    pbytes = _BYTES[w.param_dtype]
    abytes = _BYTES[w.compute_dtype]
    lowp = pbytes < 4
    k = _k(w.optimizer)
    stages = _stage_params(m, pp, cfg.schedule) if pp > 1 else [list(m.params)]
    links = _links(cfg, cl)
    per_replica = w.global_batch // dp
    micro = max(1, cfg.micro_batches)
    mb = per_replica // micro if pp > 1 else per_replica
    tokens_mb = mb * m.seq_len
    counts = partition_blocks(m.block_costs, pp) if pp > 1 else [len(m.block_costs)]  # tensor bytes: one chunk each
    chunk_blocks = _stage_blocks(m, pp, cfg.schedule) if pp > 1 else [[(0, len(m.block_costs))]]
    v = len(chunk_blocks[0])
    where = placement(cfg.schedule)
    if pp > 1:
        orders, bubble_fraction = _orders(cfg.schedule, pp, micro)
        messages = _messages(orders, where)
    last_rank = holder(where, pp, pp * v - 1)[0] if pp > 1 else 0
    preds: list[Prediction] = []
    for s, params in enumerate(stages):
        numels = _tp_numel(params, tp)
        numel = sum(numels)
        mem: dict[str, float] = {"buffers": m.buffer_bytes / pp}
        padding = 0
        if cfg.zero_stage == 0:
            mem["parameters"] = numel * pbytes
            mem["gradients"] = numel * pbytes
            mem["optimizer_state"] = k * numel * pbytes + (4 * len(params) if w.optimizer.startswith("adam") else 0)
            mem["master"] = 0
        else:
            buckets = _buckets(numels, w.param_dtype, cfg.bucket_mb, cfg.first_bucket_mb)
            if cfg.zero_stage == 1:
                owned = padded_shard(numel, dp)
                padding = dp * owned - numel
                mem["parameters"] = numel * pbytes  # the module's parameters: the flat buffer's padding apart
                mem["gradients"] = numel * pbytes
                mem["flat_padding"] = padding * pbytes
            else:
                owned = sum(padded_shard(b, dp) for b in buckets)
                padding = dp * owned - numel
                mem["parameters"] = numel * pbytes
                mem["gradients"] = numel * pbytes + owned * pbytes
            mem["optimizer_state"] = k * owned * (4 if lowp else pbytes)
            mem["master"] = owned * 4 if lowp else 0
        mem["padding"] = padding * pbytes
        # activations: per chunk, its layers times the micro-batches the schedule keeps alive there (from F to W, or
        # to a whole B: 1F1B min(pp - s, m), GPipe all m), at the rank's peak
        layers = [sum(1 for b in range(lo, hi) if b in m.layer_blocks) for lo, hi in chunk_blocks[s]]
        if pp == 1:
            mem["activations"] = _activation_bytes(w, cfg, mb, m.layers, True)
        else:
            peak, alive = activations_alive(orders[s], layers)
            head = alive[holder(where, pp, pp * v - 1)[1]] if s == last_rank else 0
            if cfg.schedule in ("1f1b", "gpipe"):  # one chunk: the same as below, the checkpointed block per in flight
                mem["activations"] = _activation_bytes(w, cfg, mb * alive[0], layers[0], s == last_rank)
            else:
                mem["activations"] = _activation_bytes(w, cfg, mb, peak, False) + (
                    _activation_bytes(w, cfg, mb * head, 0, True) if head else 0
                )
        layers_here = sum(layers)
        # -- counted bytes (the rank's own counters: sends and receives, the tensor group's, the data group's)
        counted = 0
        ops: list[tuple[str, str, float, int]] = []  # (group, op, payload, calls)
        if pp > 1:
            act = tokens_mb * m.hidden * abytes
            specs, tensors, hops = messages[s]  # spec messages, activations and gradients, loss hops in or out
            counted += specs * 128 * 8 + tensors * act + hops * 8
            ops.append(("pipeline", "p2p", tensors * act / 2, 2 * micro * v))
            rank_of = {b: r for r, chunks in enumerate(chunk_blocks) for lo, hi in chunks for b in range(lo, hi)}
            tied = [p for p in params if len({rank_of[b] for b in (p.block, *p.tied_blocks)}) > 1]
            if tied:
                tied_numel = sum(_tp_numel(tied, tp))
                counted += tied_numel * pbytes
                ops.append(("pipeline", "all_reduce", tied_numel * pbytes, 1))
            if s == last_rank and dp > 1:
                counted += 8
        if tp > 1:
            tp_bytes = _tensor_parallel_bytes(m, tokens_mb, abytes, tp, s, len(stages), counts)
            counted += tp_bytes * micro if pp > 1 else tp_bytes
            ops.append(("tensor", "all_reduce", tp_bytes * (micro if pp > 1 else 1), 4 * max(1, layers_here) * micro))
        if dp > 1:
            if cfg.zero_stage == 0:
                counted += numel * pbytes
                ops.append(("data", "all_reduce", numel * pbytes, 1))
            else:
                inner = replace(cfg, strategy={1: "zero1", 2: "zero2"}[cfg.zero_stage], comm_dtype=None)
                c, _, dops = _data_parallel_traffic(w, inner, numels, dp)
                if cfg.zero_stage == 1:  # the inner optimizer reduce-scatters the padded flat buffer itself
                    c = 2 * dp * padded_shard(numel, dp) * pbytes + 8
                counted += c
                ops += [("data", op, payload, calls) for op, payload, calls in dops]
        pred = Prediction(cfg, True, "", bytes_per_step=int(counted))
        pred.memory = _finish_memory(mem)
        pred.link_bytes = {"intra": 0, "inter": 0}
        comm_time: dict[str, float] = {}
        for group, op, payload, calls in ops:
            link, bw, lat = links[group]
            size = {"pipeline": pp, "tensor": tp, "data": dp}[group]
            if op == "p2p":
                pred.link_bytes[link] += int(payload / 2)
                comm_time[group] = comm_time.get(group, 0.0) + payload / 2 / bw + calls * lat
            else:
                pred.link_bytes[link] += int(_ring(op, payload, size))
                comm_time[group] = comm_time.get(group, 0.0) + _comm_time(op, payload, size, bw, lat, calls)
        stage_params = sum(p.numel for p in params) / tp
        compute = _flops(w, cfg, per_replica, stage_params) / cl.device_flops
        # the schedule's idle share at equal F, B, W (1F1B, GPipe: (p - 1) / (m + p - 1), so (p - 1) / m of compute)
        bubble = compute * bubble_fraction / (1 - bubble_fraction) if pp > 1 else 0.0
        optimizer_time = (mem["optimizer_state"] + mem["master"] + 3 * numel * pbytes) * 2 / cl.memory_bandwidth
        pred.time_parts = {
            "compute": compute,
            "bubble": bubble,
            "exposed_comm": sum(comm_time.values()),
            "optimizer": optimizer_time,
            "overhead": cl.step_overhead,
        }
        pred.step_time = sum(pred.time_parts.values())
        preds.append(pred)
    first = preds[0]
    first.bytes_by_stage = [p.bytes_per_step for p in preds]
    first.step_time = max(p.step_time for p in preds)
    worst = max(preds, key=lambda p: p.memory["total"])
    first.memory = worst.memory if worst.memory["total"] > first.memory["total"] else first.memory
    return first


def _tensor_parallel_bytes(
    m: ModelSpec, tokens: int, abytes: int, tp: int, stage: int, stages: int, counts: list[int]
) -> int:
    """Counted bytes of one micro-batch's tensor-parallel all-reduces on ``stage``: a column-parallel layer
    all-reduces its input's gradient (backward), a row-parallel layer its output (forward), the vocabulary
    embedding its output, the vocabulary-parallel loss two values per token (max; sum and target logit)."""
    per_block = 0
    for layer in m.tp_layers:
        if layer.style in ("colwise", "colwise_qkv"):
            per_block += tokens * layer.in_features * abytes
        elif layer.style == "rowwise":
            per_block += tokens * layer.out_features * abytes
    per_layer = per_block / max(m.layers, 1)  # tp_layers lists every block's layers
    # blocks of this stage that are transformer layers
    if stages > 1:
        lo = sum(counts[:stage])
        hi = lo + counts[stage]
        layers_here = sum(1 for b in range(lo, hi) if b in m.layer_blocks)
    else:
        layers_here = m.layers
    total = round(per_layer * layers_here)
    styles = {layer.style for layer in m.tp_layers}
    if stage == 0 and "vocab" in styles:
        total += tokens * m.hidden * abytes
    if stage == stages - 1 and "vocab_output" in styles:
        total += tokens * m.hidden * abytes + tokens * 3 * 4
    return int(total)


# ---------------------------------------------------------------------------------------------------------------------
# The plan: every configuration, ranked


@dataclass
class PlanResult:
    """Every configuration's :class:`Prediction`, ranked: feasible first, then by step time, then by memory."""

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    predictions: list[Prediction]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Prediction | None:
        """The fastest configuration that fits, or None when none does."""
        return self.predictions[0] if self.predictions and self.predictions[0].fits else None

    def feasible(self) -> list[Prediction]:
        return [p for p in self.predictions if p.fits]

    def table(self, top: int = 12, infeasible: int = 6) -> str:
        """The ranked table: the ``top`` fastest that fit, then ``infeasible`` that do not, each with why."""
        fmt = lambda b: f"{b / 2**30:.2f}" if b >= 2**27 else f"{b / 2**20:.1f}M"
        head = (
            f"{'#':>3} {'configuration':<34} {'fits':<4} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
            f"{'total GiB':>9} {'MB/step':>9} {'inter MB':>8} {'step s':>8}  why"
        )
        lines = [
            f"model {self.model.name}: {self.model.numel / 1e9:.3f}B parameters, {self.model.layers} layers, "
            f"hidden {self.model.hidden}, seq {self.model.seq_len}; global batch {self.global_batch}; "
            f"{self.cluster.nodes} node(s) x {self.cluster.devices_per_node} devices of "
            f"{self.cluster.device_memory / 1e9:.0f} GB; {self.settings.get('dtype', '')} params, "
            f"{self.settings.get('optimizer', '')}",
            head,
            "-" * len(head),
        ]
        shown = self.feasible()[:top] + [p for p in self.predictions if not p.fits][:infeasible]
        for i, p in enumerate(shown, 1):
            mem = p.memory
            opt = mem.get("optimizer_state", 0) + mem.get("master", 0)
            step = f"{p.step_time:.3f}" if math.isfinite(p.step_time) else "-"
            lines.append(
                f"{i:>3} {p.config.describe():<34} {'yes' if p.fits else 'no':<4} "
                f"{fmt(mem.get('parameters', 0)):>8} {fmt(mem.get('gradients', 0)):>8} {fmt(opt):>8} "
                f"{fmt(mem.get('activations', 0)):>8} {mem.get('total', 0) / 2**30:>9.2f} "
                f"{p.bytes_per_step / 1e6:>9.1f} {p.link_bytes.get('inter', 0) / 1e6:>8.1f} {step:>8}  {p.why}"
            )
        total, ok = len(self.predictions), len(self.feasible())
        lines.append(f"{ok} of {total} configurations fit; sizes in GiB unless marked M (MiB)")
        return "\n".join(lines)

    def code(self, prediction: Prediction | None = None) -> str:
        """Python that builds ``prediction``'s configuration (the best by default) in a training script."""
        p = prediction or self.best
        if p is None:
            return "# no configuration fits: add devices, enable --checkpointing, or use a smaller batch"
        return _code_for(p.config, self.settings)

    def command(self, prediction: Prediction | None = None) -> str:
        """A launch line for examples/train.py with ``prediction``'s configuration (the best by default)."""
        p = prediction or self.best
        if p is None:
            return ""
        c = p.config
        args = [f"--strategy {c.strategy}", f"--global-batch {self.global_batch}"]
        if c.tp > 1:
            args.append(f"--tp {c.tp}")
        if c.pp > 1:
            args += [f"--pp {c.pp}", f"--micro-batches {c.micro_batches}"]
        if c.comm_dtype:
            args.append(f"--comm-dtype {c.comm_dtype}")
        if c.compression:
            args.append(f"--compression {c.compression}")
        launch = (
            f"torchrun --nnodes {self.cluster.nodes} --nproc-per-node {self.cluster.devices_per_node}"
            if self.cluster.nodes > 1 or self.cluster.devices_per_node > 1
            else "python"
        )
        return f"{launch} examples/train.py {' '.join(args)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {
                "name": self.model.name,
                "parameters": self.model.numel,
                "layers": self.model.layers,
                "hidden": self.model.hidden,
                "heads": self.model.heads,
                "kv_heads": self.model.kv_heads,
                "vocab": self.model.vocab,
                "seq_len": self.model.seq_len,
            },
            "cluster": asdict(self.cluster),
            "global_batch": self.global_batch,
            "settings": self.settings,
            "best": self.best.row() if self.best else None,
            "code": self.code(),
            "command": self.command(),
            "configurations": [p.row() for p in self.predictions],
        }


def _code_for(c: Config, settings: dict[str, Any]) -> str:
    opt = "torch.optim.AdamW(model.parameters(), lr=3e-4)"
    wire = (
        f", communication_dtype=torch.{_DTYPES[c.comm_dtype]}".replace("torch.torch.", "torch.") if c.comm_dtype else ""
    )
    lines = [
        "import torch, gpudist",
        "comm = gpudist.init()",
        f"config = gpudist.ShardingConfiguration(comm, bucket_cap_mb={c.bucket_mb:g}{wire})",
    ]
    simple = {
        "ddp": ("DDPModel", "DDPOptimizer"),
        "zero1": ("ZeRO1Model", "ZeRO1Optimizer"),
        "zero2": ("ZeRO2Model", "ZeRO2Optimizer"),
        "zero3": ("ZeRO3Model", "ZeRO3Optimizer"),
        "fsdp": ("FSDPModel", "ZeRO3Optimizer"),
    }
    if c.strategy in simple:
        model_cls, opt_cls = simple[c.strategy]
        lines.append(f"model = gpudist.{model_cls}(net, config)")
        if c.compression:
            lines.append(f'opt = gpudist.GradientCompressionOptimizer({opt}, config, "{c.compression}")')
        else:
            lines.append(f"opt = gpudist.{opt_cls}({opt}, config)")
        lines.append("# loop: loss.backward(); opt.step(); opt.zero_grad()")
    elif c.strategy == "tensor":
        lines.append(f'model = gpudist.TensorParallelModel(net, config, plan="auto", tensor_parallel_size={c.tp})')
        lines.append(f"opt = {opt}")
    elif c.strategy == "pipeline":
        lines.append(
            f"model = gpudist.PipelineParallelModel(net, config, num_stages={c.pp}, "
            f'micro_batches={c.micro_batches}, schedule="{c.schedule}")'
        )
        lines.append(f"opt = {opt}")
        lines.append("# loop: model.train_step(x, y, loss_fn, opt)")
    else:
        lines.append(
            f"model = gpudist.HybridShardedModel(net, config, pipeline_parallel_size={c.pp}, "
            f'tensor_parallel_size={c.tp}, plan="auto", micro_batches={c.micro_batches}, schedule="{c.schedule}")'
        )
        lines.append(f"opt = gpudist.HybridShardedOptimizer({opt}, config, {c.pp}, {c.tp}, zero_stage={c.zero_stage})")
        lines.append("# loop: model.train_step(x, y, optimizer=opt)")
    return "\n".join(lines)


def _why(p: Prediction, budget: float) -> str:
    parts = p.time_parts
    total = p.step_time
    if not total or not math.isfinite(total):
        return ""
    main = max(parts, key=parts.get)
    share = parts[main] / total
    text = f"{main} {share:.0%}"
    if p.config.pp > 1:
        text += f", bubble {parts.get('bubble', 0) / total:.0%}"
    return text + f"; {p.memory['total'] / budget:.0%} of memory"


def _resolve_model(model: Any, seq_len: int | None, blocks, tp_plan) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return ModelSpec.preset(model, seq_len)
    if isinstance(model, dict):
        return ModelSpec.from_sizes(**({"seq_len": seq_len} if seq_len else {}), **model)
    if isinstance(model, nn.Module):
        return ModelSpec.from_module(model, seq_len=seq_len, blocks=blocks, tp_plan=tp_plan)
    if hasattr(model, "num_hidden_layers") or hasattr(model, "n_layer"):
        return ModelSpec.from_hf_config(model, seq_len=seq_len)
    raise TypeError(
        f"gpudist.plan: model must be an nn.Module, a Hugging Face config, a dict of sizes or a preset name "
        f"({', '.join(PRESETS)}), got {type(model).__name__}"
    )


def plan(
    model: Any,
    *,
    global_batch: int,
    nodes: int = 1,
    devices_per_node: int = 8,
    device_memory: float | str = "80GB",
    cluster: Cluster | None = None,
    dtype: str = "bf16",
    mixed_precision: bool = True,
    optimizer: str = "adam",
    checkpointing: bool = False,
    seq_len: int | None = None,
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    tp_plan: Any = None,
    measure: bool = False,
    comm_dtypes: Sequence[str | None] = (None, "bf16"),
    compressions: Sequence[str | None] = (None, "int8"),
    bucket_mbs: Sequence[float] = (25.0,),
    strategies: Sequence[str] | None = None,
) -> PlanResult:
    """Predict memory, traffic and step time of every way to train ``model`` on the cluster, ranked.

    Args:
        model: An ``nn.Module`` (exact parameter layout), a Hugging Face config, a dict of sizes for
            :meth:`ModelSpec.from_sizes` (layers, hidden, heads, kv_heads, ffn, vocab, seq_len), a preset name
            (:data:`PRESETS`) or a :class:`ModelSpec`.
        global_batch: Sequences per step over all ranks.
        nodes, devices_per_node, device_memory: The cluster (``"80GB"`` or bytes); ``cluster`` overrides them
            with every link parameter.
        dtype: The parameters' dtype, "fp32" or "bf16" (ZeRO keeps an fp32 master of the owned range for bf16).
        mixed_precision: Activations and matmuls in bf16 (else in ``dtype``).
        optimizer: "adam"/"adamw" (K = 2), "sgd" (momentum, K = 1) or "sgd-plain".
        checkpointing: Activation checkpointing (each block keeps its input; 8 instead of 6 FLOPs per parameter
            and token).
        seq_len, blocks, tp_plan: For an ``nn.Module``: see :meth:`ModelSpec.from_module`.
        measure: Calibrate the cluster on this machine (:func:`measure_cluster`) instead of the given numbers.
        comm_dtypes, compressions, bucket_mbs: The wire dtypes, gradient compressions and bucket sizes tried.
        strategies: Only these strategies (default: all).

    Returns:
        A :class:`PlanResult`: ``.table()``, ``.best``, ``.code()``, ``.command()``, ``.to_json()``.
    """
    spec = _resolve_model(model, seq_len, blocks, tp_plan)
    if cluster is None:
        cluster = Cluster(nodes=nodes, devices_per_node=devices_per_node, device_memory=_parse_bytes(device_memory))
    if measure:
        cluster = measure_cluster(cluster)
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r}; use fp32, bf16 or fp16")
    param_dtype = _DTYPES[dtype]
    compute_dtype = torch.bfloat16 if mixed_precision and dtype == "fp32" else param_dtype
    if optimizer not in ("adam", "adamw", "sgd", "sgd-plain"):
        raise ValueError(f"optimizer={optimizer!r}; use adam, adamw, sgd (momentum) or sgd-plain")
    wires = [w for w in comm_dtypes if w is None or _DTYPES[w] != param_dtype]
    budget = cluster.device_memory * cluster.usable_memory
    preds = []
    configs = enumerate_configs(
        spec,
        cluster.world_size,
        global_batch,
        devices_per_node=cluster.devices_per_node,
        checkpointing=checkpointing,
        comm_dtypes=wires,
        compressions=compressions if param_dtype == torch.float32 else (None,),
        bucket_mbs=bucket_mbs,
    )
    for cfg, why in configs:
        if strategies is not None and cfg.strategy not in strategies:
            continue
        if why is not None:
            preds.append(Prediction(cfg, False, why))
            continue
        p = predict(
            cfg, spec, cluster, global_batch, param_dtype=param_dtype, compute_dtype=compute_dtype, optimizer=optimizer
        )
        if p.memory["total"] > budget:
            p.fits = False
            p.why = (
                f"needs {p.memory['total'] / 2**30:.1f} GiB per rank, over the {budget / 2**30:.1f} GiB budget "
                f"({cluster.usable_memory:.0%} of {cluster.device_memory / 1e9:.0f} GB)"
            )
        else:
            p.why = _why(p, budget)
        preds.append(p)
    preds.sort(key=lambda p: (not p.fits, p.step_time, p.memory.get("total", math.inf)))
    settings = {
        "dtype": dtype,
        "compute_dtype": _dtype_name(compute_dtype),
        "optimizer": optimizer,
        "checkpointing": checkpointing,
        "measured": measure,
    }
    return PlanResult(spec, cluster, global_batch, preds, settings)


# ---------------------------------------------------------------------------------------------------------------------
# Building a configuration, and calibrating the cluster on this machine


def build(
    config: Config,
    module: nn.Module,
    comm,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None,
    tp_plan: Any = "auto",
    **sharding: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer wrappers of ``config`` around ``module`` on ``comm`` (collective: every rank).

    Args:
        config: A :class:`Config` (``plan(...).best.config``).
        module: The model to wrap.
        comm: The backend (``gpudist.init()``).
        optimizer: Makes the torch optimizer from parameters, e.g. ``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``.
        blocks, tp_plan: The pipeline's blocks and the tensor-parallel plan (as the wrappers take them).
        **sharding: More :class:`~gpudist.ShardingConfiguration` settings.
    """
    from . import strategies as gpudist  # the wrappers, as the facade exports them (not the facade: it imports us)
    from .config import ShardingConfiguration

    settings = dict(bucket_cap_mb=config.bucket_mb, first_bucket_mb=config.first_bucket_mb, **sharding)
    if config.comm_dtype:
        settings["communication_dtype"] = _DTYPES[config.comm_dtype]
    sc = ShardingConfiguration(comm, **settings)
    simple = {
        "ddp": (gpudist.DDPModel, gpudist.DDPOptimizer),
        "zero1": (gpudist.ZeRO1Model, gpudist.ZeRO1Optimizer),
        "zero2": (gpudist.ZeRO2Model, gpudist.ZeRO2Optimizer),
        "zero3": (gpudist.ZeRO3Model, gpudist.ZeRO3Optimizer),
        "fsdp": (gpudist.FSDPModel, gpudist.ZeRO3Optimizer),
    }
    if config.strategy in simple:
        model_cls, opt_cls = simple[config.strategy]
        model = model_cls(module, sc)
        if config.compression:
            return model, gpudist.GradientCompressionOptimizer(optimizer(model.parameters()), sc, config.compression)
        return model, opt_cls(optimizer(model.parameters()), sc)
    if config.strategy == "tensor":
        model = gpudist.TensorParallelModel(module, sc, tp_plan, tensor_parallel_size=config.tp)
        return model, optimizer(model.parameters())
    if config.strategy == "pipeline" and config.zero_stage == 0:
        model = gpudist.PipelineParallelModel(
            module,
            sc,
            num_stages=config.pp,
            micro_batches=config.micro_batches,
            schedule=config.schedule,
            blocks=blocks,
        )
        return model, optimizer(model.parameters())
    model = gpudist.HybridShardedModel(
        module,
        sc,
        pipeline_parallel_size=config.pp,
        tensor_parallel_size=config.tp,
        plan=tp_plan if config.tp > 1 else None,
        blocks=blocks,
        micro_batches=config.micro_batches,
        schedule=config.schedule,
    )
    opt = gpudist.HybridShardedOptimizer(
        optimizer(model.parameters()), sc, config.pp, config.tp, zero_stage=config.zero_stage
    )
    return model, opt


def _measure_rank(comm, sizes: Sequence[int], rounds: int) -> dict[str, float]:
    """On each rank: the time of an all-reduce of each size (median of ``rounds``), and a matmul and copy probe."""
    out: dict[str, float] = {}
    for size in sizes:
        t = torch.zeros(size // 4)
        comm.all_reduce(t)
        times = []
        for _ in range(rounds):
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - start)
        out[f"all_reduce_{size}"] = sorted(times)[len(times) // 2]
    if comm.rank == 0:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b
        start = time.perf_counter()
        for _ in range(8):
            a @ b
        out["flops"] = 8 * 2 * 512**3 / (time.perf_counter() - start)
        x = torch.zeros(1 << 22)
        y = torch.ones(1 << 22)
        x.add_(y)
        start = time.perf_counter()
        for _ in range(8):
            x.add_(y)
        out["memory_bandwidth"] = 8 * 3 * x.numel() * 4 / (time.perf_counter() - start)
    return out


def measure_cluster(base: Cluster | None = None, backend: str = "gloo", world_size: int = 2) -> Cluster:
    """Calibrate ``base`` on this machine: all-reduces of 4 KiB and 4 MiB over ``world_size`` local ranks give the
    latency and bandwidth of both link classes (one machine: intra = inter), a 512x512 matmul the FLOP/s, and an
    add of 16 MiB the memory bandwidth (per rank: the other ranks' processes share the cores)."""
    from .testing import run_ranks

    small, large = 4 << 10, 4 << 20
    results = run_ranks(_measure_rank, world_size, backend, sizes=(small, large), rounds=7)
    r0 = results[0]
    n = world_size
    t_small, t_large = r0[f"all_reduce_{small}"], r0[f"all_reduce_{large}"]
    factor = 2 * (n - 1) / n
    bandwidth = factor * (large - small) / max(t_large - t_small, 1e-9)
    latency = max(t_small - factor * small / bandwidth, 1e-7) / (2 * (n - 1))
    base = base or Cluster()
    return replace(
        base,
        nodes=1,
        devices_per_node=world_size,
        device_flops=r0["flops"] / world_size,
        memory_bandwidth=r0["memory_bandwidth"],
        intra_bandwidth=bandwidth,
        inter_bandwidth=bandwidth,
        intra_latency=latency,
        inter_latency=latency,
        chunked_overlap=backend != "nccl",
    )


# ---------------------------------------------------------------------------------------------------------------------
# The command


def add_arguments(parser) -> None:
    """``gpudist plan``'s options."""
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a JSON file of sizes")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 4 per device)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory", default="80GB")
    parser.add_argument("--tflops", type=float, default=None, help="achieved TFLOP/s per device (default 400)")
    parser.add_argument("--intra-bw", type=float, default=None, help="GB/s per rank inside a node (default 150)")
    parser.add_argument("--inter-bw", type=float, default=None, help="GB/s per rank across nodes (default 25)")
    parser.add_argument("--intra-latency-us", type=float, default=None)
    parser.add_argument("--inter-latency-us", type=float, default=None)
    parser.add_argument("--measure", action="store_true", help="calibrate links and compute on this machine")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="parameter dtype")
    parser.add_argument("--no-mixed-precision", action="store_true", help="activations in the parameter dtype")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd", "sgd-plain"])
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--top", type=int, default=12, help="rows of feasible configurations to print")
    parser.add_argument("--json", default=None, help="also write every configuration to this JSON file")


def run_from_args(args) -> int:
    """``gpudist plan``: print the ranked table and the code and command of the best configuration."""
    import sys
    from pathlib import Path

    if args.model in PRESETS:
        sizes = dict(PRESETS[args.model])
        name = args.model
    elif Path(args.model).is_file():
        sizes = json.loads(Path(args.model).read_text())
        name = Path(args.model).stem
    elif all(getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")):
        sizes, name = {}, args.model
    else:
        print(
            f"gpudist plan: --model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file; "
            "or give --layers, --hidden, --heads, --vocab (and --seq-len)",
            file=sys.stderr,
        )
        return 2
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    sizes.setdefault("seq_len", 2048)
    try:
        spec = ModelSpec.from_sizes(name=name, **sizes)
    except TypeError as e:
        print(f"gpudist plan: bad model sizes ({e})", file=sys.stderr)
        return 2
    base = Cluster(nodes=args.nodes, devices_per_node=args.gpus_per_node, device_memory=_parse_bytes(args.gpu_memory))
    overrides = {
        "device_flops": args.tflops and args.tflops * 1e12,
        "intra_bandwidth": args.intra_bw and args.intra_bw * 1e9,
        "inter_bandwidth": args.inter_bw and args.inter_bw * 1e9,
        "intra_latency": args.intra_latency_us and args.intra_latency_us * 1e-6,
        "inter_latency": args.inter_latency_us and args.inter_latency_us * 1e-6,
    }
    cluster = replace(base, **{k: v for k, v in overrides.items() if v})
    batch = args.global_batch or 4 * cluster.world_size
    result = plan(
        spec,
        global_batch=batch,
        cluster=cluster,
        dtype=args.dtype,
        mixed_precision=not args.no_mixed_precision,
        optimizer=args.optimizer,
        checkpointing=args.checkpointing,
        measure=args.measure,
    )
    print(result.table(top=args.top))
    print()
    if result.best is None:
        print("nothing fits: try --checkpointing, more nodes, or a smaller --global-batch")
    else:
        print(f"best: {result.best.config.describe()}  ({result.best.step_time:.3f} s/step predicted)")
        print(result.code())
        print(result.command())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0
