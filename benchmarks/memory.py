"""Activation memory as autograd sees it, for the benchmarks.

Use ``with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t)``
around the code to measure; ``meter.peak`` is then the largest number of bytes
held for backward at once, each storage counted once (weights saved by
several ops count once).
"""

from __future__ import annotations

import weakref


class SavedBytes:
    """Peak bytes of distinct storages saved for backward (weights count once)."""

    def __init__(self):
        self.refs: dict[int, list] = {}
        self.live = self.peak = 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [t.untyped_storage().nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(t, self._release, key)
        return t

    def _release(self, key):
        entry = self.refs.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self.refs[key]
