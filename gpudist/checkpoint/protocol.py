"""The protocol: what a model and an optimizer say about the state they hold.

gpudist's wrappers describe themselves (ShardedModel's checkpoint_* methods, ShardedOptimizer's checkpoint_pieces
and stage_checkpoint); a plain nn.Module and a plain torch optimizer are described here, parameter by parameter.
This module knows no strategy: it sits below them, and they build on it and on the vocabulary of
:mod:`gpudist.checkpoint.format` (canonical pieces, written, Reader).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..comm import CommunicationBackend
from .format import CheckpointError, Reader, Segments, Share, _jsonable, canonical, written


@runtime_checkable
class CheckpointableModel(Protocol):
    """What a model tells a checkpoint (:class:`gpudist.ShardedModel` implements it for every strategy).

    The checkpoint is written over ``comm`` (one file per rank, rank 0 commits), or over the model's optional
    ``checkpoint_group`` when its state spans more ranks than ``comm`` (HSDP: the shard group x the replica group;
    it needs only ``rank``, ``world_size``, ``device``, ``all_reduce`` and ``all_gather``)."""

    strategy: str
    comm: CommunicationBackend

    def parameter_table(self) -> list[dict]: ...
    def checkpoint_segments(self) -> list[tuple[torch.Tensor, Segments]]: ...
    def checkpoint_share(self, name: str, across_replicas: bool = True) -> tuple[int, int] | None: ...
    def buffer_table(self) -> list[dict]: ...
    def checkpoint_buffers(self) -> list[tuple[str, torch.Tensor, bool]]: ...


@runtime_checkable
class CheckpointableOptimizer(Protocol):
    """What an optimizer tells a checkpoint (:class:`gpudist.ShardedOptimizer` implements it for every strategy).

    ``segmap`` maps ``id(parameter)`` to the canonical pieces the model holds in it; ``share`` is the model's
    :meth:`~gpudist.ShardedModel.checkpoint_share`."""

    comm: CommunicationBackend

    def checkpoint_pieces(
        self, segmap: dict[int, Segments], share: Share, rank: int, world: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]], dict]:
        """This rank's state pieces (``{"state.KEY|name|start": values}``, each element written by one rank), the
        per-parameter scalars (``{name: {"step": 3}}``) and a description (``{"class": ..., "groups": ...}``)."""
        ...

    def stage_checkpoint(
        self, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Callable[[], None]:
        """Read (and verify) all this rank needs from ``reader``; append ``(destination, values)`` copies to
        ``apply``; return what installs the rest. Nothing may change before every rank has read successfully."""
        ...


# ---------------------------------------------------------------------------------------------------------------------
# What a rank holds


@dataclass
class _Parts:
    """What a rank holds of a model, and which of it it writes."""

    held: list[tuple[torch.Tensor, Segments]]
    share: Share
    buffers: list[tuple[str, torch.Tensor, bool]]  # (full name, tensor, whether this rank writes it)
    buffer_table: list[dict[str, Any]]
    strategy: str


def _model_parts(model: nn.Module, comm: CommunicationBackend | None) -> _Parts:
    if isinstance(model, CheckpointableModel):
        return _Parts(
            model.checkpoint_segments(),
            model.checkpoint_share,
            model.checkpoint_buffers(),
            model.buffer_table(),
            model.strategy,
        )
    if isinstance(model, nn.Module):
        # A plain module is whole on every rank of the optimizer's group (if any): rank r writes its shard_range of
        # every parameter, rank 0 the buffers, as for a replicated ShardedModel.
        rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
        buffers = list(model.named_buffers())
        table = [{"name": n, "shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")} for n, b in buffers]
        return _Parts(
            module_segments(model),
            lambda name, across=True: (world, rank) if across else (1, 0),
            [(n, b, rank == 0) for n, b in buffers],
            table,
            "module",
        )
    raise TypeError(f"checkpoints hold an nn.Module or a gpudist ShardedModel, got {type(model).__name__}")


def _param_table(model: nn.Module) -> list[dict[str, Any]]:
    return model.parameter_table() if isinstance(model, CheckpointableModel) else module_table(model)


def _comm_of(model, optimizer) -> CommunicationBackend | None:
    if isinstance(model, CheckpointableModel):
        return getattr(model, "checkpoint_group", model.comm)
    if isinstance(optimizer, CheckpointableOptimizer):
        return optimizer.comm
    return None


def module_table(module: nn.Module) -> list[dict]:
    """The parameter table of an unwrapped module (:meth:`gpudist.ShardedModel.parameter_table`): name, other names
    (tied parameters), shape and dtype of every parameter, in ``parameters()`` order."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return [
        {
            "name": name,
            "aliases": aliases[id(p)][1:],
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
        }
        for name, p in module.named_parameters()
    ]


