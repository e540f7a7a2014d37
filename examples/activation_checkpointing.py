"""Activation checkpointing: trade recomputation for activation memory.

    python examples/activation_checkpointing.py

A deep MLP is trained for a few steps twice from the same start: once keeping
every activation for backward, once with ``dsparallel.checkpoint`` around each
block (only the block inputs are kept; the rest is recomputed in backward,
with the same RNG states, so dropout masks match). It prints the bytes saved
for backward (measured with ``torch.autograd.graph.saved_tensors_hooks``),
the time per step, and checks that the gradients are the same.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import dsparallel


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(width),
            nn.Linear(width, 4 * width),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(4 * width, width),
        )

    def forward(self, x):
        return x + self.net(x)


class Model(nn.Module):
    def __init__(self, width: int, depth: int, checkpoint: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.checkpoint = checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = dsparallel.checkpoint(block, x) if self.checkpoint else block(x)
        return x


class SavedBytes:
    """Counts the bytes autograd saves for backward while active."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        def pack(t):
            self.bytes += t.numel() * t.element_size()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def run(checkpoint: bool, args):
    torch.manual_seed(0)
    model = Model(args.width, args.depth, checkpoint)
    x = torch.randn(args.batch, args.width)
    model(x).sum().backward()  # warm-up (the first checkpointed call sets up)
    model.zero_grad()
    with SavedBytes() as saved:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        elapsed = time.perf_counter() - t0
    return saved.bytes, elapsed, [p.grad for p in model.parameters()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=512)
    args = p.parse_args()
    torch.set_num_threads(1)

    kept, t_kept, g_kept = run(False, args)
    ckpt, t_ckpt, g_ckpt = run(True, args)
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(g_kept, g_ckpt))
    print(
        f"saved for backward: {kept / 2**20:.1f} MiB without, {ckpt / 2**20:.1f} MiB with "
        f"checkpointing ({1 - ckpt / kept:.0%} less)"
    )
    print(f"forward+backward: {t_kept * 1e3:.0f} ms without, {t_ckpt * 1e3:.0f} ms with")
    print(f"gradients equal: {same}")
    if not same or ckpt >= kept:
        raise SystemExit("checkpointing changed the gradients or saved no memory")


if __name__ == "__main__":
    main()
