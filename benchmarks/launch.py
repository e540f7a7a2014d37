"""Starts one process per rank for a benchmark and returns rank 0's result.

Each rank gets the torch.distributed environment (a free local port) and
OMP_NUM_THREADS=1, runs ``fn(rank, world, *args)``, and rank 0's return value
comes back to the caller.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, args, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    value = fn(rank, world, *args)
    if rank == 0:
        results.put(value)


def run_ranks(fn, world: int, *args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, args, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    value = results.get()
    for p in procs:
        p.join()
    return value
