"""Context-parallel attention against one process.

Every rank builds the same whole q, k, v and output gradient, keeps its
load-balanced part (``shard_sequence``) and runs ring or Ulysses
attention; the output and the gradients of its q, k and v must equal its
part of ``scaled_dot_product_attention`` over the whole sequence and of
that's gradients: within 1e-10 in fp64 and 1e-5 in fp32, at cp 2 and 4,
causal and not, grouped-query heads, packed documents.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks

BATCH, HEADS, DIM = 2, 4, 8
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _whole(seq, kv_heads, dtype, docs):
    g = torch.Generator().manual_seed(seq * 10 + kv_heads)
    q = torch.randn(BATCH, HEADS, seq, DIM, generator=g, dtype=dtype)
    k = torch.randn(BATCH, kv_heads, seq, DIM, generator=g, dtype=dtype)
    v = torch.randn(BATCH, kv_heads, seq, DIM, generator=g, dtype=dtype)
    dout = torch.randn(BATCH, HEADS, seq, DIM, generator=g, dtype=dtype)
    doc_ids = None
    if docs:  # documents of uneven lengths, differently cut in each sample
        cuts = torch.tensor([[0, 3, 9, seq], [0, 7, seq - 2, seq]])
        doc_ids = torch.stack(
            [torch.bucketize(torch.arange(seq), c[1:-1], right=True) for c in cuts]
        )
    return q, k, v, dout, doc_ids


def _reference(q, k, v, dout, doc_ids, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None
    if doc_ids is not None:
        mask = (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
        if causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


CASES = [
    (mode, causal, kv, docs, dtype)
    for mode, causal, kv, docs, dtype in itertools.product(
        ("ring", "ulysses"), (True, False), (4, 2, 1), (False, True), TOLERANCE
    )
]


def _errors_body(rank, world):
    from dsparallel.context_parallel import (
        ring_attention,
        shard_sequence,
        ulysses_attention,
    )

    group = torch.distributed.group.WORLD
    attention = {"ring": ring_attention, "ulysses": ulysses_attention}
    errors = []
    for mode, causal, kv, docs, dtype in CASES:
        if mode == "ulysses" and kv % world and world % kv:
            continue
        seq = 8 * world
        whole = _whole(seq, kv, dtype, docs)
        expected = _reference(*whole, causal)
        q, k, v, dout, doc_ids = (
            None if t is None else shard_sequence(t, group, dim=2 if t.dim() == 4 else 1)
            for t in whole
        )
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = attention[mode](q, k, v, group, causal=causal, doc_ids=doc_ids)
        out.backward(dout)
        got = (out.detach(), q.grad, k.grad, v.grad)
        worst = max(
            (a - shard_sequence(b, group, dim=2)).abs().max().item() for a, b in zip(got, expected)
        )
        errors.append([mode, causal, kv, docs, str(dtype), worst])
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_ulysses_equal_one_process_attention(world):
    ranks = run_ranks(_errors_body, world, timeout=180)
    checked = set()
    for rank, errors in enumerate(ranks):
        assert errors, "nothing was checked"
        for mode, causal, kv, docs, dtype, worst in errors:
            tol = TOLERANCE[getattr(torch, dtype.split(".")[1])]
            where = f"rank {rank}: {mode}, causal={causal}, {kv} kv heads, docs={docs}, {dtype}"
            assert worst <= tol, f"{where}: off by {worst:.3g}"
            checked.add(mode)
    assert checked == {"ring", "ulysses"}


def _work_body(rank, world):
    """The query x key pairs of the blocks each rank's causal ring attention
    hands the attention kernel, forward and backward (from the profiler:
    the kernel calls and their shapes): one local causal block and C - 1
    half blocks on every rank."""
    from torch.profiler import ProfilerActivity, profile

    from dsparallel.context_parallel import ring_attention, shard_sequence

    group = torch.distributed.group.WORLD
    q, k, v, dout, _ = _whole(8 * world, 2, torch.float32, False)
    q, k, v, dout = (shard_sequence(t, group, dim=2) for t in (q, k, v, dout))
    q.requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        ring_attention(q, k, v, group, causal=True).backward(dout)
    pairs = {"forward": [], "backward": []}
    for e in prof.events():
        if not e.name.startswith("aten::_scaled_dot_product_flash_attention_for_cpu"):
            continue
        backward = e.name.endswith("_backward")
        shapes = e.input_shapes[1:3] if backward else e.input_shapes[0:2]
        pairs["backward" if backward else "forward"].append(shapes[0][2] * shapes[1][2])
    return {kind: sorted(calls) for kind, calls in pairs.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_the_load_balanced_layout_gives_every_rank_the_same_work(world):
    ranks = run_ranks(_work_body, world, timeout=120)
    assert all(r == ranks[0] for r in ranks), ranks
    s = 8  # local tokens: 2 chunks of 4
    blocks = sorted([s * s] + [s * s // 2] * (world - 1))
    assert ranks[0] == {"forward": blocks, "backward": blocks}, ranks[0]


def _bad_input_body(rank, world):
    from dsparallel.context_parallel import shard_sequence, ulysses_attention

    group = torch.distributed.group.WORLD
    errors = []
    q = torch.randn(1, 3, 8, 4)  # 3 heads over 2 ranks
    try:
        ulysses_attention(q, q, q, group)
    except ValueError as e:
        errors.append(str(e))
    for seq in (2, 10):  # shorter than the ranks' chunks; not a multiple of 2 x 2
        try:
            shard_sequence(torch.zeros(1, seq), group)
        except ValueError as e:
            errors.append(str(e))
    try:
        torch.ops.dsparallel.ring_attention(
            q[:, :, :3], q[:, :, :3], q[:, :, :3], group.group_name, True, None, None
        )
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_input_is_refused_on_every_rank():
    for errors in run_ranks(_bad_input_body, 2, timeout=60):
        assert len(errors) == 4, errors
        assert "3 query heads are not divisible by 2" in errors[0]
        assert "a sequence of 2 tokens" in errors[1] and "multiple of 2 x 2 = 4" in errors[1]
        assert "a sequence of 10 tokens" in errors[2]
        assert "the local sequence length 3 must be even" in errors[3]
