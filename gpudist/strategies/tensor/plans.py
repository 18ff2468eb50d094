"""Plans: which submodules a :class:`~gpudist.TensorParallelModel` converts, and to what (:data:`PLAN_STYLES`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Literal

from torch import nn

from ...comm import CommunicationBackend
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
    check_column,
    divisors,
    require_divisible,
)

# Plans

Plan = Mapping[str, str] | Callable[[nn.Module], Mapping[str, str]] | Literal["auto"]
"""A plan: module name -> style, or a function of the module returning one, or ``"auto"`` (a Hugging Face model's
own plan, :func:`hf_plan`). A ``*`` in a name stands for one component of it (``"layers.*.mlp.fc1"``: every
layer's); a name without one wins over a pattern that also matches its module."""

PLAN_STYLES: dict[str, str] = {
    "colwise": "nn.Linear -> ColumnParallelLinear; its output stays split (feed a 'rowwise' layer)",
    "colwise_qkv": "fused q, k, v nn.Linear ([3 d, d]) -> ColumnParallelLinear holding the same heads' q, k and v",
    "rowwise": "nn.Linear -> RowParallelLinear; its input arrives split, its output is all-reduced",
    "vocab": "nn.Embedding -> VocabParallelEmbedding (table split by vocabulary rows)",
    "vocab_output": "the output nn.Linear over the vocabulary -> ColumnParallelLinear; the model's output is then "
    "logits split by vocabulary, for vocab_parallel_cross_entropy",
    "heads": "a block with n_heads and head_parallel(tp) -> block.head_parallel(tp), its attention on n_heads / tp "
    "local heads (the plan must also give its children the styles its head_parallel_plan names)",
}
"""The styles a tensor-parallel plan maps module names to, with what each does."""


def style_split(style: str | None, attr: str) -> Split | None:
    """How a parameter named ``attr`` of a module converted with ``style`` is split (None: replicated)."""
    if style in ("colwise", "vocab_output", "vocab"):
        return Split(0)
    if style == "colwise_qkv":
        return Split(0, 3)
    if style == "rowwise" and attr == "weight":
        return Split(1)
    return None


def _convert(module: nn.Module, style: str, comm: CommunicationBackend) -> nn.Module:
    if style == "heads":
        return module.head_parallel(comm.world_size)
    if style == "vocab":
        return VocabParallelEmbedding.from_embedding(module, comm)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, comm)
    return ColumnParallelLinear.from_linear(module, comm, chunks=3 if style == "colwise_qkv" else 1)


# ---------------------------------------------------------------------------------------------------------------------
# Plans from a Hugging Face model's config, and wildcards

HF_STYLES: dict[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "vocab",
    "colwise_gather_output": "vocab_output",
    "colwise_rep": "vocab_output",
    "replicate": None,
}
"""The transformers tensor-parallel styles ``plan="auto"`` takes, and the gpudist style each becomes (None: left
replicated). A gathered column split (``colwise_gather_output``, ``colwise_rep``) is taken on the model's output
layer only, as ``vocab_output``: its logits stay split by vocabulary for the loss, and :meth:`predict` (or a
``labels=`` forward) gathers them."""

_HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")
"""Attributes of an attention module that count its heads; they become the local counts once its projections are
split (``head_dim`` and the query heads per key/value head, ``num_key_value_groups``, do not change)."""


def _names(module: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in module.named_modules()}


