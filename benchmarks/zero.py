"""Memory per rank and step time of sharded optimizers over "dsp".

    python benchmarks/zero.py [--worlds 2 4] [--repeats 5] [--png docs/figures/zero-memory.png]

On an MLP of ``layers`` Linear(width, width) layers (12 x 2048: 50M
parameters), one run per configuration and world size, each rank measures
the bytes of optimizer state and of gradients it actually holds after
backward and step, its peak RSS, and the median step time (forward,
backward, step; steps back to back after one barrier) over the timed steps.
Each configuration runs ``repeats`` times, round-robin with the others (so
a drift of the machine hits all alike), and its step time is the median of
its runs:

- torch DDP + AdamW (the baseline: every rank holds everything),
- torch DDP + torch's ZeroRedundancyOptimizer (stage 1, whole parameters per rank),
  as constructed by default and with ``fused=True`` (ours picks the fused
  kernel itself when the user chose none: both are shown),
- our DDP + AdamW (our plain data parallelism),
- our DDP + dsparallel.ZeroRedundancyOptimizer (stage 1, even flat shards),
- our DDP(zero_stage=2) + dsparallel.ZeroRedundancyOptimizer (stage 2:
  gradients reduce-scattered into shards), and the same with
  ``overlap_param_gather=True`` (each step's all-gathers overlap the next
  forward),
- torch's FSDP2 (fully_shard per layer) + AdamW over "dsp" (stage 3), and
  the same over gloo.

All over the "dsp" backend but the last. Ratios are against the baseline of the same
run; the last lines compare stage 2's step time with our plain DDP's and
with torch DDP + torch's ZeroRedundancyOptimizer's, and each rank's state
and gradients with plain / N.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from common import save, stats
from launch import run_ranks

CONFIGS = [
    "ddp+adamw",
    "ddp+torch-zero1",
    "ddp+torch-zero1-fused",
    "ours-ddp+adamw",
    "ours-zero1",
    "ours-zero2",
    "ours-zero2-overlap",
    "fsdp2",
    "fsdp2-gloo",
]


def _bytes(t) -> int:
    local = getattr(t, "_local_tensor", t)  # DTensor: this rank's shard
    return local.numel() * local.element_size()


def _state_bytes(opt) -> int:
    inner = getattr(opt, "_inner", None) or getattr(opt, "optim", None) or opt
    tensors = [v for s in inner.state.values() for v in s.values() if hasattr(v, "numel")]
    return sum(_bytes(v) for v in tensors if v.dim())


def _body(rank, world, config, layers, width, steps):
    import torch
    import torch.distributed as dist
    from torch import nn

    import dsparallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo" if config.endswith("gloo") else "dsp")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if config.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # A CPU mesh, given explicitly: on a machine with a GPU the default is a CUDA mesh
        # (NCCL refuses two ranks on one GPU).
        mesh = init_device_mesh("cpu", (world,))

        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif config.startswith("ours"):
        stage = 2 if config.startswith("ours-zero2") else 0
        overlap = config.endswith("overlap")
        wrapped = dsparallel.DistributedDataParallel(
            model, zero_stage=stage, overlap_param_gather=overlap
        )
        if config == "ours-ddp+adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
        if config.startswith("ddp+torch-zero1"):
            from torch.distributed.optim import ZeroRedundancyOptimizer

            fused = {"fused": True} if config.endswith("fused") else {}
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, **fused)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, width)
    times = []
    # One barrier, then steps back to back (a barrier per step would also
    # wait for the all-gathers that overlap_param_gather leaves running).
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        wrapped(x).square().mean().backward()
        grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        if config.startswith("ours-zero2"):  # no .grad: the reducer's shards and what it held
            grads += sum(_bytes(g) for g in wrapped.reducer.grad_shards())
            grads += wrapped.reducer.staging_bytes
        opt.step()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    if config == "ours-zero2-overlap":
        wrapped.wait_param_gather()
    params = sum(_bytes(p) for p in model.parameters())
    staging = bucket = 0
    if config.startswith("ours-zero2"):
        staging = wrapped.reducer.staging_bytes
        bucket = max(wrapped.reducer.padded_numels()) * model[0].weight.element_size()
    row = {
        "params": params,
        "grads": grads,
        "state": _state_bytes(opt),
        "staging": staging,
        "bucket": bucket,
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step": statistics.median(times[1:]),
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    dist.destroy_process_group()
    return rows


def _compare(results, world):
    """The summary lines of one world size, from whichever rows ran."""

    def step_of(config):
        return results[(world, config)][0]["step"] if (world, config) in results else None

    against = [
        ("ours-ddp+adamw", "our DDP + AdamW"),
        ("ddp+torch-zero1", "torch DDP + torch ZeroRedundancyOptimizer"),
        ("ddp+torch-zero1-fused", "the same with fused=True"),
    ]
    for config in ("ours-zero2", "ours-zero2-overlap"):
        step = step_of(config)
        ratios = [f"{step / step_of(c):.2f}x {name}" for c, name in against if step and step_of(c)]
        if ratios:
            print(f"{config} step time: " + ", ".join(ratios))
    if step_of("fsdp2") and step_of("fsdp2-gloo"):
        ratio = step_of("fsdp2") / step_of("fsdp2-gloo")
        print(f"FSDP2 step time over dsp: {ratio:.2f}x over gloo")
    if (world, "ours-zero2") in results and (world, "ddp+adamw") in results:
        z2, plain = results[(world, "ours-zero2")], results[(world, "ddp+adamw")][0]
        print(
            "stage 2 per rank / (plain / N): opt state "
            f"{[round(x['state'] / (plain['state'] / world), 4) for x in z2]}, grads "
            f"{[round(x['grads'] / (plain['grads'] / world), 4) for x in z2]} "
            f"(grads include the most the reducer held besides its shards during "
            f"backward: {z2[0]['staging'] / 1e6:.1f} MB; the largest bucket is "
            f"{z2[0]['bucket'] / 1e6:.1f} MB)"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs per configuration, round-robin over the configurations; the step "
        "time's median, min and max are over the runs' medians",
    )
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    p.add_argument("--png", help="stacked bars of memory per rank")
    args = p.parse_args()
    n = args.layers * (args.width * args.width + args.width)
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}): {n / 1e6:.1f}M params, fp32")
    results, rows = {}, []
    for world in args.worlds:
        print(f"\n{world} ranks over dsp (rank 0; MB)")
        print(
            f"{'config':>21} | {'params':>7} {'grads':>7} {'opt state':>9} {'peak RSS':>8} | "
            f"{'state/base':>10} {'step ms':>8} {'step/base':>9}"
        )
        runs = {c: [] for c in args.configs}
        for _ in range(args.repeats):
            for config in args.configs:
                runs[config].append(
                    run_ranks(_body, world, config, args.layers, args.width, args.steps)
                )
        base = None
        for config in args.configs:
            # Bytes are the same every run; the step time is the median over runs.
            r = runs[config][-1]
            every = [run[0]["step"] for run in runs[config]]
            r[0]["step"] = statistics.median(every)
            results[(world, config)] = r
            rows.append(
                {
                    "world": world,
                    "config": config,
                    "step_s": stats(every),
                    **{k: [x[k] for x in r] for k in ("params", "grads", "state", "rss")},
                }
            )
            base = base or r[0]
            mb = 1e6
            print(
                f"{config:>21} | {r[0]['params'] / mb:7.1f} {r[0]['grads'] / mb:7.1f} "
                f"{r[0]['state'] / mb:9.1f} {r[0]['rss'] / mb:8.0f} | "
                f"{r[0]['state'] / base['state']:10.3f} {r[0]['step'] * 1e3:8.0f} "
                f"{r[0]['step'] / base['step']:9.2f}",
                flush=True,
            )
            print(f"{'':>21}   step ms per run: {[round(t * 1e3) for t in every]}")
            if world > 1:
                states = [x["state"] for x in r]
                print(f"{'':>21}   opt state per rank (MB): {[round(s / mb, 1) for s in states]}")
        _compare(results, world)
    save("zero", rows, vars(args))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.worlds), figsize=(6 * len(args.worlds), 4))
        for ax, world in zip(axes if len(args.worlds) > 1 else [axes], args.worlds):
            rows = [results[(world, c)][0] for c in args.configs]
            bottom = [0.0] * len(args.configs)
            for key in ("params", "grads", "state"):
                vals = [r[key] / 1e6 for r in rows]
                ax.bar(args.configs, vals, bottom=bottom, label=key)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_title(f"{world} ranks: memory per rank (rank 0)")
            ax.set_ylabel("MB")
            ax.set_xticks(range(len(args.configs)), args.configs, rotation=30, ha="right")
            ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        fig.savefig(args.png)
        print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
