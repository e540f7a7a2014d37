"""What every benchmark shares: its timing, the machine it ran on, statistics
over repeats, and the one JSON file per benchmark and machine class that
``benchmarks/report.py`` turns into docs/performance.md.

A result file is ``benchmarks/results/<benchmark>-<machine class>.json``;
re-running a benchmark on the same class of machine replaces it (git keeps
the history), and records the commit and a hash of the files it measured
(``sources.py``). Each row holds, per measured quantity, the median, min and max
over at least ``MIN_REPEATS`` repeats (``stats``).

Timing inside a process group: every sample is one call timed on each rank
after a barrier and reduced to the slowest rank's time, so a sample is what
the job as a whole waited. Configurations compared with each other are timed
in interleaved rounds (``interleaved_rounds``), their order rotating, so that
a drift of the machine favours none; a configuration's repeats are its
rounds, each summarised by the median of its samples (``round_stats``).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MIN_REPEATS = 5
ROUNDS = MIN_REPEATS  # interleaved rounds: one repeat each


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine and software a result was measured with."""
    import torch

    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])

    def git(*args) -> str:
        return subprocess.run(
            ["git", "-C", ROOT, *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        # A change to what runs (the package, its C++, the benchmarks, the
        # build) means the code measured is not the commit's; results,
        # figures, docs and tests do not run here.
        changed = git(
            "status",
            "--porcelain",
            "--",
            "dsparallel",
            "csrc",
            "benchmarks",
            "examples",
            "setup.py",
            "CMakeLists.txt",
            "pyproject.toml",
            ":!benchmarks/results",
        )
        commit += "+changes" if changed else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "date": datetime.date.today().isoformat(),
    }


def machine_class(m: dict) -> str:
    """A stable file-name part: CPU model and core count."""
    cpu = re.sub(r"\((R|TM)\)|CPU|Processor|@.*|\d+-Core", "", m["cpu"])
    slug = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")
    return f"{slug}-{m['cores']}c"


def malloc_bytes() -> tuple[int, int]:
    """glibc's allocator counters (``mallinfo2``): the bytes it holds from
    the system (heap arenas plus mmapped blocks) and the bytes handed out
    and not yet freed. CPU tensors' storage comes from it."""
    info = _mallinfo2()()
    return info.arena + info.hblkhd, info.uordblks + info.hblkhd


@functools.cache
def _mallinfo2():
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            ).split()
        ]

    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = Info
    return fn


def stats(samples) -> dict:
    """Median, min and max of a quantity's repeats (seconds, or any unit)."""
    samples = list(samples)
    if len(samples) < MIN_REPEATS:
        raise ValueError(f"{len(samples)} repeats; every result needs at least {MIN_REPEATS}")
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def save(benchmark: str, rows: list[dict], config: dict, path: str | None = None) -> str:
    """Writes the benchmark's result file and returns its path."""
    from sources import sources_hash

    m = machine()
    path = path or os.path.join(RESULTS, f"{benchmark}-{machine_class(m)}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # The hash of what was measured, for report.py to tell when it is stale.
    result = {"benchmark": benchmark, "machine": m, "sources": sources_hash(benchmark)}
    with open(path, "w") as f:
        json.dump({**result, "config": config, "rows": rows}, f, indent=1)
        f.write("\n")
    print(f"results: {os.path.relpath(path, ROOT)}")
    return path


def slowest_rank_seconds(fn) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed_stats(fn, steps: int, warmup: int) -> dict:
    """``warmup`` untimed calls, then ``stats`` of ``steps`` samples."""
    for _ in range(warmup):
        fn()
    return stats(slowest_rank_seconds(fn) for _ in range(steps))


def interleaved_rounds(steppers: dict, rounds: int, steps: int, warmup: int = 0) -> dict:
    """Times every configuration in ``rounds`` rounds, rotating their order,
    so that drift of the machine over the run favours none of them. Returns
    {key: [[samples of round 0], [samples of round 1], ...]}."""
    keys = list(steppers)
    out = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            for _ in range(warmup):
                steppers[k]()
            out[k].append([slowest_rank_seconds(steppers[k]) for _ in range(steps)])
    return out


def round_stats(per_round: list[list[float]]) -> dict:
    """``stats`` over the rounds of ``interleaved_rounds``, each round's
    median one repeat."""
    return stats(statistics.median(r) for r in per_round)


def medians(row: dict) -> dict:
    """The row with each ``stats`` replaced by its median (for printing)."""
    return {k: v["median"] if isinstance(v, dict) and "median" in v else v for k, v in row.items()}


def remove_deepspeed_segments(rank):
    """DeepSpeed's shared-memory all-reduce never unlinks its segments (one
    per rank, named for the job's address and port): left alone, repeated
    runs filled 9 GB of /dev/shm on a 2-core machine. Each rank removes its
    own once the group is gone."""
    import glob

    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}"):
        os.remove(path)
