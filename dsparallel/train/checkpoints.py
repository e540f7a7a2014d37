"""The run's checkpoint folder: ``step-N`` folders (N the optimizer steps
done), the last ``keep`` kept, the latest complete one found for
``resume = "auto"``. A checkpoint is written under a staging name and
renamed once every rank has written its part (``save_checkpoint``), so a
folder named ``step-N`` is always complete; one a kill interrupted keeps
its staging name and is never resumed from."""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist

_NAME = re.compile(r"^step-(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def complete(root: str) -> list[tuple[int, str]]:
    """(steps, path) of the complete checkpoints in ``root``, oldest first."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _NAME.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, ".metadata")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def resume_path(cfg) -> str | None:
    """The checkpoint ``[checkpoint] resume`` names: the latest complete one
    in ``dir`` (``auto``; None when there is none yet), a path, or None
    (``none``)."""
    if cfg.resume in ("", "none"):
        return None
    if cfg.resume == "auto":
        found = complete(cfg.dir)
        return found[-1][1] if found else None
    if not os.path.isfile(os.path.join(cfg.resume, ".metadata")):
        raise FileNotFoundError(
            f"[checkpoint] resume: {cfg.resume} is not a complete checkpoint (no .metadata)"
        )
    return cfg.resume


def prune(root: str, keep: int) -> None:
    """Rank 0 removes all but the last ``keep`` complete checkpoints
    (``keep`` 0: none removed)."""
    if keep <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
        return
    for _, path in complete(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
