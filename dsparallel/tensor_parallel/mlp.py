"""The transformer MLP: column-parallel up-projection, activation, row-parallel
down-projection; one all-reduce forward, one backward."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .group import check_divisible, resolve_group, set_up_from
from .linear import ColumnParallelLinear, RowParallelLinear

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(activation) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(activation):
        return activation
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"ParallelMLP: unknown activation {activation!r}; one of "
            f"{sorted(_ACTIVATIONS)} or a callable"
        )
    return _ACTIVATIONS[activation]


class ParallelMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        group: dist.ProcessGroup | None = None,
        bias: bool = True,
        activation="gelu",
        device=None,
        dtype=None,
    ):
        super().__init__()
        g = resolve_group(group, "ParallelMLP")
        check_divisible("ParallelMLP", "ffn_hidden_size", ffn_hidden_size, g.size())
        fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias, device=device, dtype=dtype)
        fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias, device=device, dtype=dtype)
        self._setup(fc1, fc2, g, activation)

    @classmethod
    def from_linears(cls, fc1: nn.Linear, fc2: nn.Linear, group=None, activation="gelu"):
        g = resolve_group(group, "ParallelMLP.from_linears")
        if fc1.out_features != fc2.in_features or fc1.in_features != fc2.out_features:
            raise ValueError(
                f"ParallelMLP.from_linears: fc1 is {fc1.in_features}->{fc1.out_features} but fc2 "
                f"is {fc2.in_features}->{fc2.out_features}"
            )
        check_divisible("ParallelMLP.from_linears", "ffn_hidden_size", fc1.out_features, g.size())
        return set_up_from(cls, fc1, fc2, g, activation)

    def _setup(self, fc1, fc2, group, activation) -> None:
        self.activation = _activation(activation)
        self.fc1 = ColumnParallelLinear.from_linear(fc1, group=group)
        self.fc2 = RowParallelLinear.from_linear(fc2, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))
