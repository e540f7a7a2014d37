"""Llama and DeepSeek-V3 of about 100M parameters, trained on 4 processes:
our models at several layouts against the ``transformers`` model under
torch's DDP over gloo, in one run (same checkpoint, tokens and optimizer).

    python benchmarks/models.py [--steps 5]

The ``transformers`` model is built from a config (seeded) and saved; our
models load that checkpoint with ``from_pretrained``. Every configuration
trains AdamW (lr 1e-4) on the same global batches of random tokens in
fresh processes. Reported per configuration: training tokens/s (slowest
rank's wall time per step, median/min/max over the timed steps) and the
peak RSS of the largest rank (MiB).

Baselines, defaults and best settings: torch DDP over gloo as constructed
by default, and with ``gradient_as_bucket_view=True`` and ``static_graph``;
for DeepSeek-V3 also ``transformers``' grouped-matmul experts
(``experts_implementation="grouped_mm"``) beside its default loop.

A second part measures ``from_pretrained``'s memory: a fresh process per
rank loads the Llama checkpoint at tp 4; the peak rise of its private
(anonymous) resident memory while loading, sampled every millisecond,
against its shard's bytes plus the largest tensor's. The checkpoint's
pages that the memory-mapped reads bring in are reported apart: they are
the page cache, shared by the ranks and reclaimable.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import save, slowest_rank_seconds, stats  # noqa: E402
from launch import run_ranks  # noqa: E402

VOCAB = 32000
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
DEEPSEEK = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=1408,
    moe_intermediate_size=512,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    num_attention_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    max_position_embeddings=1024,
)
# (name, tp, pp, ep, sequence parallel[, experts over tp]) of our layouts on
# 4 processes.
OURS = {
    "llama": [
        ("dp 4", 1, 1, 1, False),
        ("tp 2 x dp 2", 2, 1, 1, False),
        ("tp 4", 4, 1, 1, False),
        ("tp 4, sequence parallel", 4, 1, 1, True),
        ("tp 2 x pp 2 (1F1B, 4 micro-batches)", 2, 2, 1, False),
    ],
    "deepseek": [
        ("dp 4, ep 4", 1, 1, 4, False),
        ("tp 2 x dp 2, ep 2", 2, 1, 2, False),
        ("tp 2 x dp 2, ep 2, sequence parallel", 2, 1, 2, True),
        ("tp 4", 4, 1, 1, False),
        ("tp 4, sequence parallel", 4, 1, 1, True),
        ("tp 2 x dp 2, ep 4 over tp", 2, 1, 4, False, True),
        ("tp 2 x dp 2, ep 4 over tp, sequence parallel", 2, 1, 4, True, True),
        ("tp 4, ep 4 over tp", 4, 1, 4, False, True),
        ("tp 4, ep 4 over tp, sequence parallel", 4, 1, 4, True, True),
    ],
}


def _batches(args):
    import torch

    g = torch.Generator().manual_seed(0)
    n = args["warmup"] + args["steps"]
    return [torch.randint(0, VOCAB, (args["batch"], args["seq"]), generator=g) for _ in range(n)]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _measure(step, batches, args) -> dict:
    import resource

    import torch
    import torch.distributed as dist

    for b in batches[: args["warmup"]]:
        step(b)
    seconds = [slowest_rank_seconds(lambda b=b: step(b)) for b in batches[args["warmup"] :]]
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = args["batch"] * args["seq"]
    return {"tokens_per_s": stats(tokens / t for t in seconds), "peak_rss_mb": peak.item()}


def _ours(
    rank,
    world,
    kind,
    tp,
    pp,
    ep,
    sp,
    path,
    args,
    precision="fp32",
    fused=False,
    zero=False,
    over_tp=False,
):
    import torch

    import dsparallel
    from dsparallel.models import from_pretrained
    from dsparallel.pipeline import Schedule1F1B

    torch.set_num_threads(1)
    state = dsparallel.init_parallel(tp, pp, expert_parallel_size=ep, experts_over_tp=over_tp)
    kwargs = {
        "fp32": {"dtype": torch.float32},
        "mixed bf16": {"mixed_precision": dsparallel.MixedPrecision()},
        "mixed bf16, bf16 reduce": {
            "mixed_precision": dsparallel.MixedPrecision(reduce_dtype=torch.bfloat16)
        },
        "pure bf16": {"dtype": torch.bfloat16},
    }[precision]
    model = from_pretrained(path, state, sequence_parallel=sp, **kwargs)
    if pp > 1:
        wrap = None
        if state.dp_size > 1:
            wrap = lambda m: dsparallel.DistributedDataParallel(m, process_group=state.dp_group)  # noqa: E731
        schedule = Schedule1F1B(
            model.pipeline_stage(wrap=wrap), n_microbatches=4, loss_fn=model.loss_fn
        )
        runner = None
    else:
        runner = model
        if state.dp_size > 1:
            runner = dsparallel.DistributedDataParallel(model, process_group=state.dp_group)
    if zero:  # ZeRO-1: AdamW's state and step sharded over the data-parallel ranks
        opt = dsparallel.ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            process_group=state.dp_group,
            lr=1e-4,
            fused=fused,
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def step(batch):
        rows = batch.chunk(state.dp_size)[state.dp_rank]
        if runner is not None:
            runner(rows, labels=rows).loss.backward()
        elif model.is_first:
            schedule.step(rows, target=rows if model.is_last else None)
        else:
            schedule.step(target=rows)
        opt.step()
        opt.zero_grad()

    result = _measure(step, _batches(args), args)
    dsparallel.destroy_parallel()
    return result


def _transformers(
    rank, world, kind, path, ddp_options, experts, args, bf16=False, fused=False, zero=False
):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    extra = {"experts_implementation": experts} if experts else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_options)
    if zero:  # torch's ZeRO-1
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=fused)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def step(batch):
        rows = batch.chunk(world)[rank]
        # bf16: torch.autocast, transformers' and torch's CPU mixed precision.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ddp(rows, labels=rows).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    result = _measure(step, _batches(args), args)
    dist.destroy_process_group()
    return result


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _load_memory(rank, world, path):
    """While this rank loads its tp-4 shard: the peak rise of its private
    (anonymous) resident memory, sampled every millisecond, and of the
    checkpoint's pages mapped in (file-backed: the page cache, shared and
    reclaimable), against the shard it keeps."""
    import threading

    import torch

    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(4, 1)
    base = {k: _status_kb(k) for k in ("RssAnon", "RssFile")}
    peak = dict(base)
    done = threading.Event()

    def sample():
        while not done.is_set():
            for k in peak:
                peak[k] = max(peak[k], _status_kb(k))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = from_pretrained(path, state, dtype=torch.float32)
    done.set()
    sampler.join()
    shard = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    mine = ((peak["RssAnon"] - base["RssAnon"]) / 1024, (peak["RssFile"] - base["RssFile"]) / 1024)
    every = [None] * world
    torch.distributed.all_gather_object(every, (*mine, shard))
    dsparallel.destroy_parallel()
    return every


def _save_checkpoints(root: str) -> dict:
    import torch
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    paths = {}
    for kind, cls, cfg in (
        ("llama", LlamaForCausalLM, LlamaConfig(**LLAMA)),
        ("deepseek", DeepseekV3ForCausalLM, DeepseekV3Config(**DEEPSEEK)),
    ):
        torch.manual_seed(0)
        model = cls(cfg)
        paths[kind] = os.path.join(root, kind)
        model.save_pretrained(paths[kind])
        n = sum(p.numel() for p in model.parameters())
        print(f"{kind}: {n / 1e6:.1f}M parameters")
    return paths


# The dtype axis: each model at one fast fp32 layout (of the layouts part),
# float32 against bf16 mixed precision (float32 masters; gradients reduced
# in float32, and in bf16 where data parallel reduces them) and pure bf16,
# against transformers under torch.autocast(bfloat16); AdamW at torch's
# default (foreach) and fused, its best on the CPU.
BEST = {
    "llama": ("tp 4, sequence parallel", 4, 1, 1, True),
    "deepseek": ("dp 4, ep 4", 1, 1, 4, False),
}
BF16_BASELINE = {"gradient_as_bucket_view": True, "static_graph": True}


def _dtype_rows(paths, args, fused_options=(False, True)) -> list[dict]:
    rows = []
    for kind in ("llama", "deepseek"):
        experts = "grouped_mm" if kind == "deepseek" else None
        layout, tp, pp, ep, sp = BEST[kind]
        data_parallel = 4 // (tp * pp) > 1  # data parallel reduces the gradients
        # Under data parallelism also ZeRO-1 (AdamW's float32 state and step
        # sharded, as Megatron's distributed optimizer), ours and torch's.
        zeros = (False, True) if data_parallel else (False,)
        for fused, zero in ((f, z) for f in fused_options for z in zeros):
            adamw = ("fused AdamW" if fused else "AdamW") + (", ZeRO-1" if zero else "")
            name = f"transformers + torch DDP/gloo, autocast bf16, {adamw}"
            r = run_ranks(
                _transformers, 4, kind, paths[kind], BF16_BASELINE, experts, args, True, fused, zero
            )
            rows.append(
                {
                    "model": kind,
                    "seq": args["seq"],
                    "system": "baseline",
                    "precision": "autocast bf16",
                    "fused": fused,
                    "zero": zero,
                    "layout": name,
                    **r,
                }
            )
            print(kind, name, f"{r['tokens_per_s']['median']:.0f} tokens/s")
        precisions = ["fp32", "mixed bf16", "pure bf16"]
        if data_parallel:
            precisions.insert(2, "mixed bf16, bf16 reduce")
        configs = [(p, f, False) for p in precisions for f in fused_options]
        if data_parallel:
            configs += [(p, f, True) for p in ("fp32", "mixed bf16") for f in fused_options]
        for precision, fused, zero in configs:
            r = run_ranks(_ours, 4, kind, tp, pp, ep, sp, paths[kind], args, precision, fused, zero)
            rows.append(
                {
                    "model": kind,
                    "seq": args["seq"],
                    "system": "dsparallel",
                    "precision": precision,
                    "fused": fused,
                    "zero": zero,
                    "layout": layout + (", ZeRO-1" if zero else ""),
                    **r,
                }
            )
            print(
                kind, layout, precision, fused, zero, f"{r['tokens_per_s']['median']:.0f} tokens/s"
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument(
        "--dtype-long-seq",
        type=int,
        default=256,
        help="the dtype axis again at this sequence length (fused AdamW only; 0: not)",
    )
    ap.add_argument(
        "--part",
        choices=["layouts", "dtype", "all"],
        default="all",
        help="the layouts in float32 (results: models), the dtype axis (models_dtype)",
    )
    a = ap.parse_args()
    args = {"steps": a.steps, "warmup": a.warmup, "seq": a.seq, "batch": a.batch}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        paths = _save_checkpoints(root)
        if a.part in ("dtype", "all"):
            dtype_rows = _dtype_rows(paths, args)
            if a.dtype_long_seq:
                # More tokens per step: the optimizer step and the casts,
                # per parameter, weigh less against the per-token compute.
                long = dict(args, seq=a.dtype_long_seq)
                dtype_rows += _dtype_rows(paths, long, fused_options=(True,))
            config = {**vars(a), "llama": LLAMA, "deepseek": DEEPSEEK}
            save("models_dtype", dtype_rows, config)
            _print_dtype(dtype_rows)
        if a.part == "dtype":
            return
        for kind in ("llama", "deepseek"):
            baselines = [
                ("transformers + torch DDP/gloo (defaults)", {}, None),
                (
                    "transformers + torch DDP/gloo (bucket views, static graph)",
                    {"gradient_as_bucket_view": True, "static_graph": True},
                    None,
                ),
            ]
            if kind == "deepseek":
                baselines.append(
                    (
                        "transformers grouped_mm experts + torch DDP/gloo (bucket views)",
                        {"gradient_as_bucket_view": True},
                        "grouped_mm",
                    )
                )
            for name, options, experts in baselines:
                r = run_ranks(_transformers, 4, kind, paths[kind], options, experts, args)
                rows.append({"model": kind, "system": "baseline", "layout": name, **r})
                print(rows[-1]["layout"], f"{r['tokens_per_s']['median']:.0f} tokens/s")
            for name, tp, pp, ep, sp, *over_tp in OURS[kind]:
                r = run_ranks(
                    _ours,
                    4,
                    kind,
                    tp,
                    pp,
                    ep,
                    sp,
                    paths[kind],
                    args,
                    "fp32",
                    False,
                    False,
                    *over_tp,
                )
                rows.append({"model": kind, "system": "dsparallel", "layout": name, **r})
                print(kind, name, f"{r['tokens_per_s']['median']:.0f} tokens/s")
        loads = run_ranks(_load_memory, 4, paths["llama"])
    largest = (LLAMA["vocab_size"] * LLAMA["hidden_size"]) * 4 / 2**20
    load = {
        "anon_rise_mb": [a for a, _, _ in loads],
        "file_pages_mb": [f for _, f, _ in loads],
        "shard_mb": [s for _, _, s in loads],
        "largest_tensor_mb": largest,
    }
    save("models", rows, {**vars(a), "load_memory_tp4": load, "llama": LLAMA, "deepseek": DEEPSEEK})
    for kind in ("llama", "deepseek"):
        mine = [r for r in rows if r["model"] == kind]
        best_base = max(
            (r for r in mine if r["system"] == "baseline"),
            key=lambda r: r["tokens_per_s"]["median"],
        )
        base = best_base["tokens_per_s"]["median"]
        print(f"\n{kind}: tokens/s (x best baseline: {best_base['layout']}), peak RSS MiB")
        for r in mine:
            t = r["tokens_per_s"]
            print(
                f"  {r['system']:>10} {r['layout']:<62} {t['median']:7.0f} "
                f"[{t['min']:.0f}-{t['max']:.0f}] {t['median'] / base:5.2f}x "
                f"{r['peak_rss_mb']:7.0f}"
            )
    print("\nfrom_pretrained at tp 4, per rank (MiB): private memory rise, checkpoint pages, shard")
    for row in zip(load["anon_rise_mb"], load["file_pages_mb"], load["shard_mb"]):
        print("  " + " ".join(f"{v:6.0f}" for v in row))
    print(f"largest tensor {largest:.0f} MiB")


def _print_dtype(rows) -> None:
    for kind in ("llama", "deepseek"):
        mine = [r for r in rows if r["model"] == kind]
        print(f"\n{kind}: tokens/s, peak RSS MiB")
        for r in mine:
            t = r["tokens_per_s"]
            adamw = ("fused" if r["fused"] else "foreach") + (" ZeRO-1" if r.get("zero") else "")
            print(
                f"  seq {r.get('seq', '')} {r['system']:>10} {r['precision']:<14} {adamw:<8} "
                f"{t['median']:7.0f} "
                f"[{t['min']:.0f}-{t['max']:.0f}] {r['peak_rss_mb']:7.0f}"
            )


if __name__ == "__main__":
    main()
