"""The pieces Llama and DeepSeek-V3 share: the layout a model is cut by,
RMSNorm, rotary embeddings, the attention mask, and the SwiGLU MLP split
over tensor parallelism.

Hidden states are [seq, batch, hidden] between layers (Megatron's layout),
so that sequence parallelism splits dim 0; attention works on [batch,
heads, seq, dim].

Every module here keeps ``hf_specs``: for each of its parameters, where it
lies in a Hugging Face checkpoint (``hf_map``); the model walks them to
load, initialise and save.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import tensor_parallel as tp
from ..context_parallel import context_attention
from .hf_map import Cat, cols, rows, whole


class _Solo:
    """The tensor-parallel "group" of a model in one process: the layers
    see size 1 and run as their plain counterparts, with no collective."""

    group_name = ""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@dataclass(frozen=True)
class Layout:
    """What a model needs of ``init_parallel``'s state (all sizes 1 for
    ``state=None``)."""

    tp_group: object
    tp_size: int = 1
    tp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    pp_size: int = 1
    pp_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    ep_size: int = 1
    ep_rank: int = 0
    # The expert-parallel group spans the tensor-parallel ranks: each routes
    # its own part of the tokens, and its experts are its own.
    experts_over_tp: bool = False
    mesh: object = None
    # Context parallelism: each rank holds its part of every sequence
    # (dsparallel.context_parallel's load-balanced layout); attention runs
    # across the group as cp_mode says.
    cp_group: dist.ProcessGroup | None = None
    cp_size: int = 1
    cp_mode: str = "ring"
    # Sequence parallelism (Megatron's): outside the tensor-parallel regions
    # each rank holds 1/tp of the sequence; only with tp > 1.
    sp: bool = False
    # Data parallelism: the replicas whose batches make up the global batch
    # (a per-token loss counts their labels together).
    dp_group: dist.ProcessGroup | None = None
    dp_size: int = 1

    @classmethod
    def of(cls, state) -> Layout:
        if state is None:
            return cls(tp_group=_Solo())
        return cls(
            tp_group=state.tp_group,
            tp_size=state.tp_size,
            tp_rank=state.tp_rank,
            pp_group=state.pp_group,
            pp_size=state.pp_size,
            pp_rank=state.pp_rank,
            ep_group=state.ep_group,
            ep_size=state.ep_size,
            ep_rank=state.ep_rank,
            experts_over_tp=state.experts_over_tp and state.tp_size > 1,
            mesh=state.mesh,
            cp_group=state.cp_group,
            cp_size=state.cp_size,
            dp_group=state.dp_group,
            dp_size=state.dp_size,
        )

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else tp.copy_to_tensor_parallel_region(x, self.tp_group)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input of a region split over tensor parallelism: all of the
        sequence (gathered under sequence parallelism, whose backward
        reduce-scatters), else the replicated input (whose gradient the
        copy map all-reduces)."""
        if self.tp_size == 1:
            return x
        if self.sp:
            return tp.gather_from_sequence_parallel_region(x, self.tp_group)
        return tp.copy_to_tensor_parallel_region(x, self.tp_group)

    def shared(self, w: torch.Tensor) -> torch.Tensor:
        """A weight every rank holds whole: under sequence parallelism each
        rank applies it to its own tokens, so its gradient is all-reduced.
        The weight itself goes on (an alias): the copy map would clone it,
        and the matmul would keep that clone for backward, a copy of the
        weight per layer and micro-batch in flight."""
        return _AllReduceGrad.apply(w, self.tp_group) if self.sp else w


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward (an alias of the input), all-reduce of the
    gradient over the tensor-parallel group backward."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return tp.reduce_from_tensor_parallel_region(grad.contiguous(), ctx.group), None


def attend(q, k, v, mask, layout: Layout, scale: float | None = None) -> torch.Tensor:
    """Causal attention of q [batch, heads, s, dim] over k, v [batch, kv
    heads, s, dim] (grouped-query when fewer). ``mask``: what the model's
    forward made of the attention mask: the boolean [batch, 1, s, keys]
    mask (None: plain causal) in one process; under context parallelism
    this rank's part of the attention mask [batch, s] itself, read as
    document ids (a token attends to the earlier tokens of its own kind:
    kept tokens to kept tokens)."""
    if layout.cp_size > 1:
        return context_attention(
            q, k, v, layout.cp_group, layout.cp_mode, doc_ids=mask, scale=scale
        )
    return dot_product_attention(q, k, v, mask, scale)


def dot_product_attention(q, k, v, mask, scale: float | None = None) -> torch.Tensor:
    """torch's fused attention (causal without a mask), except for one
    reduced-precision query per sequence under no_grad, a decode step: there
    the CPU's fused kernel took 3-7x as long as the float32 matmuls below
    (100 us against 34 at 160 keys, 5.6 ms against 0.9 at 8 x 1000), which
    are also exact up to the output's rounding."""
    if q.shape[2] == 1 and q.dtype != torch.float32 and not torch.is_grad_enabled():
        b, heads, _, d = q.shape
        kv_heads = k.shape[1]
        grouped = q.reshape(b, kv_heads, heads // kv_heads, d).float()
        scores = torch.matmul(grouped, k.float().transpose(-1, -2))
        scores = scores * (scale if scale is not None else d**-0.5)
        if mask is not None:  # [b, 1, 1, keys]
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1), v.float())
        return out.to(q.dtype).reshape(b, heads, 1, v.shape[-1])
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None and q.shape[2] > 1,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def new_kv_slot(batch: int, heads: int, length: int, dim: int, dtype) -> dict:
    """A layer's KV cache: keys and values of ``heads`` heads at ``length``
    positions for ``batch`` sequences."""
    shape = (batch, heads, length, dim)
    return {"k": torch.empty(shape, dtype=dtype), "v": torch.empty(shape, dtype=dtype)}


