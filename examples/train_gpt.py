"""Train a small character-level GPT with data, tensor and pipeline parallelism.

    torchrun --nproc-per-node 4 examples/train_gpt.py                  # tp 2 x pp 2
    torchrun --nproc-per-node 4 examples/train_gpt.py --tensor-parallel 2 --pipeline-parallel 1
    torchrun --nproc-per-node 4 examples/train_gpt.py --save ckpt --steps 100
    torchrun --nproc-per-node 4 examples/train_gpt.py --resume ckpt --steps 200

``dsparallel.init_parallel`` lays the ranks out as (pp, dp, tp). Each rank
builds only its pipeline stage's layers (two stages for interleaved_1f1b,
zbv and dualpipev; --stages-per-rank K for interleaved_1f1b and zb1p),
split across its tensor-parallel group; the stage's data-parallel replicas
are wrapped in our DDP; the stages run the 1F1B schedule (or --schedule
gpipe, interleaved_1f1b, zb1p, zbv, dualpipev). With
--moe-experts each block's MLP is a mixture of experts, split over
--expert-parallel ranks of the data-parallel ones. The corpus is text this
repository already holds (its README and the package's sources), read as
bytes (a 128-symbol vocabulary), so nothing is downloaded. Rank 0 shows
progress; at the end it prints a summary and writes a loss curve.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

import dsparallel
from dsparallel.models import GPTConfig, build_stage, gpt_loss
from dsparallel.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from dsparallel.plan.measure import measure_step

# --schedule: one stage per rank, except interleaved_1f1b (rank r builds
# stages r, r + pp, ... of a model cut into K pp stages, K = --stages-per-rank,
# 2 by default), zb1p with --stages-per-rank K > 1 (the same layout: zero
# bubble over interleaved 1F1B) and zbv and dualpipev (stages r and 2 pp - 1
# - r: a V).
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zb1p": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
V_SHAPED = ("zbv", "dualpipev")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_corpus() -> torch.Tensor:
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "dsparallel", "**", "*.py"), recursive=True))
    data = b"".join(open(f, "rb").read() for f in files)
    codes = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return codes.masked_fill(codes >= 128, ord("?"))  # a 128-symbol vocabulary


def batch(corpus: torch.Tensor, step: int, size: int, seq: int):
    """The step's global batch: the same on every rank, a function of the
    step alone (so a resumed run sees the same batches)."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, len(corpus) - seq - 1, (size,), generator=g)
    ids = torch.stack([corpus[s : s + seq] for s in starts])
    target = torch.stack([corpus[s + 1 : s + seq + 1] for s in starts])
    return ids, target


def layout_of(state) -> dict:
    return {
        "tp": state.tp_size,
        "pp": state.pp_size,
        "dp": state.dp_size,
        "ep": state.ep_size,
        "cp": state.cp_size,
    }


def save(path, rank, state, cfg, step, module, opt, history):
    os.makedirs(path, exist_ok=True)
    torch.save(
        {
            "layout": layout_of(state),
            "config": asdict(cfg),
            "step": step,
            "model": module.state_dict(),
            "optim": opt.state_dict(),
            "history": history,
        },
        os.path.join(path, f"rank{rank:05d}.pt"),
    )
    if rank == 0:
        with open(os.path.join(path, "layout.json"), "w") as f:
            json.dump({"layout": layout_of(state), "config": asdict(cfg), "step": step}, f)


def saved_rank(layout: dict, pp: int, dp: int, tp: int) -> int:
    """The global rank of mesh coordinates (pp, dp, tp) in a saved layout
    (init_parallel's mesh is ("pp", "dp", "tp"), tp fastest)."""
    return (pp * layout["dp"] + dp) * layout["tp"] + tp