def module_segments(module: nn.Module) -> list[tuple[torch.Tensor, Segments]]:
    """The checkpoint segments of an unwrapped module (:meth:`gpudist.ShardedModel.checkpoint_segments`): each
    parameter whole, under its first name."""
    return [(p, [(0, p.numel(), name, 0)]) for name, p in module.named_parameters()]


# ---------------------------------------------------------------------------------------------------------------------
# Optimizers


def group_hyperparameters(groups: list[dict]) -> list[dict]:
    """The groups' hyper-parameters as JSON values; a one-element tensor (a learning rate kept on the device) as its
    number (read on the host), which :func:`update_group` fills back into the tensor in place."""
    return [
        {k: scalar_of(v) if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params" and _saved(v)}
        for g in groups
    ]


def _saved(value) -> bool:
    return value.numel() == 1 if isinstance(value, torch.Tensor) else _jsonable(value)


def update_group(group: dict, hyper: dict) -> None:
    """Set a parameter group's hyper-parameters to ``hyper``, filling those it holds as tensors in place (a captured
    graph and a scheduler keep reading the same tensor)."""
    for key, value in hyper.items():
        held = group.get(key)
        if isinstance(held, torch.Tensor) and isinstance(value, (int, float, torch.Tensor)) and held.numel() == 1:
            with torch.no_grad():
                held.copy_(value) if isinstance(value, torch.Tensor) else held.fill_(value)
        else:
            group[key] = value


def scalar_of(value) -> float | int | None:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def optimizer_pieces(opt, segmap: dict[int, Segments], share: Share, rank: int, world: int):
    """:meth:`CheckpointableOptimizer.checkpoint_pieces` of any optimizer, a plain torch one included."""
    if isinstance(opt, CheckpointableOptimizer):
        return opt.checkpoint_pieces(segmap, share, rank, world)
    return torch_optimizer_pieces(opt, segmap, share)


def stage_optimizer(opt, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list) -> Callable[[], None]:
    """:meth:`CheckpointableOptimizer.stage_checkpoint` of any optimizer, a plain torch one included."""
    if isinstance(opt, CheckpointableOptimizer):
        return opt.stage_checkpoint(body, reader, segmap, apply)
    return stage_torch_optimizer(opt, body, reader, segmap, apply)


def put_piece(pieces: dict[str, torch.Tensor], key: str, name: str, at: int, values: torch.Tensor) -> None:
    """Add ``values`` (elements ``[at, at + n)`` of optimizer state ``key`` of parameter ``name``) to ``pieces``."""
    pieces[f"state.{key}|{name}|{at}"] = values.detach().reshape(-1).contiguous().cpu().clone()


def torch_optimizer_pieces(torch_opt: torch.optim.Optimizer, segmap: dict[int, Segments], share: Share):
    """:func:`optimizer_pieces` of a torch optimizer whose state is per parameter, replicated like the parameters."""
    pieces: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float]] = {}
    for group in torch_opt.param_groups:
        for p in group["params"]:
            state = torch_opt.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and key != "step":
                    flat = value.reshape(-1)
                    for pos, n, name, c in written(canonical(segmap.get(id(p), []), 0, p.numel()), share, True):
                        put_piece(pieces, key, name, c, flat[pos : pos + n])
                elif (s := scalar_of(value)) is not None:
                    for _, _, name, _ in segmap.get(id(p), []):
                        scalars.setdefault(name, {})[key] = s
    return pieces, scalars, {"class": type(torch_opt).__name__, "groups": group_hyperparameters(torch_opt.param_groups)}


def saved_optimizer(body: dict, reader: Reader, groups: list[dict], kind: str) -> tuple[dict, dict, list[str]]:
    """The checkpoint's optimizer record, checked against an optimizer of class ``kind`` with ``groups``: the record,
    its per-parameter scalars, and the state tensors' keys (``master`` aside)."""
    saved = body.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{reader.path} holds no optimizer state; load it with optimizer=None, or save one")
    if len(saved["groups"]) != len(groups):
        raise CheckpointError(
            f"{reader.path}: the checkpoint's optimizer has {len(saved['groups'])} parameter "
            f"group(s), this one {len(groups)}"
        )
    if saved["class"] != kind:
        raise CheckpointError(
            f"{reader.path}: the checkpoint holds {saved['class']} state, the optimizer is a "
            f"{kind}; build the same optimizer class, or load with optimizer=None"
        )
    keys = sorted({k.removeprefix("state.") for k, _ in reader.index if k.startswith("state.")} - {"master"})
    return saved, saved["scalars"], keys


