"""ZeRO: the optimizer state (stage 1) and the gradients (stage 2) sharded
evenly across data-parallel ranks.

``ZeroRedundancyOptimizer(params, optimizer_class, process_group=None, **defaults)``
has torch's constructor and methods, so that switching is an import change.
Unlike torch's, which gives each parameter whole to one rank (one large
embedding unbalances it) and broadcasts every parameter after the step,
shards here are even: parameters are laid end to end in flat buffers, each
padded to a multiple of the group size, and rank r owns the r-th equal slice
of every buffer, across parameter boundaries (Megatron-core's distributed
optimizer). The parameters become views into the buffers (no second copy).
The inner ``torch.optim`` optimizer steps only this rank's slices (fp32
views, or fp32 master copies for half-precision parameters), and one
all-gather per buffer writes every rank the updated parameters in place: the
same traffic as a broadcast of each shard.

Where the buffers come from decides the stage:

* Stage 1 (any data parallelism, or none): one buffer per (param group,
  dtype). Gradients are whatever the user's data parallelism left in
  ``.grad`` (our DDP or torch's all-reduces them, every rank keeps the whole
  averaged gradient) and only this rank's slice is read.
* Stage 2 (parameters of ``dsparallel.DistributedDataParallel(...,
  zero_stage=2)``): the buffers are the DDP's buckets. Its C++ reducer
  reduce-scatters each bucket during backward into this rank's gradient
  shard and keeps no ``.grad``; the optimizer steps on those shards.

A parameter without a gradient on a step contributes zeros (as in
Megatron-core); frozen parameters (``requires_grad=False``) are not sharded.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from .parallel_state import expert_dp_group_of, get_parallel_state, parallel_state_or_none

_FULL_PRECISION = (torch.float32, torch.float64)
# param_states' name for the fp32 master copy of a half-precision parameter.
MASTER = "master"
# torch 2.13 renamed all_gather_into_tensor (still an alias there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedBuffer:
    """Parameters laid end to end in one flat buffer (``padded_numel``
    elements, a multiple of the group size) and this rank's slice
    ``[lo, hi)`` of it, spread over ``group`` (the optimizer's or the DDP's;
    for expert parameters, the ranks holding the same experts). For stage 2
    the DDP's reducer supplies the gradient shard (``grad_shard``, the
    slice's averaged gradient)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        offsets: list[int],
        padded_numel: int,
        group,
        grad_shard: torch.Tensor | None = None,
        reducer=None,
        members: list[int] | None = None,
    ):
        self.params = params
        self.offsets = list(offsets)
        self.numels = [p.numel() for p in params]
        self.dtype = params[0].dtype
        self.group = group
        self.per_rank = padded_numel // dist.get_world_size(group)
        self.lo = dist.get_rank(group) * self.per_rank
        self.hi = self.lo + self.per_rank
        self.grad_shard = grad_shard
        self.reducer = reducer
        self.members = members  # stage 2: the parameters' indices in the reducer
        self.owner = None  # the optimizer that steps this buffer
        self.expert = bool(params) and getattr(params[0], "_dsp_expert_group", None) is not None
        # Stage 2 with overlap_param_gather: the all-gather after a step is
        # left running, and the DDP's forward pre-hooks wait for it.
        self.overlap_gather = False
        self.pending = None
        self.pieces: list[_Piece] = []
        self.flat = torch.zeros(padded_numel, dtype=self.dtype, device=params[0].device)
        with torch.no_grad():
            torch._foreach_copy_(self.views(), [p.detach() for p in params])
        self.bind()
        self.versions = self.param_versions()

    @classmethod
    def packed(cls, params: list[torch.Tensor], group) -> ShardedBuffer:
        """A stage-1 buffer: the parameters back to back."""
        offsets = [0]
        for p in params[:-1]:
            offsets.append(offsets[-1] + p.numel())
        total = offsets[-1] + params[-1].numel()
        world = dist.get_world_size(group)
        return cls(params, offsets, -(-total // world) * world, group)

    def bind(self) -> None:
        """Makes every parameter a view into the buffer: no second copy of the
        parameters, and the all-gather writes them in place."""
        for p, v in zip(self.params, self.views()):
            if p.data_ptr() != v.data_ptr():
                p.data = v

    def views(self) -> list[torch.Tensor]:
        return [
            self.flat[o : o + n].view_as(p)
            for p, o, n in zip(self.params, self.offsets, self.numels)
        ]

    def param_versions(self) -> list[int]:
        # A parameter's own version counter moves when it is written through
        # the parameter (``model.load_state_dict``), not through the buffer.
        return [p._version for p in self.params]

    @torch.no_grad()
    def refresh_if_changed(self) -> None:
        """Takes the parameters back when something other than our step wrote
        them: rebound (``load_state_dict(assign=True)``, ``.data = ...``: copied
        into the buffer and bound again) or written in place (the fp32 master
        copies of a half-precision slice are refreshed)."""
        rebound = [
            (p, v) for p, v in zip(self.params, self.views()) if p.data_ptr() != v.data_ptr()
        ]
        for p, v in rebound:
            v.copy_(p.detach())
        self.bind()
        if not rebound and self.param_versions() == self.versions:
            return
        for piece in self.pieces:
            if piece.has_master:
                piece.param.copy_(piece.view())
        self.versions = self.param_versions()

    def overlap(self, k: int) -> tuple[int, int]:
        """[a, b): where parameter k overlaps this rank's slice (a >= b: not)."""
        o = self.offsets[k]
        return max(self.lo, o), min(self.hi, o + self.numels[k])

    def has_grad(self) -> list[bool]:
        """Per parameter: whether it has a gradient. Under stage 2, whether a
        rank produced one in a synced backward since the shards were reset
        (None, as torch's ``.grad`` would be, otherwise)."""
        if self.grad_shard is not None:
            flags = self.reducer.params_with_gradients()
            return [flags[i] for i in self.members]
        return [p.grad is not None for p in self.params]

    def owned_grad(self, has: list[bool]) -> torch.Tensor | None:
        """This rank's slice of the gradients, in buffer positions from ``lo``:
        stage 2's reduced shard, or (stage 1) the slice of the concatenated
        ``.grad``; None if no parameter has a gradient."""
        if not any(has):
            return None
        if self.grad_shard is not None:
            return self.grad_shard
        out = torch.zeros(self.per_rank, dtype=self.dtype, device=self.flat.device)
        for k, p in enumerate(self.params):
            a, b = self.overlap(k)
            if a < b and has[k]:
                o = self.offsets[k]
                out[a - self.lo : b - self.lo] = p.grad.reshape(-1)[a - o : b - o]
        return out

    def param_grad(self, p: torch.Tensor) -> torch.Tensor:
        """Stage 2: parameter ``p``'s whole averaged gradient, pieced
        together from every rank's shard (one all-reduce over the group):
        for the few parameters whose gradient must meet another's (tied
        copies on two pipeline stages)."""
        k = self._index(p)
        o, (a, b) = self.offsets[k], self.overlap(k)
        full = torch.zeros(self.numels[k], dtype=self.grad_shard.dtype, device=self.flat.device)
        if a < b:
            full[a - o : b - o] = self.grad_shard[a - self.lo : b - self.lo]
        dist.all_reduce(full, group=self.group)
        return full.view_as(p)

    def set_param_grad(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Stage 2: this rank's shard takes its part of ``grad``, a whole
        gradient of parameter ``p``."""
        k = self._index(p)
        o, (a, b) = self.offsets[k], self.overlap(k)
        if a < b:
            self.grad_shard[a - self.lo : b - self.lo] = grad.reshape(-1)[a - o : b - o]

    def _index(self, p: torch.Tensor) -> int:
        return next(k for k, q in enumerate(self.params) if q is p)

    def start_gather(self) -> None:
        """Writes the master copies into the buffer and starts the all-gather
        over its group that gives every rank the updated parameters."""
        for piece in self.pieces:
            if piece.has_master:
                piece.view().copy_(piece.param)  # fp32 master -> the half-precision buffer
        self.pending = _all_gather(
            self.flat, self.flat[self.lo : self.hi], group=self.group, async_op=True
        )

    def wait_gather(self) -> None:
        """Returns once the parameters hold the last step's values."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.versions = self.param_versions()


class _Piece:
    """The part ``[a, b)`` of parameter k of a buffer that lies in this rank's
    slice: one tensor of the inner optimizer (a view of the buffer, or an
    fp32 master copy of it), with a state and a step count of its own, so
    that a parameter without a gradient is skipped as torch skips it."""

    def __init__(self, buffer: ShardedBuffer, group_index: int, k: int):
        self.buffer, self.group_index, self.k = buffer, group_index, k
        self.a, self.b = buffer.overlap(k)
        view = self.view()
        data = view if buffer.dtype in _FULL_PRECISION else view.detach().float()
        self.param = torch.nn.Parameter(data, requires_grad=True)

    @property
    def has_master(self) -> bool:
        """Whether the optimizer steps an fp32 copy of a half-precision slice."""
        return self.param.data_ptr() != self.view().data_ptr()

    @property
    def source(self) -> torch.Tensor:
        """The model's parameter this is a piece of."""
        return self.buffer.params[self.k]

    @property
    def range(self) -> tuple[int, int]:
        """The piece's elements within its parameter (flat)."""
        o = self.buffer.offsets[self.k]
        return self.a - o, self.b - o

    def view(self) -> torch.Tensor:
        return self.buffer.flat[self.a : self.b]

    def grad_of(self, owned: torch.Tensor | None, has: list[bool]) -> torch.Tensor | None:
        if owned is None or not has[self.k]:
            return None
        g = owned[self.a - self.buffer.lo : self.b - self.buffer.lo]
        return g if g.dtype == self.param.dtype else g.to(self.param.dtype)


def _signature(groups: list[dict]) -> list[tuple]:
    return [
        (gi, pi, tuple(p.shape), str(p.dtype), p.requires_grad)
        for gi, g in enumerate(groups)
        for pi, p in enumerate(g["params"])
    ]


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` so that each rank keeps the state of an even
    1/N slice of the parameters (see the module docstring)."""

    def __init__(self, params, optimizer_class, process_group=None, **defaults: Any):
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"ZeroRedundancyOptimizer: optimizer_class must be a torch.optim.Optimizer "
                f"subclass, got {optimizer_class!r}"
            )
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self._buffers: list[ShardedBuffer] = []
        self._pieces: list[_Piece] = []
        self._inner: torch.optim.Optimizer | None = None
        self._consolidated: dict | None = None
        self._auto_fused = False
        super().__init__(params, defaults)
        self._check_same_params_everywhere()
        # One inner group per user group, holding that group's pieces.
        groups = [self._inner_group(gi) for gi in range(len(self.param_groups))]
        self._inner = self._fused_inner(optimizer_class, groups, defaults)
        # The inner class's defaults (betas, eps, ...) complete the user's
        # groups, so that state_dict() is a whole optimizer_class state dict
        # (without our choice of the fused kernel: it stays inside).
        self.defaults = {**self._inner.defaults, **defaults}
        if self._auto_fused:
            self.defaults["fused"] = None
        for g in self.param_groups:
            for k, v in self.defaults.items():
                g.setdefault(k, v)

    # -- construction -----------------------------------------------------

    def _check_same_params_everywhere(self) -> None:
        mine = _signature(self.param_groups)
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.process_group)
        for r, theirs in enumerate(every):
            if theirs == every[0]:
                continue
            for a, b in zip(every[0], theirs):
                if a != b:
                    raise ValueError(
                        f"ZeroRedundancyOptimizer: ranks hold different parameters: parameter "
                        f"{a[1]} of group {a[0]} is {a[2]} {a[3]} on rank 0 but {b[2]} {b[3]} "
                        f"(group {b[0]}, index {b[1]}) on rank {r}"
                    )
            raise ValueError(
                f"ZeroRedundancyOptimizer: rank 0 has {len(every[0])} parameters, "
                f"rank {r} has {len(theirs)}"
            )

    def _fused_inner(self, optimizer_class, groups: list[dict], defaults: dict):
        """The inner optimizer, with ``fused=True`` when the class takes it and
        the user chose neither ``fused`` nor ``foreach``: the same update in
        one kernel per group. On this rank's slices of a 50M-parameter model,
        torch's CPU default (a loop over tensors) made AdamW the largest part
        of the step (benchmarks/zero.py); the fused kernel is several times
        faster. Where the kernel refuses (a device or dtype it lacks) the
        class's default is kept."""
        takes = "fused" in inspect.signature(optimizer_class.__init__).parameters
        if takes and "fused" not in defaults and "foreach" not in defaults:
            try:
                inner = optimizer_class(groups, fused=True, **defaults)
                self._auto_fused = True
                return inner
            except (RuntimeError, ValueError, TypeError):
                pass
        return optimizer_class(groups, **defaults)

    def _options(self, gi: int) -> dict:
        """The hyperparameters of the user's group ``gi`` (not our fused choice)."""
        skip = {"params", "fused"} if self._auto_fused else {"params"}
        return {k: v for k, v in self.param_groups[gi].items() if k not in skip}

    def _inner_group(self, gi: int) -> dict:
        pieces = [piece.param for piece in self._pieces if piece.group_index == gi]
        return {**self._options(gi), "params": pieces}

    def _sync_options(self) -> None:
        """The inner groups take the user's hyperparameters (LR schedulers and
        load_state_dict change those)."""
        for gi, inner in enumerate(self._inner.param_groups):
            inner.update(self._options(gi))

    def _claim(self, buffer: ShardedBuffer) -> None:
        if buffer.owner is not None and buffer.owner is not self:
            raise ValueError(
                "ZeroRedundancyOptimizer: parameters of one zero_stage=2 DDP bucket are split "
                "across two ZeroRedundancyOptimizers; give all of a DDP's parameters to one"
            )
        if buffer.owner is None:
            buffer.owner = self
            self._buffers.append(buffer)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        trainable = [p for p in self.param_groups[gi]["params"] if p.requires_grad]
        # Stage 2: the DDP's buckets that hold these parameters.
        by_buffer: dict[int, tuple[ShardedBuffer, list]] = {}
        # Stage 1: one buffer per (dtype, expert or not); expert parameters
        # (of expert-parallel MoE layers) are sharded over the ranks holding
        # the same experts, not over the whole group.
        by_dtype: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
        for p in trainable:
            buffer = getattr(p, "_dsp_zero_buffer", None)
            if buffer is not None:
                by_buffer.setdefault(id(buffer), (buffer, []))[1].append(p)
            else:
                expert = getattr(p, "_dsp_expert_group", None) is not None
                by_dtype.setdefault((p.dtype, expert), []).append(p)
        pairs = list(by_buffer.values())
        for (_, expert), ps in by_dtype.items():
            group = self.process_group
            if expert:
                group = expert_dp_group_of(f"of group {gi}", ps[0], "ZeroRedundancyOptimizer")
            pairs.append((ShardedBuffer.packed(ps, group), ps))
        for buffer, ps in pairs:
            self._claim(buffer)
            ids = {id(p) for p in ps}
            for k, p in enumerate(buffer.params):
                a, b = buffer.overlap(k)
                if a < b and id(p) in ids:
                    buffer.pieces.append(_Piece(buffer, gi, k))
                    self._pieces.append(buffer.pieces[-1])
        if self._inner is not None:  # after construction: the inner optimizer too
            self._inner.add_param_group(self._inner_group(gi))

    # -- the step ---------------------------------------------------------

    def _grads(self) -> list[tuple[_Piece, torch.Tensor | None]]:
        """Each piece with its gradient (None: its parameter has none)."""
        out = []
        for buffer in self._buffers:
            has = buffer.has_grad()
            owned = buffer.owned_grad(has)
            out += [(piece, piece.grad_of(owned, has)) for piece in buffer.pieces]
        return out

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None and not callable(closure):
            raise TypeError(
                f"ZeroRedundancyOptimizer.step: closure must be callable, got {closure!r}"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_options()
        for buffer in self._buffers:
            buffer.wait_gather()  # a step again before any forward
            buffer.refresh_if_changed()
        for piece, grad in self._grads():
            piece.param.grad = grad
        self._inner.step()
        for buffer in self._buffers:
            for piece in buffer.pieces:
                piece.param.grad = None
            buffer.start_gather()  # into the parameters
        for buffer in self._buffers:
            if not buffer.overlap_gather:
                buffer.wait_gather()
        self._consolidated = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients: ``.grad`` (stage 1) and the DDP's gradient
        shards (stage 2)."""
        super().zero_grad(set_to_none)
        for reducer in {id(b.reducer): b.reducer for b in self._buffers if b.reducer}.values():
            reducer.zero_grad_shards(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of every parameter by their global norm, computed
        from the slices each rank owns (each element counted once) and one
        all-reduce; returns the total norm. Call it between backward and step
        (instead of ``torch.nn.utils.clip_grad_norm_``, which under stage 2
        finds no ``.grad``, and under stage 1 computes the same norm from the
        whole gradients at N times the work).

        The parameters must be the whole model on every rank of the group:
        under tensor or pipeline parallelism each rank holds another part
        of it, whose norm this cannot weigh, and it refuses; the models'
        ``model.clip_grad_norm_(max_norm, optimizer=this)`` counts every
        part once."""
        self._check_whole_model("clip_grad_norm_")
        norm_type = float(norm_type)
        inf = norm_type == float("inf")
        device = self._buffers[0].flat.device if self._buffers else torch.device("cpu")
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

        def add(acc, g):
            g = g.float().abs()
            return torch.maximum(acc, g.max()) if inf else acc + g.pow(norm_type).sum()

        dense = expert = torch.zeros((), device=device)
        for piece, g in self._grads():
            if g is not None and piece.buffer.expert:
                expert = add(expert, g)
            elif g is not None:
                dense = add(dense, g)
        dist.all_reduce(dense, op=op, group=self.process_group)
        experts = [b for b in self._buffers if b.expert]
        if experts:
            # Over the ranks sharing the experts' slices, then over the
            # expert-parallel group, whose ranks hold the other experts.
            dist.all_reduce(expert, op=op, group=experts[0].group)
            dist.all_reduce(expert, op=op, group=get_parallel_state().ep_group)
        total = torch.maximum(dense, expert) if inf else (dense + expert).pow(1.0 / norm_type)
        coef = max_norm / (total + 1e-6)
        if coef < 1:
            self.scale_grad_shards_(coef)
            for b in self._buffers:
                if b.grad_shard is None:  # stage 1: every rank keeps the whole gradient
                    torch._foreach_mul_([p.grad for p in b.params if p.grad is not None], coef)
        return total

    def owned_grads(self) -> dict[int, list[tuple[tuple[int, int], torch.Tensor]]]:
        """Per model parameter (by id): the gradients of its parts in this
        rank's slices, each with its range in the flattened parameter. For
        a norm over a model split other ways too (``model.clip_grad_norm_``)."""
        out: dict[int, list] = {}
        for piece, g in self._grads():
            if g is not None:
                out.setdefault(id(piece.source), []).append((piece.range, g))
        return out

    def scale_grad_shards_(self, coef: float) -> None:
        """Multiplies stage 2's gradient shards (no ``.grad``) by ``coef``."""
        for b in self._buffers:
            if b.grad_shard is not None:
                b.grad_shard.mul_(coef)

    def _check_whole_model(self, what: str) -> None:
        state = parallel_state_or_none()
        if state is not None and (state.tp_size > 1 or state.pp_size > 1):
            raise ValueError(
                f"ZeroRedundancyOptimizer.{what}: under tensor or pipeline parallelism "
                f"(tp {state.tp_size}, pp {state.pp_size}) every rank holds another part of the "
                "model, and the norm of its own part is not the model's: call the model's "
                "clip_grad_norm_(max_norm, optimizer=...) (dsparallel.models), which counts "
                "every part once"
            )

    # -- checkpoints --------------------------------------------------------

    def _param_index(self) -> dict[int, int]:
        """id(param) -> its index in torch's state_dict numbering."""
        ids, i = {}, 0
        for g in self.param_groups:
            for p in g["params"]:
                ids[id(p)] = i
                i += 1
        return ids

    def _groups_for_state_dict(self) -> list[dict]:
        index = self._param_index()
        return [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [index[id(p)] for p in g["params"]],
            }
            for g in self.param_groups
        ]

    def _shard_state(self) -> dict[int, dict]:
        """This rank's state, per parameter index: the state of its elements
        in this rank's slice, with their range (``zero_range``)."""
        index = self._param_index()
        state = {}
        for piece in self._pieces:
            local = self._inner.state.get(piece.param, {})
            if local:
                # Cloned, the step count too: torch's optimizers increment
                # it in place.
                entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in local.items()}
                state[index[id(piece.source)]] = {"zero_range": piece.range, **entry}
        return state

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole optimizer state on rank ``to`` (call it on every
        rank), as a plain ``torch.optim`` state dict that ``state_dict()``
        then returns there: it loads into ``optimizer_class`` itself."""
        if any(b.expert for b in self._buffers):
            raise NotImplementedError(
                "ZeroRedundancyOptimizer.consolidate_state_dict: the optimizer holds expert-"
                "parallel parameters, which differ between ranks; save each rank's "
                "state_dict() shard instead"
            )
        every = [None] * self.world if self.rank == to else None
        dist.gather_object(self._shard_state(), every, group=self.process_group, group_dst=to)
        if self.rank != to:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        whole = self._join([{"state": s} for s in every], params)
        state = {
            i: {k: v.view_as(params[i]) if _per_element(v) else v for k, v in entry.items()}
            for i, entry in whole.items()
        }
        self._consolidated = {"state": state, "param_groups": self._groups_for_state_dict()}

    def state_dict(self) -> dict:
        """After ``consolidate_state_dict(to)``, on rank ``to``: the whole state
        as a plain ``torch.optim`` state dict. Otherwise this rank's shard of it
        in the same format (parameters indexed as torch does, each holding
        only the state of its elements in this rank's slice, with their
        offsets): save one per rank, and ``load_state_dict`` takes the list of
        them at any world size."""
        if self._consolidated is not None:
            return self._consolidated
        return {
            "state": self._shard_state(),
            "param_groups": self._groups_for_state_dict(),
            "zero_shard": True,
        }

    @staticmethod
    def _join(shards: list[dict], params: list[torch.Tensor]) -> dict[int, dict]:
        """Each parameter's state, whole and flat, from the pieces of several
        shards (or from a plain state dict); per-element state is any tensor
        with a dimension."""
        whole: dict[int, dict] = {}
        for sd in shards:
            for i, entry in sd["state"].items():
                i = int(i)
                if i >= len(params):
                    raise ValueError(
                        f"ZeroRedundancyOptimizer.load_state_dict: the state has parameter {i}, "
                        f"this optimizer only {len(params)}"
                    )
                p = params[i]
                a, b = entry.get("zero_range", (0, p.numel()))
                slot = whole.setdefault(i, {})
                for k, v in entry.items():
                    if k == "zero_range":
                        continue
                    if not _per_element(v):
                        slot[k] = v.clone() if torch.is_tensor(v) else v
                        continue
                    want = (b - a,) if "zero_range" in entry else tuple(p.shape)
                    if tuple(v.shape) != want:
                        raise ValueError(
                            f"ZeroRedundancyOptimizer.load_state_dict: state {k!r} of parameter "
                            f"{i} has shape {tuple(v.shape)} but this optimizer's parameter {i} "
                            f"needs {want} (a state saved for another model?)"
                        )
                    buf = slot.setdefault(k, torch.zeros(p.numel(), dtype=v.dtype, device=p.device))
                    buf[a:b] = v.reshape(-1).to(p.device)
        return whole

    def param_states(self) -> dict[torch.Tensor, dict]:
        """Each parameter's whole optimizer state, keyed by the parameter:
        per-element state shaped like it, scalars (the step) as they are.
        Every rank of a buffer's group gets its parameters' states (one
        all-gather per buffer): for checkpoints that any layout can load
        (``dsparallel.save_checkpoint``)."""
        out: dict[torch.Tensor, dict] = {}
        for buffer in self._buffers:
            mine = []
            for piece in buffer.pieces:
                local = self._inner.state.get(piece.param)
                if local:
                    entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in local.items()}
                    if piece.has_master:
                        entry[MASTER] = piece.param.detach().clone()
                    mine.append((piece.k, piece.range, entry))
            every = [None] * dist.get_world_size(buffer.group)
            dist.all_gather_object(every, mine, group=buffer.group)
            for shard in every:
                for k, (a, b), entry in shard:
                    p = buffer.params[k]
                    slot = out.setdefault(p, {})
                    for name, v in entry.items():
                        if _per_element(v):
                            flat = slot.setdefault(name, torch.zeros(p.numel(), dtype=v.dtype))
                            flat[a:b] = v.reshape(-1)
                        else:
                            slot[name] = v
        return {
            p: {k: v.view(p.shape) if _per_element(v) else v for k, v in entry.items()}
            for p, entry in out.items()
        }

    @torch.no_grad()
    def load_param_states(self, states: dict[torch.Tensor, dict]) -> None:
        """The inverse of ``param_states``: each of this rank's slices takes
        its part of its parameter's whole state, and a half-precision
        slice's fp32 master copy its saved value (not one rebuilt from the
        rounded parameter). Call it after the parameters were loaded."""
        for piece in self._pieces:
            entry = dict(states.get(piece.source) or {})
            master = entry.pop(MASTER, None)
            if not entry:
                continue
            a, b = piece.range
            if master is not None and piece.has_master:
                piece.param.copy_(master.reshape(-1)[a:b])
            self._inner.state[piece.param] = {
                k: v.reshape(-1)[a:b].to(piece.param.dtype).clone()
                if _per_element(v)
                else (v.clone() if torch.is_tensor(v) else v)
                for k, v in entry.items()
            }
        for buffer in self._buffers:
            # The parameters were written by the loader, the masters above:
            # the next step must not rebuild the masters from the parameters.
            buffer.versions = buffer.param_versions()
        self._consolidated = None

    def load_state_dict(self, state_dict) -> None:
        """Loads a plain ``torch.optim`` state dict (a consolidated one, or one
        saved from ``optimizer_class`` itself), or the list of every rank's
        ``state_dict()`` shards saved at any world size (resharding)."""
        shards = state_dict if isinstance(state_dict, list) else [state_dict]
        groups = shards[0]["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"ZeroRedundancyOptimizer.load_state_dict: the state has {len(groups)} param "
                f"groups, this optimizer {len(self.param_groups)}"
            )
        params = [p for g in self.param_groups for p in g["params"]]
        whole = self._join(shards, params)
        for gi, g in enumerate(groups):
            self.param_groups[gi].update({k: v for k, v in g.items() if k != "params"})
        index = self._param_index()
        for piece in self._pieces:
            entry = whole.get(index[id(piece.source)])
            if not entry:
                continue
            a, b = piece.range
            self._inner.state[piece.param] = {
                k: v[a:b].to(piece.param.dtype).clone()
                if _per_element(v)
                else (v.clone() if torch.is_tensor(v) else v)
                for k, v in entry.items()
            }
        self._sync_options()
        self._consolidated = None


def _per_element(v) -> bool:
    return torch.is_tensor(v) and v.dim() >= 1
