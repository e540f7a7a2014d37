"""One training step of a ``CausalLM`` at its layout: its gradients
averaged over the data- and context-parallel ranks by our DDP (ZeRO-2:
reduce-scattered) or torch's FSDP2, a pipeline schedule over the
micro-batches under pipeline parallelism, the loss the mean over every
label of the global batch however the ranks and micro-batches divide it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..moe import update_expert_bias

# Per schedule: its class, where it wants the stages ("loop": rank r holds
# r, r + p, ...; "v": r and 2p - 1 - r) and how many per rank by default.
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "1f1b": ("Schedule1F1B", "loop", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop", 2),
    "zb1p": ("ScheduleInterleavedZeroBubble", "loop", 1),
    "zbv": ("ScheduleZBVZeroBubble", "v", 2),
    "dualpipev": ("ScheduleDualPipeV", "v", 2),
}


def stage_layout(schedule: str, stages_per_rank: int = 0) -> tuple[int, str]:
    """(stages per rank, placement) of a schedule, for the model's
    ``stages_per_rank`` and ``stage_placement``; ``stages_per_rank`` 0 takes
    the schedule's own (two for interleaved 1F1B, ZBV and DualPipeV)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"[parallel] schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    _, placement, default = SCHEDULES[schedule]
    per_rank = stages_per_rank or default
    fixed = {"gpipe": 1, "1f1b": 1, "zbv": 2, "dualpipev": 2}.get(schedule)
    if fixed is not None and per_rank != fixed:
        raise ValueError(
            f"[parallel] stages_per_rank: {schedule} runs {fixed} stage(s) per rank, not "
            f"{per_rank} (interleaved_1f1b and zb1p take any number)"
        )
    return per_rank, placement


@dataclass
class Step:
    """``backward(rows)`` runs forward and backward of this data-parallel
    rank's ``rows`` and returns the losses this rank computed (none on a
    pipeline's other stages); ``step(rows)`` adds the tied embeddings'
    reduction and the optimizer's step."""

    model: object
    opt: object
    ddps: list = field(default_factory=list)  # our DDP wrappers (one, or none)
    schedule: object = None  # the pipeline's, or None
    runner: object = None  # what runs forward without a pipeline

    def backward(self, rows: torch.Tensor) -> list[torch.Tensor]:
        losses = []
        if self.schedule is None:
            # The mean over every label of the global batch, however the
            # data-parallel ranks' rows divide them (the schedule counts them itself).
            n = self.model.count_items([rows])
            loss = self.runner(rows, labels=rows, num_items_in_batch=n).loss
            loss.backward()
            losses.append(loss.detach())
        elif self.model.is_first:
            self.schedule.step(rows, target=rows if self.model.is_last else None, losses=losses)
        else:
            self.schedule.step(target=rows, losses=losses)
        return losses

    def step(self, rows: torch.Tensor) -> list[torch.Tensor]:
        losses = self.backward(rows)
        self.model.allreduce_tied_grads()
        self.opt.step()
        self.opt.zero_grad()
        update_expert_bias(self.model)
        return losses


def fully_shard_model(model, state) -> None:
    """torch's FSDP2 over the data-parallel ranks: each layer, then the rest."""
    from torch.distributed.fsdp import fully_shard

    if state.pp_size > 1 or state.cp_size > 1:
        raise ValueError(
            "[parallel] fsdp: FSDP2 shards over the data-parallel ranks of a model without "
            "pipeline or context parallelism here; under those use zero_stage = 2"
        )
    mesh = state.mesh["dp"]
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def pipeline_schedule(name: str, stages: list, micro_batches: int, loss_fn):
    """The schedule ``name`` over this rank's ``stages`` (as the model
    built them for ``stage_layout(name)``)."""
    from .. import pipeline

    stage_layout(name)  # names the schedules when the name is none of them
    cls = getattr(pipeline, SCHEDULES[name][0])
    if name in ("gpipe", "1f1b"):
        (stages,) = stages
    return cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn)


def make_step(
    model,
    state,
    make_optimizer,
    zero_stage: int = 0,
    fsdp: bool = False,
    schedule: str = "1f1b",
    micro_batches: int = 1,
    **ddp_options,
) -> Step:
    """``model`` (built for ``init_parallel``'s ``state``) trained by the
    optimizer ``make_optimizer(params_or_groups_of(model), zero)`` returns
    (``zero``: the process group to shard it over, or None): our DDP
    over the data x context-parallel ranks (``zero_stage`` 2:
    gradients reduce-scattered), or FSDP2 with ``fsdp`` (a model the
    caller already sharded with ``fully_shard`` is trained as it is), and
    under a pipeline ``schedule`` over ``micro_batches`` (the model built
    with the stages ``stage_layout(schedule)`` gives). ``ddp_options``
    go to our DDP (``overlap_param_gather=True``)."""
    from .. import DistributedDataParallel

    replicas = state.dp_cp_group  # the ranks holding the same parameters
    ddps = []

    def wrap(module):
        ddps.append(
            DistributedDataParallel(
                module,
                process_group=replicas,
                zero_stage=2 if zero_stage == 2 else 0,
                **ddp_options,
            )
        )
        return ddps[-1]

    if fsdp:
        if zero_stage:
            raise ValueError("[parallel] fsdp shards the optimizer itself: leave zero_stage 0")
        fully_shard_model(model, state)
    sharded = fsdp or hasattr(model, "unshard")  # FSDP2's, on a sharded model
    wrapped = not sharded and (replicas.size() > 1 or zero_stage == 2)
    pipe = runner = None
    if state.pp_size > 1:
        stages = model.pipeline_stages(wrap=wrap if wrapped else None)
        pipe = pipeline_schedule(schedule, stages, micro_batches, model.loss_fn)
        for m in model.modules():  # a balance loss per micro-batch: 1/M of the step's
            if hasattr(m, "balance_loss_share"):
                m.balance_loss_share = 1.0 / micro_batches
    else:
        runner = wrap(model) if wrapped else model
    opt = make_optimizer(model, replicas if zero_stage else None)
    return Step(model, opt, ddps, pipe, runner)
