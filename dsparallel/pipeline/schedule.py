"""Pipeline schedules, generated and validated in C++ (csrc/core/pipeline)."""

from __future__ import annotations

from .. import _C

Action = _C.PipelineAction
Schedule = _C.PipelineSchedule

_NAMES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved_1f1b": "interleaved_1f1b",
    "interleaved1f1b": "interleaved_1f1b",
    "zb1p": "zb1p",
    "interleavedzerobubble": "zb1p",  # torch's spelling
    "zbv": "zbv",
    "zbvzerobubble": "zbv",  # torch's spelling
    "dualpipev": "dualpipev",
}


def get_schedule(
    name: str, num_stages: int, n_microbatches: int, stages_per_rank: int = 1
) -> Schedule:
    """The per-rank action lists of a schedule, already validated.

    ``name`` is ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"zb1p"``
    (zero bubble, with I and W actions: the backward split in two; ZB-H1
    with one stage per rank, over interleaved 1F1B with more), ``"zbv"``
    (two stages per rank in a V, split backward) or ``"dualpipev"``
    (DeepSeek's DualPipe in a V). Stage ``s`` runs on rank
    ``s % (num_stages // stages_per_rank)``, or with ``schedule.placement ==
    "v"`` rank ``r`` holds stages ``r`` and ``num_stages - 1 - r``. ``schedule.ranks[r]``
    lists rank ``r``'s actions (printed like ``2F0``: stage 2, forward,
    micro-batch 0); ``schedule.validate()`` returns the unit-time statistics
    (``bubble``, ``peak_in_flight`` per rank, ``makespan``). Raises ValueError
    naming the numbers when the combination is impossible.
    """
    key = _NAMES.get(name.lower())
    if key is None:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; use one of {sorted(set(_NAMES.values()))}"
        )
    schedule = _C.make_schedule(key, num_stages, n_microbatches, stages_per_rank)
    schedule.validate()
    return schedule
