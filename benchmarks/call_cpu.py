"""Where the time of an 8-byte all-reduce goes: wall time, CPU time and
context switches per call, on "dsp" and on torch's own floor.

    python benchmarks/call_cpu.py [--worlds 2 4] [--iters 5000] [--rounds 3]

Engines, each timed in its own ranks (float32, two elements, sum in place):

- ``dist``: ``dist.all_reduce`` on a "dsp" group;
- ``op``: our direct ``dsparallel.ops.all_reduce_`` on the same group;
- ``fake``: ``dist.all_reduce`` on torch's fake process group (no
  communication at all): torch's own per-call cost, the floor under ``dist``;
- ``fake_yield``: the same, each call followed by ``os.sched_yield()``: with
  two ranks per core, they take turns on it after every call, as ranks waiting
  for a collective do, so each call runs after a context switch;
- ``mpi``: ``MPI_Allreduce`` through mpi4py (``mpi_collectives.py``, wall
  time only), when Open MPI and mpi4py are installed.

Per call and rank, averaged over ranks: wall microseconds, CPU microseconds
(user + system, ``getrusage``), of which system, and involuntary context
switches (a ``sched_yield`` that hands the core over counts as one). With more
ranks than cores, the cores never idle while a collective is pending (a
waiting rank yields its core to the peer that shares it), so the wall time per
call is ranks / cores times the CPU time per call: torch's per-call CPU, paid
by every rank on the same core in turn, sets a floor under ``dist``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from collectives import _mpi_available, _run_mpi  # noqa: E402
from common import MIN_REPEATS, save, stats  # noqa: E402
from launch import run_ranks  # noqa: E402

WARMUP = 200


def _worker(rank, n, engine, iters, rounds):
    if engine.startswith("fake"):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    else:
        import dsparallel  # noqa: F401  (registers "dsp")

        dist.init_process_group("dsp")
    from dsparallel.ops import all_reduce_

    buf = torch.ones(2)
    if engine == "op":
        call = lambda: all_reduce_(buf)  # noqa: E731
    elif engine == "fake_yield":
        call = lambda: (dist.all_reduce(buf), os.sched_yield())  # noqa: E731
    else:
        call = lambda: dist.all_reduce(buf)  # noqa: E731
    rows = []
    for _ in range(rounds):
        for _ in range(WARMUP):
            call()
        if not engine.startswith("fake"):  # the fake group's barrier waits for nobody
            dist.barrier()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(iters):
            call()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
        rows.append([wall, user + system, system, r1.ru_nivcsw - r0.ru_nivcsw])
    per_call = torch.tensor(rows, dtype=torch.float64) / iters
    if engine.startswith("fake"):  # no collectives there: every rank reports its own
        return per_call.tolist() if rank == 0 else None
    dist.all_reduce(per_call)
    dist.destroy_process_group()
    return (per_call / n).tolist()


def _spread(s: dict) -> str:
    """Median [min-max] of per-call microseconds."""
    return f"{s['median']:6.2f} [{s['min']:5.2f}-{s['max']:5.2f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=MIN_REPEATS)
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs; per call and rank: median over {args.rounds} rounds [range]")
    print(f"{'n':>2} {'engine':>10} | {'wall us':>20} | {'cpu us':>20} | sys us | switches")
    rows = []
    for n in args.worlds:
        for engine in ["fake", "fake_yield", "op", "dist"]:
            rounds = run_ranks(_worker, n, engine, args.iters, args.rounds)
            wall, cpu, system, switches = (
                stats(row[i] * scale for row in rounds)
                for i, scale in ((0, 1e6), (1, 1e6), (2, 1e6), (3, 1))
            )
            rows.append(
                {"world": n, "engine": engine, "wall_us": wall, "cpu_us": cpu, "switches": switches}
            )
            print(
                f"{n:>2} {engine:>10} | {_spread(wall)} | {_spread(cpu)} | "
                f"{system['median']:6.2f} | {switches['median']:8.2f}",
                flush=True,
            )
        if _mpi_available():
            mpi = stats(_run_mpi(n, "all_reduce", [8])[8])  # its rounds, in us
            rows.append({"world": n, "engine": "mpi", "wall_us": mpi})
            print(f"{n:>2} {'mpi':>10} | {_spread(mpi)} |", flush=True)
    save("call_cpu", rows, vars(args))


if __name__ == "__main__":
    main()
