"""python -m dsparallel.plan: which layout for this model on these devices.

    python -m dsparallel.plan --model examples/configs/deepseek-v3.json \\
        --cluster h100-80gb-sxm --hosts 8 --global-batch 1024 --seq-len 4096
    python -m dsparallel.plan --model gpt --cluster this.json --global-batch 16 --seq-len 128
    python -m dsparallel.plan calibrate --devices 4 --out this.json
    python -m dsparallel.plan published   # the published figures it reproduces

Every valid layout is estimated (``dsparallel.plan.estimate``); those whose
most loaded rank does not fit ``--margin`` of a device's memory are
dropped, the rest ranked by predicted tokens/s. Prints the top ``--top``
(memory per rank by kind, step time by part, tokens/s, MFU) and the
command line that runs the best.
"""

from __future__ import annotations

import argparse
import sys

from .cluster import PRESETS, read_cluster
from .model import read_model
from .search import search

GB = 1e9


def _gpt(spec: str):
    """``gpt`` or ``gpt:hidden=256,layers=8,...``: our GPT config."""
    from ..models.gpt import GPTConfig

    values = {}
    if ":" in spec:
        for item in spec.split(":", 1)[1].split(","):
            key, value = item.split("=")
            values[key] = int(value)
    return GPTConfig(**values)


def _launcher(world: int, devices_per_host: int) -> str:
    """torchrun for ``world`` processes: on one host, or run on each of the
    hosts with the rendezvous at the first (as torchrun's multi-node use)."""
    if world <= devices_per_host:
        return f"torchrun --nproc-per-node {world}"
    return (
        f"torchrun --nnodes {world // devices_per_host} --nproc-per-node {devices_per_host} "
        "--rdzv-backend c10d --rdzv-endpoint $FIRST_HOST:29500"
    )


def _command(e, model_arg: str, model, seq: int, global_batch: int, devices_per_host: int) -> str:
    lay, kind = e.layout, model.kind
    launch = _launcher(lay.world, devices_per_host)
    if kind == "gpt":
        cfg = model.config
        parts = [
            f"{launch} examples/train_gpt.py",
            f"--hidden {cfg.hidden} --heads {cfg.heads} --layers {cfg.layers} --seq {seq}",
            f"--tensor-parallel {lay.tp}",
            f"--pipeline-parallel {lay.pp}",
            f"--micro-batches {lay.micro_batches}",
            f"--batch-size {global_batch}",
        ]
        if cfg.moe_experts:
            parts.append(
                f"--moe-experts {cfg.moe_experts} --moe-top-k {cfg.moe_top_k} "
                f"--moe-shared-experts {cfg.moe_shared_experts}"
            )
        if lay.pp > 1:
            parts.append(f"--schedule {lay.schedule}")
    else:
        return _trainer_command(launch, lay, model_arg, seq, global_batch)
    if lay.ep > 1:
        parts.append(f"--expert-parallel {lay.ep}")
    if lay.experts_over_tp:
        parts.append("--experts-over-tp")
    if lay.cp > 1:
        parts.append(f"--context-parallel {lay.cp} --cp-mode {lay.cp_mode}")
    if lay.zero:
        parts.append(f"--zero-stage {lay.zero}")
    if lay.recompute:
        parts.append("--checkpoint-activations" if kind == "gpt" else "--recompute")
    return " ".join(parts)


def _trainer_command(launch: str, lay, model_arg: str, seq: int, global_batch: int) -> str:
    """The trainer (``python -m dsparallel.train``) at the planned layout:
    ``job.toml`` is the user's (their ``[data]`` and ``[optim]``); the
    layout, batch and dtype come as overrides."""
    par = [f"tensor={lay.tp}", f"pipeline={lay.pp}"]
    if lay.pp > 1:
        par += [f"schedule={lay.schedule}", f"micro_batches={lay.micro_batches}"]
    if lay.ep > 1:
        par.append(f"expert={lay.ep}")
    if lay.experts_over_tp:
        par.append("experts_over_tp=true")
    if lay.cp > 1:
        par += [f"context={lay.cp}", f"cp_mode={lay.cp_mode}"]
    if lay.sequence_parallel:
        par.append("sequence_parallel=true")
    if lay.zero:
        par.append(f"zero_stage={lay.zero}")
    if lay.recompute:
        par.append("recompute=true")
    parts = [
        f"{launch} -m dsparallel.train --config job.toml --model.name={model_arg}",
        f"--model.dtype={lay.dtype}",
        *(f"--parallel.{p}" for p in par),
        f"--data.seq_len={seq} --data.global_batch={global_batch}",
    ]
    return " ".join(parts)


