"""Parameter, gradient and optimizer-state bytes per rank, as dsparallel's
training holds them: parameters in the model's dtype (a router in float32);
gradients of the same size (our DDP keeps ``.grad``), or under ZeRO stage 2
this rank's shard of each DDP bucket (buckets padded to a multiple of the
replicas); AdamW's two moments per parameter in its dtype and a float32
step count per tensor, or under ZeRO this rank's even slice of the
parameters laid end to end (padded likewise) in float32, with a float32
master copy for half-precision parameters and a step count per piece.

The buffers are mirrored exactly (ZeRO's per dtype and expert kind; DDP's
buckets: parameters in reverse order, 1 MiB for the first bucket of each
dtype and 25 MiB after), so that the bytes equal what a rank holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .layout import Layout
from .model import Model, Tensor, rank_tensors

_MB = 1024 * 1024
FIRST_BUCKET, BUCKET_CAP = 1 * _MB, 25 * _MB  # our DDP's defaults (torch's)
STEP_BYTES = 4  # AdamW's step count: a float32 scalar per tensor it steps


@dataclass(frozen=True)
class ModelState:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _bytes(t: Tensor, lay: Layout) -> int:
    return 4 if t.fp32 else lay.dtype_bytes


def _buckets(tensors: list[Tensor], lay: Layout) -> list[list[Tensor]]:
    """Our DDP reducer's buckets (csrc/core/bucket: assignBuckets)."""
    open_: dict[int, tuple[list[Tensor], int, int]] = {}
    out = []
    for t in reversed(tensors):
        group = _bytes(t, lay)  # one bucket group per dtype
        members, size, closed = open_.get(group, ([], 0, 0))
        members.append(t)
        size += t.numel * group
        cap = FIRST_BUCKET if closed == 0 else BUCKET_CAP
        if size >= cap:
            out.append(members)
            members, size, closed = [], 0, closed + 1
        open_[group] = (members, size, closed)
    out += [m for m, _, _ in open_.values() if m]
    return out


def _padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


def _slice_state(buffer: list[Tensor], world: int, rank: int, lay: Layout) -> int:
    """AdamW's state for this rank's slice of a ZeRO buffer: two float32
    moments per element, a float32 master copy of half-precision pieces, a
    step count per piece."""
    size = _padded(sum(t.numel for t in buffer), world) // world
    lo, hi = rank * size, (rank + 1) * size
    total, offset = 0, 0
    for t in buffer:
        a, b = max(lo, offset), min(hi, offset + t.numel)
        if a < b:
            master = 4 * (b - a) if _bytes(t, lay) < 4 else 0
            total += 2 * 4 * (b - a) + master + STEP_BYTES
        offset += t.numel
    return total


@functools.lru_cache(maxsize=4096)
def model_state(
    model: Model, lay: Layout, pp_rank: int = 0, dp_rank: int = 0, cp_rank: int = 0
) -> ModelState:
    """The bytes of one rank: pipeline rank ``pp_rank``, data-parallel rank
    ``dp_rank`` and context-parallel rank ``cp_rank`` (the rank's place
    among the replicas decides its ZeRO slices)."""
    per_stage = [
        rank_tensors(model, lay.tp, lay.num_stages, lay.ep, s) for s in lay.stages_of(pp_rank)
    ]
    tensors = [t for stage in per_stage for t in stage]
    params = sum(t.numel * _bytes(t, lay) for t in tensors)
    replicas = lay.dp * lay.cp
    replica = dp_rank * lay.cp + cp_rank  # the rank in dp_cp_group
    expert_replicas = replicas // lay.expert_split
    expert_replica = replica // lay.expert_split  # the rank in the expert data-parallel group
    if lay.zero == 0:
        moments = sum(2 * t.numel * _bytes(t, lay) + STEP_BYTES for t in tensors)
        return ModelState(params, params, moments)

    def place(expert: bool) -> tuple[int, int]:
        return (expert_replicas, expert_replica) if expert else (replicas, replica)

    buffers: list[tuple[list[Tensor], bool]] = []
    grads = 0
    if lay.zero == 2 and replicas > 1:
        # The DDP (one per stage) reduce-scatters its buckets: the
        # optimizer's buffers are those buckets, dense and expert apart.
        for stage in per_stage:
            for expert in (False, True):
                kind = [t for t in stage if t.expert == expert]
                buffers += [(b, expert) for b in _buckets(kind, lay)]
        for b, expert in buffers:
            world, _ = place(expert)
            grads += _padded(sum(t.numel for t in b), world) // world * _bytes(b[0], lay)
    else:
        grads = params
        for expert in (False, True):
            for width in sorted({_bytes(t, lay) for t in tensors}):
                kind = [t for t in tensors if t.expert == expert and _bytes(t, lay) == width]
                if kind:
                    buffers.append((kind, expert))
    optimizer = sum(_slice_state(b, *place(expert), lay) for b, expert in buffers)
    return ModelState(params, grads, optimizer)
