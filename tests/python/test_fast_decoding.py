"""The decode paths that replace torch's kernels for speed hold to them:
oneDNN's packed bfloat16 linear equals ``F.linear`` bit for bit, and the
one-query attention equals float32 attention within its output's
rounding (and beats torch's bfloat16 fused kernel's error)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsparallel.inference.fast_linear import _can_pack, fast_decoding
from dsparallel.models.layers import dot_product_attention


def test_packed_linears_equal_f_linear_bit_for_bit():
    if not _can_pack():
        pytest.skip("no bfloat16 oneDNN on this CPU")
    torch.manual_seed(0)
    model = nn.Linear(96, 160, bias=True).bfloat16()
    inputs = [torch.randn(1, 96).bfloat16(), torch.randn(3, 5, 96).bfloat16()]
    with torch.no_grad():
        want = [model(x) for x in inputs]
        with fast_decoding(model):
            got = [model(x) for x in inputs]
            # A weight that is not one of the model's parameters is left alone.
            other = torch.randn(160, 96).bfloat16()
            assert torch.equal(F.linear(inputs[0], other), inputs[0] @ other.t())
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("masked", [False, True])
def test_one_query_attention_equals_float32_attention(masked):
    torch.manual_seed(1)
    b, heads, kv_heads, keys, d = 3, 8, 2, 37, 16
    q = torch.randn(b, heads, 1, d).bfloat16()
    k, v = (torch.randn(b, kv_heads, keys, d).bfloat16() for _ in range(2))
    mask = torch.rand(b, 1, 1, keys) > 0.3 if masked else None
    if masked:
        mask[..., -1] = True
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
    )
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with torch.no_grad():
        out = dot_product_attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16
    # Within the output's own rounding (bfloat16 keeps 8 bits).
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=2**-8)
    assert (out.float() - ref).abs().max() <= (fused.float() - ref).abs().max() + 1e-6
