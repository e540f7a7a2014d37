"""Activation checkpointing that also replays the tensor-parallel RNG stream.

``torch.utils.checkpoint`` restores the default generator before recomputing,
but not the per-rank stream that dropout inside tensor-parallel regions uses;
without it a recomputed dropout mask would differ from the one used forward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint as torch_checkpoint

from .tensor_parallel.random import cuda_rng_live, get_rng_tracker


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


def capture_rng():
    """The default generators' states (CPU, and the current CUDA device's when
    CUDA is in use: dropout on CUDA tensors draws from it) and the
    tensor-parallel streams."""
    cuda = (torch.cuda.current_device(), torch.cuda.get_rng_state()) if cuda_rng_live() else None
    return torch.get_rng_state(), cuda, get_rng_tracker().get_states()


@contextlib.contextmanager
def replay_rng(state):
    """Runs the body from a ``capture_rng()`` state, then puts the current
    states back (for recomputing a forward with the same dropout masks)."""
    cpu, cuda, streams = state
    tracker = get_rng_tracker()
    current = tracker.get_states()
    with torch.random.fork_rng(devices=[cuda[0]] if cuda else []):
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state(cuda[1], cuda[0])
        tracker.set_states(streams)
        try:
            yield
        finally:
            tracker.set_states(current)


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, keeping only its inputs; recomputed in backward
    with the same default and tensor-parallel RNG states."""
    return torch_checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=_tracker_context, **kwargs
    )
