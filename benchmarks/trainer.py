"""The trainer (``python -m dsparallel.train``) against the ``transformers``
``Trainer``: a Llama of about 90M parameters trained on this repository's
docs, 2 processes (one per core), the same tokenizer, packed sequences,
optimizer and schedule, in one run.

    python benchmarks/trainer.py [--steps 5 --rounds 2]

Both train AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1, warmup then
cosine, clipping at 1.0) on sequences of 256 tokens, a global batch of 8,
packed from the docs with a byte-level BPE tokenizer of 8192 tokens. Ours
runs at dp 2 and at tp 2 with sequence parallelism, in float32 and in bf16
over float32 masters (``[model] mixed_precision = "bf16"``); the
``transformers`` ``Trainer`` runs its DDP over gloo as constructed by
default (which looks for unused parameters every step) and with its best
settings here (no search for unused parameters, ``ddp_bucket_cap_mb=100``,
no buffer broadcast, torch's fused AdamW as ours), with those over "dsp"
(a process group it finds initialised), and with those in bf16 under
autocast (``bf16=True``, its mixed precision). Reported per
configuration: training tokens/s of each timed step (rank 0's wall time per
optimizer step, everything the trainer does included: data, the step,
logging), pooled over the rounds (each configuration runs once per round,
in fresh processes, the order reversed every other round), and for ours
the largest share of a run's steps spent in the trainer's own work
(reading data, reporting metrics).

Needs ``pip install accelerate==1.13.0`` (the ``Trainer``'s own dependency).

torchtitan is not among them: its CPU run needs six changes to its source
(see the trainer guide), which a fair baseline should not depend on.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import ROOT, save, stats  # noqa: E402
from launch import run_ranks  # noqa: E402

WORLD = 2
SEQ, BATCH, VOCAB = 256, 8, 8192
LLAMA = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=10,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
OPTIM = dict(lr=3e-4, warmup_steps=2, decay="cosine", min_lr_ratio=0.1, grad_clip=1.0)


def _job(tok: str, model: str, parallel: dict, steps: int, model_options=None) -> dict:
    return {
        "model": {"name": model, **(model_options or {})},
        "parallel": parallel,
        "data": {
            "train": [os.path.join(ROOT, "docs", "**", "*.md")],
            "tokenizer": tok,
            "seq_len": SEQ,
            "global_batch": BATCH,
        },
        "optim": OPTIM,
        "train": {"steps": steps, "log_every": 1},
        "metrics": {"progress": False, "peak_flops": 1e9},
    }


def _ours(rank, world, job, warmup):
    import dsparallel
    from dsparallel.train import Trainer

    trainer = Trainer(job)
    history = trainer.fit()
    dsparallel.destroy_parallel()
    seconds = [t for s, t in sorted(history["seconds"].items()) if s > warmup]
    timing = trainer.timing
    return {"seconds": seconds, "own_share": (timing["data"] + timing["report"]) / timing["steps"]}


def _transformers(rank, world, tok, model_dir, backend, options, steps, warmup):
    import time

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from dsparallel.train.data import PackedStream, Tokenizer, expand, load_documents

    os.environ["LOCAL_RANK"] = str(rank)
    if backend == "dsp":
        import dsparallel  # noqa: F401  (registers "dsp")

        dist.init_process_group("dsp")
    files = expand([os.path.join(ROOT, "docs", "**", "*.md")], "train")
    stream = PackedStream(
        load_documents(files, "text", "document", False), Tokenizer(tok), SEQ, 0, 1, seed=0
    )
    rows = [stream.next_rows(1)[0] for _ in range(BATCH * steps)]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=BATCH // world,
        max_steps=steps,
        learning_rate=OPTIM["lr"],
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.1,
        warmup_steps=OPTIM["warmup_steps"],
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **({"ddp_backend": "gloo"} if backend == "gloo" else {}),
        **options,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Clock()]).train()
    seconds = [b - a for a, b in zip(stamps, stamps[1:])][warmup - 1 :]
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"seconds": seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    steps = a.steps + a.warmup
    rows = []
    with tempfile.TemporaryDirectory() as root:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from dsparallel.train.tokenizer import train_tokenizer

        tok = train_tokenizer(
            sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)),
            VOCAB,
            os.path.join(root, "tok"),
        )
        torch.manual_seed(0)
        model_dir = os.path.join(root, "llama")
        LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **LLAMA)).save_pretrained(model_dir)
        best = {
            "ddp_find_unused_parameters": False,
            "ddp_bucket_cap_mb": 100,
            "ddp_broadcast_buffers": False,
            "optim": "adamw_torch_fused",  # as ours: torch's fused AdamW
        }
        baselines = [
            ("transformers Trainer, DDP over gloo (defaults)", "gloo", {}),
            ("transformers Trainer, DDP over gloo (best settings)", "gloo", best),
            ("transformers Trainer, DDP over dsp (best settings)", "dsp", best),
            (
                "transformers Trainer, bf16 autocast, DDP over gloo (best settings)",
                "gloo",
                {**best, "bf16": True},
            ),
        ]
        bf16 = {"mixed_precision": "bf16"}
        ours = [
            ("dsparallel.train, dp 2", {}, None),
            ("dsparallel.train, dp 2, ZeRO-1", {"zero_stage": 1}, None),
            ("dsparallel.train, tp 2 + sp", {"tensor": 2, "sequence_parallel": True}, None),
            ("dsparallel.train, dp 2, mixed bf16", {}, bf16),
            (
                "dsparallel.train, tp 2 + sp, mixed bf16",
                {"tensor": 2, "sequence_parallel": True},
                bf16,
            ),
        ]
        runs = [("baseline", n, (_transformers, tok, model_dir, b, o)) for n, b, o in baselines]
        runs += [("dsparallel", n, (_ours, _job(tok, model_dir, p, steps, m))) for n, p, m in ours]
        # Every configuration once in each of --rounds rounds, the order
        # reversed every other round, so that the machine's drift over the
        # run favours none; a configuration's samples are pooled.
        samples = {name: [] for _, name, _ in runs}
        own = {}
        for r in range(a.rounds):
            for system, name, (fn, *args) in runs if r % 2 == 0 else runs[::-1]:
                extra = (steps, a.warmup) if system == "baseline" else (a.warmup,)
                out = run_ranks(fn, WORLD, *args, *extra)
                samples[name] += out["seconds"]
                if "own_share" in out:
                    own.setdefault(name, []).append(out["own_share"])
                print(name, f"round {r}: {SEQ * BATCH / min(out['seconds']):.0f} tokens/s (best)")
        for system, name, _ in runs:
            row = {"system": system, "layout": name}
            row["tokens_per_s"] = stats(SEQ * BATCH / t for t in samples[name])
            if name in own:
                row["own_share"] = max(own[name])
            rows.append(row)
    config = {**vars(a), "world": WORLD, "seq": SEQ, "batch": BATCH, "vocab": VOCAB}
    save("trainer", rows, {**config, "llama": LLAMA, "optim": OPTIM})
    best = max(
        (r for r in rows if r["system"] == "baseline"), key=lambda r: r["tokens_per_s"]["median"]
    )
    base = best["tokens_per_s"]["median"]
    print(f"\ntokens/s (x the best baseline: {best['layout']})")
    for r in rows:
        t = r["tokens_per_s"]
        own = f"  own work {100 * r['own_share']:.1f}% of a step" if "own_share" in r else ""
        print(
            f"  {r['layout']:<76} {t['median']:7.0f} [{t['min']:.0f}-{t['max']:.0f}] "
            f"{t['median'] / base:5.2f}x{own}"
        )


if __name__ == "__main__":
    main()
