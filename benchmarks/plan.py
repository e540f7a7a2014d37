"""The split planner against measurement: the GPT job at every layout of 4
(or 2) processes, its step time, memory and activations as planned and as
run.

    python benchmarks/plan.py [--devices 4] [--rounds 3] [--steps 5]

``dsparallel.plan.calibrate(devices)`` measures this machine with that many
ranks at once (the cluster the plans are for); each layout then runs the training job's
own step (``examples/train_gpt.py``'s ``make_job`` and ``train_step``):
``--steps`` timed steps after 2 untimed ones, the slowest rank's time per
step, in ``--rounds`` rounds with the layouts' order rotating. The report
ranks the layouts by predicted and by measured time (Spearman's rho) and
compares the predicted best with the measured best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from common import save, stats  # noqa: E402
from launch import run_ranks  # noqa: E402

MODEL = dict(vocab_size=128, seq_len=128, hidden=256, heads=8, layers=8)
BATCH, MICRO_BATCHES = 16, 4
# (tp, pp, cp, zero, schedule, recompute) on 4 or 2 processes; dp fills the
# rest.
LAYOUTS_2 = [
    (1, 1, 1, 0, "1f1b", False),
    (1, 1, 1, 1, "1f1b", False),
    (1, 1, 1, 2, "1f1b", False),
    (2, 1, 1, 0, "1f1b", False),
    (1, 2, 1, 0, "1f1b", False),
    (1, 2, 1, 0, "gpipe", False),
    (1, 2, 1, 0, "interleaved_1f1b", False),
    (1, 2, 1, 0, "zbv", False),
    (1, 1, 2, 0, "1f1b", False),
    (1, 1, 1, 0, "1f1b", True),
    (2, 1, 1, 0, "1f1b", True),
    (1, 2, 1, 0, "1f1b", True),
]
LAYOUTS_4 = [
    (1, 1, 1, 0, "1f1b", False),
    (1, 1, 1, 1, "1f1b", False),
    (1, 1, 1, 2, "1f1b", False),
    (2, 1, 1, 0, "1f1b", False),
    (4, 1, 1, 0, "1f1b", False),
    (1, 2, 1, 0, "1f1b", False),
    (1, 4, 1, 0, "1f1b", False),
    (1, 4, 1, 0, "gpipe", False),
    (2, 2, 1, 0, "1f1b", False),
    (1, 2, 1, 0, "interleaved_1f1b", False),
    (1, 2, 1, 0, "zbv", False),
    (1, 1, 2, 0, "1f1b", False),
    (2, 1, 2, 0, "1f1b", False),
    (1, 1, 1, 0, "1f1b", True),
]


def _measure(rank, world, layout, steps):
    import torch
    import torch.distributed as dist
    import train_gpt

    import dsparallel
    from dsparallel.models import GPTConfig
    from dsparallel.plan.measure import measure_step

    tp, pp, cp, zero, schedule, recompute = layout
    cfg = GPTConfig(**MODEL)
    job = train_gpt.make_job(
        cfg,
        tp,
        pp,
        MICRO_BATCHES,
        BATCH,
        zero_stage=zero,
        schedule=schedule,
        context_parallel=cp,
        checkpoint=recompute,
    )
    corpus = train_gpt.load_corpus()
    for step in range(2):
        train_gpt.train_step(job, corpus, step)
    times = []
    for step in range(2, 2 + steps):
        dist.barrier()
        t0 = time.perf_counter()
        train_gpt.train_step(job, corpus, step)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    state, peak, _ = measure_step(
        job.module, job.opt, lambda: train_gpt.train_step(job, corpus, 2 + steps), job.ddps
    )
    mine = torch.tensor(
        [float(state.params + state.grads + state.optimizer), float(peak)],
        dtype=torch.float64,
    )
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    dsparallel.destroy_parallel()
    return {"times": times, "model_state_bytes": mine[0].item(), "saved_bytes": mine[1].item()}


def _layout(devices, tp, pp, cp, zero, schedule, recompute):
    from dsparallel.plan import Layout

    dp = devices // (tp * pp * cp)
    return Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        zero=zero,
        schedule=schedule,
        recompute=recompute,
        micro_batch=BATCH // (dp * MICRO_BATCHES),
        micro_batches=MICRO_BATCHES,
    )


def _predicted(lay, cluster) -> dict:
    """The estimate, and (as the run measures them: the most over the
    ranks) the model state and activation bytes of any rank."""
    from dsparallel.models import GPTConfig
    from dsparallel.plan import estimate, model_state, read_model
    from dsparallel.plan.activations import activation_bytes

    cfg = GPTConfig(**MODEL)
    row = estimate(cfg, lay, cluster, BATCH, MODEL["seq_len"]).row()
    m = read_model(cfg)
    places = [(p, d, c) for p in range(lay.pp) for d in range(lay.dp) for c in range(lay.cp)]
    row["model_state_bytes"] = max(model_state(m, lay, *place).total for place in places)
    row["saved_bytes"] = max(activation_bytes(m, lay, p, MODEL["seq_len"]) for p in range(lay.pp))
    return row


def repredict(path: str) -> None:
    """Recomputes a results file's predictions with this code, from the
    cluster it measured (the measurements stay as they were)."""
    from dsparallel.plan import Layout, read_cluster

    with open(path) as f:
        results = json.load(f)
    cluster = read_cluster(results["config"]["cluster"])
    for row in results["rows"]:
        row["predicted"] = _predicted(Layout(**row["layout"]), cluster)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(f"re-predicted: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, choices=[2, 4], default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--repredict", metavar="RESULTS", help="only recompute the predictions of a results file"
    )
    a = ap.parse_args()
    if a.repredict:
        repredict(a.repredict)
        return
    from dsparallel.plan.calibrate import calibrate

    layouts = LAYOUTS_4 if a.devices == 4 else LAYOUTS_2
    cluster = calibrate(a.devices)
    print(f"cluster: {dataclasses.asdict(cluster)}")
    samples = {layout: [] for layout in layouts}
    memory = {}
    for r in range(a.rounds):
        order = layouts[r % len(layouts) :] + layouts[: r % len(layouts)]
        for layout in order:
            out = run_ranks(_measure, a.devices, layout, a.steps)
            samples[layout] += out["times"]
            memory[layout] = out
            print(f"round {r}: {layout}: {sorted(out['times'])[len(out['times']) // 2]:.3f} s")
    rows = []
    for layout in layouts:
        lay = _layout(a.devices, *layout)
        predicted = _predicted(lay, cluster)
        rows.append(
            {
                "layout": dataclasses.asdict(lay),
                "step_s": stats(samples[layout]),
                "predicted": predicted,
                "model_state_bytes": memory[layout]["model_state_bytes"],
                "saved_bytes": memory[layout]["saved_bytes"],
            }
        )
        print(
            f"{layout}: measured {stats(samples[layout])['median']:.3f} s, predicted "
            f"{predicted['time']['total']:.3f} s"
        )
    save(
        "plan" if a.devices == 4 else f"plan_{a.devices}",
        rows,
        {
            **vars(a),
            "model": MODEL,
            "batch": BATCH,
            "micro_batches": MICRO_BATCHES,
            "cluster": dataclasses.asdict(cluster),
        },
    )


if __name__ == "__main__":
    main()
