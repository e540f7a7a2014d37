"""Pipeline step time, bubble and activation memory: dsparallel's schedules
against torch.distributed.pipelining on the same model and backend, in one run.

    python benchmarks/pipeline.py [--ranks 2] [--micro-batches 8] [--steps 20] [--timeline t.png]

(``--timeline`` is docs/figures/pipeline.png by default: it writes
pipeline_<schedule>.png there for each of our schedules, the step of median
bubble under its plan; ``--timeline ''`` none.)

``--ranks`` processes (an MLP of two blocks per rank: one stage of two
blocks per rank, or two stages of one block: for the V-shaped schedules rank
r holds stages r and 2 x ranks - 1 - r, for the interleaved ones r and r +
ranks). For GPipe, 1F1B, zero-bubble ZB-H1 (torch's
ScheduleInterleavedZeroBubble with one stage per rank, ours "zb1p"),
interleaved 1F1B ("int1f1b") and interleaved zero bubble ("intzb1p": the
same two classes with two stages per rank), ZBV and DualPipeV under both
libraries it reports
the step time (slowest rank; every configuration timed in interleaved
rounds; median, min and max over the rounds' medians) against torch's
schedule of the same name and against torch's fastest schedule on the same
model, ranks and micro-batches, the measured bubble of our runs (from per-action
times: 1 - busy / (ranks x span); the median over the timed steps, with its
range) next to the planned one (the C++ simulator run with each stage's
mean measured F, B, I and W times in that schedule) and the one replayed
from each step's own action times (``pp.replayed``: the measured order and
durations, no runtime, so what the measured bubble has beyond it is the
runtime's), and the first stage's peak activation memory: bytes of
distinct storages held by autograd for backward (tensors saved through
saved_tensors_hooks), measured the same way for both; for ours, next to the
schedule's bound for that rank (its planned peak of micro-batches in flight
times what one micro-batch adds to a stage, plus what is saved once: the
weights and the batch's storage). For the split schedules it says which
share of the backward time was W (deferred) and which parameters, if any,
had their gradient computed inside I. The last lines set each split
schedule's measured step time against our 1F1B's (intzb1p's against our
int1f1b's) next to the planned ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROUNDS, interleaved_rounds, round_stats, save  # noqa: E402
from launch import run_ranks  # noqa: E402
from memory import SavedBytes  # noqa: E402

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zb1p": "ScheduleInterleavedZeroBubble",
    "int1f1b": "ScheduleInterleaved1F1B",
    "intzb1p": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
V_SHAPED = ("zbv", "dualpipev")
LOOPED = ("int1f1b", "intzb1p")  # two stages per rank: r, r + ranks
SPLIT = ("zb1p", "intzb1p", "zbv", "dualpipev")  # the backward split into I and W


def _median_durations(entries) -> dict[str, float]:
    """Per action kind ("SEND_F", ...), the median duration in microseconds."""
    from dsparallel.pipeline.timeline import parse_action

    per_kind = {}
    for name, start, end in entries:
        per_kind.setdefault(parse_action(name)[1], []).append(end - start)
    return {k: 1e6 * statistics.median(v) for k, v in sorted(per_kind.items())}


def _stage_module(index, width, blocks):
    import torch
    from torch import nn

    torch.manual_seed(index)
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.GELU())])


def _saved_by_forwards(forward, inputs) -> int:
    """Peak bytes autograd saves for backward over ``forward(k, input)`` of
    each input, all kept."""
    import torch

    meter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        outs = [forward(k, t.detach().requires_grad_()) for k, t in enumerate(inputs)]
    del outs
    return meter.peak


def _stage_forward(module, loss_fn, targets):
    """forward(k, t) of one stage on micro-batch k; the last stage adds its loss."""
    if loss_fn is None:
        return lambda k, t: module(t)
    return lambda k, t: loss_fn(module(t), targets[k])


def _memory_bound(forwards, micro_batches, peak_in_flight) -> int:
    """The schedule's activation bound in bytes for this rank: what its stages
    save once whatever the micro-batch count (weights, the target's storage),
    plus ``peak_in_flight`` (from the C++ plan) times the most one
    micro-batch adds to one stage (the second forward's extra bytes; the last
    stage's forward includes the loss)."""
    once, per_micro_batch = 0, 0
    for forward in forwards:
        one = _saved_by_forwards(forward, micro_batches[:1])
        two = _saved_by_forwards(forward, micro_batches[:2])
        per_micro_batch = max(per_micro_batch, two - one)
        once += one - (two - one)
    return once + peak_in_flight * per_micro_batch


def _worker(rank, world, args):
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp
    from torch import nn

    import dsparallel  # noqa: F401
    import dsparallel.pipeline as pp

    torch.set_num_threads(1)
    dist.init_process_group("dsp", rank=rank, world_size=world)
    m, width = args.micro_batches, args.width
    loss_fn = nn.functional.mse_loss
    x = torch.randn(args.batch_size, width)
    y = torch.randn(args.batch_size, width)
    configs = {}
    for lib in ("torch", "dsparallel"):
        for name in SCHEDULES:
            v, two = name in V_SHAPED, name in V_SHAPED or name in LOOPED
            n_stages = 2 * world if two else world
            indices = [rank, 2 * world - 1 - rank] if v else [rank, rank + world] if two else [rank]
            blocks = args.blocks_per_stage // 2 if two else args.blocks_per_stage
            modules = [_stage_module(i, width, blocks) for i in indices]
            if lib == "torch":
                stages = [
                    tpp.PipelineStage(mod, i, n_stages, torch.device("cpu"))
                    for mod, i in zip(modules, indices)
                ]
                cls = getattr(tpp, SCHEDULES[name])
            else:
                stages = [pp.PipelineStage(mod, i, n_stages) for mod, i in zip(modules, indices)]
                cls = getattr(pp, SCHEDULES[name])
            one = name in ("gpipe", "1f1b") or (name == "zb1p" and lib == "dsparallel")
            sched = cls(stages[0] if one else stages, m, loss_fn=loss_fn)
            traces_of = []  # ours: this rank's measured trace of every step

            def step(sched=sched, modules=modules, traces_of=traces_of, lib=lib, v=v):
                for module in modules:
                    module.zero_grad(set_to_none=True)
                if rank == 0 and v:  # the first and the last stage
                    sched.step(x, target=y, losses=[])
                elif rank == 0:
                    sched.step(x)
                elif v:
                    sched.step()
                else:
                    sched.step(target=y, losses=[])
                if lib == "dsparallel":
                    traces_of.append((sched.trace, sched.transfer_trace))

            for _ in range(2):
                step()
            saved = SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                step()
            traces_of.clear()  # keep the timed steps only
            # Each local stage's forward on one micro-batch, for the memory bound.
            forwards = [
                _stage_forward(mod, loss_fn if i == n_stages - 1 else None, y.chunk(m))
                for mod, i in zip(modules, indices)
            ]
            configs[(lib, name)] = (step, traces_of, saved.peak, forwards, sched)

    steppers = {k: step for k, (step, *_) in configs.items()}
    rounds = interleaved_rounds(steppers, ROUNDS, max(1, args.steps // ROUNDS))
    rows, traces = [], {}
    for (lib, name), (_step, traces_of, peak, forwards, sched) in configs.items():
        row = {
            "lib": lib,
            "schedule": name,
            "step_s": round_stats(rounds[(lib, name)]),
            "peak_saved_bytes": peak,
        }
        if lib == "dsparallel":
            # Every timed step's trace from every rank: the bubble of each
            # step, reported as the median (one step alone is noisy here).
            everyone = [None] * world
            dist.all_gather_object(everyone, traces_of)
            steps = [[everyone[r][i][0] for r in range(world)] for i in range(len(traces_of))]
            moves = [[everyone[r][i][1] for r in range(world)] for i in range(len(traces_of))]
            measured = [pp.bubble(t) for t in steps]
            bubbles = sorted((b, i) for i, b in enumerate(measured))
            median_bubble, median_step = bubbles[len(bubbles) // 2]
            row["bubble_measured"] = median_bubble
            row["bubble_range"] = [bubbles[0][0], bubbles[-1][0]]
            # Each step replayed with its own action times and no runtime:
            # the schedule's bubble under the compute that happened.
            replays = [pp.bubble(pp.replayed(t)) for t in steps]
            row["bubble_replayed"] = statistics.median(replays)
            row["over_replayed"] = sorted(m / r for m, r in zip(measured, replays))
            row["breakdown"] = pp.bubble_breakdown(steps[median_step], moves[median_step])
            row["transfers_us"] = _median_durations(
                m for t in moves for rank_moves in t for m in rank_moves
            )
            entries = [e for t in steps for rank_trace in t for e in rank_trace]
            costs = pp.mean_costs([entries], sched.num_stages)
            plan = sched.plan.validate(costs=costs)  # the plan the schedule runs
            row["bubble_planned"] = plan.bubble
            row["planned_makespan"] = plan.makespan
            row["costs"] = costs
            row["memory_bound"] = _memory_bound(forwards, x.chunk(m), plan.peak_in_flight[rank])
            traces[name] = (sched.plan, steps[median_step])  # the step of median bubble
            # Of the last step: every rank's share of its backward deferred to W.
            shares = [None] * world
            dist.all_gather_object(shares, sched.split_report())
            row["split"] = {s: e for per_rank in shares for s, e in per_rank.items()}
        rows.append(row)
    if rank == 0 and args.timeline:
        root, ext = os.path.splitext(args.timeline)
        os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
        for name, (plan, measured) in traces.items():
            pp.plot_schedule(plan, f"{root}_{name}{ext}", title=f"our {name}", measured=measured)
    dist.destroy_process_group()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks-per-stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeline", default="docs/figures/pipeline.png")
    args = ap.parse_args()
    rows = run_ranks(_worker, args.ranks, args)
    save("pipeline", rows, vars(args))
    for r in rows:  # printed below by median
        r["step_stats"], r["step_s"] = r["step_s"], r["step_s"]["median"]
    print(
        f"{args.ranks} ranks ({args.ranks} stages; {2 * args.ranks} for int1f1b and intzb1p, "
        f"stages r and r + {args.ranks} on rank r, and for zbv and dualpipev, in a V), "
        f"{args.micro_batches} micro-batches of {args.batch_size // args.micro_batches}"
        f", width {args.width}, median of {args.steps} steps per configuration in "
        f"{ROUNDS} interleaved rounds; memory: first stage"
    )
    print(
        f"{'library':>11} {'schedule':>9} {'step ms':>9} {'vs torch':>9} {'vs fastest':>10} "
        f"{'bubble meas/plan':>17} {'(range)':>13} {'peak saved MB':>14} {'bound MB':>9}"
    )
    ref = {r["schedule"]: r["step_s"] for r in rows if r["lib"] == "torch"}
    fastest = min(ref, key=ref.get)
    for r in rows:
        bubble, spread = "-", ""
        if "bubble_measured" in r:
            bubble = f"{r['bubble_measured']:.1%} / {r['bubble_planned']:.1%}"
            lo, hi = r["bubble_range"]
            spread = f"({lo:.0%}-{hi:.0%})"
        print(
            f"{r['lib']:>11} {r['schedule']:>9} {r['step_s'] * 1e3:>9.1f} "
            f"{r['step_s'] / ref[r['schedule']]:>8.2f}x {r['step_s'] / ref[fastest]:>9.2f}x "
            f"{bubble:>17} {spread:>13} "
            f"{r['peak_saved_bytes'] / 2**20:>14.2f} "
            + (f"{r['memory_bound'] / 2**20:>9.2f}" if "memory_bound" in r else f"{'-':>9}")
        )
    print(f"torch's fastest schedule here: {fastest}")
    ours = {r["schedule"]: r for r in rows if r["lib"] == "dsparallel"}
    for name, r in ours.items():
        d = r["breakdown"]
        parts = (
            f"wait {d['wait']:.1%}, overhead {d['overhead']:.1%} (in transfers "
            f"{d['in_transfers']:.1%}, between actions {d['between']:.1%}), tail {d['tail']:.1%}"
        )
        print(
            f"our {name} measured bubble {r['bubble_measured']:.1%} = {parts} "
            f"(planned {r['bubble_planned']:.1%})"
        )
    for name, r in ours.items():
        over = r["over_replayed"]
        print(
            f"our {name} bubble replayed from each step's own action times (no runtime): "
            f"{r['bubble_replayed']:.1%} median; measured / replayed "
            f"{statistics.median(over):.2f} median ({over[0]:.2f}-{over[-1]:.2f})"
        )
    for name, r in ours.items():
        moves = ", ".join(f"{k} {v:.1f}" for k, v in r["transfers_us"].items())
        print(f"our {name} median us per transfer action: {moves}")
    for name, r in ours.items():
        per_stage = "; ".join(
            f"s{s} " + " ".join(f"{k}{c}" for k, c in zip("FBIW", costs) if c > 1)
            for s, costs in enumerate(r["costs"])
        )
        busy = r["step_s"] * (1 - r["bubble_measured"]) * 1e3
        print(f"our {name} mean us per action: {per_stage}; busy {busy:.1f} ms per rank")
    for name in SPLIT:
        split = ours[name]["split"]
        share = sum(e["weight_s"] for e in split.values()) / sum(
            e["backward_s"] + e["weight_s"] for e in split.values()
        )
        kept = sorted({n for e in split.values() for n in e["not_deferred"]})
        per_stage = ", ".join(f"{split[s]['deferred_share']:.0%}" for s in sorted(split))
        print(
            f"our {name}: W is {share:.0%} of the backward time (all stages, last step; "
            f"per stage {per_stage})"
            f"; computed inside I, not deferred: {', '.join(kept) or 'nothing'}"
        )
    for name in SPLIT:
        base = "int1f1b" if name in LOOPED else "1f1b"
        print(
            f"our {name} / our {base} step time: "
            f"{ours[name]['step_s'] / ours[base]['step_s']:.3f} measured, "
            f"{ours[name]['planned_makespan'] / ours[base]['planned_makespan']:.3f} planned "
            "(from each schedule's measured per-stage F, B, I, W)"
        )
    if args.timeline:
        root, ext = os.path.splitext(args.timeline)
        print(
            f"timelines of our steps of median bubble, each under its plan from its mean F, B, "
            f"I, W per stage: {root}_<schedule>{ext} for {', '.join(SCHEDULES)}"
        )


if __name__ == "__main__":
    main()
