"""Mixture-of-experts with expert parallelism (see ``layer.py``)."""

from .layer import GroupedExperts, MoE, moe_layers, update_expert_bias
from .ops import Plan, combine, dispatch
from .router import TopKRouter

__all__ = [
    "GroupedExperts",
    "MoE",
    "Plan",
    "TopKRouter",
    "combine",
    "dispatch",
    "moe_layers",
    "update_expert_bias",
]