def resume(path, rank, state, cfg, module, opt):
    file = os.path.join(path, f"rank{rank:05d}.pt")
    with open(os.path.join(path, "layout.json")) as f:
        saved = json.load(f)["layout"]
    saved.setdefault("ep", 1)  # saved before expert parallelism
    saved.setdefault("cp", 1)  # saved before context parallelism
    mine = layout_of(state)
    only_dp_differs = {k: v for k, v in saved.items() if k != "dp"} == {
        k: v for k, v in mine.items() if k != "dp"
    }
    zero = isinstance(opt, dsparallel.ZeroRedundancyOptimizer)
    if saved != mine and not (only_dp_differs and zero and mine["ep"] == 1):
        raise SystemExit(
            f"--resume {path}: saved with layout {saved}; this run is {mine}. Resharding "
            "works for the data-parallel size with --zero-stage 1 or 2 (and no expert "
            "parallelism) only: resume with the layout it was saved with."
        )
    if saved != mine:
        # Another data-parallel size: the model from the saved replica 0 of
        # this (pp, tp) position, the optimizer state from every saved
        # replica's shard (ZeroRedundancyOptimizer reshards them).
        files = [
            os.path.join(path, f"rank{saved_rank(saved, state.pp_rank, d, state.tp_rank):05d}.pt")
            for d in range(saved["dp"])
        ]
        ckpts = [torch.load(f, weights_only=False) for f in files]
        ckpt = ckpts[0]
        optim = [c["optim"] for c in ckpts]
    else:
        if not os.path.exists(file):
            raise SystemExit(f"--resume {path}: no shard for rank {rank} ({file})")
        ckpt = torch.load(file, weights_only=False)
        optim = ckpt["optim"]
    if ckpt["config"] != asdict(cfg):
        raise SystemExit(
            f"--resume {path}: saved with model {ckpt['config']}; this run is {asdict(cfg)}"
        )
    model_state = ckpt["model"]
    if state.dp_size > 1 and not any(k.startswith("module.") for k in model_state):
        model_state = {"module." + k: v for k, v in model_state.items()}
    elif state.dp_size == 1 and all(k.startswith("module.") for k in model_state):
        model_state = {k[len("module.") :]: v for k, v in model_state.items()}
    module.load_state_dict(model_state)
    opt.load_state_dict(optim)
    return ckpt["step"], ckpt["history"]


def plan_report(job: Job, args) -> dict:
    """The planner's prediction for this rank's place in the layout
    (dsparallel.plan), printed by rank 0 for the most loaded rank; with
    --plan-cluster also the step time."""
    from dsparallel.plan import Layout, estimate, model_state, read_model
    from dsparallel.plan.activations import activation_bytes

    state, cfg = job.state, job.cfg
    lay = Layout.of(
        state,
        zero=args.zero_stage,
        schedule=args.schedule,
        stages_per_rank=args.stages_per_rank,
        recompute=args.checkpoint_activations,
        cp_mode=args.cp_mode,
        micro_batch=job.batch_size // (state.dp_size * job.micro_batches),
        micro_batches=job.micro_batches,
    )
    model = read_model(cfg)
    mine = model_state(model, lay, state.pp_rank, state.dp_rank, state.cp_rank)
    act = activation_bytes(model, lay, state.pp_rank, cfg.seq_len)
    planned = torch.tensor([mine.params, mine.grads, mine.optimizer, act], dtype=torch.float64)
    dist.all_reduce(planned, op=dist.ReduceOp.MAX)
    step_s = None
    if args.plan_cluster:
        step_s = estimate(model, lay, args.plan_cluster, job.batch_size, cfg.seq_len).time["total"]
    if dist.get_rank() == 0:
        print(
            "plan (predicted, most loaded rank): "
            + _bytes_line(planned)
            + (f"; step {step_s * 1e3:.0f} ms" if step_s is not None else ""),
            flush=True,
        )
    return {"bytes": planned, "step_s": step_s}


def plan_compare(planned: dict, measured, step_s: float, rank: int) -> None:
    """The same figures as measured on the last step (every rank's most)."""
    state, saved = measured
    held = torch.tensor([state.params, state.grads, state.optimizer, saved], dtype=torch.float64)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if rank == 0:
        predicted = planned["step_s"]
        print(
            "plan (measured, most loaded rank): "
            + _bytes_line(held)
            + f"; step {step_s * 1e3:.0f} ms"
            + (f" (predicted {predicted * 1e3:.0f} ms)" if predicted is not None else "")
        )


def _bytes_line(values: torch.Tensor) -> str:
    names = ("params", "grads", "optimizer", "activations")
    return ", ".join(f"{n} {v / 2**20:.2f} MiB" for n, v in zip(names, values.tolist()))


def plot(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h[0] for h in history], [h[1] for h in history])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("train_gpt.py")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass
class Job:
    """One rank's part of the hybrid job."""

    cfg: GPTConfig
    state: dsparallel.ParallelState
    module: torch.nn.Module  # this rank's layers (each stage wrapped in DDP when dp > 1)
    stages: list[PipelineStage]
    schedule: Schedule1F1B  # or another of SCHEDULES
    opt: torch.optim.Optimizer
    micro_batches: int
    batch_size: int

    @property
    def ddps(self) -> list:
        """The stages' DistributedDataParallel wrappers (none without dp x cp)."""
        return [s.submod for s in self.stages if hasattr(s.submod, "zero_stage")]


