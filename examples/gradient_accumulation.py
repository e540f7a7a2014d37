"""Gradient accumulation with dsparallel's DDP: k micro-batches per step.

    torchrun --nproc-per-node 2 examples/gradient_accumulation.py --micro-batches 4

The first k-1 micro-batches run under ``ddp.no_sync()``: their gradients
accumulate locally and no communication happens. The k-th backward reduces
the accumulated sum once, so a step costs one all-reduce however large the
effective batch. Each micro-batch's loss is divided by k, which makes the
step equal to one step on the k-times larger batch (the tests check this).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist

import dsparallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--backend", default="dsp")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    teacher = torch.nn.Linear(32, 4).requires_grad_(False)
    model = dsparallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 4))
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    k = args.micro_batches
    first = last = None
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for i in range(k):
            x = torch.randn(args.micro_batch_size, 32, generator=gen)
            sync = i == k - 1  # only the last micro-batch's backward communicates
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(x), teacher(x)) / k
                loss.backward()
            step_loss += loss.item()
        opt.step()
        t = torch.tensor([step_loss])
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        first = t.item() if first is None else first
        last = t.item()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.5f}", flush=True)
    if rank == 0:
        print(
            f"done: {world} ranks x {k} micro-batches of {args.micro_batch_size} per step, "
            f"loss {first:.4f} -> {last:.4f}"
        )
        if not last < 0.5 * first:
            raise RuntimeError("loss did not fall by half: training is broken")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
