"""A small character-level mixture-of-experts language model trained with
expert parallelism.

    torchrun --nproc-per-node 2 examples/moe.py
    torchrun --nproc-per-node 4 examples/moe.py --experts 8 --top-k 2 --shared-experts 1

Every rank is a data-parallel replica with its own batches, and the ranks
also form one expert-parallel group: each holds ``experts / world`` of the
routed experts of every MoE layer, and the tokens travel to their experts
and back by all-to-all (``dsparallel.moe``). Our DDP averages the dense
parameters over all ranks; each expert is held by one rank here, so its
gradient (from every rank's tokens) needs no reduction. After each step the
routing bias moves towards an even load (DeepSeek-V3's auxiliary-loss-free
balancing; ``--bias-rate 0`` turns it off). The text is this repository's
README, so nothing is downloaded. Rank 0 prints the loss and how evenly the
experts were loaded in the first and the last tenth of the run.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import dsparallel
from dsparallel.moe import MoE, moe_layers, update_expert_bias


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, moe: MoE):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.moe = moe

    def forward(self, x):
        h = self.ln1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab, hidden, heads, blocks, seq, make_moe):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads, make_moe()) for _ in range(blocks))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, target):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def corpus() -> torch.Tensor:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), "rb") as f:
        codes = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    return codes.masked_fill(codes >= 128, ord("?"))


def imbalance(load: torch.Tensor) -> float:
    """Most-loaded expert over the mean, averaged over layers (1 is even)."""
    return (load.max(-1).values / load.mean(-1).clamp(min=1e-9)).mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared-experts", type=int, default=0)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()

    torch.set_num_threads(1)
    state = dsparallel.init_parallel(expert_parallel_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same dense initialisation everywhere

    def make_moe():
        return MoE(
            args.hidden,
            2 * args.hidden,
            args.experts,
            args.top_k,
            num_shared_experts=args.shared_experts,
            group=state.ep_group,
            bias_update_rate=args.bias_rate,
        )

    model = TinyMoELM(128, args.hidden, args.heads, args.blocks, args.seq, make_moe)
    ddp = dsparallel.DistributedDataParallel(model, process_group=state.dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = corpus()
    g = torch.Generator().manual_seed(rank)  # each replica its own batches
    tenth = max(1, args.steps // 10)
    loads, first_loss = [], None
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch_size,), generator=g)
        ids = torch.stack([data[s : s + args.seq] for s in starts])
        target = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts])
        before = torch.stack([m.router.pending_load.clone() for m in moe_layers(model)])
        loss = ddp(ids, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        load = torch.stack([m.router.pending_load for m in moe_layers(model)]) - before
        dist.all_reduce(load)
        loads.append(load)
        update_expert_bias(model, state.dp_group)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        first_loss = mean if first_loss is None else first_loss
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {mean:.4f}", flush=True)

    early = imbalance(torch.stack(loads[:tenth]).sum(0))
    late = imbalance(torch.stack(loads[-tenth:]).sum(0))
    # The dense parameters must agree on every rank (DDP kept them so).
    dense = [p.detach() for p in model.parameters() if not hasattr(p, "_dsp_expert_group")]
    flat = torch.cat([p.flatten() for p in dense])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    agree = torch.tensor([float(torch.equal(flat, ref))])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    agree = bool(agree.item())
    if rank == 0:
        print(
            f"done: {world} ranks x {args.experts // world} experts each, top-{args.top_k}; "
            f"loss {first_loss:.3f} -> {mean:.3f}; busiest expert / mean load: "
            f"{early:.2f} (first tenth) -> {late:.2f} (last tenth); dense parameters "
            f"{'agree' if agree else 'DIFFER'} across ranks"
        )
    dsparallel.destroy_parallel()


if __name__ == "__main__":
    main()
