"""One training step at a layout for the tests that hold a layout's step
against a reference: the trainer's own step (``dsparallel.train.step``)
with AdamW, as ``python -m dsparallel.train`` builds it."""

from __future__ import annotations

import torch

import dsparallel
from dsparallel.train.step import Step, make_step


def make_trainer(model, state, zero_stage: int, micro_batches: int, lr: float, **options) -> Step:
    """``model`` (built for ``init_parallel``'s ``state``) trained with AdamW
    by the trainer's step: our DDP over the data- and context-parallel
    ranks, ZeRO stage 1/2 sharding AdamW's state over them, 1F1B over
    ``micro_batches`` under a pipeline. A model already sharded by torch's
    FSDP2 (``fully_shard``) is trained as it is. ``options`` go to
    ``make_step``: another ``schedule=`` (the model built with its stages),
    or our DDP's ``overlap_param_gather=True``."""

    def make_optimizer(model, zero_group):
        params = [q for q in model.parameters() if q.requires_grad]
        if zero_group is None:
            return torch.optim.AdamW(params, lr=lr)
        return dsparallel.ZeroRedundancyOptimizer(
            params, torch.optim.AdamW, process_group=zero_group, lr=lr
        )

    return make_step(
        model, state, make_optimizer, zero_stage=zero_stage, micro_batches=micro_batches, **options
    )
