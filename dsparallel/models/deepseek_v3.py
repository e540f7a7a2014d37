"""DeepSeek-V3, the maths of ``transformers``' ``DeepseekV3ForCausalLM``:
multi-head latent attention, then a dense SwiGLU MLP in the first
``first_k_dense_replace`` layers and a mixture of experts in the rest.

Multi-head latent attention (per token, n heads)::

    q        = q_b(rmsnorm(q_a(x)))          (or q_proj(x) without q_lora_rank)
    c, k_pe  = kv_a(x)                       latent [kv_lora_rank], shared rope key
    k_nope,v = kv_b(rmsnorm(c))              per head
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe)]
    out      = o(softmax(q k^T * scale) v)

Heads are split over tensor parallelism: ``q_b`` (or ``q_proj``) and
``kv_b`` column-parallel, ``o`` row-parallel. The down projections
``q_a`` and ``kv_a`` and their norms are small and replicated; their
outputs enter the head-split part through the copy map, whose backward
all-reduces the partial gradients of every rank's heads (this also covers
the shared rope key, which every head reads).

The MoE layer: sigmoid scores of a float32 router; the top ``topk_group``
of ``n_group`` expert groups (a group scored by the sum of its two best
``score + e_score_correction_bias``), then the ``num_experts_per_tok``
best experts inside them; weights are the chosen scores (without the
bias), renormalised with ``norm_topk_prob``, times ``routed_scaling_factor``.
Routed experts (SwiGLU) are split over the expert-parallel group and
reached through the C++ dispatch/combine ops; the shared experts are one
SwiGLU split over tensor parallelism. By default the routed experts are
replicated over tensor parallelism: every rank of a tensor-parallel group
routes the same tokens (under sequence parallelism, its own part of them,
the experts' gradients then summed over the group). With
``init_parallel(experts_over_tp=True)`` the expert-parallel group spans the
tp ranks and each routes only its own tokens: its part of the sequence
under sequence parallelism, else its share of the rows every tp rank holds
(split before the router, the routed output gathered after the combine),
so no expert's work or gradient is repeated over tp.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import context_parallel
from .. import tensor_parallel as tp
from ..checkpoint import checkpoint as recompute
from ..moe.layer import AddAuxLossGrad
from ..moe.ops import Plan, combine, dispatch, grouped_mlp
from .causal_lm import CausalLM
from .hf_config import rope_frequencies, softmax_scale
from .hf_map import Cat, Stack, cols, rows, whole
from .layers import Layout, RMSNorm, Rotary, SwiGLU, attend, check_split


class MLA(nn.Module):
    def __init__(self, cfg, index: int, layout: Layout, rotary: Rotary):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        n, r = layout.tp_size, layout.tp_rank
        check_split("num_attention_heads", heads, n)
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        qk = self.nope + self.rope_dim
        self.kv_lora = cfg.kv_lora_rank
        self.q_lora = cfg.get("q_lora_rank")
        self.layout, self.rotary = layout, rotary
        self.scale = softmax_scale(cfg.rope_parameters, qk)
        pre = f"model.layers.{index}.self_attn"
        eps = cfg.rms_norm_eps
        local = heads // n

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, device="meta"))

        specs = {}
        if self.q_lora:
            self.q_a = param(self.q_lora, h)
            self.q_a_layernorm = RMSNorm(self.q_lora, eps, f"{pre}.q_a_layernorm.weight", layout)
            self.q_b = param(local * qk, self.q_lora)
            specs["q_a"] = whole(f"{pre}.q_a_proj.weight", (self.q_lora, h))
            specs["q_b"] = rows(f"{pre}.q_b_proj.weight", (heads * qk, self.q_lora), r, n)
        else:
            self.q = param(local * qk, h)
            specs["q"] = rows(f"{pre}.q_proj.weight", (heads * qk, h), r, n)
        self.kv_a = param(self.kv_lora + self.rope_dim, h)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps, f"{pre}.kv_a_layernorm.weight", layout)
        self.kv_b = param(local * (self.nope + self.v_dim), self.kv_lora)
        specs["kv_a"] = whole(f"{pre}.kv_a_proj_with_mqa.weight", (self.kv_lora + self.rope_dim, h))
        specs["kv_b"] = rows(
            f"{pre}.kv_b_proj.weight", (heads * (self.nope + self.v_dim), self.kv_lora), r, n
        )
        self.o_proj = tp.RowParallelLinear(
            heads * self.v_dim,
            h,
            bias=False,
            group=layout.tp_group,
            sequence_parallel=layout.sp,
            device="meta",
        )
        self.o_proj.hf_specs = {
            "weight": cols(f"{pre}.o_proj.weight", (h, heads * self.v_dim), r, n)
        }
        self.hf_specs = specs

    def new_cache(self, batch: int, length: int, dtype) -> dict:
        """The compressed cache: the normalised latent and the rotated shared
        rope key of ``length`` positions (every rank holds all of it: one
        latent serves every head)."""
        return {
            "latent": torch.empty(batch, length, self.kv_lora, dtype=dtype),
            "k_pe": torch.empty(batch, length, self.rope_dim, dtype=dtype),
        }

    def cache_entries(self) -> dict:
        """Per cached position: the latent and the shared rope key."""
        return {"latent": (self.kv_lora,), "k_pe": (self.rope_dim,)}

    def forward(self, x, cos, sin, mask, cache=None):
        """x [seq (/tp under sequence parallelism), batch, hidden]; with
        ``cache`` (this layer's ``new_cache``, the position its queries
        start at) attention runs on the cached latent (``_absorbed``)."""
        lay = self.layout
        # The down projections and their norms are replicated. Without
        # sequence parallelism every rank computes them on the same tokens
        # and their outputs enter the head-split part through the copy map
        # (its backward sums the heads' partial gradients). With it, every
        # rank computes them on the gathered sequence, the gather's backward
        # sums the input gradients, and their weights' gradients are summed
        # instead (``shared``).
        if lay.sp:
            x = lay.enter(x)

        def into_heads(a):
            return a if lay.sp else lay.copy_to(a)

        if self.q_lora:
            c = self.q_a_layernorm(F.linear(x, lay.shared(self.q_a)))
            q = F.linear(into_heads(c), self.q_b)
        else:
            q = F.linear(into_heads(x), self.q)
        s, b = x.shape[:2]
        q = q.view(s, b, -1, self.nope + self.rope_dim).permute(1, 2, 0, 3)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = F.linear(x, lay.shared(self.kv_a)).split([self.kv_lora, self.rope_dim], -1)
        latent = into_heads(torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1))
        latent, k_pe = latent.split([self.kv_lora, self.rope_dim], dim=-1)
        q_pe = self.rotary.apply(q_pe, cos, sin)
        k_pe = self.rotary.apply(k_pe.transpose(0, 1).unsqueeze(1), cos, sin)
        if cache is not None:
            out = self._absorbed(q_nope, q_pe, latent.transpose(0, 1), k_pe[:, 0], mask, cache)
            return self.o_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
        kv = F.linear(latent, self.kv_b).view(s, b, -1, self.nope + self.v_dim).permute(1, 2, 0, 3)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = attend(q, k, v, mask, lay, self.scale)
        return self.o_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask, cache):
        """Attention over the cached latent without expanding it to keys and
        values (DeepSeek-V2's absorption, as vLLM decodes): kv_b's key part
        W_UK is folded into the queries and its value part W_UV applied
        after, so a step reads (kv_lora_rank + rope) values per cached
        position instead of heads x (k + v).

            q.k  = (q_nope W_UK) . latent + q_pe . k_pe
            out  = (softmax(q.k * scale) latent) W_UV
        """
        if not isinstance(cache, tuple):  # a paged step's layer: one row of every sequence's tokens

            def per_group(qs, kv, allowed):  # [g, q, heads, .], [g, keys, .]
                out = self._absorbed_attention(
                    qs["nope"].transpose(1, 2),
                    qs["pe"].transpose(1, 2),
                    kv["latent"],
                    kv["k_pe"],
                    allowed[:, None],
                )
                return out.transpose(1, 2)

            queries = {"nope": q_nope[0].transpose(0, 1), "pe": q_pe[0].transpose(0, 1)}
            out = cache.attend(queries, {"latent": latent[0], "k_pe": k_pe[0]}, per_group)
            return out.transpose(0, 1)[None]
        slot, start = cache
        n = latent.shape[1]
        slot["latent"][:, start : start + n] = latent
        slot["k_pe"][:, start : start + n] = k_pe
        latent, k_pe = slot["latent"][:, : start + n], slot["k_pe"][:, : start + n]
        if mask is None:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=latent.device).tril(start)
        return self._absorbed_attention(q_nope, q_pe, latent, k_pe, mask)

    def _absorbed_attention(self, q_nope, q_pe, latent, k_pe, allowed):
        """q_nope, q_pe [batch, heads, q, .] over latent, k_pe [batch, keys,
        .]; ``allowed`` the boolean mask broadcast to [batch, heads, q, keys]."""
        w = self.kv_b.view(-1, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.einsum("bhqn,hnc->bhqc", q_nope, w_uk)
        scores = torch.einsum("bhqc,bkc->bhqk", q_latent, latent)
        scores = (scores + torch.einsum("bhqr,bkr->bhqk", q_pe, k_pe)) * self.scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1, dtype=torch.float32)
        out = torch.einsum("bhqk,bkc->bhqc", probs.to(latent.dtype), latent)
        return torch.einsum("bhqc,hvc->bhqv", out, w_uv)


class Router(nn.Module):
    """DeepSeek-V3's group-limited top-k router (see the module docstring);
    the weight and the correction bias stay float32 whatever the model's
    dtype, as in ``transformers``.

    Training counts the tokens each expert is chosen for
    (``pending_load``); ``model.update_expert_bias()`` then
    moves ``e_score_correction_bias`` by ``bias_update_rate`` (DeepSeek's
    update speed, 0.001) towards the mean load: the auxiliary-loss-free
    balancing of the DeepSeek-V3 paper. 0 keeps the bias fixed."""

    bias_update_rate = 1e-3
    # The sequence-wise balance loss's weight (the paper's alpha; 0: off, as
    # transformers' model, which has none; the trainer's default is the
    # paper's 1e-4), and the share of it each forward call carries (1/M when
    # a pipeline runs M micro-batches a step: the step's loss is then the
    # mean over the global batch's sequences).
    balance_loss_weight = 0.0
    balance_loss_share = 1.0

    def __init__(self, cfg, prefix: str, layout: Layout):
        super().__init__()
        self.layout = layout
        self.layer_index = int(prefix.split(".")[2])  # model.layers.{i}.mlp
        self.experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.groups, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.get("norm_topk_prob", True)
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.experts, cfg.hidden_size, device="meta"))
        self.weight._dsp_keep_fp32 = True
        self.register_buffer("e_score_correction_bias", torch.empty(self.experts, device="meta"))
        # This rank's token counts per expert since the last update: not a
        # buffer, so that neither a checkpoint nor DDP's broadcast carries it.
        self.pending_load = torch.zeros(self.experts)
        self.balance_loss: torch.Tensor | None = None  # the last one trained with
        self.hf_specs = {
            "weight": whole(f"{prefix}.gate.weight", (self.experts, cfg.hidden_size)),
            "e_score_correction_bias": whole(
                f"{prefix}.gate.e_score_correction_bias", (self.experts,)
            ),
        }

    def forward(self, x: torch.Tensor, batch: int = 1, valid: int | None = None):
        """x [tokens, hidden] (``batch`` sequences, sequence-major) ->
        (expert indices [tokens, top_k], weights float32, the balance loss
        to train with or None). Rows from ``valid`` on are padding: not
        routed (index -1) nor counted."""
        scores = F.linear(x.float(), self.layout.shared(self.weight).float()).sigmoid()
        with torch.no_grad():
            choice = scores + self.e_score_correction_bias
            per_group = choice.view(-1, self.groups, self.experts // self.groups)
            group_scores = per_group.topk(2, dim=-1).values.sum(-1)
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
            keep = keep.unsqueeze(-1).expand_as(per_group).reshape(-1, self.experts)
            idx = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)
            idx = idx.indices
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        padded = valid is not None and valid < idx.shape[0]
        if self.training and torch.is_grad_enabled():
            # Recomputation counts every token twice, in every layer alike:
            # the sign rule, scale-free, moves the bias the same.
            load = torch.bincount(idx[:valid].flatten(), minlength=self.experts).float()
            self.pending_load = self.pending_load.to(load.device) + load
        balance = None
        if self.balance_loss_weight and self.training and torch.is_grad_enabled():
            if padded or idx.shape[0] % batch:  # not whole positions of every sequence
                raise ValueError(
                    "DeepseekV3: the balance loss with experts_over_tp needs the tokens to split "
                    f"evenly over the tensor-parallel ranks ({self.layout.tp_size}): make the "
                    "sequence length a multiple of it"
                )
            balance = self._balance_loss(scores, idx, batch)
        if padded:
            idx = idx.clone()
            idx[valid:] = -1
        return idx, weights * self.scaling, balance

    def _balance_loss(self, scores: torch.Tensor, idx: torch.Tensor, batch: int):
        """DeepSeek-V3's sequence-wise balance loss (paper, eq. 17-20): per
        sequence of T tokens, f_i = E / (K T) * (tokens choosing expert i)
        and P_i = mean over the tokens of the scores normalised over the
        experts; alpha * sum_i f_i P_i, the mean over the sequences.

        A rank may hold part of each sequence (sequence parallelism: 1/tp of
        it; context parallelism: its chunks): the counts and score sums are
        summed over those ranks (one all-reduce of [2, batch, experts] per
        group, no gradient), and the returned term is this rank's tokens'
        share, whose gradient is the loss's through them (times the
        context-parallel size, which the gradients' averaging over dp x cp
        divides out, as the language-model loss does). ``balance_loss``
        keeps the whole loss's value."""
        lay, e = self.layout, self.experts
        mine = scores.view(-1, batch, e)  # [seq here, batch, experts]
        share = (mine / mine.sum(-1, keepdim=True)).sum(0)  # [batch, experts]
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0).view(-1, batch, e).sum(0)
        stats = torch.stack([chosen, share.detach()])
        tokens = mine.shape[0]
        for size, group, on in (
            (lay.tp_size, lay.tp_group, lay.sp),
            (lay.cp_size, lay.cp_group, True),
        ):
            if on and size > 1:
                dist.all_reduce(stats, group=group)
                tokens *= size
        f = stats[0] * e / (self.top_k * tokens)
        alpha = self.balance_loss_weight * self.balance_loss_share
        self.balance_loss = alpha * (f * stats[1] / tokens).sum(-1).mean()
        return alpha * lay.cp_size * (f * share / tokens).sum(-1).mean()

    @torch.no_grad()
    def apply_load(self, load: torch.Tensor) -> None:
        """The sign rule on the load summed over every rank that routed
        other tokens through this layer."""
        bias = self.e_score_correction_bias
        bias += self.bias_update_rate * torch.sign(load.mean() - load).to(bias)
        self.pending_load = torch.zeros_like(self.pending_load)


