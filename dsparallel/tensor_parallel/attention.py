"""Multi-head self-attention with whole heads per rank.

QKV is a column-parallel projection laid out per rank as [q_r; k_r; v_r] (this
rank's heads of each), attention runs on the local heads with
``scaled_dot_product_attention``, and the output projection is row-parallel:
one all-reduce forward, one backward, as in Megatron-LM.

With a ``context_parallel_group`` each rank holds its part of the sequence
in the load-balanced layout (``dsparallel.context_parallel``) and its local
heads attend over the whole sequence through ring attention or Ulysses
(``cp_mode``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..context_parallel import check_mode, context_attention
from .group import check_divisible, resolve_group, set_up_from
from .linear import ColumnParallelLinear, RowParallelLinear
from .random import get_rng_tracker


class ParallelAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        group: dist.ProcessGroup | None = None,
        bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        device=None,
        dtype=None,
        context_parallel_group: dist.ProcessGroup | None = None,
        cp_mode: str = "ring",
    ):
        super().__init__()
        g = resolve_group(group, "ParallelAttention")
        self._check(hidden_size, num_heads, g.size())
        mha = nn.MultiheadAttention(
            hidden_size,
            num_heads,
            dropout=dropout,
            bias=bias,
            batch_first=True,
            device=device,
            dtype=dtype,
        )
        self._setup(mha, g, causal)
        self._set_context_parallel(context_parallel_group, cp_mode, dropout)

    def _set_context_parallel(self, group, mode: str, dropout: float) -> None:
        """Checks, on every rank alike, what context parallelism needs."""
        size = 1 if group is None else group.size()
        check_mode(mode, self.num_heads_per_partition, size, "ParallelAttention")
        if size > 1:
            if dropout:
                raise ValueError(
                    "ParallelAttention: context parallelism takes no attention dropout"
                )
        else:
            group = None
        self.cp_group, self.cp_mode = group, mode

    @staticmethod
    def _check(hidden_size: int, num_heads: int, size: int) -> None:
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"ParallelAttention: hidden_size={hidden_size} is not divisible by "
                f"num_heads={num_heads}"
            )
        check_divisible("ParallelAttention", "num_heads", num_heads, size)

    @classmethod
    def from_multihead_attention(cls, mha: nn.MultiheadAttention, group=None, causal: bool = False):
        """This rank's heads of ``mha`` (which must be ``batch_first`` with equal
        q, k and v sizes, and no bias_k/v or zero attention)."""
        g = resolve_group(group, "ParallelAttention.from_multihead_attention")
        if not mha.batch_first:
            raise ValueError(
                "ParallelAttention.from_multihead_attention: mha must be batch_first=True"
            )
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise NotImplementedError(
                "ParallelAttention.from_multihead_attention: kdim/vdim, add_bias_kv and "
                "add_zero_attn are not supported"
            )
        cls._check(mha.embed_dim, mha.num_heads, g.size())
        return set_up_from(cls, mha, g, causal)

    def _setup(self, mha: nn.MultiheadAttention, group, causal: bool) -> None:
        size = group.size()
        self.group = group
        self.hidden_size = mha.embed_dim
        self.num_heads = mha.num_heads
        self.head_dim = mha.head_dim
        self.num_heads_per_partition = mha.num_heads // size
        self.causal = causal
        self.dropout = mha.dropout
        self.cp_group, self.cp_mode = None, "ring"  # _set_context_parallel may change it
        h, local = self.hidden_size, self.hidden_size // size
        # Reorder the rows of [q; k; v] to [q_0; k_0; v_0; q_1; ...] so that the
        # column split hands each rank its own heads of q, k and v.
        order = torch.cat(
            [
                torch.arange(part * h + r * local, part * h + (r + 1) * local)
                for r in range(size)
                for part in range(3)
            ]
        )
        bias = None if mha.in_proj_bias is None else mha.in_proj_bias.detach()[order]
        self.qkv = ColumnParallelLinear._from_full(mha.in_proj_weight.detach()[order], bias, group)
        self.proj = RowParallelLinear.from_linear(mha.out_proj, group=group)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (batch, seq, hidden). ``attn_mask`` as in
        ``scaled_dot_product_attention`` (bool: True attends), added to the
        causal mask when ``causal``."""
        if x.dim() != 3:
            raise ValueError(
                f"ParallelAttention: input must be (batch, seq, hidden), got shape {tuple(x.shape)}"
            )
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.num_heads_per_partition, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.cp_group is not None:
            if attn_mask is not None:
                raise ValueError("ParallelAttention: context parallelism takes no attn_mask")
            out = context_attention(q, k, v, self.cp_group, self.cp_mode, causal=self.causal)
            return self.proj(out.transpose(1, 2).reshape(b, s, -1))
        dropout = self.dropout if self.training else 0.0
        is_causal = self.causal
        if attn_mask is not None and self.causal:
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            attn_mask = (
                causal & attn_mask
                if attn_mask.dtype == torch.bool
                else attn_mask.masked_fill(~causal, float("-inf"))
            )
            is_causal = False
        # Each rank holds different heads, so their dropout masks come from
        # the per-rank stream.
        rng = get_rng_tracker().fork(group=self.group) if dropout > 0 else contextlib.nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal
            )
        out = out.transpose(1, 2).reshape(b, s, self.num_heads_per_partition * self.head_dim)
        return self.proj(out)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads} "
            f"({self.num_heads_per_partition} on this rank), causal={self.causal}, "
            f"dropout={self.dropout}"
        )
