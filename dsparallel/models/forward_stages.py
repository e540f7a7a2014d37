"""Forward-only passes through a model's pipeline stages: evaluation's
forward and generation's prefill and decode steps. (Training runs the same
stages under a schedule through the C++ runtime.)

A rank may hold several stages (``stage_ids``). Each step runs this rank's
stages in ascending order, each over every micro-batch: a stage's input
comes from the stage before it (received when another rank holds that
one), and its output goes on to the next. That order is a topological
order of the stages' dependencies on every rank, and sends do not block,
so no placement can deadlock; with several micro-batches the first stage
runs micro-batch m + 1 while the next runs m.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import _C


def stage_ids(pp_rank: int, pp_size: int, per_rank: int = 1, placement: str = "loop") -> list:
    """The pipeline stages of pipeline rank ``pp_rank``, ascending:
    ``placement`` "loop" puts stage s on rank s % pp_size (interleaved
    schedules), "v" puts stages r and 2 pp_size - 1 - r on rank r (ZBV,
    DualPipeV; two per rank)."""
    if placement not in ("loop", "v"):
        raise ValueError(f"stage_placement must be 'loop' or 'v', got {placement!r}")
    if not isinstance(per_rank, int) or per_rank < 1:
        raise ValueError(f"stages_per_rank must be a positive integer, got {per_rank!r}")
    if placement == "v" and per_rank != 2:
        raise ValueError(f"stage_placement 'v' holds two stages per rank, not {per_rank}")
    total = pp_size * per_rank
    return [s for s in range(total) if _C.rank_of_stage(s, pp_size, placement) == pp_rank]


class ForwardStages:
    """One model's stages on this rank, driven forward only. ``step`` runs
    one pass of every micro-batch; ``send`` / ``recv`` carry anything else
    between pipeline ranks (generation's tokens, from the last stage back
    to the first); ``finish`` waits for the sends still in flight."""

    def __init__(self, model):
        lay = model.layout
        self.model = model
        self.group, self.me = lay.pp_group, lay.pp_rank
        self.last = model.num_stages - 1
        # Per key the last send (work, tensor): the tensor lives until the
        # send completes, which it has by the time the same key sends
        # again (that needed the first received), so nothing piles up.
        self._pending: dict = {}

    def step(
        self,
        microbatches: int,
        first: Callable[[int], torch.Tensor],
        compute: Callable[[int, int, torch.Tensor], object],
        buffer: Callable[[int, int], tuple],
    ) -> dict:
        """``first(m)``: stage 0's input for micro-batch m (called on the
        rank holding stage 0); ``compute(stage, m, x)``: that stage's
        output; ``buffer(stage, m)``: (shape, dtype) of the stage's input
        when it arrives from another rank. Returns {m: the last stage's
        output} on the rank holding the last stage, else {}."""
        model, owner = self.model, self.model.stage_owner
        held, out = {}, {}
        for s in model.stage_ids:
            for m in range(microbatches):
                if s == 0:
                    x = first(m)
                elif owner(s - 1) == self.me:
                    x = held.pop((s - 1, m))
                else:
                    shape, dtype = buffer(s, m)
                    x = self.recv(shape, dtype, owner(s - 1))
                h = compute(s, m, x)
                if s == self.last:
                    out[m] = h
                elif owner(s + 1) == self.me:
                    held[(s, m)] = h
                else:
                    self.send(("stage", s, m), h.contiguous(), owner(s + 1))
        return out

    def send(self, key, tensor: torch.Tensor, dst: int) -> None:
        if key in self._pending:
            self._pending[key][0].wait()
        work = dist.isend(tensor, group=self.group, group_dst=dst)
        self._pending[key] = (work, tensor)

    def recv(self, shape, dtype, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype)
        dist.recv(x, group=self.group, group_src=src)
        return x

    def finish(self) -> None:
        for work, _ in self._pending.values():
            work.wait()
        self._pending.clear()
