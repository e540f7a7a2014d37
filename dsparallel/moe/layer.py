"""The mixture-of-experts layer: router, routed experts split over an
expert-parallel group, shared experts computed locally.

    out = shared(x) + sum over the token's top_k experts e of gate_e * E_e(x)

Tokens reach their experts through ``moe_dispatch`` and come back through
``moe_combine`` (C++ ops over one uneven all-to-all each way). Expert ``e``
lives on group rank ``e // (num_experts / group size)``; the rows arrive in
blocks, by source rank and then by local expert, and a rank runs each block
through its expert where it lies (a loop over sources x its few experts,
never over tokens; no regrouping copy).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .ops import Plan, combine, dispatch, grouped_mlp
from .router import TopKRouter


class GroupedExperts(nn.Module):
    """``num_local`` two-layer GELU MLPs stored stacked ([L, hidden, ffn] and
    [L, ffn, hidden]), so every expert has a gradient (zero when it got no
    token) and the parameters are two tensors whatever L is.

    Global expert ``first + i`` is drawn from its own generator seeded with
    ``seed + first + i``: the experts are the same whichever rank holds them.
    """

    def __init__(self, num_local: int, first: int, hidden: int, ffn: int, seed: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_local, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(num_local, ffn, hidden))
        with torch.no_grad():
            for i in range(num_local):
                g = torch.Generator().manual_seed(seed + first + i)
                self.w1[i].normal_(0.0, 0.02, generator=g)
                self.w2[i].normal_(0.0, 0.02, generator=g)

    def forward(self, rows: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
        """``rows`` in blocks of ``chunks`` [(local expert, rows), ...]; every
        expert appears at least once (empty blocks too), so each gets a
        gradient."""
        return grouped_mlp(rows, self.w1, self.w2, chunks, "gelu")


class AddAuxLossGrad(torch.autograd.Function):
    """Identity on the output; in backward, also d(aux)/d(aux) = 1, so the
    auxiliary loss trains the router as if it had been added to the loss,
    without the user (or a pipeline stage) having to carry it."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


def _seed_from_rng() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


