"""ZeRO stage 1: the optimizer state sharded evenly across data-parallel ranks.

``ZeroRedundancyOptimizer(params, optimizer_class, process_group=None, **defaults)``
has torch's constructor and methods, so that switching is an import change.
Unlike torch's, which gives each parameter whole to one rank (one large
embedding unbalances it) and broadcasts every parameter after the step,
shards here are even: the parameters of each (param group, dtype) are laid
end to end in one flat buffer, padded to a multiple of the group size, and
rank r owns the r-th equal slice, across parameter boundaries (Megatron-core's
distributed optimizer). The parameters become views into these buffers (no
second copy). The inner ``torch.optim`` optimizer steps only this rank's
slice (an fp32 view, or an fp32 master copy for half-precision parameters),
and one all-gather per buffer writes every rank the updated parameters in
place: the same traffic as a broadcast of each shard, in one call.

Gradients are whatever the user's data parallelism left in ``.grad`` (our DDP
or torch's all-reduces them: every rank keeps the whole averaged gradient,
and reads only its slice). A parameter whose ``.grad`` is None on this step
contributes zeros to its buffer's slice (as in Megatron-core); frozen
parameters (``requires_grad=False``) are not sharded at all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_FULL_PRECISION = (torch.float32, torch.float64)
# torch 2.13 renamed all_gather_into_tensor (still an alias there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Shard:
    """The parameters of one (param group, dtype), flat, and this rank's slice."""

    def __init__(self, group_index: int, params: list[torch.Tensor], rank: int, world: int):
        self.group_index = group_index
        self.params = params
        self.dtype = params[0].dtype
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.per_rank = -(-self.numel // world)  # ceil: padded to a multiple of world
        self.lo = rank * self.per_rank
        self.hi = self.lo + self.per_rank
        self.flat = torch.zeros(self.per_rank * world, dtype=self.dtype, device=params[0].device)
        with torch.no_grad():
            torch._foreach_copy_(self.views(), [p.detach() for p in params])
        self.bind()
        owned = self.flat[self.lo : self.hi]
        # What the inner optimizer steps: a view into the buffer when it is
        # full precision, else an fp32 master copy of the slice.
        data = owned if self.dtype in _FULL_PRECISION else owned.float()
        self.param = torch.nn.Parameter(data, requires_grad=True)
        self.versions = self.param_versions()

    def bind(self) -> None:
        """Makes every parameter a view into the buffer: no second copy of the
        parameters, and the all-gather writes them in place."""
        for p, v in zip(self.params, self.views()):
            if p.data_ptr() != v.data_ptr():
                p.data = v

    def param_versions(self) -> list[int]:
        # A parameter's own version counter moves when it is written through
        # the parameter (``model.load_state_dict``), not through the buffer.
        return [p._version for p in self.params]

    @torch.no_grad()
    def refresh_if_changed(self) -> None:
        """Takes the parameters back when something other than our step wrote
        them: rebound (``load_state_dict(assign=True)``, ``.data = ...``: copied
        into the buffer and bound again) or written in place (the fp32 master
        copy of a half-precision slice is refreshed)."""
        rebound = [
            (p, v) for p, v in zip(self.params, self.views()) if p.data_ptr() != v.data_ptr()
        ]
        for p, v in rebound:
            v.copy_(p.detach())
        self.bind()
        if not rebound and self.param_versions() == self.versions:
            return
        owned = self.flat[self.lo : self.hi]
        if self.param.data_ptr() != owned.data_ptr():
            self.param.copy_(owned)
        self.versions = self.param_versions()

    def views(self) -> list[torch.Tensor]:
        return [
            self.flat[o : o + n].view_as(p)
            for p, o, n in zip(self.params, self.offsets, self.numels)
        ]

    def owned_pieces(self):
        """(param, its offset in the buffer, a, b) for every parameter that
        overlaps this rank's slice, [a, b) being the overlap in buffer
        positions."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            a, b = max(self.lo, o), min(self.hi, o + n)
            if a < b:
                yield p, o, a, b

    def owned_grad(self) -> torch.Tensor | None:
        """This rank's slice of the concatenated gradients (zeros where a
        parameter has none, and in the padding); None if none has one."""
        if all(p.grad is None for p in self.params):
            return None
        out = torch.zeros(self.per_rank, dtype=self.param.dtype, device=self.flat.device)
        for p, o, a, b in self.owned_pieces():
            if p.grad is not None:
                out[a - self.lo : b - self.lo] = p.grad.reshape(-1)[a - o : b - o]
        return out


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
        self._shards: list[_Shard] = []
        self._inner: torch.optim.Optimizer | None = None
        self._consolidated: dict | None = None
        super().__init__(params, defaults)
        self._check_same_params_everywhere()
        self._inner = optimizer_class(
            [self._inner_group(s) for s in self._shards] or [{"params": []}], **defaults
        )
        # The inner class's defaults (betas, eps, ...) complete the user's
        # groups, so that state_dict() is a whole optimizer_class state dict.
        self.defaults = {**self._inner.defaults, **defaults}
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

    def _options(self, shard: _Shard) -> dict:
        """The hyperparameters of the user's group that holds ``shard``."""
        return {k: v for k, v in self.param_groups[shard.group_index].items() if k != "params"}

    def _inner_group(self, shard: _Shard) -> dict:
        return {**self._options(shard), "params": [shard.param]}

    def _sync_options(self) -> None:
        """The inner groups take the user's hyperparameters (LR schedulers and
        load_state_dict change those)."""
        for shard, inner in zip(self._shards, self._inner.param_groups):
            inner.update(self._options(shard))

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.param_groups[gi]["params"]:
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        new = [_Shard(gi, ps, self.rank, self.world) for ps in by_dtype.values()]
        self._shards += new
        if self._inner is not None:  # after construction: the inner optimizer too
            for s in new:
                self._inner.add_param_group(self._inner_group(s))

    # -- the step ---------------------------------------------------------

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
        for shard in self._shards:
            shard.refresh_if_changed()
            shard.param.grad = shard.owned_grad()
        self._inner.step()
        for shard in self._shards:
            shard.param.grad = None
            owned = shard.flat[shard.lo : shard.hi]
            if shard.param.data_ptr() != owned.data_ptr():
                owned.copy_(shard.param)  # fp32 master -> the half-precision buffer
            _all_gather(shard.flat, owned, group=self.process_group)  # into the parameters
            shard.versions = shard.param_versions()
        self._consolidated = None
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the gradients of every parameter by their global norm, computed
        from the slices each rank owns (each element counted once) and one
        all-reduce; returns the total norm. Call it between backward and step."""
        norm_type = float(norm_type)
        grads = [g for g in (s.owned_grad() for s in self._shards) if g is not None]
        device = self._shards[0].flat.device if self._shards else torch.device("cpu")
        if norm_type == float("inf"):
            local = max((g.abs().max() for g in grads), default=torch.zeros((), device=device))
            total = local.float().clone()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.process_group)
        else:
            local = sum(
                (g.float().abs().pow(norm_type).sum() for g in grads),
                torch.zeros((), device=device),
            )
            dist.all_reduce(local, group=self.process_group)
            total = local.pow(1.0 / norm_type)
        coef = max_norm / (total + 1e-6)
        if coef < 1:
            for s in self._shards:
                torch._foreach_mul_([p.grad for p in s.params if p.grad is not None], coef)
        return total

    # -- checkpoints --------------------------------------------------------

    def _full_state(self, shard: _Shard, state: dict) -> dict:
        """The shard's optimizer state over the whole buffer (every rank's
        slice, unpadded), by all-gather: tensors of the slice's length are
        per element, anything else (the step count) is shared."""
        full = {}
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() >= 1:
                out = torch.empty(shard.per_rank * self.world, dtype=v.dtype, device=v.device)
                _all_gather(out, v.contiguous(), group=self.process_group)
                full[k] = out[: shard.numel]
            else:
                full[k] = v
        return full

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

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers the whole optimizer state on rank ``to`` (call it on every
        rank), as a plain ``torch.optim`` state dict that ``state_dict()``
        then returns there: it loads into ``optimizer_class`` itself."""
        index = self._param_index()
        state: dict[int, dict] = {}
        for shard in self._shards:
            full = self._full_state(shard, self._inner.state.get(shard.param, {}))
            for p, o, n in zip(shard.params, shard.offsets, shard.numels):
                state[index[id(p)]] = {
                    k: (v[o : o + n].view_as(p) if v.dim() >= 1 else v).clone()
                    if torch.is_tensor(v)
                    else v
                    for k, v in full.items()
                }
        if self.rank == to:
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
        index = self._param_index()
        state = {}
        for shard in self._shards:
            local = self._inner.state.get(shard.param, {})
            for p, o, a, b in shard.owned_pieces():
                entry = {"zero_range": (a - o, b - o)}
                for k, v in local.items():
                    per_element = torch.is_tensor(v) and v.dim() >= 1
                    entry[k] = v[a - shard.lo : b - shard.lo].clone() if per_element else v
                state[index[id(p)]] = entry
        return {"state": state, "param_groups": self._groups_for_state_dict(), "zero_shard": True}

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
        # Each parameter's state, whole (flat): the pieces of several shards
        # are joined; per-element state is any tensor with a dimension.
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
                    if not (torch.is_tensor(v) and v.dim() >= 1):
                        slot[k] = v
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
        for gi, g in enumerate(groups):
            self.param_groups[gi].update({k: v for k, v in g.items() if k != "params"})
        index = self._param_index()
        for shard in self._shards:
            entries = [whole.get(index[id(p)], {}) for p in shard.params]
            if not any(entries):
                continue
            # Parameters outside the loaded shards' ranges have no entry:
            # zeros stand in (only this rank's slice is kept, and the shards
            # saved by the ranks that cover it are what fill it).
            state = {}
            for k in dict.fromkeys(k for e in entries for k in e):
                v0 = next(e[k] for e in entries if k in e)
                if torch.is_tensor(v0) and v0.dim() >= 1:
                    flat = torch.cat(
                        [e[k] if k in e else v0.new_zeros(n) for e, n in zip(entries, shard.numels)]
                    )
                    flat = torch.cat(
                        [flat, flat.new_zeros(shard.per_rank * self.world - flat.numel())]
                    )
                    state[k] = flat[shard.lo : shard.hi].to(shard.param.dtype).clone()
                else:
                    state[k] = v0.clone() if torch.is_tensor(v0) else v0
            self._inner.state[shard.param] = state
        self._sync_options()
        self._consolidated = None
