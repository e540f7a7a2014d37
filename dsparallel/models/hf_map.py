"""Where each of our parameters lies in a Hugging Face checkpoint.

Every parameter (and persistent buffer) of a model states, next to its
definition, how this rank's tensor is made from checkpoint tensors: a
``Piece`` is a block of one named tensor (whole, or a range of rows or
columns), ``Cat`` joins pieces along a dim (a fused gate/up weight: this
rank's gate rows, then its up rows), ``Stack`` stacks them (the experts
of a layer), ``Pad`` adds rows no checkpoint holds (a padded
vocabulary). The one description serves both directions: ``materialize``
reads a parameter from the checkpoint (each piece through its own slice,
never the whole tensor), ``split`` cuts a parameter back into pieces for
``save_pretrained`` to reassemble.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    key: str  # the checkpoint's name
    shape: tuple[int, ...]  # the whole tensor's shape
    dim: int | None = None  # None: the whole tensor; else rows (0) or columns (1)
    start: int = 0
    length: int = 0

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] = self.length
        return tuple(shape)

    def index(self) -> tuple:
        """The block as an index into the whole tensor."""
        if self.dim is None:
            return (...,)
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)


@dataclass(frozen=True)
class Cat:
    parts: tuple
    dim: int = 0


@dataclass(frozen=True)
class Stack:
    parts: tuple


@dataclass(frozen=True)
class Pad:
    """``part`` (None: nothing) followed by ``rows`` rows of zeros that no
    checkpoint holds: the padded rows of a vocabulary the tensor-parallel
    size does not divide. They are zeros when read, never saved."""

    part: object
    rows: int
    tail: tuple[int, ...]  # the shape after dim 0


Node = Piece | Cat | Stack | Pad


def whole(key: str, shape) -> Piece:
    return Piece(key, tuple(shape))


def rows(key: str, shape, rank: int, size: int) -> Piece:
    """Rank's contiguous share of the rows (dim 0)."""
    return _even(key, tuple(shape), 0, rank, size)


def cols(key: str, shape, rank: int, size: int) -> Piece:
    """Rank's contiguous share of the columns (dim 1)."""
    return _even(key, tuple(shape), 1, rank, size)


def padded_rows(key: str, shape, rank: int, size: int, padded: int) -> Node:
    """Rank's share of the rows of ``shape`` padded to ``padded`` rows (a
    multiple of ``size``): the checkpoint rows it covers, then zeros."""
    per = padded // size
    start = rank * per
    real = max(0, min(per, shape[0] - start))
    part = Piece(key, tuple(shape), 0, start, real) if real else None
    return Pad(part, per - real, tuple(shape[1:])) if real < per else part


def _even(key, shape, dim, rank, size) -> Piece:
    n = shape[dim] // size
    return Piece(key, shape, dim, rank * n, n)


def node_shape(node: Node) -> tuple[int, ...]:
    if isinstance(node, Piece):
        return node.block_shape
    if isinstance(node, Pad):
        inner = node_shape(node.part)[0] if node.part is not None else 0
        return (inner + node.rows, *node.tail)
    shapes = [node_shape(p) for p in node.parts]
    if isinstance(node, Stack):
        return (len(shapes), *shapes[0])
    out = list(shapes[0])
    out[node.dim] = sum(s[node.dim] for s in shapes)
    return tuple(out)


def pieces_of(node: Node) -> list[Piece]:
    if isinstance(node, Piece):
        return [node]
    if isinstance(node, Pad):
        return pieces_of(node.part) if node.part is not None else []
    return [p for part in node.parts for p in pieces_of(part)]


def materialize(node: Node, read: Callable[[Piece], torch.Tensor]) -> torch.Tensor:
    if isinstance(node, Piece):
        return read(node)
    if isinstance(node, Pad):
        zeros = torch.zeros(node.rows, *node.tail)
        if node.part is None:
            return zeros
        block = materialize(node.part, read)
        return torch.cat([block, zeros.to(block.dtype)])
    parts = [materialize(p, read) for p in node.parts]
    return torch.stack(parts) if isinstance(node, Stack) else torch.cat(parts, node.dim)


def split(node: Node, tensor: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
    """The inverse of ``materialize``: (piece, its block of ``tensor``)."""
    if isinstance(node, Piece):
        return [(node, tensor)]
    if isinstance(node, Pad):
        if node.part is None:
            return []
        return split(node.part, tensor[: tensor.shape[0] - node.rows])
    if isinstance(node, Stack):
        blocks = tensor.unbind(0)
    else:
        blocks = tensor.split([node_shape(p)[node.dim] for p in node.parts], node.dim)
    return [pair for part, block in zip(node.parts, blocks) for pair in split(part, block)]


def specs_of(module: torch.nn.Module) -> dict[str, Node]:
    """Parameter and buffer names under ``module`` -> their ``hf_specs``."""
    out = {}
    for prefix, sub in module.named_modules():
        for name, node in getattr(sub, "hf_specs", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = node
    return out


def initial_block(piece: Piece, seed: int, std: float) -> torch.Tensor:
    """The block ``piece`` of the value a freshly built model gives its
    checkpoint tensor: norm weights ones, biases (DeepSeek's score-correction
    bias among them) zeros, everything else N(0, std) as ``transformers``
    initialises. A
    matrix is drawn row by row, each row from a generator seeded by the
    seed, the name and the row alone, so a rank draws only its own rows (a
    block of columns: each whole row in turn, one at a time, never the
    whole tensor) and every layout builds the same model."""
    key, shape = piece.key, piece.shape
    module = key.rsplit(".", 2)[-2] if "." in key else ""
    if key.endswith(".weight") and ("norm" in module or module.startswith("ln_")):
        return torch.ones(piece.block_shape)  # RMSNorm, LayerNorm (GPT-2's ln_*)
    if key.endswith("bias"):
        return torch.zeros(piece.block_shape)
    base = seed * 1_000_003 + zlib.crc32(key.encode())
    g = torch.Generator().manual_seed(base)
    if len(shape) < 2:
        return torch.empty(shape).normal_(0.0, std, generator=g)[piece.index()]
    first, count = (piece.start, piece.length) if piece.dim == 0 else (0, shape[0])
    out = torch.empty(piece.block_shape)
    row = torch.empty(shape[1:])
    for j in range(count):
        g.manual_seed(base * 1_000_033 + first + j)
        if piece.dim == 1:
            out[j] = row.normal_(0.0, std, generator=g)[piece.start : piece.start + piece.length]
        else:
            out[j].normal_(0.0, std, generator=g)
    return out
