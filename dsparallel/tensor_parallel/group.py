"""Which process group a tensor-parallel layer or map runs over, and the
checks and construction helper the layers share.

``group=None`` means the tensor-parallel group of ``dsparallel.init_parallel``
when it has been called, otherwise the default (world) group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

_default_group: dist.ProcessGroup | None = None


def set_default_group(group: dist.ProcessGroup | None) -> None:
    """Makes ``group`` what ``group=None`` means (set by ``init_parallel``)."""
    global _default_group
    _default_group = group


def resolve_group(group: dist.ProcessGroup | None, what: str) -> dist.ProcessGroup:
    if group is None:
        group = _default_group if _default_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError(
                f"{what}: no process group; call torch.distributed.init_process_group "
                "(or dsparallel.init_parallel) first, or pass group="
            )
    if group is dist.GroupMember.NON_GROUP_MEMBER or group.rank() < 0:
        raise ValueError(
            f"{what}: this process (global rank {dist.get_rank()}) is not a member of "
            "the given tensor-parallel group"
        )
    return group


def check_divisible(what: str, name: str, value: int, size: int) -> None:
    if value % size != 0:
        raise ValueError(
            f"{what}: {name}={value} is not divisible by the tensor-parallel group size {size}"
        )


def set_up_from(cls, *setup_args):
    """An instance of the layer ``cls`` made by ``cls._setup(*setup_args)``
    instead of ``__init__`` (which would initialise fresh weights): the
    ``from_*`` constructors slice an existing module's weights."""
    self = cls.__new__(cls)
    nn.Module.__init__(self)
    self._setup(*setup_args)
    return self
