"""MPI_Allreduce (float32 sum) timings for benchmarks/collectives.py.

Run under mpirun with the sizes in bytes as arguments; rank 0 prints one JSON
line {bytes: microseconds per call on the slowest rank}. Same warm-up and
time budget and median of three rounds as the torch side.
"""

import json
import sys
import time

import numpy as np
from mpi4py import MPI

TIME_BUDGET_S = 0.45
ROUNDS = 3


def main():
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    out = {}
    for size in map(int, sys.argv[1:]):
        elems = max(1, size // 4)
        send = np.full(elems, rank + 1, dtype=np.float32)
        recv = np.empty_like(send)
        comm.Allreduce(send, recv, op=MPI.SUM)
        assert np.all(recv == n * (n + 1) / 2), "MPI_Allreduce gave a wrong result"
        for _ in range(3 if size >= (16 << 20) else 20):
            comm.Allreduce(send, recv, op=MPI.SUM)
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(2):
            comm.Allreduce(send, recv, op=MPI.SUM)
        probe = comm.allreduce((time.perf_counter() - t0) / 2, op=MPI.MAX)
        iters = int(min(2000, max(2, TIME_BUDGET_S / ROUNDS / max(probe, 1e-7))))
        rounds = []
        for _ in range(ROUNDS):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.Allreduce(send, recv, op=MPI.SUM)
            mine = (time.perf_counter() - t0) / iters
            rounds.append(comm.allreduce(mine, op=MPI.MAX))
        out[size] = sorted(rounds)[ROUNDS // 2] * 1e6
    if rank == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
