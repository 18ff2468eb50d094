"""Model adapters: how a decoder model's own forward pass runs as pipeline stages, with no user wrappers.

A decoder is glue around a list of blocks: the first stage embeds the tokens, every stage derives the blocks' side
inputs (position ids, rotary embeddings, the causal/padding mask), the last stage applies the final norm and the
head. An adapter names where a model family keeps each part and runs that glue as the model's ``forward`` does, so
``PipelineParallelModel(model, config)`` splits the model's own block list and a checkpoint keeps the model's own
parameter names. Between stages the activation is a dict: ``hidden_states`` plus the ``attention_mask`` and
``position_ids`` the caller passed (integer tensors: no gradient travels back for them); each stage rebuilds the
4-D mask and the rotary embeddings from them once per micro-batch, not once per block.

Adapters in :data:`ADAPTERS` (first match wins; :func:`register_adapter` adds one):

- :class:`LlamaAdapter`: ``model.embed_tokens``, ``model.rotary_emb``, ``model.layers``, ``model.norm``,
  ``lm_head`` (Llama; Mistral and Qwen2/Qwen3 share the structure and the glue, sliding-window masks included).
- :class:`GPT2Adapter`: ``transformer.wte``, ``transformer.wpe``, ``transformer.drop``, ``transformer.h``,
  ``transformer.ln_f``, ``lm_head``.

A family is matched by its ``config.model_type`` as well as its attribute names: a model with the same names but
other glue (Gemma scales its embeddings inside ``forward``) must not be split as if it were Llama.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "ADAPTERS",
    "DecoderAdapter",
    "GPT2Adapter",
    "LlamaAdapter",
    "PipelineParts",
    "find_adapter",
    "pipeline_parts",
    "register_adapter",
]


def _get(model: nn.Module, dotted: str) -> Any:
    """``model``'s attribute at the dotted path, or None where it has none."""
    obj: Any = model
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class DecoderAdapter:
    """How one family of decoder models runs as pipeline stages. A subclass names the model's parts (dotted paths
    from the model) and implements the glue; instances hold the model's config only, never its modules, so a stage
    keeps no reference to the other stages' parameters.

    Attributes:
        family: The name errors and metadata use.
        model_types: The ``config.model_type`` values whose ``forward`` runs this glue.
        block_list: Where the model keeps its blocks (an ``nn.ModuleList``).
        first_stage: Stage attribute -> the model's submodule, held by the first stage (the embeddings).
        every_stage: The same for modules every stage needs (the rotary embedding: buffers, no parameters).
        last_stage: The same for the last stage (final norm, head).
    """

    family = ""
    model_types: tuple[str, ...] = ()
    block_list = ""
    first_stage: dict[str, str] = {}
    every_stage: dict[str, str] = {}
    last_stage: dict[str, str] = {}
    inputs = ("input_ids", "attention_mask", "position_ids")

    def __init__(self, model: nn.Module, block_list: str | None = None):
        self.config = model.config
        if block_list is not None:
            self.block_list = block_list
        self.vocab_size = model.config.vocab_size

    @classmethod
    def looks_for(cls, block_list: str | None = None) -> list[str]:
        """The dotted names this adapter needs in a model."""
        return [
            block_list or cls.block_list,
            *cls.first_stage.values(),
            *cls.every_stage.values(),
            *cls.last_stage.values(),
        ]

    @classmethod
    def mismatch(cls, model: nn.Module, block_list: str | None = None) -> str | None:
        """Why ``model`` is not of this family (None when it is)."""
        wanted = cls.looks_for(block_list)
        missing = [name for name in wanted if not isinstance(_get(model, name), nn.Module)]
        if missing:
            return "found none" if len(missing) == len(wanted) else f"no {', '.join(missing)}"
        if not isinstance(_get(model, block_list or cls.block_list), (nn.ModuleList, nn.Sequential)):
            return f"{block_list or cls.block_list} is not an nn.ModuleList"
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in cls.model_types:
            return f"config.model_type is {model_type!r}, not one of {cls.model_types}"
        return None

    # -- the glue ------------------------------------------------------------------------------------------------

    def split_inputs(self, inputs: Any) -> dict[str, torch.Tensor]:
        """The first stage's micro-batch as keyword tensors: ``input_ids`` alone, or a mapping of :attr:`inputs`."""
        if isinstance(inputs, torch.Tensor):
            return {"input_ids": inputs}
        if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
            raise TypeError(
                f"PipelineParallelModel ({self.family} adapter): inputs must be the input_ids tensor or a mapping "
                f"with input_ids (and optionally attention_mask, position_ids), got {type(inputs).__name__}"
            )
        unknown = sorted(set(inputs) - set(self.inputs))
        if unknown:
            raise ValueError(
                f"PipelineParallelModel ({self.family} adapter): inputs {unknown} are not supported; pass "
                f"{', '.join(self.inputs)}"
            )
        out = {k: v for k, v in inputs.items() if v is not None}
        if "attention_mask" in out and out["attention_mask"].dtype == torch.bool:
            out["attention_mask"] = out["attention_mask"].long()  # an integer tensor travels between stages
        return out

    def embed(self, stage: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The hidden states entering the first block (first stage)."""
        raise NotImplementedError

    def side_inputs(
        self, stage: nn.Module, blocks: Sequence[nn.Module], hidden: torch.Tensor, carry: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """What every block of the stage gets besides the hidden states, from the carried ``attention_mask`` and
        ``position_ids`` (computed once per stage and micro-batch)."""
        raise NotImplementedError

    def run_block(self, block: nn.Module, hidden: torch.Tensor, side: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the last block's hidden states (last stage)."""
        raise NotImplementedError

    def run_stage(self, stage: nn.Module, blocks: Sequence[nn.Module], x: Any, first: bool, last: bool) -> Any:
        """One stage: embed (first stage), side inputs once, the blocks, then the head (last stage) or the
        activation dict for the next stage."""
        if first:
            carry = self.split_inputs(x)
            hidden = self.embed(stage, carry)
            carry = {k: v for k, v in carry.items() if k != "input_ids"}
        else:
            carry = dict(x)
            hidden = carry.pop("hidden_states")
        if blocks:
            side = self.side_inputs(stage, blocks, hidden, carry)
            for block in blocks:
                hidden = self.run_block(block, hidden, side)
        if last:
            return self.head(stage, hidden)
        return {"hidden_states": hidden, **carry}

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's causal-LM loss, as ``model(input_ids, labels=labels).loss``: ``labels`` are the input ids
        (shifted here), ``-100`` ignored; the mean over the micro-batch's counted tokens. Half-precision logits are
        upcast to float32 as the model's loss does; float64 stays float64."""
        logits = logits[..., :-1, :].flatten(0, -2)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return nn.functional.cross_entropy(logits, labels[..., 1:].flatten().to(logits.device))

    # -- helpers -------------------------------------------------------------------------------------------------

    @staticmethod
    def positions(hidden: torch.Tensor, carry: dict[str, torch.Tensor]) -> torch.Tensor:
        """The carried position ids, or ``0 .. T-1`` (the model's default without a cache)."""
        ids = carry.get("position_ids")
        return ids if ids is not None else torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)

    def mask(self, kind: str, hidden: torch.Tensor, carry: dict[str, torch.Tensor], positions: torch.Tensor) -> Any:
        """The 4-D attention mask (or None where attention is causal without one) of ``kind`` ("full_attention" or
        "sliding_attention"), as the model's ``forward`` builds it from the 2-D padding mask."""
        from transformers import masking_utils

        build = masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention" else None
        build = build or masking_utils.create_causal_mask
        names = inspect.signature(build).parameters
        kwargs = {
            "config": self.config,
            "attention_mask": carry.get("attention_mask"),
            "past_key_values": None,
            "position_ids": positions,
        }
        kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = hidden
        if "cache_position" in names:  # transformers 4.x
            kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
        return build(**kwargs)


