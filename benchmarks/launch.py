"""Starts one process per rank for a benchmark and returns rank 0's result.

Each rank gets the torch.distributed environment (a free local port) and
OMP_NUM_THREADS=1, runs ``fn(rank, world, *args)``, and rank 0's return value
comes back to the caller. A rank that dies (an exception, a signal) ends
the run with an error naming it, instead of leaving the caller waiting on a
result that never comes.

``Workers`` keeps a configuration's ranks alive between calls, so that
several configurations, each set up once (a model loaded), can be timed in
interleaved rounds: ``fn(rank, world, *args)`` returns the function each
``call`` runs on every rank; the others wait, idle, on their queues.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
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


def _serve(fn, rank, world, port, args, commands, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    run = fn(rank, world, *args)
    if rank == 0:
        results.put("ready")
    while (command := commands.get()) is not None:
        value = run(command)
        if rank == 0:
            results.put(value)
    close = getattr(run, "close", None)
    if close is not None:
        close()


class Workers:
    """One configuration's ranks, set up once, serving ``call`` after call."""

    def __init__(self, fn, world: int, *args):
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_serve, args=(fn, r, world, port, args, self.commands[r], self.results)
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        try:
            _wait(self.results, self.procs)  # "ready": set up
        except BaseException:
            self.kill()
            raise

    def call(self, command):
        for q in self.commands:
            q.put(command)
        return _wait(self.results, self.procs)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=120)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()


def _wait(results, procs):
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or all(p.exitcode is not None for p in procs):
                raise RuntimeError(
                    f"benchmark ranks ended without a result (rank, exit code): {dead}"
                ) from None


def run_ranks(fn, world: int, *args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, args, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        value = _wait(results, procs)
        for p in procs:
            p.join()
        return value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