def cached_kv(k: torch.Tensor, v: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes k, v [batch, heads, s, dim] of queries from position
    ``start`` into the cache (``cache`` = (slot, start)); returns every key
    and value so far."""
    slot, start = cache
    s = k.shape[2]
    slot["k"][:, :, start : start + s] = k
    slot["v"][:, :, start : start + s] = v
    return slot["k"][:, :, : start + s], slot["v"][:, :, : start + s]


def kv_attention(q, k, v, mask, layout: Layout, cache, scale: float | None = None):
    """Attention of q [batch, heads, s, dim] over the keys and values k, v
    [batch, kv heads, s, dim] of the same positions and everything cached
    before them: ``cache`` a dense slot and its start (``cached_kv``), or a
    paged step's layer (``dsparallel.inference.paged``, whose batch of 1
    holds every sequence's tokens one after another)."""
    if isinstance(cache, tuple):
        k, v = cached_kv(k, v, cache)
        return attend(q, k, v, mask, layout, scale)

    def per_group(qs, kv, allowed):  # [g, q, heads, dim], [g, keys, heads, dim]
        out = dot_product_attention(
            qs["q"].transpose(1, 2),
            kv["k"].transpose(1, 2),
            kv["v"].transpose(1, 2),
            allowed[:, None],
            scale,
        )
        return out.transpose(1, 2)

    tokens = {"k": k[0].transpose(0, 1), "v": v[0].transpose(0, 1)}
    return cache.attend({"q": q[0].transpose(0, 1)}, tokens, per_group).transpose(0, 1)[None]


def kv_entries(heads: int, dim: int) -> dict:
    """A paged cache's per-position entries of ``new_kv_slot``'s layers."""
    return {"k": (heads, dim), "v": (heads, dim)}


def check_split(what: str, value: int, size: int, over: str = "tensor-parallel size") -> None:
    if value % size:
        raise ValueError(f"{what}={value} is not divisible by the {over} {size}")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the
    weight, as ``transformers``' LlamaRMSNorm."""

    def __init__(self, size: int, eps: float, key: str, layout: Layout):
        super().__init__()
        self.eps, self.layout = eps, layout
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.hf_specs = {"weight": whole(key, (size,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.layout.shared(self.weight) * x.to(dtype)


class Rotary:
    """cos/sin of the positions (computed per call: a few kilobytes) and
    their application, half-split (Llama) or in interleaved pairs
    (DeepSeek's ``rope_interleave``, whose output comes de-interleaved, as
    ``transformers`` emits it)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, interleave: bool = False):
        self.inv_freq, self.scaling, self.interleave = inv_freq, scaling, interleave

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [batch, heads, seq, dim]; cos, sin [batch, seq, dim]."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.interleave:
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attention_mask_for(
    attention_mask: torch.Tensor | None, seq: int, start: int = 0
) -> torch.Tensor | None:
    """The boolean [batch, 1, seq, start + seq] mask (True attends) of
    causal attention of ``seq`` queries at positions start.. over the keys
    ``attention_mask`` [batch, >= start + seq] keeps; None for plain causal
    attention. A query with no key to attend to (a left pad) attends to
    all: its output is never used, and a row of -inf would turn it into NaN
    that the next layer's keys carry."""
    if attention_mask is None:
        return None
    keys = start + seq
    causal = torch.ones(seq, keys, dtype=torch.bool, device=attention_mask.device)
    causal = causal.tril(diagonal=start)
    allowed = causal & attention_mask[:, :keys].bool()[:, None, None, :]
    return allowed | ~allowed.any(-1, keepdim=True)


def cached_mask(attention_mask, batch: int, seq: int, start: int) -> torch.Tensor | None:
    """``attention_mask_for`` of a step over the KV cache: ``seq`` queries
    from position ``start``. None (no padding) stays None where causal
    attention from position 0, or one query that sees every key, needs no
    mask (the fused attention kernels); several queries after cached ones
    need the causal offset spelled out."""
    if attention_mask is None and seq > 1 and start > 0:
        attention_mask = torch.ones(batch, start + seq, dtype=torch.long)
    return attention_mask_for(attention_mask, seq, start)


def last_logits(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """[batch, vocab] of the vocabulary-parallel logits [1, batch, vocab / tp]
    of the last position, gathered over tensor parallelism."""
    if layout.tp_size > 1:
        local = tp.gather_from_tensor_parallel_region(local, layout.tp_group)
    return local[0]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one
    column-parallel weight (this rank's gate rows, then its up rows) and
    down row-parallel: one all-reduce forward, one backward."""

    def __init__(self, hidden: int, ffn: int, prefix: str, layout: Layout):
        super().__init__()
        check_split(f"{prefix}: intermediate_size", ffn, layout.tp_size)
        g, r, n = layout.tp_group, layout.tp_rank, layout.tp_size
        sp = layout.sp
        self.gate_up = tp.ColumnParallelLinear(
            hidden, 2 * ffn, bias=False, group=g, sequence_parallel=sp, device="meta"
        )
        self.down = tp.RowParallelLinear(
            ffn, hidden, bias=False, group=g, sequence_parallel=sp, device="meta"
        )
        self.hf_specs = {
            "gate_up.weight": Cat(
                (
                    rows(f"{prefix}.gate_proj.weight", (ffn, hidden), r, n),
                    rows(f"{prefix}.up_proj.weight", (ffn, hidden), r, n),
                )
            ),
        }
        self.down.hf_specs = {"weight": cols(f"{prefix}.down_proj.weight", (hidden, ffn), r, n)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