class LlamaAdapter(DecoderAdapter):
    """Llama-like decoders (``LlamaForCausalLM``; Mistral, Qwen2, Qwen3): token embedding, rotary embeddings
    computed once per stage, decoder layers taking ``attention_mask``/``position_embeddings``, RMSNorm, head."""

    family = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    block_list = "model.layers"
    first_stage = {"embed_tokens": "model.embed_tokens"}
    every_stage = {"rotary_emb": "model.rotary_emb"}
    last_stage = {"norm": "model.norm", "lm_head": "lm_head"}

    def embed(self, stage, inputs):
        return stage.embed_tokens(inputs["input_ids"])

    def _kind(self, block: nn.Module) -> str:
        kind = getattr(block, "attention_type", None)  # Qwen2/3: per layer
        if kind is None:  # Mistral: one window for every layer
            kind = "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"
        return kind

    def side_inputs(self, stage, blocks, hidden, carry):
        positions = self.positions(hidden, carry)
        kinds = {self._kind(block) for block in blocks}
        return {
            "masks": {kind: self.mask(kind, hidden, carry, positions) for kind in kinds},
            "position_ids": positions,
            "position_embeddings": stage.rotary_emb(hidden, positions),
        }

    def run_block(self, block, hidden, side):
        return block(
            hidden,
            attention_mask=side["masks"][self._kind(block)],
            position_ids=side["position_ids"],
            position_embeddings=side["position_embeddings"],
            use_cache=False,
        )

    def head(self, stage, hidden):
        return stage.lm_head(stage.norm(hidden))


