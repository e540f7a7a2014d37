"""RNG streams for tensor parallelism.

Inside the parallel region (e.g. dropout on attention probabilities, where each
rank holds different heads) every rank needs its own stream; outside it
(dropout on replicated activations) all ranks must draw the same numbers from
the default generator. ``manual_seed(seed)`` seeds both, Megatron style: the
default generator with ``seed`` on every rank, the tensor-parallel stream with
``seed + 2718 + tp_rank``. Code runs in the tensor-parallel stream inside
``get_rng_tracker().fork()``. ``dsparallel.checkpoint`` restores the stream on
recomputation, so recomputed dropout masks equal the original ones.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .group import resolve_group

MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718


def cuda_rng_live() -> bool:
    """True when CUDA is in use, so that its generator's state matters."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class RNGStatesTracker:
    """Named RNG states (CPU, and the current CUDA device when in use)."""

    def __init__(self):
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self._states = {}

    def is_seeded(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        devices = [torch.cuda.current_device()] if cuda_rng_live() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            self._states[name] = self._capture()

    @staticmethod
    def _capture() -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if cuda_rng_live():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def _restore(state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and cuda_rng_live():
            torch.cuda.set_rng_state(state["cuda"])

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        return {k: {d: s.clone() for d, s in v.items()} for k, v in self._states.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self._states = {k: dict(v) for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG, group=None):
        """Runs the body with the named stream, then puts the default back.

        An unseeded tensor-parallel stream is seeded on first use from the
        default generator's initial seed (the same on every rank when the
        user seeded torch), offset by the tensor-parallel rank.
        """
        if name not in self._states:
            if name != MODEL_PARALLEL_RNG:
                raise KeyError(f"RNG state {name!r} was never added")
            rank = resolve_group(group, "RNG tracker").rank()
            self.add(name, torch.initial_seed() + _SEED_OFFSET + rank)
        outside = self._capture()
        self._restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._capture()
            self._restore(outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def manual_seed(seed: int, group: dist.ProcessGroup | None = None) -> None:
    """Seeds the default generator (same on all ranks) and the per-rank stream."""
    rank = resolve_group(group, "manual_seed").rank()
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _SEED_OFFSET + rank)
