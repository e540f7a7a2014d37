"""DDP step time: torch's DDP and dsparallel's, over gloo and "dsp", in one run.

    python benchmarks/ddp.py [--world 2] [--steps 15] [--hook fp16|bf16]

Two models: a communication-bound MLP (~50M parameters, small batch) and a
compute-bound conv net (small parameters, larger batch). For each model it
measures, per configuration, the median step time (forward, backward with
gradient sync, SGD step; the slowest rank's time per step; the four
configurations are timed in interleaved rounds), and:

  local   the same step with no communication at all (the module alone,
          forward, backward and SGD step)
  comm    all-reducing the gradients' bytes alone, as 25 MB buckets
  hidden  how much of `comm` the overlap hid: 1 - (step - local) / comm

Ratios are against torch DDP over gloo, the configuration users would
otherwise run. ``--hook fp16`` (or ``bf16``) registers torch's compress hook
of that dtype on every configuration (ours takes torch's hooks): the
buckets then travel, and are reduced, in half precision; `comm` then moves
buckets of that dtype.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROUNDS, interleaved_rounds, medians, round_stats, save, timed_stats  # noqa: E402
from launch import run_ranks  # noqa: E402

CONFIGS = [("torch", "gloo"), ("torch", "dsp"), ("dsparallel", "gloo"), ("dsparallel", "dsp")]


def comm_bound_model():
    import torch.nn as nn

    width, depth = 3584, 4  # 4 x 3584^2 ~ 51M parameters
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1]), (8, width)


def compute_bound_model():
    import torch.nn as nn

    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 16, 10),
    )
    return model, (32, 3, 48, 48)


MODELS = {"comm-bound MLP 51M": comm_bound_model, "compute-bound conv": compute_bound_model}


def _worker(rank, world, steps, warmup, hook=None):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import dsparallel

    torch.set_num_threads(1)
    dist.init_process_group("dsp", rank=rank, world_size=world)
    groups = {"dsp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    wrappers = {
        "torch": torch.nn.parallel.DistributedDataParallel,
        "dsparallel": dsparallel.DistributedDataParallel,
    }
    rows = []
    for model_name, make in MODELS.items():
        torch.manual_seed(0)
        model, shape = make()
        x = torch.randn(*shape)

        plain_opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def plain_step(module=model, x=x, opt=plain_opt):
            opt.zero_grad(set_to_none=True)
            module(x).square().mean().backward()
            opt.step()

        local = timed_stats(plain_step, steps, warmup)
        # Communication alone: the gradients' bytes as 25 MB buckets (DDP's
        # cap), preallocated, all launched then awaited, as the reducer does.
        numel = sum(p.numel() for p in model.parameters())
        cap = 25 * 1024 * 1024 // 4
        wire = {None: torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[hook]
        buckets = [torch.zeros(min(cap, numel - i), dtype=wire) for i in range(0, numel, cap)]

        def comm_alone(group, buckets=buckets):
            works = [dist.all_reduce(b, group=group, async_op=True) for b in buckets]
            for w in works:
                w.wait()

        row = {
            "model": model_name,
            "params": sum(p.numel() for p in model.parameters()),
            "local_s": local,
        }
        for backend in ("gloo", "dsp"):
            row[f"comm_{backend}_s"] = timed_stats(
                lambda b=backend: comm_alone(groups[b]),
                steps,
                warmup,
            )
        # All four configurations live side by side and are timed in
        # interleaved rounds (rotating the order), so that drift of the
        # machine over the run does not favour whichever ran first.
        steppers = {}
        for ddp_name, backend in CONFIGS:
            torch.manual_seed(0)
            replica, _ = make()
            ddp = wrappers[ddp_name](replica, process_group=groups[backend])
            if hook:
                compress = getattr(default_hooks, f"{hook}_compress_hook")
                ddp.register_comm_hook(groups[backend], compress)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

            def step(ddp=ddp, opt=opt, x=x):
                opt.zero_grad(set_to_none=True)
                ddp(x).square().mean().backward()
                opt.step()

            steppers[f"{ddp_name}/{backend}"] = step
        rounds = interleaved_rounds(steppers, ROUNDS, max(1, steps // ROUNDS), warmup)
        for k, per_round in rounds.items():
            row[f"{k}_s"] = round_stats(per_round)
        del steppers
        rows.append(row)
    dist.destroy_process_group()
    return rows


def _format(rows):
    rows = [medians(r) for r in rows]
    lines = []
    base_key = "torch/gloo_s"
    for r in rows:
        lines.append(
            f"\n{r['model']}: {r['params'] / 1e6:.2f}M parameters; "
            f"local step (no communication) {r['local_s'] * 1e3:.1f} ms"
        )
        lines.append(
            f"{'configuration':>24} {'step ms':>9} {'vs torch/gloo':>14} "
            f"{'comm alone ms':>14} {'hidden':>7}"
        )
        for ddp_name, backend in CONFIGS:
            step = r[f"{ddp_name}/{backend}_s"]
            comm = r[f"comm_{backend}_s"]
            hidden = 1 - max(0.0, step - r["local_s"]) / comm if comm > 0 else float("nan")
            lines.append(
                f"{ddp_name + ' DDP / ' + backend:>24} {step * 1e3:>9.1f} "
                f"{step / r[base_key]:>13.2f}x {comm * 1e3:>14.1f} "
                f"{max(0.0, hidden) * 100:>6.0f}%"
            )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15, help=f"timed steps, over {ROUNDS} rounds")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hook", choices=["fp16", "bf16"], help="torch's compress hook")
    args = ap.parse_args()
    rows = run_ranks(_worker, args.world, args.steps, args.warmup, args.hook)
    hooked = f", {args.hook} compress hook" if args.hook else ""
    print(
        f"DDP step time, {args.world} ranks{hooked}, median over {ROUNDS} interleaved rounds "
        f"of {max(1, args.steps // ROUNDS)}-step medians"
    )
    print(_format(rows))
    save("ddp" + (f"-{args.hook}-hook" if args.hook else ""), rows, vars(args))


if __name__ == "__main__":
    main()
