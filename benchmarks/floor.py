"""The floor under the gloo baselines: an 8-byte all-reduce between two
processes over gloo, beside the plain loopback TCP round trip of the same
machine and "dsp"'s 8-byte all-reduce, in one run.

    python benchmarks/floor.py [--iters 2000]

gloo's small all-reduce at 2 ranks is at least one exchange over TCP on
loopback, so it cannot be faster than one round trip of a few bytes between
two processes. The round trip is timed in Python (``socket`` with
TCP_NODELAY: 8 bytes sent, 8 bytes echoed back), so it carries the
interpreter's per-call cost as the torch calls do. Each engine is timed in
ROUNDS rounds of ``iters`` calls; a round gives the slowest rank's mean per
call, the engines taking turns round by round. A reader can then judge how
far gloo's numbers in the other benchmarks are from what its transport allows.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROUNDS, medians, save, stats  # noqa: E402
from launch import run_ranks  # noqa: E402


def _tcp_pair(rank: int, port: int) -> socket.socket:
    if rank == 0:
        server = socket.create_server(("127.0.0.1", port))
        conn, _ = server.accept()
        server.close()
    else:
        for _ in range(200):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.01)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _worker(rank, world, iters):
    import torch
    import torch.distributed as dist

    import dsparallel  # noqa: F401  (registers "dsp")

    torch.set_num_threads(1)
    dist.init_process_group("dsp")
    gloo = dist.new_group(backend="gloo")
    port = torch.tensor([0])
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast(port, 0)
    conn = _tcp_pair(rank, int(port))
    word = b"\0" * 8

    def round_trip():
        if rank == 0:
            conn.sendall(word)
            conn.recv(8, socket.MSG_WAITALL)
        else:
            conn.recv(8, socket.MSG_WAITALL)
            conn.sendall(word)

    buf = torch.zeros(2)  # 8 bytes of float32
    engines = {
        "tcp_round_trip": round_trip,
        "gloo_all_reduce": lambda: dist.all_reduce(buf, group=gloo),
        "dsp_all_reduce": lambda: dist.all_reduce(buf),
    }
    samples = {name: [] for name in engines}
    names = list(engines)
    for r in range(ROUNDS):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run = engines[name]
            for _ in range(iters // 10):
                run()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            mine = torch.tensor([(time.perf_counter() - t0) / iters * 1e6])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            samples[name].append(mine.item())
    conn.close()
    dist.destroy_process_group()
    return {name: stats(s) for name, s in samples.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    row = run_ranks(_worker, 2, args.iters)
    save("floor", [{"world": 2, "bytes": 8, **row}], vars(args))
    m = medians(row)
    print(f"2 processes, 8 bytes, us per call (median of {ROUNDS} rounds [min-max])")
    for name, s in row.items():
        print(f"{name:>16} {s['median']:8.2f} [{s['min']:.2f}-{s['max']:.2f}]")
    print(
        f"gloo all-reduce / TCP round trip: {m['gloo_all_reduce'] / m['tcp_round_trip']:.2f}x; "
        f"dsp all-reduce / TCP round trip: {m['dsp_all_reduce'] / m['tcp_round_trip']:.2f}x"
    )


if __name__ == "__main__":
    main()
