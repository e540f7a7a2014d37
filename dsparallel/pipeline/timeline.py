"""Timelines of a pipeline schedule: planned (from the C++ simulator) or
measured (per-action wall times recorded by ``step``)."""

from __future__ import annotations

import statistics

import torch.distributed as dist

from .schedule import Action, Schedule

_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#55a868", "W": "#c44e52"}
_KINDS = "FBIW"  # the order of a cost tuple, as Schedule.validate takes it

Trace = list[list[tuple[str, float, float]]]


def planned_trace(schedule: Schedule, costs=None) -> Trace:
    """Per rank, (action, start, end) of each compute action as the C++
    simulator places them: in unit slots, or with ``costs`` (one (F, B, I, W)
    tuple of integer durations, or one per stage, as ``Schedule.validate``
    takes them) in the costs' unit."""
    stats = schedule.validate() if costs is None else schedule.validate(costs=costs)

    def duration(action) -> float:
        if costs is None:
            return 1.0
        c = costs[action.stage] if isinstance(costs, list) else costs
        return float(c[_KINDS.index(action.kind)])

    trace = []
    for actions, starts in zip(schedule.ranks, stats.start_slots):
        trace.append(
            [(str(a), float(t), float(t) + duration(a)) for a, t in zip(actions, starts) if t >= 0]
        )
    return trace


def mean_costs(trace: Trace, num_stages: int | None = None) -> list[tuple[int, int, int, int]]:
    """Per stage, the mean measured (F, B, I, W) durations of a trace in whole
    microseconds (1 where a kind is absent), the costs to plan it with:
    stages differ (the first computes no input gradient, the last adds the
    loss)."""
    per_kind: dict[tuple[int, str], list[float]] = {}
    for rank in trace:
        for text, start, end in rank:
            stage, kind, _ = parse_action(text)
            per_kind.setdefault((stage, kind), []).append(end - start)
    stages = num_stages or 1 + max((s for s, _ in per_kind), default=-1)
    return [
        tuple(
            max(1, round(1e6 * statistics.mean(per_kind[(s, k)]))) if (s, k) in per_kind else 1
            for k in _KINDS
        )
        for s in range(stages)
    ]


def bubble(trace: Trace) -> float:
    """Idle fraction of the ranks between the first start and the last end."""
    spans = [(s, e) for rank in trace for _, s, e in rank]
    if not spans:
        return 0.0
    t0, t1 = min(s for s, _ in spans), max(e for _, e in spans)
    busy = sum(e - s for s, e in spans)
    return 1.0 - busy / (len(trace) * (t1 - t0))


def parse_action(text: str) -> tuple[int, str, int]:
    """ "1I3" -> (1, "I", 3), by the C++ parser the schedules are read with."""
    a = Action.parse(text)
    return a.stage, a.kind, a.microbatch


def _inputs_of(stage: int, kind: str, mb: int, last_stage: int) -> list[tuple[int, str, int]]:
    """The compute actions whose results ``(stage, kind, mb)`` needs: a
    forward the previous stage's forward, a W its own I, a B or I the next
    stage's input gradient (B or I, whichever that schedule ran)."""
    if kind == "F":
        return [(stage - 1, "F", mb)] if stage > 0 else []
    if kind == "W":
        return [(stage, "I", mb)]
    if stage == last_stage:
        return []
    return [(stage + 1, "B", mb), (stage + 1, "I", mb)]


