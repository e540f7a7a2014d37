"""Block-quantized FP8 checkpoints in (DeepSeek-V3's and R1's release format).

Their linear weights are ``float8_e4m3fn``, each beside a float32
``{name}_scale_inv`` of one scale per block of ``weight_block_size``
(128 x 128) elements: the weight is ``fp8 * scale_inv`` block by block (as
DeepSeek's own ``fp8_cast_bf16.py`` computes it, in float32). The config
says so in ``quantization_config`` (``quant_method: fp8``). A rank
dequantizes only the blocks of rows or columns it keeps, with the scale
rows or columns that cover them, into float32; ``from_pretrained`` copies
that into the model's dtype. The model is then an ordinary unquantized one
(``save_pretrained`` writes it without ``quantization_config``).
"""

from __future__ import annotations

import torch

from .hf_map import Piece

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def block_size(config: dict, path: str) -> tuple[int, int] | None:
    """The scale blocks of the checkpoint's config (None: not quantized);
    another quantization is refused by name."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"from_pretrained: {path} is quantized with {method!r}; dsparallel loads "
            "unquantized checkpoints and block-quantized fp8 ones (DeepSeek's release format)"
        )
    size = q.get("weight_block_size")
    if size is None or len(size) != 2 or min(size) < 1:
        raise ValueError(
            f"from_pretrained: {path}'s quantization_config has weight_block_size {size!r}; "
            "block-quantized fp8 needs [rows, columns] of one scale block (the release: "
            "[128, 128])"
        )
    return int(size[0]), int(size[1])


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(
    weight: torch.Tensor, piece: Piece, scale_slice, block: tuple[int, int]
) -> torch.Tensor:
    """``weight``: the ``piece`` block of an fp8 tensor; ``scale_slice``:
    its scale tensor's safetensors slice. Returns the block in float32."""
    shape = tuple(piece.shape)
    if len(shape) != 2:
        raise ValueError(
            f"from_pretrained: {piece.key} is {weight.dtype} of shape {shape}; block scales "
            "are defined for matrices only"
        )
    want = scale_shape(shape, block)
    got = tuple(scale_slice.get_shape())
    if got != want:
        raise ValueError(
            f"from_pretrained: {piece.key}{SCALE_SUFFIX} has shape {got}; a {shape} weight in "
            f"blocks of {list(block)} needs {want}"
        )
    if piece.dim is None:
        scales = scale_slice[:]
    else:
        # The scale rows (columns) covering the block, and where in them
        # the block starts.
        b = block[piece.dim]
        first, last = piece.start // b, -(-(piece.start + piece.length) // b)
        scales = scale_slice[first:last] if piece.dim == 0 else scale_slice[:, first:last]
        start = piece.start - first * b
    scales = scales.float()
    for dim in (0, 1):
        scales = scales.repeat_interleave(block[dim], dim)
    if piece.dim is None:
        scales = scales[: shape[0], : shape[1]]
    else:
        scales = scales.narrow(piece.dim, start, piece.length)
        other = 1 - piece.dim
        scales = scales.narrow(other, 0, shape[other])
    return weight.float() * scales
