"""One process per rank on this machine, each running a function: how the
planner's calibration and the benchmarks start their ranks.

Each rank gets the torch.distributed environment (a free local port) and
OMP_NUM_THREADS=1 (one thread, as torchrun gives a rank), runs
``fn(rank, world, *args)``, and rank 0's return value comes back to the
caller. A rank that dies (an exception, a signal) ends the run with an
error naming it, instead of leaving the caller waiting on a result that
never comes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """This process's environment as rank ``rank`` of ``world``, with one
    thread."""
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    # This module's package imported torch before the variable was set,
    # which torch reads once: ranks sharing the cores would each start as
    # many threads as there are cores.
    torch.set_num_threads(1)


def wait_result(results, procs):
    """The next value on ``results``; raises if the ranks end without one."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or all(p.exitcode is not None for p in procs):
                raise RuntimeError(
                    f"ranks ended without a result (rank, exit code): {dead}"
                ) from None


def _entry(fn, rank, world, port, args, results):
    rank_env(rank, world, port)
    value = fn(rank, world, *args)
    if rank == 0:
        results.put(value)


def run_ranks(fn, world: int, *args):
    """Runs ``fn(rank, world, *args)`` in ``world`` fresh processes (spawned:
    ``fn`` must be importable) and returns rank 0's value."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, args, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        value = wait_result(results, procs)
        for p in procs:
            p.join()
        return value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