def _table(rows, cluster) -> str:
    head = (
        "tp pp dp  ep cp  zero  schedule          rc sp  mb x n   "
        "params  grads  optim  activ  total GB |  compute   comm  bubble  optim  step ms | "
        "tokens/s    MFU"
    )
    lines = [head, "-" * len(head)]
    for e in rows:
        lay, mem, t = e.layout, e.memory, e.time
        lines.append(
            f"{lay.tp:2} {lay.pp:2} {lay.dp:2} {lay.ep:2}{'t' if lay.experts_over_tp else ' '} "
            f"{lay.cp:2}  {lay.zero:4}  "
            f"{lay.schedule if lay.pp > 1 else '-':16}  {'y' if lay.recompute else 'n':2} "
            f"{'y' if lay.sequence_parallel else 'n':2} "
            f"{lay.micro_batch:3} x{lay.micro_batches:3}  "
            f"{mem['params'] / GB:7.2f} {mem['grads'] / GB:6.2f} {mem['optimizer'] / GB:6.2f} "
            f"{mem['activations'] / GB:6.2f} {mem['total'] / GB:6.2f}    | "
            f"{t['compute'] * 1e3:8.1f} {t['comm'] * 1e3:6.1f} {t['bubble'] * 1e3:7.1f} "
            f"{t['optimizer'] * 1e3:6.1f} {t['total'] * 1e3:8.1f} | "
            f"{e.tokens_per_s:9.0f} {e.mfu:6.1%}"
        )
    return "\n".join(lines)


def _png(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("params", "grads", "optimizer", "activations")
    labels = [
        f"tp{e.layout.tp} pp{e.layout.pp} dp{e.layout.dp} ep{e.layout.ep}"
        f"{'t' if e.layout.experts_over_tp else ''} cp{e.layout.cp} "
        f"z{e.layout.zero}{' rc' if e.layout.recompute else ''}"
        for e in rows
    ]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    for kind in kinds:
        values = [e.memory[kind] / GB for e in rows]
        ax.barh(labels, values, left=left, label=kind)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set_xlabel("GB per rank (most loaded), predicted")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["published"]:
        from .published import report

        print(report())
        return 0
    if argv[:1] == ["calibrate"]:
        ap = argparse.ArgumentParser(prog="python -m dsparallel.plan calibrate")
        ap.add_argument("--devices", type=int, default=4)
        ap.add_argument("--dtype", default="float32")
        ap.add_argument("--out", required=True)
        a = ap.parse_args(argv[1:])
        from .calibrate import calibrate

        cluster = calibrate(a.devices, a.dtype, a.out)
        print(f"wrote {a.out}: {cluster}")
        return 0
    ap = argparse.ArgumentParser(prog="python -m dsparallel.plan", description=__doc__)
    ap.add_argument("--model", required=True, help="config.json (or its directory), gpt[:k=v,..]")
    ap.add_argument("--cluster", required=True, help=f"a JSON file or {', '.join(PRESETS)}")
    ap.add_argument("--hosts", type=int, default=None, help="hosts of a preset (default 1)")
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the model's dtype: bfloat16 by default, float32 for the GPT job (its only one)",
    )
    ap.add_argument("--margin", type=float, default=0.9, help="share of device memory a plan fills")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--png", default=None, help="draw memory by kind of the top layouts")
    a = ap.parse_args(argv)
    try:
        model = read_model(_gpt(a.model) if a.model.startswith("gpt") else a.model)
        cluster = read_cluster(a.cluster, a.hosts)
        dtype = a.dtype or ("float32" if model.kind == "gpt" else "bfloat16")
        if model.kind == "gpt" and dtype != "float32":
            raise ValueError(f"the GPT job trains in float32 only, not {dtype}")
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, count, smallest = search(model, cluster, a.global_batch, a.seq_len, dtype, a.margin)
    print(
        f"{count} layouts of {model.kind} on {cluster.devices} x {cluster.name} "
        f"({cluster.memory_bytes / GB:.0f} GB each, {cluster.source or 'no source stated'}); "
        f"{len(rows)} fit {a.margin:.0%} of a device's memory. Predictions, fastest first:"
    )
    if not rows:
        if smallest is not None:
            lay = smallest.layout
            print(
                f"The least memory: {smallest.memory['total'] / GB:.1f} GB on the most loaded "
                f"rank (tp {lay.tp} pp {lay.pp} dp {lay.dp} ep {lay.ep}"
                f"{' over tp' if lay.experts_over_tp else ''} cp {lay.cp}, ZeRO "
                f"{lay.zero}{', recomputed' if lay.recompute else ''}): more devices, or a "
                "smaller batch or sequence, are needed."
            )
        return 1
    print(_table(rows[: a.top], cluster))
    best = _command(rows[0], a.model, model, a.seq_len, a.global_batch, cluster.devices_per_host)
    where = " (on each host; FIRST_HOST: the first's address)" if cluster.hosts > 1 else ""
    print(f"\nthe best{where}:", best)
    if a.png:
        _png(rows[: a.top], a.png)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
