"""Typed wrappers over the C++ dispatch, combine and grouped-expert ops
(``csrc/ops/moe_dispatch.cpp``, ``csrc/ops/grouped_mlp.cpp``) and their
fake kernels."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _C  # noqa: F401  (registers the ops)
from ..ops import group_size

_ops = torch.ops.dsparallel


@torch.library.register_fake("dsparallel::moe_plan")
def _plan_fake(expert_idx, num_experts, group_name):
    n = group_size(group_name)
    kept = torch.library.get_ctx().new_dynamic_size()
    counts = torch.empty(n, num_experts // n, dtype=torch.long)
    return expert_idx.new_empty(kept, dtype=torch.long), counts, counts.clone()


@torch.library.register_fake("dsparallel::moe_dispatch")
def _dispatch_fake(x, order, send_counts, recv_counts, top_k, group_name):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size(), x.shape[1])


@torch.library.register_fake("dsparallel::_moe_dispatch_backward")
def _dispatch_backward_fake(grad, order, send_counts, recv_counts, top_k, num_tokens, group_name):
    return grad.new_empty(num_tokens, grad.shape[1])


@torch.library.register_fake("dsparallel::moe_combine")
def _combine_fake(y, weights, order, send_counts, recv_counts, group_name):
    return y.new_empty(weights.shape[0], y.shape[1])


@torch.library.register_fake("dsparallel::_moe_combine_forward")
def _combine_forward_fake(y, weights, order, send_counts, recv_counts, group_name):
    return y.new_empty(weights.shape[0], y.shape[1]), y.new_empty(order.shape[0], y.shape[1])


@torch.library.register_fake("dsparallel::_moe_combine_backward")
def _combine_backward_fake(grad, back, weights, order, send_counts, recv_counts, num_rows, g):
    return grad.new_empty(num_rows, grad.shape[1]), weights.new_empty(weights.shape)


@torch.library.register_fake("dsparallel::grouped_mlp")
def _grouped_mlp_fake(x, w1, w2, experts, rows, activation, transposed=False):
    return x.new_empty(x.shape)


@torch.library.register_fake("dsparallel::_grouped_mlp_forward")
def _grouped_mlp_forward_fake(x, w1, w2, experts, rows, activation, transposed):
    width = w1.shape[1] if transposed else w1.shape[2]
    return x.new_empty(x.shape), x.new_empty(x.shape[0], width)


@torch.library.register_fake("dsparallel::_grouped_mlp_backward")
def _grouped_mlp_backward_fake(grad, x, w1, w2, h, experts, rows, activation, transposed):
    return x.new_empty(x.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape)


def grouped_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    chunks: list[tuple[int, int]],
    activation: str,
    transposed: bool = False,
) -> torch.Tensor:
    """``x``'s blocks of ``chunks`` [(local expert, rows), ...] each through
    its expert, ``act(block @ w1[e]) @ w2[e]``, in one C++ op:
    ``activation`` "gelu" or "swiglu" (w1's columns: gate, then up);
    ``transposed`` weights are stored as ``nn.Linear`` holds them
    ([experts, out, in])."""
    experts = [e for e, _ in chunks]
    rows = [n for _, n in chunks]
    return _ops.grouped_mlp(x, w1, w2, experts, rows, activation, transposed)


class Plan:
    """Where this rank's (token, slot) assignments go: ``order`` (the
    assignments sorted by expert, dropped ones left out), ``send_counts``
    [group, local experts] and ``recv_counts`` [group, local experts]."""

    def __init__(self, expert_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup):
        self.group_name = group.group_name
        self.top_k = expert_idx.shape[1]
        self.order, self.send_counts, self.recv_counts = _ops.moe_plan(
            expert_idx, num_experts, self.group_name
        )

    def chunks(self) -> list[tuple[int, int]]:
        """(local expert, rows) of each block of the dispatched rows, in
        order: by source rank, then by local expert."""
        return [(e, n) for row in self.recv_counts.tolist() for e, n in enumerate(row)]


def dispatch(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Each assignment's token row on its expert's rank, in ``plan.chunks()``
    blocks (by source rank, then local expert)."""
    return _ops.moe_dispatch(
        x, plan.order, plan.send_counts, plan.recv_counts, plan.top_k, plan.group_name
    )


def combine(y: torch.Tensor, weights: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The expert outputs back on their tokens' ranks, summed per token with
    ``weights`` [tokens, top_k]."""
    return _ops.moe_combine(
        y, weights, plan.order, plan.send_counts, plan.recv_counts, plan.group_name
    )
