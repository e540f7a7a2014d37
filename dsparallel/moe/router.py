"""The top-k router, with DeepSeek-V3's auxiliary-loss-free balancing.

Scores are ``softmax`` or ``sigmoid`` of the router logits (kept in float32).
The ``top_k`` experts of a token are chosen on ``score + expert_bias``; the
gates come from the scores alone (the bias steers selection, never the
output): softmax gates are the selected probabilities as they are (GShard,
Megatron's default), sigmoid gates are normalised over the selected experts
(DeepSeek-V3). ``update_expert_bias`` then moves each expert's bias by
``bias_update_rate`` towards the mean load (down when overloaded, up when
underloaded), from the counts of every data-parallel rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class TopKRouter(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_function: str = "softmax",
        bias_update_rate: float = 1e-3,
        aux_loss_coeff: float = 0.0,
    ):
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.score_function = score_function
        self.bias_update_rate = bias_update_rate
        self.aux_loss_coeff = aux_loss_coeff
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        # Persistent (a checkpoint keeps the balance reached); the same on
        # every rank, since every rank applies the same all-reduced counts.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        # Not buffers: DDP broadcasts buffers from rank 0, and these are this
        # rank's own counts (since the last bias update; since construction).
        self.pending_load = torch.zeros(num_experts, dtype=torch.float32)
        self.total_load = torch.zeros(num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor):
        """``x`` [tokens, hidden] -> (expert indices [tokens, top_k] int64,
        gates [tokens, top_k] float32, auxiliary loss or None)."""
        logits = F.linear(x.float(), self.weight.float())
        if self.score_function == "softmax":
            scores = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
        with torch.no_grad():
            choice = scores + self.expert_bias if self.bias_update_rate else scores
            idx = choice.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, idx)
        if self.score_function == "sigmoid":
            gates = gates / gates.sum(-1, keepdim=True)
        if self.training:
            load = torch.bincount(idx.flatten().cpu(), minlength=self.num_experts).float()
            self.pending_load += load
            self.total_load += load
        aux = self._aux_loss(scores, idx) if self.aux_loss_coeff else None
        return idx, gates, aux

    def _aux_loss(self, scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's balance loss over this call's tokens:
        alpha * sum_i f_i * P_i with f_i = E / (k T) * (tokens choosing i)
        and P_i the mean normalised score of expert i."""
        t, e, k = scores.shape[0], self.num_experts, self.top_k
        chosen = torch.zeros_like(scores).scatter_(1, idx, 1.0).sum(0)
        f = chosen * (e / (k * max(t, 1)))
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        return self.aux_loss_coeff * (f * p).sum()

    @torch.no_grad()
    def apply_load(self, load: torch.Tensor) -> None:
        """The sign rule on the load summed over all data-parallel ranks."""
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.pending_load.zero_()
