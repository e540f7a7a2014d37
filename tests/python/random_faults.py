"""Randomised faults: many short multi-process runs of collectives and
point-to-point over "dsp", in each of which one random rank, at a random
point, raises (and exits), stalls past the group's timeout, or is killed.

Every surviving rank must either finish with every result right or raise;
none may hang (each run has a deadline), die of a signal, or see a wrong
value; nothing may be left in /dev/shm. Prints one JSON line of counts.

    python tests/python/random_faults.py --runs 200 --seed 0

Ranks are forked from this process once torch and dsparallel are imported
(no interpreter start per run); each run rendezvouses through a FileStore.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import dsparallel  # noqa: F401  (registers "dsp")

TIMEOUT_S = 0.5  # the group's timeout during the run (a stall outlasts it)
OPS = ["all_reduce", "all_reduce_large", "broadcast", "all_gather", "ring", "ring_large", "barrier"]


def expected(op: str, i: int, world: int, rank: int):
    """What rank `rank` must hold after op number i."""
    if op.startswith("all_reduce"):
        return float(sum(r + i for r in range(world)))
    if op == "broadcast":
        return float(i % world + 100 * i)
    if op == "all_gather":
        return [float(r * 10 + i) for r in range(world)]
    if op.startswith("ring"):
        return float((rank - 1) % world * 1000 + i)
    return None


def run_op(op: str, i: int, world: int, rank: int):
    """Runs op number i; returns what this rank holds after it."""
    if op.startswith("all_reduce"):
        t = torch.full((300_000 if op.endswith("large") else 8,), float(rank + i))
        dist.all_reduce(t)
        return t
    if op == "broadcast":
        t = torch.full((16,), float(i % world + 100 * i) if rank == i % world else -1.0)
        dist.broadcast(t, src=i % world)
        return t
    if op == "all_gather":
        out = torch.empty(world * 4)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, torch.full((4,), float(rank * 10 + i)))
        return out
    if op.startswith("ring"):
        n = 600_000 if op.endswith("large") else 32  # large: read in place
        got = torch.empty(n)
        recv = dist.irecv(got, src=(rank - 1) % world, tag=i)
        dist.send(torch.full((n,), float(rank * 1000 + i)), dst=(rank + 1) % world, tag=i)
        recv.wait()
        return got
    dist.barrier()
    return None


def correct(op: str, i: int, world: int, rank: int, got) -> bool:
    want = expected(op, i, world, rank)
    if want is None:
        return True
    if isinstance(want, list):
        return torch.equal(got, torch.tensor(want).repeat_interleave(4))
    return bool((got == want).all())


def rank_main(store_path: str, rank: int, world: int, plan: list[str], fault, out_fd: int):
    """One rank's run; writes its outcome to out_fd and exits."""
    outcome = {"rank": rank, "done": 0, "wrong": 0, "error": None, "error_after_s": 0.0}
    started = None
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            "dsp", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
        dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=TIMEOUT_S))
        for i, op in enumerate(plan):
            if fault is not None and fault["rank"] == rank and fault["at"] == i:
                if fault["kind"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault["kind"] == "raise":
                    raise RuntimeError("injected fault")
                time.sleep(TIMEOUT_S + 0.3)  # stall past the peers' timeout
            started = time.monotonic()
            got = run_op(op, i, world, rank)
            if not correct(op, i, world, rank, got):
                outcome["wrong"] += 1
            outcome["done"] += 1
    except Exception as e:  # noqa: BLE001 - the outcome is the test
        outcome["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if started is not None:  # how long the failing call took to raise
            outcome["error_after_s"] = time.monotonic() - started
        if "injected fault" not in str(e) and not str(e).startswith("dsp"):
            outcome["unexpected"] = traceback.format_exc()[-2000:]
    os.write(out_fd, json.dumps(outcome).encode())
    os.close(out_fd)
    os._exit(0)


def one_run(rng: random.Random, counts: dict) -> None:
    world = rng.choice([2, 3])
    plan = [rng.choice(OPS) for _ in range(rng.randint(3, 8))]
    fault = None
    if rng.random() < 0.85:
        fault = {
            "rank": rng.randrange(world),
            "at": rng.randrange(len(plan)),
            "kind": rng.choice(["raise", "stall", "kill"]),
        }
        counts["faults"][fault["kind"]] += 1
    before = set(glob.glob("/dev/shm/dsp-*"))
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for r in range(world):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                try:
                    rank_main(os.path.join(tmp, "store"), r, world, plan, fault, write)
                finally:
                    os._exit(3)
            os.close(write)
            children.append((pid, read))
        deadline = time.monotonic() + TIMEOUT_S * 4 + 10
        for r, (pid, read) in enumerate(children):
            status = None
            while status is None:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = st
                elif time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    counts["hangs"] += 1
                    status = -1
                else:
                    time.sleep(0.005)
            data = b"".join(iter(lambda fd=read: os.read(fd, 65536), b""))
            os.close(read)
            killed = fault is not None and fault["kind"] == "kill" and fault["rank"] == r
            if killed:
                continue
            if status == -1:
                continue
            if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not data:
                counts["crashes"] += 1
                counts["details"].append(
                    {"plan": plan, "fault": fault, "rank": r, "status": status}
                )
                continue
            outcome = json.loads(data)
            counts["wrong_results"] += outcome["wrong"]
            counts["ops_completed"] += outcome["done"]
            counts["slowest_error_s"] = max(counts["slowest_error_s"], outcome["error_after_s"])
            if outcome["error"]:
                faulty = fault is not None and fault["rank"] == r
                counts["errors_raised"] += 0 if faulty and fault["kind"] == "raise" else 1
            if "unexpected" in outcome:
                counts["unexpected_errors"] += 1
                counts["details"].append({"plan": plan, "fault": fault, "outcome": outcome})
            if fault is None and outcome["error"]:
                counts["errors_without_fault"] += 1
                counts["details"].append({"plan": plan, "outcome": outcome})
    time.sleep(0.01)
    counts["leaks"] += len(set(glob.glob("/dev/shm/dsp-*")) - before)
    counts["runs"] += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    counts = {
        "runs": 0,
        "faults": {"raise": 0, "stall": 0, "kill": 0},
        "errors_raised": 0,
        "ops_completed": 0,
        "wrong_results": 0,
        "hangs": 0,
        "crashes": 0,
        "leaks": 0,
        "unexpected_errors": 0,
        "errors_without_fault": 0,
        "slowest_error_s": 0.0,
        "details": [],
    }
    t0 = time.monotonic()
    for _ in range(args.runs):
        one_run(rng, counts)
    counts["seconds"] = round(time.monotonic() - t0, 1)
    counts["slowest_error_s"] = round(counts["slowest_error_s"], 3)
    counts["timeout_s"] = TIMEOUT_S
    counts["seed"] = args.seed
    print(json.dumps(counts))
    bad = (
        "wrong_results",
        "hangs",
        "crashes",
        "leaks",
        "unexpected_errors",
        "errors_without_fault",
    )
    # A failing call raises within the timeout, give or take a wait's slice
    # and a loaded machine's scheduling.
    late = counts["slowest_error_s"] > TIMEOUT_S + 2.0
    return 1 if late or any(counts[k] for k in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
