"""How much /dev/shm a "dsp" group needs, and whether the GPT job fits in a
container's usual 64 MB.

    python benchmarks/shm_size.py                 # segment bytes per group size
    sudo python benchmarks/shm_size.py --job 64 256   # + the GPT job in a 64 / 256 MB /dev/shm

Each group on a host reserves its whole segment at creation; the table is
read from the backend (``segment_bytes``). With ``--job MB ...`` (needs root:
a private mount namespace with its own tmpfs on /dev/shm) the training job
(tp 2 x pp 2 x dp 1 or 2: a group for the world and one per tensor-, pipeline-
and data-parallel group of two or more ranks) runs a few steps at 4 and 8
ranks with that much /dev/shm.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from common import save
from launch import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _segment_bytes(rank, world):
    import torch
    import torch.distributed as dist

    import dsparallel  # noqa: F401

    dist.init_process_group("dsp")
    be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    n = be.segment_bytes
    dist.destroy_process_group()
    return n


def _job(nproc: int, shm_mb: int) -> tuple[bool, str]:
    cmd = (
        f"mount -t tmpfs -o size={shm_mb}m tmpfs /dev/shm && "
        f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node {nproc} "
        f"{ROOT}/examples/train_gpt.py --steps 5 --plot /dev/null"
    )
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = out.stdout + out.stderr
    summary = next((ln for ln in text.splitlines() if ln.startswith("summary:")), None)
    if out.returncode == 0 and summary:
        return True, "ran (" + summary[:60] + "...)"
    return False, f"FAILED rc={out.returncode}: " + text.strip().splitlines()[-1][:200]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4, 8])
    p.add_argument("--job", type=int, nargs="*", default=[], metavar="MB")
    args = p.parse_args()
    print("ranks  segment bytes per group (default DSP_CHUNK_BYTES, DSP_P2P_RING_BYTES)")
    rows = []
    for w in args.worlds:
        n = run_ranks(_segment_bytes, w)  # exact: read from the backend, not timed
        rows.append({"world": w, "segment_bytes": n})
        print(f"{w:5d}  {n:12d}  ({n / 1e6:.1f} MB)", flush=True)
    for mb in args.job:
        for nproc in (4, 8):
            ran, what = _job(nproc, mb)
            rows.append({"job_ranks": nproc, "shm_mb": mb, "ran": ran})
            print(f"GPT job, {nproc} ranks, /dev/shm of {mb} MB: {what}", flush=True)
    save("shm_size", rows, vars(args))


if __name__ == "__main__":
    main()
