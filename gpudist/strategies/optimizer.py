"""ShardedOptimizer: the torch.optim wrapper every optimizer strategy subclasses (seeds: ShardedOptimizerBase).

A strategy decides where optimizer state lives and how updated parameters are shared by implementing
``reduce_gradients`` (make the gradients this rank steps on global) and, when state is sharded, ``step``.
Early stopping, the training loop (``optimize``), state (de)serialization and parameter/state
synchronization are shared here.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..checkpoint import (
    Reader,
    Segments,
    Share,
    load_keeping_identity,
    optimizer_pieces,
    stage_optimizer,
    stage_torch_optimizer,
    torch_optimizer_pieces,
)
from ..comm import ReductionOperation
from ..config import ShardingConfiguration
from ..flat import broadcast_tensors
from .model import ShardedModel

__all__ = ["DataParallelWrapper", "OptimizationResult", "ShardedOptimizer"]

STATE_FORMAT = "gpudist.optimizer.v1"


@dataclass
class OptimizationResult:
    """What :meth:`ShardedOptimizer.optimize` did.

    Attributes:
        steps: Optimizer steps taken.
        epochs: Epochs started (the last one possibly cut short by ``max_steps``).
        losses: Each step's loss, averaged over ranks.
        epoch_losses: Each epoch's mean step loss.
        best_loss: The lowest epoch loss.
        final_loss: The last step's loss (NaN when no step ran).
        stopped_early: Whether ``patience`` ended training.
        seconds: Wall-clock time of the whole call.
    """

    steps: int
    epochs: int
    losses: list[float] = field(default_factory=list)
    """Per step, averaged over ranks."""
    epoch_losses: list[float] = field(default_factory=list)
    best_loss: float = math.inf
    final_loss: float = math.nan
    stopped_early: bool = False
    seconds: float = 0.0


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of all optimizer strategies: wraps a ``torch.optim.Optimizer`` and shares its param_groups and state.

    It is itself a ``torch.optim.Optimizer`` (LR schedulers and ``GradScaler`` accept it). Used with a
    plain module, the optimizer does all the communication itself; used with the matching ``ShardedModel``
    built from the same ``config``, it leaves gradient reduction to the model and never repeats it.

    Args:
        optimizer: The ``torch.optim.Optimizer`` to wrap (not a ``ShardedOptimizer``); its ``param_groups`` and
            ``state`` are shared, not copied.
        config: The :class:`~gpudist.ShardingConfiguration` the model wrapper (if any) was built from, which
            finds that model (:meth:`ShardingConfiguration.model_for`), or the ``ShardedModel`` itself (explicit
            pairing; its ``config`` is used).

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` or is already a ``ShardedOptimizer``, or
            ``config`` is neither a ``ShardingConfiguration`` nor a ``ShardedModel``.
        ValueError: When the ``ShardedModel`` passed as ``config`` does not reduce every trainable parameter of
            ``optimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: ShardingConfiguration | ShardedModel):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, ShardedOptimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer instance, got {type(optimizer).__name__}"
            )
        model = None
        if isinstance(config, ShardedModel):  # explicit pairing: the model hands over its configuration
            model, config = config, config.config
        if not isinstance(config, ShardingConfiguration):
            raise TypeError(
                f"config must be a gpudist.ShardingConfiguration or the ShardedModel this optimizer pairs with, got "
                f"{type(config).__name__}"
            )
        super().__init__([{"params": list(g["params"])} for g in optimizer.param_groups], optimizer.defaults)
        # Share, do not copy: schedulers editing our param_groups edit the wrapped optimizer's.
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.config = config
        self._model: ShardedModel | None = None
        self._named_model = model
        self.gradient_norm_fn: Callable[[], float] | None = None
        """The global gradient norm for clipping (collective), when this optimizer steps one part of a larger
        model (HybridShardedOptimizer sets it on its data-parallel optimizer); None: the norm of its own gradients."""
        if model is not None:
            self._check_pairing(model)
        self.model()  # pair now when the model exists (memory reports count this optimizer's state from then on)

    def state_bytes(self, params: set[int] | None = None) -> int:
        """Bytes of optimizer state tensors this rank holds (for the parameters with ids in ``params``, or all).

        Args:
            params: ``id()`` of the parameters to count; None counts all.

        Returns:
            The bytes of the matching state tensors.
        """
        return sum(
            v.numel() * v.element_size()
            for p, entry in self.state.items()
            if params is None or id(p) in params
            for v in entry.values()
            if isinstance(v, torch.Tensor)
        )

    @property
    def comm(self):
        """The backend this optimizer communicates on (``config.backend``)."""
        return self.config.backend

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def model(self) -> ShardedModel | None:
        """The model wrapper that reduces all of this optimizer's gradients, if any.

        Returns:
            The one named at construction, else the one built from the same config that manages every parameter
            (:meth:`ShardingConfiguration.model_for`). None: a plain module, whose gradients this optimizer
            reduces itself.
        """
        if self._model is None:
            named = self._named_model
            params = [p for p in self._params() if p.requires_grad]
            self._model = named if named is not None else self.config.model_for(params)
            if self._model is not None:
                self._model._optimizers.add(self)
        return self._model

    def _check_pairing(self, model: ShardedModel) -> None:
        """A model named explicitly must reduce every trainable parameter of this optimizer."""
        foreign = [i for i, p in enumerate(self._params()) if p.requires_grad and not model.manages(p)]
        if foreign:
            raise ValueError(
                f"{type(self).__name__}: {len(foreign)} parameter(s) of the optimizer (first at index {foreign[0]}) "
                f"are not {type(model).__name__}'s; build the optimizer from model.parameters()"
            )

    # -- the strategy's part -----------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Make the gradients this rank steps on the global average (no-op when a model wrapper did it)."""
        raise NotImplementedError

    # -- stepping ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_gradients(self) -> torch.Tensor | None:
        """Clip to ``config.max_grad_norm`` (global L2 norm over every rank's gradients), on the device: no host sync.

        Returns:
            The gradient norm before clipping (a tensor on the gradients' device, as
            ``torch.nn.utils.clip_grad_norm_`` returns), or None when ``config.max_grad_norm`` is None.
        """
        if self.config.max_grad_norm is None:
            return None
        grads = [p.grad for p in self._params() if p.grad is not None]
        if self.gradient_norm_fn is None:
            return torch.nn.utils.clip_grad_norm_(grads, self.config.max_grad_norm)
        norm = torch.as_tensor(self.gradient_norm_fn()).reshape(())
        # torch.nn.utils.clip_grad_norm_'s rule, NaN included: a coefficient of at most 1, applied on the device
        coefficient = (self.config.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, coefficient.to(grads[0].device, grads[0].dtype))
        return norm

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Reduce the gradients (unless the model wrapper did), clip them, and step the wrapped optimizer.

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients enabled), as for any torch
                optimizer; None: use the gradients already computed.

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        self.clip_gradients()
        self.optimizer.step()
        return loss

    def capture_refusal(self) -> str | None:
        """Why a captured graph (:func:`gpudist.capture`) could not replay this optimizer's step, or None: it can.
        Here: what :func:`torch_capture_refusal` says of the wrapped torch optimizer, which this one steps.

        Returns:
            The reason and the way out, or None.
        """
        return torch_capture_refusal(self.optimizer)

    @contextlib.contextmanager
    def graph_capture(self) -> Iterator[None]:
        """A graph is being captured (:func:`gpudist.capture` enters this around the captured step, outside the
        graph): an optimizer that reads its own results on the host between steps settles them before, and reads
        nothing inside. The default reads nothing."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (a paired model's gradient buckets, or the wrapped optimizer's parameters').

        Args:
            set_to_none: Drop the gradients (torch's default) instead of zeroing them in place.
        """
        model = self.model()
        if model is not None and hasattr(model, "zero_grad_buckets"):
            model.zero_grad_buckets(set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state.

        Returns:
            The wrapped optimizer's ``state_dict()``.
        """
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` into the wrapped optimizer, keeping its ``param_groups`` and ``state`` objects
        (so LR schedulers and wrappers sharing them stay connected).

        Args:
            state_dict: What :meth:`state_dict` returned, for an optimizer with the same parameter groups.
        """
        load_keeping_identity(self.optimizer, state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer (as ``torch.optim.Optimizer.add_param_group``).

        Args:
            param_group: ``{"params": [...], **hyper-parameters}``.
        """
        if hasattr(self, "optimizer"):
            self.optimizer.add_param_group(param_group)
            self._model = None
        else:  # called by torch.optim.Optimizer.__init__ while we are being built
            super().add_param_group(param_group)

    # -- synchronization ---------------------------------------------------------------------------------------------

    def synchronize_parameters(self, src: int = 0) -> None:
        """Make every rank's parameters equal to ``src``'s (repairs drift; collective).

        Args:
            src: The rank whose values every rank takes.

        Raises:
            TypeError: When ``src`` is not an int.
            ValueError: When ``src`` is not a rank of the group.
        """
        broadcast_tensors(self.comm, [p.data for p in self._params()], src)

    def synchronize_optimizer_state(self, src: int = 0) -> None:
        """Make every rank's optimizer state equal to ``src``'s (replicated state; collective).

        Every rank must already hold state of the same structure (e.g. after the same number of steps).

        Args:
            src: The rank whose state every rank takes.

        Raises:
            TypeError: When ``src`` is not an int.
            ValueError: When ``src`` is not a rank of the group.
        """
        tensors = [v for p in self._params() for v in self.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        broadcast_tensors(self.comm, tensors, src)

    def should_early_stop(self, local_flag: bool, require: str = "all") -> bool:
        """Consensus on stopping. Every rank gets the same answer (collective).

        Args:
            local_flag: This rank's vote: True to stop.
            require: ``"all"`` stops only when every rank votes to stop, ``"any"`` when one does.

        Returns:
            Whether to stop, the same on every rank.

        Raises:
            ValueError: When ``require`` is neither ``"all"`` nor ``"any"``.
        """
        if require not in ("all", "any"):
            raise ValueError(f"require={require!r} must be 'all' or 'any'")
        vote = torch.tensor([1 if local_flag else 0], dtype=torch.int64, device=self.comm.device)
        self.comm.all_reduce(vote, ReductionOperation.MIN if require == "all" else ReductionOperation.MAX)
        return bool(vote.item())

    # -- the seeds' training loop ------------------------------------------------------------------------------------

    def optimize(
        self,
        model: torch.nn.Module,
        batches: Callable[[int], Iterable[tuple[Any, Any]]] | Iterable[tuple[Any, Any]],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        epochs: int = 1,
        max_steps: int | None = None,
        patience: int | None = None,
        min_delta: float = 0.0,
    ) -> OptimizationResult:
        """Train ``model`` for up to ``epochs`` passes over ``batches`` or ``max_steps`` steps.

        Each step's loss is averaged over ranks. With ``patience``, training stops when the epoch loss has not
        improved by ``min_delta`` for that many epochs (every rank decides alike). Collective.

        Args:
            model: The model this optimizer steps: a ``ShardedModel`` (trained with its ``train_step``) or a plain
                module.
            batches: This rank's ``(inputs, targets)`` pairs: an iterable, or a callable ``batches(epoch)`` that
                gives a fresh iterable per epoch.
            loss_fn: ``loss_fn(outputs, targets)`` returning a scalar loss tensor.
            epochs: The most passes over ``batches``.
            max_steps: Stop after this many steps in all; None: no limit.
            patience: Stop after this many epochs without improvement; None: never stop early.
            min_delta: The smallest decrease of the epoch loss that counts as an improvement.

        Returns:
            What the training did (:class:`OptimizationResult`).

        Raises:
            ValueError: When ``epochs``, ``max_steps`` or ``patience`` is below 1, or (with a ``ShardedModel``)
                ``loss_fn`` does not return a one-element tensor.
        """
        if epochs < 1 or (max_steps is not None and max_steps < 1) or (patience is not None and patience < 1):
            raise ValueError(f"epochs={epochs}, max_steps={max_steps}, patience={patience}: each must be >= 1")
        start = time.perf_counter()
        result = OptimizationResult(steps=0, epochs=0)
        stale = 0
        for epoch in range(epochs):
            epoch_sum, epoch_steps = 0.0, 0
            for inputs, targets in batches(epoch) if callable(batches) else batches:
                if isinstance(model, ShardedModel):
                    local = float(model.train_step(inputs, targets, loss_fn, self))  # fit reports every step
                else:
                    loss = loss_fn(model(inputs), targets)
                    loss.backward()
                    self.step()
                    self.zero_grad()
                    local = float(loss.detach())
                mean = torch.tensor([local], dtype=torch.float64, device=self.comm.device)
                self.comm.all_reduce(mean, ReductionOperation.AVERAGE)
                result.losses.append(mean.item())
                epoch_sum, epoch_steps = epoch_sum + mean.item(), epoch_steps + 1
                result.steps += 1
                if max_steps is not None and result.steps >= max_steps:
                    break
            result.epochs = epoch + 1
            epoch_loss = epoch_sum / max(epoch_steps, 1)
            result.epoch_losses.append(epoch_loss)
            improved = epoch_loss < result.best_loss - min_delta
            result.best_loss = min(result.best_loss, epoch_loss)
            stale = 0 if improved else stale + 1
            if max_steps is not None and result.steps >= max_steps:
                break
            if patience is not None and self.should_early_stop(stale >= patience):
                result.stopped_early = True
                break
        result.final_loss = result.losses[-1] if result.losses else math.nan
        result.seconds = time.perf_counter() - start
        return result

    # -- checkpoints (gpudist.checkpoint's optimizer protocol) -------------------------------------------------------

    def checkpoint_pieces(self, segmap: dict[int, Segments], share: Share, rank: int, world: int):
        """This rank's optimizer state as checkpoint pieces (:class:`gpudist.checkpoint.CheckpointableOptimizer`).
        Here: the wrapped optimizer's per-parameter state, written once across the ranks holding copies of it.
        Strategies whose state is sharded or held elsewhere override it.

        Args:
            segmap: ``id(parameter)`` -> the canonical pieces the model holds in it.
            share: The model's :meth:`~gpudist.ShardedModel.checkpoint_share`.
            rank: This rank in the checkpoint's group.
            world: The size of that group.

        Returns:
            ``(pieces, scalars, description)``: the state pieces this rank writes, the per-parameter scalars (such
            as Adam's ``step``) and ``{"class": ..., "groups": ...}``.
        """
        return torch_optimizer_pieces(self.optimizer, segmap, share)

    def stage_checkpoint(self, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list):
        """Read the state this rank needs from a checkpoint; return what installs it
        (:class:`gpudist.checkpoint.CheckpointableOptimizer`).

        Args:
            body: The checkpoint's verified manifest (:func:`gpudist.read_manifest`).
            reader: Reads canonical ranges from the checkpoint's files.
            segmap: ``id(parameter)`` -> the canonical pieces the model holds in it.
            apply: ``(destination, values)`` copies to make once every rank has read successfully; appended to.

        Returns:
            A function that installs the state read; nothing changes before it is called.

        Raises:
            CheckpointError: When the checkpoint holds no optimizer state, state of another optimizer class or
                number of parameter groups, or lacks data this rank needs (or a file holding it is damaged).
        """
        return stage_torch_optimizer(self.optimizer, body, reader, segmap, apply)

    # -- bytes -------------------------------------------------------------------------------------------------------

    def serialize(self) -> bytes:
        """The optimizer state as safetensors bytes: tensors by parameter index, the rest as JSON in the header.

        Returns:
            The payload :meth:`deserialize` reads.
        """
        sd = self.optimizer.state_dict()
        tensors, plain = {}, {}
        for pid, entry in sd["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state.{pid}.{key}"] = value.detach().contiguous().cpu()
                else:
                    plain[f"{pid}.{key}"] = value
        meta = {"format": STATE_FORMAT, "param_groups": json.dumps(sd["param_groups"]), "plain": json.dumps(plain)}
        return st_save(tensors, metadata=meta)

    def deserialize(self, data: bytes) -> None:
        """Load bytes from :meth:`serialize` into the wrapped optimizer (which must hold the same parameters).

        Args:
            data: A payload from :meth:`serialize`.

        Raises:
            ValueError: When ``data`` is not a gpudist optimizer payload (truncated, damaged or another format), or
                (torch's ``load_state_dict``) its parameter groups do not match the wrapped optimizer's.
        """
        try:
            header_len = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
            tensors = st_load(data)
        except Exception as e:
            raise ValueError(f"not a gpudist optimizer payload (truncated or damaged): {e}") from None
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"not a gpudist optimizer payload: format {meta.get('format')!r}")
        state: dict[int, dict[str, Any]] = {}
        for name, value in tensors.items():
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = value
        for name, value in json.loads(meta["plain"]).items():
            pid, key = name.split(".", 1)
            state.setdefault(int(pid), {})[key] = value
        self.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


def torch_capture_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a captured graph could not replay ``optimizer.step()``, or None: torch's Adam and AdamW keep their step
    count on the host unless built with ``capturable=True``, and a graph would freeze it at the captured step.

    Returns:
        The reason and the way out, or None.
    """
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not all(
        g.get("capturable") for g in optimizer.param_groups
    ):
        name = type(optimizer).__name__
        return (
            f"torch.optim.{name} keeps its step count on the host unless built with capturable=True; build "
            f"torch.optim.{name}(..., capturable=True)"
        )
    return None


class DataParallelWrapper(ShardedOptimizer):
    """Base of the optimizers that step through a data-parallel optimizer they hold as ``self.inner``
    (:class:`gpudist.HybridShardedOptimizer`, :class:`gpudist.ElasticOptimizer`): the gradients, the state and the
    checkpoint pieces are the inner optimizer's, and these methods hand them to it."""

    inner: ShardedOptimizer

    def graph_capture(self) -> contextlib.AbstractContextManager[None]:
        """The data-parallel optimizer's (:meth:`ShardedOptimizer.graph_capture`)."""
        return self.inner.graph_capture()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients through the data-parallel optimizer.

        Args:
            set_to_none: Drop the gradients (torch's default) instead of zeroing them in place.
        """
        self.inner.zero_grad(set_to_none)

    # -- checkpoints: the state is the data-parallel optimizer's -----------------------------------------------------

    def checkpoint_pieces(self, segmap: dict[int, Segments], share: Share, rank: int, world: int):
        """The data-parallel optimizer's checkpoint pieces (:meth:`ShardedOptimizer.checkpoint_pieces`).

        Args:
            segmap: ``id(parameter)`` -> the canonical pieces the model holds in it.
            share: The model's :meth:`~gpudist.ShardedModel.checkpoint_share`.
            rank: This rank in the checkpoint's group.
            world: The size of that group.

        Returns:
            ``(pieces, scalars, description)`` of the data-parallel optimizer.
        """
        return optimizer_pieces(self.inner, segmap, share, rank, world)

    def stage_checkpoint(self, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list):
        """Read the data-parallel optimizer's state from a checkpoint (:meth:`ShardedOptimizer.stage_checkpoint`).

        Args:
            body: The checkpoint's verified manifest.
            reader: Reads canonical ranges from the checkpoint's files.
            segmap: ``id(parameter)`` -> the canonical pieces the model holds in it.
            apply: ``(destination, values)`` copies to make once every rank has read successfully; appended to.

        Returns:
            A function that installs the state read.

        Raises:
            CheckpointError: When the checkpoint's optimizer state does not fit the data-parallel optimizer or
                lacks data this rank needs (see :meth:`ShardedOptimizer.stage_checkpoint`).
        """
        return stage_optimizer(self.inner, body, reader, segmap, apply)

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state.

        Returns:
            The data-parallel optimizer's ``state_dict()`` (ZeRO: this rank's shard, for the same world size).
        """
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` into the data-parallel optimizer.

        Args:
            state_dict: What :meth:`state_dict` returned (ZeRO: on this rank, at the same world size).

        Raises:
            ValueError: (ZeRO) When it was saved at another world size or for other owned segments.
        """
        self.inner.load_state_dict(state_dict)
