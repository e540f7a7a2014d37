"""PipelineStage: one stage's module and its place in the pipeline."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, computed by ``submodule``.

    Stage ``s`` runs on rank ``s % group_size`` of ``group`` (default: the
    world), so with one stage per rank, stage ``s`` is rank ``s``; V-shaped
    schedules (``ScheduleZBVZeroBubble``) put stages ``r`` and
    ``2 group_size - 1 - r`` on rank ``r`` instead. With
    ``checkpoint=True`` the stage keeps only its inputs during forward and
    recomputes its activations in backward.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device=None,
        group=None,
        checkpoint: bool = False,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is not in [0, {num_stages})")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group if group is not None else dist.group.WORLD
        self.group_size = dist.get_world_size(self.group)
        self.group_rank = dist.get_rank(self.group)
        if self.group_rank < 0:
            raise ValueError("this rank is not in the pipeline's group")
        looped = stage_index % self.group_size
        v = 2 * self.group_size - 1 - stage_index if num_stages == 2 * self.group_size else None
        if self.group_rank not in (looped, v):
            raise ValueError(
                f"stage {stage_index} belongs to group rank {looped}"
                + (f" (or {v} in a V)" if v is not None and v != looped else "")
                + f", not to this rank ({self.group_rank})"
            )
        self.device = torch.device(device) if device is not None else None
        self.checkpoint = checkpoint
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
