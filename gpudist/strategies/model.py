"""ShardedModel: the nn.Module wrapper every strategy subclasses (seeds: ShardedModelBase).

A strategy decides where parameters live and how gradients are communicated by implementing
``initialize_sharding`` and ``synchronize_gradients`` (and, when parameters are sharded,
``gather_full_parameters``/``set_parameters``/``full_state_dict``). Everything else — the training step,
prediction, cloning, serialization, files and metadata — is shared here.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from ..checkpoint import load_checkpoint, module_segments, module_table, save_checkpoint
from ..comm import ReductionOperation
from ..config import ShardingConfiguration
from ..fileio import atomic_write_bytes
from ..flat import exchange_bytes

__all__ = ["ShardedModel", "model_fingerprint", "module_segments", "module_table", "replica_share"]

FORMAT = "gpudist.model.v1"


def model_fingerprint(module: nn.Module) -> int:
    """A 62-bit hash of parameter and buffer names, shapes and dtypes: equal on every rank for the same model."""
    text = ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in [*module.named_parameters(), *module.named_buffers()])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def same_on_every_rank(comm, value: int) -> bool:
    """Whether every rank of ``comm`` passed the same integer (one 16-byte all-reduce; collective)."""
    seen = torch.tensor([value, -value], dtype=torch.int64, device=comm.device)
    comm.all_reduce(seen, ReductionOperation.MAX)
    return seen[0].item() == value and -seen[1].item() == value


def _check_materialized(module: nn.Module, wrapper: str) -> None:
    """Refuse a module with parameters or buffers on the ``meta`` device (shapes without data): every strategy
    copies or broadcasts the values at wrap time, where torch would only say "Cannot copy out of meta tensor"."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.device.type == "meta":
            raise ValueError(
                f"{wrapper}: {name} is on the meta device (no data); materialize the module before wrapping it, "
                "e.g. module.to_empty(device='cpu') and then initialize its parameters"
            )


