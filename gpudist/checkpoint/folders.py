"""The folders under a checkpoint root: which hold complete checkpoints (:func:`complete_checkpoints`,
:func:`latest_checkpoint`), the lock a save holds while it renames its folder into place, and what interrupted saves
left: settled (:func:`settle_interrupted`) or cleared (:func:`remove_stale_staging`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from .format import MANIFEST, CheckpointError, read_manifest


def remove_stale_staging(root: str | os.PathLike) -> list[Path]:
    """Clear what interrupted saves left under ``root`` (hidden ``.NAME.tmp-*`` and ``.NAME.old-*`` folders), after
    :func:`settle_interrupted` put back what a save interrupted between its two renames left. Call it only when no
    save is in progress (e.g. on rank 0 when a job starts): a save being written keeps its files in a ``.tmp``
    folder until it commits.

    Args:
        root: The folder holding checkpoint folders (nothing happens if it does not exist).

    Returns:
        The folders it removed (not the ones it put back).
    """
    root = Path(root)
    settle_interrupted(root)
    removed = []
    for folders in _hidden_folders(root).values():
        for child, _ in folders:
            _discard(child)
            removed.append(child)
    return removed


@contextlib.contextmanager
def _root_lock(root: Path, timeout: float = 60.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the folder ``root`` itself (no lock file is left beside the checkpoints), waiting
    at most ``timeout`` seconds for it. A save holds it across its manifest write and two renames, a reader while it
    settles an interrupted save; the kernel releases it when its holder dies."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"the checkpoint folder {root} is still locked after {timeout:g}s: a save there holds it while "
                        "it moves its folder into place (milliseconds); a process that hangs holding it must be ended"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _hidden_folders(root: Path) -> dict[str, list[tuple[Path, str]]]:
    """Per checkpoint name, the hidden folders interrupted saves left under ``root``: ``(folder, ".tmp-" or
    ".old-")`` (a save's staging folder, and the previous folder it moved aside)."""
    hidden: dict[str, list[tuple[Path, str]]] = {}
    if not root.is_dir():
        return hidden
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") and child.is_dir():
            kind = next((k for k in (".tmp-", ".old-") if k in child.name), None)
            if kind is not None:
                hidden.setdefault(child.name[1:].rsplit(kind, 1)[0], []).append((child, kind))
    return hidden


def settle_interrupted(root: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Finish, or roll back, saves under ``root`` that were interrupted between their two renames (the previous
    folder moved aside, the new one not yet in place), so that a crash there loses no checkpoint: for each checkpoint
    name (or only ``name``) whose folder is missing while a complete hidden one is there, the newest complete one
    (the highest step; the new folder before the previous one at the same step) goes back under the name. Nothing
    is deleted, and nothing happens where every folder is in place. :func:`latest_checkpoint`,
    :func:`complete_checkpoints` and :func:`load_checkpoint` call it, so a restart needs no helper call; it runs
    under a lock on ``root`` that a save holds while it renames, so it never moves a live save's folders.

    Args:
        root: The folder holding checkpoint folders.
        name: Only this checkpoint's folders (None: every name under ``root``).

    Returns:
        The checkpoint folders it put back.

    Raises:
        CheckpointError: When the lock stays held for a minute (a save that hangs between its renames).
    """
    root = Path(root)
    interrupted = {
        n: folders
        for n, folders in _hidden_folders(root).items()
        if (name is None or n == name) and not (root / n).exists()
    }
    restored: list[Path] = []
    if not interrupted:
        return restored
    with _root_lock(root):
        for n, folders in interrupted.items():
            if (root / n).exists():  # a save (or another reader) put it in place meanwhile
                continue
            complete = [(_step_of(folder), kind == ".tmp-", folder) for folder, kind in folders]
            complete = [c for c in complete if c[0] is not None]
            if complete:
                os.replace(max(complete)[2], root / n)
                restored.append(root / n)
    return restored


def _discard(folder: Path) -> None:
    """Remove a checkpoint folder that is not needed any more, its manifest first: a removal cut short leaves a
    folder without a manifest, which nothing takes for a complete checkpoint."""
    (folder / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def _step_of(folder: Path) -> int | None:
    """The step of the complete checkpoint ``folder`` (None: not complete)."""
    try:
        return read_manifest(folder)["step"]
    except CheckpointError:
        return None


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoint folders under ``root`` with a valid manifest, newest step first (hidden folders skipped).

    A save interrupted between its two renames is finished or rolled back first (:func:`settle_interrupted`).

    Args:
        root: The folder holding checkpoint folders.

    Returns:
        Those folders; empty when there is none (or ``root`` does not exist).

    Raises:
        CheckpointError: When an interrupted save is to be settled and the folder's lock stays held for a minute.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    settle_interrupted(root)
    found = []
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            found.append((read_manifest(child)["step"], child.name, child))
        except CheckpointError:
            continue
    return [child for _, _, child in sorted(found, reverse=True)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint folder under ``root`` with the highest step.

    Hidden folders (interrupted saves) and folders without a valid manifest are skipped, after a save interrupted
    between its two renames was finished or rolled back (:func:`settle_interrupted`).

    Args:
        root: The folder holding checkpoint folders.

    Returns:
        That folder, or None if there is none (or ``root`` does not exist).
    """
    found = complete_checkpoints(root)
    return found[0] if found else None
