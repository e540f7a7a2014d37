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
