"""The grouped expert op (``torch.ops.dsparallel.grouped_mlp``) against a
per-expert loop of plain torch ops: outputs and every gradient, in float64
to rounding and in bfloat16 to its precision; with experts that own several
blocks, an empty block and an expert that gets no row."""

import pytest
import torch
import torch.nn.functional as F

from dsparallel.moe.ops import grouped_mlp

L, HIDDEN, FFN = 3, 8, 6
# Expert 2 owns two blocks, one of them empty; expert 1 appears once;
# expert 3 of the four gets nothing. Block sizes are uneven.
CHUNKS = [(0, 5), (2, 0), (1, 7), (0, 3), (2, 4)]


def _loop(x, w1, w2, chunks, activation, transposed):
    out = []
    for (e, _), part in zip(chunks, x.split([n for _, n in chunks])):
        a, b = (w1[e].t(), w2[e].t()) if transposed else (w1[e], w2[e])
        h = part @ a
        if activation == "gelu":
            act = F.gelu(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out.append(act @ b)
    return torch.cat(out)


def _inputs(activation, transposed, chunks, dtype, experts=L + 1, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = 2 * FFN if activation == "swiglu" else FFN
    rows = sum(n for _, n in chunks)
    w1_shape = (experts, width, HIDDEN) if transposed else (experts, HIDDEN, width)
    w2_shape = (experts, HIDDEN, FFN) if transposed else (experts, FFN, HIDDEN)
    make = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return make(rows, HIDDEN), make(*w1_shape) / 3, make(*w2_shape) / 3, make(rows, HIDDEN)


@pytest.mark.parametrize("transposed", [False, True], ids=["in-out", "linear"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_equals_the_per_expert_loop_in_float64(activation, transposed):
    x, w1, w2, g = _inputs(activation, transposed, CHUNKS, torch.float64)
    inputs = [t.requires_grad_() for t in (x, w1, w2)]
    out = grouped_mlp(x, w1, w2, CHUNKS, activation, transposed)
    want = _loop(x, w1, w2, CHUNKS, activation, transposed)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, inputs, g)
    ref = torch.autograd.grad(want, inputs, g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # The expert that got no row has a gradient, and it is zero.
    assert got[1][3].abs().max() == 0 and got[2][3].abs().max() == 0


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bfloat16_blocks_cut_for_the_kernel_cache_agree_with_the_loop(activation):
    # Blocks longer than the 64-row cut, with a remainder, and shorter.
    chunks = [(0, 150), (1, 64), (2, 9), (0, 70)]
    x, w1, w2, g = _inputs(activation, True, chunks, torch.float64, experts=3)
    ref_in = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = _loop(*ref_in, chunks, activation, True)
    ref = torch.autograd.grad(want, ref_in, g)
    low = [t.bfloat16().requires_grad_() for t in (x, w1, w2)]
    out = grouped_mlp(*low, chunks, activation, transposed=True)
    got = torch.autograd.grad(out, low, g.bfloat16())
    assert out.dtype == torch.bfloat16
    for a, b in zip((out, *got), (want, *ref)):
        # bfloat16 keeps 8 bits: 2 % of the largest entry.
        err = (a.double() - b).abs().max() / b.abs().max()
        assert err < 2e-2, err


def test_passes_opcheck():
    x, w1, w2, _ = _inputs("swiglu", True, CHUNKS, torch.float64)
    experts = [e for e, _ in CHUNKS]
    rows = [n for _, n in CHUNKS]
    for t in (x, w1, w2):
        t.requires_grad_()
    torch.library.opcheck(
        torch.ops.dsparallel.grouped_mlp, (x, w1, w2, experts, rows, "swiglu", True)
    )


def test_no_blocks_gives_no_rows():
    x, w1, w2, _ = _inputs("gelu", False, [], torch.float32)
    assert grouped_mlp(x, w1, w2, [], "gelu").shape == (0, HIDDEN)


@pytest.mark.parametrize(
    "chunks, activation, words",
    [
        ([(0, 5), (1, 7)], "gelu", ["blocks hold 12 rows", "x has 19"]),
        ([(0, 5), (4, 14)], "gelu", ["names expert 4", "4 local experts"]),
        (CHUNKS, "relu", ['"gelu" or "swiglu"', '"relu"']),
    ],
    ids=["rows", "expert", "activation"],
)
def test_bad_input_is_named(chunks, activation, words):
    x, w1, w2, _ = _inputs("gelu", False, CHUNKS, torch.float32)
    with pytest.raises(RuntimeError) as err:
        grouped_mlp(x, w1, w2, chunks, activation)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_mismatched_weights_are_named():
    x, w1, w2, _ = _inputs("gelu", False, CHUNKS, torch.float32)
    with pytest.raises(RuntimeError, match="do not fit x"):
        grouped_mlp(x, w1, w2, CHUNKS, "gelu", transposed=True)
    with pytest.raises(RuntimeError, match="share a dtype"):
        grouped_mlp(x, w1.double(), w2, CHUNKS, "gelu")
