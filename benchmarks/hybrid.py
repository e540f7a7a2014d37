"""The GPT job (examples/train_gpt.py) in four 4-process layouts, with and
without activation checkpointing: tokens/s and memory per rank, in one run.

    python benchmarks/hybrid.py [--steps 20] [--png docs/figures/hybrid.png]
    python benchmarks/hybrid.py --replot benchmarks/results/hybrid-*.json --png ...  # redraw only

Layouts: dp 4; tp 2 x dp 2; tp 2 x pp 2; pp 4 (1F1B, 4 micro-batches). Each
configuration runs in fresh processes over "dsp". Reported per configuration:
training tokens/s (slowest rank's wall time over the timed steps), and per
rank:
  held   the peak bytes autograd held for backward during one step (distinct
         storages, so the stage's weights count once; saved_tensors_hooks, see
         memory.py). A checkpointed block keeps only its input; the one block
         it recomputes at a time in backward is not counted here.
  rss+   how far the process's peak RSS rose above its RSS just before
         training (everything: activations, recomputation, gradients,
         optimizer state, communication buffers; page-granular, and glibc
         keeps some freed memory, so it is coarse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from common import save, slowest_rank_seconds, stats  # noqa: E402
from launch import run_ranks  # noqa: E402

LAYOUTS = [("dp 4", 1, 1), ("tp 2 x dp 2", 2, 1), ("tp 2 x pp 2", 2, 2), ("pp 4", 1, 4)]


def _worker(rank, world, tp, pp, checkpoint, args):
    import resource

    import torch
    import torch.distributed as dist
    import train_gpt
    from memory import SavedBytes

    import dsparallel
    from dsparallel.models import GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=args["seq"], hidden=args["hidden"], layers=args["layers"])
    job = train_gpt.make_job(
        cfg, tp, pp, args["micro_batches"], args["batch_size"], checkpoint=checkpoint
    )
    corpus = train_gpt.load_corpus()
    with open("/proc/self/statm") as f:
        rss_before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    step = 0
    for _ in range(args["warmup"]):
        train_gpt.train_step(job, corpus, step)
        step += 1
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        train_gpt.train_step(job, corpus, step)
    step += 1
    seconds = []
    for _ in range(args["steps"]):
        seconds.append(slowest_rank_seconds(lambda s=step: train_gpt.train_step(job, corpus, s)))
        step += 1
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    mine = torch.tensor([saved.peak / 2**20, peak_rss - rss_before])
    every = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(every, mine)
    dsparallel.destroy_parallel()
    tokens = args["batch_size"] * args["seq"]  # per step
    return {
        "tokens_per_s": stats(tokens / t for t in seconds),
        "saved_mb": [e[0].item() for e in every],
        "rss_growth_mb": [e[1].item() for e in every],
    }


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['layout']}{' +ckpt' if r['checkpoint'] else ''}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.barh(labels, [r["tokens_per_s"]["median"] / 1000 for r in rows], color="tab:blue")
    a.set_xlabel("thousand tokens/s")
    a.invert_yaxis()
    b.barh(labels, [max(r["saved_mb"]) for r in rows], color="tab:orange")
    b.set_xlabel("peak MiB held for backward (largest rank)")
    b.invert_yaxis()
    fig.suptitle("GPT job, 4 CPU processes")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--png", help="e.g. docs/figures/hybrid.png")
    ap.add_argument("--replot", help="draw --png from this results file instead of measuring")
    a = ap.parse_args()
    if a.replot:
        with open(a.replot) as f:
            _plot(json.load(f)["rows"], a.png)
        return
    args = {k: getattr(a, k) for k in ("steps", "warmup", "hidden", "layers", "seq")}
    args.update(batch_size=a.batch_size, micro_batches=a.micro_batches)
    rows = []
    for name, tp, pp in LAYOUTS:
        for checkpoint in (False, True):
            result = run_ranks(_worker, 4, tp, pp, checkpoint, args)
            rows.append({"layout": name, "checkpoint": checkpoint, **result})
    print(
        f"GPT {a.layers} layers x {a.hidden} hidden, seq {a.seq}, global batch {a.batch_size}, "
        f"{a.micro_batches} micro-batches, 4 processes on this machine; {a.steps} timed steps"
    )
    print(
        f"{'layout':>14} {'ckpt':>5} {'tokens/s':>9} {'vs dp 4':>8}   "
        f"{'held MiB per rank':<28} rss+ MiB per rank"
    )
    save("hybrid", rows, vars(a))
    base = rows[0]["tokens_per_s"]["median"]
    for r in rows:
        held = " ".join(f"{v:6.1f}" for v in r["saved_mb"])
        rss = " ".join(f"{v:5.1f}" for v in r["rss_growth_mb"])
        print(
            f"{r['layout']:>14} {'yes' if r['checkpoint'] else 'no':>5} "
            f"{r['tokens_per_s']['median']:>9.0f} {r['tokens_per_s']['median'] / base:>7.2f}x   "
            f"{held:<28} {rss}"
        )
    if a.png:
        _plot(rows, a.png)


if __name__ == "__main__":
    main()
