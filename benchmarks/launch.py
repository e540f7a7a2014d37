"""Starts one process per rank for a benchmark. ``run_ranks(fn, world,
*args)`` (``dsparallel.spawn``'s) runs ``fn(rank, world, *args)`` on every
rank and returns rank 0's result.

``Workers`` keeps a configuration's ranks alive between calls, so that
several configurations, each set up once (a model loaded), can be timed in
interleaved rounds: ``fn(rank, world, *args)`` returns the function each
``call`` runs on every rank; the others wait, idle, on their queues.
"""

from __future__ import annotations

import multiprocessing as mp

from dsparallel.spawn import free_port, rank_env, run_ranks, wait_result

__all__ = ["Workers", "run_ranks"]


def _serve(fn, rank, world, port, args, commands, results):
    rank_env(rank, world, port)
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
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_serve, args=(fn, r, world, port, args, self.commands[r], self.results)
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        try:
            wait_result(self.results, self.procs)  # "ready": set up
        except BaseException:
            self.kill()
            raise

    def call(self, command):
        for q in self.commands:
            q.put(command)
        return wait_result(self.results, self.procs)

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
