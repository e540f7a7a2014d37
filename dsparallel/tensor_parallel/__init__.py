"""Tensor (model) parallelism, Megatron-LM style.

Each layer is the math of its plain counterpart with its weights split across
the ranks of a tensor-parallel group (``group=None``: the ``init_parallel``
tensor-parallel group, else the world). The region maps are C++ autograd ops in
``torch.ops.dsparallel``; with a group of one every layer is its plain
counterpart and launches no collective.
"""

from .attention import ParallelAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding, vocab_range
from .linear import ColumnParallelLinear, RowParallelLinear
from .mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .mlp import ParallelMLP
from .random import RNGStatesTracker, get_rng_tracker, manual_seed

__all__ = [
    "ColumnParallelLinear",
    "ParallelAttention",
    "ParallelMLP",
    "RNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "get_rng_tracker",
    "manual_seed",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]
