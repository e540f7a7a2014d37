"""Decoding's matrix-vector products at the memory's speed on the CPU.

A decode step reads every weight once, so it should take about the weight
bytes over the memory bandwidth. ATen's ``F.linear`` does not get there
for bfloat16 on the CPU: it reorders the weight into oneDNN's blocked
layout on every call. ``packed_linears(model)`` reorders each bfloat16
weight once (``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's
CPU freezing does) and, while active, sends every ``F.linear`` over one of
the model's weights to oneDNN's packed kernel: the same values, bit for
bit, 2-2.6x faster at batch 1 on an AVX-512 BF16 CPU (measured in
``benchmarks/inference.py``). Float32 weights keep ATen's kernel, whose
matrix-vector product was faster with the weight read column-major
(``column_major_wide_weights``).

Only weights that are the model's parameters are packed (found by their
storage), so a weight the layers compute on the fly is never mistaken for
another; the packs are made on first use and dropped at the end.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _can_pack() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


class _PackedLinears(TorchFunctionMode):
    def __init__(self, model, pack: bool):
        super().__init__()
        self.params = set()
        if pack:
            self.params = {
                p.data_ptr()
                for p in model.parameters()
                if p.dim() == 2 and p.dtype == torch.bfloat16 and p.device.type == "cpu"
            }
        self.int8 = getattr(model, "_int8_weights", {})
        self.packed: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not torch.is_grad_enabled():
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            quantized = self.int8.get(w.data_ptr())
            if quantized is not None:
                q, scales = quantized
                y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scales)
                y = y.view(*x.shape[:-1], q.shape[0])
                return y if bias is None else y + bias
            if w.data_ptr() in self.params and x.dtype == w.dtype and x.dim() >= 2:
                key = (w.data_ptr(), tuple(w.shape), w.stride())
                packed = self.packed.get(key)
                if packed is None:
                    packed = self.packed[key] = torch.ops.mkldnn._reorder_linear_weight(w, 1)
                return torch.ops.mkldnn._linear_pointwise(
                    x.contiguous(), packed, bias, "none", [], ""
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def packed_linears(model):
    """While active (under ``torch.no_grad``), ``F.linear`` over ``model``'s
    bfloat16 weights runs oneDNN's packed kernel (where the CPU and build
    have bfloat16 oneDNN), and over its int8 weights (``quantize_int8``)
    ATen's int8 weight-only kernel."""
    mode = _PackedLinears(model, _can_pack())
    if not mode.params and not mode.int8:
        yield
        return
    with mode:
        yield


@contextlib.contextmanager
def column_major_wide_weights(model):
    """While active, each float32 weight with more outputs than inputs (the
    fused gate/up, the LM head's vocabulary slice, ...) is read from a
    column-major copy: the same values and shape, but a decode step's
    matrix-vector products over them ran ~30% faster on the CPU (MKL reads
    ``x @ W.t()`` row by row then). bfloat16 weights run slower so and are
    left alone (``packed_linears`` is their fast path). The model gets its
    own storage back at the end (it may be a view into a ZeRO buffer or be
    trained on), at the price of holding both copies of those weights
    while active."""
    swapped = []
    with torch.no_grad():
        for p in model.parameters():
            if (
                p.dim() == 2
                and p.dtype == torch.float32
                and 0 not in p.stride()  # not an int8 weight's stand-in
                and p.shape[0] > p.shape[1]
                and p.stride(1) != p.shape[0]
            ):
                swapped.append((p, p.data))
                p.data = p.data.t().contiguous().t()
    try:
        yield
    finally:
        for p, original in swapped:
            p.data = original


@contextlib.contextmanager
def fast_decoding(model):
    """Both of the above: what ``generate`` and the server decode under."""
    with column_major_wide_weights(model), packed_linears(model):
        yield


@torch.no_grad()
def quantize_int8(model) -> int:
    """Int8 weight-only quantization of ``model``'s linear weights, per
    output channel (symmetric, scale = max |w| / 127), in place; returns
    the bytes saved. Which weights: every 2-D weight that a decode step
    uses only as ``F.linear``'s weight, found by running one step under a
    recording mode (so the embedding, a tied head, DeepSeek-V3's kv_b,
    whose absorbed attention reads it in einsums, and the float32 router
    stay as they are). Every rank runs the step: call it on all of them.

    Each quantized parameter's storage is released; the parameter becomes
    a NaN stand-in of its shape (never silently wrong outside decoding),
    and ``fast_decoding`` computes its products from the int8 copy with
    torch's ``_weight_int8pack_mm``."""
    from .kv_cache import KVCache

    if getattr(model, "_int8_weights", None):
        return 0
    candidates = {
        p.data_ptr(): p for p in model.parameters() if p.dim() == 2 and p.is_floating_point()
    }
    other_uses: set[int] = set()

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            flat = list(args) + list(kwargs.values())
            for i, a in enumerate(flat):
                if isinstance(a, torch.Tensor) and a.data_ptr() in candidates:
                    if not (func is F.linear and i == 1 and a.dim() == 2):
                        other_uses.add(a.data_ptr())
            return func(*args, **kwargs)

    ids = torch.zeros(1, 2, dtype=torch.long)
    cache = KVCache(model, 1, 2, model._dtype())
    with Record():
        model.cached_step(ids, torch.arange(2)[None], None, cache.layers, 0)
    int8, saved = {}, 0
    for ptr, p in candidates.items():
        if ptr in other_uses:
            continue
        w = p.data.float()
        scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        saved += p.numel() * p.element_size() - q.numel() - scales.numel() * p.element_size()
        p.data = torch.full((1,), float("nan"), dtype=p.dtype).expand(p.shape)
        int8[p.data_ptr()] = (q, scales.to(p.dtype))
    model._int8_weights = int8
    return saved
