"""The checkpoint side of :class:`~gpudist.strategies.flat_optimizer.FlatShardOptimizer`: its owned state (and fp32
master of low-precision parameters) written as canonical pieces and read back from any world size and strategy
(``gpudist.checkpoint``'s optimizer protocol), and torch's ``state_dict`` of this rank's shard."""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint import (
    CheckpointError,
    Reader,
    Segments,
    Share,
    canonical,
    group_hyperparameters,
    load_keeping_identity,
    put_piece,
    saved_optimizer,
    scalar_of,
    update_group,
    written,
)

__all__ = ["FlatCheckpoint"]


class FlatCheckpoint:
    """Checkpoints of a :class:`~gpudist.strategies.flat_optimizer.FlatShardOptimizer` (a mixin of it: it reads the
    members that class documents, and its ``_step_counts``, ``_set_step_counts`` and ``_refresh_master``)."""

    # -- checkpoints (gpudist.checkpoint's optimizer protocol) -------------------------------------------------------

    def owned_canonical(self, segmap: dict[int, Segments]):
        """The owned buffer in canonical coordinates.

        The owned ranges are disjoint over this optimizer's ranks (the data-parallel replicas); copies elsewhere, as
        tensor ranks' replicated LayerNorms, are narrowed by the model's ``checkpoint_share(name, False)``.

        Args:
            segmap: ``id(parameter)`` -> the canonical pieces the model holds in it.

        Yields:
            ``(owned position, length, parameter name, position in it)``.
        """
        for p, start, at, length in self.owned_ranges():
            for pos, n, name, c in canonical(segmap[id(p)], start, start + length):
                yield at + pos - start, n, name, c

    def checkpoint_pieces(self, segmap: dict[int, Segments], share: Share, rank: int, world: int):
        """The owned state (and fp32 master of low-precision parameters) as canonical pieces; each rank writes the
        part of its owned ranges that ``share`` gives it.

        Args: as :meth:`ShardedOptimizer.checkpoint_pieces`.

        Returns:
            ``(pieces, scalars, description)``, as :meth:`ShardedOptimizer.checkpoint_pieces`.
        """
        pieces: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, float]] = {}
        owned = written(self.owned_canonical(segmap), share, False)
        tensors = dict(self._state)
        if not self._master_is_view:
            tensors["master"] = self._master
        for pos, n, name, c in owned:
            for key, t in tensors.items():
                put_piece(pieces, key, name, c, t[pos : pos + n])
        if self._inner is not None:  # generic path: per-view state of the wrapped optimizer's class
            for view, piece in zip(self._views, self._pieces, strict=True):
                state = self._inner.state.get(view, {})
                for pos, n, name, c in owned:
                    a, b = max(pos, piece.owned_offset), min(pos + n, piece.owned_offset + piece.length)
                    if a >= b:
                        continue
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor) and value.shape == view.shape and key != "step":
                            lo, hi = a - piece.owned_offset, b - piece.owned_offset
                            put_piece(pieces, key, name, c + a - pos, value.reshape(-1)[lo:hi])
                        elif (s := scalar_of(value)) is not None:
                            scalars.setdefault(name, {})[key] = s
        else:
            counts = self._step_counts()
            for g, group in enumerate(self.param_groups):
                for p in group["params"]:
                    for _, _, name, _ in segmap.get(id(p), []):
                        scalars.setdefault(name, {})["step"] = counts[g]
        kind = type(self.optimizer).__name__
        return pieces, scalars, {"class": kind, "groups": group_hyperparameters(self.param_groups)}

    def stage_checkpoint(self, body: dict, reader: Reader, segmap: dict[int, Segments], apply: list):
        """Read the state of the owned ranges (from whichever ranks' files hold it: any world size, any strategy).

        Args: as :meth:`ShardedOptimizer.stage_checkpoint`.

        Returns:
            A function that installs the rest (steps, hyper-parameters, the wrapped optimizer's state).

        Raises:
            CheckpointError: When the checkpoint holds no optimizer state, state of another optimizer class,
                another number of parameter groups or other state tensors than this optimizer needs, or lacks
                data this rank needs (or a file holding it is damaged).
        """
        saved, scalars, keys = saved_optimizer(body, reader, self.param_groups, type(self.optimizer).__name__)
        owned = list(self.owned_canonical(segmap))
        targets = dict(self._state)
        if set(keys) != set(targets) and self._inner is None:
            raise CheckpointError(
                f"{reader.path}: the checkpoint's optimizer state has {keys or 'no tensors'}, "
                f"this {type(self.optimizer).__name__} needs {sorted(targets)}"
            )
        for pos, n, name, c in owned:
            for key, t in targets.items():
                apply.append((t[pos : pos + n], reader.read(f"state.{key}", name, c, n, t.dtype)))
            if not self._master_is_view and reader.has("state.master", name):  # fp32 beats a bf16 copy of it
                master = reader.read("state.master", name, c, n, torch.float32)
                apply.append((self._master[pos : pos + n], master))
        inner_state = None
        if self._inner is not None:
            inner_state = {}
            for i, (view, piece) in enumerate(zip(self._views, self._pieces, strict=True)):
                entry: dict[str, Any] = {}
                for key in keys:
                    values = torch.zeros(piece.length, dtype=self._state_dtype, device="cpu")
                    for pos, n, name, c in owned:
                        a, b = max(pos, piece.owned_offset), min(pos + n, piece.owned_offset + piece.length)
                        if a < b:
                            values[a - piece.owned_offset : b - piece.owned_offset] = reader.read(
                                f"state.{key}", name, c + a - pos, b - a, self._state_dtype
                            )
                    entry[key] = values.view_as(view)
                name = next(
                    (
                        nm
                        for pos, n, nm, c in owned
                        if pos < piece.owned_offset + piece.length and pos + n > piece.owned_offset
                    ),
                    None,
                )
                for key, value in scalars.get(name, {}).items():
                    entry[key] = torch.tensor(float(value), device="cpu")
                inner_state[i] = entry

        def step_of(group) -> int:
            name = next((segs[0][2] for p in group["params"] if (segs := segmap.get(id(p)))), None)
            return int(scalars.get(name, {}).get("step", 0)) if name is not None else 0

        steps = [step_of(g) for g in self.param_groups]

        def finish() -> None:
            for group, hyper in zip(self.param_groups, saved["groups"], strict=True):
                update_group(group, hyper)
            self._set_step_counts(steps)
            if not any(reader.has("state.master", name) for _, _, name, _ in owned):
                self._refresh_master()  # no fp32 copy saved: start from the loaded parameters
            if inner_state is not None:
                sd = self._inner.state_dict()
                load_keeping_identity(self._inner, {"state": inner_state, "param_groups": sd["param_groups"]})

        return finish

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state, as torch's ``state_dict`` (for checkpoints that load at another
        world size, use :func:`gpudist.save_checkpoint`, which reshards).

        Returns:
            The strategy, world size, rank, owned segments, step counts, state tensors (copies), the wrapped
            optimizer's state (generic path) and the groups' hyper-parameters. Loads back only at the same world
            size (:meth:`load_state_dict`).
        """
        return {
            "strategy": self.strategy,
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "segments": list(self._segments),
            "steps": self._step_counts(),
            "state": {k: v.clone() for k, v in self._state.items()},
            "inner": self._inner.state_dict() if self._inner is not None else None,
            "param_groups": [
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self._hyper(g).items()}
                for g in range(len(self.param_groups))
            ],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned on this rank, at the same world size.

        Args:
            state_dict: This rank's :meth:`state_dict`, saved by the same strategy and world size.

        Raises:
            ValueError: When it was saved at another world size or for other owned segments (load across world
                sizes through a gpudist checkpoint).
        """
        if state_dict.get("world_size") != self.comm.world_size or state_dict.get("segments") != list(self._segments):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state was saved at world size "
                f"{state_dict.get('world_size')} with segments {state_dict.get('segments')}, this rank owns "
                f"{list(self._segments)} at world size {self.comm.world_size}; load across world sizes through a "
                "gpudist checkpoint"
            )
        for key, value in state_dict["state"].items():
            self._state[key].copy_(value)
        self._set_step_counts(state_dict["steps"])
        if self._inner is not None:
            self._inner.load_state_dict(state_dict["inner"])
        for group, hyper in zip(self.param_groups, state_dict["param_groups"], strict=True):
            update_group(group, hyper)
