"""Context parallelism: the sequence of every sample split over the ranks
of a ``cp`` group, attention computed across them.

- ``shard_sequence`` / ``unshard_sequence`` / ``positions``: the
  load-balanced layout (the sequence cut into 2C chunks, rank r holding
  chunks r and 2C-1-r, so that causal attention costs every rank the same)
  and the global positions of a rank's tokens (for RoPE and learned
  position embeddings).
- ``ring_attention``: keys and values travel the ring, partial results are
  merged by their log-sum-exp (``torch.ops.dsparallel.ring_attention``).
- ``ulysses_attention``: an all-to-all from sequence-split to head-split,
  attention over the whole sequence for 1/C of the heads, and back
  (``torch.ops.dsparallel.ulysses_all_to_all``).
"""

from .attention import MODES, check_mode, context_attention, ring_attention, ulysses_attention
from .layout import positions, shard_sequence, unshard_sequence

__all__ = [
    "MODES",
    "check_mode",
    "context_attention",
    "positions",
    "ring_attention",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
]
