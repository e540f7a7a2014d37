"""Pipeline parallelism: a small MLP cut into one stage per rank, trained with 1F1B.

    torchrun --nproc-per-node 2 examples/pipeline.py --micro-batches 8

Rank 0 feeds the batch, the last rank computes the loss; activations flow
forward and gradients backward between ranks. At the end rank 0 writes the
measured timeline of the last step under its plan (``--timeline``, a PNG)
and prints the measured bubble next to the schedule's planned one.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import dsparallel  # noqa: F401  (registers "dsp")
import dsparallel.pipeline as pp


def make_stage(index: int, width: int, layers_per_stage: int) -> nn.Module:
    torch.manual_seed(index)  # each stage its own initial weights
    return nn.Sequential(
        *[m for _ in range(layers_per_stage) for m in (nn.Linear(width, width), nn.GELU())]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers-per-stage", type=int, default=1)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--checkpoint", action="store_true", help="recompute activations")
    parser.add_argument("--timeline", default="pipeline_timeline.png")
    parser.add_argument("--backend", default="dsp")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    stage = pp.PipelineStage(
        make_stage(rank, args.width, args.layers_per_stage), rank, world, checkpoint=args.checkpoint
    )
    cls = pp.Schedule1F1B if args.schedule == "1f1b" else pp.ScheduleGPipe
    schedule = cls(stage, args.micro_batches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.Adam(stage.submod.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(0)  # every rank draws the same batches
    teacher = nn.Linear(args.width, args.width).requires_grad_(False)
    first = last = None
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.width, generator=gen)
        y = teacher(x)
        losses = []
        opt.zero_grad(set_to_none=True)
        if stage.is_first:
            schedule.step(x)
        elif stage.is_last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        if stage.is_last:
            loss = torch.stack(losses).mean().item()
            first = loss if first is None else first
            last = loss
            if step % 20 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {loss:.5f}", flush=True)

    trace = pp.gather_trace(schedule)
    if stage.is_last:
        print(
            f"done: {world} stages, {args.schedule}, {args.micro_batches} micro-batches, "
            f"loss {first:.4f} -> {last:.4f}"
        )
        if not last < 0.5 * first:
            raise RuntimeError("loss did not fall by half: training is broken")
    if rank == 0:
        unit = schedule.plan.validate().bubble
        timed = schedule.plan.validate(costs=pp.mean_costs(trace, world)).bubble
        print(
            f"bubble: measured {pp.bubble(trace):.1%}, planned {timed:.1%} with the measured "
            f"mean F and B of each stage ({unit:.1%} with equal ones)"
        )
        pp.plot_schedule(schedule.plan, args.timeline, measured=trace)
        print(f"timeline written to {args.timeline}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
