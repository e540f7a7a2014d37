"""Cross-entropy on vocabulary-parallel logits, without gathering them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .group import resolve_group
from .mappings import _ops


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.library.register_fake("dsparallel::vocab_parallel_cross_entropy")
def _loss_fake(logits, target, ignore_index, group_name):
    return logits.new_empty(logits.shape[:-1])


@torch.library.register_fake("dsparallel::_vocab_parallel_cross_entropy_forward")
def _forward_fake(logits, target, ignore_index, group_name):
    return (
        logits.new_empty(logits.shape[:-1]),
        logits.new_empty(logits.shape, dtype=_compute_dtype(logits)),
        target.new_empty(target.shape, dtype=torch.int64),
    )


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of the logits gathered along their last dim.

    ``vocab_parallel_logits`` is (..., vocab slice) on each rank, the slices in
    rank order (as a ``ColumnParallelLinear`` LM head or a
    ``VocabParallelEmbedding``'s split makes them; unequal slices work);
    ``target`` is (...) with global class indices, the same on every rank.
    ``reduction`` is ``"mean"`` (over tokens not equal to ``ignore_index``),
    ``"sum"`` or ``"none"``. Computed in float32 (float64 for float64
    logits); numerically stable (max subtracted before the exponential).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"vocab_parallel_cross_entropy: reduction must be mean, sum or none, got {reduction!r}"
        )
    g = resolve_group(group, "vocab_parallel_cross_entropy")
    if g.size() == 1:
        flat = vocab_parallel_logits.reshape(-1, vocab_parallel_logits.shape[-1])
        loss = F.cross_entropy(
            flat, target.reshape(-1), ignore_index=ignore_index, reduction=reduction
        )
        return loss.view(target.shape) if reduction == "none" else loss
    loss = _ops.vocab_parallel_cross_entropy(
        vocab_parallel_logits, target, ignore_index, g.group_name
    )
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
