"""Train a Llama or DeepSeek-V3 at any layout: a Hugging Face checkpoint
or config, or a small built-in one, split over tensor, pipeline, expert,
context and data parallelism.

    torchrun --nproc-per-node 4 examples/train_hf.py --model llama --tensor-parallel 2 \\
        --context-parallel 2
    torchrun --nproc-per-node 4 examples/train_hf.py --model deepseek_v3 --expert-parallel 2 \\
        --context-parallel 2 --cp-mode ulysses --seq-len 256
    torchrun --nproc-per-node 4 examples/train_hf.py --model path/to/checkpoint --save out
    torchrun --nproc-per-node 2 examples/train_hf.py --model out/hf --resume out/train

``--model llama`` / ``deepseek_v3`` builds a small model with fresh
weights from a built-in config; a directory (``config.json`` and
safetensors) is loaded with ``dsparallel.models.from_pretrained``; a
``config.json`` alone gives fresh weights. The corpus is the one
train_gpt.py reads (this repository's text as bytes, ids below 128, so any
vocabulary of at least 128 takes it). ``--save DIR`` writes a Hugging Face
checkpoint (``DIR/hf``, which ``transformers`` loads) and a training
checkpoint (``DIR/train``: model and optimizer, which ``--resume`` reads at
any other layout).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from train_gpt import batch, load_corpus

import dsparallel
from dsparallel.models import DeepseekV3, Llama, from_pretrained
from dsparallel.train.models import BUILTIN
from dsparallel.train.step import Step, make_step

# The trainer's small built-in configs, over the corpus's ids (below 128).
SMALL = {name: {**config, "vocab_size": 128} for name, config in BUILTIN.items()}
CLASSES = {"llama": Llama, "deepseek_v3": DeepseekV3}


def build_model(spec: str, state, args):
    mixed = args.dtype == "mixed-bfloat16"
    kwargs = dict(
        dtype=getattr(torch, args.dtype) if args.dtype and not mixed else None,
        mixed_precision=dsparallel.MixedPrecision() if mixed else None,
        checkpoint=args.recompute,
        sequence_parallel=args.sequence_parallel,
        cp_mode=args.cp_mode,
    )
    if os.path.isdir(spec):
        return from_pretrained(spec, state, **kwargs)
    config = SMALL.get(spec)
    if config is None:
        if not os.path.isfile(spec):
            raise SystemExit(
                f"--model {spec!r}: neither {sorted(SMALL)} nor a checkpoint directory nor a "
                "config.json"
            )
        with open(spec) as f:
            config = json.load(f)
    kind = config.get("model_type")
    if kind not in CLASSES:
        raise SystemExit(f"--model {spec}: model_type {kind!r} is not one of {sorted(CLASSES)}")
    return CLASSES[kind](config, state, seed=args.seed, **kwargs)


def make_trainer(model, state, zero_stage: int, micro_batches: int, lr: float, **options) -> Step:
    """``model`` (built for ``init_parallel``'s ``state``) trained with AdamW
    by the trainer's step (``dsparallel.train.step``): our DDP over the
    data- and context-parallel ranks, ZeRO stage 1/2 sharding AdamW's state
    over them, 1F1B over ``micro_batches`` under a pipeline. A model already
    sharded by torch's FSDP2 (``fully_shard``) is trained as it is.
    ``options`` go to ``make_step``: another ``schedule=`` (the model built
    with its stages), or our DDP's ``overlap_param_gather=True``."""

    def make_optimizer(model, zero_group):
        params = [q for q in model.parameters() if q.requires_grad]
        if zero_group is None:
            return torch.optim.AdamW(params, lr=lr)
        return dsparallel.ZeroRedundancyOptimizer(
            params, torch.optim.AdamW, process_group=zero_group, lr=lr
        )

    return make_step(
        model,
        state,
        make_optimizer,
        zero_stage=zero_stage,
        micro_batches=micro_batches,
        **options,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", help="llama, deepseek_v3, a directory or a config")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--pipeline-parallel", type=int, default=1)
    p.add_argument("--expert-parallel", type=int, default=1)
    p.add_argument(
        "--experts-over-tp",
        action="store_true",
        help="the expert-parallel group spans the tp ranks (--expert-parallel a multiple of tp)",
    )
    p.add_argument("--context-parallel", type=int, default=1)
    p.add_argument("--cp-mode", choices=["ring", "ulysses"], default="ring")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0)
    p.add_argument("--recompute", action="store_true", help="recompute each layer in backward")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "mixed-bfloat16"],
        default=None,
        help="the model's dtype (default: a checkpoint's own, float32 for a config); "
        "bfloat16 is pure bf16, mixed-bfloat16 computes in bf16 with float32 masters",
    )
    p.add_argument("--micro-batches", type=int, default=2, help="per step under pp (1F1B)")
    p.add_argument("--batch-size", type=int, default=8, help="global, in sequences")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None)
    p.add_argument("--resume", default=None, help="a --save DIR/train of any layout")
    args = p.parse_args()

    state = dsparallel.init_parallel(
        args.tensor_parallel,
        args.pipeline_parallel,
        expert_parallel_size=args.expert_parallel,
        context_parallel_size=args.context_parallel,
        experts_over_tp=args.experts_over_tp,
    )
    rank = dist.get_rank()
    model = build_model(args.model, state, args)
    trainer = make_trainer(model, state, args.zero_stage, args.micro_batches, args.lr)
    opt = trainer.opt
    first = 0
    if args.resume:
        dsparallel.load_checkpoint(args.resume, model, opt)
        with open(os.path.join(args.resume, "step.json")) as f:
            first = json.load(f)["step"]

    corpus = load_corpus()
    if rank == 0:
        n = sum(q.numel() for q in model.parameters())
        print(
            f"{type(model).__name__}: {args.model}, layout {state}, {n} parameters on rank 0, "
            f"{model.precision}, "
            f"global batch {args.batch_size} x {args.seq_len} tokens",
            flush=True,
        )
    losses, start = [], time.perf_counter()
    for step in range(first, first + args.steps):
        ids, _ = batch(corpus, step, args.batch_size, args.seq_len)
        rows = ids.chunk(state.dp_size)[state.dp_rank]  # cp ranks: the same rows
        mine = trainer.step(rows)
        # The mean over the data-parallel replicas (the last stage holds it).
        value = torch.stack(mine).mean() if mine else torch.zeros(())
        value = value.double().reshape(1)
        dist.all_reduce(value)
        losses.append(value.item() / (state.dp_size * state.cp_size * state.tp_size))
        if rank == 0 and (step == first or (step + 1) % 10 == 0):
            print(f"step {step + 1}: loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    if args.save:
        model_dir, train_dir = os.path.join(args.save, "hf"), os.path.join(args.save, "train")
        model.save_pretrained(model_dir)
        dsparallel.save_checkpoint(train_dir, model, opt)
        if rank == 0:
            with open(os.path.join(train_dir, "step.json"), "w") as f:
                json.dump({"step": first + args.steps}, f)
    if rank == 0:
        tokens = args.steps * args.batch_size * args.seq_len
        print(
            f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps; "
            f"{tokens / elapsed:.0f} tokens/s",
            flush=True,
        )
    dsparallel.destroy_parallel()


if __name__ == "__main__":
    main()