def make_job(
    cfg: GPTConfig,
    tensor_parallel: int,
    pipeline_parallel: int,
    micro_batches: int,
    batch_size: int,
    lr: float = 2e-3,
    checkpoint: bool = False,
    backend: str | None = None,
    zero_stage: int = 0,
    schedule: str = "1f1b",
    expert_parallel: int = 1,
    stages_per_rank: int | None = None,
    context_parallel: int = 1,
    cp_mode: str = "ring",
) -> Job:
    """Lays out the ranks, builds this rank's stage, wraps it in DDP across
    its replicas and in the 1F1B schedule across the stages."""
    state = dsparallel.init_parallel(
        tensor_parallel,
        pipeline_parallel,
        backend,
        expert_parallel_size=expert_parallel,
        context_parallel_size=context_parallel,
    )
    if batch_size % (state.dp_size * micro_batches):
        raise SystemExit(
            f"--batch-size {batch_size} must divide into {state.dp_size} data-parallel "
            f"replicas x {micro_batches} micro-batches"
        )
    pp, r = state.pp_size, state.pp_rank
    per_rank = stages_per_rank or (2 if schedule in V_SHAPED + ("interleaved_1f1b",) else 1)
    if schedule in V_SHAPED and per_rank != 2:
        raise SystemExit(f"--stages-per-rank {per_rank}: {schedule} runs 2 (a V)")
    if per_rank > 1 and schedule not in V_SHAPED + ("interleaved_1f1b", "zb1p"):
        raise SystemExit(f"--stages-per-rank {per_rank}: {schedule} runs 1")
    indices, num_stages = [r + k * pp for k in range(per_rank)], per_rank * pp
    if schedule in V_SHAPED:
        indices = [r, 2 * pp - 1 - r]
    stages = []
    for index in indices:
        module = build_stage(
            cfg,
            index,
            num_stages,
            group=state.tp_group,
            checkpoint=checkpoint,
            context_parallel_group=state.cp_group,
            cp_mode=cp_mode,
        )
        if state.dp_size * state.cp_size > 1:
            # Gradients are reduced over the data- and context-parallel ranks
            # (the same parameters, other tokens). zero_stage=2: the reducer
            # reduce-scatters each bucket into this rank's gradient shard
            # instead of all-reducing it.
            module = dsparallel.DistributedDataParallel(
                module, process_group=state.dp_cp_group, zero_stage=2 if zero_stage == 2 else 0
            )
        stages.append(PipelineStage(module, index, num_stages, group=state.pp_group))
    loss_fn = gpt_loss(state.tp_group)
    if len(stages) > 1:
        schedule = SCHEDULES[schedule](stages, micro_batches, loss_fn=loss_fn)
    else:
        schedule = SCHEDULES[schedule](stages[0], micro_batches, loss_fn=loss_fn)
    module = stages[0].submod if len(stages) == 1 else torch.nn.ModuleList(s.submod for s in stages)
    if zero_stage in (1, 2):
        # AdamW's state (and with stage 2 the gradients) sharded evenly over
        # the data-parallel replicas.
        opt = dsparallel.ZeroRedundancyOptimizer(
            module.parameters(), torch.optim.AdamW, process_group=state.dp_cp_group, lr=lr
        )
    elif zero_stage == 0:
        opt = torch.optim.AdamW(module.parameters(), lr=lr)
    else:
        raise SystemExit(f"--zero-stage {zero_stage}: 0, 1 or 2")
    return Job(cfg, state, module, stages, schedule, opt, micro_batches, batch_size)


