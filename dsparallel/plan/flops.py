"""Forward FLOPs per token of one layer on one rank (matmuls at 2 m n k,
attention's scores and weighted sum over the keys it attends) and the eager
ops it runs. Backward is twice the forward (the input and the weight
gradients, each a forward's worth); recomputation adds a forward."""

from __future__ import annotations

from .layout import Layout
from .model import Model

# Eager ops per layer's forward (counted from the layers' code, rounded):
# at a few microseconds each on a CPU they are most of a small model's step.
OPS = {
    "gpt": 30,
    "llama": 40,
    "deepseek_v3": 60,
    "expert": 8,
    "head": 12,
    "ring_step": 12,
    "ulysses": 10,
}


def _attention(keys: float, width: float) -> float:
    """Scores and weighted sum for one query over ``keys`` keys, summed over
    heads of total ``width`` (q.k and p.v, each 2 flops per element)."""
    return 4 * keys * width


def layer_flops(m: Model, lay: Layout, index: int, seq: int) -> float:
    """Forward FLOPs per token (of this rank's tokens) of layer ``index``
    on one rank: tensor parallelism splits the matmuls and heads;
    attention over a causal sequence of ``seq`` reads seq / 2 keys on
    average with the flash kernel, all ``seq`` on the math path."""
    g, t = m.get, lay.tp
    h, heads = m.hidden, m.heads
    causal_keys = seq / 2
    if m.kind == "gpt":
        cfg = m.config
        dense = 2 * h * 4 * h / t + _attention(causal_keys, h) / t
        if cfg.moe_experts:
            ffn, k = max(1, 4 * h // cfg.moe_top_k), cfg.moe_top_k
            mlp = 2 * h * cfg.moe_experts + k * 4 * h * ffn + 4 * h * ffn * cfg.moe_shared_experts
        else:
            mlp = 2 * h * 8 * h / t
        return dense + mlp
    if m.kind == "llama":
        kv = g("num_key_value_heads", heads)
        d = g("head_dim") or h // heads
        proj = 2 * h * (2 * heads * d + 2 * kv * d) / t
        mlp = 2 * 3 * h * g("intermediate_size") / t
        return proj + mlp + _attention(causal_keys, heads * d) / t
    nope, rope, vd = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
    q_lora, kv_lora = g("q_lora_rank"), g("kv_lora_rank")
    qk = nope + rope
    q = 2 * h * q_lora + 2 * q_lora * heads * qk / t if q_lora else 2 * h * heads * qk / t
    kv = 2 * h * (kv_lora + rope) + 2 * kv_lora * heads * (nope + vd) / t
    o = 2 * heads * vd * h / t
    keys = causal_keys if lay.cp > 1 else seq  # the math path computes every score
    attention = 2 * keys * heads * (qk + vd) / t
    if index < g("first_k_dense_replace", 0):
        mlp = 2 * 3 * h * g("intermediate_size") / t
    else:
        mffn, k = g("moe_intermediate_size"), g("num_experts_per_tok")
        mlp = 2 * h * g("n_routed_experts") + k * 6 * h * mffn
        if lay.tokens_split_for_experts:  # each tp rank routes its own tokens
            mlp /= t
        mlp += 6 * h * mffn * g("n_shared_experts", 1) / t
    return q + kv + o + attention + mlp


def head_flops(m: Model, lay: Layout) -> float:
    """The LM head's forward FLOPs per token (and the loss, negligible)."""
    return 2 * m.hidden * m.vocab / lay.tp


def layer_ops(m: Model, index: int, lay: Layout) -> int:
    """Eager ops of a layer's forward on one rank (ring attention adds a
    kernel call and a merge of a few ops per step)."""
    ops = OPS[m.kind]
    if lay.cp > 1:
        ops += OPS["ring_step"] * lay.cp if lay.cp_mode == "ring" else OPS["ulysses"]
    if m.kind == "deepseek_v3" and index >= m.get("first_k_dense_replace", 0):
        ops += OPS["expert"] * m.get("n_routed_experts") // lay.ep
    if m.kind == "gpt" and m.config.moe_experts:
        ops += OPS["expert"] * m.config.moe_experts // lay.ep
    return ops


def model_flops_per_token(m: Model, seq: int) -> float:
    """Training FLOPs per token of the whole model (forward and backward,
    no recomputation, one process): what MFU divides by."""
    lay = Layout()
    fwd = sum(layer_flops(m, lay, i, seq) for i in range(m.layers)) + head_flops(m, lay)
    return 3 * fwd