def bubble_breakdown(
    trace: Trace,
    transfers: Trace | None = None,
) -> dict[str, float]:
    """Where a measured step's idle time went (one list per rank of the
    pipeline's group, stage s on rank s % ranks), as fractions of ranks x
    span, which add up to ``bubble(trace)``:

    - ``wait``: the rank was free but the action's input did not exist yet
      (a peer's F, or B/I, had not finished): the schedule's own bubble,
      plus delays that peers passed on;
    - ``overhead``: the input existed and the rank was free, yet the action
      had not started: transfers, the runtime's bookkeeping, the Python
      callback around the compute;
    - ``tail``: after the rank's last action, until the last rank finished.

    Given each rank's ``transfer_trace`` too, ``overhead`` is also split into
    ``in_transfers`` (the rank was posting a send or completing a receive)
    and ``between`` (the rest: bookkeeping between the actions).
    """
    ranks = len(trace)
    ends = {}
    for rank in trace:
        for text, _, e in rank:
            ends[parse_action(text)] = e
    spans = [(s, e) for rank in trace for _, s, e in rank]
    keys = ["wait", "overhead", "tail"] + (["in_transfers", "between"] if transfers else [])
    if not spans:
        return dict.fromkeys(keys, 0.0)
    t0, t1 = min(s for s, _ in spans), max(e for _, e in spans)
    last_stage = max(stage for stage, _, _ in ends)
    wait = overhead = tail = in_transfers = 0.0
    for r, rank in enumerate(trace):
        # A rank's transfers and its actions' idle windows both come in time
        # order, so one pointer walk finds each window's transfers.
        moving = sorted((s, e) for _, s, e in transfers[r]) if transfers else []
        first = 0
        prev = t0
        for text, start, end in rank:
            needs = _inputs_of(*parse_action(text), last_stage)
            deps = [ends[n] for n in needs if n in ends]
            ready = min(start, max([prev] + deps))
            wait += ready - prev
            overhead += start - ready
            while first < len(moving) and moving[first][1] <= ready:
                first += 1
            k = first
            while k < len(moving) and moving[k][0] < start:
                s, e = moving[k]
                in_transfers += max(0.0, min(e, start) - max(s, ready))
                k += 1
            prev = max(prev, end)
        tail += t1 - prev
    total = ranks * (t1 - t0)
    out = {"wait": wait / total, "overhead": overhead / total, "tail": tail / total}
    if transfers:
        out["in_transfers"] = in_transfers / total
        out["between"] = (overhead - in_transfers) / total
    return out


def replayed(trace: Trace) -> Trace:
    """The measured step replayed without the runtime: each rank runs its
    actions in the order it ran them, each lasting exactly as long as it
    did, each starting the moment the rank is free and its inputs exist
    (transfers free, nothing between actions).

    Its bubble is the schedule's own under the compute that actually
    happened: a plan from mean action times misses that a zero-bubble
    schedule's slack is small, so on a noisy machine one slow F or I
    delays its consumers. What the measured bubble has beyond the replayed
    one is the runtime's (transfers, bookkeeping, and their knock-on)."""
    spans = [s for rank in trace for _, s, _ in rank]
    if not spans:
        return [[] for _ in trace]
    t0 = min(spans)
    parsed = [[(parse_action(text), text, end - start) for text, start, end in r] for r in trace]
    last_stage = max(stage for r in parsed for (stage, _, _), _, _ in r)
    ends: dict[tuple[int, str, int], float] = {}
    out: Trace = [[] for _ in trace]
    free = [t0] * len(trace)
    pending = sum(len(r) for r in parsed)
    while pending:
        progressed = False
        for r, actions in enumerate(parsed):
            while len(out[r]) < len(actions):
                key, text, duration = actions[len(out[r])]
                needs = _inputs_of(*key, last_stage)
                if needs and not any(n in ends for n in needs):
                    break  # its input comes from a rank not replayed this far
                start = max([free[r]] + [ends[n] for n in needs if n in ends])
                ends[key] = free[r] = start + duration
                out[r].append((text, start, start + duration))
                pending -= 1
                progressed = True
        if not progressed:
            raise ValueError("the trace cannot be replayed: its actions wait on each other")
    return out