class Experts(nn.Module):
    """This rank's routed experts, SwiGLU, stacked as ``transformers``
    holds them in memory: gate_up [local, 2 * ffn, hidden] (gate rows,
    then up rows) and down [local, hidden, ffn]; on disk each expert is
    three tensors, ``experts.{j}.{gate,up,down}_proj.weight``."""

    def __init__(self, cfg, prefix: str, first: int, count: int, layout: Layout):
        super().__init__()
        self.layout = layout
        ep_group = layout.ep_group
        h, ffn = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(count, 2 * ffn, h, device="meta"))
        self.down = nn.Parameter(torch.empty(count, h, ffn, device="meta"))
        for p in (self.gate_up, self.down):
            # Read by our DDP and ZeRO: reduced over the ranks holding the
            # same experts.
            p._dsp_expert_group = ep_group
        # Under sequence parallelism the tensor-parallel ranks route
        # different tokens through the same experts, whose gradients then
        # add over tp; unless the experts are split over tp too.
        self.summed_over_tp = layout.sp and not layout.experts_over_tp
        ex = [f"{prefix}.experts.{first + j}" for j in range(count)]
        shape = (ffn, h)
        self.hf_specs = {
            "gate_up": Stack(
                tuple(
                    Cat(
                        (whole(f"{e}.gate_proj.weight", shape), whole(f"{e}.up_proj.weight", shape))
                    )
                    for e in ex
                )
            ),
            "down": Stack(tuple(whole(f"{e}.down_proj.weight", (h, ffn)) for e in ex)),
        }

    def forward(self, rows_: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
        """``rows_`` in blocks of ``chunks`` [(local expert, rows), ...]."""
        gate_up, down = self.gate_up, self.down
        if self.summed_over_tp:
            gate_up, down = self.layout.shared(gate_up), self.layout.shared(down)
        return grouped_mlp(rows_, gate_up, down, chunks, "swiglu", transposed=True)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg, index: int, layout: Layout):
        super().__init__()
        pre = f"model.layers.{index}.mlp"
        experts = cfg.n_routed_experts
        check_split("n_routed_experts", experts, layout.ep_size, "expert-parallel size")
        check_split("n_routed_experts", experts, cfg.n_group, "n_group")
        local = experts // layout.ep_size
        self.layout, self.ep_group = layout, layout.ep_group
        self.num_experts, self.top_k = experts, cfg.num_experts_per_tok
        # With the experts over tp each rank routes its own tokens: the
        # router's weight gradient and its balance loss statistics are then
        # summed over tp, as under sequence parallelism.
        self.split_tokens = layout.experts_over_tp and not layout.sp
        routing = dataclasses.replace(layout, sp=True) if layout.experts_over_tp else layout
        self.gate = Router(cfg, pre, routing)
        self.experts = Experts(cfg, pre, layout.ep_rank * local, local, layout)
        self.shared_experts = SwiGLU(
            cfg.hidden_size,
            cfg.moe_intermediate_size * cfg.get("n_shared_experts", 1),
            f"{pre}.shared_experts",
            layout,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        valid = None
        if self.split_tokens:
            flat, valid = self._my_rows(flat)
        idx, weights, balance = self.gate(flat, batch=shape[1], valid=valid)
        weights = weights.to(x.dtype)
        if self.ep_group is not None:
            plan = Plan(idx, self.num_experts, self.ep_group)
            routed = combine(self.experts(dispatch(flat, plan), plan.chunks()), weights, plan)
        else:
            routed = self._local(flat, idx, weights)
        if self.split_tokens:
            routed = self._all_rows(routed, shape[0] * shape[1])
        out = routed.view(shape) + self.shared_experts(x)
        if balance is not None:  # trains the router as if added to the loss
            out = AddAuxLossGrad.apply(out, balance)
        return out

    def _my_rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This tensor-parallel rank's share of the rows every rank holds
        (zero rows pad them to a multiple of tp; a decoding step may have
        fewer rows than ranks) and how many of them are real. The split's
        backward all-gathers the rows' gradients."""
        lay = self.layout
        n, h = flat.shape
        per = -(-n // lay.tp_size)
        padded = F.pad(flat, (0, 0, 0, per * lay.tp_size - n))
        mine = tp.scatter_to_tensor_parallel_region(padded.reshape(-1), lay.tp_group)
        return mine.view(per, h), max(0, min(per, n - lay.tp_rank * per))

    def _all_rows(self, mine: torch.Tensor, n: int) -> torch.Tensor:
        """Every rank's routed rows, in order (the gather's backward keeps
        this rank's share of the replicated gradient)."""
        lay = self.layout
        every = tp.gather_from_tensor_parallel_region(mine.reshape(-1), lay.tp_group)
        return every.view(-1, mine.shape[1])[:n]

    def _local(self, x, idx, weights):
        """Every expert in this process: assignments sorted by expert, each
        expert's block through it, the outputs weighted back per token."""
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        y = self.experts(x.index_select(0, order // self.top_k), list(enumerate(counts)))
        slots = x.new_zeros(flat.numel(), x.shape[1]).index_copy(0, order, y)
        return torch.bmm(weights.unsqueeze(1), slots.view(-1, self.top_k, x.shape[1])).squeeze(1)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg, index: int, layout: Layout, rotary: Rotary):
        super().__init__()
        pre = f"model.layers.{index}"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, f"{pre}.input_layernorm.weight", layout)
        self.self_attn = MLA(cfg, index, layout, rotary)
        self.post_attention_layernorm = RMSNorm(
            h, eps, f"{pre}.post_attention_layernorm.weight", layout
        )
        if index >= cfg.first_k_dense_replace:
            self.mlp = DeepseekMoE(cfg, index, layout)
        else:
            self.mlp = SwiGLU(h, cfg.intermediate_size, f"{pre}.mlp", layout)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """One multi-token-prediction module (the DeepSeek-V3 paper, section
    2.2), checkpoint layer ``index`` (``num_hidden_layers`` + k - 1 for
    depth k), in the released checkpoints' names::

        h' = eh_proj [enorm(emb(t_{i+k})) ; hnorm(h_i)]
        h  = block(h')                   a decoder layer (MoE past the dense ones)
        logits = head(shared_head.norm(h))

    ``emb`` and ``head`` are the model's own (the paper's shared embedding
    and output head); ``h_i`` is the previous depth's output, at depth 1
    the main model's last layer before its final norm. ``eh_proj`` is
    replicated over tensor parallelism (its output enters the block as any
    layer's input)."""

    def __init__(self, cfg, index: int, layout: Layout, rotary: Rotary):
        super().__init__()
        pre = f"model.layers.{index}"
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layout = layout
        self.enorm = RMSNorm(h, eps, f"{pre}.enorm.weight", layout)
        self.hnorm = RMSNorm(h, eps, f"{pre}.hnorm.weight", layout)
        self.eh_proj = nn.Parameter(torch.empty(h, 2 * h, device="meta"))
        self.hf_specs = {"eh_proj": whole(f"{pre}.eh_proj.weight", (h, 2 * h))}
        self.block = DeepseekV3DecoderLayer(cfg, index, layout, rotary)
        self.head_norm = RMSNorm(h, eps, f"{pre}.shared_head.norm.weight", layout)

    def forward(self, h, emb, cos, sin, mask):
        """h, emb [seq (/tp under sequence parallelism), batch, hidden]."""
        x = torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)
        return self.block(F.linear(x, self.layout.shared(self.eh_proj)), cos, sin, mask)


class DeepseekV3(CausalLM):
    """``DeepseekV3(config, state=None, mtp_depth=0)``: as ``Llama``, with
    the routed experts split over ``init_parallel``'s expert-parallel
    group, and ``mtp_depth`` multi-token-prediction modules (``MTPLayer``;
    ``from_pretrained`` builds as many as the checkpoint holds, up to
    ``num_nextn_predict_layers``, unless told otherwise).

    In training, a forward with labels adds ``mtp_loss_weight`` (the
    paper's lambda: 0.3 for most of its pre-training, 0.1 after) times the
    mean of the depths' losses: depth k's position i predicts token
    i + k + 1, -100 labels ignored, each depth's cross entropy the mean
    over its own targets (with ``num_items_in_batch``, a per-token loss,
    the sum over the main loss's count, as Megatron's per-token MTP loss).
    ``mtp_loss`` keeps that mean's value. Evaluation (``model.eval()``)
    leaves it out. Not under a pipeline schedule yet."""

    mtp_loss_weight = 0.3

    def __init__(self, config, state=None, *, mtp_depth: int = 0, **kwargs):
        if not isinstance(mtp_depth, int) or mtp_depth < 0:
            raise ValueError(f"DeepseekV3: mtp_depth must be an integer >= 0, got {mtp_depth!r}")
        self.mtp_depth = mtp_depth
        super().__init__(config, state, **kwargs)
        self.mtp_loss: torch.Tensor | None = None

    @classmethod
    def checkpoint_options(cls, config: dict, weight_map: dict) -> dict:
        """The MTP layers the checkpoint holds (consecutive from layer
        ``num_hidden_layers``, at most ``num_nextn_predict_layers``)."""
        first, depth = config.get("num_hidden_layers", 0), 0
        while (
            depth < config.get("num_nextn_predict_layers", 0)
            and f"model.layers.{first + depth}.eh_proj.weight" in weight_map
        ):
            depth += 1
        return {"mtp_depth": depth}

    def make_extras(self) -> None:
        self.mtp = None
        cfg, first = self.config, self.config.num_hidden_layers
        if self.mtp_depth and self.is_last:
            self.mtp = nn.ModuleList(
                MTPLayer(cfg, first + k, self.layout, self.rotary) for k in range(self.mtp_depth)
            )
        # Written by whichever stage holds the embedding and the head.
        for k in range(self.mtp_depth):
            pre = f"model.layers.{first + k}"
            self.saved_twice.setdefault(self.embed_key, []).append(f"{pre}.embed_tokens.weight")
            self.saved_twice.setdefault(self.head_key, []).append(f"{pre}.shared_head.head.weight")

    def extra_loss(self, h, input_ids, labels, position_ids, mask, num_items):
        if self.mtp is None:
            return None
        lay = self.layout
        cos, sin = self.rotary.cos_sin(position_ids, h.dtype)
        losses = []
        for k, layer in enumerate(self.mtp, start=1):
            # t_{i+k} at position i; past the end a pad token, whose target
            # (t_{i+k+1}) is past the end too and ignored.
            ids = F.pad(input_ids, (0, k))[:, k:]
            if lay.cp_size > 1:
                ids = context_parallel.shard_sequence(ids, lay.cp_group)
            emb = self.embed(ids, position_ids)
            if self.checkpoint and torch.is_grad_enabled():
                h = recompute(layer, h, emb, cos, sin, mask)
            else:
                h = layer(h, emb, cos, sin, mask)
            logits = self.vocab_parallel_logits(h, layer.head_norm)
            targets = F.pad(labels, (0, k), value=-100)[:, k:]  # loss_fn shifts one more
            losses.append(self.loss_fn(logits, targets, num_items))
        mean = torch.stack(losses).mean()
        self.mtp_loss = mean.detach()
        return self.mtp_loss_weight * mean

    def config_dict(self) -> dict:
        """The config as read (a round trip keeps every field), with the
        MTP depth built where there is one. Layers dropped with
        ``mtp_depth=0`` leave the count as it was, as ``transformers``,
        which drops them too, leaves it."""
        values = super().config_dict()
        if self.mtp_depth:
            values["num_nextn_predict_layers"] = self.mtp_depth
        return values

    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    # As ``DeepseekV3Config``'s, for the fields a config leaves out.
    defaults = {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "rope_interleave": True,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
        "q_lora_rank": 1536,
    }

    def check(self, cfg) -> None:
        scoring = cfg.get("scoring_func", "sigmoid")
        method = cfg.get("topk_method", "noaux_tc")
        if scoring != "sigmoid" or method != "noaux_tc":
            raise NotImplementedError(
                f"DeepseekV3: scoring_func={scoring!r}, topk_method={method!r} are not "
                "supported (DeepSeek-V3 uses sigmoid and noaux_tc)"
            )
        if cfg.get("attention_bias"):
            raise NotImplementedError("DeepseekV3: attention_bias is not supported")

    @torch.no_grad()
    def update_expert_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """DeepSeek's auxiliary-loss-free balancing step (see ``Router``);
        every rank calls it after each optimizer step. One all-reduce of a
        [layers, experts] table of token counts over ``group`` (default:
        the world), each rank filling its own layers' rows: it sums every
        rank that routed other tokens through a layer (data, context and,
        under sequence parallelism, tensor-parallel ranks) and adds zeros
        from other pipeline stages. Ranks that routed the same tokens
        (tensor parallel without sequence parallelism) scale a layer's
        counts alike, which the sign rule does not see."""
        routers = [m for m in self.modules() if isinstance(m, Router)]
        cfg = self.config
        table = torch.zeros(cfg.num_hidden_layers + self.mtp_depth, cfg.n_routed_experts)
        for r in routers:
            table[r.layer_index] = r.pending_load.cpu()
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)
        for r in routers:
            if r.bias_update_rate:
                r.apply_load(table[r.layer_index])

    def make_rotary(self) -> Rotary:
        cfg = self.config
        inv, scaling = rope_frequencies(cfg.rope_parameters, cfg.qk_rope_head_dim)
        return Rotary(inv, scaling, interleave=bool(cfg.rope_interleave))

    def make_layer(self, index: int) -> nn.Module:
        return DeepseekV3DecoderLayer(self.config, index, self.layout, self.rotary)
