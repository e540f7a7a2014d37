"""What every rank must agree on around a checkpoint: whether any rank
failed (each then raises the same error, instead of the others hanging in
the next collective), and when the files are complete (they are written
under a temporary name and take their real one only then, so a failure
leaves the previous checkpoint as it was).
"""

from __future__ import annotations

import importlib
import os
import shutil

import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
    """Every rank calls it with its own error (or None). If any rank
    failed, every rank raises an error of the first failing rank's class
    (where it can be rebuilt from a message; ``RuntimeError`` otherwise)
    naming that rank and its message."""
    mine = None if error is None else (type(error).__module__, type(error).__qualname__, str(error))
    every = [mine]
    if _distributed():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    failed = [(rank, e) for rank, e in enumerate(every) if e is not None]
    if not failed:
        return
    rank, (module, name, message) = failed[0]
    text = f"{what} failed on rank {rank}: {message}"
    try:
        cls = getattr(importlib.import_module(module), name)
        err = cls(text)
    except Exception:  # a class we cannot rebuild: say what it was
        err = RuntimeError(f"{what} failed on rank {rank}: {name}: {message}")
    raise err from error


def staging_path(path: str) -> str:
    """Where a checkpoint for ``path`` is written until it is complete
    (the same name on every rank). Rank 0 clears what a crashed attempt
    left there; every rank returns once it is clear."""
    staging = os.fspath(path).rstrip("/") + ".partial"
    if not _distributed() or dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    if _distributed():
        dist.barrier()
    return staging


def publish(staging: str, path: str) -> None:
    """Every rank calls it once every rank has written its part into
    ``staging``: rank 0 puts it in place of ``path`` (the previous
    checkpoint there is removed only once the new one has its name)."""
    if not _distributed() or dist.get_rank() == 0:
        path = os.fspath(path).rstrip("/")
        previous = path + ".previous"
        shutil.rmtree(previous, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, previous)
        os.rename(staging, path)
        shutil.rmtree(previous, ignore_errors=True)
    if _distributed():
        dist.barrier()
