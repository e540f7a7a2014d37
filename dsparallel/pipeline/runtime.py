"""Executes one rank's actions of a validated schedule.

Transfers: a send is posted asynchronously (``isend``) and awaited at the
end of the step; a receive completes at its RECV action, in the order the C++
validator proved deadlock-free. Receives are posted ahead where their shape
is known (a gradient when its activation is sent; the next micro-batch's
activation once the first fixed the shape): gloo moves a message only once
both ends have posted it, so a receive posted late stalls the sender's data
until the receiving rank gets there. Each activation travels
with a small header (its shape and dtype), so a stage whose output shape
changes between micro-batches raises a clear error on both ends of the
transfer. Activations are dropped as soon as their backward has run.

The loss is divided by the number of micro-batches once, on the last stage,
so the gradients equal those of the whole batch run unsplit; calling
``step`` again accumulates into ``.grad`` like a normal backward.

A stage whose module is a DistributedDataParallel (ours or torch's) runs its
forwards under ``no_sync`` and arms the reducer just before the stage's last
backward of the step, so its replicas all-reduce the accumulated gradients
once per step, overlapped with that backward.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..checkpoint import capture_rng, replay_rng
from ..ddp import DistributedDataParallel
from .schedule import get_schedule
from .stage import PipelineStage

_MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def _tag(stage: int, microbatch: int, n_microbatches: int, backward: bool, header: bool):
    return ((stage * n_microbatches + microbatch) * 2 + int(backward)) * 2 + int(header)


def _is_ddp(module) -> bool:
    return isinstance(module, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel))


@dataclass
class _Slot:
    """What one (stage, micro-batch) keeps between its forward and backward."""

    input: torch.Tensor | None = None  # the received activation (RECV_F)
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    grad_input: torch.Tensor | None = None
    args: tuple = field(default_factory=tuple)
    targets: tuple = field(default_factory=tuple)
    rng: tuple | None = None  # checkpointing: the RNG states of the forward


class _PipelineSchedule:
    _NAME = ""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn=None):
        if not stages:
            raise ValueError("a pipeline schedule needs at least one stage on this rank")
        self.stages = {s.stage_index: s for s in stages}
        first = stages[0]
        self.group, self.num_stages = first.group, first.num_stages
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        per_rank = len(stages)
        self.plan = get_schedule(self._NAME, self.num_stages, n_microbatches, per_rank)
        if self.plan.num_ranks != first.group_size:
            raise ValueError(
                f"{self._NAME}: {self.num_stages} stages at {per_rank} per rank need "
                f"{self.plan.num_ranks} ranks, the group has {first.group_size}"
            )
        self.actions = self.plan.ranks[first.group_rank]
        mine = {a.stage for a in self.actions}
        if mine != set(self.stages):
            raise ValueError(
                f"this rank must hold stages {sorted(mine)}, got {sorted(self.stages)}"
            )
        last = self.stages.get(self.num_stages - 1)
        if last is not None and loss_fn is None:
            raise ValueError("the last stage needs a loss_fn")
        self._shapes: dict[int, torch.Size] = {}
        self._dtypes: dict[int, torch.dtype] = {}
        # Each stage's last backward in a step, where a DDP stage syncs.
        self._last_backward = {a.stage: a.microbatch for a in self.actions if a.kind == "B"}
        # The last step's compute actions as (action, start s, end s), for
        # gather_trace / plot_schedule and the measured bubble.
        self.trace: list[tuple[str, float, float]] = []

    # ------------------------------------------------------------------ step

    def step(self, *args, target=None, losses: list | None = None):
        m = self.n_microbatches
        inputs = self._split(args, "input") if 0 in self.stages else None
        targets = None
        if self.num_stages - 1 in self.stages:
            if target is None:
                raise ValueError("the last stage's step() needs target=")
            targets = self._split((target,), "target")
        slots = {(s, mb): _Slot() for s in self.stages for mb in range(m)}
        pending = []
        # Receives posted ahead: ("F" | "B", stage, micro-batch) -> (works, tensors).
        posted = {}
        for a in self.actions:
            if a.kind == "RECV_F" and a.microbatch == 0:
                self._prefetch_activation(posted, self.stages[a.stage], a.stage, 0)
        stage_losses = [None] * m
        self.trace = []
        for action in self.actions:
            s, mb, kind = action.stage, action.microbatch, action.kind
            start = time.perf_counter()
            slot = slots[(s, mb)]
            stage = self.stages[s]
            if kind in ("F", "B"):
                if kind == "F":
                    self._forward(stage, slot, slots, mb, inputs, targets, stage_losses)
                else:
                    self._backward(stage, slot, slots, mb)
                self.trace.append((str(action), start, time.perf_counter()))
            elif kind == "SEND_F":
                pending += self._send_activation(stage, slot.output.detach(), s, mb)
                grad = torch.empty_like(slot.output)
                src = stage.global_rank_of(s + 1)
                work = dist.irecv(grad, src, group=self.group, tag=_tag(s + 1, mb, m, True, False))
                posted[("B", s, mb)] = ([work], grad)
            elif kind == "RECV_F":
                early = posted.pop(("F", s, mb), None)
                if early is None:
                    slot.input = self._recv_activation(stage, s, mb)
                else:
                    slot.input = self._finish_activation(early, s, mb)
                if mb + 1 < m:
                    self._prefetch_activation(posted, stage, s, mb + 1)
            elif kind == "SEND_B":
                pending.append(
                    dist.isend(
                        slot.grad_input,
                        stage.global_rank_of(s - 1),
                        group=self.group,
                        tag=_tag(s, mb, m, True, False),
                    )
                )
            elif kind == "RECV_B":
                works, grad = posted.pop(("B", s, mb))
                for work in works:
                    work.wait()
                slot.grad_output = grad
        for work in pending:
            work.wait()
        if losses is not None and targets is not None:
            losses.extend(stage_losses)

    def _split(self, tensors, what):
        m = self.n_microbatches
        out = []
        for t in tensors:
            if t.shape[0] % m:
                raise ValueError(
                    f"the {what} batch of {t.shape[0]} cannot be split into {m} equal micro-batches"
                )
            out.append(t.chunk(m))
        return [tuple(chunks[i] for chunks in out) for i in range(m)]

    # --------------------------------------------------------------- compute

    def _stage_input(self, stage, slots, mb, inputs):
        s = stage.stage_index
        if stage.is_first:
            return inputs[mb]
        if s - 1 in self.stages:  # previous stage on this rank: local hand-off
            x = slots[(s - 1, mb)].output.detach()
        else:
            x = slots[(s, mb)].input
        return (x.requires_grad_(x.is_floating_point()),)

    def _forward(self, stage, slot, slots, mb, inputs, targets, stage_losses):
        args = self._stage_input(stage, slots, mb, inputs)
        slot.args = args
        slot.targets = targets[mb] if stage.is_last else ()
        if stage.checkpoint:
            # Keep only the inputs (and the RNG states, so that dropout draws
            # the same masks when the backward recomputes).
            slot.rng = capture_rng()
            with torch.no_grad():
                slot.output, slot.loss = self._compute(stage, slot)
        else:
            slot.output, slot.loss = self._compute(stage, slot)
        if stage.is_last:
            stage_losses[mb] = slot.loss.detach()

    def _compute(self, stage, slot):
        sync_off = stage.submod.no_sync() if _is_ddp(stage.submod) else contextlib.nullcontext()
        with sync_off:
            out = stage.submod(*slot.args)
        loss = self.loss_fn(out, *slot.targets) if stage.is_last else None
        return out, loss

    def _backward(self, stage, slot, slots, mb):
        s = stage.stage_index
        if stage.checkpoint:
            with replay_rng(slot.rng):
                slot.output, slot.loss = self._compute(stage, slot)
        if _is_ddp(stage.submod) and mb == self._last_backward[s]:
            stage.submod.reducer.prepare_for_backward([slot.output])
        if stage.is_last:
            torch.autograd.backward(slot.loss / self.n_microbatches)
        else:
            grad = slot.grad_output
            if s + 1 in self.stages:  # next stage on this rank
                grad = slots[(s + 1, mb)].grad_input
            torch.autograd.backward(slot.output, grad)
        if not stage.is_first:
            slot.grad_input = slot.args[0].grad
        # Free the activations: only the gradient for the previous stage stays.
        slot.output = slot.loss = slot.grad_output = slot.rng = None
        slot.args = slot.targets = ()

    # ------------------------------------------------------------- transfers

    def _send_activation(self, stage, out, s, mb):
        m = self.n_microbatches
        if out.dtype not in _DTYPES or out.dim() > _MAX_DIMS:
            raise ValueError(
                f"stage {s} output of dtype {out.dtype} and {out.dim()} dims cannot "
                "be sent between stages"
            )
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0], header[1] = out.dim(), _DTYPES.index(out.dtype)
        header[2 : 2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
        dst = stage.global_rank_of(s + 1)
        works = [dist.isend(header, dst, group=self.group, tag=_tag(s, mb, m, False, True))]
        try:
            self._check_shape(s, mb, out.shape)
        except RuntimeError:
            # Deliver the header only, so the receiver raises the same error
            # (its receive, posted for the old shape, never gets mismatched data).
            works[0].wait()
            raise
        data = out.contiguous()
        works.append(dist.isend(data, dst, group=self.group, tag=_tag(s, mb, m, False, False)))
        return works

    def _recv_activation(self, stage, s, mb):
        m = self.n_microbatches
        src = stage.global_rank_of(s - 1)
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
        dist.recv(header, src, group=self.group, tag=_tag(s - 1, mb, m, False, True))
        shape, dtype = self._parse_header(header)
        self._check_shape(s - 1, mb, shape)
        self._dtypes[s - 1] = dtype
        x = torch.empty(shape, dtype=dtype)
        dist.recv(x, src, group=self.group, tag=_tag(s - 1, mb, m, False, False))
        return x

    def _prefetch_activation(self, posted, stage, s, mb):
        """Posts the receive of stage s's input for mb when its shape is known."""
        if s - 1 not in self._shapes or ("F", s, mb) in posted:
            return
        m = self.n_microbatches
        src = stage.global_rank_of(s - 1)
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
        x = torch.empty(self._shapes[s - 1], dtype=self._dtypes[s - 1])
        works = [
            dist.irecv(header, src, group=self.group, tag=_tag(s - 1, mb, m, False, True)),
            dist.irecv(x, src, group=self.group, tag=_tag(s - 1, mb, m, False, False)),
        ]
        posted[("F", s, mb)] = (works, (header, x))

    def _finish_activation(self, early, s, mb):
        works, (header, x) = early
        works[0].wait()
        shape, _ = self._parse_header(header)
        self._check_shape(s - 1, mb, shape)  # raises before waiting for data never sent
        works[1].wait()
        return x

    @staticmethod
    def _parse_header(header):
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        return torch.Size(header[2 : 2 + ndim].tolist()), dtype

    def _check_shape(self, s, mb, shape):
        """Stage outputs keep one shape across micro-batches (checked on both ends)."""
        first = self._shapes.setdefault(s, shape)
        if shape != first:
            raise RuntimeError(
                f"stage {s} output changed shape between micro-batches: "
                f"{list(first)} for the first, {list(shape)} for micro-batch {mb}"
            )


class ScheduleGPipe(_PipelineSchedule):
    """All forwards, then all backwards: m micro-batches in flight."""

    _NAME = "gpipe"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None):
        super().__init__([stage], n_microbatches, loss_fn)


class Schedule1F1B(_PipelineSchedule):
    """One forward, one backward: at most (stages - stage) micro-batches in flight."""

    _NAME = "1f1b"

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn=None):
        super().__init__([stage], n_microbatches, loss_fn)


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """Several stages per rank (rank r holds r, r + p, ...): a smaller bubble."""

    _NAME = "interleaved_1f1b"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn=None):
        super().__init__(list(stages), n_microbatches, loss_fn)
