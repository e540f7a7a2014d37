"""Collectives below torch: our C++ core against Open MPI, both in C.

    python benchmarks/core_latency.py [--worlds 2 4] [--collectives all_reduce all_gather broadcast]
                                      [--max-bytes 256K] [--runs 2]

`benchmarks/collectives.py` times "dsp" through torch (``dist.all_reduce`` and
our direct op) and MPI through mpi4py: at small sizes both carry their
Python binding's per-call cost, and torch's is several times mpi4py's. This
benchmark takes both away. `benchmarks/latency/core_latency.cpp` runs
``dsp::ShmComm``'s collective (the torch-free core the "dsp" backend calls)
in forked processes, `benchmarks/latency/mpi_latency.c` the same loop over
MPI (Open MPI's shared-memory transport, ``--mca btl self,vader``): float32,
all_reduce a sum in place, all_gather in place (the size is the output's),
broadcast from rank 0; untimed calls, then 5 rounds each ended by a
barrier, the median round's time per call. The two alternate,
``--runs`` times; the table gives the median over runs and their range, and
MPI's time over ours (above 1: the core is faster).

Needs cmake, a C++ compiler, and Open MPI with its compiler wrapper
(``apt-get install openmpi-bin libopenmpi-dev``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from collectives import fmt_bytes, mpirun, parse_bytes, run_json  # noqa: E402

ROOT = os.path.dirname(HERE)
BUILD = os.path.join(ROOT, "build", "latency")
SIZES = [8, 64, 512, 4 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def build() -> tuple[str, str]:
    for tool in ("cmake", "mpicc", "mpirun"):
        if shutil.which(tool) is None:
            sys.exit(
                f"core_latency: {tool} not found (apt-get install cmake openmpi-bin libopenmpi-dev)"
            )
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        [
            "cmake",
            "-S",
            ROOT,
            "-B",
            BUILD,
            *gen,
            "-DDSP_BUILD_TESTS=OFF",
            "-DDSP_BUILD_BENCHMARKS=ON",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["cmake", "--build", BUILD, "--target", "dsp_core_latency"], check=True, capture_output=True
    )
    mpi = os.path.join(BUILD, "mpi_latency")
    subprocess.run(
        ["mpicc", "-O2", os.path.join(HERE, "latency", "mpi_latency.c"), "-o", mpi], check=True
    )
    return os.path.join(BUILD, "dsp_core_latency"), mpi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument(
        "--collectives",
        nargs="+",
        default=["all_reduce"],
        choices=["all_reduce", "all_gather", "broadcast"],
    )
    ap.add_argument("--max-bytes", type=parse_bytes, default=256 << 10)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    core, mpi = build()
    sizes = [s for s in SIZES if s <= args.max_bytes]
    print(f"float32; {os.cpu_count()} CPUs; us per call (median over {args.runs} runs, range)")
    print(
        f"{'collective':>10} {'ranks':>5} {'size':>6} |"
        f" {'dsp core us':>22} | {'Open MPI us':>22} | MPI / dsp"
    )
    for collective in args.collectives:
        for n in args.worlds:
            sizes_args = [str(s) for s in sizes]
            times = {"dsp": [], "mpi": []}
            for _ in range(args.runs):
                times["dsp"].append(run_json([core, str(n), collective, *sizes_args]))
                times["mpi"].append(run_json(mpirun(n) + [mpi, collective, *sizes_args]))
            for s in sizes:
                d = [t[s] for t in times["dsp"]]
                m = [t[s] for t in times["mpi"]]
                dm, mm = statistics.median(d), statistics.median(m)
                print(
                    f"{collective:>10} {n:>5} {fmt_bytes(s):>6} |"
                    f" {dm:8.2f} ({min(d):6.2f}-{max(d):6.2f}) |"
                    f" {mm:8.2f} ({min(m):6.2f}-{max(m):6.2f}) | {mm / dm:6.2f}"
                )


if __name__ == "__main__":
    main()