def stage_torch_optimizer(
    torch_opt: torch.optim.Optimizer, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list
) -> Callable[[], None]:
    """:func:`stage_optimizer` of a torch optimizer: its whole per-parameter state, installed by load_state_dict.

    The state is built and then loaded into a throwaway copy of the optimizer over meta tensors, so whatever torch's
    loader would refuse (a missing ``step``, ...) is found here, before anything is changed."""
    saved, scalars, keys = saved_optimizer(body, reader, torch_opt.param_groups, type(torch_opt).__name__)
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in torch_opt.param_groups:
        for p in group["params"]:
            segs = segmap.get(id(p), [])
            entry = {}
            if segs:
                for key in keys:
                    values = torch.zeros(p.numel(), dtype=torch.float32, device="cpu")
                    for pos, n, name, c in canonical(segs, 0, p.numel()):
                        values[pos : pos + n] = reader.read(f"state.{key}", name, c, n, torch.float32)
                    entry[key] = values.view_as(p)
                own = scalars.get(segs[0][2])
                if own is None and p.numel() == 0:  # no shard owns an element of it: its group's common scalars
                    own = _common_scalars(scalars, [s[0][2] for q in group["params"] if (s := segmap.get(id(q)))])
                for key, value in (own or {}).items():
                    entry[key] = torch.tensor(float(value), device="cpu")
            if entry:
                state[index] = entry
            index += 1
    _check_state_keys(state, torch_opt, segmap, reader.path)
    sd = torch_opt.state_dict()
    groups_sd = [{**g, **hyper} for g, hyper in zip(sd["param_groups"], saved["groups"], strict=True)]
    loaded = {"state": state, "param_groups": groups_sd}
    _try_load(torch_opt, loaded, reader.path)

    def finish() -> None:
        load_keeping_identity(torch_opt, loaded)

    return finish


def _common_scalars(scalars: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The scalars (``step``, ...) that every one of ``names`` that has any holds with the same value."""
    held = [scalars[n] for n in names if n in scalars]
    return {k: v for k, v in held[0].items() if all(h.get(k) == v for h in held)} if held else {}


def _check_state_keys(state: dict[int, dict[str, Any]], torch_opt, segmap: dict[int, Segments], path: Path) -> None:
    """Every parameter's staged state has the same keys: a parameter the checkpoint gave fewer (a scalar missing for
    it) is named here rather than failing in torch's loader or the next step()."""
    params = [p for g in torch_opt.param_groups for p in g["params"]]
    every = set().union(*(e.keys() for e in state.values())) if state else set()
    for i, entry in state.items():
        if entry.keys() != every:
            name = segmap[id(params[i])][0][2]
            raise CheckpointError(
                f"{path}: the optimizer state of {name!r} lacks {sorted(every - entry.keys())} that the other "
                "parameters have (a checkpoint written without them?)"
            )


def _try_load(torch_opt: torch.optim.Optimizer, state_dict: dict[str, Any], path: Path) -> None:
    """Load ``state_dict`` into a throwaway copy of ``torch_opt`` whose parameters are meta tensors (no memory, no
    copy), so a state that torch's loader or the optimizer's ``__setstate__`` refuses fails before anything changed:
    their failure would come after the optimizer had already dropped its old state."""
    probe = copy.copy(torch_opt)  # Optimizer.__getstate__: defaults, state, param_groups; no hooks
    probe.param_groups = [
        {**g, "params": [torch.empty_like(p, device="meta") for p in g["params"]]} for g in torch_opt.param_groups
    ]
    probe.state = collections.defaultdict(dict)
    try:
        probe.load_state_dict(state_dict)
    except Exception as e:
        raise CheckpointError(
            f"{path}: the optimizer state does not load into {type(torch_opt).__name__} ({type(e).__name__}: {e})"
        ) from e


def load_keeping_identity(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``, keeping its ``param_groups`` dicts and ``state`` mapping the same
    objects: torch's loader replaces them, which silently disconnects every wrapper sharing them and every LR
    scheduler built before the load (the scheduler would go on setting lr in dicts the optimizer no longer reads)."""
    groups, state = optimizer.param_groups, optimizer.state
    optimizer.load_state_dict(state_dict)
    for old, new in zip(groups, optimizer.param_groups, strict=True):
        old.update({k: v for k, v in new.items() if k != "params"})
    state.clear()
    state.update(optimizer.state)
    optimizer.param_groups, optimizer.state = groups, state
