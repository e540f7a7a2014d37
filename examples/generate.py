"""Generate text from a Hugging Face checkpoint (Llama, DeepSeek-V3 or
GPT-2: the trainer's ``[checkpoint] export_hf``, or a downloaded one) at any
tensor x pipeline parallel layout, not only the one it was trained at.

    bash scripts/train.sh                          # writes runs/llama-docs/hf
    torchrun --nproc-per-node 2 examples/generate.py --model runs/llama-docs/hf
    torchrun --nproc-per-node 2 examples/generate.py --model runs/llama-docs/hf \
        --tensor-parallel 1 --pipeline-parallel 2 --sample --seed 3

``from_pretrained`` builds this rank's part of the model and reads its
blocks of the checkpoint; ``dsparallel.inference.generate`` prefills the
prompts (left padded to one batch) and decodes them together over a KV
cache of this rank's heads. The checkpoint's ``tokenizer.json`` turns text
into ids and back. Rank 0 prints each prompt and its continuation.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

import dsparallel
from dsparallel.inference import generate
from dsparallel.models import from_pretrained

PROMPTS = ["The backend", "Pipeline parallelism", "A checkpoint"]


def encode(tok: Tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [batch, longest] and the mask that keeps the text."""
    codes = [tok.encode(p).ids for p in prompts]
    width = max(len(c) for c in codes)
    ids = torch.zeros(len(codes), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, c in enumerate(codes):
        ids[row, width - len(c) :] = torch.tensor(c)
        mask[row, width - len(c) :] = 1
    return ids, mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a checkpoint directory with tokenizer.json")
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--pipeline-parallel", type=int, default=1)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)
    state = dsparallel.init_parallel(args.tensor_parallel, args.pipeline_parallel)
    model = from_pretrained(args.model, state).eval()
    tok = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    ids, mask = encode(tok, args.prompt or PROMPTS)
    new = args.max_new_tokens
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
        cfg = model.config
        print(
            f"{model.model_type} {cfg.num_hidden_layers} layers x {cfg.hidden_size} hidden at "
            f"tp {state.tp_size} x pp {state.pp_size}: {ids.shape[0]} prompts, {new} new "
            f"tokens each in {elapsed:.2f} s"
        )
        for row, keep in zip(out, torch.cat([mask, torch.ones(len(mask), new)], 1).bool()):
            print("-" * 40 + "\n" + tok.decode(row[keep].tolist()))
    dsparallel.destroy_parallel()


if __name__ == "__main__":
    main()
