"""``nn.Embedding`` with its vocabulary split across the group."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .group import resolve_group, set_up_from
from .mappings import _ops


def vocab_range(num_embeddings: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's slice: the first ``num_embeddings % size`` ranks
    hold one row more, so any vocabulary size splits."""
    base, extra = divmod(num_embeddings, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, end) of the table; a token's vector comes
    from the rank that holds it (the others contribute zeros to an all-reduce).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: dist.ProcessGroup | None = None,
        init_method: Callable[[torch.Tensor], None] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        g = resolve_group(group, "VocabParallelEmbedding")
        if num_embeddings < g.size():
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings={num_embeddings} is smaller than "
                f"the tensor-parallel group size {g.size()}"
            )
        full = nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype)
        if init_method is not None:
            with torch.no_grad():
                init_method(full.weight)
        self._setup(full.weight, g)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None):
        """This rank's rows of ``embedding`` (options such as padding_idx are
        not supported and are refused)."""
        g = resolve_group(group, "VocabParallelEmbedding.from_embedding")
        unsupported = {
            "padding_idx": embedding.padding_idx,
            "max_norm": embedding.max_norm,
            "sparse": embedding.sparse or None,
            "scale_grad_by_freq": embedding.scale_grad_by_freq or None,
        }
        used = [k for k, v in unsupported.items() if v is not None]
        if used:
            raise NotImplementedError(f"VocabParallelEmbedding does not support {', '.join(used)}")
        return set_up_from(cls, embedding.weight, g)

    def _setup(self, weight: torch.Tensor, group) -> None:
        self.group = group
        self.tp_size, self.tp_rank = group.size(), group.rank()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.vocab_start, self.vocab_end = vocab_range(
            self.num_embeddings, self.tp_rank, self.tp_size
        )
        self.weight = nn.Parameter(weight.detach()[self.vocab_start : self.vocab_end].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding: ids must be int64 or int32, got {ids.dtype}")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise IndexError(
                    f"VocabParallelEmbedding: token id {bad} is outside the vocabulary "
                    f"[0, {self.num_embeddings})"
                )
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _ops.reduce_from_tensor_parallel_region(out, self.group.group_name)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} "
            f"(rows {self.vocab_start}..{self.vocab_end - 1} on this rank)"
        )
