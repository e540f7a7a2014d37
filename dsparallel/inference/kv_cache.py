"""The KV cache of one request batch: each layer's tensors allocated once,
for the prompt and every new token, written in place as decoding goes."""

from __future__ import annotations

import torch


class KVCache:
    """This rank's cache for its stage's layers: per layer what the model's
    ``new_cache`` makes (Llama and the GPT: keys and values of this rank's
    heads; DeepSeek-V3: the compressed latent and the shared rope key),
    ``length`` positions for ``batch`` sequences."""

    def __init__(self, model, batch: int, length: int, dtype: torch.dtype):
        self.layers = model.new_cache(batch, length, dtype)

    def rows(self, start: int, stop: int) -> dict:
        """The caches of sequences [start, stop) (views: a micro-batch's)."""
        return {
            index: {name: t[start:stop] for name, t in slot.items()}
            for index, slot in self.layers.items()
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers.values() for t in s.values())
