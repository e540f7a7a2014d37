"""What a model holds, rank by rank, without building it: the shapes of
the tensors each rank of a layout keeps, in the order the model registers
them (the order ZeRO lays them end to end in), for our GPT and for Llama and
DeepSeek-V3 configs. The planner counts bytes from these lists; the tests
hold them against the models themselves, tensor for tensor.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field

from ..models.causal_lm import padded_vocab
from ..models.checkpoint_io import model_classes
from ..models.gpt import GPTConfig, stage_blocks


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    expert: bool = False  # reduced over the ranks holding the same experts
    fp32: bool = False  # kept in float32 whatever the model's dtype (a router)
    numel: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "numel", math.prod(self.shape))


@dataclass(frozen=True, eq=False)  # hashed by identity: the planner's caches key on it
class Model:
    """A model config as the planner reads it: ``kind`` is "gpt", "llama" or
    "deepseek_v3"; ``config`` the GPTConfig or the config dict."""

    kind: str
    config: object

    def get(self, key: str, default=None):
        if self.kind == "gpt":
            return getattr(self.config, key)
        value = self.config.get(key)
        return default if value is None else value

    @property
    def layers(self) -> int:
        return self.get("layers") if self.kind == "gpt" else self.get("num_hidden_layers")

    @property
    def hidden(self) -> int:
        return self.get("hidden") if self.kind == "gpt" else self.get("hidden_size")

    @property
    def heads(self) -> int:
        return self.get("heads") if self.kind == "gpt" else self.get("num_attention_heads")

    @property
    def vocab(self) -> int:
        return self.get("vocab_size")


def read_model(config) -> Model:
    """Our GPTConfig, a ``transformers`` Llama or DeepSeek-V3 config, its
    ``config.json`` dict, or a path to one (or to its directory)."""
    if isinstance(config, Model):
        return config
    if isinstance(config, GPTConfig):
        return Model("gpt", config)
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if not os.path.isfile(path):
            raise FileNotFoundError(f"plan: no model config at {path}")
        with open(path) as f:
            config = json.load(f)
    elif not isinstance(config, dict):
        if not hasattr(config, "to_dict"):
            raise TypeError(
                "plan: a model config is a GPTConfig, a transformers config, a config.json "
                f"dict or its path; got {type(config).__name__}"
            )
        config = config.to_dict()
    kind = config.get("model_type")
    if kind == "gpt2":
        return Model("gpt", _gpt2(config))
    classes = model_classes()
    if kind not in classes:
        raise ValueError(f"plan: model_type {kind!r} is not one of 'llama', 'deepseek_v3', 'gpt2'")
    # The fields a config leaves out take the model's defaults, as they do
    # when the model is built.
    return Model(kind, {**classes[kind].defaults, **config})


def _gpt2(config: dict) -> GPTConfig:
    """A GPT-2 config as the planner's GPT, whose layers are GPT-2's (the
    planner counts an LM head apart from the embedding, which GPT-2 ties:
    one vocabulary table too many for a model in one stage)."""
    from ..models.gpt2 import GPT2

    values = {**GPT2.defaults, **config}
    ffn = values.get("n_inner")
    if ffn is not None and ffn != 4 * values["n_embd"]:
        raise ValueError(f"plan: a GPT-2 with n_inner={ffn} (not 4 x n_embd) is not planned")
    return GPTConfig(
        vocab_size=values["vocab_size"],
        seq_len=values["n_positions"],
        hidden=values["n_embd"],
        heads=values["n_head"],
        layers=values["n_layer"],
    )


def _split(what: str, value: int, size: int, over: str = "tensor-parallel size") -> int:
    if value % size:
        raise ValueError(f"plan: {what}={value} is not divisible by the {over} {size}")
    return value // size


@functools.lru_cache(maxsize=4096)
def rank_tensors(model: Model, tp: int, pp: int, ep: int, pp_rank: int) -> list[Tensor]:
    """The parameters a rank of pipeline stage ``pp_rank`` holds at tensor-
    parallel size ``tp`` and expert-parallel size ``ep`` (every rank of a
    stage holds the same shapes)."""
    if model.kind == "gpt":
        return _gpt(model.config, tp, pp, ep, pp_rank)
    return _hf(model, tp, pp, ep, pp_rank)


def _gpt(cfg: GPTConfig, n: int, pp: int, ep: int, stage: int) -> list[Tensor]:
    h, v = cfg.hidden, cfg.vocab_size
    local = _split("heads", cfg.heads, n) * (h // cfg.heads)
    out: list[Tensor] = []
    if stage == 0:
        out += [Tensor("tok", (_split("vocab_size", v, n), h)), Tensor("pos", (cfg.seq_len, h))]
    for i in stage_blocks(cfg.layers, stage, pp):
        b = f"blocks.{i}."
        out += [Tensor(b + k, (h,)) for k in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")]
        out += [
            Tensor(b + "qkv.weight", (3 * local, h)),
            Tensor(b + "qkv.bias", (3 * local,)),
            Tensor(b + "proj.weight", (h, local)),
            Tensor(b + "proj.bias", (h,)),
        ]
        if cfg.moe_experts:
            ffn = max(1, 4 * h // cfg.moe_top_k)
            e = _split("moe_experts", cfg.moe_experts, ep, "expert-parallel size")
            out += [
                Tensor(b + "router", (cfg.moe_experts, h)),
                Tensor(b + "experts.w1", (e, h, ffn), expert=ep > 1),
                Tensor(b + "experts.w2", (e, ffn, h), expert=ep > 1),
            ]
            if cfg.moe_shared_experts:
                width = cfg.moe_shared_experts * ffn
                out += [Tensor(b + "shared.0", (width, h)), Tensor(b + "shared.2", (h, width))]
        else:
            f = _split("4 x hidden", 4 * h, n)
            out += [
                Tensor(b + "fc1.weight", (f, h)),
                Tensor(b + "fc1.bias", (f,)),
                Tensor(b + "fc2.weight", (h, f)),
                Tensor(b + "fc2.bias", (h,)),
            ]
    if stage == pp - 1:
        out += [Tensor("head.ln.weight", (h,)), Tensor("head.ln.bias", (h,))]
        out.append(Tensor("head.proj", (_split("vocab_size", v, n), h)))
    return out


def _hf(model: Model, n: int, pp: int, ep: int, stage: int) -> list[Tensor]:
    g = model.get
    h, v = model.hidden, model.vocab
    heads = _split("num_attention_heads", model.heads, n)
    tied = bool(g("tie_word_embeddings", False))
    out: list[Tensor] = []
    first, last = stage == 0, stage == pp - 1
    rows = padded_vocab(v, n, 64) // n  # the models pad what tp does not divide
    if first:
        out.append(Tensor("model.embed_tokens.weight", (rows, h)))
    make = _llama_layer if model.kind == "llama" else _deepseek_layer
    for i in stage_blocks(model.layers, stage, pp):
        out += make(model, i, n, ep, heads)
    if last:
        out.append(Tensor("model.norm.weight", (h,)))
        if not (tied and first):
            out.append(Tensor("lm_head.weight", (rows, h)))
    return out


def _llama_layer(model: Model, i: int, n: int, ep: int, heads: int) -> list[Tensor]:
    g = model.get
    h, kv = model.hidden, g("num_key_value_heads", model.heads)
    d = g("head_dim") or h // model.heads
    ffn = _split("intermediate_size", g("intermediate_size"), n)
    local_kv = kv if kv < n else _split("num_key_value_heads", kv, n)
    p = f"model.layers.{i}."
    return [
        Tensor(p + "input_layernorm.weight", (h,)),
        Tensor(p + "self_attn.q", (heads * d, h)),
        Tensor(p + "self_attn.kv", (2 * local_kv * d, h)),
        Tensor(p + "self_attn.o_proj", (h, heads * d)),
        Tensor(p + "post_attention_layernorm.weight", (h,)),
        Tensor(p + "mlp.gate_up", (2 * ffn, h)),
        Tensor(p + "mlp.down", (h, ffn)),
    ]


def _deepseek_layer(model: Model, i: int, n: int, ep: int, heads: int) -> list[Tensor]:
    g = model.get
    h = model.hidden
    nope, rope, vd = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
    q_lora, kv_lora = g("q_lora_rank"), g("kv_lora_rank")
    p = f"model.layers.{i}."
    a = p + "self_attn."
    # MLA's own matrices first, then its norms and o_proj (submodules).
    out = [Tensor(p + "input_layernorm.weight", (h,))]
    if q_lora:
        out += [Tensor(a + "q_a", (q_lora, h)), Tensor(a + "q_b", (heads * (nope + rope), q_lora))]
    else:
        out.append(Tensor(a + "q", (heads * (nope + rope), h)))
    out += [
        Tensor(a + "kv_a", (kv_lora + rope, h)),
        Tensor(a + "kv_b", (heads * (nope + vd), kv_lora)),
    ]
    if q_lora:
        out.append(Tensor(a + "q_a_layernorm", (q_lora,)))
    out += [
        Tensor(a + "kv_a_layernorm", (kv_lora,)),
        Tensor(a + "o_proj", (h, heads * vd)),
        Tensor(p + "post_attention_layernorm.weight", (h,)),
    ]
    m = p + "mlp."
    if i < g("first_k_dense_replace", 0):
        ffn = _split("intermediate_size", g("intermediate_size"), n)
        return out + [Tensor(m + "gate_up", (2 * ffn, h)), Tensor(m + "down", (h, ffn))]
    experts = g("n_routed_experts")
    local = _split("n_routed_experts", experts, ep, "expert-parallel size")
    mffn = g("moe_intermediate_size")
    shared = _split("shared experts' width", mffn * g("n_shared_experts", 1), n)
    return out + [
        Tensor(m + "gate.weight", (experts, h), fp32=True),
        Tensor(m + "experts.gate_up", (local, 2 * mffn, h), expert=ep > 1),
        Tensor(m + "experts.down", (local, h, mffn), expert=ep > 1),
        Tensor(m + "shared_experts.gate_up", (2 * shared, h)),
        Tensor(m + "shared_experts.down", (h, shared)),
    ]
