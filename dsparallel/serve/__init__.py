"""Serving: ``torchrun --nproc-per-node N -m dsparallel.serve --model DIR ...``
(an OpenAI-compatible HTTP server over tensor-parallel ranks, see the
"Serving" guide), and its ``Engine`` for a script of your own."""

from .engine import Engine, Event, QueueFull, SamplingParams

__all__ = ["Engine", "Event", "QueueFull", "SamplingParams"]
