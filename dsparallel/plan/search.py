"""Every valid layout of a model on a cluster, estimated and ranked."""

from __future__ import annotations

import itertools

from .cluster import Cluster
from .estimate import Estimate, estimate
from .layout import Layout
from .model import Model


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _experts(m: Model) -> int:
    if m.kind == "gpt":
        return m.config.moe_experts
    return m.get("n_routed_experts", 0) if m.kind == "deepseek_v3" else 0


def layouts(m: Model, cluster: Cluster, global_batch: int, seq: int, dtype: str):
    """The layouts worth estimating: tp within a host, pp up to the layers,
    cp and ep where they apply (the experts over the tp ranks too), ZeRO
    0-2, recomputation on and off, sequence parallelism with tp, the 1F1B,
    interleaved 1F1B, ZBV and DualPipeV schedules under pp (every model runs
    every schedule), micro-batches of 1, 2 or 4 sequences."""
    world = cluster.devices
    experts = _experts(m)
    for tp, pp, cp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * pp * cp) or tp > cluster.devices_per_host or m.heads % tp:
            continue
        if pp > m.layers or seq % (2 * cp):
            continue
        dp = world // (tp * pp * cp)
        if global_batch % dp:
            continue
        # (ep, over tp): carved out of dp x cp, or spanning the tp ranks too.
        eps = [(e, False) for e in _divisors(dp * cp) if experts and experts % e == 0]
        if tp > 1:
            eps += [
                (tp * e, True) for e in _divisors(dp * cp) if experts and experts % (tp * e) == 0
            ]
        eps = eps or [(1, False)]
        schedules = ["1f1b"] if pp == 1 else ["1f1b", "interleaved_1f1b", "zbv", "dualpipev"]
        for (ep, over_tp), zero, recompute, schedule, mb in itertools.product(
            eps, (0, 1, 2), (False, True), schedules, (1, 2, 4)
        ):
            if (global_batch // dp) % mb:
                continue
            micro_batches = global_batch // (dp * mb)
            if pp > 1 and micro_batches < pp:
                continue
            if schedule == "interleaved_1f1b" and (micro_batches % pp or 2 * pp > m.layers):
                continue
            if schedule in ("zbv", "dualpipev") and 2 * pp > m.layers:
                continue
            if schedule == "dualpipev" and micro_batches < 2 * pp:
                continue
            if zero and dp * cp == 1:
                continue
            yield Layout(
                tp=tp,
                pp=pp,
                dp=dp,
                ep=ep,
                experts_over_tp=over_tp,
                cp=cp,
                zero=zero,
                schedule=schedule,
                recompute=recompute,
                sequence_parallel=tp > 1 and (seq // cp) % tp == 0,
                micro_batch=mb,
                micro_batches=micro_batches,
                dtype=dtype,
            )


def search(
    m: Model, cluster: Cluster, global_batch: int, seq: int, dtype: str, margin: float = 0.9
) -> tuple[list[Estimate], int, Estimate | None]:
    """(the layouts that fit, fastest first; how many were estimated; the
    one that needs the least memory of those that do not fit)."""
    fits, count, smallest = [], 0, None
    for lay in layouts(m, cluster, global_batch, seq, dtype):
        try:
            e = estimate(m, lay, cluster, global_batch, seq, margin, time_if_unfit=False)
        except ValueError:
            continue  # a layout the model cannot take (shapes that do not split)
        count += 1
        if e.fits:
            fits.append(e)
        elif smallest is None or e.memory["total"] < smallest.memory["total"]:
            smallest = e
    fits.sort(key=lambda e: -e.tokens_per_s)
    return fits, count, smallest
