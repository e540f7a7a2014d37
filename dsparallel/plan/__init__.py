"""The split planner: which layout for this model on these devices.

- ``model.read_model`` / ``rank_tensors``: what each rank of a layout holds,
  from the config alone;
- ``memory.model_state``: parameter, gradient and optimizer bytes per rank,
  exact for dsparallel's DDP, ZeRO 1/2 and AdamW;
- ``measure.held``: the same bytes counted on a live job.
"""

from .cluster import PRESETS, Cluster, read_cluster
from .estimate import Estimate, estimate
from .layout import Layout
from .measure import held
from .memory import ModelState, model_state
from .model import Model, read_model

__all__ = [
    "PRESETS",
    "Cluster",
    "Estimate",
    "Layout",
    "Model",
    "ModelState",
    "estimate",
    "held",
    "model_state",
    "read_cluster",
    "read_model",
]
