"""What a rank holds, counted on the live objects, in the planner's terms:
the checks of its predictions, and the GPT job's report of them."""

from __future__ import annotations

import torch

from .memory import ModelState


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def held(module: torch.nn.Module, optimizer, ddps=()) -> ModelState:
    """Parameter bytes of ``module`` (each tensor once), gradient bytes
    (``.grad``, or under ZeRO stage 2 the DDPs' gradient shards), and the
    optimizer's state (a ``torch.optim`` optimizer's tensors; for
    ``ZeroRedundancyOptimizer`` its inner optimizer's and the float32
    master copies of half-precision pieces). ``ddps``: the job's
    ``DistributedDataParallel`` wrappers."""
    from ..zero import ZeroRedundancyOptimizer

    params = {id(p): p for p in module.parameters()}.values()
    param_bytes = sum(_nbytes(p) for p in params)
    sharded = [d for d in ddps if d.zero_stage == 2]
    if sharded:
        grads = sum(
            _nbytes(s)
            for d in sharded
            for r in (d.reducer, d._expert_reducer)
            if r is not None
            for s in r.grad_shards()
        )
    else:
        grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        inner = optimizer._inner
        state = sum(
            _nbytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v)
        )
        masters = sum(
            _nbytes(piece.param)
            for piece in optimizer._pieces
            if piece.param.data_ptr() != piece.view().data_ptr()
        )
        return ModelState(param_bytes, grads, state + masters)
    state = sum(
        _nbytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return ModelState(param_bytes, grads, state)


class SavedTensors:
    """Counts the bytes autograd keeps for backward while inside, from when
    a tensor is saved to when autograd lets it go (after its backward), and
    the peak over the body (under a pipeline schedule: the micro-batches in
    flight). Parameters are left out; a storage counts once, by the span
    its saved views reach (a batch's token ids sliced from a larger tensor
    count as the slice)::

        with SavedTensors(model) as saved:
            schedule.step(...)
        saved.peak
    """

    def __init__(self, module: torch.nn.Module | None = None):
        self._params = (
            {p.untyped_storage().data_ptr() for p in module.parameters()} if module else set()
        )
        self._held: dict[int, list[int]] = {}  # storage -> [views saved, lo, hi]
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return t
        size = t.element_size()
        lo = t.storage_offset() * size
        span = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
        hi = min(storage.nbytes(), lo + (span + 1) * size) if t.numel() else lo
        return _Held(self, t, key, lo, hi)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _add(self, key: int, lo: int, hi: int) -> None:
        entry = self._held.get(key)
        if entry is None:
            self._held[key] = [1, lo, hi]
            self.live += hi - lo
        else:
            before = entry[2] - entry[1]
            entry[0] += 1
            entry[1], entry[2] = min(entry[1], lo), max(entry[2], hi)
            self.live += entry[2] - entry[1] - before
        self.peak = max(self.peak, self.live)

    def _drop(self, key: int) -> None:
        entry = self._held[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._held[key]
            self.live -= entry[2] - entry[1]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Held:
    __slots__ = ("owner", "tensor", "key")

    def __init__(self, owner: SavedTensors, tensor: torch.Tensor, key: int, lo: int, hi: int):
        self.owner, self.tensor, self.key = owner, tensor, key
        owner._add(key, lo, hi)

    def __del__(self):
        self.owner._drop(self.key)


def measure_step(module: torch.nn.Module, optimizer, run, ddps=()) -> tuple:
    """Runs one training step ``run()`` (forward, backward, the optimizer's
    step and its ``zero_grad``) and returns what the rank held: the model
    state counted after the optimizer's step, before the gradients are let
    go, the peak bytes saved for backward over the step, and what ``run``
    returned."""
    counted = []
    zero_grad = optimizer.zero_grad

    def count_then_zero(*args, **kwargs):
        counted.append(held(module, optimizer, ddps))
        return zero_grad(*args, **kwargs)

    optimizer.zero_grad = count_then_zero
    try:
        with SavedTensors(module) as saved:
            value = run()
    finally:
        optimizer.zero_grad = zero_grad
    if not counted:
        raise RuntimeError("measure_step: the step did not call the optimizer's zero_grad")
    return counted[0], saved.peak, value
