"""The plan's result: :class:`PlanResult` holds every configuration's prediction, ranked, and renders it as the
table ``gpudist plan`` prints, the code and launch command of a configuration, and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .codegen import _code_for
from .cost import Prediction
from .model import Cluster, Config, ModelSpec


@dataclass
class PlanResult:
    """Every configuration's :class:`Prediction`, ranked: feasible first, then by step time, then by memory."""

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    predictions: list[Prediction]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def best(self) -> Prediction | None:
        """The fastest configuration that fits, or None when none does."""
        return self.predictions[0] if self.predictions and self.predictions[0].fits else None

    def feasible(self) -> list[Prediction]:
        return [p for p in self.predictions if p.fits]

    def table(self, top: int = 12, infeasible: int = 6) -> str:
        """The ranked table: the ``top`` fastest that fit, then ``infeasible`` that do not, each with why. A layout
        is shown once: with its fastest activation checkpointing mode that fits, or, when none fits, with the one
        that needs the least memory (the rest stay in :attr:`predictions` and the JSON)."""
        fmt = lambda b: f"{b / 2**30:.2f}" if b >= 2**27 else f"{b / 2**20:.1f}M"
        head = (
            f"{'#':>3} {'configuration':<44} {'fits':<4} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
            f"{'total GiB':>9} {'MB/step':>9} {'inter MB':>8} {'step s':>8}  why"
        )
        lines = [
            f"model {self.model.name}: {self.model.numel / 1e9:.3f}B parameters, {self.model.layers} layers, "
            f"hidden {self.model.hidden}, seq {self.model.seq_len}; global batch {self.global_batch}; "
            f"{self.cluster.nodes} node(s) x {self.cluster.devices_per_node} devices of "
            f"{self.cluster.device_memory / 1e9:.0f} GB; {self.settings.get('dtype', '')} params, "
            f"{self.settings.get('optimizer', '')}",
            head,
            "-" * len(head),
        ]
        fitting = _per_layout(self.feasible())
        done = {_layout(p.config) for p in fitting}
        failing = sorted((p for p in self.predictions if not p.fits), key=lambda p: p.memory.get("total", math.inf))
        failing = [p for p in _per_layout(failing) if _layout(p.config) not in done]
        rank = {id(p): i for i, p in enumerate(self.predictions)}
        failing.sort(key=lambda p: rank[id(p)])
        shown = fitting[:top] + failing[:infeasible]
        for i, p in enumerate(shown, 1):
            mem = p.memory
            opt = mem.get("optimizer_state", 0) + mem.get("master", 0)
            step = f"{p.step_time:.3f}" if math.isfinite(p.step_time) else "-"
            lines.append(
                f"{i:>3} {p.config.describe():<44} {'yes' if p.fits else 'no':<4} "
                f"{fmt(mem.get('parameters', 0)):>8} {fmt(mem.get('gradients', 0)):>8} {fmt(opt):>8} "
                f"{fmt(mem.get('activations', 0)):>8} {mem.get('total', 0) / 2**30:>9.2f} "
                f"{p.bytes_per_step / 1e6:>9.1f} {p.link_bytes.get('inter', 0) / 1e6:>8.1f} {step:>8}  {p.why}"
            )
        total, ok = len(self.predictions), len(self.feasible())
        modes = self.settings.get("checkpointing", "none")
        tried = "each with activation checkpointing none, selective and full" if modes == "auto" else f"ckpt={modes}"
        lines.append(f"{ok} of {total} configurations fit ({tried}); sizes in GiB unless marked M (MiB)")
        return "\n".join(lines)

    def code(self, prediction: Prediction | None = None) -> str:
        """Python that builds ``prediction``'s configuration (the best by default) in a training script."""
        p = prediction or self.best
        if p is None:
            if self.settings.get("checkpointing", "auto") == "auto":
                return (
                    "# no configuration fits, even with full activation checkpointing: add devices or a smaller batch"
                )
            return "# no configuration fits: add devices, let --checkpointing search (auto), or use a smaller batch"
        return _code_for(p.config, self.settings)

    def command(self, prediction: Prediction | None = None) -> str:
        """A launch line for examples/train.py with ``prediction``'s configuration (the best by default)."""
        p = prediction or self.best
        if p is None:
            return ""
        c = p.config
        args = [f"--strategy {c.strategy}", f"--global-batch {self.global_batch}"]
        if c.tp > 1:
            args.append(f"--tp {c.tp}")
        if c.pp > 1:
            args += [f"--pp {c.pp}", f"--micro-batches {c.micro_batches}"]
        if c.comm_dtype:
            args.append(f"--comm-dtype {c.comm_dtype}")
        if c.compression:
            args.append(f"--compression {c.compression}")
        launch = (
            f"torchrun --nnodes {self.cluster.nodes} --nproc-per-node {self.cluster.devices_per_node}"
            if self.cluster.nodes > 1 or self.cluster.devices_per_node > 1
            else "python"
        )
        return f"{launch} examples/train.py {' '.join(args)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {
                "name": self.model.name,
                "parameters": self.model.numel,
                "layers": self.model.layers,
                "hidden": self.model.hidden,
                "heads": self.model.heads,
                "kv_heads": self.model.kv_heads,
                "vocab": self.model.vocab,
                "seq_len": self.model.seq_len,
            },
            "cluster": asdict(self.cluster),
            "global_batch": self.global_batch,
            "settings": self.settings,
            "best": self.best.row() if self.best else None,
            "code": self.code(),
            "command": self.command(),
            "configurations": [p.row() for p in self.predictions],
        }


def _layout(config: Config) -> Config:
    """``config`` without its activation checkpointing mode: the layout the modes are tried on."""
    return replace(config, checkpointing="none")


def _per_layout(predictions: list[Prediction]) -> list[Prediction]:
    """The first prediction of each layout, in order."""
    seen: set[Config] = set()
    out = []
    for p in predictions:
        if _layout(p.config) not in seen:
            seen.add(_layout(p.config))
            out.append(p)
    return out
