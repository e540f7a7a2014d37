"""The model a job names: a small built-in Llama or DeepSeek-V3, a Hugging
Face checkpoint directory (its weights), or a ``config.json`` (fresh
weights), at this rank's place in the layout."""

from __future__ import annotations

import json
import os

import torch

from ..mixed_precision import MixedPrecision

# Small configs for trying a layout or a corpus; ``[model] config`` changes
# any field (the vocabulary size is the tokenizer's unless it is given).
BUILTIN = {
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # GPT-2's layout (learned positions, LayerNorm, GELU, tied LM head).
    "gpt": dict(
        model_type="gpt2",
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_positions=4096,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=8,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=4096,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def model_config(cfg, vocab_size: int) -> dict | None:
    """The config dict of ``[model]`` (None for a checkpoint directory,
    which brings its own)."""
    name = cfg.name
    if os.path.isdir(name):
        if cfg.config:
            raise ValueError(
                f"[model] config: {name} is a checkpoint, whose config.json is its own: "
                "change the fields there (or point name at a config.json for fresh weights)"
            )
        return None
    if name in BUILTIN:
        values = {**BUILTIN[name], "vocab_size": vocab_size}
    elif os.path.isfile(name):
        with open(name) as f:
            values = json.load(f)
    else:
        raise ValueError(
            f"[model] name: {name!r} is none of {', '.join(BUILTIN)}, a checkpoint directory "
            "or a config.json"
        )
    return {**values, **cfg.config}


def precision(cfg) -> tuple[torch.dtype | None, MixedPrecision | None]:
    """(dtype, mixed-precision policy) of ``[model] dtype`` and
    ``mixed_precision``."""
    if cfg.dtype and cfg.dtype not in DTYPES:
        raise ValueError(f"[model] dtype: {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.mixed_precision not in ("", "none", "bf16"):
        raise ValueError(
            f"[model] mixed_precision: {cfg.mixed_precision!r} is not none or bf16 (bf16 "
            "compute over float32 master weights)"
        )
    mixed = cfg.mixed_precision == "bf16"
    dtype = DTYPES[cfg.dtype] if cfg.dtype else None
    if mixed and dtype not in (None, torch.float32):
        raise ValueError(
            f"[model] mixed_precision = bf16 keeps float32 masters: dtype must be float32, "
            f"not {cfg.dtype}"
        )
    return dtype, MixedPrecision() if mixed else None


def build_model(cfg, parallel, state, vocab_size: int, seed: int):
    """This rank's part of the model of ``[model]`` at ``state``'s layout."""
    from ..models import GPT2, DeepseekV3, Llama, from_pretrained
    from ..models.deepseek_v3 import Router
    from .step import stage_layout

    dtype, policy = precision(cfg)
    per_rank, placement = stage_layout(parallel.schedule, parallel.stages_per_rank)
    kwargs = dict(
        stages_per_rank=per_rank,
        stage_placement=placement,
        mixed_precision=policy,
        checkpoint=parallel.recompute,
        sequence_parallel=parallel.sequence_parallel,
        cp_mode=parallel.cp_mode,
    )
    config = model_config(cfg, vocab_size)
    if cfg.mtp_depth >= 0:
        kind = config.get("model_type") if config else _checkpoint_type(cfg.name)
        if kind == "deepseek_v3":
            kwargs["mtp_depth"] = cfg.mtp_depth
        elif cfg.mtp_depth:
            raise ValueError(
                f"[model] mtp_depth: multi-token prediction is DeepSeek-V3's; {cfg.name} is "
                f"a {kind!r} model"
            )
    if config is None:
        model = from_pretrained(cfg.name, state, dtype=dtype, **kwargs)
    else:
        classes = {"llama": Llama, "deepseek_v3": DeepseekV3, "gpt2": GPT2}
        kind = config.get("model_type")
        if kind not in classes:
            raise ValueError(
                f"[model] {cfg.name}: model_type {kind!r} is not one of {sorted(classes)}"
            )
        model = classes[kind](config, state, seed=seed, dtype=dtype or torch.float32, **kwargs)
    for m in model.modules():
        if isinstance(m, Router):
            m.bias_update_rate = cfg.expert_bias_update_rate
            m.balance_loss_weight = cfg.balance_loss_weight
    if isinstance(model, DeepseekV3):
        model.mtp_loss_weight = cfg.mtp_loss_weight
    return model


def _checkpoint_type(path: str) -> str | None:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("model_type")
