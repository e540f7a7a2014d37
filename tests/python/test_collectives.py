"""Every collective of "dsp" against exact expected values and against gloo,
in real processes, world sizes 1 to 4."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

WORLDS = [1, 2, 3, 4]
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]
# 0 elements, 1, odd, one-shot sized, and several 1 MiB chunks.
SIZES = [0, 1, 37, 4099, 700_001]


def _reduce_expect(op, n, base):
    """Each rank r contributes (r + 1) * base (small integers: exact in every dtype)."""
    vals = [(r + 1) * base for r in range(n)]
    if op == dist.ReduceOp.SUM:
        return sum(vals)
    if op == dist.ReduceOp.PRODUCT:
        out = torch.ones_like(base)
        for v in vals:
            out = out * v
        return out
    if op == dist.ReduceOp.MIN:
        return vals[0]
    if op == dist.ReduceOp.MAX:
        return vals[-1]
    if op == dist.ReduceOp.AVG:
        return sum(vals) / n
    raise AssertionError(op)


def _all_reduce_body(rank, n):
    ops = [
        dist.ReduceOp.SUM,
        dist.ReduceOp.PRODUCT,
        dist.ReduceOp.MIN,
        dist.ReduceOp.MAX,
        dist.ReduceOp.AVG,
    ]
    for dtype in DTYPES:
        for size in SIZES:
            # values 0..2 so that products of up to 4 ranks fit in int8
            base = (torch.arange(size) % 3).to(torch.float64)
            for op in ops:
                if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                if op == dist.ReduceOp.PRODUCT and size > 4099:
                    continue  # same kernel path as SUM; keeps the test short
                t = ((rank + 1) * base).to(dtype)
                dist.all_reduce(t, op=op)
                expect = _reduce_expect(op, n, base).to(dtype)
                assert torch.equal(t, expect), (dtype, size, op, t[:8], expect[:8])
    # bool: SUM is logical or, MIN logical and
    b = torch.tensor([rank == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.SUM)
    assert b.tolist() == [True, True, False]
    b = torch.tensor([rank == 0, True, False])
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    assert b.tolist() == [n == 1, True, False]


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_every_dtype_op_size(world):
    run_ranks(_all_reduce_body, world)


def _against_gloo_body(rank, n):
    gloo = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(1234 + rank)
    for size in [1, 1000, 300_000]:
        x = torch.randn(size, generator=gen, dtype=torch.float64)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a)
        dist.all_reduce(b, group=gloo)
        # float64 sums in a different order: agree to rounding
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        xi = torch.randint(-1000, 1000, (size,), generator=gen)
        a, b = xi.clone(), xi.clone()
        dist.all_reduce(a, op=dist.ReduceOp.MAX)
        dist.all_reduce(b, op=dist.ReduceOp.MAX, group=gloo)
        assert torch.equal(a, b)
        outs_a = [torch.empty(size) for _ in range(n)]
        outs_b = [torch.empty(size) for _ in range(n)]
        y = torch.randn(size, generator=gen)
        dist.all_gather(outs_a, y)
        dist.all_gather(outs_b, y, group=gloo)
        for p, q in zip(outs_a, outs_b):
            assert torch.equal(p, q)
        z = torch.randn(size, generator=gen) if rank == 0 else torch.empty(size)
        z2 = z.clone()
        dist.broadcast(z, 0)
        dist.broadcast(z2, 0, group=gloo)
        assert torch.equal(z, z2)


@pytest.mark.parametrize("world", [2, 3])
def test_matches_gloo(world):
    run_ranks(_against_gloo_body, world)


def _rooted_and_gather_body(rank, n):
    for size in SIZES:
        for root in range(n):
            # broadcast
            t = torch.full((size,), float(rank), dtype=torch.float32)
            dist.broadcast(t, src=root)
            assert torch.equal(t, torch.full((size,), float(root)))
            # reduce
            t = torch.full((size,), rank + 1, dtype=torch.int64)
            dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
            if rank == root:
                assert torch.equal(t, torch.full((size,), n * (n + 1) // 2))
            else:
                assert torch.equal(t, torch.full((size,), rank + 1))  # untouched
            # gather
            mine = torch.full((size,), rank, dtype=torch.int32)
            lst = [torch.empty(size, dtype=torch.int32) for _ in range(n)] if rank == root else None
            dist.gather(mine, lst, dst=root)
            if rank == root:
                for r, x in enumerate(lst):
                    assert torch.equal(x, torch.full((size,), r, dtype=torch.int32))
            # scatter
            out = torch.empty(size, dtype=torch.float64)
            src = [torch.full((size,), 10.0 + r, dtype=torch.float64) for r in range(n)]
            dist.scatter(out, src if rank == root else None, src=root)
            assert torch.equal(out, torch.full((size,), 10.0 + rank, dtype=torch.float64))
        # all_gather (list) and all_gather_into_tensor
        outs = [torch.empty(size, dtype=torch.bfloat16) for _ in range(n)]
        dist.all_gather(outs, torch.full((size,), rank, dtype=torch.bfloat16))
        for r, x in enumerate(outs):
            assert torch.equal(x, torch.full((size,), r, dtype=torch.bfloat16))
        flat = torch.empty(n * size, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, torch.full((size,), rank, dtype=torch.int64))
        assert torch.equal(flat, torch.arange(n).repeat_interleave(size))


@pytest.mark.parametrize("world", WORLDS)
def test_broadcast_reduce_gather_scatter_all_gather(world):
    run_ranks(_rooted_and_gather_body, world)


def _reduce_scatter_all_to_all_body(rank, n):
    for size in SIZES:
        # reduce_scatter (list): block j of rank r holds r + j
        ins = [torch.full((size,), float(rank + j)) for j in range(n)]
        out = torch.empty(size)
        dist.reduce_scatter(out, ins)
        assert torch.equal(out, torch.full((size,), float(n * (n - 1) / 2 + n * rank)))
        # reduce_scatter_tensor
        inp = torch.cat(ins)
        out2 = torch.empty(size)
        dist.reduce_scatter_tensor(out2, inp, op=dist.ReduceOp.MAX)
        assert torch.equal(out2, torch.full((size,), float(n - 1 + rank)))
        # all_to_all_single, equal splits: row j*size..(j+1)*size goes to rank j
        inp = torch.arange(n * size, dtype=torch.int64) + 1_000_000 * rank
        out = torch.empty(n * size, dtype=torch.int64)
        dist.all_to_all_single(out, inp)
        expect = torch.cat(
            [torch.arange(rank * size, (rank + 1) * size) + 1_000_000 * r for r in range(n)]
        )
        assert torch.equal(out, expect)
    # uneven splits: rank i sends (i + j + 1) rows of width 3 to rank j
    send = [i_j + 1 for i_j in (rank + j for j in range(n))]
    recv = [r + rank + 1 for r in range(n)]
    inp = torch.cat([torch.full((send[j], 3), 100 * rank + j) for j in range(n)])
    out = torch.empty(sum(recv), 3, dtype=inp.dtype)
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    expect = torch.cat([torch.full((recv[r], 3), 100 * r + rank) for r in range(n)])
    assert torch.equal(out, expect)
    # list all_to_all with uneven sizes
    ins = [torch.full((rank + j + 1,), float(rank * 10 + j)) for j in range(n)]
    outs = [torch.empty(r + rank + 1) for r in range(n)]
    dist.all_to_all(outs, ins)
    for r, x in enumerate(outs):
        assert torch.equal(x, torch.full((r + rank + 1,), float(r * 10 + rank)))
    dist.barrier()


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_and_all_to_all(world):
    run_ranks(_reduce_scatter_all_to_all_body, world)


def _noncontiguous_and_coalesced_body(rank, n):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = (base * (rank + 1)).t()  # non-contiguous view
    assert not t.is_contiguous()
    dist.all_reduce(t)
    assert torch.equal(t, (base * (n * (n + 1) / 2)).t())
    big = torch.zeros(8, 8)
    col = big[:, 3]  # strided column: the result must land in `big`
    col.fill_(rank + 1.0)
    dist.all_reduce(col)
    assert torch.equal(big[:, 3], torch.full((8,), n * (n + 1) / 2))
    assert big.sum() == 8 * n * (n + 1) / 2
    outs = [torch.empty(6, 4).t() for _ in range(n)]
    dist.all_gather(outs, torch.full((4, 6), float(rank)))
    for r, x in enumerate(outs):
        assert torch.equal(x, torch.full((4, 6), float(r)))
    # coalesced all-reduce (one synchronisation for the lot)
    ts = [torch.full((3,), float(rank)), torch.full((2, 2), 2.0 * rank)]
    dist.all_reduce_coalesced(ts)
    s = n * (n - 1) / 2
    assert torch.equal(ts[0], torch.full((3,), s))
    assert torch.equal(ts[1], torch.full((2, 2), 2 * s))
    # zero-element tensors through every collective
    z = torch.empty(0)
    dist.all_reduce(z)
    dist.broadcast(z, 0)
    dist.all_gather([torch.empty(0) for _ in range(n)], z)


@pytest.mark.parametrize("world", [2, 3])
def test_noncontiguous_zero_and_coalesced(world):
    run_ranks(_noncontiguous_and_coalesced_body, world)


def _p2p_body(rank, n):
    # ring exchange with tags, both directions; 5 floats through the rings,
    # 1 MiB (more than half a ring) read in place
    right, left = (rank + 1) % n, (rank - 1) % n
    for tag, numel in ((0, 5), (7, 5), (8, 1 << 18)):
        out = torch.full((numel,), float(rank * 100 + tag))
        inb = torch.empty(numel)
        reqs = [dist.isend(out, right, tag=tag), dist.irecv(inb, left, tag=tag)]
        for r in reqs:
            r.wait()
        assert torch.equal(inb, torch.full((numel,), float(left * 100 + tag)))
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), float(rank)), right),
        dist.P2POp(dist.irecv, got := torch.empty(2), left),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got, torch.full((2,), float(left)))


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv(world):
    run_ranks(_p2p_body, world)


def _p2p_paths_body(rank, n, single_copy):
    """Shared-memory rings (up to a ring's worth) and larger messages (read in
    place by the receiver, or over gloo) for the same tags, received out of
    order; any-source; a non-contiguous target; polling; a size mismatch
    named; large messages both ways at once. `single_copy`: "on", "off"
    (DSP_P2P_SINGLE_COPY=0), or "rank0-off" (rank 0 cannot read rank 1, as
    where ptrace rules refuse one direction: 0 -> 1 goes in place, 1 -> 0
    over gloo, and both ends agree)."""
    import os

    os.environ["DSP_P2P_RING_BYTES"] = "4096"
    if single_copy == "off" or (single_copy == "rank0-off" and rank == 0):
        os.environ["DSP_P2P_SINGLE_COPY"] = "0"
    dist.init_process_group("dsp")
    big = 4096 // 4  # floats: more than a ring takes
    if rank == 0:
        for tag, numel in ((1, 5), (2, big), (3, 7), (1, big + 3)):
            dist.send(torch.arange(numel, dtype=torch.float32) + tag, 1, tag=tag)
        dist.send(torch.tensor([10.0, 20.0]), 1, tag=4)  # into a column
        dist.send(torch.ones(3), 1, tag=5)  # the receiver expects 4
        got = torch.empty(1)
        src = dist.recv(got, tag=6)  # any source
        assert (src, got.item()) == (1, 66.0)
    else:
        want = {3: 7, 2: big, 1: 5}
        bufs = {tag: torch.empty(numel) for tag, numel in want.items()}
        reqs = {tag: dist.irecv(bufs[tag], 0, tag=tag) for tag in want}
        for tag in (3, 1, 2):  # not the order sent
            reqs[tag].wait()
        for tag, numel in want.items():
            assert torch.equal(bufs[tag], torch.arange(numel, dtype=torch.float32) + tag), tag
        second = torch.empty(big + 3)
        dist.recv(second, 0, tag=1)
        assert torch.equal(second, torch.arange(big + 3, dtype=torch.float32) + 1)
        m = torch.zeros(2, 3)
        work = dist.irecv(m[:, 1], 0, tag=4)
        while not work.is_completed():
            pass
        work.wait()
        assert torch.equal(m[:, 1], torch.tensor([10.0, 20.0])) and m.sum() == 30
        with pytest.raises(RuntimeError, match="has 12 bytes, the receive expects 16"):
            dist.recv(torch.empty(4), 0, tag=5)
        dist.send(torch.tensor([66.0]), 0, tag=6)
    # Large messages both ways at once, a non-contiguous bf16 source among
    # them, each side's sends waited for only after its receives.
    peer = 1 - rank
    src = torch.arange(3 * big, dtype=torch.float32).reshape(3, big) + rank
    out = [dist.isend(src, peer, tag=7), dist.isend(src.t().bfloat16(), peer, tag=8)]
    got, got_t = torch.empty(3, big), torch.empty(big, 3, dtype=torch.bfloat16)
    for w in [dist.irecv(got_t, peer, tag=8), dist.irecv(got, peer, tag=7)]:
        w.wait()
    for w in out:
        w.wait()
    want = torch.arange(3 * big, dtype=torch.float32).reshape(3, big) + peer
    assert torch.equal(got, want) and torch.equal(got_t, want.t().bfloat16())
    if single_copy == "on" and rank == 0:
        dist.send(torch.ones(big + 1), 1, tag=9)
    elif single_copy == "on":
        with pytest.raises(RuntimeError, match=f"has {4 * big + 4} bytes, the receive expects"):
            dist.recv(torch.empty(big + 2), 0, tag=9)
    dist.barrier()


@pytest.mark.parametrize("single_copy", ["on", "off", "rank0-off"])
def test_send_recv_through_rings_and_in_place(single_copy):
    run_ranks(_p2p_paths_body, 2, single_copy, init=False)


def _streamed_outputs_body(rank, n):
    """With DSP_STREAM_BYTES tiny, every large output is written with
    non-temporal stores: all_gather (into a tensor, a list, and in place at
    an odd offset) and broadcast still equal the plain computation, and an
    all_reduce (in place: it keeps memcpy) is unaffected."""
    import os

    os.environ["DSP_STREAM_BYTES"] = "4096"
    dist.init_process_group("dsp")
    numel = 300_001  # several 512 KiB chunks per rank, not a multiple of a line
    mine = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    out = torch.empty(n * numel)
    dist.all_gather_into_tensor(out, mine)
    for r in range(n):
        assert torch.equal(out[r * numel : (r + 1) * numel], torch.arange(numel) * (r + 1.0))
    outs = [torch.empty(numel) for _ in range(n)]
    dist.all_gather(outs, mine)
    assert all(torch.equal(o, torch.arange(numel) * (r + 1.0)) for r, o in enumerate(outs))
    flat = torch.zeros(n * numel + 3)
    view = flat[3:]  # an output 12 bytes past its storage's alignment
    view[rank * numel : (rank + 1) * numel].copy_(mine)
    dist.all_gather_into_tensor(view, view[rank * numel : (rank + 1) * numel])
    assert torch.equal(view, out) and torch.equal(flat[:3], torch.zeros(3))
    b = mine.clone() if rank == 1 else torch.zeros(numel)
    dist.broadcast(b, src=1)
    assert torch.equal(b, torch.arange(numel) * 2.0)
    summed = mine.clone()
    dist.all_reduce(summed)
    assert torch.equal(summed, torch.arange(numel) * float(n * (n + 1) // 2))


def test_streamed_outputs_equal_the_plain_copies():
    run_ranks(_streamed_outputs_body, 2, init=False)


def _direct_op_body(rank, n):
    import dsparallel.ops as ops

    ops_by_name = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.AVG,
        "product": dist.ReduceOp.PRODUCT,
        "min": dist.ReduceOp.MIN,
        "max": dist.ReduceOp.MAX,
    }
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for size in (1, 37, 700_001):
            base = (torch.arange(size) % 3).to(torch.float64)
            for name, op in ops_by_name.items():
                if name == "avg" and not dtype.is_floating_point:
                    continue
                t = ((rank + 1) * base).to(dtype)
                out = ops.all_reduce_(t, op=name)
                assert out is t
                assert torch.equal(t, _reduce_expect(op, n, base).to(dtype)), (dtype, size, name)
    # A strided view, reduced in place; a sub-group; the gloo backend behind a name.
    t = torch.full((4, 6), float(rank + 1))[:, ::2]
    torch.ops.dsparallel.all_reduce_(t, dist.group.WORLD.group_name, "sum")
    assert torch.equal(t, torch.full((4, 3), n * (n + 1) / 2))
    members = sorted({0, n - 1})
    for backend in ("dsp", "gloo"):
        group = dist.new_group(members, backend=backend)
        t = torch.tensor([float(rank)])
        if rank in members:
            ops.all_reduce_(t, op="max", group=group)
            assert t.item() == n - 1
    with pytest.raises(RuntimeError, match='op must be "sum"'):
        ops.all_reduce_(torch.ones(1), op="mean")
    # The direct path (a tensor outside autograd) bumps the version counter as
    # an in-place op does: autograd sees that a tensor it saved was changed.
    w, x = torch.ones(3, requires_grad=True), torch.ones(3)
    y = (w * x).sum()  # saves x for w's gradient
    ops.all_reduce_(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_direct_all_reduce_op(world):
    """torch.ops.dsparallel.all_reduce_ (and dsparallel.ops.all_reduce_): the
    same results as dist.all_reduce for every op, in place, on any backend."""
    run_ranks(_direct_op_body, world)
