"""Step timing shared by the benchmarks (inside an initialised process group).

Every sample is one call timed on each rank after a barrier and reduced to the
slowest rank's time, so a sample is what the job as a whole waited.
"""

from __future__ import annotations

import statistics
import time


def slowest_rank_seconds(fn) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def median_seconds(fn, steps: int, warmup: int) -> float:
    """``warmup`` untimed calls, then the median of ``steps`` samples."""
    for _ in range(warmup):
        fn()
    return statistics.median(slowest_rank_seconds(fn) for _ in range(steps))


def interleaved_rounds(steppers: dict, rounds: int, steps: int, warmup: int = 0) -> dict:
    """Times every configuration in ``rounds`` rounds, rotating their order,
    so that drift of the machine over the run favours none of them. Returns
    {key: [[samples of round 0], [samples of round 1], ...]}."""
    keys = list(steppers)
    out = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            for _ in range(warmup):
                steppers[k]()
            out[k].append([slowest_rank_seconds(steppers[k]) for _ in range(steps)])
    return out
