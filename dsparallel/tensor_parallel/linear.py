"""Column- and row-parallel linear layers (Megatron-LM's split of ``nn.Linear``).

Both initialise by building the plain ``nn.Linear`` under the caller's RNG and
keeping this rank's slice, so a seeded parallel layer equals the matching slice
of the same seeded plain layer (no fan-in is computed on a shard). With a group
of one they are ``F.linear`` and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .group import check_divisible, resolve_group, set_up_from
from .mappings import _ops


def _check_last_dim(what: str, x: torch.Tensor, expected: int) -> None:
    if x.dim() == 0 or x.shape[-1] != expected:
        got = x.shape[-1] if x.dim() else "a scalar"
        raise ValueError(f"{what}: input has last dimension {got}, expected {expected}")


def _full_linear(in_features, out_features, bias, init_method, device, dtype) -> nn.Linear:
    full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
    if init_method is not None:
        with torch.no_grad():
            init_method(full.weight)
            if full.bias is not None:
                full.bias.zero_()
    return full


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by rows (output features) across the group.

    The input is replicated (or, with ``sequence_parallel``, split along dim 0
    and all-gathered here). The output stays split along its last dim unless
    ``gather_output``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        init_method: Callable[[torch.Tensor], None] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        g = resolve_group(group, "ColumnParallelLinear")
        check_divisible("ColumnParallelLinear", "out_features", out_features, g.size())
        full = _full_linear(in_features, out_features, bias, init_method, device, dtype)
        self._setup(full.weight, full.bias, g, gather_output, sequence_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, gather_output: bool = False):
        """This rank's slice of ``linear`` (its output features)."""
        g = resolve_group(group, "ColumnParallelLinear.from_linear")
        check_divisible(
            "ColumnParallelLinear.from_linear", "out_features", linear.out_features, g.size()
        )
        return cls._from_full(linear.weight, linear.bias, g, gather_output)

    @classmethod
    def _from_full(cls, weight, bias, group, gather_output: bool = False):
        return set_up_from(cls, weight, bias, group, gather_output, False)

    def _setup(self, weight, bias, group, gather_output, sequence_parallel):
        if gather_output and sequence_parallel:
            raise ValueError(
                "ColumnParallelLinear: gather_output and sequence_parallel exclude each other"
            )
        self.group = group
        self.tp_size, self.tp_rank = group.size(), group.rank()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.out_features_per_partition = self.out_features // self.tp_size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        rows = slice(
            self.tp_rank * self.out_features_per_partition,
            (self.tp_rank + 1) * self.out_features_per_partition,
        )
        self.weight = nn.Parameter(weight.detach()[rows].clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim("ColumnParallelLinear", x, self.in_features)
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        name = self.group.group_name
        if self.sequence_parallel:
            x = _ops.gather_from_sequence_parallel_region(x, name)
        else:
            x = _ops.copy_to_tensor_parallel_region(x, name)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = _ops.gather_from_tensor_parallel_region(y, name)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features_per_partition} on this rank), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by columns (input features) across the group.

    The input is split along its last dim (``input_is_parallel``, e.g. the
    output of a ``ColumnParallelLinear``) or split here. Partial products are
    all-reduced (or, with ``sequence_parallel``, reduce-scattered along dim 0)
    and the bias, held whole on every rank, is added once after.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        init_method: Callable[[torch.Tensor], None] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        g = resolve_group(group, "RowParallelLinear")
        check_divisible("RowParallelLinear", "in_features", in_features, g.size())
        full = _full_linear(in_features, out_features, bias, init_method, device, dtype)
        self._setup(full.weight, full.bias, g, input_is_parallel, sequence_parallel)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True):
        """This rank's slice of ``linear`` (its input features); the bias whole."""
        g = resolve_group(group, "RowParallelLinear.from_linear")
        check_divisible(
            "RowParallelLinear.from_linear", "in_features", linear.in_features, g.size()
        )
        return set_up_from(cls, linear.weight, linear.bias, g, input_is_parallel, False)

    def _setup(self, weight, bias, group, input_is_parallel, sequence_parallel):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.group = group
        self.tp_size, self.tp_rank = group.size(), group.rank()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.in_features_per_partition = self.in_features // self.tp_size
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        cols = slice(
            self.tp_rank * self.in_features_per_partition,
            (self.tp_rank + 1) * self.in_features_per_partition,
        )
        self.weight = nn.Parameter(weight.detach()[:, cols].clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            _check_last_dim("RowParallelLinear", x, self.in_features)
            return F.linear(x, self.weight, self.bias)
        name = self.group.group_name
        if self.input_is_parallel:
            _check_last_dim("RowParallelLinear", x, self.in_features_per_partition)
        else:
            _check_last_dim("RowParallelLinear", x, self.in_features)
            x = _ops.scatter_to_tensor_parallel_region(x, name)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = _ops.reduce_scatter_to_sequence_parallel_region(y, name)
        else:
            y = _ops.reduce_from_tensor_parallel_region(y, name)
        if self.bias is not None:
            # Under sequence parallelism each rank sees only its tokens, so the
            # bias gradient is partial: the copy map all-reduces it.
            b = (
                _ops.copy_to_tensor_parallel_region(self.bias, name)
                if self.sequence_parallel
                else self.bias
            )
            y = y + b
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features_per_partition} on this rank), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