class ShardedModel(nn.Module):
    """Base of all model strategies: wraps ``module`` and communicates through ``config.backend``.

    Subclasses implement :meth:`initialize_sharding` (called once, collectively, from the constructor) and
    :meth:`synchronize_gradients`. Constructing a wrapper is a collective call: every rank must do it.

    Args:
        module: The ``nn.Module`` to wrap (not one that is already wrapped). Strategies may move, shard or
            replace its parameters in place.
        config: The settings shared with the paired optimizer; ``config.backend`` is the group this wrapper
            communicates on.

    Raises:
        TypeError: When ``module`` is not an ``nn.Module`` or is already a ``ShardedModel``, or ``config`` is not
            a :class:`~gpudist.ShardingConfiguration`.
    """

    strategy = "sharded"

    def __init__(self, module: nn.Module, config: ShardingConfiguration):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, ShardedModel):
            raise TypeError(
                f"{type(self).__name__} got an already wrapped {type(module).__name__}; wrap the inner module once"
            )
        if not isinstance(config, ShardingConfiguration):
            raise TypeError(f"config must be a gpudist.ShardingConfiguration, got {type(config).__name__}")
        _check_materialized(module, type(self).__name__)
        self.module = module
        self.config = config
        self.last_step_bytes = 0
        self._comm_hook = None  # set by register_comm_hook (strategies that support it)
        self._bytes_mark = 0
        self.initialize_sharding()
        self._bytes_mark = self._bytes_total()
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        """The optimizers paired with this model (:meth:`ShardedOptimizer.model`), for :meth:`memory_per_rank`."""
        config._models.add(self)

    # -- the strategy's part ------------------------------------------------------------------------------------

    def initialize_sharding(self) -> None:
        """Place parameters and set up communication (collective; called once by the constructor)."""
        raise NotImplementedError

    def synchronize_gradients(self) -> None:
        """Make every parameter's ``.grad`` the global average (or this rank's shard of it) now."""
        raise NotImplementedError

    def manages(self, param: torch.Tensor) -> bool:
        """True when this wrapper reduces ``param``'s gradient itself (so an optimizer must not).

        Args:
            param: A parameter, e.g. one of an optimizer's.

        Returns:
            Whether this wrapper makes ``param``'s gradient global (False in the base class).
        """
        return False

    # -- shared ---------------------------------------------------------------------------------------------------

    @property
    def comm(self):
        """The backend this wrapper communicates on (``config.backend``)."""
        return self.config.backend

    @property
    def rank(self) -> int:
        """This rank in ``comm``."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in ``comm``."""
        return self.comm.world_size

    def capture_refusal(self) -> str | None:
        """Why a captured graph (:func:`gpudist.capture`) could not replay this strategy's step, or None: it can
        (the data-parallel wrappers, whose per-step work is planned at wrap time). Strategies whose step decides on
        the host override it.

        Returns:
            The reason, or None.
        """
        return None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module.

        Args:
            *args: Positional arguments for the wrapped module.
            **kwargs: Keyword arguments for the wrapped module.

        Returns:
            The wrapped module's output.
        """
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """Forward in eval mode without autograd; restores the previous mode.

        Args:
            inputs: The model's input, passed to ``forward`` as its one positional argument.

        Returns:
            The model's output.
        """
        was_training = self.training
        self.eval()
        try:
            return self(inputs)
        finally:
            self.train(was_training)

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
    ) -> torch.Tensor:
        """One step on this rank's slice of the batch: forward, loss, backward (gradients synchronized as the
        strategy does), then ``optimizer.step()`` and ``zero_grad()`` if an optimizer is given.

        Args:
            inputs: This rank's slice of the batch, passed to the model.
            targets: The matching targets, passed to ``loss_fn``.
            loss_fn: ``loss_fn(outputs, targets)`` returning a scalar (one-element) loss tensor.
            optimizer: Stepped and zeroed after backward; None leaves the step to the caller.

        Returns:
            This rank's loss, detached: a 0-dim tensor on the model's device that reads as a number
            (``float(loss)``, ``f"{loss:.3f}"``). It stays on the device, so the step makes no host sync; the
            read, when you make it, waits for the step.

        Raises:
            ValueError: When ``loss_fn`` does not return a tensor of one element.
        """
        self.train()
        loss = loss_fn(self(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
            )
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        return loss.detach().reshape(())

    def traffic_settings(self) -> dict[str, Any]:
        """Everything besides the module that shapes this strategy's collectives (bucket sizes, the wire dtype, the
        reduction each bucket uses, the layout of the ranks, ...): every rank must have the same, and
        :meth:`initialize_sharding` checks it across ranks before anything is sent, because the per-step
        collectives then run without a per-op check.

        Returns:
            Setting name -> a JSON-serializable value.
        """
        c = self.config
        settings = {
            "bucket_cap_mb": c.bucket_cap_mb,
            "first_bucket_mb": c.first_bucket_mb,
            "communication_dtype": str(c.communication_dtype),
            "gradient_as_bucket_view": c.gradient_as_bucket_view,
            "find_unused_parameters": c.find_unused_parameters,
            "broadcast_buffers": c.broadcast_buffers,
            "max_grad_norm": c.max_grad_norm,
        }
        layout = getattr(self, "_setup", {}).get("layout")
        if layout is not None:
            settings["layout"] = layout.describe()
        return settings

    def _check_same_model(self) -> None:
        """Every rank must wrap the same architecture with the same traffic settings: buckets and collectives derive
        from both, and the steps' collectives run unchecked (one exchange here, at wrap time; collective)."""
        mine = {"module": model_fingerprint(self.module), **self.traffic_settings()}
        payload = json.dumps(mine, sort_keys=True).encode()
        for peer, theirs in enumerate(json.loads(b) for b in exchange_bytes(self.comm, payload)):
            if theirs == mine:
                continue
            if theirs.get("module") != mine["module"]:
                raise ValueError(
                    f"{type(self).__name__}: rank {self.rank} wraps a module whose parameter names/shapes/dtypes "
                    f"differ from rank {peer}'s; every rank must build the same model before wrapping it"
                )
            key = next(k for k in sorted({*mine, *theirs}) if mine.get(k) != theirs.get(k))
            raise ValueError(
                f"{type(self).__name__}: rank {self.rank} has {key}={mine.get(key)!r} but rank {peer} has "
                f"{theirs.get(key)!r}; every rank must wrap with the same settings (they shape the buckets and "
                "collectives), e.g. build the ShardingConfiguration the same way on every rank"
            )

    def _mark_step_bytes(self) -> None:
        """Record the bytes communicated since the last mark as this step's (called when a step's sync ends)."""
        total = self._bytes_total()
        self.last_step_bytes, self._bytes_mark = total - self._bytes_mark, total

    def _bytes_total(self) -> int:
        """Bytes this rank has communicated so far through the backends this model uses."""
        return self.comm.stats.total_bytes

    # -- parameters as one flat vector ----------------------------------------------------------------------------

    def _module_params(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def gather_full_parameters(self) -> torch.Tensor:
        """All parameters of the wrapped module, flattened in ``parameters()`` order; identical on every rank.

        Returns:
            A 1-D tensor of :meth:`parameter_count` elements (empty for a module without parameters). Strategies
            that shard parameters gather them (collective).
        """
        params = self._module_params()
        if not params:
            return torch.empty(0)
        return torch.cat([p.detach().reshape(-1) for p in params])

    def get_parameters(self) -> torch.Tensor:
        """A copy of :meth:`gather_full_parameters`.

        Returns:
            A new 1-D tensor holding every parameter's values, in ``parameters()`` order.
        """
        return self.gather_full_parameters().clone()

    def parameter_count(self) -> int:
        """The number of elements of the full model's parameters (a tied parameter counted once).

        Returns:
            The element count, the length of :meth:`gather_full_parameters`.
        """
        return sum(p.numel() for p in self._module_params())

    def set_parameters(self, flat: torch.Tensor) -> None:
        """Overwrite every parameter from a flat vector in ``parameters()`` order (same on every rank).

        Args:
            flat: A 1-D tensor of :meth:`parameter_count` elements, as :meth:`gather_full_parameters` returns.

        Raises:
            ValueError: When ``flat`` is not a 1-D tensor of :meth:`parameter_count` elements.
        """
        params = self._module_params()
        self._check_flat(flat)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _check_flat(self, flat: torch.Tensor) -> None:
        """Refuse a :meth:`set_parameters` argument that is not a 1-D tensor of :meth:`parameter_count` elements."""
        count = self.parameter_count()
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != count:
            shape = tuple(flat.shape) if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise ValueError(
                f"set_parameters needs a 1-D tensor of {count} elements (the model's parameter count), got {shape}"
            )

    def clone(self) -> ShardedModel:
        """A new wrapper of the same strategy around a deep copy of the module (collective: every rank calls it).

        Returns:
            The new wrapper, built with the same ``config``.
        """
        return type(self)(copy.deepcopy(self.module), self.config)

    def with_parameters(self, flat: torch.Tensor) -> ShardedModel:
        """A clone holding ``flat`` as its parameters; this model is unchanged (collective).

        Args:
            flat: The clone's parameters, as for :meth:`set_parameters`.

        Returns:
            The new wrapper (see :meth:`clone`).

        Raises:
            ValueError: When ``flat`` is not a 1-D tensor of :meth:`parameter_count` elements.
        """
        twin = self.clone()
        twin.set_parameters(flat)
        return twin

    # -- checkpoints (gpudist.checkpoint) ---------------------------------------------------------------------------

    shards_parameters = False
    """Whether each rank holds only part of the parameters (ZeRO-3/FSDP); otherwise they are replicated."""

    def parameter_table(self) -> list[dict]:
        """Name, other names (tied parameters), shape and dtype of every full parameter, in parameters() order.

        Returns:
            One dict per parameter: ``{"name": str, "aliases": list[str], "shape": list[int], "dtype": str}``
            (the dtype without its ``torch.`` prefix).
        """
        return module_table(self.module)

    def checkpoint_segments(self) -> list[tuple[torch.Tensor, list[tuple[int, int, str, int]]]]:
        """Every trainable or frozen tensor this rank holds for the module's parameters, each with the pieces of
        full parameters it stores. Replicated strategies hold whole parameters.

        Returns:
            ``(tensor, pieces)`` pairs; each piece is ``(offset in the tensor, length, parameter name, offset in
            that parameter)`` over flattened values.
        """
        return module_segments(self.module)

    def checkpoint_share(self, name: str, across_replicas: bool = True) -> tuple[int, int] | None:
        """Which part of the pieces of parameter ``name`` this rank holds (:meth:`checkpoint_segments`) it writes
        into a checkpoint, so that every canonical element is written exactly once.

        Args:
            name: A parameter's name in the full module (its first name, as in :meth:`parameter_table`).
            across_replicas: False asks about state that is already split over the data-parallel replicas (a
                ZeRO optimizer's owned ranges): replicas are then not copies of each other.

        Returns:
            ``(copies, index)``: ``copies`` ranks hold the same elements and this rank writes the ``index``-th
            :func:`shard_range` of the full parameter (intersected with what it holds). None: another rank writes
            them all (a parameter tied across pipeline stages, written by the stage that owns it).
        """
        if self.shards_parameters or not across_replicas:
            return 1, 0
        return self.world_size, self.rank

    def buffer_table(self) -> list[dict]:
        """Name, shape and dtype of every buffer of the full module (what a checkpoint's manifest lists).

        Returns:
            One dict per buffer: ``{"name": str, "shape": list[int], "dtype": str}``.
        """
        return [
            {"name": n, "shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
            for n, b in self.module.named_buffers()
        ]

    def checkpoint_buffers(self) -> list[tuple[str, torch.Tensor, bool]]:
        """The buffers this rank holds; each buffer is written by one rank (rank 0 when every rank holds all of
        them).

        Returns:
            ``(name in the full module, tensor, whether this rank writes it)`` per buffer.
        """
        return [(n, b, self.rank == 0) for n, b in self.module.named_buffers()]

    # -- serialization --------------------------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's complete state (parameters and buffers), as a single process would hold it.

        Returns:
            The unwrapped module's ``state_dict()`` keys mapped to detached full tensors. Strategies that shard
            parameters gather them (collective).
        """
        return {k: v.detach() for k, v in self.module.state_dict().items()}

    def serialize(self) -> bytes:
        """The full model state as safetensors bytes (no pickle), with a checksum and the strategy in the header.

        Tied parameters (and any other state entries that are the same memory, e.g. a module shared by two parents)
        are stored once, under their first name; the header maps each other name to it (``"aliases"``) and
        :meth:`deserialize` gives them back the same values, so a tied model loads tied. safetensors itself refuses
        tensors that share memory.

        Returns:
            The payload :meth:`deserialize` reads, loadable by any strategy at any world size.
        """
        kept, aliases = _split_aliases(self.full_state_dict())
        state = {k: v.contiguous().cpu() for k, v in kept.items()}
        meta = {
            "format": FORMAT,
            "strategy": self.strategy,
            "world_size": str(self.world_size),
            "sha256": _digest(state, aliases),
        }
        if aliases:
            meta["aliases"] = json.dumps(aliases, sort_keys=True)
        return st_save(state, metadata=meta)

    def deserialize(self, data: bytes) -> None:
        """Load bytes from :meth:`serialize` (any strategy, any world size). Checks everything before changing
        anything: a damaged or mismatched payload raises and leaves the model as it was.

        Args:
            data: A payload from :meth:`serialize`.

        Raises:
            ValueError: When ``data`` is not a gpudist model payload (truncated, damaged or another format), its
                checksum does not match, or its tensors' names or shapes differ from this model's.
        """
        state, _ = _read(data)
        own = self.full_state_dict()
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(f"serialized model does not match: missing {missing[:5]}, unexpected {extra[:5]}")
        for k, v in own.items():
            if state[k].shape != v.shape:
                raise ValueError(
                    f"serialized model does not match: {k} has shape {tuple(state[k].shape)}, "
                    f"the model {tuple(v.shape)}"
                )
        self.load_full_state_dict(state)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a complete (unsharded) state into this wrapper; sharded strategies take their slice.

        Args:
            state: Every key of :meth:`full_state_dict`, mapped to a full tensor of the same shape (checked by
                :meth:`deserialize`, not here).
        """
        with torch.no_grad():
            for k, v in self.module.state_dict().items():
                v.copy_(state[k])

    def save_model(self, path: str | os.PathLike) -> None:
        """Save the model (collective: every rank calls it and returns once it is complete).

        Args:
            path: A path ending in ``.safetensors`` gets one file with the full state (an export, written
                atomically by rank 0); any other path becomes a sharded checkpoint folder
                (:func:`gpudist.save_checkpoint`: each rank writes its share, loadable by any strategy at any world
                size). It must be on a file system every rank sees.

        Raises:
            CheckpointError: (A folder) when a rank could not write its file; a previous checkpoint at ``path``
                is left as it was.
        """
        if Path(path).suffix == ".safetensors":
            data = self.serialize()
            if self.rank == 0:
                atomic_write_bytes(path, data)
            self.comm.barrier()
        else:
            save_checkpoint(path, self)

    def load_model(self, path: str | os.PathLike) -> None:
        """Load what :meth:`save_model` wrote (a file or a checkpoint folder, from any strategy and world size);
        checksums are verified and nothing changes if anything fails (collective for folders).

        Args:
            path: A ``.safetensors`` file or a checkpoint folder.

        Raises:
            FileNotFoundError: When ``path`` is neither a file nor a folder.
            CheckpointError: When the folder is not a complete, intact checkpoint of this model (on every rank
                when any rank fails).
            ValueError: When the file is damaged or holds another model (see :meth:`deserialize`).
        """
        path = Path(path)
        if path.is_dir():
            load_checkpoint(path, self)
            return
        if not path.is_file():
            raise FileNotFoundError(f"no model file or checkpoint folder at {path}")
        self.deserialize(path.read_bytes())

    # -- reporting ------------------------------------------------------------------------------------------------

    def memory_per_rank(self) -> dict[str, int]:
        """Bytes this rank holds, by category, measured from live tensors.

        Returns:
            Bytes by category: ``"parameters"``, ``"gradients"``, ``"optimizer_state"`` (of the paired optimizers)
            and ``"buffers"``; some strategies add their own (e.g. ``"communication_buffers"``).
        """
        params = self._module_params()
        grads = {id(p.grad): p.grad for p in params if p.grad is not None}
        ids = {id(p) for p in params}
        return {
            "parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(g.numel() * g.element_size() for g in grads.values()),
            "optimizer_state": sum(opt.state_bytes(ids) for opt in list(self._optimizers)),
            "buffers": sum(b.numel() * b.element_size() for b in self.module.buffers()),
        }

    def get_model_metadata(self) -> dict[str, Any]:
        """Strategy, world size, parameter count, bytes this rank communicated in the last step, memory by category.

        Returns:
            A dict with ``"strategy"``, ``"world_size"``, ``"rank"``, ``"parameter_count"``, ``"bytes_per_step"``,
            ``"memory_per_rank"`` (:meth:`memory_per_rank`) and, with gradient compression, ``"compression"``;
            some strategies add their layout.
        """
        return {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "rank": self.rank,
            "parameter_count": self.parameter_count(),
            "bytes_per_step": self.last_step_bytes,
            "memory_per_rank": self.memory_per_rank(),
            **({"compression": self._comm_hook.report()} if self._comm_hook is not None else {}),
        }


def replica_share(layout, rank: int, split: bool, across_replicas: bool) -> tuple[int, int]:
    """:meth:`ShardedModel.checkpoint_share` of one parameter under a pipeline x data x tensor ``layout`` (on the
    stage that writes it): a parameter tensor parallelism split has one copy of each element per data-parallel
    replica, an unsplit one (LayerNorms, row-parallel biases) one per replica and tensor rank; replicas count only
    ``across_replicas``. The copies of an element take turns in (data rank, tensor rank) order."""
    _, data_rank, tensor_rank = layout.coords(rank)
    tp, t = (1, 0) if split else (layout.tensor_parallel_size, tensor_rank)
    dp, d = (layout.data_parallel_size, data_rank) if across_replicas else (1, 0)
    return dp * tp, d * tp + t


def _digest(state: dict[str, torch.Tensor], aliases: dict[str, str] | None = None) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes() if state[k].numel() else b"")
    if aliases:  # absent from payloads without tied entries, whose digest stays what it was
        h.update(json.dumps(aliases, sort_keys=True).encode())
    return h.hexdigest()


def _read(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
        state = st_load(data)
    except Exception as e:  # safetensors raises several types for truncated or garbled input
        raise ValueError(f"not a gpudist model payload (truncated or damaged): {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a gpudist model payload: format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        aliases = json.loads(meta.get("aliases", "{}"))
        tied = {alias: state[name] for alias, name in aliases.items() if alias not in state}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a gpudist model payload: damaged aliases in the header ({e!r})") from None
    if meta.get("sha256") != _digest(state, aliases) or len(tied) != len(aliases):
        raise ValueError("model payload checksum mismatch: the data was damaged after it was written")
    return {**state, **tied}, meta


def _split_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state`` with each memory kept once (tied parameters are one tensor under several names): the entries
    under their first name, and every other name mapped to that first name."""
    first: dict[tuple, str] = {}
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride())
        if t.numel() and key in first:
            aliases[name] = first[key]
            continue
        first.setdefault(key, name)
        kept[name] = t
    return kept, aliases
