"""What ``gpudist bench gpu``'s ``gate`` part needs of the benchmark gate without importing the repository: the device
kind a baseline is stored under, and the gate's records read from pytest-benchmark's JSON. The gate itself (the
baselines in ``benchmarks/baselines/``, the tolerances, the check) is ``benchmarks/gate.py``, which re-exports these;
the part runs it in the repository (``pytest benchmarks/ --gate``)."""

from __future__ import annotations

import re

import torch

__all__ = ["device_kind", "records_from_json"]


def device_kind(device: torch.device | str) -> str:
    """The baseline a device is gated against: ``cpu`` (any CPU: ratios, not times, are compared), or ``cuda-`` and the
    GPU's model name (ratios differ between GPU generations: an H100 and an A100 get their own baselines)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def records_from_json(doc: dict) -> list[dict]:
    """The gate's records from pytest-benchmark's ``--benchmark-json`` document: every benchmark whose ``extra_info``
    carries a ratio (the tier's tests all do), keyed by its node id."""
    out = []
    for b in doc.get("benchmarks", []):
        info = b.get("extra_info", {})
        if "ratio" in info and "device_kind" in info:
            out.append({**info, "key": b["fullname"]})
    return out
