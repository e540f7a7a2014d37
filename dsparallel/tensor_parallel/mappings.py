"""The region maps between replicated and split activations.

Each is a C++ autograd op in ``torch.ops.dsparallel`` (forward and backward
paired as in Megatron-LM, see ``csrc/ops/tp_maps.cpp``); these wrappers
resolve the group and skip the op entirely for a group of one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _C  # noqa: F401  (registers the ops)
from ..ops import group_size
from .group import resolve_group

_ops = torch.ops.dsparallel


def _fake_same(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_resized(dim: int, grow: bool):
    def fake(x, group_name):
        shape = list(x.shape)
        n = group_size(group_name)
        shape[dim] = shape[dim] * n if grow else shape[dim] // n
        return x.new_empty(shape)

    return fake


for _name, _fake in [
    ("copy_to_tensor_parallel_region", _fake_same),
    ("reduce_from_tensor_parallel_region", _fake_same),
    ("scatter_to_tensor_parallel_region", _fake_resized(-1, grow=False)),
    ("gather_from_tensor_parallel_region", _fake_resized(-1, grow=True)),
    ("scatter_to_sequence_parallel_region", _fake_resized(0, grow=False)),
    ("gather_from_sequence_parallel_region", _fake_resized(0, grow=True)),
    ("reduce_scatter_to_sequence_parallel_region", _fake_resized(0, grow=False)),
]:
    torch.library.register_fake(f"dsparallel::{_name}")(_fake)


def _apply(name: str, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    g = resolve_group(group, name)
    if g.size() == 1:
        return x
    return getattr(_ops, name)(x, g.group_name)


def copy_to_tensor_parallel_region(x, group=None):
    """Identity forward; all-reduce of the gradient in backward."""
    return _apply("copy_to_tensor_parallel_region", x, group)


def reduce_from_tensor_parallel_region(x, group=None):
    """All-reduce (sum) forward; identity backward."""
    return _apply("reduce_from_tensor_parallel_region", x, group)


def scatter_to_tensor_parallel_region(x, group=None):
    """This rank's slice of the last dim forward; all-gather backward."""
    return _apply("scatter_to_tensor_parallel_region", x, group)


def gather_from_tensor_parallel_region(x, group=None):
    """All-gather along the last dim forward; this rank's slice backward."""
    return _apply("gather_from_tensor_parallel_region", x, group)


def scatter_to_sequence_parallel_region(x, group=None):
    """This rank's slice of dim 0 forward; all-gather along dim 0 backward."""
    return _apply("scatter_to_sequence_parallel_region", x, group)


def gather_from_sequence_parallel_region(x, group=None):
    """All-gather along dim 0 forward; reduce-scatter along dim 0 backward."""
    return _apply("gather_from_sequence_parallel_region", x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """Reduce-scatter along dim 0 forward; all-gather along dim 0 backward."""
    return _apply("reduce_scatter_to_sequence_parallel_region", x, group)
