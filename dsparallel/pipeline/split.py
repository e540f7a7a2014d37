"""The split backward of zero-bubble schedules, on the Python side.

``split_linear(x, weight, bias)`` is ``F.linear`` whose backward, during a
schedule's I action, computes only the input gradient and leaves the weight
gradient in the C++ store (csrc/pipeline/split_backward.h) for the W action.
A custom module opts in by calling it instead of ``F.linear``. Inside a
zero-bubble schedule's stages every ``F.linear`` call (``nn.Linear``, our
``ColumnParallelLinear`` and ``RowParallelLinear``, the GPT's projections) is
routed to it; other modules compute their weight gradients inside I, which
is still correct, only not deferred.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _C  # noqa: F401  (registers torch.ops.dsparallel.split_linear)

_LINEAR = (F.linear, torch._C._nn.linear)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)`` whose weight gradient a zero-bubble
    schedule defers to its W action (computed at once anywhere else)."""
    return torch.ops.dsparallel.split_linear(x, weight, bias)


class SplitLinears(TorchFunctionMode):
    """Routes ``F.linear`` to ``split_linear`` while active (a stage's
    forward, and its recomputation under activation checkpointing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR and torch.is_grad_enabled():
            return split_linear(*args, **kwargs)
        return func(*args, **kwargs)