def gather_trace(schedule_runner, group=None, transfers: bool = False) -> list | None:
    """All ranks' measured traces of the last ``step`` (on every rank); with
    ``transfers``, their transfer traces instead."""
    group = group if group is not None else schedule_runner.group
    everyone = [None] * dist.get_world_size(group)
    mine = schedule_runner.transfer_trace if transfers else schedule_runner.trace
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def plot_schedule(
    schedule_or_trace, path: str, title: str | None = None, measured: Trace | None = None
) -> str:
    """Draws the timeline (one row per rank, F, B (or I) and W boxes in three
    colours, labelled with the stage and micro-batch) as a PNG at ``path``.
    Takes a Schedule (planned, unit slots) or a trace as returned by
    ``gather_trace`` (seconds).

    With a Schedule and ``measured`` (a trace of a step of it), draws the
    plan and the measured step side by side on one time axis: the plan
    placed by the simulator with each stage's mean measured F, B, I and W
    durations (``mean_costs``), the measured step below it, each with its
    bubble, so that what the runtime and the machine added shows as the
    difference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planned = isinstance(schedule_or_trace, Schedule)
    if measured is not None and not planned:
        raise ValueError("plot_schedule: a measured trace is drawn beside a Schedule's plan")
    if measured is not None:
        costs = mean_costs(measured, schedule_or_trace.num_stages)
        plan = planned_trace(schedule_or_trace, costs)
        panels = [
            (
                [[(a, 1e-6 * s, 1e-6 * e) for a, s, e in rank] for rank in plan],
                "planned (each stage's mean measured F, B, I, W)",
            ),
            (measured, "measured"),
        ]
    elif planned:
        panels = [(planned_trace(schedule_or_trace), "planned")]
    else:
        panels = [(schedule_or_trace, "measured")]
    rows = sum(len(trace) for trace, _ in panels)
    # 10 inches at 110 dpi: a docs page shows it at about 0.65 of its width,
    # where 8 pt labels are still 7.5 px high.
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(10, 0.6 * rows + 1.2 * len(panels)), sharex=True, squeeze=False
    )
    labels = []
    for ax, (trace, label) in zip(axes[:, 0], panels):
        labels += _draw(ax, trace)
        ax.set_title(f"{label} timeline, bubble {bubble(trace):.1%}")
    axes[-1, 0].set_xlabel("slot" if planned and measured is None else "seconds")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # A box keeps its whole name ("1F3") where it fits, else its micro-batch
    # ("3": the colour gives the kind), else nothing: a long step's boxes
    # are narrower than their names, which would run into each other.
    renderer = fig.canvas.get_renderer()
    for text, ax, width in labels:
        box = ax.transData.transform((width, 0))[0] - ax.transData.transform((0, 0))[0]
        if text.get_window_extent(renderer).width > box - 2:
            text.set_text(str(parse_action(text.get_text())[2]))
            text.set_visible(text.get_window_extent(renderer).width <= box - 2)
    # The smallest text's height in pixels, for the docs' readability check.
    smallest = f"{_LABEL_PT * DPI / 72:.1f}"
    fig.savefig(
        path, dpi=DPI, metadata={"smallest_text_px": smallest} if path.endswith(".png") else None
    )
    plt.close(fig)
    return path


DPI = 110
_LABEL_PT = 8


def _draw(ax, trace: Trace) -> list:
    """One row per rank, from the trace's first start; returns each box's
    label with its axes and width."""
    t0 = min((s for rank in trace for _, s, _ in rank), default=0.0)
    labels = []
    for r, rank in enumerate(trace):
        for text, s, e in rank:
            kind = parse_action(text)[1][:1]
            ax.broken_barh(
                [(s - t0, e - s)], (r - 0.4, 0.8), color=_COLORS[kind], edgecolor="white"
            )
            label = ax.text(
                (s + e) / 2 - t0,
                r,
                text,
                ha="center",
                va="center",
                fontsize=_LABEL_PT,
                color="white",
            )
            labels.append((label, ax, e - s))
    ax.set_yticks(range(len(trace)), [f"rank {r}" for r in range(len(trace))])
    ax.invert_yaxis()
    return labels
