"""Attention across a context-parallel group, on q [batch, heads, s, dim]
and k, v [batch, kv heads, s, dim] holding this rank's ``s`` positions in
the load-balanced layout (``shard_sequence``).

Both equal ``scaled_dot_product_attention`` over the whole sequence, the
output in the same layout. ``context_attention`` picks one by name, as the
models' attention layers do. ``doc_ids`` [batch, s] (this rank's part, as
the tokens) marks packed documents: a token attends only within its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..ops import group_size
from .layout import natural_order


@torch.library.register_fake("dsparallel::ring_attention")
def _ring_fake(q, k, v, group_name, causal, doc_ids=None, scale=None):
    return torch.empty_like(q)


@torch.library.register_fake("dsparallel::ulysses_all_to_all")
def _all_to_all_fake(x, group_name, scatter_dim, gather_dim):
    shape, n = list(x.shape), group_size(group_name)
    shape[scatter_dim] //= n
    shape[gather_dim] *= n
    return x.new_empty(shape)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    causal: bool = True,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Ring attention: this rank's queries against every rank's keys and
    values, which travel the ring; C steps, each attending one block and
    passing it on (``csrc/ops/context_parallel.cpp``). Values may have
    another head dim than queries and keys (DeepSeek's latent attention):
    the flash kernel the op runs takes one, so the narrower side is padded
    with zeros, which change neither the scores nor the output's own
    dims, and the output is cut back."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        scale = qk_dim**-0.5 if scale is None else scale
        q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
    out = torch.ops.dsparallel.ring_attention(q, k, v, group.group_name, causal, doc_ids, scale)
    return out[..., :v_dim] if v_dim < qk_dim else out


MODES = ("ring", "ulysses")


def check_mode(mode: str, heads: int, size: int, who: str) -> None:
    """Refuses (alike on every rank) a ``cp_mode`` that is not one of
    ``MODES``, and Ulysses over a group that does not divide the
    ``heads`` a rank holds."""
    if mode not in MODES:
        raise ValueError(f"{who}: cp_mode must be 'ring' or 'ulysses', got {mode!r}")
    if mode == "ulysses" and heads % size:
        raise ValueError(
            f"{who}: Ulysses splits this rank's {heads} heads over the {size} context-parallel "
            "ranks: they are not divisible (use cp_mode='ring')"
        )


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    mode: str,
    causal: bool = True,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``ring_attention`` or ``ulysses_attention``, as ``mode`` names."""
    attend = ring_attention if mode == "ring" else ulysses_attention
    return attend(q, k, v, group, causal=causal, doc_ids=doc_ids, scale=scale)


def _check_heads(q: torch.Tensor, k: torch.Tensor, size: int) -> int:
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % size:
        raise ValueError(
            f"ulysses_attention splits the heads over the {size} context-parallel ranks: "
            f"{heads} query heads are not divisible by {size} (use ring attention, or a "
            "context-parallel size that divides the heads)"
        )
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"ulysses_attention: {kv_heads} key/value heads neither divide nor are divided "
            f"by the context-parallel size {size}"
        )
    return max(1, size // kv_heads)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    causal: bool = True,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses: an all-to-all turns [batch, heads, s, dim] split by
    sequence into [batch, heads / C, C s, dim] split by heads, attention runs
    over the whole sequence (put back in order) and the inverse all-to-all
    returns this rank's positions. Key/value heads fewer than C are repeated
    so that each rank receives the one its query heads read."""
    size, name = group.size(), group.group_name
    repeat = _check_heads(q, k, size)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    local = q.shape[2]
    order = natural_order(size, local).to(q.device)
    undo = torch.empty_like(order)
    undo[order] = torch.arange(len(order), device=q.device)

    def to_heads(t):
        t = torch.ops.dsparallel.ulysses_all_to_all(t, name, 1, 2)
        return t.index_select(2, order)

    mask = None
    if doc_ids is not None:
        docs = [torch.empty_like(doc_ids) for _ in range(size)]
        dist.all_gather(docs, doc_ids.contiguous(), group=group)
        docs = torch.cat(docs, dim=1).index_select(1, order)
        mask = (docs[:, :, None] == docs[:, None, :])[:, None]
        if causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(
        to_heads(q),
        to_heads(k),
        to_heads(v),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return torch.ops.dsparallel.ulysses_all_to_all(out.index_select(2, undo), name, 2, 1)
