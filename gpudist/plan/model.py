"""The planner's inputs: the model (:class:`ModelSpec`, its :data:`PRESETS`), the cluster (:class:`Cluster`) and one
way to run on it (:class:`Config`), with the dtype names they use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..strategies.tensor.layers import require_divisible

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

CHECKPOINTING_MODES = ("none", "selective", "full")
"""Activation checkpointing modes the planner searches (:attr:`Config.checkpointing`; the memory and time of each are
in :func:`gpudist.plan.cost._activation_bytes` and :func:`gpudist.plan.cost._flops`)."""
ATTENTION_KINDS = ("flash", "eager")


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
    attention: str = "flash"
    """How attention keeps its activations: "flash" (a fused kernel, torch's SDPA on a GPU or FlashAttention: no
    tensor of sequence x sequence scores is kept, the backward recomputes them) or "eager" (scores, softmax and
    dropout materialized and kept for backward, e.g. Hugging Face's ``attn_implementation="eager"``)."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention={self.attention!r}; use one of {', '.join(ATTENTION_KINDS)}")

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
                from ..strategies.tensor.plans import validate_plan

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
            attention=_attention_of(config),
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
            attention=_attention_of(config),
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
        attention: str = "flash",
    ) -> ModelSpec:
        """A decoder from its sizes: Llama's layout when ``gated`` (RMSNorm, q/k/v/o, SwiGLU gate/up/down, no
        biases), GPT-2's otherwise (LayerNorms, fused qkv and MLP with biases, learned positions). ``attention``:
        see :attr:`ModelSpec.attention`."""
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
            attention=attention,
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


def _attention_of(config: Any) -> str:
    """A Hugging Face config's attention as :attr:`ModelSpec.attention` ("eager" only when it says so: sdpa and
    flash_attention_2 keep no scores)."""
    return "eager" if getattr(config, "_attn_implementation", None) == "eager" else "flash"


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
    from ..strategies.tensor.plans import expand_plan, hf_plan, style_split

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
    from ..strategies.tensor.plans import expand_plan, hf_plan

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
    host_scale: float = 1.0
    """Multiplies the host's time to issue a step (:func:`gpudist.plan.cost._host_time`, calibrated on an H200's
    host): above 1 for a slower host CPU; 0 where the host does the compute itself (a CPU cluster, as
    :func:`~gpudist.plan.measure_cluster` calibrates)."""

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
    checkpointing: str = "none"
    """Activation checkpointing: "none" (autograd keeps every block's activations), "selective" (Korthikanti et al.
    2022: the attention core's score-sized tensors are recomputed, the rest kept) or "full" (each block keeps its
    input and is recomputed in backward). ``True``/``False`` are read as "full"/"none"."""

    def __post_init__(self) -> None:
        if isinstance(self.checkpointing, bool):
            object.__setattr__(self, "checkpointing", "full" if self.checkpointing else "none")
        if self.checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(f"checkpointing={self.checkpointing!r}; use one of {', '.join(CHECKPOINTING_MODES)}")

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
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        return " ".join(parts)
