"""The fixed part of ZeRO-3/FSDP, decided once at wrap time: which submodules are units, which parameters each unit's
groups hold, where each parameter lies in its group's flat vector and which range of that vector this rank's shard
holds. Nothing here changes after the wrap; the per-step state lives in :mod:`.group`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...flat import padded_range, padded_shard

__all__ = ["GroupLayout", "UnitSpec", "group_layouts", "merge_small_units", "unit_names"]

UnitSpec = Iterable[str | nn.Module] | Callable[[str, nn.Module], bool] | tuple[type, ...] | type | None
"""The units of a ZeRO-3 wrapper: module names or objects, module classes, a predicate ``(name, module) -> bool``, or
None (every submodule that holds parameters itself)."""


def unit_names(spec: UnitSpec, module: nn.Module, owner: str) -> list[str]:
    """The names of the submodules ``spec`` picks (in ``named_modules()`` order, or ``spec``'s own for a list).

    Raises:
        ValueError: When a listed unit is not a submodule of ``module`` (``owner`` names the wrapper in the error).
    """
    named = dict(module.named_modules())
    if spec is None:
        return [n for n, m in named.items() if n and any(True for _ in m.parameters(recurse=False))]
    if isinstance(spec, type) or (isinstance(spec, tuple) and all(isinstance(c, type) for c in spec)):
        return [n for n, m in named.items() if n and isinstance(m, spec)]
    if callable(spec) and not isinstance(spec, nn.Module):
        return [n for n, m in named.items() if n and spec(n, m)]
    by_id = {id(m): n for n, m in named.items()}
    names = []
    for item in spec:
        name = by_id.get(id(item)) if isinstance(item, nn.Module) else item
        if name is None or name not in named or name == "":
            raise ValueError(
                f"{owner}: unit {item!r} is not a submodule of the wrapped module; "
                f"pass names from module.named_modules(), e.g. {list(named)[1:4]}"
            )
        names.append(name)
    return names


def _depth(name: str) -> int:
    return name.count(".") + bool(name)


def _placement(module: nn.Module, units: list[str]) -> tuple[dict, dict, dict]:
    """Per parameter (by id): the ``(module, attribute)`` pairs that hold it, the names it is known by, and the unit
    that gathers it: the innermost of ``units`` holding all its places, or the root (``""``) for a parameter shared by
    several units (tied weights)."""
    modules = dict(module.named_modules())
    unit_of: dict[int, str] = {}
    for name in sorted(["", *units], key=_depth):  # outer units first, inner ones override
        for sub in modules[name].modules():
            unit_of[id(sub)] = name
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, list[str]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None and (mod, attr) not in places.setdefault(id(p), []):
                places[id(p)].append((mod, attr))
                names.setdefault(id(p), []).append(f"{mod_name}.{attr}" if mod_name else attr)
    owner = {}
    for key, held in places.items():
        owners = {unit_of[id(m)] for m, _ in held}
        owner[key] = owners.pop() if len(owners) == 1 else ""
    return places, names, owner


def _unit_numels(module: nn.Module, units: list[str]) -> dict[str, int]:
    """Elements each unit gathers, as :func:`group_layouts` will place the parameters."""
    numels = dict.fromkeys(units, 0)
    _, _, owner = _placement(module, units)
    for p in module.parameters():
        if owner[id(p)] in numels:
            numels[owner[id(p)]] += p.numel()
    return numels


def merge_small_units(names: list[str], module: nn.Module, min_numel: int) -> list[str]:
    """``names`` without the units that would gather fewer than ``min_numel`` elements, innermost first: a small
    unit's parameters join the nearest enclosing unit that stays (or the root), and count towards its size.

    Tiny units cost a collective (and its latency) each for little memory saved: DeepSpeed ZeRO-3 leaves parameters
    under its ``stage3_param_persistence_threshold`` (100K elements) unpartitioned for the same reason.
    """
    kept = list(dict.fromkeys(names))
    if min_numel <= 0:
        return kept
    for depth in sorted({_depth(n) for n in kept}, reverse=True):  # units of one depth are disjoint subtrees
        numels = _unit_numels(module, kept)
        small = {n for n in kept if _depth(n) == depth and numels[n] < min_numel}
        kept = [n for n in kept if n not in small]
    return kept


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """One flat vector of a unit: parameters of one dtype/device/trainability, sharded over ``world`` ranks. Fixed
    at wrap time."""

    index: int
    unit: str
    names: tuple[str, ...]
    """Every name each parameter is known by (tied parameters have several), joined by ','."""
    places: tuple[tuple[tuple[nn.Module, str], ...], ...]
    """Per parameter, the ``(module, attribute)`` pairs that hold it."""
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    """Where each parameter starts in the flat vector."""
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    start: int
    end: int
    """The real elements of the flat vector in this rank's shard (:func:`~gpudist.flat.padded_range`)."""
    padded: int
    """Elements of every rank's shard, padding included (:func:`~gpudist.flat.padded_shard`)."""
    world: int

    @property
    def total(self) -> int:
        """Elements of the flat vector (the parameters', no padding)."""
        return sum(self.numels)

    @property
    def gathered(self) -> int:
        """Elements of the gathered vector: every rank's padded shard, the real ones first."""
        return self.padded * self.world

    def in_shard(self, j: int) -> tuple[int, int, int] | None:
        """The part of parameter ``j`` in this rank's shard: ``(start in the shard, length, start in the parameter)``,
        or None when the shard holds none of it."""
        lo, hi = self.offsets[j], self.offsets[j] + self.numels[j]
        a, b = max(lo, self.start), min(hi, self.end)
        return (a - self.start, b - a, a - lo) if a < b else None


def group_layouts(
    module: nn.Module, units: list[str], world: int, rank: int
) -> tuple[list[tuple[GroupLayout, nn.Parameter]], list[tuple[int, int]], list[str]]:
    """Cut ``module``'s parameters into groups: per unit (the root ``""`` first), one per (dtype, device,
    trainability); a parameter shared by several units goes to the root. Each group's shard holds this rank's values
    (of the module as it is now), zero-padded.

    Returns:
        ``(layout, shard)`` per group; per parameter of ``module.parameters()`` its ``(group index, position in the
        group)``; and per parameter its first name.
    """
    places, names, owner = _placement(module, [u for u in units if u])
    keyed: dict[tuple, list[nn.Parameter]] = {}
    params = list(module.parameters())
    for p in params:
        unit = owner[id(p)]  # shared across units: the root gathers it
        keyed.setdefault((units.index(unit), unit, p.dtype, str(p.device), p.requires_grad), []).append(p)
    groups: list[tuple[GroupLayout, nn.Parameter]] = []
    slot: dict[int, tuple[int, int]] = {}
    for (_, unit, dtype, _, trainable), ps in sorted(keyed.items(), key=lambda kv: kv[0][0]):
        numels = [p.numel() for p in ps]
        start, end = padded_range(sum(numels), world, rank)
        padded = padded_shard(sum(numels), world)
        full = torch.cat([p.detach().reshape(-1) for p in ps]) if ps else torch.empty(0)
        values = torch.zeros(padded, dtype=full.dtype, device=full.device)
        values[: end - start] = full[start:end]
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        layout = GroupLayout(
            index=len(groups),
            unit=unit,
            names=tuple(",".join(names[id(p)]) for p in ps),
            places=tuple(tuple(places[id(p)]) for p in ps),
            shapes=tuple(p.shape for p in ps),
            numels=tuple(numels),
            offsets=tuple(offsets),
            dtype=dtype,
            device=ps[0].device,
            requires_grad=trainable,
            start=start,
            end=end,
            padded=padded,
            world=world,
        )
        for j, p in enumerate(ps):
            slot[id(p)] = (layout.index, j)
        groups.append((layout, nn.Parameter(values, requires_grad=trainable)))
    return groups, [slot[id(p)] for p in params], [names[id(p)][0] for p in params]


def expose_device_and_dtype(module: nn.Module, shards: list[nn.Parameter]) -> None:
    """Keep ``module.device`` and ``module.dtype`` working once its parameters became the wrapper's shards: Hugging
    Face models read them from ``next(self.parameters())``, which then raises StopIteration. Where the module's
    class defines them as properties, the module's class becomes a subclass (same name) whose properties answer
    from the shards (their device; the first floating-point dtype), as FSDP2's ``fully_shard`` swaps in a subclass."""
    cls = type(module)
    answers = {
        "device": property(lambda self: shards[0].device),
        "dtype": property(lambda self: next((s.dtype for s in shards if s.is_floating_point()), shards[0].dtype)),
    }
    answers = {name: prop for name, prop in answers.items() if isinstance(getattr(cls, name, None), property)}
    if shards and answers:
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        module.__class__ = type(cls.__name__, (cls,), {**names, **answers})
