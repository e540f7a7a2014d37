"""The GPT: GPT-2's maths and checkpoint (``transformers``'
``GPT2LMHeadModel``), split Megatron-style like Llama.

Per block::

    h = x + c_proj(attention(split_heads(c_attn(ln_1(x)))))
    y = h + mlp.c_proj(act(c_fc(ln_2(h))))

with learned position embeddings added to the token embeddings, LayerNorm
(with bias) everywhere, and the LM head tied to the token embedding.
GPT-2 stores its projections as ``Conv1D``: weights [in, out], which our
parameters keep (a checkpoint block is then a range of columns for a
column-parallel weight, of rows for a row-parallel one); the fused
``c_attn`` holds this rank's heads of q, then of k, then of v.

Dropout: the ``*_pdrop`` fields are not applied (the models here train
without dropout, as large language model pretraining does); a config that
sets them trains as if they were 0, and ``check`` says so once.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .. import tensor_parallel as tp
from .causal_lm import CausalLM
from .hf_map import Cat, Piece, cols, rows, whole
from .layers import Layout, attend, check_split, kv_attention, kv_entries, new_kv_slot

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` over the hidden size with its checkpoint names; under
    sequence parallelism its weight and bias gradients are all-reduced."""

    def __init__(self, size: int, eps: float, key: str, layout: Layout):
        super().__init__()
        self.eps, self.layout = eps, layout
        self.weight = nn.Parameter(torch.empty(size, device="meta"))
        self.bias = nn.Parameter(torch.empty(size, device="meta"))
        self.hf_specs = {
            "weight": whole(f"{key}.weight", (size,)),
            "bias": whole(f"{key}.bias", (size,)),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        w, b = lay.shared(self.weight), lay.shared(self.bias)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


class _Projections(nn.Module):
    """A column-parallel ``Conv1D`` (``up``: [in, out / tp] and its bias)
    and a row-parallel one (``down``: [in / tp, out], its bias added once
    after the reduction)."""

    def __init__(self, layout: Layout, up_shape, up_spec, down_shape, down_spec, out: int):
        super().__init__()
        self.layout = layout
        self.up_weight = nn.Parameter(torch.empty(*up_shape, device="meta"))
        self.up_bias = nn.Parameter(torch.empty(up_shape[1], device="meta"))
        self.down_weight = nn.Parameter(torch.empty(*down_shape, device="meta"))
        self.down_bias = nn.Parameter(torch.empty(out, device="meta"))
        self.hf_specs = {**up_spec, **down_spec}

    def up(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layout.enter(x)
        return F.linear(x, self.up_weight.t(), self.up_bias)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        y = F.linear(x, self.down_weight.t())
        if lay.tp_size > 1:
            if lay.sp:
                y = tp.reduce_scatter_to_sequence_parallel_region(y, lay.tp_group)
            else:
                y = tp.reduce_from_tensor_parallel_region(y, lay.tp_group)
        return y + lay.shared(self.down_bias)


class GPT2Attention(_Projections):
    def __init__(self, cfg, index: int, layout: Layout):
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        n, r = layout.tp_size, layout.tp_rank
        check_split("num_attention_heads", heads, n)
        local = h // n
        pre = f"transformer.h.{index}.attn"

        def qkv(key, shape, dim):
            parts = (Piece(key, shape, dim, part * h + r * local, local) for part in range(3))
            return Cat(tuple(parts), dim=dim)

        super().__init__(
            layout,
            (h, 3 * local),
            {
                "up_weight": qkv(f"{pre}.c_attn.weight", (h, 3 * h), 1),
                "up_bias": qkv(f"{pre}.c_attn.bias", (3 * h,), 0),
            },
            (local, h),
            {
                "down_weight": rows(f"{pre}.c_proj.weight", (h, h), r, n),
                "down_bias": whole(f"{pre}.c_proj.bias", (h,)),
            },
            h,
        )
        self.head_dim = h // heads
        self.heads = heads // n
        self.scale = 1.0 / math.sqrt(self.head_dim) if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            self.scale /= index + 1

    def new_cache(self, batch: int, length: int, dtype) -> dict:
        return new_kv_slot(batch, self.heads, length, self.head_dim, dtype)

    def cache_entries(self) -> dict:
        return kv_entries(self.heads, self.head_dim)

    def forward(self, x, mask, cache=None):
        qkv = self.up(x)
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, 3, self.heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        if cache is not None:
            out = kv_attention(q, k, v, mask, self.layout, cache, self.scale)
        else:
            out = attend(q, k, v, mask, self.layout, scale=self.scale)
        return self.down(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class GPT2MLP(_Projections):
    def __init__(self, cfg, index: int, layout: Layout):
        h = cfg.hidden_size
        ffn = cfg.get("n_inner") or 4 * h
        n, r = layout.tp_size, layout.tp_rank
        check_split("n_inner", ffn, n)
        pre = f"transformer.h.{index}.mlp"
        super().__init__(
            layout,
            (h, ffn // n),
            {
                "up_weight": cols(f"{pre}.c_fc.weight", (h, ffn), r, n),
                "up_bias": rows(f"{pre}.c_fc.bias", (ffn,), r, n),
            },
            (ffn // n, h),
            {
                "down_weight": rows(f"{pre}.c_proj.weight", (ffn, h), r, n),
                "down_bias": whole(f"{pre}.c_proj.bias", (h,)),
            },
            h,
        )
        self.act = ACTIVATIONS[cfg.activation_function]

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg, index: int, layout: Layout):
        super().__init__()
        pre, eps = f"transformer.h.{index}", cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.hidden_size, eps, f"{pre}.ln_1", layout)
        self.attn = GPT2Attention(cfg, index, layout)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps, f"{pre}.ln_2", layout)
        self.mlp = GPT2MLP(cfg, index, layout)
        self.self_attn = self.attn  # where the model's new_cache looks

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class _PositionEmbedding(nn.Module):
    """GPT-2's learned positions (``wpe``), whole on the first stage."""

    def __init__(self, positions: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(positions, hidden, device="meta"))
        self.hf_specs = {"weight": whole("transformer.wpe.weight", (positions, hidden))}

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)


class _NoRotary:
    """GPT-2 has no rotary positions: the layers take no cos/sin."""

    def cos_sin(self, position_ids, dtype):
        return None, None


class GPT2(CausalLM):
    """``GPT2(config, state=None)``: ``config`` a ``GPT2Config``, a
    config.json dict or its path (GPT-2's own field names, ``n_embd``,
    ``n_layer``, ``n_head``, ``n_positions``, or the common ones);
    otherwise as ``Llama``."""

    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    defaults = {
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "n_positions": 1024,
    }
    # GPT-2's names of the common fields (transformers' attribute_map).
    aliases = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "max_position_embeddings": "n_positions",
    }
    embed_key = "transformer.wte.weight"
    norm_key = "transformer.ln_f"

    def check(self, cfg) -> None:
        if cfg.activation_function not in ACTIVATIONS:
            raise NotImplementedError(
                f"GPT2: activation_function {cfg.activation_function!r} is not one of "
                f"{', '.join(ACTIVATIONS)}"
            )
        unsupported = [k for k in ("reorder_and_upcast_attn", "add_cross_attention") if cfg.get(k)]
        if unsupported:
            fields = ", ".join(unsupported)
            raise NotImplementedError(f"GPT2: config fields not supported: {fields}")
        if not cfg.get("tie_word_embeddings", True):
            raise NotImplementedError("GPT2: an LM head apart from the embedding is not supported")
        dropout = {k: cfg.get(k) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        if any(dropout.values()):
            warnings.warn(
                f"GPT2: dropout ({', '.join(f'{k}={v}' for k, v in dropout.items() if v)}) is "
                "not applied: the model trains without it",
                stacklevel=3,
            )

    def make_rotary(self):
        return _NoRotary()

    def config_dict(self) -> dict:
        values = super().config_dict()
        values.pop("rope_parameters", None)  # read_config's, not GPT-2's
        values.pop("num_key_value_heads", None)
        return values

    def make_norm(self, key: str) -> nn.Module:
        return LayerNorm(self.config.hidden_size, self.config.layer_norm_epsilon, key, self.layout)

    def make_position_embedding(self) -> nn.Module:
        return _PositionEmbedding(self.config.max_position_embeddings, self.config.hidden_size)

    def make_layer(self, index: int) -> nn.Module:
        return GPT2Block(self.config, index, self.layout)
