"""The load-balanced sequence layout of context parallelism.

The sequence is cut into 2C chunks of equal length (C the group's size);
rank r holds chunk r followed by chunk 2C-1-r. Under causal attention a
token attends to the tokens before it, so early chunks cost little and late
ones much: pairing the r-th from the start with the r-th from the end gives
every rank the same work (Megatron's and torch's head-tail layout). A
sequence whose length is not a multiple of 2C is refused: pad it (and mask
the padding out of the loss) to a multiple first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _check(length: int, size: int, what: str) -> int:
    if length < 2 * size or length % (2 * size):
        raise ValueError(
            f"{what}: a sequence of {length} tokens cannot take the load-balanced layout over "
            f"{size} context-parallel ranks: its length must be a positive multiple of "
            f"2 x {size} = {2 * size} (pad it, masking the padding out of the loss)"
        )
    return length // (2 * size)


def _chunks(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (chunks r and 2C-1-r of
    2C), contiguous. Differentiable (the gradient of the rest is zero)."""
    size, rank = group.size(), group.rank()
    c = _check(x.shape[dim], size, "shard_sequence")
    first, second = _chunks(rank, size)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim)


def positions(seq_len: int, group: dist.ProcessGroup, device=None) -> torch.Tensor:
    """The global positions [2c] of this rank's tokens of a sequence of
    ``seq_len`` (what ``shard_sequence`` of ``arange(seq_len)`` gives)."""
    size, rank = group.size(), group.rank()
    c = _check(seq_len, size, "positions")
    first, second = _chunks(rank, size)
    return torch.cat(
        [
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ]
    )


def natural_order(size: int, local: int) -> torch.Tensor:
    """Indices that put the ranks' parts, concatenated in rank order (what
    an all-gather along the sequence gives), back in sequence order."""
    c = local // 2
    owner = torch.empty(2 * size * c, dtype=torch.long)
    for rank in range(size):
        for slot, chunk in enumerate(_chunks(rank, size)):
            owner[chunk * c : (chunk + 1) * c] = torch.arange(c) + rank * local + slot * c
    return owner


@torch.no_grad()
def unshard_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence on every rank from each rank's ``shard_sequence``
    part (an all-gather, then the chunks back in order). Not
    differentiable: for outputs, evaluation and tests."""
    size = group.size()
    x = x.movedim(dim, 0).contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    whole = torch.cat(parts).index_select(0, natural_order(size, x.shape[0]).to(x.device))
    return whole.movedim(0, dim)
