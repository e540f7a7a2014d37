"""Expert parallelism: our C++ dispatch/combine against the same built from
torch's ops, the MoE layer against a dense MLP, and the expert load over
training with and without the balancing bias.

    python benchmarks/moe.py [--worlds 2 4] [--steps 15] [--plot docs/figures/moe-load.png]

For each size (tokens per rank, hidden; 8 experts, top-2, routing from a
random router) it times forward + backward (median step, slowest rank) of:

  dispatch+combine  tokens to their experts and back, the experts left out
                    (y = the dispatched rows), so that only the moving counts:
      ours / dsp, ours / gloo   ``dsparallel.moe`` ops (C++: counting sort, one
                                count exchange, one uneven all-to-all each way)
      torch / dsp, torch / gloo Megatron's recipe from torch ops in Python:
                                argsort, all_to_all_single of the counts,
                                ``all_to_all_single_autograd`` each way, the
                                regroup by split + cat
  MoE layer / dsp   ``dsparallel.moe.MoE`` (8 experts of 4h/2, top-2) over the
                    world as expert-parallel group
  dense MLP         h -> 4h -> h in each process: the routed experts' active
                    parameters

all in interleaved rounds in one run. Ratios: ours over torch's ops on gloo
and on dsp, and the share of the MoE layer's time that dispatch + combine
take. With ``--plot`` it also trains the GPT job's model with 8 experts in
one process, with the bias (rate 1e-3) and without, and plots the load per
expert of its first MoE block over the steps.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROUNDS, interleaved_rounds, medians, round_stats, save  # noqa: E402
from launch import run_ranks  # noqa: E402

EXPERTS, TOP_K = 8, 2
# (tokens per rank, hidden): the GPT job's (4 sequences of 64 x 128) and larger.
SIZES = [(256, 128), (1024, 256), (4096, 512)]


def torch_dispatch_combine(x, idx, gates, group):
    """Tokens to experts and back with torch's ops (as Megatron's all-to-all
    dispatcher does), the experts being the identity."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    world, k = dist.get_world_size(group), idx.shape[1]
    local = EXPERTS // world
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=EXPERTS)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send = counts.view(world, local).sum(1).tolist()
    recv_by = recv_counts.view(world, local)
    recv = recv_by.sum(1).tolist()
    rows = all_to_all_single_autograd(x[order // k], recv, send, group)
    # [source, expert] -> [expert, source] and back (sort_chunks_by_idxs).
    chunks = rows.split(recv_by.flatten().tolist())
    y = torch.cat([chunks[s * local + e] for e in range(local) for s in range(world)])
    parts = y.split(recv_by.t().flatten().tolist())
    back = torch.cat([parts[e * world + s] for s in range(world) for e in range(local)])
    returned = all_to_all_single_autograd(back, send, recv, group)
    slots = x.new_zeros(flat.numel(), x.shape[1]).index_copy(0, order, returned)
    return torch.bmm(gates.unsqueeze(1), slots.view(-1, k, x.shape[1])).squeeze(1)


def ours_dispatch_combine(x, idx, gates, group):
    from dsparallel.moe import Plan, combine, dispatch

    plan = Plan(idx, EXPERTS, group)
    return combine(dispatch(x, plan), gates, plan)


def _time_size(rank, world, tokens, hidden, groups, steps, warmup):
    import torch
    import torch.nn.functional as F

    from dsparallel.moe import MoE

    torch.manual_seed(rank)
    x = torch.randn(tokens, hidden, requires_grad=True)
    router = torch.randn(hidden, EXPERTS)
    probs = (x.detach() @ router).softmax(-1)
    gates, idx = probs.topk(TOP_K, dim=-1)
    gates.requires_grad_()
    torch.manual_seed(0)
    moe = MoE(hidden, 4 * hidden // TOP_K, EXPERTS, TOP_K, group=groups["dsp"])
    fc1, fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def run(fn, group):
        def step():
            x.grad = gates.grad = None
            fn(x, idx, gates, group).sum().backward()

        return step

    def layer():
        moe.zero_grad()
        moe(x).sum().backward()

    def dense():
        fc1.zero_grad()
        fc2.zero_grad()
        fc2(F.gelu(fc1(x))).sum().backward()

    steppers = {}
    for name, g in groups.items():
        steppers[f"ours / {name}"] = run(ours_dispatch_combine, g)
        steppers[f"torch / {name}"] = run(torch_dispatch_combine, g)
    steppers["MoE layer / dsp"] = layer
    steppers["dense MLP"] = dense
    rounds = interleaved_rounds(steppers, ROUNDS, max(1, steps // ROUNDS), warmup)
    row = {"world": world, "tokens": tokens, "hidden": hidden}
    row.update({k: round_stats(v) for k, v in rounds.items()})
    return row


def _worker(rank, world, steps, warmup):
    import torch
    import torch.distributed as dist

    import dsparallel  # noqa: F401  (registers "dsp")

    torch.set_num_threads(1)
    dist.init_process_group("dsp", rank=rank, world_size=world)
    groups = {"dsp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    rows = [_time_size(rank, world, t, h, groups, steps, warmup) for t, h in SIZES]
    dist.destroy_process_group()
    return rows


def _format(rows):
    rows = [medians(r) for r in rows]
    head = (
        f"{'ranks':>5} {'tokens x hidden':>16} {'ours/dsp':>9} {'ours/gloo':>9} "
        f"{'torch/dsp':>9} {'torch/gloo':>10} {'ours:dsp / torch:gloo':>22} "
        f"{'ours / torch (dsp)':>18} {'ours / torch (gloo)':>19}"
    )
    lines = ["dispatch + combine, forward + backward (ms)", head]
    for r in rows:
        od, og, td, tg = (
            r[k] for k in ("ours / dsp", "ours / gloo", "torch / dsp", "torch / gloo")
        )
        size = f"{r['world']:>5} {r['tokens']:>7} x {r['hidden']:<6}"
        lines.append(
            f"{size} {od * 1e3:>9.3f} {og * 1e3:>9.3f} {td * 1e3:>9.3f} {tg * 1e3:>10.3f} "
            f"{od / tg:>21.2f}x {od / td:>17.2f}x {og / tg:>18.2f}x"
        )
    lines += ["", "MoE layer (8 experts, top-2, expert parallel = ranks) against the dense MLP"]
    lines.append(
        f"{'ranks':>5} {'tokens x hidden':>16} {'MoE ms':>9} {'dense ms':>9} {'MoE/dense':>9} "
        f"{'dispatch+combine share':>23}"
    )
    for r in rows:
        m, d, od = r["MoE layer / dsp"], r["dense MLP"], r["ours / dsp"]
        lines.append(
            f"{r['world']:>5} {r['tokens']:>7} x {r['hidden']:<6} {m * 1e3:>9.3f} {d * 1e3:>9.3f} "
            f"{m / d:>8.2f}x {od / m:>22.0%}"
        )
    return "\n".join(lines)


def _train_loads(steps: int, bias: bool):
    """Per-step tokens per expert of the first MoE block of the GPT job's
    model (8 experts, top-2), trained in one process."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import train_gpt

    from dsparallel.models import GPTConfig, build_stage, gpt_loss
    from dsparallel.moe import moe_layers, update_expert_bias

    torch.set_num_threads(1)
    dist.init_process_group("dsp", rank=0, world_size=1)
    cfg = GPTConfig(seq_len=64, hidden=128, layers=4, moe_experts=EXPERTS, moe_top_k=TOP_K)
    model = build_stage(cfg)
    layers = moe_layers(model)
    if not bias:
        for m in layers:
            m.router.bias_update_rate = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loss_fn, corpus = gpt_loss(), train_gpt.load_corpus()
    loads = []
    for step in range(steps):
        ids, target = train_gpt.batch(corpus, step, 16, cfg.seq_len)
        before = layers[0].router.total_load.clone()
        loss_fn(model(ids), target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_expert_bias(model)
        loads.append((layers[0].router.total_load - before).tolist())
    dist.destroy_process_group()
    return loads


def _load_worker(rank, world, steps, bias):
    return _train_loads(steps, bias)


def _plot(path, runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, (title, loads) in zip(axes, runs.items()):
        for e in range(EXPERTS):
            ax.plot([row[e] / sum(row) for row in loads], label=f"expert {e}", lw=1)
        ax.axhline(1 / EXPERTS, color="k", ls="--", lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("training step")
    axes[0].set_ylabel("share of block 0's assignments")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4], help="none: the plot only")
    ap.add_argument("--steps", type=int, default=15, help=f"timed steps, over {ROUNDS} rounds")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--plot", help="PNG of the per-expert load over training")
    ap.add_argument("--train-steps", type=int, default=300)
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        rows += run_ranks(_worker, world, args.steps, args.warmup)
    if rows:
        print(
            "MoE on CPU (1 thread per rank), median of "
            f"{ROUNDS} interleaved rounds of {max(1, args.steps // ROUNDS)}-step medians"
        )
        print(_format(rows))
    if args.plot:
        runs = {}
        for bias, title in ((True, "balancing bias (rate 1e-3)"), (False, "no bias")):
            runs[title] = run_ranks(_load_worker, 1, args.train_steps, bias)
        _plot(args.plot, runs)
        print("")
        for title, loads in runs.items():
            last = loads[-len(loads) // 10 :]
            share = [sum(r[e] for r in last) for e in range(EXPERTS)]
            busiest = max(share) / (sum(share) / EXPERTS)
            print(
                f"{title}: busiest expert / mean load over the last tenth of "
                f"{len(loads)} steps = {busiest:.2f}"
            )
            rows.append({"load": title, "steps": len(loads), "busiest_over_mean": busiest})
        print(f"load plot: {args.plot}")
    save("moe", rows, vars(args))


if __name__ == "__main__":
    main()
