"""Data-parallel training on the CPU over the "dsp" backend.

    torchrun --nproc-per-node 2 examples/ddp_simple.py

A small MLP learns a fixed random teacher network (the data is generated
here, nothing is downloaded). Each rank trains on its own shard of every
batch; dsparallel.DistributedDataParallel averages the gradients in fused
buckets overlapped with backward (``--ddp torch`` uses torch's DDP instead,
``--backend gloo`` the gloo backend). Rank 0 prints the loss; at the end
every rank checks that its parameters equal rank 0's.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.parallel

import dsparallel  # registers the "dsp" backend


def make_model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(32, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 8),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="dsp")
    parser.add_argument("--ddp", choices=["dsparallel", "torch"], default="dsparallel")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {world} ranks")
    torch.set_num_threads(1)

    torch.manual_seed(0)  # same teacher and same initial student everywhere
    teacher = make_model(64).requires_grad_(False)
    wrapper = (
        dsparallel.DistributedDataParallel
        if args.ddp == "dsparallel"
        else torch.nn.parallel.DistributedDataParallel
    )
    model = wrapper(make_model(args.width))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    data_gen = torch.Generator().manual_seed(1)  # same global batch on every rank
    local = args.batch_size // world
    first = last = None
    start = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 32, generator=data_gen)
        x_local = x[rank * local : (rank + 1) * local]
        loss = torch.nn.functional.mse_loss(model(x_local), teacher(x_local))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # the global loss, averaged over ranks (for the log only)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        first = global_loss.item() if first is None else first
        last = global_loss.item()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.5f}", flush=True)
    elapsed = time.perf_counter() - start

    # Data parallelism keeps the replicas identical: check it.
    for p in model.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, 0)
        if not torch.equal(ref, p.detach()):
            raise RuntimeError(f"rank {rank}: parameters diverged from rank 0")
    if rank == 0:
        print(
            f"done: {args.ddp} DDP, {world} ranks over '{args.backend}', {args.steps} steps in "
            f"{elapsed:.1f}s ({args.steps * args.batch_size / elapsed:.0f} samples/s), "
            f"loss {first:.4f} -> {last:.4f}; replicas identical"
        )
        if not last < 0.5 * first:
            raise RuntimeError("loss did not fall by half: training is broken")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
