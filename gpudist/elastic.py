"""ElasticOptimizer: data-parallel training that survives workers leaving and joining (torchrun elastic launch).

A membership change restarts every worker (that is how torchrun's elastic agent works); the optimizer makes the
restart cheap and exact:

* On construction it loads the newest *complete* checkpoint under ``checkpoint_dir`` into the model and itself,
  resharded to the new world size (ZeRO state included), and restores the step, the samples seen and ``extra``.
* Every ``checkpoint_every`` steps it snapshots the model and optimizer to host memory and writes the files in a
  background thread while training goes on; the checkpoint is committed (manifest written, folder renamed into
  place) at the next step. A crash at any moment leaves the last committed checkpoint intact, so at most
  ``checkpoint_every`` steps are redone after a failure, and none is applied twice.
* Optionally the learning rate follows the global batch: ``lr_scaling="linear"`` (Goyal et al.) or ``"sqrt"``
  multiplies each group's base lr by ``(world_size / base_world_size)`` or its square root.

Launch (one agent per node; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes every round start a fresh store)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=job1 train.py
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from .checkpoint import (
    CheckpointError,
    CheckpointWrite,
    complete_checkpoints,
    load_checkpoint,
    remove_stale_staging,
)
from .config import ShardingConfiguration
from .flat import exchange_bytes
from .strategies.ddp import DDPModel
from .strategies.fsdp import ZeRO3Model, ZeRO3Optimizer
from .strategies.model import ShardedModel
from .strategies.optimizer import DataParallelWrapper, ShardedOptimizer
from .strategies.zero import ZeRO2Model, data_parallel_optimizer

__all__ = ["ElasticOptimizer", "elastic_classes"]

_SCALING = {None: lambda ratio: 1.0, "linear": lambda ratio: ratio, "sqrt": math.sqrt}
_PREFIX = "step-"


def elastic_classes(zero_stage: int) -> tuple[type[ShardedModel], type[ShardedOptimizer]]:
    """The model wrapper and data-parallel optimizer for ``zero_stage``: 0 (DDP, replicated state), 1 (ZeRO-1) and
    2 (ZeRO-2) as :func:`~gpudist.strategies.zero.data_parallel_optimizer` maps them, 3 (ZeRO-3: parameters split
    too). ZeRO-2 frees the gradients it does not own and ZeRO-3 the parameters, so each has its own model; stages 0
    and 1 reduce gradients with DDP.

    Raises:
        ValueError: When ``zero_stage`` is not 0, 1, 2 or 3.
    """
    if zero_stage == 3 and not isinstance(zero_stage, bool):
        return ZeRO3Model, ZeRO3Optimizer
    try:
        optimizer_class = data_parallel_optimizer(zero_stage)
    except ValueError:
        raise ValueError(
            f"zero_stage={zero_stage!r}; use 0 (replicated state), 1 (ZeRO-1), 2 (ZeRO-2) or 3 (ZeRO-3)"
        ) from None
    return (ZeRO2Model if zero_stage == 2 else DDPModel), optimizer_class


class ElasticOptimizer(DataParallelWrapper):
    """Data parallelism (replicated state, or ZeRO-1/2/3 with ``zero_stage``) with resumable, asynchronous,
    atomic checkpoints: see the module doc.

    ``model``: the module (or ``ShardedModel`` wrapper) whose parameters this optimizer steps; by default the
    wrapper built with the same ``config``. ``batch_size``: samples per rank per step, to count ``samples_seen``
    (the data position; with a fixed global batch, pass ``global_batch // world_size``). ``keep``: committed
    checkpoints kept (older ones are deleted). ``resume=False`` ignores existing checkpoints.

    After construction: ``step_count`` (optimizer steps applied so far, including those before the restart),
    ``samples_seen``, ``extra`` (a JSON dict of your own saved with every checkpoint, e.g. an epoch or a
    sampler's state), ``restored`` (the :class:`~gpudist.CheckpointInfo` loaded, or None) and ``history``
    (``[step, world_size]`` at each start). Call :meth:`finish` after the last step to commit the last checkpoint.

    Args:
        optimizer: The ``torch.optim.Optimizer`` over the model's parameters.
        config: The configuration the model wrapper (if any) was built from; ``config.backend`` is the
            data-parallel group.
        checkpoint_dir: The folder of the ``step-NNNNNNNNN`` checkpoints, on a file system every rank sees
            (created if missing).
        checkpoint_every: Steps between checkpoints (>= 1); a failure redoes at most that many steps.
        model: The module or ``ShardedModel`` to checkpoint; None: the wrapper built with ``config``.
        zero_stage: 0 (replicated state), 1 (ZeRO-1), 2 (ZeRO-2) or 3 (ZeRO-3; the model must be the
            :class:`~gpudist.ZeRO3Model` built with ``config``: :func:`elastic_classes` gives the pair).
        batch_size: Samples per rank per step, to count ``samples_seen``; None: not counted.
        lr_scaling: None, ``"linear"`` or ``"sqrt"``, as described in the module doc.
        base_world_size: The world size the groups' base learning rates are meant for; None: this run's (or the
            restored one's).
        keep: Committed checkpoints to keep (>= 1).
        resume: Load the newest complete checkpoint under ``checkpoint_dir`` now.

    Raises:
        TypeError: When ``optimizer`` is not a ``torch.optim.Optimizer`` (or is already wrapped), ``config`` is
            neither a ``ShardingConfiguration`` nor a ``ShardedModel``, or there is no model (no ``model`` and no
            wrapper built with ``config``).
        ValueError: When ``checkpoint_every``, ``zero_stage``, ``lr_scaling``, ``batch_size``, ``keep`` or
            ``base_world_size`` is invalid, ``zero_stage=3`` comes without a ``ZeRO3Model`` (or a ``ZeRO3Model``
            with another stage), or the data-parallel optimizer refuses the parameters (ZeRO: no
            trainable parameter, mixed dtypes or devices, layouts that differ between ranks).
        CheckpointError: When ``resume`` finds a checkpoint that cannot be loaded into the model and optimizer.
    """

    strategy = "elastic"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: ShardingConfiguration,
        checkpoint_dir: str | os.PathLike,
        checkpoint_every: int = 100,
        *,
        model: torch.nn.Module | None = None,
        zero_stage: int = 0,
        batch_size: int | None = None,
        lr_scaling: str | None = None,
        base_world_size: int | None = None,
        keep: int = 2,
        resume: bool = True,
    ):
        super().__init__(optimizer, config)
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(
                f"checkpoint_every={checkpoint_every!r} must be an integer >= 1 (steps between "
                "checkpoints; a failure redoes at most that many steps)"
            )
        model_class, inner_class = elastic_classes(zero_stage)
        if lr_scaling not in _SCALING:
            raise ValueError(f"lr_scaling={lr_scaling!r}; use None, 'linear' or 'sqrt'")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(
                f"batch_size={batch_size!r} must be a positive integer (samples per rank per step) or None"
            )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an integer >= 1 (committed checkpoints to keep)")
        if base_world_size is not None and (not isinstance(base_world_size, int) or base_world_size < 1):
            raise ValueError(f"base_world_size={base_world_size!r} must be a positive integer or None")
        module = model if model is not None else self.model()
        if module is None:
            raise TypeError(
                "ElasticOptimizer needs the model it checkpoints: build a DDPModel/ZeRO model with the "
                "same config first, or pass model=your_module"
            )
        if (zero_stage == 3) != isinstance(module, ZeRO3Model):  # the other stages' optimizers step whole parameters
            raise ValueError(
                f"zero_stage={zero_stage} with a {type(module).__name__}: ZeRO-3 shards the parameters, so its "
                f"optimizer pairs only with a ZeRO3Model and a ZeRO3Model only with zero_stage=3; build the model "
                f"as {model_class.__name__} (gpudist.elastic.elastic_classes({zero_stage})[0]) or pass the "
                "zero_stage it was built for"
            )
        shared_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if shared_store and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            warnings.warn(
                "several torchrun agents share the rendezvous store: with torch 2.11-2.13 the agents wait "
                "forever when a node joins. Launch them with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                "(docs/strategies.md, Elastic training)",
                RuntimeWarning,
                stacklevel=2,
            )
        self.inner = inner_class(optimizer, config)
        self.module = module
        self.zero_stage = zero_stage
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self.batch_size = batch_size
        self.lr_scaling = lr_scaling
        self.keep = keep
        self.base_world_size = base_world_size or self.comm.world_size
        self.base_lrs = [float(g["lr"]) for g in self.param_groups]
        self.step_count = 0
        self.samples_seen = 0
        self.extra: dict[str, Any] = {}
        self.history: list[list[int]] = []
        self.restored = None
        self._pending = None
        if resume:
            self.restore()
        self.history.append([self.step_count, self.comm.world_size])
        self._scale_lr()

    # -- checkpoints -------------------------------------------------------------------------------------------------

    def _name(self, step: int) -> Path:
        return self.checkpoint_dir / f"{_PREFIX}{step:09d}"

    def restore(self):
        """Load the newest checkpoint under ``checkpoint_dir`` that loads (collective; every rank tries the same ones,
        listed by rank 0, newest first: one whose files are damaged gives way to the one before it, with a warning),
        and the step, samples seen, history and ``extra`` saved with it. A save interrupted between its renames is
        finished first (:func:`gpudist.checkpoint.remove_stale_staging`).

        Returns:
            Its :class:`~gpudist.CheckpointInfo`, or None when there is none.

        Raises:
            CheckpointError: When no checkpoint there can be loaded into the model and optimizer (nothing changes).
        """

        comm = self.comm
        listed = b""
        if comm.rank == 0:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_staging(self.checkpoint_dir)  # interrupted saves of the run before the restart
            listed = "\n".join(map(str, complete_checkpoints(self.checkpoint_dir))).encode()
        candidates = [c for c in exchange_bytes(comm, listed)[0].decode().split("\n") if c]
        if not candidates:
            return None
        info, failures = None, []
        for candidate in candidates:  # newest first; one that fails to load (every rank agrees) gives way
            try:
                info = load_checkpoint(candidate, self.module, self.inner)
                break
            except CheckpointError as e:
                failures.append(f"{candidate}: {e}")
                if comm.rank == 0:
                    warnings.warn(f"ElasticOptimizer: skipping {candidate}, which cannot be loaded ({e})", stacklevel=2)
        if info is None:
            raise CheckpointError(
                f"none of the {len(candidates)} checkpoint(s) under {self.checkpoint_dir} can be loaded: "
                + "; ".join(failures)
            )
        state = info.extra.get("elastic", {})
        self.step_count = info.step
        self.samples_seen = int(state.get("samples_seen", 0))
        self.history = [list(h) for h in state.get("history", [])]
        self.base_world_size = int(state.get("base_world_size", self.base_world_size))
        self.base_lrs = [float(x) for x in state.get("base_lrs", self.base_lrs)]
        self.extra = dict(info.extra.get("user", {}))
        self.restored = info
        return info

    def _scale_lr(self) -> None:
        factor = _SCALING[self.lr_scaling](self.comm.world_size / self.base_world_size)
        for group, base in zip(self.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def checkpoint(self, background: bool = True):
        """Start a checkpoint of the current step now (collective); it is committed by the next :meth:`step`,
        :meth:`checkpoint` or :meth:`finish` (or right away when ``background=False``).

        Args:
            background: Write the files in a background thread (True) or now, committing at once (False).

        Raises:
            CheckpointError: When the pending (or, with ``background=False``, this) checkpoint could not be
                written on some rank; the committed ones are untouched.
            TypeError: When ``extra`` is not JSON-serializable.
        """

        self._commit()
        extra = {
            "elastic": {
                "samples_seen": self.samples_seen,
                "history": self.history,
                "base_world_size": self.base_world_size,
                "base_lrs": self.base_lrs,
            },
            "user": self.extra,
        }
        self._pending = CheckpointWrite(
            self._name(self.step_count),
            self.module,
            self.inner,
            step=self.step_count,
            extra=extra,
            background=background,
        )
        if not background:
            self._commit()

    def _commit(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.wait()
        if self.comm.rank == 0:  # keep the newest ``keep`` committed checkpoints
            done = sorted(p for p in self.checkpoint_dir.iterdir() if p.name.startswith(_PREFIX) and p.is_dir())
            for old in done[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    # -- the optimizer -----------------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        self.inner.reduce_gradients()

    def capture_refusal(self) -> str | None:
        """An elastic step may change the group: not captured."""
        return "an elastic step may change the group; run it eagerly"

    def step(self, closure=None):
        """Commit the pending checkpoint, step the data-parallel optimizer (collective), count the step and the
        samples, and start a checkpoint every ``checkpoint_every`` steps.

        Args:
            closure: Re-evaluates the model and returns the loss; None: use the gradients already computed.

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            CheckpointError: When the pending checkpoint could not be written on some rank.
            TypeError: When a checkpoint is due and ``extra`` is not JSON-serializable.
        """
        self._commit()  # the previous checkpoint's files were written while this step's forward/backward ran
        loss = self.inner.step(closure)
        self.step_count += 1
        if self.batch_size is not None:
            self.samples_seen += self.batch_size * self.comm.world_size
        if self.step_count % self.checkpoint_every == 0:
            self.checkpoint()
        return loss

    def finish(self) -> None:
        """Commit the pending checkpoint (collective). Call after the last step.

        Raises:
            CheckpointError: When the pending checkpoint could not be written on some rank.
        """
        self._commit()
