"""A small character-level transformer trained with tensor parallelism.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py

Every rank holds 1/world of each layer: the embedding table split by
vocabulary, attention split by heads, the MLP by its hidden units, and the LM
head by vocabulary, whose logits go straight into the vocabulary-parallel
cross-entropy (they are never gathered). All ranks see the same batches. The
text is this repository's README, so nothing is downloaded. Rank 0 prints the
loss; at the end every rank checks that its replicated parameters (layer
norms, positions) equal rank 0's.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import dsparallel  # noqa: F401  (registers the "dsp" backend)
from dsparallel import tensor_parallel as tp


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = tp.ParallelAttention(hidden, heads, causal=True)
        self.mlp = tp.ParallelMLP(hidden, 4 * hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, blocks: int, seq: int):
        super().__init__()
        self.emb = tp.VocabParallelEmbedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(hidden)
        # The head's output features are the vocabulary: split across ranks.
        self.head = tp.ColumnParallelLinear(hidden, vocab, bias=False)

    def forward(self, ids, target):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return tp.vocab_parallel_cross_entropy(self.head(self.ln(x)), target)


def corpus() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        return f.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="dsp")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    text = corpus()
    chars = sorted(set(text))
    # Pad the vocabulary to a multiple of the group so the LM head splits
    # evenly (the embedding alone would take any size).
    vocab = -(-len(chars) // world) * world
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    tp.manual_seed(0)  # same initial model and batches everywhere
    model = TinyLM(vocab, args.hidden, args.heads, args.blocks, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = torch.Generator().manual_seed(1)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"tensor parallel over {world} ranks: vocab {vocab}, {n} parameters on each rank")

    t0, first, last = time.perf_counter(), None, None
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch_size,), generator=batches)
        ids = torch.stack([data[s : s + args.seq] for s in starts])
        target = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts])
        opt.zero_grad(set_to_none=True)
        loss = model(ids, target)
        loss.backward()
        opt.step()
        last = loss.item()
        first = last if first is None else first
        if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.4f}", flush=True)
    elapsed = time.perf_counter() - t0

    # Replicated parameters must have stayed identical on every rank.
    for name, p in model.named_parameters():
        if "ln" in name or name == "pos":
            ref = p.detach().clone()
            dist.broadcast(ref, 0)
            if not torch.equal(ref, p.detach()):
                raise SystemExit(f"rank {rank}: replicated parameter {name} diverged")
    if rank == 0:
        tokens = args.steps * args.batch_size * args.seq
        print(
            f"done: loss {first:.3f} -> {last:.3f}, {tokens / elapsed:.0f} tokens/s, "
            f"{elapsed:.1f} s; replicated parameters agree on all ranks"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
