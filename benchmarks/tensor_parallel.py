"""Tensor-parallel transformer block: dsparallel against torch's tensor parallel.

    python benchmarks/tensor_parallel.py [--world 2] [--steps 20]

A block is self-attention (QKV and output projection) plus an MLP (4x hidden),
each with a residual. For each size it times forward + backward (median step,
slowest rank) of:

  torch TP / <backend>   the plain block under torch's ``parallelize_module``
                         (q, k, v, fc1 ``ColwiseParallel``; out, fc2
                         ``RowwiseParallel``) on a 1-D DeviceMesh
  ours TP / <backend>    ``ParallelAttention`` + ``ParallelMLP``
  plain                  the plain block in each process (no parallelism)
  ours, group of 1       our layers on a group of one

with both TP variants over the same backend ("dsp", and gloo for reference),
all timed in interleaved rounds in one run. Ratios: ours / torch TP on the same
backend, and ours at group size 1 / plain.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROUNDS, interleaved_rounds, medians, round_stats, save  # noqa: E402
from launch import run_ranks  # noqa: E402

# (batch, seq, hidden, heads)
SIZES = [(4, 32, 128, 4), (4, 64, 512, 8), (4, 128, 1024, 16)]


def _plain_block(hidden, heads):
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads = heads
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, s, _ = x.shape

            def heads_of(t):  # n_heads is this rank's share under torch TP
                return t.view(b, s, self.n_heads, -1).transpose(1, 2)

            a = F.scaled_dot_product_attention(
                heads_of(self.q(x)), heads_of(self.k(x)), heads_of(self.v(x)), is_causal=True
            )
            x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
            return x + self.fc2(F.gelu(self.fc1(x)))

    return Block()


def _our_block(hidden, heads, group):
    from torch import nn

    from dsparallel import tensor_parallel as tp

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = tp.ParallelAttention(hidden, heads, group=group, causal=True)
            self.mlp = tp.ParallelMLP(hidden, 4 * hidden, group=group)

        def forward(self, x):
            x = x + self.attn(x)
            return x + self.mlp(x)

    return Block()


def _torch_tp_block(hidden, heads, mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    block = _plain_block(hidden, heads)
    plan = {name: ColwiseParallel() for name in ("q", "k", "v", "fc1")}
    plan.update(o=RowwiseParallel(), fc2=RowwiseParallel())
    parallelize_module(block, mesh, plan)
    block.n_heads = heads // mesh.size()
    return block


def _worker(rank, world, steps, warmup):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import dsparallel  # noqa: F401  (registers "dsp")

    torch.set_num_threads(1)
    dist.init_process_group("dsp", rank=rank, world_size=world)
    groups = {"dsp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    singles = [dist.new_group([r]) for r in range(world)]
    meshes = {
        name: DeviceMesh.from_group(g, "cpu", mesh=list(range(world))) for name, g in groups.items()
    }
    rows = []
    for batch, seq, hidden, heads in SIZES:
        torch.manual_seed(0)
        x = torch.randn(batch, seq, hidden)
        blocks = {}
        for backend, g in groups.items():
            blocks[f"torch TP / {backend}"] = _torch_tp_block(hidden, heads, meshes[backend])
            blocks[f"ours TP / {backend}"] = _our_block(hidden, heads, g)
        blocks["plain"] = _plain_block(hidden, heads)
        blocks["ours, group of 1"] = _our_block(hidden, heads, singles[rank])

        def step(block, x=x):
            for p in block.parameters():
                p.grad = None
            block(x).sum().backward()

        steppers = {k: (lambda b=b: step(b)) for k, b in blocks.items()}
        rounds = interleaved_rounds(steppers, ROUNDS, max(1, steps // ROUNDS), warmup)
        row = {"batch": batch, "seq": seq, "hidden": hidden, "heads": heads}
        row.update({k: round_stats(v) for k, v in rounds.items()})
        rows.append(row)
    dist.destroy_process_group()
    return rows


def _format(rows, world):
    rows = [medians(r) for r in rows]
    lines = [
        f"{'batch x seq x hidden (heads)':>30} {'torch TP ms':>12} {'ours TP ms':>11} "
        f"{'ours/torch':>10}   (backend)"
    ]
    for r in rows:
        size = f"{r['batch']} x {r['seq']} x {r['hidden']} ({r['heads']})"
        for backend in ("dsp", "gloo"):
            t, o = r[f"torch TP / {backend}"], r[f"ours TP / {backend}"]
            lines.append(f"{size:>30} {t * 1e3:>12.2f} {o * 1e3:>11.2f} {o / t:>9.2f}x   {backend}")
    lines.append("")
    lines.append(
        f"{'batch x seq x hidden (heads)':>30} {'plain ms':>12} {'ours@1 ms':>11} {'ratio':>10}"
    )
    for r in rows:
        size = f"{r['batch']} x {r['seq']} x {r['hidden']} ({r['heads']})"
        p, o = r["plain"], r["ours, group of 1"]
        lines.append(f"{size:>30} {p * 1e3:>12.2f} {o * 1e3:>11.2f} {o / p:>9.2f}x")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    rows = run_ranks(_worker, args.world, args.steps, args.warmup)
    print(
        f"Transformer block forward+backward, TP={args.world} on CPU (1 thread per rank), "
        f"median of {ROUNDS} interleaved rounds of {max(1, args.steps // ROUNDS)}-step medians"
    )
    print(_format(rows, args.world))
    save("tensor_parallel", rows, vars(args))


if __name__ == "__main__":
    main()
