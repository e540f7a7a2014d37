"""Activation bytes saved for backward per rank, as dsparallel's layers
save them (counted tensor by tensor from what autograd keeps, and held
against the jobs in tests/python/test_plan.py).

For one micro-batch of ``b`` sequences, ``T = b * s / cp`` of them this
rank's tokens (context parallelism splits the sequence), ``t`` the
tensor-parallel size and ``sp`` sequence parallelism (norms and residual
inputs on T / t tokens, the inputs of the tensor-parallel matmuls gathered
whole). Per layer, in elements:

- GPT block: T (4h + 12h/t + 4 + a/t): the two LayerNorms' inputs and
  outputs (and their mean and rstd per token) replicated; q, k, v, the
  attention output, the MLP's hidden and its GELU split over t; the flash
  kernel's log-sum-exp per head. With recomputation only the input, T h.
- Llama layer: 2 (2h + 1) / sp (two RMSNorms: input, output, rsqrt) + 2h
  (the inputs of the attention and MLP matmuls) + per rank's heads: the
  rotated queries and keys, keys and values, the output, the log-sum-exp
  + 4 ffn / t (gate and up, silu, their product) + cos and sin.
- DeepSeek-V3 layer: the same norms and inputs, the latent paths (q_lora,
  kv_lora + rope, their norms), per rank's heads the expanded keys and
  values, the queries, the output and (attention with another value width
  runs on the math path) the softmax probabilities, b s^2 per head;
  then the dense MLP or the MoE: the router's scores and choices, the k T
  dispatched rows (with ep, the rows this rank's experts receive: k T on
  average), their experts' gate/up (the grouped expert GEMM recomputes
  silu and the product in its backward), the combined outputs, and the
  shared experts' gate/up, silu and product split over t.

A pipeline stage adds the embedding (token ids) on the first stage and the
final norm, the LM head's input and the vocabulary-parallel loss (T V / t)
on the last. The micro-batches in flight come from the schedule
(``peak_in_flight`` of the C++ simulator).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..models.gpt import stage_blocks
from .layout import Layout
from .model import Model


@dataclass(frozen=True)
class Saved:
    """One tensor a layer saves for backward: ``width`` elements per token
    of ``nbytes`` each (None: the model's dtype). ``split`` says what
    divides it over the tensor-parallel ranks: "tp" (a head's or the MLP's
    shard), "sp" (a whole-width tensor that sequence parallelism keeps on
    T / t tokens), or "" (every rank keeps it whole). ``core`` marks
    attention's core (the scores, their softmax and dropout), which
    selective recomputation drops."""

    width: float
    nbytes: int | None = None
    split: str = ""
    core: bool = False


def layer_bytes(saved: list[Saved], lay: Layout, tokens: float, selective: bool = False) -> float:
    """Bytes a layer's ``saved`` tensors take on one rank for ``tokens``
    of this rank's tokens."""
    total = 0.0
    for x in saved:
        if selective and x.core:
            continue
        whole = x.split == "" or (x.split == "sp" and not lay.sequence_parallel)
        nbytes = lay.dtype_bytes if x.nbytes is None else x.nbytes
        total += tokens * x.width * nbytes / (1 if whole else lay.tp)
    return total


def gpt_block(m: Model, lay: Layout) -> list[Saved]:
    """What our GPT block saves: the two LayerNorms' inputs and outputs and
    their float32 mean and rstd, whole on every rank; q, k, v, the
    attention output and the MLP's hidden and GELU on this rank's heads;
    the flash kernel's float32 log-sum-exp per head. Recomputed: the
    block's input."""
    h, a = m.hidden, m.heads
    if lay.recompute:
        return [Saved(h)]
    saved = [Saved(4 * h), Saved(4, 4), Saved(4 * h, split="tp"), Saved(a, 4, "tp")]
    cfg = m.config
    if not cfg.moe_experts:
        return saved + [Saved(8 * h, split="tp")]  # fc1's output and GELU's
    # Not split by tp: the router's scores and choices (int64), the
    # dispatched rows, each expert's hidden (the grouped expert GEMM saves
    # only the pre-activation and recomputes GELU in its backward), the
    # combined rows and their slots; the shared experts' hidden and GELU.
    k, ffn = cfg.moe_top_k, max(1, 4 * h // cfg.moe_top_k)
    mlp = cfg.moe_experts + 7 * k + k * (3 * h + ffn) + 2 * cfg.moe_shared_experts * ffn
    return saved + [Saved(mlp)]


def megatron_layer(h: int, a: int, s: int, recompute: str = "none") -> list[Saved]:
    """What Megatron-LM's GPT layer saves, as Korthikanti et al. (arXiv
    2205.05198, section 4) count it: 16-bit activations, 1-byte dropout
    masks, attention without a fused kernel (its scores, softmax and
    dropout per head over the ``s`` keys). ``recompute``: "none",
    "selective" (marked ``core``, dropped by ``layer_bytes(selective=True)``)
    or "full" (the layer's input)."""
    if recompute == "full":
        return [Saved(h, 2)]
    return [
        Saved(h, 2, "sp"),  # LayerNorm 1's input
        Saved(h, 2, "sp"),  # the QKV matmul's input
        Saved(2 * h, 2, "tp"),  # q and k for the scores
        Saved(a * s, 2, "tp", core=True),  # softmax's output
        Saved(a * s, 1, "tp", core=True),  # its dropout mask
        Saved(a * s, 2, "tp", core=True),  # the dropout's output (times v)
        Saved(h, 2, "tp"),  # v
        Saved(h, 2, "tp"),  # the output projection's input
        Saved(h, 1, "sp"),  # attention's dropout mask
        Saved(h, 2, "sp"),  # LayerNorm 2's input
        Saved(h, 2, "sp"),  # fc1's input
        Saved(4 * h, 2, "tp"),  # GeLU's input
        Saved(4 * h, 2, "tp"),  # fc2's input
        Saved(h, 1, "sp"),  # the MLP's dropout mask
    ]


def _norms(
    h: int, lay: Layout, tokens: float, count: int = 2, split: bool = True
) -> tuple[float, float]:
    """RMSNorms, computed in float32 (on T / t tokens under sp, if
    ``split``): each keeps its input in float32, its rsqrt, and x * rsqrt
    (in the model's dtype once cast; the same float32 tensor as the
    input's when that is float32)."""
    sigma = lay.tp if lay.sequence_parallel and split else 1
    n = count * tokens / sigma
    if lay.dtype_bytes == 4:
        return 0.0, n * (2 * h + 1)
    return n * h, n * (h + 1)


def _llama_layer(m: Model, lay: Layout, tokens: float, seq: float) -> float:
    g = m.get
    h, heads, t = m.hidden, m.heads, lay.tp
    if lay.recompute:
        return tokens * h / (t if lay.sequence_parallel else 1), 0.0
    kv = g("num_key_value_heads", heads)
    d = g("head_dim") or h // heads
    local_kv = 1 if kv < t else kv // t
    q = heads // t * d
    attention = 2 * q + 3 * local_kv * d + q  # q, q_rot, k_rot + k, v, out
    mlp = 4 * g("intermediate_size") / t
    low, fp32 = _norms(h, lay, tokens)
    low += tokens * (2 * h + attention + mlp)
    return low, fp32 + tokens * heads // t  # the log-sum-exp


def _deepseek_layer(m: Model, lay: Layout, index: int, tokens: float, seq: float) -> float:
    g = m.get
    h, heads, t = m.hidden, m.heads, lay.tp
    if lay.recompute:
        return tokens * h / (t if lay.sequence_parallel else 1), 0.0
    nope, rope, vd = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
    q_lora, kv_lora = g("q_lora_rank"), g("kv_lora_rank")
    local = heads // t
    qk = nope + rope
    latent = (q_lora if q_lora else 0) + 2 * (kv_lora + rope)  # q_a's output, kv_a's, cat
    low_precision = lay.dtype_bytes < 4
    if lay.cp > 1:
        # The ring's flash kernel: q, k, v padded to q's width, the padded
        # output, then o_proj's input; the log-sum-exp in float32.
        per_head, fp32 = local * (4 * qk + vd), local
    elif low_precision:
        # The math path (another value width) upcasts to float32: q, k, v
        # and the softmax probabilities [b, heads, s, s]; o_proj's input.
        per_head, fp32 = local * vd, local * (2 * qk + seq + vd)
    else:
        # The same in float32, v a view of kv_b's output (k_nope and v).
        per_head, fp32 = local * ((nope + vd) + 2 * qk + seq + vd), 0.0
    attention = 2 * h + latent + per_head
    if index < g("first_k_dense_replace", 0):
        mlp = 4 * g("intermediate_size") / t
    else:
        k, experts = g("num_experts_per_tok"), g("n_routed_experts")
        mffn = g("moe_intermediate_size")
        sigma = t if lay.tokens_split_for_experts else 1
        # The routed experts' gate/up only (the grouped GEMM recomputes silu
        # and the product); the shared experts' gate, up, silu and product.
        mlp = k * (3 * h + 2 * mffn) / sigma + 4 * mffn * g("n_shared_experts", 1) / t
        # The float32 router's input and sigmoid scores, choices (int64), weights.
        if low_precision:
            fp32 += (h + experts + 6 * k + 1) / sigma
        else:
            mlp += (experts + 6 * k + 1) / sigma
    low, norms32 = _norms(h, lay, tokens)
    # The latent norms run on every token (gathered under sp).
    for width in (kv_lora, q_lora or 0):
        a, b = _norms(width, lay, tokens, 1, split=False) if width else (0.0, 0.0)
        low, norms32 = low + a, norms32 + b
    low += tokens * (attention + mlp)
    return low, norms32 + tokens * fp32


def _rope_table(m: Model, seq: float) -> float:
    """cos and sin [1, s, d] (DeepSeek's interleaved rope keeps half)."""
    if m.kind == "llama":
        return 2 * seq * (m.get("head_dim") or m.hidden // m.heads)
    return seq * m.get("qk_rope_head_dim")


@functools.lru_cache(maxsize=4096)
def stage_bytes(m: Model, lay: Layout, stage: int, micro_batch: int, seq: int) -> float:
    """Bytes one micro-batch of ``micro_batch`` sequences of ``seq`` tokens
    leaves saved on a rank of pipeline stage ``stage``."""
    local_seq = seq / lay.cp
    tokens = micro_batch * local_seq
    h, t = m.hidden, lay.tp
    low = fp32 = blocks = 0.0  # elements in the model's dtype, in float32; bytes
    for i in stage_blocks(m.layers, stage, lay.num_stages):
        if m.kind == "gpt":
            blocks += layer_bytes(gpt_block(m, lay), lay, tokens)
            continue
        if m.kind == "llama":
            a, b = _llama_layer(m, lay, tokens, local_seq)
        else:
            a, b = _deepseek_layer(m, lay, i, tokens, local_seq)
        low, fp32 = low + a, fp32 + b
    if m.kind != "gpt" and stage_blocks(m.layers, stage, lay.num_stages):
        low += _rope_table(m, local_seq)  # cos and sin, which every layer keeps
    if stage == 0:
        fp32 += 2 * tokens + 2 * local_seq  # token ids and positions (int64)
    if stage == lay.num_stages - 1:
        # The final norm and the LM head's input; the loss's float32 softmax.
        if m.kind == "gpt":
            low += tokens * 2 * h  # LayerNorm's input and output (the head's input)
            fp32 += tokens * 2
        else:
            a, b = _norms(h, lay, tokens, 1)
            low, fp32 = low + a + tokens * h, fp32 + b
        fp32 += tokens * (m.vocab / t + 4)
    return blocks + low * lay.dtype_bytes + fp32 * 4


@functools.lru_cache(maxsize=1024)
def schedule_of(name: str, num_stages: int, micro_batches: int, per_rank: int):
    """The C++ schedule (generated and validated once per shape: a search
    asks for the same few thousands of times). Read only."""
    from ..pipeline.schedule import get_schedule

    return get_schedule(name, num_stages, micro_batches, per_rank)


@functools.lru_cache(maxsize=1024)
def _peaks(name: str, num_stages: int, micro_batches: int, per_rank: int) -> tuple[int, ...]:
    return tuple(schedule_of(name, num_stages, micro_batches, per_rank).validate().peak_in_flight)


def peak_in_flight(lay: Layout) -> list[int]:
    """Per pipeline rank, the most micro-batch-stages whose forward has run
    and whose backward (or weight gradient) has not: the schedule's own
    simulation (csrc/core/pipeline)."""
    if lay.pp == 1 and lay.per_rank == 1:
        return [1]
    return list(_peaks(lay.schedule, lay.num_stages, lay.micro_batches, lay.per_rank))


def activation_bytes(m: Model, lay: Layout, pp_rank: int, seq: int) -> float:
    """The most bytes a rank of pipeline rank ``pp_rank`` keeps saved over a
    step: its stages' micro-batch activations times the micro-batches the
    schedule keeps in flight there."""
    stages = lay.stages_of(pp_rank)
    per_stage = [stage_bytes(m, lay, s, lay.micro_batch, seq) for s in stages]
    return peak_in_flight(lay)[pp_rank] * sum(per_stage) / len(per_stage)
