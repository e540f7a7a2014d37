"""The gradient norm of the whole model, whatever its layout, and clipping
by it: equal to ``torch.nn.utils.clip_grad_norm_`` over the same model in
one process.

Every rank adds up the part of the norm it holds, with each element of a
checkpoint tensor counted once over the world, and one all-reduce over the
world gives the total:

* pipeline stages and expert-parallel ranks hold different tensors: each
  counts in full; the tied LM head, a copy of the first stage's embedding
  (its gradient summed into both by ``allreduce_tied_grads``), not at all;
* a tensor-parallel rank's blocks of checkpoint tensors are its own, or
  replicated over the tensor-parallel group (norms, key/value heads shared
  for grouped-query attention): a block held by k ranks counts 1/k on each
  (read from the model's ``checkpoint_map``, element by element where one
  parameter mixes both, as a fused QKV does);
* data (and context) parallel replicas hold the same averaged gradient:
  1/replicas each; under ZeRO each rank holds its own slices (the
  optimizer's ``owned_grads``), and under FSDP2 its own shard: in full.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..zero import ZeroRedundancyOptimizer
from .hf_map import pieces_of, split

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
_EPS = 1e-6


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0, optimizer=None):
    """Scales every gradient of ``model`` by ``max_norm / total`` where the
    whole model's norm ``total`` exceeds it; returns ``total``. Every rank
    calls it, after ``allreduce_tied_grads`` and before the step;
    ``optimizer``: the ``ZeroRedundancyOptimizer`` that holds the
    gradient shards (ZeRO 1/2), else None."""
    norm_type = float(norm_type)
    inf = norm_type == float("inf")
    weights = _weights(model)
    zero = isinstance(optimizer, ZeroRedundancyOptimizer)
    held = optimizer.owned_grads() if zero else {}
    # What ZeRO shards: counted from the owners' slices only (under stage 1
    # every rank still holds the whole .grad, which must not count again).
    sharded = {id(p) for g in optimizer.param_groups for p in g["params"]} if zero else set()
    # Whole tensors of one weight go through torch's per-tensor norm kernel
    # (as torch.nn.utils.clip_grad_norm_ computes them), one call per
    # weight; tensors whose blocks weigh differently, element by element.
    uniform: dict[float, list[torch.Tensor]] = {}
    weighted: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad or name in model._copies:
            continue
        w = weights[name]
        if id(p) in held:  # ZeRO: this rank's slices, (a, b) of the flat parameter
            parts = [(g, _slice(w, a, b)) for (a, b), g in held[id(p)]]
        elif id(p) in sharded or p.grad is None:  # other ranks' slices, or no gradient
            continue
        elif hasattr(p.grad, "to_local"):  # FSDP2: this rank's shard
            parts = [(p.grad.to_local(), w)]
        else:
            parts = [(p.grad, w / _replicas(model, p))]
        for g, scale in parts:
            if g.numel() == 0:
                continue
            if isinstance(scale, float):
                uniform.setdefault(scale, []).append(g.detach())
            else:
                weighted.append((g.detach(), scale))
    acc = torch.zeros((), dtype=torch.float64)
    for scale, grads in uniform.items():
        norms = torch.stack(torch._foreach_norm(grads, norm_type)).double()
        if inf:
            acc = torch.maximum(acc, norms.max())
        else:
            acc += norms.pow(norm_type).sum() * scale
    for g, scale in weighted:
        g = g.double().abs().reshape(-1)
        if inf:
            acc = torch.maximum(acc, g.max())
        else:
            acc += (g.pow(norm_type) * scale.reshape(-1)).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    total = acc if inf else acc.pow(1.0 / norm_type)
    coef = max_norm / (float(total) + _EPS)
    if coef < 1:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
        if zero:
            optimizer.scale_grad_shards_(coef)
    # In the gradients' dtype, as torch's (float32 under mixed precision).
    return total.to(next(p.dtype for p in model.parameters() if p.is_floating_point()))


def _weights(model) -> dict:
    """Per parameter name: 1 / (tensor-parallel ranks holding the same
    elements), a float, or a tensor of the parameter's shape where its
    blocks differ. Gathered once over the tensor-parallel group."""
    cached = getattr(model, "_grad_norm_weights", None)
    if cached is not None:
        return cached
    lay = model.layout
    nodes = model.checkpoint_map()
    # A tied copy is not counted (nor is it a second holder of the embedding's blocks).
    mine = {
        name: [(q.key, q.dim, q.start, q.length) for q in pieces_of(nodes[name])]
        for name, _ in model.named_parameters()
        if name not in model._copies
    }
    every = [mine]
    if lay.tp_size > 1:
        every = [None] * lay.tp_size
        dist.all_gather_object(every, mine, group=lay.tp_group)
    held = {}
    for theirs in every:
        for blocks in theirs.values():
            for block in blocks:
                held[block] = held.get(block, 0) + 1
    weights = {}
    for name, p in model.named_parameters():
        if name not in mine:
            continue
        counts = [held[block] for block in mine[name]]
        if len(set(counts)) <= 1:  # none: padding only, whose gradient is zero
            weights[name] = 1.0 / counts[0] if counts else 1.0
            continue
        w = torch.zeros(p.shape, dtype=torch.float64)  # padded rows: no block
        for (_, block), count in zip(split(nodes[name], w), counts):
            block.fill_(1.0 / count)
        weights[name] = w
    model._grad_norm_weights = weights
    return weights


def _slice(w, a: int, b: int):
    return w if isinstance(w, float) else w.reshape(-1)[a:b]


def _replicas(model, p: torch.Tensor) -> int:
    """The data-parallel ranks holding the same whole gradient of ``p``."""
    if model.layout.mesh is None:
        return 1
    from ..parallel_state import get_parallel_state

    state = get_parallel_state()
    expert = getattr(p, "_dsp_expert_group", None) is not None
    group = state.expert_dp_group if expert else state.dp_cp_group
    return dist.get_world_size(group)
