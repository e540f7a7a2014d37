"""Collectives below torch: our C++ core against Open MPI, both in C.

    python benchmarks/core_latency.py [--worlds 2 4] [--collectives all_reduce all_gather broadcast]
                                      [--max-bytes 256K] [--runs 2] [--data static fresh]
                                      [--baseline OTHER_BUILD/dsp_core_latency]

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

``--data static`` (the default) calls on the same data again and again.
``--data fresh`` has each rank rewrite what it contributes before every call
(the root's buffer for broadcast), as a training step's new values are: a
single-copy transport reading a peer's unchanged buffer finds it in its own
cache from the call before, which real use never lets it do. The rewrite's
own time counts on both sides alike.

``--baseline B`` also times B, a ``dsp_core_latency`` built from another
commit (``cmake --build <its build dir> --target dsp_core_latency``), in turn
with this build's and MPI's, run by run: a before/after of the core from one
run, which this kind of machine's swings between runs make necessary.

Needs cmake, a C++ compiler, and Open MPI with its compiler wrapper
(``apt-get install openmpi-bin libopenmpi-dev``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from collectives import fmt_bytes, mpirun, parse_bytes, run_json  # noqa: E402
from common import MIN_REPEATS, save, stats  # noqa: E402

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
    ap.add_argument("--runs", type=int, default=MIN_REPEATS)
    ap.add_argument("--data", nargs="+", default=["static"], choices=["static", "fresh"])
    ap.add_argument(
        "--baseline",
        help="a dsp_core_latency binary built from another commit: timed in turn with this"
        " build's, for a before/after in one run",
    )
    args = ap.parse_args()
    core, mpi = build()
    sizes = [s for s in SIZES if s <= args.max_bytes]
    print(f"float32; {os.cpu_count()} CPUs; us per call (median over {args.runs} runs, range)")
    engines = {"dsp": lambda n, c, d: [core, str(n), c, d]}
    if args.baseline:
        engines["base"] = lambda n, c, d: [args.baseline, str(n), c, d]
    engines["mpi"] = lambda n, c, d: mpirun(n) + [mpi, c, d]
    heads = {"dsp": "dsp core us", "base": "baseline us", "mpi": "Open MPI us"}
    print(
        f"{'collective':>10} {'data':>6} {'ranks':>5} {'size':>6} |"
        + "".join(f" {heads[e]:>22} |" for e in engines)
        + " MPI / dsp"
        + (" | base / dsp" if args.baseline else "")
    )
    rows = []
    for collective in args.collectives:
        for n in args.worlds:
            sizes_args = [str(s) for s in sizes]
            times = {(d, e): [] for d in args.data for e in engines}
            for _ in range(args.runs):
                for data in args.data:
                    for e, cmd in engines.items():
                        times[data, e].append(run_json(cmd(n, collective, data) + sizes_args))
            for data in args.data:
                for s in sizes:
                    med, cells = {}, ""
                    row = {"collective": collective, "data": data, "world": n, "bytes": s}
                    for e in engines:
                        row[e] = stats(r[s] for r in times[data, e])  # us per call
                        med[e], lo, hi = row[e]["median"], row[e]["min"], row[e]["max"]
                        cells += f" {med[e]:8.2f} ({lo:6.2f}-{hi:6.2f}) |"
                    rows.append(row)
                    print(
                        f"{collective:>10} {data:>6} {n:>5} {fmt_bytes(s):>6} |{cells}"
                        f" {med['mpi'] / med['dsp']:9.2f}"
                        + (f" | {med['base'] / med['dsp']:10.2f}" if args.baseline else "")
                    )
    save("core_latency", rows, vars(args))


if __name__ == "__main__":
    main()
