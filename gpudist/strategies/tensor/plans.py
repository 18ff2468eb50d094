"""Plans: which submodules a :class:`~gpudist.TensorParallelModel` converts, and to what (:data:`PLAN_STYLES`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from ...comm import CommunicationBackend
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Split,
    VocabParallelEmbedding,
    check_column,
    require_divisible,
)

# Plans

Plan = Mapping[str, str] | Callable[[nn.Module], Mapping[str, str]]
"""A plan: module name -> style, or a function of the module returning one."""

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


def _style_split(style: str | None, attr: str) -> Split | None:
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


def validate_plan(module: nn.Module, plan: Mapping[str, str], tp: int) -> list[tuple[str, str]]:
    """The plan's (name, style) entries after checking every one against the module and tp (no communication)."""
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"plan must be a non-empty dict of module name -> style ({', '.join(PLAN_STYLES)}) or a "
            f"function returning one (e.g. examples/lm.py's tinylm_plan), got {plan!r}"
        )
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
    outputs = [n for n, s in plan.items() if s == "vocab_output"]
    if len(outputs) > 1:
        raise ValueError(f"plan maps {outputs} to 'vocab_output'; only the model's output layer can be one")
    # Tied parameters (a head sharing the embedding's matrix) must be split the same way wherever they are used.
    seen: dict[int, tuple[str, Split | None]] = {}
    for owner, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is None:
                continue
            name, split = f"{owner}.{attr}" if owner else attr, _style_split(plan.get(owner), attr)
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
                if (split := _style_split(styles.get(owner), attr)) is not None:
                    splits[name] = split
    for name, style in sorted(entries, key=lambda e: e[1] == "heads"):  # leaves first, then their blocks
        parent, _, child = name.rpartition(".")
        owner = module.get_submodule(parent)
        owner.register_module(child, _convert(owner.get_submodule(child), style, tensor_group))
    for names in aliases.values():  # conversion gave each alias its own copy of a shard: tie them again
        first = module.get_parameter(names[0])
        for other in names[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner), attr, first)
    outputs = [n for n, s in entries if s == "vocab_output"]
    return splits, outputs[0] if outputs else None


# ---------------------------------------------------------------------------------------------------------------------
