"""Typed wrappers over the C++ ops in ``torch.ops.dsparallel`` and their fake
(meta) kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from . import _C  # registers the ops; all_reduce_'s direct path


def group_size(group_name: str) -> int:
    """The size of the process group an op names (for fake kernels)."""
    return _resolve_process_group(group_name).size()


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None):
    """All-reduces ``tensor`` in place and returns it, blocking: what
    ``dist.all_reduce(tensor, op, group)`` does, without torch.distributed's
    Python wrapper and dispatcher op on the way (on "dsp" the collective runs on
    the calling thread). ``op`` is ``"sum"``, ``"avg"``, ``"product"``,
    ``"min"`` or ``"max"``.

    Eagerly, on a tensor outside autograd, it calls the kernel of
    ``torch.ops.dsparallel.all_reduce_`` straight through our extension module,
    without the dispatcher's boxed call from Python: the cheapest all-reduce of
    a small tensor from Python (``benchmarks/collectives.py``, its "op"
    column). A tensor that requires grad, and code being compiled, go through
    ``torch.ops.dsparallel.all_reduce_(tensor, group.group_name, op)``, so that
    autograd's in-place checks and tracing apply."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("all_reduce_ needs an initialised process group")
    if tensor.requires_grad or torch.compiler.is_compiling():
        return torch.ops.dsparallel.all_reduce_(tensor, group.group_name, op)
    _C.all_reduce_(tensor, group.group_name, op)
    return tensor


@torch.library.register_fake("dsparallel::fused_all_reduce")
def _fused_all_reduce_fake(tensors, op, group_name, bucket_cap_bytes):
    return None


def fused_all_reduce(
    tensors: Sequence[torch.Tensor],
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25,
) -> None:
    """All-reduces ``tensors`` in place, packed into as few flat buckets as fit.

    One collective per bucket of at most ``bucket_cap_mb`` (tensors are never
    split; dtypes and devices get their own buckets), all launched before
    any is awaited. ``op`` is ``"sum"`` or ``"avg"``. For users who accumulate
    gradients by hand: ``fused_all_reduce([p.grad for p in params], op="avg")``.
    """
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("fused_all_reduce needs an initialised process group")
    torch.ops.dsparallel.fused_all_reduce(
        list(tensors), op, group.group_name, max(1, int(bucket_cap_mb * 1024 * 1024))
    )
