"""On a GPU: "dsp" (which hands CUDA tensors to torch's NCCL group) against
torch's "nccl" backend, and the fused all-reduce's bucket packing against a
plain device-to-device copy of the same bytes.

    python benchmarks/gpu.py

One rank per GPU (all GPUs of the machine). all_reduce: time per call and
busbw per size, for both backends in the same run, and their ratio.
fused_all_reduce: 200 tensors of mixed sizes (100 MB in all) packed into
25 MB buckets and all-reduced, against one all_reduce of a preallocated flat
buffer of the same bytes plus a device-to-device copy in and out (the work a
hand-written flatten would do), reported as effective GB/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROUNDS, medians, save, stats  # noqa: E402
from launch import run_ranks  # noqa: E402

SIZES = [8, 4 << 10, 256 << 10, 4 << 20, 64 << 20]


def _timed(fn, iters):
    """``stats`` of the seconds per call over ROUNDS rounds of ``iters`` calls."""
    import torch

    for _ in range(3):
        fn()
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / iters)
    return stats(rounds)


def _worker(rank, world):
    import torch
    import torch.distributed as dist

    import dsparallel

    torch.cuda.set_device(rank)
    dist.init_process_group("dsp", rank=rank, world_size=world)
    groups = {"dsp": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
    rows = []
    for size in SIZES:
        row = {"bytes": size}
        for name, g in groups.items():
            buf = torch.ones(max(1, size // 4), device="cuda")
            iters = 200 if size < (4 << 20) else 20
            row[name] = _timed(lambda b=buf, g=g: dist.all_reduce(b, group=g), iters)
        rows.append(row)
    sizes = [(i % 50 + 1) * 1000 * (1 + i % 7) for i in range(200)]
    scale = (100 << 20) / 4 / sum(sizes)
    tensors = [torch.ones(max(1, int(n * scale)), device="cuda") for n in sizes]
    total = sum(t.numel() for t in tensors) * 4
    flat = torch.empty(total // 4, device="cuda")

    def by_hand():
        torch.cat([t.view(-1) for t in tensors], out=flat)
        dist.all_reduce(flat, group=groups["nccl"])
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))

    fused = _timed(lambda: dsparallel.fused_all_reduce(tensors), 10)
    hand = _timed(by_hand, 10)
    other = torch.empty_like(flat)
    copy = _timed(lambda: other.copy_(flat), 10)
    ddp = _ddp_steps(groups["nccl"])
    dist.destroy_process_group()
    return {
        "world": world,
        "all_reduce": rows,
        "fused_bytes": total,
        "fused_s": fused,
        "by_hand_s": hand,
        "d2d_copy_s": copy,
        "ddp_step_s": ddp,
    }


def _ddp_steps(nccl_group):
    """One training step of a 34M-parameter MLP on the GPU: torch's DDP over
    its NCCL group against ours over "dsp" (whose CUDA tensors go to NCCL)."""
    import copy

    import torch
    from torch import nn

    import dsparallel

    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    x = torch.randn(256, 2048, device="cuda")
    out = {}
    for name, wrap in (
        ("torch", lambda m: nn.parallel.DistributedDataParallel(m, process_group=nccl_group)),
        ("ours", dsparallel.DistributedDataParallel),
    ):
        model = wrap(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        out[name] = _timed(step, 30)
    return out


def main():
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = ap.parse_args()
    world = torch.cuda.device_count()
    if world == 0:
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU")
    r = run_ranks(_worker, world)
    save("gpu", [r], vars(args))
    r = medians(r)
    r["ddp_step_s"] = medians(r["ddp_step_s"])
    n = r["world"]
    bus = 2 * (n - 1) / n if n > 1 else 1.0
    print(f"all_reduce on {n} GPU(s): dsp (NCCL underneath) against torch's nccl backend")
    print(f"{'bytes':>10} {'dsp us':>10} {'nccl us':>10} {'dsp busbw':>10} {'dsp/nccl':>9}")
    for row in r["all_reduce"]:
        d, c = row["dsp"]["median"], row["nccl"]["median"]
        print(
            f"{row['bytes']:>10} {d * 1e6:>10.1f} {c * 1e6:>10.1f} "
            f"{row['bytes'] / d / 1e9 * bus:>10.2f} {d / c:>8.2f}x"
        )
    gb = r["fused_bytes"] / 1e9
    print(
        f"fused_all_reduce of 200 tensors ({gb * 1e3:.0f} MB): {gb / r['fused_s']:.1f} GB/s; "
        f"flatten by hand + all_reduce: {gb / r['by_hand_s']:.1f} GB/s; "
        f"a plain device-to-device copy: {gb / r['d2d_copy_s']:.1f} GB/s"
    )
    d = r["ddp_step_s"]
    print(
        f"DDP step, 34M-param MLP: torch DDP/nccl {d['torch'] * 1e3:.2f} ms, "
        f"ours/dsp {d['ours'] * 1e3:.2f} ms ({d['ours'] / d['torch']:.2f}x)"
    )


if __name__ == "__main__":
    main()