class GPT2Adapter(DecoderAdapter):
    """GPT-2 (``GPT2LMHeadModel``): token plus learned position embeddings and dropout, blocks taking the causal
    mask, final LayerNorm, head (tied to the token embedding: the first and last stage sum its gradients)."""

    family = "gpt2"
    model_types = ("gpt2",)
    block_list = "transformer.h"
    first_stage = {"wte": "transformer.wte", "wpe": "transformer.wpe", "drop": "transformer.drop"}
    last_stage = {"ln_f": "transformer.ln_f", "lm_head": "lm_head"}

    def embed(self, stage, inputs):
        ids = inputs["input_ids"]
        hidden = stage.wte(ids)
        return stage.drop(hidden + stage.wpe(self.positions(hidden, inputs)))

    def side_inputs(self, stage, blocks, hidden, carry):
        positions = self.positions(hidden, carry)
        return {"attention_mask": self.mask("full_attention", hidden, carry, positions), "position_ids": positions}

    def run_block(self, block, hidden, side):
        return block(hidden, None, side["attention_mask"], use_cache=False, position_ids=side["position_ids"])

    def head(self, stage, hidden):
        return stage.lm_head(stage.ln_f(hidden))


ADAPTERS: list[type[DecoderAdapter]] = [LlamaAdapter, GPT2Adapter]
"""The model families :func:`find_adapter` recognises, tried in order."""


def register_adapter(adapter: type[DecoderAdapter]) -> type[DecoderAdapter]:
    """Add a :class:`DecoderAdapter` subclass to :data:`ADAPTERS` (tried before the built-in ones); usable as a
    class decorator."""
    if not (isinstance(adapter, type) and issubclass(adapter, DecoderAdapter)):
        raise TypeError(f"register_adapter takes a DecoderAdapter subclass, got {adapter!r}")
    ADAPTERS.insert(0, adapter)
    return adapter


BlocksArg = str | Callable[[nn.Module], nn.Sequential | Sequence[nn.Module]] | None


def find_adapter(model: nn.Module | Sequence[nn.Module], blocks: BlocksArg, who: str) -> DecoderAdapter | None:
    """The adapter that splits ``model``, or None when ``model`` is already a sequence of blocks (or ``blocks`` is a
    function returning one).

    Args:
        model: The model to pipeline.
        blocks: None, a function returning the blocks, or the dotted name of the model's block list.
        who: The wrapper's name, for errors.

    Raises:
        TypeError: When no adapter matches, naming what each one looked for; or ``blocks`` is of another type.
    """
    if callable(blocks) or (blocks is None and isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple))):
        return None
    if blocks is not None and not isinstance(blocks, str):
        raise TypeError(
            f"{who}: blocks={blocks!r}; pass the dotted name of the model's block list (e.g. 'model.layers') or a "
            "function returning its blocks in order"
        )
    reasons = []
    for adapter in ADAPTERS:
        why = adapter.mismatch(model, blocks)
        if why is None:
            return adapter(model, blocks)
        reasons.append(f"{adapter.family} looked for {', '.join(adapter.looks_for(blocks))}: {why}")
    raise TypeError(
        f"{who} splits an nn.Sequential or a list of blocks, got {type(model).__name__}, which no model adapter "
        f"recognises ({'; '.join(reasons)}); pass blocks=, a function returning the model's blocks in order (each "
        "taking the previous one's tensor, tuple or dict of tensors), or register_adapter() an adapter for its family"
    )


@dataclass
class PipelineParts:
    """A model cut for pipelining: ``blocks`` are split over the stages; with an ``adapter``, the first stage also
    holds ``first``, every stage ``every``, the last ``last`` (stage attribute -> the model's module)."""

    blocks: list[nn.Module]
    adapter: DecoderAdapter | None = None
    first: dict[str, nn.Module] = field(default_factory=dict)
    every: dict[str, nn.Module] = field(default_factory=dict)
    last: dict[str, nn.Module] = field(default_factory=dict)


def pipeline_parts(model: nn.Module, blocks: BlocksArg, adapter: DecoderAdapter | None) -> PipelineParts:
    """Cut ``model`` as :func:`find_adapter` decided (``adapter``), after any in-place conversion (tensor parallel)."""
    if adapter is not None:
        return PipelineParts(
            list(_get(model, adapter.block_list)),
            adapter,
            {k: _get(model, v) for k, v in adapter.first_stage.items()},
            {k: _get(model, v) for k, v in adapter.every_stage.items()},
            {k: _get(model, v) for k, v in adapter.last_stage.items()},
        )
    seq = blocks(model) if callable(blocks) else model
    if isinstance(seq, nn.Module) and not isinstance(seq, (nn.Sequential, nn.ModuleList)):
        seq = [seq]  # one block (a one-stage hybrid model)
    return PipelineParts(list(seq))
