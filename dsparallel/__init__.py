"""dsparallel: data, tensor and pipeline parallel training for PyTorch.

Importing the package registers the torch.distributed backend ``"dsp"``.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from ._loader import load_extension
from ._version import __version__  # noqa: F401  (the package version)

load_extension()  # before any module that imports _C: a clear error on a torch mismatch

from . import backend, comm_hooks, context_parallel, moe, tensor_parallel
from .backend import use_as_default
from .checkpoint import checkpoint
from .ddp import DDP, DistributedDataParallel
from .mixed_precision import MixedPrecision
from .ops import fused_all_reduce
from .parallel_state import ParallelState, destroy_parallel, get_parallel_state, init_parallel
from .training_checkpoint import load_checkpoint, save_checkpoint
from .zero import ZeroRedundancyOptimizer

backend.register()

__all__ = [
    "DDP",
    "DistributedDataParallel",
    "ParallelState",
    "backend",
    "checkpoint",
    "comm_hooks",
    "context_parallel",
    "destroy_parallel",
    "fused_all_reduce",
    "get_parallel_state",
    "init_parallel",
    "load_checkpoint",
    "MixedPrecision",
    "moe",
    "save_checkpoint",
    "tensor_parallel",
    "use_as_default",
    "ZeroRedundancyOptimizer",
]
