"""Llama (and the Llama 3 family), the maths of ``transformers``'
``LlamaForCausalLM``, split Megatron-style.

Per decoder layer::

    h = x + o(attention(rope(q(n1)), rope(k(n1)), v(n1)))   n1 = rmsnorm(x)
    y = h + down(silu(gate(n2)) * up(n2))                    n2 = rmsnorm(h)

Query heads are split over tensor parallelism, each rank holding whole
heads, ``o`` and ``down`` row-parallel: one all-reduce forward and one
backward per attention and per MLP. Key/value heads follow their query
heads (grouped-query attention: query head j reads key/value head
j // (heads / kv_heads)). When there are fewer key/value heads than
tensor-parallel ranks they are replicated, as Megatron-core and vLLM do:
each rank keeps the whole (small) key/value weight, uses the one head its
query heads read, and its gradient is all-reduced over the group, so the
copies stay equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import tensor_parallel as tp
from .causal_lm import CausalLM
from .hf_config import rope_frequencies
from .hf_map import Cat, cols, rows, whole
from .layers import (
    Layout,
    RMSNorm,
    Rotary,
    SwiGLU,
    attend,
    check_split,
    kv_attention,
    kv_entries,
    new_kv_slot,
)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, index: int, layout: Layout, rotary: Rotary):
        super().__init__()
        h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.get("head_dim") or h // heads
        n, r = layout.tp_size, layout.tp_rank
        check_split("num_attention_heads", heads, n)
        if heads % kv:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
            )
        self.replicated = kv < n
        if self.replicated and n % kv:
            raise ValueError(
                f"num_key_value_heads={kv} can be neither split over nor replicated across "
                f"the tensor-parallel size {n} (one must divide the other)"
            )
        if not self.replicated:
            check_split("num_key_value_heads", kv, n)
        self.layout, self.rotary, self.head_dim = layout, rotary, d
        self.kv_heads = kv
        # With replication: the key/value head this rank's query heads read.
        self.kv_head = r // (n // kv) if self.replicated else 0
        pre = f"model.layers.{index}.self_attn"
        q_shape, kv_shape = (heads * d, h), (kv * d, h)
        local_kv = 2 * kv * d if self.replicated else 2 * (kv // n) * d
        self.q_weight = nn.Parameter(torch.empty(heads // n * d, h, device="meta"))
        self.kv_weight = nn.Parameter(torch.empty(local_kv, h, device="meta"))
        if self.replicated:
            kv_spec = Cat(
                (whole(f"{pre}.k_proj.weight", kv_shape), whole(f"{pre}.v_proj.weight", kv_shape))
            )
        else:
            kv_spec = Cat(
                (
                    rows(f"{pre}.k_proj.weight", kv_shape, r, n),
                    rows(f"{pre}.v_proj.weight", kv_shape, r, n),
                )
            )
        self.o_proj = tp.RowParallelLinear(
            heads * d,
            h,
            bias=False,
            group=layout.tp_group,
            sequence_parallel=layout.sp,
            device="meta",
        )
        self.o_proj.hf_specs = {"weight": cols(f"{pre}.o_proj.weight", (h, heads * d), r, n)}
        self.hf_specs = {
            "q_weight": rows(f"{pre}.q_proj.weight", q_shape, r, n),
            "kv_weight": kv_spec,
        }

    def new_cache(self, batch: int, length: int, dtype) -> dict:
        """This rank's keys and values of ``length`` positions: its heads."""
        heads = 1 if self.replicated else self.kv_heads // self.layout.tp_size
        return new_kv_slot(batch, heads, length, self.head_dim, dtype)

    def cache_entries(self) -> dict:
        """Per cached position: this rank's heads' key and value."""
        return kv_entries(
            1 if self.replicated else self.kv_heads // self.layout.tp_size, self.head_dim
        )

    def forward(self, x, cos, sin, mask, cache=None):
        """x [seq (/tp under sequence parallelism), batch, hidden]; ``cache``
        (this layer's ``new_cache``, the position its queries start at):
        their keys and values are written there and all earlier ones read."""
        d, lay = self.head_dim, self.layout
        x = lay.enter(x)
        s, b = x.shape[:2]
        q = F.linear(x, self.q_weight).view(s, b, -1, d).permute(1, 2, 0, 3)
        w = self.kv_weight
        if self.replicated:
            # The whole weight's gradient is all-reduced: each rank's is
            # non-zero only on the head it uses.
            w = lay.copy_to(w).view(2, self.kv_heads, d, -1)[:, self.kv_head].reshape(2 * d, -1)
        k, v = F.linear(x, w).view(s, b, 2, -1, d).permute(2, 1, 3, 0, 4).unbind(0)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        if cache is not None:
            out = kv_attention(q, k, v, mask, lay, cache)
        else:
            out = attend(q, k, v, mask, lay)
        return self.o_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, index: int, layout: Layout, rotary: Rotary):
        super().__init__()
        pre = f"model.layers.{index}"
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, eps, f"{pre}.input_layernorm.weight", layout
        )
        self.self_attn = LlamaAttention(cfg, index, layout, rotary)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, eps, f"{pre}.post_attention_layernorm.weight", layout
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, f"{pre}.mlp", layout)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    """``Llama(config, state=None)``: ``config`` a ``LlamaConfig``, a
    config.json dict or its path; ``state`` what ``init_parallel``
    returned (None: one process). Fresh weights are N(0,
    initializer_range) from ``seed`` and each tensor's name, the same in
    every layout; ``dsparallel.models.from_pretrained`` loads a checkpoint
    instead."""

    model_type = "llama"
    architecture = "LlamaForCausalLM"
    defaults = {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
    }

    def check(self, cfg) -> None:
        unsupported = {
            "attention_bias": cfg.get("attention_bias"),
            "mlp_bias": cfg.get("mlp_bias"),
            "hidden_act": cfg.get("hidden_act") != "silu",
            "pretraining_tp": cfg.get("pretraining_tp", 1) != 1,
        }
        used = [k for k, v in unsupported.items() if v]
        if used:
            raise NotImplementedError(f"Llama: config fields not supported: {', '.join(used)}")

    def make_rotary(self) -> Rotary:
        cfg = self.config
        d = cfg.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads
        return Rotary(*rope_frequencies(cfg.rope_parameters, d))

    def make_layer(self, index: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, index, self.layout, self.rotary)