def hf_plan(module: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a Hugging Face model carries, in gpudist's styles (what ``plan="auto"`` uses).

    Takes ``config.base_model_tp_plan`` (named relative to the base model, so prefixed with its name: ``model.`` in
    ``LlamaForCausalLM``), the model class's ``_tp_plan`` (its head, ``{"lm_head": "colwise_gather_output"}``) and
    the instance's merged ``_tp_plan`` where transformers built one, and splits the input embedding by vocabulary
    where none of them names it. Styles translate by :data:`HF_STYLES`; ``*`` patterns are kept.

    Args:
        module: A transformers ``PreTrainedModel`` (anything with ``config.base_model_tp_plan``).

    Returns:
        Module name (or ``*`` pattern) -> gpudist style.

    Raises:
        ValueError: When the model's config has no ``base_model_tp_plan``, or its plan uses a style gpudist does
            not convert (or a gathered column split on a layer other than the output).
    """
    config = getattr(module, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        owner = "has no config" if config is None else f"has a {type(config).__name__} without one"
        conv1d = any(type(m).__name__ == "Conv1D" for m in module.modules())
        why = (
            " (its layers are transformers Conv1D, weights stored [in, out], with q, k and v fused in one layer: "
            "no plan style converts them; train it with DDP, ZeRO, FSDP or a pipeline instead)"
            if conv1d
            else f"; pass a plan dict of module name -> style ({', '.join(PLAN_STYLES)}) instead"
        )
        raise ValueError(
            f"plan='auto' takes the plan from a Hugging Face model's config.base_model_tp_plan; "
            f"{type(module).__name__} {owner}{why}"
        )
    names = _names(module)
    base = getattr(module, "base_model", module)
    prefix = f"{names[id(base)]}." if id(base) in names and names[id(base)] else ""
    raw = dict(getattr(type(module), "_tp_plan", None) or {})
    raw.update({prefix + k: v for k, v in base_plan.items()})
    merged = module.__dict__.get("_tp_plan")  # transformers' own merge of the above, on the instance
    raw.update(merged if isinstance(merged, dict) else {})
    embed = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    if isinstance(embed, nn.Embedding) and names.get(id(embed)) not in raw:
        raw[names[id(embed)]] = "embedding_rowwise"
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    plan: dict[str, str] = {}
    for name, hf_style in raw.items():
        if hf_style not in HF_STYLES:
            raise ValueError(
                f"plan='auto': {type(module).__name__}'s plan maps {name!r} to {hf_style!r}, a transformers style "
                f"gpudist does not convert (it takes {', '.join(HF_STYLES)}); pass a plan dict instead, "
                f"e.g. hf_plan(model) with that entry changed (styles: {', '.join(PLAN_STYLES)})"
            )
        style = HF_STYLES[hf_style]
        if style == "vocab_output" and (head is None or names.get(id(head)) != name):
            raise ValueError(
                f"plan='auto': {type(module).__name__}'s plan maps {name!r} to {hf_style!r} (a gathered column "
                "split), which gpudist takes only on the model's output layer (get_output_embeddings()); pass a "
                "plan dict that maps it to 'colwise' with a 'rowwise' layer after it"
            )
        if style is not None:
            plan[name] = style
    return plan


def _split_sizes(modules: dict[str, nn.Module], plan: Mapping[str, str]) -> list[int]:
    """The sizes the plan cuts into tp equal parts (vocabularies, features, head counts), for naming the tp sizes
    that would work."""
    sizes = []
    for name, style in plan.items():
        sub = modules.get(name)
        if style == "vocab" and isinstance(sub, nn.Embedding):
            sizes.append(sub.num_embeddings)
        elif style in ("colwise", "colwise_qkv", "vocab_output", "rowwise") and isinstance(sub, nn.Linear):
            sizes.append(sub.in_features if style == "rowwise" else sub.out_features // (3 if "qkv" in style else 1))
        elif style == "heads" and isinstance(getattr(sub, "n_heads", None), int):
            sizes.append(sub.n_heads)
    return sizes


def _check_hf_heads(module: nn.Module, plan: Mapping[str, str], tp: int) -> None:
    """``plan="auto"``: the config's query and key/value head counts divisible by tp, so no head is split."""
    config = module.config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or not any(s in ("colwise", "rowwise") for s in plan.values()):
        return
    kv = getattr(config, "num_key_value_heads", None) or heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n % tp:
            working = math.gcd(heads, kv, *_split_sizes(dict(module.named_modules()), plan))
            gqa = f" (grouped-query attention: {heads} query heads share {kv} key/value heads)" if kv != heads else ""
            kind = "key/value" if what == "num_key_value_heads" else "query"
            raise ValueError(
                f"plan='auto' on {type(module).__name__}: {what}={n} is not divisible by the tensor-parallel size "
                f"{tp}, so a {kind} head would be split across ranks{gqa}; use a tensor-parallel size that divides "
                f"num_attention_heads={heads}, num_key_value_heads={kv} and the plan's layers: {divisors(working)}"
            )


def expand_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """``plan`` with every ``*`` pattern replaced by the submodule names it matches (``*``: one component of a
    name, such as a layer index); a name without ``*`` wins over a pattern that also matches it.

    Raises:
        ValueError: When a pattern matches no submodule, or two patterns give one module different styles.
    """
    exact = {k: v for k, v in plan.items() if not (isinstance(k, str) and "*" in k)}
    names = [n for n, _ in module.named_modules() if n]
    expanded: dict[str, str] = {}
    source: dict[str, str] = {}
    for pattern, style in plan.items():
        if pattern in exact:
            continue
        regex = re.compile("[^.]+".join(re.escape(part) for part in pattern.split("*")))
        matched = [n for n in names if regex.fullmatch(n)]
        if not matched:
            near = [n for n in names if n.rpartition(".")[2] == pattern.rpartition(".")[2]][:3]
            raise ValueError(
                f"plan pattern {pattern!r} matches no submodule of {type(module).__name__} ('*' stands for one "
                f"component of a name, e.g. a layer index; names are relative to the module wrapped)"
                + (f"; submodules with that last name: {near}" if near else "")
            )
        for name in matched:
            if name in exact:
                continue
            if expanded.get(name, style) != style:
                raise ValueError(
                    f"plan patterns {source[name]!r} ({expanded[name]}) and {pattern!r} ({style}) both match "
                    f"{name!r}; name it without '*' to choose its style"
                )
            expanded[name], source[name] = style, pattern
    return {**expanded, **exact}


def validate_plan(module: nn.Module, plan: Plan, tp: int) -> list[tuple[str, str]]:
    """The plan's (name, style) entries, ``"auto"`` and ``*`` patterns resolved (:func:`hf_plan`,
    :func:`expand_plan`), after checking every one against the module and tp (no communication)."""
    if isinstance(plan, str) and plan == "auto":
        plan = hf_plan(module)
        _check_hf_heads(module, plan, tp)
    elif callable(plan):
        plan = plan(module)
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f'plan must be "auto" (a Hugging Face model\'s own plan), a non-empty dict of module name -> style '
            f"({', '.join(PLAN_STYLES)}) or a function returning one (e.g. examples/lm.py's tinylm_plan), got {plan!r}"
        )
    plan = expand_plan(module, plan)
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
            absent = [a for a in ("n_heads", "head_parallel") if not hasattr(sub, a)]
            if absent or any(True for _ in sub.parameters(recurse=False)):
                raise TypeError(
                    f"{what}: needs a block that says how its attention runs on local heads (an n_heads attribute, "
                    "a head_parallel(tensor_parallel_size) method returning the converted block, and no parameters "
                    f"of its own; see examples/lm.py's Block); {type(sub).__name__} lacks "
                    f"{absent or 'none, but has parameters of its own'}"
                )
            require_divisible(f"{what}: n_heads", sub.n_heads, tp)
            for part, needed in getattr(sub, "head_parallel_plan", {}).items():
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
            require_divisible(f"{what}: vocabulary size (num_embeddings)", sub.num_embeddings, tp)
        elif style == "rowwise":
            require_divisible(f"{what}: in_features", sub.in_features, tp)
        else:
            check_column(what, sub.out_features, 3 if style == "colwise_qkv" else 1, tp)
        head_dim = getattr(modules[name.rpartition(".")[0]], "head_dim", None)
        if style in ("colwise", "rowwise") and isinstance(head_dim, int) and head_dim > 0:
            # A projection of an attention module (one with head_dim, as transformers' are): whole heads per rank.
            side, width = ("in", sub.in_features) if style == "rowwise" else ("out", sub.out_features)
            if width % head_dim == 0:
                require_divisible(
                    f"{what}: heads ({side}_features {width} / head_dim {head_dim})", width // head_dim, tp
                )
    outputs = [n for n, s in plan.items() if s == "vocab_output"]
    if len(outputs) > 1:
        raise ValueError(f"plan maps {outputs} to 'vocab_output'; only the model's output layer can be one")
    # Tied parameters (a head sharing the embedding's matrix) must be split the same way wherever they are used.
    seen: dict[int, tuple[str, Split | None]] = {}
    for owner, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            name, split = f"{owner}.{attr}" if owner else attr, style_split(plan.get(owner), attr)
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
) -> tuple[dict[str, Split], str | None]:
    """Convert ``module``'s planned layers in place (``entries`` from :func:`validate_plan`) to their parallel
    versions over ``tensor_group``, keeping parameter names and ties. Returns how each split parameter (every name
    of it) is cut, and the name of the ``vocab_output`` layer (None without one)."""
    aliases: dict[int, list[str]] = {}
    splits: dict[str, Split] = {}  # every name (aliases too) of a split parameter
    styles = dict(entries)
    for owner, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is not None:
                name = f"{owner}.{attr}" if owner else attr
                aliases.setdefault(id(p), []).append(name)
                if (split := style_split(styles.get(owner), attr)) is not None:
                    splits[name] = split
    for name, style in sorted(entries, key=lambda e: e[1] == "heads"):  # leaves first, then their blocks
        parent, _, child = name.rpartition(".")
        owner = module.get_submodule(parent)
        owner.register_module(child, _convert(owner.get_submodule(child), style, tensor_group))
    # An attention module (one with head_dim, as transformers' are; a 'heads' block converts itself) whose
    # projections are now split column-wise runs on its local heads: its head counts must say so.
    owners = {n.rpartition(".")[0] for n, s in entries if s == "colwise"} - {n for n, s in entries if s == "heads"}
    for owner in (module.get_submodule(n) for n in sorted(owners)):
        if isinstance(getattr(owner, "head_dim", None), int):
            for attr in _HEAD_COUNTS:
                if isinstance(getattr(owner, attr, None), int):
                    setattr(owner, attr, getattr(owner, attr) // tensor_group.world_size)
    for names in aliases.values():  # conversion gave each alias its own copy of a shard: tie them again
        first = module.get_parameter(names[0])
        for other in names[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)
    outputs = [n for n, s in entries if s == "vocab_output"]
    return splits, outputs[0] if outputs else None


# ---------------------------------------------------------------------------------------------------------------------
