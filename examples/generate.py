"""Generate text with the GPT that examples/train_gpt.py trained, at any
tensor x pipeline parallel layout (not only the one it was trained at).

    torchrun --nproc-per-node 4 examples/train_gpt.py --save ckpt   # tp 2 x pp 2
    torchrun --nproc-per-node 2 examples/generate.py --load ckpt/model.pt
    torchrun --nproc-per-node 2 examples/generate.py --load ckpt/model.pt \
        --tensor-parallel 1 --pipeline-parallel 2 --sample --seed 3

``load_gpt`` builds this rank's stage of the new layout and reads its
blocks of the one-file checkpoint; ``GPTForGeneration`` runs it over a KV
cache of its heads; ``dsparallel.inference.generate`` prefills the
prompts (left padded to one batch) and decodes them together. The model
reads and writes bytes (a 128-symbol vocabulary), so a prompt is text and
so is what comes back. Rank 0 prints each prompt and its continuation.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import dsparallel
from dsparallel.inference import generate
from dsparallel.models import GPTForGeneration, load_gpt

PROMPTS = ["import torch\n", "def forward(self, x", "The backend "]


def encode(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [batch, longest] and the mask that keeps the text."""
    codes = [[min(b, 127) for b in p.encode()] for p in prompts]
    width = max(len(c) for c in codes)
    ids = torch.zeros(len(codes), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, c in enumerate(codes):
        ids[row, width - len(c) :] = torch.tensor(c)
        mask[row, width - len(c) :] = 1
    return ids, mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True, help="model.pt that train_gpt.py --save wrote")
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--pipeline-parallel", type=int, default=1)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    p.add_argument("--max-new-tokens", type=int, help="default: up to the model's positions")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)
    state = dsparallel.init_parallel(args.tensor_parallel, args.pipeline_parallel)
    module, cfg = load_gpt(args.load, state)
    model = GPTForGeneration(module.eval(), cfg, state)
    ids, mask = encode(args.prompt or PROMPTS)
    new = args.max_new_tokens
    if new is None:
        new = cfg.seq_len - ids.shape[1]
    sampling = {}
    if args.sample:
        sampling = dict(
            do_sample=True,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=torch.Generator().manual_seed(args.seed),
        )
    t0 = time.perf_counter()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=new, **sampling)
    elapsed = time.perf_counter() - t0
    if dist.get_rank() == 0:
        print(
            f"GPT {cfg.layers} layers x {cfg.hidden} hidden at tp {state.tp_size} x pp "
            f"{state.pp_size}: {ids.shape[0]} prompts, {new} new tokens each in {elapsed:.2f} s"
        )
        for row, keep in zip(out, torch.cat([mask, torch.ones(len(mask), new)], 1).bool()):
            text = bytes(row[keep].tolist()).decode(errors="replace")
            print("-" * 40 + "\n" + text)
    dsparallel.destroy_parallel()


if __name__ == "__main__":
    main()
