"""The GPT as ``dsparallel.inference.generate`` takes a model: its stage's
layers run one step at a time over a KV cache.

``GPTForGeneration(module, cfg, state)`` wraps this rank's stage (what
``build_stage`` or ``load_gpt`` returns) and reuses its weights: each
block's attention writes the keys and values of the new positions into
the cache of its heads and attends over every cached one; the rest of
the block, the embedding (token plus learned position) and the head are
the training layers themselves. Between stages hidden states are [seq,
batch, hidden], as for the Hugging Face models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import tensor_parallel as tp
from .gpt import Block, Embedding, GPTConfig, Head, stage_blocks
from .hf_config import HFConfig
from .layers import Layout, cached_mask, last_logits


class GPTForGeneration(nn.Module):
    def __init__(self, module: nn.Sequential, cfg: GPTConfig, state=None):
        super().__init__()
        self.stage = module
        self.layout = lay = Layout.of(state)
        # What generate reads: the positions there are, the hidden size.
        self.config = HFConfig({"max_position_embeddings": cfg.seq_len, "hidden_size": cfg.hidden})
        parts = list(module)
        self.is_first, self.is_last = isinstance(parts[0], Embedding), isinstance(parts[-1], Head)
        blocks = [p for p in parts if isinstance(p, Block)]
        indices = stage_blocks(cfg.layers, lay.pp_rank, lay.pp_size)
        if len(blocks) != len(indices):
            raise ValueError(
                f"GPTForGeneration: the module has {len(blocks)} blocks, stage {lay.pp_rank} of "
                f"{lay.pp_size} has {len(indices)}: pass the stage of this layout"
            )
        if any(not isinstance(b.mlp, tp.ParallelMLP) for b in blocks):
            raise ValueError("GPTForGeneration: mixture-of-experts blocks are not supported")
        if any(b.attn.cp_group is not None for b in blocks):
            raise ValueError("GPTForGeneration: build the stage without context parallelism")
        self.layers = dict(zip(map(str, indices), blocks))  # the stage holds them
        # One stage per rank: what generate's stage driver reads.
        self.stage_ids, self.num_stages = [lay.pp_rank], lay.pp_size

    def stage_owner(self, stage: int) -> int:
        return stage

    def _dtype(self) -> torch.dtype:
        return next(self.stage.parameters()).dtype

    def new_cache(self, batch: int, length: int, dtype: torch.dtype) -> dict:
        """Keys and values of this rank's heads, per block of the stage."""
        out = {}
        for index, block in self.layers.items():
            attn = block.attn
            shape = (batch, attn.num_heads_per_partition, length, attn.head_dim)
            out[index] = {
                "k": torch.empty(shape, dtype=dtype),
                "v": torch.empty(shape, dtype=dtype),
            }
        return out

    @torch.no_grad()
    def cached_step(
        self, x, position_ids, attention_mask, cache, start: int, stage: int | None = None
    ) -> torch.Tensor:
        """As ``CausalLM.cached_step``: token ids [batch, q] (first stage) or
        hidden states [q, batch, hidden] in; hidden states, or on the last
        stage the last position's logits [batch, vocab], out."""
        if self.is_first:
            emb = self.stage[0]
            x = (emb.tok(x) + emb.pos(position_ids)).transpose(0, 1).contiguous()
        mask = cached_mask(attention_mask, x.shape[1], x.shape[0], start)
        for index, block in self.layers.items():
            x = x + _attend(block.attn, block.ln1(x), mask, cache[index], start)
            x = x + block.mlp(block.ln2(x))
        if not self.is_last:
            return x
        head = self.stage[-1]
        return last_logits(head.proj(head.ln(x[-1:])), self.layout)


def _attend(attn: tp.ParallelAttention, x, mask, slot: dict, start: int) -> torch.Tensor:
    """``ParallelAttention`` of queries x [q, batch, hidden] at positions
    start.. over the cache, after writing their keys and values there."""
    s, b, _ = x.shape
    qkv = attn.qkv(x).view(s, b, 3, attn.num_heads_per_partition, attn.head_dim)
    q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # [batch, heads, q, dim]
    slot["k"][:, :, start : start + s] = k
    slot["v"][:, :, start : start + s] = v
    k, v = slot["k"][:, :, : start + s], slot["v"][:, :, : start + s]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and s > 1)
    return attn.proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
