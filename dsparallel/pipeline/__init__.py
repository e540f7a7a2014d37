"""Pipeline parallelism: the schedule as data (C++), and stages that run it.

The names follow ``torch.distributed.pipelining`` so that switching is an
import change::

    stage = PipelineStage(my_layers, stage_index=rank, num_stages=world)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    schedule.step(x)                                   # first stage
    schedule.step(target=y, losses=losses)             # last stage
"""

from .runtime import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from .schedule import Action, Schedule, get_schedule
from .split import split_linear
from .stage import PipelineStage
from .timeline import (
    bubble,
    bubble_breakdown,
    gather_trace,
    mean_costs,
    planned_trace,
    plot_schedule,
    replayed,
)

__all__ = [
    "Action",
    "PipelineStage",
    "Schedule",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "bubble",
    "bubble_breakdown",
    "gather_trace",
    "get_schedule",
    "mean_costs",
    "planned_trace",
    "plot_schedule",
    "replayed",
    "split_linear",
]
