"""Live-mode snapshots: a rank's part of a checkpoint in memory (:func:`snapshot_state`), as a frame to send every
step (:func:`snapshot_frame`, :func:`frame_length`, :func:`frame_snapshot`), and loading any set of them that covers
the state (:func:`load_snapshots`); nothing is written to a file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from .format import FORMAT, CheckpointError, CheckpointInfo, Reader, _jsonable, _merged_body, _pack_runs
from .protocol import _comm_of
from .read import _load
from .write import _capture


def snapshot_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0, extra: dict | None = None
) -> bytes:
    """This rank's part of a checkpoint of ``model`` and ``optimizer`` as bytes in memory, for sending to a peer
    (live healing) instead of writing a file. Not collective, so it works after the group failed: the pieces are
    in the coordinates of the group the model was built on (a replicated model's rank writes only its share; pass
    the plain module and torch optimizer for a whole copy). :func:`load_snapshots` loads any set of them that
    covers the state, at any world size.

    Args:
        model: A gpudist ``ShardedModel``, or a plain ``nn.Module`` (then written whole).
        optimizer: A gpudist or torch optimizer over ``model``'s parameters; None: no optimizer state.
        step: The training step recorded with it.
        extra: A JSON-serializable dict carried with it.

    Returns:
        A safetensors file's bytes whose metadata carries the manifest body.

    Raises:
        TypeError: When ``extra`` is not JSON-serializable, or ``model`` is not an ``nn.Module``.
    """
    stored, meta = _snapshot_parts(model, optimizer, step, extra, clone=True)
    return st_save(stored, metadata=meta)


def _snapshot_parts(
    model: nn.Module, optimizer, step: int, extra: dict | None, clone: bool
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a snapshot (:func:`_capture`'s, packed) and its safetensors metadata."""
    if extra is not None and not _jsonable(extra):
        raise TypeError(f"extra must be JSON-serializable, got {extra!r}")
    pieces, scalars, body = _capture(model, optimizer, _comm_of(model, optimizer), step, extra, clone)
    stored, listed = _pack_runs(pieces)
    meta = {"format": FORMAT, "body": json.dumps(body), "pieces": json.dumps(listed), "scalars": json.dumps(scalars)}
    return stored, meta


_FRAME_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // _FRAME_ALIGN) * _FRAME_ALIGN


def snapshot_frame(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    extra: dict | None = None,
    capacity: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`snapshot_state` as a frame: one uint8 host tensor to send every step (buddy mirrors), made with a single
    copy of each piece of the state and no serialization pass (``snapshot_state`` copies, packs and serializes: three
    passes over the state). :func:`frame_snapshot` turns a frame into ``snapshot_state``'s bytes when it is needed
    (a heal).

    Layout: an int64 payload length ``P``, an int64 header length ``H``, the header (JSON: the manifest metadata of
    ``snapshot_state`` and each tensor's name, dtype, shape and offset), then the tensors' bytes, each 16-byte aligned;
    ``frame_length(frame) = 8 + P`` bytes are used, the rest is room.

    Args:
        model, optimizer, step, extra: As :func:`snapshot_state`.
        capacity: The frame's size at least (room to grow, so frames of later steps keep one size).
        out: A frame to write into if it is large enough (reused: no fresh memory each step).

    Returns:
        The frame: ``out``, or a new tensor.

    Raises:
        TypeError: When ``extra`` is not JSON-serializable, or ``model`` is not an ``nn.Module``.
    """
    stored, meta = _snapshot_parts(model, optimizer, step, extra, clone=False)
    entries, offset = [], 0
    for name, t in stored.items():
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset = _aligned(offset + t.numel() * t.element_size())
    header = json.dumps({"meta": meta, "tensors": entries}).encode()
    data = _aligned(16 + len(header))
    size = max(data + offset, capacity)
    frame = out if out is not None and out.numel() >= size else torch.empty(size, dtype=torch.uint8)
    frame[:16] = torch.tensor([data + offset - 8, len(header)], dtype=torch.int64).view(torch.uint8)
    frame[16 : 16 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for (_, _, _, at), t in zip(entries, stored.values(), strict=True):
        n = t.numel() * t.element_size()
        frame[data + at : data + at + n].view(t.dtype).copy_(t.reshape(-1))
    return frame


def frame_length(frame: torch.Tensor) -> int:
    """The bytes of ``frame`` (:func:`snapshot_frame`) in use; more than ``frame.numel()`` when only its start was
    received (the snapshot outgrew the frames it was sent in)."""
    return 8 + int(frame[:8].view(torch.int64))


def frame_snapshot(frame: torch.Tensor) -> bytes:
    """The :func:`snapshot_state` bytes of a :func:`snapshot_frame`, for :func:`load_snapshots`.

    Raises:
        CheckpointError: When the frame is damaged.
    """
    try:
        payload, length = (int(v) for v in frame[:16].view(torch.int64))
        header = json.loads(frame[16 : 16 + length].numpy().tobytes())
        data = _aligned(16 + length)
        tensors = {}
        for name, dtype, shape, at in header["tensors"]:
            dtype = getattr(torch, dtype)
            n = math.prod(shape) * dtype.itemsize
            if data + at + n > 8 + payload:
                raise ValueError(f"tensor {name} ends past the payload")
            tensors[name] = frame[data + at : data + at + n].view(dtype).reshape(shape).clone()  # own storage each
        return st_save(tensors, metadata=header["meta"])
    except Exception as e:  # json, torch and the checks raise several types for garbled input
        raise CheckpointError(f"snapshot frame is damaged: {type(e).__name__}: {e}") from None


def load_snapshots(
    snapshots: list[bytes], model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> CheckpointInfo:
    """Load the union of :func:`snapshot_state` results into ``model`` (and ``optimizer``), as
    :func:`load_checkpoint` loads a folder (collective; all ranks apply or none does): any strategy and world size.

    Args:
        snapshots: The snapshots whose pieces together cover what this rank needs (the same list on every rank,
            or at least lists that cover each rank's needs); the first one's manifest body is used.
        model: The gpudist ``ShardedModel`` or plain ``nn.Module`` to load into.
        optimizer: The optimizer to load the state into; None loads the model only.

    Returns:
        The snapshots' step, world size, strategy and ``extra`` (``path`` is ``"<memory>"``).

    Raises:
        CheckpointError: When the snapshots are malformed, do not match the model or optimizer, lack data this rank
            needs, or another rank could not load its own.
    """

    def source() -> tuple[dict, Reader]:
        if not snapshots:
            raise CheckpointError("no snapshot to load from")
        infos, files, bodies = [], {}, []
        for f, data in enumerate(snapshots):
            try:
                tensors = st_load(data)
                meta = _safetensors_metadata(data)
                infos.append({"pieces": json.loads(meta["pieces"]), "scalars": json.loads(meta["scalars"])})
                bodies.append(json.loads(meta["body"]))
            except Exception as e:  # safetensors and json raise several types for garbled input
                raise CheckpointError(f"snapshot {f} is damaged: {type(e).__name__}: {e}") from None
            files[f] = tensors
        body = _merged_body(bodies[0], infos)
        reader = Reader(Path("<memory>"), body)
        reader.files = files
        return body, reader

    return _load(Path("<memory>"), source, model, optimizer)


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file held in ``data`` (its header is 8 bytes of length, then JSON)."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})
