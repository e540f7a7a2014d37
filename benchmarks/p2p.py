"""Point-to-point send/recv: "dsp" against gloo, two ranks, in one run.

    python benchmarks/p2p.py [--iters 300]

Ping-pong between rank 0 and rank 1 (a blocking send, then the reply's
receive), per message size: the one-way latency (half the round trip, median
of rounds) and the bandwidth it implies, for both backends, and their ratio.
Sizes up to half a shared-memory ring (512 KiB by default) go through the
rings; larger ones fall back to gloo inside "dsp" too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import run_ranks  # noqa: E402

SIZES = [4, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
ROUNDS = 5


def _worker(rank, world, args):
    import torch
    import torch.distributed as dist

    import dsparallel  # noqa: F401  (registers "dsp")

    torch.set_num_threads(1)
    dist.init_process_group("dsp", rank=rank, world_size=world)
    groups = {"dsp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    out = {}
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)
        samples = {name: [] for name in groups}
        for r in range(ROUNDS):
            for name in list(groups)[r % 2 :] + list(groups)[: r % 2]:  # alternate order
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
        out[nbytes] = {name: statistics.median(s) for name, s in samples.items()}
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
    args = ap.parse_args()
    rows = run_ranks(_worker, 2, args)
    print(f"ping-pong, 2 ranks, one-way latency: median of {ROUNDS} rounds of {args.iters}")
    print(f"{'size':>6} | {'dsp us':>9} {'GB/s':>7} | {'gloo us':>9} {'GB/s':>7} | gloo/dsp")
    for nbytes, r in rows.items():
        d, g = r["dsp"], r["gloo"]
        print(
            f"{_size(nbytes):>6} | {d * 1e6:>9.1f} {nbytes / d / 1e9:>7.3f} | "
            f"{g * 1e6:>9.1f} {nbytes / g / 1e9:>7.3f} | {g / d:>7.1f}x"
        )


if __name__ == "__main__":
    main()