def train_step(job: Job, corpus: torch.Tensor, step: int) -> float:
    """One optimizer step on the step's batch; returns the loss (every rank)."""
    state = job.state
    is_first = any(s.is_first for s in job.stages)
    is_last = any(s.is_last for s in job.stages)
    ids, target = batch(corpus, step, job.batch_size, job.cfg.seq_len)
    per_replica = job.batch_size // state.dp_size
    mine = slice(state.dp_rank * per_replica, (state.dp_rank + 1) * per_replica)
    ids, target = ids[mine], target[mine]
    if state.cp_size > 1:  # this rank's part of every sequence
        ids = dsparallel.context_parallel.shard_sequence(ids, state.cp_group)
        target = dsparallel.context_parallel.shard_sequence(target, state.cp_group)
    losses = []
    inputs = (ids,) if is_first else ()
    if is_last:
        job.schedule.step(*inputs, target=target, losses=losses)
    else:
        job.schedule.step(*inputs)
    job.opt.step()
    job.opt.zero_grad(set_to_none=True)
    # Mixture of experts: the routing bias moves towards an even load, from
    # the counts of every data-parallel replica.
    dsparallel.moe.update_expert_bias(job.module, state.dp_group)
    # The loss lives on the last stage: its mean over the data-parallel
    # replicas (and the context-parallel parts, of equal token counts)
    # reaches every rank through one small all-reduce.
    contribution = torch.zeros(1)
    if is_last and state.tp_rank == 0:
        contribution += torch.stack(losses).mean() / (state.dp_size * state.cp_size)
    dist.all_reduce(contribution)
    return contribution.item()


