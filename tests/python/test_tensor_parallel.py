"""Tensor-parallel maps and layers held against their plain counterparts in
real processes (tensor-parallel sizes 1, 2 and 4).

Every rank computes the plain module on the same (seeded) input too, and
checks its output, input gradient and each weight gradient against the
matching slice. Tolerance: float32, rtol = atol = 1e-5 (the parallel sums run
in a different order).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

import dsparallel
from dsparallel import tensor_parallel as tp

TOL = dict(rtol=1e-5, atol=1e-5)


def close(got, want, what):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def chunk(t, dim, rank, world):
    return t.chunk(world, dim)[rank]


def leaf(t):
    return t.detach().clone().requires_grad_()


# --------------------------------------------------------------------- maps


def _maps_body(rank, world):
    g = dist.group.WORLD
    torch.manual_seed(0)
    full = torch.randn(2 * world, 3, 4 * world)
    # Each rank's own tensor and own output gradient, so sums are visible.
    mine = full * (rank + 1)
    grad_of = [torch.randn(2 * world, 3, 4 * world) for _ in range(world)]
    total = sum(full * (r + 1) for r in range(world))

    def run(fn, x, g_out):
        x = leaf(x)
        y = fn(x, g)
        (gx,) = torch.autograd.grad(y, x, g_out)
        return y, gx

    # copy: identity; backward sums the ranks' gradients.
    y, gx = run(tp.copy_to_tensor_parallel_region, mine, grad_of[rank])
    close(y, mine, "copy forward")
    close(gx, sum(grad_of), "copy backward")
    # reduce: sum; backward identity.
    y, gx = run(tp.reduce_from_tensor_parallel_region, mine, grad_of[rank])
    close(y, total, "reduce forward")
    close(gx, grad_of[rank], "reduce backward")
    # scatter along the last dim; backward gathers the slices' gradients.
    y, gx = run(tp.scatter_to_tensor_parallel_region, full, chunk(grad_of[rank], -1, rank, world))
    close(y, chunk(full, -1, rank, world), "scatter forward")
    want = torch.cat([chunk(grad_of[r], -1, r, world) for r in range(world)], -1)
    close(gx, want, "scatter backward")
    # gather along the last dim; backward takes this rank's slice.
    y, gx = run(tp.gather_from_tensor_parallel_region, chunk(mine, -1, rank, world), full)
    close(
        y, torch.cat([chunk(full * (r + 1), -1, r, world) for r in range(world)], -1), "gather fwd"
    )
    close(gx, chunk(full, -1, rank, world), "gather backward")
    # sequence parallel: split dim 0; backward all-gathers dim 0.
    y, gx = run(tp.scatter_to_sequence_parallel_region, full, chunk(grad_of[rank], 0, rank, world))
    close(y, chunk(full, 0, rank, world), "sp scatter forward")
    want = torch.cat([chunk(grad_of[r], 0, r, world) for r in range(world)], 0)
    close(gx, want, "sp scatter backward")
    # all-gather dim 0; backward reduce-scatters.
    y, gx = run(tp.gather_from_sequence_parallel_region, chunk(mine, 0, rank, world), grad_of[rank])
    close(
        y, torch.cat([chunk(full * (r + 1), 0, r, world) for r in range(world)], 0), "sp gather fwd"
    )
    close(gx, chunk(sum(grad_of), 0, rank, world), "sp gather backward")
    # reduce-scatter dim 0; backward all-gathers.
    y, gx = run(
        tp.reduce_scatter_to_sequence_parallel_region, mine, chunk(grad_of[rank], 0, rank, world)
    )
    close(y, chunk(total, 0, rank, world), "sp reduce-scatter forward")
    close(gx, torch.cat([chunk(grad_of[r], 0, r, world) for r in range(world)], 0), "sp rs bwd")

    # The ops themselves, called directly (not through the wrappers), with
    # their backward nodes called directly: the same gradients as above.
    ops = torch.ops.dsparallel
    for op, x, g_out in [
        (ops.copy_to_tensor_parallel_region, mine, grad_of[rank]),
        (ops.reduce_from_tensor_parallel_region, mine, grad_of[rank]),
        (ops.scatter_to_tensor_parallel_region, full, chunk(grad_of[rank], -1, rank, world)),
        (ops.gather_from_tensor_parallel_region, chunk(mine, -1, rank, world), full),
        (ops.scatter_to_sequence_parallel_region, full, chunk(grad_of[rank], 0, rank, world)),
        (ops.gather_from_sequence_parallel_region, chunk(mine, 0, rank, world), grad_of[rank]),
        (
            ops.reduce_scatter_to_sequence_parallel_region,
            mine,
            chunk(grad_of[rank], 0, rank, world),
        ),
    ]:
        y = op(leaf(x), g.group_name)
        direct = y.grad_fn(g_out)
        _, want = run(lambda t, grp, op=op: op(t, grp.group_name), x, g_out)
        close(direct, want, f"{op} backward node")

    # A size that does not split names the numbers.
    with pytest.raises(RuntimeError, match="not divisible by the group size"):
        tp.scatter_to_tensor_parallel_region(torch.zeros(3, 4 * world + 1), g)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_maps_forward_and_backward(world):
    run_ranks(_maps_body, world)


def _opcheck_body(rank, world):
    name = dist.group.WORLD.group_name
    torch.manual_seed(0)
    ops = torch.ops.dsparallel
    x = torch.randn(2 * world, 4 * world, requires_grad=True)
    for op in [
        ops.copy_to_tensor_parallel_region,
        ops.reduce_from_tensor_parallel_region,
        ops.scatter_to_tensor_parallel_region,
        ops.gather_from_tensor_parallel_region,
        ops.scatter_to_sequence_parallel_region,
        ops.gather_from_sequence_parallel_region,
        ops.reduce_scatter_to_sequence_parallel_region,
    ]:
        torch.library.opcheck(op, (x, name))
    logits = torch.randn(6, 5, requires_grad=True)
    target = torch.randint(0, 5 * world, (6,))
    torch.library.opcheck(ops.vocab_parallel_cross_entropy, (logits, target, -100, name))
    return True


def test_opcheck_every_op():
    run_ranks(_opcheck_body, 2, timeout=300)


# ------------------------------------------------------------------- layers


def _column(rank, world):
    torch.manual_seed(1)
    out = 3 * world
    x = torch.randn(world, 5, 7)
    for gather_output, sp in [(False, False), (True, False), (False, True)]:
        torch.manual_seed(2)
        ours = tp.ColumnParallelLinear(7, out, gather_output=gather_output, sequence_parallel=sp)
        torch.manual_seed(2)
        plain = nn.Linear(7, out)
        what = f"column gather_output={gather_output} sp={sp}"
        close(ours.weight, chunk(plain.weight, 0, rank, world), f"{what} init")
        xr, xo = leaf(x), leaf(chunk(x, 0, rank, world) if sp else x)
        ref = plain(xr)
        w = torch.randn_like(ref)
        (ref * w).sum().backward()
        y = ours(xo)
        want, wy = (
            (ref, w) if gather_output else (chunk(ref, -1, rank, world), chunk(w, -1, rank, world))
        )
        close(y, want, f"{what} output")
        (y * wy).sum().backward()
        close(xo.grad, chunk(xr.grad, 0, rank, world) if sp else xr.grad, f"{what} input grad")
        close(ours.weight.grad, chunk(plain.weight.grad, 0, rank, world), f"{what} weight grad")
        close(ours.bias.grad, chunk(plain.bias.grad, 0, rank, world), f"{what} bias grad")


def _row(rank, world):
    torch.manual_seed(3)
    x = torch.randn(world, 3, 3 * world)
    for parallel_in, sp in [(True, False), (False, False), (True, True)]:
        torch.manual_seed(4)
        ours = tp.RowParallelLinear(
            3 * world, 5, input_is_parallel=parallel_in, sequence_parallel=sp
        )
        torch.manual_seed(4)
        plain = nn.Linear(3 * world, 5)
        what = f"row input_is_parallel={parallel_in} sp={sp}"
        close(ours.weight, chunk(plain.weight, 1, rank, world), f"{what} init")
        xr, xo = leaf(x), leaf(chunk(x, -1, rank, world) if parallel_in else x)
        ref = plain(xr)
        w = torch.randn_like(ref)
        (ref * w).sum().backward()
        y = ours(xo)
        want, wy = (chunk(ref, 0, rank, world), chunk(w, 0, rank, world)) if sp else (ref, w)
        close(y, want, f"{what} output")
        (y * wy).sum().backward()
        close(
            xo.grad, chunk(xr.grad, -1, rank, world) if parallel_in else xr.grad, f"{what} in grad"
        )
        close(ours.weight.grad, chunk(plain.weight.grad, 1, rank, world), f"{what} weight grad")
        close(ours.bias.grad, plain.bias.grad, f"{what} bias grad")


def _embedding(rank, world):
    for vocab in (11, 4 * world):
        torch.manual_seed(5)
        ours = tp.VocabParallelEmbedding(vocab, 6)
        torch.manual_seed(5)
        plain = nn.Embedding(vocab, 6)
        start, end = tp.vocab_range(vocab, rank, world)
        close(ours.weight, plain.weight[start:end], f"embedding {vocab} init")
        ids = torch.randint(0, vocab, (3, 7))
        ref = plain(ids)
        w = torch.randn_like(ref)
        (ref * w).sum().backward()
        y = ours(ids)
        close(y, ref, f"embedding {vocab} output")
        (y * w).sum().backward()
        close(ours.weight.grad, plain.weight.grad[start:end], f"embedding {vocab} grad")
    with pytest.raises(IndexError, match="token id 11 is outside the vocabulary"):
        tp.VocabParallelEmbedding(11, 6)(torch.tensor([[1, 11]]))


def _qkv_rows(h, rank, world):
    local = h // world
    return torch.cat(
        [torch.arange(p * h + rank * local, p * h + (rank + 1) * local) for p in range(3)]
    )


def _attention(rank, world):
    h, heads = 16, 4
    for causal in (False, True):
        torch.manual_seed(6)
        mha = nn.MultiheadAttention(h, heads, batch_first=True)
        with torch.no_grad():  # non-zero biases, so their slicing is checked
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
        ours = tp.ParallelAttention.from_multihead_attention(mha, causal=causal)
        x = torch.randn(2, 5, h)
        xr, xo = leaf(x), leaf(x)
        mask = nn.Transformer.generate_square_subsequent_mask(5) if causal else None
        ref = mha(xr, xr, xr, need_weights=False, attn_mask=mask, is_causal=causal)[0]
        w = torch.randn_like(ref)
        (ref * w).sum().backward()
        y = ours(xo)
        what = f"attention causal={causal}"
        close(y, ref, f"{what} output")
        (y * w).sum().backward()
        close(xo.grad, xr.grad, f"{what} input grad")
        rows = _qkv_rows(h, rank, world)
        close(ours.qkv.weight.grad, mha.in_proj_weight.grad[rows], f"{what} qkv weight grad")
        close(ours.qkv.bias.grad, mha.in_proj_bias.grad[rows], f"{what} qkv bias grad")
        close(
            ours.proj.weight.grad, chunk(mha.out_proj.weight.grad, 1, rank, world), f"{what} out w"
        )
        close(ours.proj.bias.grad, mha.out_proj.bias.grad, f"{what} out bias grad")
    # Seeded construction equals the slice of the seeded plain module.
    torch.manual_seed(7)
    ours = tp.ParallelAttention(h, heads)
    torch.manual_seed(7)
    mha = nn.MultiheadAttention(h, heads, batch_first=True)
    close(ours.qkv.weight, mha.in_proj_weight[_qkv_rows(h, rank, world)], "attention init")
    close(ours.proj.weight, chunk(mha.out_proj.weight, 1, rank, world), "attention init out")


def _mlp(rank, world):
    torch.manual_seed(8)
    ours = tp.ParallelMLP(6, 4 * world)
    torch.manual_seed(8)
    fc1, fc2 = nn.Linear(6, 4 * world), nn.Linear(4 * world, 6)
    x = torch.randn(3, 2, 6)
    xr, xo = leaf(x), leaf(x)
    ref = fc2(F.gelu(fc1(xr)))
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    y = ours(xo)
    close(y, ref, "mlp output")
    (y * w).sum().backward()
    close(xo.grad, xr.grad, "mlp input grad")
    close(ours.fc1.weight.grad, chunk(fc1.weight.grad, 0, rank, world), "mlp fc1 grad")
    close(ours.fc1.bias.grad, chunk(fc1.bias.grad, 0, rank, world), "mlp fc1 bias grad")
    close(ours.fc2.weight.grad, chunk(fc2.weight.grad, 1, rank, world), "mlp fc2 grad")
    close(ours.fc2.bias.grad, fc2.bias.grad, "mlp fc2 bias grad")


def _cross_entropy(rank, world):
    vocab = 11
    start, end = tp.vocab_range(vocab, rank, world)
    for scale in (1.0, 100.0):
        torch.manual_seed(9)
        logits = torch.randn(3, 4, vocab) * scale
        target = torch.randint(0, vocab, (3, 4))
        target[0, 1] = -100
        for reduction in ("mean", "sum", "none"):
            lr, lo = leaf(logits), leaf(logits[..., start:end])
            ref = F.cross_entropy(lr.view(-1, vocab), target.view(-1), reduction=reduction)
            ref = ref.view(3, 4) if reduction == "none" else ref
            got = tp.vocab_parallel_cross_entropy(lo, target, reduction=reduction)
            what = f"cross entropy scale={scale} {reduction}"
            close(got, ref, f"{what} loss")
            w = torch.randn_like(ref)
            (ref * w).sum().backward()
            (got * w).sum().backward()
            close(lo.grad, lr.grad[..., start:end], f"{what} grad")
    if world > 1:
        with pytest.raises(RuntimeError, match=r"outside the vocabulary \[0, 11\)"):
            tp.vocab_parallel_cross_entropy(
                torch.zeros(2, end - start), torch.tensor([1, 11]), reduction="sum"
            )


def _layers_body(rank, world):
    if world == 1:
        # A group of one is the plain module: no dsparallel op runs at all.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _layer_checks(rank, world)
        ran = {e.name for e in prof.events() if e.name.startswith("dsparallel::")}
        assert not ran, f"ops launched with a group of one: {ran}"
    else:
        _layer_checks(rank, world)
    return True


def _layer_checks(rank, world):
    _column(rank, world)
    _row(rank, world)
    _embedding(rank, world)
    _attention(rank, world)
    _mlp(rank, world)
    _cross_entropy(rank, world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layers_match_plain_modules(world):
    run_ranks(_layers_body, world, timeout=180)


# ------------------------------------------------------- a small transformer


class PlainBlock(nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        s = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(s)
        a = self.ln1(x)
        x = x + self.attn(a, a, a, need_weights=False, attn_mask=mask, is_causal=True)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ParallelBlock(nn.Module):
    def __init__(self, plain: PlainBlock):
        super().__init__()
        self.ln1, self.ln2 = plain.ln1, plain.ln2
        self.attn = tp.ParallelAttention.from_multihead_attention(plain.attn, causal=True)
        self.mlp = tp.ParallelMLP.from_linears(plain.fc1, plain.fc2)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=16, h=16, heads=4, ffn=32, seq=8, blocks=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.pos = nn.Parameter(torch.randn(seq, h) * 0.02)
        self.blocks = nn.ModuleList(PlainBlock(h, heads, ffn) for _ in range(blocks))
        self.ln = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def loss(self, ids, target):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class TinyLMParallel(nn.Module):
    def __init__(self, plain: TinyLM):
        super().__init__()
        self.emb = tp.VocabParallelEmbedding.from_embedding(plain.emb)
        self.pos = plain.pos
        self.blocks = nn.ModuleList(ParallelBlock(b) for b in plain.blocks)
        self.ln = plain.ln
        self.head = tp.ColumnParallelLinear.from_linear(plain.head)

    def loss(self, ids, target):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return tp.vocab_parallel_cross_entropy(self.head(self.ln(x)), target)


def _train_body(rank, world):
    import copy

    torch.manual_seed(10)
    plain = TinyLM()
    parallel = TinyLMParallel(copy.deepcopy(plain))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, parallel)]
    losses = {"plain": [], "parallel": []}
    for step in range(5):
        ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(step))
        target = ids.roll(-1, 1)
        for key, model, opt in [("plain", plain, opts[0]), ("parallel", parallel, opts[1])]:
            opt.zero_grad()
            loss = model.loss(ids, target)
            loss.backward()
            opt.step()
            losses[key].append(loss.item())
    torch.testing.assert_close(
        torch.tensor(losses["parallel"]), torch.tensor(losses["plain"]), rtol=1e-5, atol=0
    )
    assert losses["plain"][-1] < losses["plain"][0]
    return losses


@pytest.mark.parametrize("world", [2])
def test_transformer_trains_like_one_process(world):
    run_ranks(_train_body, world, timeout=180)


# ---------------------------------------------------------------- bad input


def _bad_input_body(rank, world):
    with pytest.raises(ValueError, match="out_features=5 is not divisible by .* size 2"):
        tp.ColumnParallelLinear(4, 5)
    with pytest.raises(ValueError, match="in_features=7 is not divisible by .* size 2"):
        tp.RowParallelLinear(7, 4)
    with pytest.raises(ValueError, match="num_heads=3 is not divisible by .* size 2"):
        tp.ParallelAttention(12, 3)
    with pytest.raises(ValueError, match="hidden_size=10 is not divisible by num_heads=4"):
        tp.ParallelAttention(10, 4)
    with pytest.raises(ValueError, match="ffn_hidden_size=9 is not divisible"):
        tp.ParallelMLP(4, 9)
    with pytest.raises(ValueError, match="input has last dimension 3, expected 4"):
        tp.ColumnParallelLinear(4, 6)(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="input has last dimension 4, expected 2"):
        tp.RowParallelLinear(4, 6)(torch.zeros(2, 4))
    only_zero = dist.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match="not a member of the given tensor-parallel group"):
            tp.ColumnParallelLinear(4, 4, group=only_zero)
    else:
        assert tp.ColumnParallelLinear(4, 4, group=only_zero).tp_size == 1
    return True


def test_bad_input_is_refused_clearly():
    run_ranks(_bad_input_body, 2)


# ---------------------------------------------------------------------- RNG


def _rng_body(rank, world):
    tp.manual_seed(123)
    tracker = tp.get_rng_tracker()
    with tracker.fork():
        inside = torch.rand(4)
    outside = torch.rand(4)
    gathered_in = [torch.empty(4) for _ in range(world)]
    gathered_out = [torch.empty(4) for _ in range(world)]
    dist.all_gather(gathered_in, inside)
    dist.all_gather(gathered_out, outside)
    assert not torch.equal(gathered_in[0], gathered_in[1]), "per-rank stream agrees across ranks"
    assert torch.equal(gathered_out[0], gathered_out[1]), "shared stream differs across ranks"

    # Dropout inside attention survives recomputation under dsparallel.checkpoint.
    torch.manual_seed(11)
    attn = tp.ParallelAttention(16, 4, dropout=0.5, causal=True)
    x = torch.randn(2, 6, 16)
    tp.manual_seed(5)
    x1 = leaf(x)
    y1 = attn(x1)
    y1.sum().backward()
    g1 = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()
    tp.manual_seed(5)
    x2 = leaf(x)
    y2 = dsparallel.checkpoint(attn, x2)
    y2.sum().backward()
    close(y2, y1, "checkpointed dropout output")
    close(x2.grad, x1.grad, "checkpointed dropout input grad")
    for a, b in zip(attn.parameters(), g1):
        close(a.grad, b, "checkpointed dropout weight grad")
    attn.eval()
    assert torch.equal(attn(x), attn(x)), "dropout active in eval mode"
    return True


def test_rng_streams_and_recompute():
    run_ranks(_rng_body, 2)
