"""Point-to-point send/recv: "dsp" against gloo and MPI, two ranks, in one run.

    python benchmarks/p2p.py [--iters 300] [--no-mpi]

Ping-pong between rank 0 and rank 1 (a blocking send, then the reply's
receive), per message size: the one-way latency (half the round trip, median
of rounds) and the bandwidth it implies, and the ratios. Sizes up to half a
shared-memory ring (512 KiB by default) go through the rings; larger ones
are read in place by the receiver ("dsp"), or, in a second "dsp" group made
with DSP_P2P_SINGLE_COPY=0, go over gloo as they did before single copy
("dsp-gloo"; the same as "dsp" up to 512 KiB). MPI: Open MPI's
shared-memory transport through mpi4py (benchmarks/mpi_collectives.py
ping_pong), run after the torch ranks, when mpirun and mpi4py are there.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collectives import _mpi_available, mpirun, run_json  # noqa: E402
from common import ROUNDS, medians, save, stats  # noqa: E402
from launch import run_ranks  # noqa: E402

SIZES = [4, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _worker(rank, world, args):
    import torch
    import torch.distributed as dist

    import dsparallel  # noqa: F401  (registers "dsp")

    torch.set_num_threads(1)
    dist.init_process_group("dsp", rank=rank, world_size=world)
    os.environ["DSP_P2P_SINGLE_COPY"] = "0"
    without = dist.new_group(backend="dsp")
    del os.environ["DSP_P2P_SINGLE_COPY"]
    groups = {
        "dsp": dist.group.WORLD,
        "dsp-gloo": without,
        "gloo": dist.new_group(backend="gloo"),
    }
    out = {}
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)
        samples = {name: [] for name in groups}
        for r in range(ROUNDS):
            for name in list(groups)[r % 3 :] + list(groups)[: r % 3]:  # rotate the order
                g = groups[name]
                peer = 1 - rank
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    if rank == 0:
                        dist.send(t, peer, group=g)
                        dist.recv(t, peer, group=g)
                    else:
                        dist.recv(t, peer, group=g)
                        dist.send(t, peer, group=g)
                samples[name].append((time.perf_counter() - t0) / args.iters / 2)
        out[nbytes] = {name: stats(s) for name, s in samples.items()}
    dist.destroy_process_group()
    return out


def _size(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--no-mpi", action="store_true", help="skip the MPI column")
    args = ap.parse_args()
    rows = run_ranks(_worker, 2, args)
    mpi = {}
    if not args.no_mpi and _mpi_available():
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_collectives.py")
        cmd = [sys.executable, script, "ping_pong", "static"] + [str(s) for s in SIZES]
        one_way = run_json(mpirun(2) + cmd).items()  # round trips, us per round
        mpi = {k: stats(t / 2 / 1e6 for t in v) for k, v in one_way}
    print(f"ping-pong, 2 ranks, one-way latency: median of {ROUNDS} rounds of {args.iters}")
    names = ["dsp", "dsp-gloo", "gloo"] + (["MPI"] if mpi else [])
    print(
        f"{'size':>6} | "
        + " | ".join(f"{n + ' us':>12} {'GB/s':>6}" for n in names)
        + " | x/dsp: "
        + " ".join(f"{n:>8}" for n in names[1:])
    )
    for nbytes, r in rows.items():
        if mpi:
            r["MPI"] = mpi[nbytes]
    save("p2p", [{"bytes": b, **r} for b, r in rows.items()], vars(args))
    for nbytes, r in rows.items():
        r = medians(r)
        cells = " | ".join(f"{r[n] * 1e6:>12.1f} {nbytes / r[n] / 1e9:>6.2f}" for n in names)
        ratios = " ".join(f"{r[n] / r['dsp']:>7.2f}x" for n in names[1:])
        print(f"{_size(nbytes):>6} | {cells} | x/dsp: {ratios}")


if __name__ == "__main__":
    main()
