"""Runs one rank's actions of a validated schedule: the Python half.

The C++ runtime (``csrc/pipeline/runtime.cpp``, ``_C.PipelineRuntime``) walks
the actions and owns everything between stages: the point-to-point transfers
(receives posted ahead), the headers that catch a stage output changing shape
(on both ends of the transfer), and dropping what travels once consumed. It
calls back here for compute only: a stage's forward (and loss, on the last
stage) and its backward, which keep the autograd graph of each micro-batch
until its backward has run.

The loss is divided by the number of micro-batches once, on the last stage,
so the gradients equal those of the whole batch run unsplit; calling
``step`` again accumulates into ``.grad`` like a normal backward. That is
the mean of the micro-batches' means, right when every micro-batch counts
the same number of items. A per-token loss opts out of it: a ``loss_fn``
that takes ``num_items_in_batch`` and has a ``count_items(targets)`` (on
itself, or on the object it is a bound method of: ``model.loss_fn`` of our
models) is given, for every micro-batch, the count that ``count_items``
returns for the list of the step's micro-batch targets (before the first
forward: every rank of the last stage calls it, so it may all-reduce the
count over data parallelism) and is not divided again: its value already
is the micro-batch's share of the batch's loss. ``losses`` then receives
each share times the number of micro-batches, so that their mean is the
batch's loss in either case.

A stage whose module is a DistributedDataParallel (ours or torch's) runs its
forwards under ``no_sync`` and arms the reducer just before the stage's last
backward of the step, so its replicas all-reduce the accumulated gradients
once per step, overlapped with that backward. Under a zero-bubble schedule
that is the stage's last W: its deferred weight gradients and a zero for
every other parameter go through one engine run, in which every
parameter's hook fires once.

Zero-bubble schedules split each backward into I and W: the stage's forward
runs with its ``F.linear`` calls routed to ``split_linear`` (split.py), the
C++ runtime runs the backward callback for I inside a capture of the
weight-gradient store, and runs the captured weight-gradient GEMMs at W.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch

from .. import _C
from ..checkpoint import capture_rng, replay_rng
from ..ddp import DistributedDataParallel
from .schedule import get_schedule
from .split import SplitLinears
from .stage import PipelineStage
from .timeline import parse_action


def _is_ddp(module) -> bool:
    return isinstance(module, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel))


@dataclass
class _Slot:
    """What one (stage, micro-batch) keeps between its forward and backward."""

    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None
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
        self._count_items = _item_counter(loss_fn)
        self._num_items = None  # this step's, for a per-token loss
        # Where a DDP stage syncs: its last action that adds gradients, a B
        # or (split backward) a W; DualPipeV mixes both in one stage.
        self._sync_at = {a.stage: (a.kind, a.microbatch) for a in self.actions if a.kind in "BW"}
        self._split_backward = any(a.kind == "W" for a in self.actions)
        # Which backwards of this rank are I's (DualPipeV mixes them with full
        # B's), and per stage the parameters whose gradient an I computed
        # itself instead of deferring it (found on each stage's first I).
        self._input_only = {(a.stage, a.microbatch) for a in self.actions if a.kind == "I"}
        self._not_deferred: dict[int, list[str]] = {}
        self._runtime = _C.PipelineRuntime(
            self.actions,
            self.num_stages,
            self.plan.num_ranks,
            n_microbatches,
            self.group,
            placement=self.plan.placement,
        )

    # ------------------------------------------------------------------ step

    def step(self, *args, target=None, losses: list | None = None):
        m = self.n_microbatches
        inputs = self._split(args, "input") if 0 in self.stages else None
        targets = None
        if self.num_stages - 1 in self.stages:
            if target is None:
                raise ValueError("the last stage's step() needs target=")
            targets = self._split((target,), "target")
            if self._count_items is not None:
                self._num_items = self._count_items([t[0] for t in targets])
        slots = {(s, mb): _Slot() for s in self.stages for mb in range(m)}
        stage_losses = [None] * m

        def forward(s, mb, received):
            stage, slot = self.stages[s], slots[(s, mb)]
            if stage.is_first:
                slot.args = inputs[mb]
            else:
                slot.args = (received.requires_grad_(received.is_floating_point()),)
            slot.targets = targets[mb] if stage.is_last else ()
            if stage.checkpoint:
                # Keep only the inputs (and the RNG states, so that dropout
                # draws the same masks when the backward recomputes).
                slot.rng = capture_rng()
                with torch.no_grad():
                    slot.output, slot.loss = self._compute(stage, slot)
            else:
                slot.output, slot.loss = self._compute(stage, slot)
            if stage.is_last:
                scale = 1 if self._num_items is None else m
                stage_losses[mb] = slot.loss.detach() * scale
                return None
            return slot.output.detach()

        def backward(s, mb, grad_output):
            stage, slot = self.stages[s], slots.pop((s, mb))
            if stage.checkpoint:
                with replay_rng(slot.rng):
                    slot.output, slot.loss = self._compute(stage, slot)
            if _is_ddp(stage.submod) and self._sync_at.get(s) == ("B", mb):
                stage.submod.prepare_for_backward([slot.output])
            watch = (s, mb) in self._input_only and s not in self._not_deferred
            before = _grad_marks(stage.submod) if watch else None
            if stage.is_last:
                share = slot.loss if self._num_items is not None else slot.loss / m
                torch.autograd.backward(share)
            else:
                torch.autograd.backward(slot.output, grad_output)
            if watch:
                after = _grad_marks(stage.submod)
                self._not_deferred[s] = [k for k in after if _changed(before[k], after[k])]
            return None if stage.is_first else slot.args[0].grad

        def weight(s, mb):
            submod = self.stages[s].submod
            if _is_ddp(submod) and self._sync_at.get(s) == ("W", mb):
                submod.prepare_for_backward([])
                return [p for p in submod.parameters() if p.requires_grad]
            return []

        self._runtime.step(forward, backward, weight if self._split_backward else None)
        if losses is not None and targets is not None:
            losses.extend(stage_losses)

    @property
    def trace(self) -> list[tuple[str, float, float]]:
        """The last step's compute actions as (action, start s, end s), on the
        clock of ``time.perf_counter``: for gather_trace / plot_schedule and
        the measured bubble."""
        return list(self._runtime.trace)

    @property
    def transfer_trace(self) -> list[tuple[str, float, float]]:
        """The last step's transfer actions ("0SEND_F3", "1RECV_B2", ...) as
        (action, start s, end s): posting a send, completing a receive. For
        ``bubble_breakdown``, which tells the part of the overhead spent in them."""
        return list(self._runtime.transfer_trace)

    def split_report(self) -> dict[int, dict]:
        """How much of each local stage's backward the last step deferred to
        W (split schedules; empty for the others). Per stage index:

        - ``backward_s``: the time of its I and full B actions, ``weight_s``:
          of its W actions (seconds, from ``trace``);
        - ``deferred_share``: ``weight_s / (backward_s + weight_s)``, the part
          of the stage's backward the schedule could move into bubbles;
        - ``not_deferred``: the names of parameters whose gradient was
          computed inside I (modules that do not route their weight
          gradient through ``split_linear``: still correct, only not
          deferred), and ``not_deferred_numel``: their share of the stage's
          trainable elements. Opt such a module in with ``split_linear``.
        """
        if not self._split_backward:
            return {}
        report = {}
        for s, stage in self.stages.items():
            times = {"B": 0.0, "I": 0.0, "W": 0.0}
            for text, start, end in self._runtime.trace:
                stage_of, kind, _ = parse_action(text)
                if stage_of == s and kind in times:
                    times[kind] += end - start
            backward, weight = times["B"] + times["I"], times["W"]
            names = self._not_deferred.get(s, [])
            params = dict(stage.submod.named_parameters())
            total = sum(p.numel() for p in params.values() if p.requires_grad)
            report[s] = {
                "backward_s": backward,
                "weight_s": weight,
                "deferred_share": weight / (backward + weight) if backward + weight else 0.0,
                "not_deferred": names,
                "not_deferred_numel": sum(params[n].numel() for n in names) / max(1, total),
            }
        return report

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

    def _compute(self, stage, slot):
        sync_off = stage.submod.no_sync() if _is_ddp(stage.submod) else contextlib.nullcontext()
        split = SplitLinears() if self._split_backward else contextlib.nullcontext()
        with sync_off, split:
            out = stage.submod(*slot.args)
        if not stage.is_last:
            return out, None
        if self._num_items is None:
            return out, self.loss_fn(out, *slot.targets)
        return out, self.loss_fn(out, *slot.targets, num_items_in_batch=self._num_items)


def _item_counter(loss_fn):
    """``count_items`` of a per-token ``loss_fn`` (see the module
    docstring), or None."""
    if loss_fn is None:
        return None
    owner = getattr(loss_fn, "__self__", None)
    count = getattr(loss_fn, "count_items", None) or getattr(owner, "count_items", None)
    if count is None:
        return None
    try:
        takes = "num_items_in_batch" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        takes = False
    return count if takes else None


def _grad_marks(module) -> dict:
    """Per trainable parameter, its gradient and that gradient's version now:
    a backward that adds to it replaces the tensor or bumps the version."""
    return {
        name: (p.grad, None if p.grad is None else p.grad._version)
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def _changed(before, after) -> bool:
    return before[0] is not after[0] or before[1] != after[1]


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


class ScheduleInterleavedZeroBubble(_PipelineSchedule):
    """Zero-bubble (Qi et al., ICLR 2024) with the backward split into I and
    W. With one stage per rank it is ZB-H1: 1F1B's order and activation
    bound, W's moved into the slots where 1F1B waits (a third of 1F1B's
    bubble when F, I and W take equal time). With several stages per rank
    (rank r holds r, r + p, ...; the micro-batches a multiple of the ranks)
    the same over interleaved 1F1B's order with a shorter warm-up, holding
    at most v x p stage-activations on a rank of v stages, as torch's order
    does: with equal F, I and W nothing idles once the last rank has started."""

    _NAME = "zb1p"

    def __init__(self, stages, n_microbatches: int, loss_fn=None):
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        super().__init__(stages, n_microbatches, loss_fn)


class _VSchedule(_PipelineSchedule):
    """Two stages per rank in a V: rank r holds stages r and 2p - 1 - r."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn=None):
        stages = list(stages)
        if len(stages) != 2:
            raise ValueError(f"{type(self).__name__} needs two stages per rank, got {len(stages)}")
        super().__init__(stages, n_microbatches, loss_fn)


class ScheduleZBVZeroBubble(_VSchedule):
    """ZBV (Qi et al., ICLR 2024, section 6): the backward split into I and
    W, the first and last stage on rank 0. With F, I and W of equal time its
    only idle time is the p - 1 forwards before the last rank starts, at
    1F1B's activation memory."""

    _NAME = "zbv"


class ScheduleDualPipeV(_VSchedule):
    """DeepSeek's DualPipe folded into a V (deepseek-ai/DualPipe's
    dualpipev.py; torch's ScheduleDualPipeV): the forward of one micro-batch
    paired with the backward of another in the steady state (their transfers
    run under each other's compute: sends and receives are posted without
    blocking), full backwards in the middle and split ones (I, then W) at the
    ends. Needs n_microbatches >= 2p."""

    _NAME = "dualpipev"


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """Several stages per rank (rank r holds r, r + p, ...): a smaller bubble."""

    _NAME = "interleaved_1f1b"

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn=None):
        super().__init__(list(stages), n_microbatches, loss_fn)
