"""A paged KV cache for continuous batching (vLLM's PagedAttention, done
with ATen's gathers and fused attention on the CPU).

The cache is a pool of fixed-size blocks of positions, per layer one
tensor [blocks x block_size, *entry] of each entry the model caches (keys
and values of this rank's heads; DeepSeek-V3's latent and rope key). A
sequence owns a list of blocks (its block table), taken from the pool as it
grows and given back when it ends, so no memory is held for tokens a
request has not produced.

A step runs every scheduled sequence's new tokens in one forward, one
after another as a batch of one (no padding in the GEMMs): a prefill chunk
of one sequence and the single next token of each decoding one. The
attention is computed per group of sequences: every decoding sequence in
one group, each prefill chunk in a group of its own. A group gathers its
sequences' cached positions through their block tables into a padded
[sequences, positions, *entry] and attends with a causal mask at each
query's position; positions past a sequence's end are masked (and zero,
never NaN, so a masked value cannot poison a sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class BlockPool:
    """This rank's blocks: every layer's cache storage, and the free list."""

    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockPool: num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        slots = num_blocks * block_size
        self.layers = {
            index: {
                name: torch.zeros(slots, *shape, dtype=dtype) for name, shape in entries.items()
            }
            for index, entries in model.cache_entries().items()
        }
        self._free = list(range(num_blocks - 1, -1, -1))

    @staticmethod
    def bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        per_position = sum(
            torch.Size(shape).numel()
            for entries in model.cache_entries().values()
            for shape in entries.values()
        )
        return per_position * block_size * size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def grow(self, table: list[int], positions: int) -> bool:
        """Extends ``table`` to hold ``positions``; False (and unchanged) when
        the pool has too few free blocks."""
        need = self.blocks_for(positions) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return True

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.layers.values() for t in s.values())


@dataclass
class Group:
    """Sequences attended together: ``index`` [g, q] their queries' places
    in the step's tokens (padded with a valid place, ``valid`` False);
    ``keys`` [g, positions] the pool slots of every cached position;
    ``allowed`` [g, q, positions] the causal mask."""

    index: torch.Tensor
    valid: torch.Tensor
    keys: torch.Tensor
    allowed: torch.Tensor


def plan_group(
    tables: list[list[int]],
    starts: list[int],
    counts: list[int],
    offsets: list[int],
    block_size: int,
):
    """The tensors of one group (built by the scheduler, sent to every rank):
    per sequence its block table, the position its new tokens start at,
    how many there are and where they begin in the step's tokens."""
    g, q = len(tables), max(counts)
    width = max(len(t) for t in tables)
    table = torch.zeros(g, width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    steps = torch.arange(q)
    count = torch.tensor(counts)
    valid = steps[None] < count[:, None]
    index = torch.where(valid, torch.tensor(offsets)[:, None] + steps[None], 0)
    positions = torch.where(valid, torch.tensor(starts)[:, None] + steps[None], 0)
    return {"table": table, "index": index, "valid": valid, "positions": positions}


class PagedStep:
    """One step's view of the pool on every rank: where each new token is
    written (``slots`` [tokens]) and the attention groups."""

    def __init__(self, pool: BlockPool, slots: torch.Tensor, groups: list[dict]):
        self.pool, self.slots = pool, slots
        bs = pool.block_size
        self.groups = []
        for g in groups:
            keys = (g["table"][:, :, None] * bs + torch.arange(bs)).flatten(1)
            allowed = torch.arange(keys.shape[1])[None, None] <= g["positions"][:, :, None]
            self.groups.append(Group(g["index"], g["valid"], keys, allowed))

    def layer(self, index: int) -> PagedLayer:
        return PagedLayer(self, self.pool.layers[index])


class PagedLayer:
    """What a layer's attention sees of a paged step (``kv_attention``,
    DeepSeek-V3's absorbed attention)."""

    def __init__(self, step: PagedStep, store: dict):
        self.step, self.store = step, store

    def attend(self, queries: dict, new: dict, per_group) -> torch.Tensor:
        """Writes ``new`` (name -> [tokens, *entry]) into the pool, then for
        each group calls ``per_group(queries [g, q, ...], cached [g,
        positions, *entry], allowed [g, q, positions])`` and returns its
        outputs at the step's tokens [tokens, ...]."""
        for name, values in new.items():
            self.store[name][self.step.slots] = values.to(self.store[name].dtype)
        out = None
        for g in self.step.groups:
            cached = {name: t[g.keys] for name, t in self.store.items()}
            result = per_group({n: t[g.index] for n, t in queries.items()}, cached, g.allowed)
            if out is None:
                tokens = next(iter(queries.values())).shape[0]
                out = result.new_empty((tokens, *result.shape[2:]))
            out[g.index[g.valid]] = result[g.valid]
        return out
