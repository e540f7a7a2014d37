"""Activation checkpointing that also replays the tensor-parallel RNG stream.

``torch.utils.checkpoint`` restores the default generator before recomputing,
but not the per-rank stream that dropout inside tensor-parallel regions uses;
without it a recomputed dropout mask would differ from the one used forward.
"""

from __future__ import annotations

import contextlib

import torch.utils.checkpoint as torch_checkpoint

from .tensor_parallel.random import get_rng_tracker


def _tracker_context():
    tracker = get_rng_tracker()
    at_forward = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, keeping only its inputs; recomputed in backward
    with the same default and tensor-parallel RNG states."""
    return torch_checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=_tracker_context, **kwargs
    )
