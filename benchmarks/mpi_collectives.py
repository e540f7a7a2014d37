"""MPI timings (float32) for benchmarks/collectives.py.

    mpirun -n N python mpi_collectives.py COLLECTIVE static|fresh SIZE...

COLLECTIVE is all_reduce (MPI_Allreduce, sum), all_gather (MPI_Allgather),
reduce_scatter (MPI_Reduce_scatter_block, sum), broadcast (MPI_Bcast from
rank 0) or ping_pong (2 ranks: rank 0 MPI_Send then MPI_Recv, rank 1 the
reverse, the same buffer; one call is a round trip; for benchmarks/p2p.py);
each SIZE is bytes of the largest buffer, as on the torch side
(all_gather: the output; reduce_scatter: the input). Rank 0 prints one JSON
line {bytes: [microseconds per call on the slowest rank, one per round]}.
Same warm-up, time budget and rounds as the torch side, and the same
correctness check on exactly representable values before timing. "fresh"
rewrites this rank's contribution (zeros) before every timed call, as
collectives.py --data fresh does on the torch side.
"""

import json
import sys
import time

import numpy as np
from fresh import fresh
from mpi4py import MPI

TIME_BUDGET_S = 0.45
ROUNDS = 5  # as common.ROUNDS; every round is printed


def _case(comm, name, size):
    """(run, check, mine): one call, one checked call returning #wrong, and
    what this rank contributes (None: nothing)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    elems = max(1, size // 4)
    if name == "all_reduce":
        send, recv = np.empty(elems, np.float32), np.empty(elems, np.float32)

        def run():
            comm.Allreduce(send, recv, op=MPI.SUM)

        def check():
            send.fill(rank + 1)
            run()
            return int((recv != n * (n + 1) / 2).sum())

        mine = send

    elif name == "all_gather":
        per = max(1, elems // n)
        send, recv = np.empty(per, np.float32), np.empty(per * n, np.float32)

        def run():
            comm.Allgather(send, recv)

        def check():
            send.fill(rank)
            run()
            return int((recv != np.repeat(np.arange(n, dtype=np.float32), per)).sum())

        mine = send

    elif name == "reduce_scatter":
        per = max(1, elems // n)
        send, recv = np.empty(per * n, np.float32), np.empty(per, np.float32)

        def run():
            comm.Reduce_scatter_block(send, recv, op=MPI.SUM)

        def check():
            send[:] = np.repeat(np.arange(n, dtype=np.float32), per) + rank
            run()
            return int((recv != n * rank + n * (n - 1) / 2).sum())

        mine = send

    elif name == "broadcast":
        buf = np.empty(elems, np.float32)

        def run():
            comm.Bcast(buf, root=0)

        def check():
            buf.fill(7.0 if rank == 0 else -1.0)
            run()
            return int((buf != 7.0).sum())

        mine = buf if rank == 0 else None

    elif name == "ping_pong":
        buf, peer = np.empty(elems, np.float32), 1 - rank

        def run():
            if rank == 0:
                comm.Send(buf, dest=peer)
                comm.Recv(buf, source=peer)
            else:
                comm.Recv(buf, source=peer)
                comm.Send(buf, dest=peer)

        def check():
            buf.fill(5.0 if rank == 0 else -1.0)
            run()
            return int((buf != 5.0).sum())

        mine = buf if rank == 0 else None

    else:
        raise SystemExit(f"unknown collective {name}")
    return run, check, mine


def main():
    comm = MPI.COMM_WORLD
    name, data, sizes = sys.argv[1], sys.argv[2], map(int, sys.argv[3:])
    if data not in ("static", "fresh"):
        raise SystemExit(f"data must be static or fresh, not {data}")
    out = {}
    for size in sizes:
        run, check, mine = _case(comm, name, size)
        wrong = comm.allreduce(check(), op=MPI.SUM)
        assert wrong == 0, f"MPI {name} gave {wrong} wrong elements at {size} bytes"
        if data == "fresh":
            run = fresh(run, mine)
        for _ in range(3 if size >= (16 << 20) else 20):
            run()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(2):
            run()
        probe = comm.allreduce((time.perf_counter() - t0) / 2, op=MPI.MAX)
        iters = int(min(2000, max(2, TIME_BUDGET_S / ROUNDS / max(probe, 1e-7))))
        rounds = []
        for _ in range(ROUNDS):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            mine = (time.perf_counter() - t0) / iters
            rounds.append(comm.allreduce(mine, op=MPI.MAX))
        out[size] = [r * 1e6 for r in rounds]
    if comm.Get_rank() == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
