"""Collective benchmark in the manner of nccl-tests: "dsp" against gloo (and
MPI when Open MPI and mpi4py are installed), measured in the same run.

    python benchmarks/collectives.py [--worlds 2 4] [--collectives all_reduce ...]
                                     [--max-bytes 256M] [--plot busbw.png] [--json out.json]
    python benchmarks/collectives.py --nodes 2 --worlds 4      # 2 simulated hosts x 2 ranks

For every (collective, world size, size) it prints the time per call, algbw,
busbw and #wrong (elements wrong in a separate, untimed correctness pass with
exactly representable values) for each backend, and the ratio of gloo's time
to ours. Conventions as nccl-tests: `size` is the bytes of the largest buffer
(all_gather: the output; reduce_scatter: the input); busbw = algbw x 2(n-1)/n
for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for broadcast.
Warm-up iterations come first; then five timed rounds, the engines taking
turns, each giving the slowest rank's mean time per call; the median round is
printed, and the results file keeps the median, min and max
(benchmarks/common.py).

For all_reduce two more engines are timed in the same processes: our direct
all-reduce ``dsparallel.ops.all_reduce_`` ("op": no torch.distributed wrapper
and no dispatcher on the way; it calls the kernel of the torch op
``torch.ops.dsparallel.all_reduce_`` through our extension module), and,
when DeepSpeed is installed (one host), its CPU shared-memory all-reduce
``torch.ops.deepspeed.inference_all_reduce_`` (built on first use;
DS_ACCELERATOR=cpu), with the ratios of our times to its. ``--dtype
bfloat16`` (or ``float16``) times every engine in that dtype (MPI is float32
only: mpi4py has no bf16 or fp16 reduction). ``--worlds 1`` gives the floor: a collective
of one rank through the same torch path. At 2 ranks and more that floor is also timed in
the same processes, in turn with the others ("alone": ``dist.all_reduce`` over a "dsp"
group of this rank alone), and the row gives what the peers add to it ("dsp-alone").

``--data fresh`` has every rank rewrite what it contributes (zeros, through
a numpy view, the same fill on the MPI side) before each timed call, as a
training step's new values are. By default the same data is sent again and
again, and a transport that reads the peer's buffer in place (Open MPI's
single copy) then finds it in its own cache from the call before.

``--nodes K`` makes the ranks K simulated hosts (DSP_NODE_ID, contiguous blocks
of ranks): "dsp" then runs hierarchically (shared memory within a host, gloo
between hosts), against gloo flat over all ranks on the same layout. On one
machine the "network" between the hosts is loopback TCP, the same that flat
gloo uses: a memory copy, like the shared memory it is compared with.

``--nodes 2 --link-mbit M`` puts each simulated host in its own network
namespace (root and iproute2 needed), joined by a veth pair whose two
directions are each limited to M Mbit/s (tc tbf; this kernel has no netem, so
no added latency): the hosts then talk over a link that costs what a real one
does, while each host's own ranks keep their loopback and shared memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import ROUNDS, remove_deepspeed_segments, save, stats  # noqa: E402
from fresh import fresh  # noqa: E402
from launch import run_ranks  # noqa: E402

DEFAULT_SIZES = [
    8,
    64,
    512,
    4 << 10,
    32 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
]
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
TIME_BUDGET_S = 0.45  # per measurement, after warm-up


def parse_bytes(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def fmt_bytes(b: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= m and b % m == 0:
            return f"{b // m}{unit}"
    return str(b)


def _make_op(name, n, rank, size_bytes, group, dtype="float32", engine="dist"):
    """Returns (run, check, mine): run() does one collective; check() counts
    wrong elements; mine is what this rank contributes (None: nothing, a
    broadcast's non-root). ``engine`` (all_reduce only): "dist" (``dist.all_reduce``), "op"
    (our ``dsparallel.ops.all_reduce_``) or "deepspeed" (DeepSpeed's
    ``torch.ops.deepspeed.inference_all_reduce_``, the world group)."""
    import torch
    import torch.distributed as dist

    dt = getattr(torch, dtype)
    elems = max(1, size_bytes // dt.itemsize)
    empty = lambda k: torch.empty(k, dtype=dt)  # noqa: E731
    arange = lambda k: torch.arange(k, dtype=dt)  # noqa: E731
    if name == "all_reduce":
        buf = empty(elems)
        if engine == "op":
            from dsparallel.ops import all_reduce_

            def run():
                all_reduce_(buf, group=group)

        elif engine == "deepspeed":

            def run():
                torch.ops.deepspeed.inference_all_reduce_(buf)

        else:

            def run():
                dist.all_reduce(buf, group=group)

        def check():
            buf.fill_(rank + 1)
            run()
            return int((buf != n * (n + 1) / 2).sum())

        mine = buf

    elif name == "all_gather":
        per = max(1, elems // n)
        inp, out = empty(per), empty(per * n)

        def run():
            dist.all_gather_into_tensor(out, inp, group=group)

        def check():
            inp.fill_(rank)
            run()
            expect = arange(n).repeat_interleave(per)
            return int((out != expect).sum())

        mine = inp

    elif name == "reduce_scatter":
        per = max(1, elems // n)
        inp, out = empty(per * n), empty(per)

        def run():
            dist.reduce_scatter_tensor(out, inp, group=group)

        def check():
            inp.copy_(arange(n).repeat_interleave(per) + rank)
            run()
            return int((out != n * rank + n * (n - 1) / 2).sum())

        mine = inp

    elif name == "broadcast":
        buf = empty(elems)

        def run():
            dist.broadcast(buf, src=0, group=group)

        def check():
            buf.fill_(7.0 if rank == 0 else -1.0)
            run()
            return int((buf != 7.0).sum())

        mine = buf if rank == 0 else None

    else:
        raise ValueError(name)
    return run, check, mine


def _time(runs, size_bytes):
    """Seconds per call of each engine in ``runs`` (name -> run): the slowest
    rank's mean in each of ROUNDS rounds. The engines take turns
    round by round, so that a burst of noise on a shared machine falls on all
    of them alike and their ratio holds within one run."""
    import torch
    import torch.distributed as dist

    warm = 3 if size_bytes >= (16 << 20) else 20
    iters = {}
    for name, run in runs.items():
        for _ in range(warm):
            run()
        # Agree on an iteration count from a short probe so every rank runs the same.
        dist.barrier()
        t0 = time.perf_counter()
        probe = 2
        for _ in range(probe):
            run()
        per = torch.tensor([(time.perf_counter() - t0) / probe])
        dist.all_reduce(per, op=dist.ReduceOp.MAX)
        iters[name] = int(min(2000, max(2, TIME_BUDGET_S / ROUNDS / max(per.item(), 1e-7))))
    rounds = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            # A few untimed calls first: the engine before leaves the caches
            # (and the other rank's core) in its own state.
            for _ in range(min(warm, iters[name])):
                run()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                run()
            mine = torch.tensor([(time.perf_counter() - t0) / iters[name]])
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            rounds[name].append(mine.item())
    return rounds


def _deepspeed_op(n):
    """Builds and initialises DeepSpeed's CPU shared-memory all-reduce over the
    world group; False when DeepSpeed is not installed or the op cannot be
    built (its output goes to stderr, away from the table)."""
    import contextlib
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return False
    # Set before DeepSpeed is imported: its CPU accelerator, and the local
    # world size without which its op skips the set-up and then crashes.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_SIZE"] = str(n)
    import torch

    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed

        deepspeed.init_distributed(dist_backend="dsp")
    return hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")


def _worker(rank, n, collectives, sizes, nodes=1, dtype="float32", deepspeed=True, data="static"):
    import warnings

    import torch
    import torch.distributed as dist

    import dsparallel  # noqa: F401

    # torch 2.13 marks the *_tensor collectives deprecated; they are what we measure.
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    if nodes > 1:
        os.environ["DSP_NODE_ID"] = f"node{rank * nodes // n}"
    dist.init_process_group("dsp", rank=rank, world_size=n)
    groups = {"dsp": None, "gloo": dist.new_group(backend="gloo")}
    # all_reduce only: our direct op, and DeepSpeed's when it is installed
    # (one host, its dtypes).
    extras = {"dsp-op": (None, "op")}
    if n > 1 and nodes == 1:
        # Every rank takes part in creating each group, its own among them.
        alone = [dist.new_group([r], backend="dsp") for r in range(n)][rank]
        extras["alone"] = (alone, "dist")
    ds_dtypes = ("float32", "bfloat16", "float16")  # what its op reduces
    if deepspeed and nodes == 1 and dtype in ds_dtypes and _deepspeed_op(n):
        extras["deepspeed"] = (None, "deepspeed")
    rows = []
    for coll in collectives:
        for size in sizes:
            row = {"collective": coll, "world": n, "bytes": size, "dtype": dtype}
            engines = {name: (group, "dist") for name, group in groups.items()}
            if coll == "all_reduce":
                engines.update(extras)
            runs = {}
            for name, (group, engine) in engines.items():
                ranks = (1, 0) if name == "alone" else (n, rank)
                run, check, mine = _make_op(coll, *ranks, size, group, dtype, engine)
                wrong = torch.tensor([check()])
                dist.all_reduce(wrong, group=None)
                row[name] = {"wrong": int(wrong.item())}
                if data == "fresh" and mine is not None:
                    run = fresh(run, mine.view(torch.uint8).numpy())
                runs[name] = run
            # gloo on its own: after a gloo call the shared-memory engines ran
            # up to 20x slower for a while on a 2-core machine (its threads
            # and sockets), which would spoil their ratios to each other.
            gloo = {"gloo": runs.pop("gloo")}
            for part in (gloo, runs):
                for name, secs in _time(part, size).items():
                    row[name]["us"] = stats(t * 1e6 for t in secs)
            del runs
            rows.append(row)
            if rank == 0:
                print(_format_row(row), flush=True)
    dist.destroy_process_group()
    if "deepspeed" in extras:
        remove_deepspeed_segments(rank)
    return rows


def _mpi_available():
    if shutil.which("mpirun") is None:
        return False
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpirun(n: int) -> list[str]:
    """Open MPI's launcher for n ranks over its shared-memory transport."""
    return [
        "mpirun",
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        str(n),
        "--mca",
        "btl",
        "self,vader",
    ]


def run_json(cmd: list[str]) -> dict:
    """Runs cmd, whose last line of output is a JSON object of size -> us
    (one number, or one per round)."""
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def _run_mpi(n, collective, sizes, data="static"):
    """The collective through MPI (mpi4py) on the same sizes (us per call, slowest rank)."""
    script = os.path.join(HERE, "mpi_collectives.py")
    cmd = [sys.executable, script, collective, data] + [str(s) for s in sizes]
    return run_json(mpirun(n) + cmd)


HEADER = (
    f"{'collective':>14} {'n':>2} {'size':>6} | {'dsp us':>10} {'algbw':>7} "
    f"{'busbw':>7} {'#wrong':>6} | {'gloo us':>10} {'algbw':>7} {'busbw':>7} "
    f"{'#wrong':>6} | {'gloo/dsp':>8}"
)


def us(row, name) -> float:
    """An engine's median microseconds per call in a row."""
    return row[name]["us"]["median"]


def _bw(row, name):
    secs = us(row, name) / 1e6
    alg = row["bytes"] / secs / 1e9
    return alg, alg * BUS_FACTOR[row["collective"]](row["world"])


def _format_row(row):
    parts = [f"{row['collective']:>14} {row['world']:>2} {fmt_bytes(row['bytes']):>6}"]
    for name in ("dsp", "gloo"):
        alg, bus = _bw(row, name)
        parts.append(f"{us(row, name):>10.1f} {alg:>7.3f} {bus:>7.3f} {row[name]['wrong']:>6}")
    ratio = us(row, "gloo") / us(row, "dsp")
    line = " | ".join(parts) + f" | {ratio:>7.1f}x"
    if "dsp-op" in row:
        line += f" | op {us(row, 'dsp-op'):>8.1f} us {row['dsp-op']['wrong']}"
    if "alone" in row:
        alone = us(row, "alone")
        more = us(row, "dsp") - alone
        line += f" | alone {alone:>6.1f} us {row['alone']['wrong']} dsp-alone {more:>6.1f} us"
    if "deepspeed" in row:
        ds = us(row, "deepspeed")
        line += (
            f" | deepspeed {ds:>8.1f} us {row['deepspeed']['wrong']} dsp/ds time "
            f"{us(row, 'dsp') / ds:>5.2f} op/ds {us(row, 'dsp-op') / ds:>5.2f}"
        )
    if "mpi" in row:
        mpi_bus = _bw(row, "mpi")[1]
        line += (
            f" | mpi {us(row, 'mpi'):>9.1f} us busbw {mpi_bus:>6.3f} dsp/mpi busbw "
            f"{_bw(row, 'dsp')[1] / mpi_bus:>5.2f}"
        )
    return line


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed; {path} not written")
        return
    colls = sorted({r["collective"] for r in rows})
    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(
        len(worlds), len(colls), figsize=(4.5 * len(colls), 3.6 * len(worlds)), squeeze=False
    )
    for (i, n), (j, coll) in ((iw, jc) for iw in enumerate(worlds) for jc in enumerate(colls)):
        ax = axes[i][j]
        sel = [r for r in rows if r["collective"] == coll and r["world"] == n]
        xs = [r["bytes"] for r in sel]
        for name in ("dsp", "gloo"):
            ax.plot(xs, [_bw(r, name)[1] for r in sel], marker="o", label=name)
        if sel and all("mpi" in r for r in sel):
            ax.plot(xs, [_bw(r, "mpi")[1] for r in sel], marker="o", label="MPI")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw GB/s")
        ax.set_title(f"{coll}, {n} ranks")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def _ip(*args):
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--link-mbit: ip {' '.join(args)} failed: {done.stderr.strip()}")


def _run_linked_hosts(n, args, sizes):
    """Runs the n ranks as 2 hosts in 2 network namespaces joined by a veth
    pair shaped by tc tbf; returns rank 0's rows."""
    tag = uuid.uuid4().hex[:6]
    ns, dev = [f"dspb{tag}{i}" for i in "ab"], [f"dvb{tag}{i}" for i in "ab"]
    addr = ["10.231.9.1", "10.231.9.2"]
    _ip("netns", "add", ns[0])
    procs = []
    try:
        _ip("netns", "add", ns[1])
        _ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in range(2):
            _ip("link", "set", dev[i], "netns", ns[i])
            _ip("-n", ns[i], "addr", "add", f"{addr[i]}/24", "dev", dev[i])
            _ip("-n", ns[i], "link", "set", dev[i], "up")
            _ip("-n", ns[i], "link", "set", "lo", "up")
            # The bucket holds at least one timer tick (4 ms at HZ=250) of
            # traffic, so that the rate, not the tick, is the limit.
            burst = max(128 << 10, args.link_mbit * 1_000_000 // 8 // 250)
            shape = ["rate", f"{args.link_mbit}mbit", "burst", str(burst), "latency", "100ms"]
            done = subprocess.run(
                ["ip", "netns", "exec", ns[i], "tc", "qdisc", "add", "dev", dev[i], "root", "tbf"]
                + shape,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise SystemExit(f"--link-mbit: tc tbf failed: {done.stderr.strip()}")
        port = str(20000 + int(tag, 16) % 20000)
        for r in range(n):
            host = r * 2 // n
            cmd = ["ip", "netns", "exec", ns[host], sys.executable, os.path.abspath(__file__)]
            cmd += ["--worlds", str(n), "--nodes", "2", "--collectives", *args.collectives]
            cmd += ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--rank", str(r)]
            cmd += ["--dtype", args.dtype, "--data", args.data]
            env = dict(
                os.environ,
                MASTER_ADDR=addr[0],
                MASTER_PORT=port,
                GLOO_SOCKET_IFNAME=dev[host],
            )
            out = subprocess.PIPE if r == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, text=True))
        rows = None
        for line in procs[0].stdout:
            if line.startswith("ROWS "):
                rows = json.loads(line[5:])
            else:
                print(line, end="", flush=True)
        for p in procs:
            if p.wait() != 0:
                raise SystemExit(f"--link-mbit: a rank exited with {p.returncode}")
        return rows
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--collectives", nargs="+", default=["all_reduce"], choices=sorted(BUS_FACTOR))
    ap.add_argument("--min-bytes", default="8")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--plot", help="write a PNG of busbw against size")
    ap.add_argument("--name", default="collectives", help="the results file's name")
    ap.add_argument("--no-mpi", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--nodes", type=int, default=1, help="simulated hosts (DSP_NODE_ID)")
    ap.add_argument("--link-mbit", type=int, help="with --nodes 2: hosts in network namespaces")
    ap.add_argument(
        "--data",
        default="static",
        choices=["static", "fresh"],
        help="fresh: each rank rewrites what it contributes before every timed call",
    )
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # one rank of --link-mbit
    args = ap.parse_args()
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    sizes = [s for s in DEFAULT_SIZES if lo <= s <= hi]
    if args.rank is not None:
        n = args.worlds[0]
        os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
        rows = _worker(
            args.rank, n, args.collectives, sizes, args.nodes, args.dtype, False, args.data
        )
        if args.rank == 0:
            print("ROWS " + json.dumps(rows), flush=True)
        return
    if args.link_mbit and args.nodes != 2:
        raise SystemExit("--link-mbit needs --nodes 2 (one veth pair joins two hosts)")

    if args.nodes > 1:
        link = f", joined by a {args.link_mbit} Mbit/s link" if args.link_mbit else " on loopback"
        print(f"{args.nodes} simulated hosts{link}: hierarchical dsp against flat gloo")
    print(HEADER)
    rows = []
    for n in args.worlds:
        if n % args.nodes:
            raise SystemExit(f"--worlds {n} does not split into --nodes {args.nodes} hosts")
        if args.link_mbit:
            world_rows = _run_linked_hosts(n, args, sizes)
        else:
            world_rows = run_ranks(
                _worker,
                n,
                args.collectives,
                sizes,
                args.nodes,
                args.dtype,
                not args.no_deepspeed,
                args.data,
            )
        # mpi4py reduces no bfloat16 or float16: the MPI column is float32 only. At world
        # size 1 there is no bus bandwidth to compare (its factor is 0).
        mpi_ok = args.nodes == 1 and n > 1 and not args.no_mpi and args.dtype == "float32"
        mpi_ok = mpi_ok and _mpi_available()
        for collective in args.collectives if mpi_ok else []:
            mpi = _run_mpi(n, collective, sizes, args.data)
            for r in world_rows:
                if r["collective"] == collective and r["bytes"] in mpi:
                    # mpi_collectives.py checked its results (it fails otherwise).
                    r["mpi"] = {"wrong": 0, "us": stats(mpi[r["bytes"]])}
                    print(_format_row(r))
        rows += world_rows
    save(args.name, rows, vars(args))
    if args.plot:
        _plot(rows, args.plot)


if __name__ == "__main__":
    main()