def expert_load_summary(job: Job) -> list[str]:
    """Tokens per expert over the run (all data-parallel replicas), per MoE
    block of this rank's stage, and the tokens dropped over capacity."""
    layers = dsparallel.moe.moe_layers(job.module)
    if not layers:
        return []
    load = torch.stack([m.router.total_load for m in layers])
    dropped = torch.tensor([float(m.dropped_total) for m in layers])
    both = torch.cat([load.flatten(), dropped])
    dist.all_reduce(both, group=job.state.dp_group)
    load = both[: load.numel()].view_as(load)
    lines = []
    for i, (row, d) in enumerate(zip(load, both[load.numel() :])):
        share = row / row.sum().clamp(min=1)
        lines.append(
            f"moe block {i} of stage {job.state.pp_rank}: tokens per expert "
            + " ".join(f"{int(c)}" for c in row)
            + f" (max/mean {share.max().item() * len(row):.2f})"
            + (f", {int(d)} assignments dropped over capacity" if d else "")
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--pipeline-parallel", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=500, help="train until this step")
    p.add_argument("--seq", "--seq-len", type=int, default=64, help="sequence length")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=sorted(SCHEDULES),
        help="pipeline schedule (zb1p: zero-bubble ZB-H1, the backward split in I and W; "
        "zbv: two stages per rank in a V, split backward; dualpipev: DeepSeek's DualPipeV)",
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        help="stages each pipeline rank holds, r, r + pp, ...: interleaved_1f1b (2 by "
        "default) and zb1p (1 by default: ZB-H1; more: zero bubble over interleaved 1F1B)",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="1: AdamW's state sharded over the data-parallel ranks (ZeRO stage 1); "
        "2: the gradients too (ZeRO stage 2)",
    )
    p.add_argument(
        "--moe-experts",
        type=int,
        default=0,
        help="routed experts per block (0: dense MLPs); split over --expert-parallel ranks",
    )
    p.add_argument("--moe-top-k", type=int, default=2, help="experts per token")
    p.add_argument("--moe-shared-experts", type=int, default=0)
    p.add_argument(
        "--moe-capacity-factor", type=float, default=None, help="drop over capacity (default: none)"
    )
    p.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        help="expert-parallel size, carved out of the data-parallel ranks",
    )
    p.add_argument(
        "--context-parallel",
        type=int,
        default=1,
        help="context-parallel size: ranks holding parts of the same sequences",
    )
    p.add_argument(
        "--cp-mode",
        default="ring",
        choices=["ring", "ulysses"],
        help="attention across the context-parallel ranks",
    )
    p.add_argument("--save", help="directory for a checkpoint at the end")
    p.add_argument("--resume", help="directory of a checkpoint to continue from")
    p.add_argument("--plot", default="gpt_loss.png", help="loss curve PNG ('' for none)")
    p.add_argument("--losses", help="write [step, loss] of every step to this JSON file")
    p.add_argument(
        "--expect-loss-drop",
        type=float,
        metavar="R",
        help="exit non-zero unless the mean loss of the last 10 steps is below R x the first",
    )
    p.add_argument("--backend", default=None)
    p.add_argument(
        "--plan-cluster",
        default=None,
        help="a cluster file or preset (python -m dsparallel.plan calibrate): also predict "
        "the step time",
    )
    args = p.parse_args()

    torch.set_num_threads(1)
    cfg = GPTConfig(
        seq_len=args.seq,
        hidden=args.hidden,
        heads=args.heads,
        layers=args.layers,
        moe_experts=args.moe_experts,
        moe_top_k=args.moe_top_k,
        moe_shared_experts=args.moe_shared_experts,
        moe_capacity_factor=args.moe_capacity_factor,
    )
    job = make_job(
        cfg,
        args.tensor_parallel,
        args.pipeline_parallel,
        args.micro_batches,
        args.batch_size,
        lr=args.lr,
        checkpoint=args.checkpoint_activations,
        backend=args.backend,
        zero_stage=args.zero_stage,
        schedule=args.schedule,
        expert_parallel=args.expert_parallel,
        stages_per_rank=args.stages_per_rank,
        context_parallel=args.context_parallel,
        cp_mode=args.cp_mode,
    )
    state, module, opt = job.state, job.module, job.opt
    rank = dist.get_rank()

    start, history = 0, []
    if args.resume:
        start, history = resume(args.resume, rank, state, cfg, module, opt)
    corpus = load_corpus()
    if rank == 0:
        n = sum(p.numel() for p in module.parameters())
        print(
            f"GPT {cfg.layers} layers x {cfg.hidden} hidden on {dist.get_world_size()} ranks: "
            f"tp {state.tp_size} x pp {state.pp_size} x dp {state.dp_size}"
            + (f" (ep {state.ep_size})" if state.ep_size > 1 else "")
            + (f" x cp {state.cp_size} ({args.cp_mode})" if state.cp_size > 1 else "")
            + ", "
            f"{job.micro_batches} micro-batches, {n:,} parameters on rank 0; "
            f"{len(corpus):,} characters of text" + (f"; resumed at step {start}" if start else ""),
            flush=True,
        )

    planned = plan_report(job, args)
    t0, tokens = time.perf_counter(), 0
    # A bar that redraws on a terminal and writes a line every 20 s into a log.
    bar = tqdm(
        range(start, args.steps),
        initial=start,
        total=args.steps,
        disable=rank != 0,
        mininterval=0.1 if sys.stderr.isatty() else 20,
        unit="step",
    )
    measured = None
    for step in bar:
        if step == args.steps - 1:  # the last step also counts what the rank holds
            run = functools.partial(train_step, job, corpus, step)
            *measured, loss = measure_step(module, opt, run, job.ddps)
        else:
            loss = train_step(job, corpus, step)
        history.append((step + 1, loss))
        tokens += args.batch_size * args.seq
        rate = f"{tokens / (time.perf_counter() - t0):,.0f}"
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=rate, refresh=False)  # drawn at mininterval
    bar.close()
    elapsed = time.perf_counter() - t0

    if args.save:
        save(args.save, rank, state, cfg, args.steps, module, opt, history)
    moe_summary = expert_load_summary(job)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    peaks = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if rank == 0 and history:
        ran = history[-(args.steps - start) :] if args.steps > start else []
        print(
            f"summary: loss {history[0][1]:.4f} (step {history[0][0]}) -> "
            f"{history[-1][1]:.4f} (step {history[-1][0]}); "
            f"{tokens / elapsed if ran else 0:,.0f} tokens/s over {len(ran)} steps; "
            "peak RSS per rank (MB): " + ", ".join(f"{p.item():.0f}" for p in peaks)
        )
        for line in moe_summary:
            print(line)
    if measured is not None:
        plan_compare(planned, measured, elapsed / max(1, args.steps - start), rank)
    if rank == 0 and history:
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(history, f)
        if args.plot:
            plot(history, args.plot)
            print(f"loss curve: {args.plot}")
    dsparallel.destroy_parallel()
    if args.expect_loss_drop is not None:
        check_loss_fell(history, args.expect_loss_drop)


def check_loss_fell(history, ratio):
    """Every rank holds the same losses, so every rank fails alike."""
    losses = [loss for _, loss in history]
    if len(losses) < 11:
        raise SystemExit(f"--expect-loss-drop needs at least 11 steps, got {len(losses)}")
    last = sum(losses[-10:]) / 10
    if not last < ratio * losses[0]:
        raise SystemExit(
            f"loss did not fall: mean of the last 10 steps {last:.4f} is not below "
            f"{ratio} x the first step's {losses[0]:.4f}"
        )


if __name__ == "__main__":
    main()