class MoE(nn.Module):
    """Routed experts spread evenly over ``group`` (the expert-parallel
    group: by default the one of ``init_parallel(expert_parallel_size=...)``,
    else none: every expert local), plus ``num_shared_experts`` shared
    experts (one MLP of ``num_shared_experts * ffn_hidden_size``) that every
    token passes through.

    ``capacity_factor=None`` (the default) drops nothing; a number caps each
    expert at ceil(tokens * top_k / num_experts * factor) of this rank's
    assignments, the earliest tokens first, and ``last_dropped`` says how
    many were dropped in the last forward. Keyword arguments after ``*`` go
    to the router (``score_function``, ``bias_update_rate``,
    ``aux_loss_coeff``).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        num_shared_experts: int = 0,
        group: dist.ProcessGroup | None = None,
        capacity_factor: float | None = None,
        score_function: str = "softmax",
        bias_update_rate: float = 1e-3,
        aux_loss_coeff: float = 0.0,
    ):
        super().__init__()
        if group is None:
            _refuse_experts_over_tp()
        self.group = group if group is not None else _default_group()
        size = dist.get_world_size(self.group) if self.group is not None else 1
        rank = dist.get_rank(self.group) if self.group is not None else 0
        self._check(hidden_size, ffn_hidden_size, num_experts, top_k, size)
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor must be positive, got {capacity_factor}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.num_local_experts = num_experts // size
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            score_function=score_function,
            bias_update_rate=bias_update_rate,
            aux_loss_coeff=aux_loss_coeff,
        )
        self.experts = GroupedExperts(
            self.num_local_experts,
            rank * self.num_local_experts,
            hidden_size,
            ffn_hidden_size,
            _seed_from_rng(),
        )
        for p in self.experts.parameters():
            # Read by our DDP (and ZeRO): expert parameters are reduced over
            # the ranks that hold the same experts, not the whole data-parallel
            # group.
            p._dsp_expert_group = self.group if size > 1 else None
        self.shared = None
        if num_shared_experts:
            width = num_shared_experts * ffn_hidden_size
            self.shared = nn.Sequential(
                nn.Linear(hidden_size, width, bias=False),
                nn.GELU(),
                nn.Linear(width, hidden_size, bias=False),
            )
        self.last_dropped = 0
        self.dropped_total = 0  # over training forwards
        self.aux_loss: torch.Tensor | None = None

    def _check(self, hidden, ffn, num_experts, top_k, size):
        mine = (hidden, ffn, num_experts, top_k)
        if self.group is not None and size > 1:
            everyone = [None] * size
            dist.all_gather_object(everyone, mine, group=self.group)
            names = ("hidden_size", "ffn_hidden_size", "num_experts", "top_k")
            for r, theirs in enumerate(everyone):
                for name, a, b in zip(names, everyone[0], theirs):
                    if a != b:
                        raise ValueError(
                            f"MoE: ranks of the expert-parallel group disagree: {name} is "
                            f"{b} on group rank {r} but {a} on group rank 0"
                        )
        if num_experts < 1 or num_experts % size:
            raise ValueError(
                f"MoE: num_experts ({num_experts}) must be a positive multiple of the "
                f"expert-parallel group size ({size})"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"MoE: top_k ({top_k}) must be between 1 and num_experts ({num_experts})"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)
        idx, gates, aux = self.router(x2)
        if self.capacity_factor is not None:
            idx = self._drop_over_capacity(idx)
        gates = gates.to(x.dtype)
        if self.group is not None:
            plan = Plan(idx, self.num_experts, self.group)
            y = self.experts(dispatch(x2, plan), plan.chunks())
            out = combine(y, gates, plan)
        else:
            out = self._local(x2, idx, gates)
        if self.shared is not None:
            out = out + self.shared(x2)
        self.aux_loss = aux.detach() if aux is not None else None
        if aux is not None and torch.is_grad_enabled():
            out = AddAuxLossGrad.apply(out, aux)
        return out.view(shape)

    def _local(self, x, idx, gates):
        """Every expert in this process: the same sort, no all-to-all."""
        flat = idx.flatten()
        kept = (flat >= 0).nonzero().squeeze(1)
        order = kept[flat[kept].argsort(stable=True)]
        counts = torch.bincount(flat[kept], minlength=self.num_experts).tolist()
        y = self.experts(x.index_select(0, order // self.top_k), list(enumerate(counts)))
        slots = x.new_zeros(flat.numel(), x.shape[1]).index_copy(0, order, y)
        return torch.bmm(gates.unsqueeze(1), slots.view(-1, self.top_k, x.shape[1])).squeeze(1)

    def _drop_over_capacity(self, idx: torch.Tensor) -> torch.Tensor:
        """Each expert keeps its first ``capacity`` assignments in token
        order; the rest become -1 (dropped: they add nothing to the output)."""
        tokens = idx.shape[0]
        capacity = math.ceil(tokens * self.top_k / self.num_experts * self.capacity_factor)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        dropped = position >= capacity
        self.last_dropped = int(dropped.sum())
        if self.training:
            self.dropped_total += self.last_dropped
        return flat.masked_fill(dropped, -1).view_as(idx)


def _refuse_experts_over_tp() -> None:
    from ..parallel_state import _state

    if _state is not None and _state.experts_over_tp and _state.tp_size > 1:
        raise NotImplementedError(
            "MoE: init_parallel(experts_over_tp=True) splits the experts over the "
            "tensor-parallel ranks, but this layer routes the tokens it is given, which every "
            "tp rank holds alike; dsparallel.models.DeepseekV3 supports that layout, this layer "
            "does not yet (leave experts_over_tp out, or pass group= explicitly)"
        )


def _default_group() -> dist.ProcessGroup | None:
    from ..parallel_state import _state

    return _state.ep_group if _state is not None else None


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Applies the auxiliary-loss-free balancing step to every MoE layer of
    ``model``: one all-reduce of their token counts over ``group`` (every
    rank that saw different tokens; by default the data-parallel group of
    ``init_parallel``, else the whole world), then each expert's bias moves by
    ``bias_update_rate`` towards the mean load. Call it after each optimizer
    step, on every rank of ``group``.

    A model that balances its own routers (``dsparallel.models.DeepseekV3``
    at any layout) does it itself: ``model.update_expert_bias(group)``.
    """
    if hasattr(model, "update_expert_bias"):
        return model.update_expert_bias(group)
    layers = [m for m in moe_layers(model) if m.router.bias_update_rate]
    if not layers:
        return
    loads = torch.stack([m.router.pending_load for m in layers])
    group = group if group is not None else _default_dp_group()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    for m, load in zip(layers, loads):
        m.router.apply_load(load)


def _default_dp_group() -> dist.ProcessGroup | None:
    from ..parallel_state import _state

    if _state is not None:
        return _state.dp_group
    return dist.group.WORLD if dist.is_initialized() else None
