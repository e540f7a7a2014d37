"""Mixture-of-experts with expert parallelism, held against one process.

The reference is written out naively here (a loop over experts with token
masks, no sorting, no all-to-all): every expert parallel rank's tokens are run
through a single-process copy holding every expert, and the gradients compared
are those of that rank's loss (router, shared experts: local to the rank) and
of the sum of all ranks' losses (routed experts: each serves every rank's
tokens).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import expect_raises, run_ranks

import dsparallel
from dsparallel.moe import MoE, update_expert_bias

H, FFN, TOKENS = 8, 12, 10


def _tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    # Positive inputs and a router that favours the low experts (below):
    # the routing is uneven, and the high experts get no token at all.
    return torch.rand(TOKENS, H, generator=g) + 0.1


def _build(group, top_k, num_experts, **kw) -> MoE:
    torch.manual_seed(0)
    moe = MoE(H, FFN, num_experts, top_k, group=group, **kw)
    with torch.no_grad():
        skew = torch.linspace(2.0, -2.0, num_experts).unsqueeze(1)
        moe.router.weight.add_(skew)
        moe.router.weight[: num_experts // 2].add_(torch.randn(num_experts // 2, H))
    return moe


def _capacity_keep(idx: torch.Tensor, num_experts: int, top_k: int, factor) -> torch.Tensor:
    """Which (token, slot) assignments survive the capacity, by a plain loop."""
    keep = torch.ones_like(idx, dtype=torch.bool)
    if factor is None:
        return keep
    capacity = math.ceil(idx.shape[0] * top_k / num_experts * factor)
    seen = [0] * num_experts
    for t in range(idx.shape[0]):
        for j in range(top_k):
            e = int(idx[t, j])
            keep[t, j] = seen[e] < capacity
            seen[e] += 1
    return keep


def _naive(ref: MoE, x: torch.Tensor):
    """out = shared(x) + sum_j gate_j * expert_{idx_j}(x), one expert at a time."""
    idx, gates, aux = ref.router(x)
    keep = _capacity_keep(idx, ref.num_experts, ref.top_k, ref.capacity_factor)
    out = torch.zeros_like(x)
    for e in range(ref.num_experts):
        w1, w2 = ref.experts.w1[e], ref.experts.w2[e]
        for j in range(ref.top_k):
            m = (idx[:, j] == e) & keep[:, j]
            out = out.index_add(
                0, m.nonzero().squeeze(1), gates[m, j, None] * (F.gelu(x[m] @ w1) @ w2)
            )
    if ref.shared is not None:
        out = out + ref.shared(x)
    return out, aux


def _loss(out: torch.Tensor, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return (out * torch.randn(out.shape, generator=g)).sum()


def _layer_body(rank, world, top_k, num_experts, kw, steps):
    group = dist.group.WORLD
    moe = _build(group, top_k, num_experts, **kw)
    ref = _build(None, top_k, num_experts, **kw)
    local = slice(rank * moe.num_local_experts, (rank + 1) * moe.num_local_experts)
    empty_experts = 0
    for step in range(steps):
        x = _tokens(rank, step)
        out = moe(x)
        loss = _loss(out, rank)
        if moe.aux_loss is not None:
            loss_with_aux = loss + moe.aux_loss
        moe.zero_grad()
        loss.backward()

        # The reference: this rank's output and loss, and every rank's loss
        # for the expert gradients.
        ref.zero_grad()
        total = 0.0
        for r in range(world):
            want, aux = _naive(ref, _tokens(r, step))
            ref_loss = _loss(want, r) + (aux if aux is not None else 0.0)
            if r == rank:
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
                if aux is not None:
                    torch.testing.assert_close(loss_with_aux, ref_loss, rtol=1e-5, atol=1e-6)
                mine = torch.autograd.grad(
                    ref_loss,
                    [p for n, p in ref.named_parameters() if not n.startswith("experts.")],
                    retain_graph=True,
                )
            total = total + ref_loss
        total.backward()
        dense = [p for n, p in moe.named_parameters() if not n.startswith("experts.")]
        for got, want in zip(dense, mine):
            torch.testing.assert_close(got.grad, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(moe.experts.parameters(), ref.experts.parameters()):
            torch.testing.assert_close(got.grad, want.grad[local], rtol=1e-5, atol=1e-6)
        empty_experts += int((moe.router.pending_load == 0).sum())

        # The balancing bias, from every rank's counts; the reference saw
        # them all (it routed every rank's tokens above).
        update_expert_bias(moe, group)
        ref.router.apply_load(ref.router.pending_load.clone())
        torch.testing.assert_close(moe.router.expert_bias, ref.router.expert_bias)
    assert moe.router.expert_bias.abs().sum() > 0
    return empty_experts, moe.last_dropped


@pytest.mark.parametrize(
    "world,top_k,kw",
    [
        (2, 1, {}),
        (2, 2, {"num_shared_experts": 1, "score_function": "sigmoid"}),
        (4, 2, {"num_shared_experts": 2}),
        (4, 1, {"score_function": "sigmoid", "aux_loss_coeff": 0.01}),
        (2, 2, {"capacity_factor": 1.0}),
    ],
)
def test_moe_layer_equals_one_process(world, top_k, kw):
    results = run_ranks(_layer_body, world, top_k, 8, kw, 3, timeout=240)
    assert results[0][0] > 0, "the routing was meant to leave some experts without tokens"
    if "capacity_factor" in kw:
        assert any(dropped for _, dropped in results), "the capacity was meant to drop tokens"


def test_local_moe_equals_naive():
    """Without a group every expert is local: the same sort, no all-to-all."""
    for kw in ({}, {"capacity_factor": 0.5, "num_shared_experts": 1}):
        moe = _build(None, 2, 4, **kw)
        x = _tokens(0, 0).requires_grad_()
        out = moe(x)
        want, _ = _naive(moe, x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        g1 = torch.autograd.grad(_loss(out, 0), [x, *moe.parameters()])
        g2 = torch.autograd.grad(_loss(want, 0), [x, *moe.parameters()])
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _opcheck_body(rank, world):
    from dsparallel.moe.ops import Plan

    name = dist.group.WORLD.group_name
    ops = torch.ops.dsparallel
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, 4, (6, 2), generator=g)
    idx[0, 1] = -1  # a dropped assignment
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes each
    for group_name in (name, singles[rank].group_name):
        torch.library.opcheck(ops.moe_plan, (idx, 4, group_name))
    plan = Plan(idx, 4, dist.group.WORLD)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    args = (plan.order, plan.send_counts, plan.recv_counts)
    torch.library.opcheck(ops.moe_dispatch, (x, *args, 2, name))
    rows = int(plan.recv_counts.sum())
    y = torch.randn(rows, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(ops.moe_combine, (y, w, *args, name))

    # The backwards are the adjoints of the forwards across ranks, in double:
    # both ops are linear (combine in y and in w separately), so
    # sum over ranks <op(x), g> equals sum over ranks <x, op^T(g)>. (A per-rank
    # gradcheck cannot do this: each rank's output also moves when the peer
    # perturbs its own input in the same step.)
    def adjoint(out, inputs):
        g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(rank))
        grads = torch.autograd.grad(out, inputs, g)
        for inp, grad in zip(inputs, grads):
            pair = torch.stack([(out * g).sum(), (inp * grad).sum()]).detach()
            dist.all_reduce(pair)
            torch.testing.assert_close(pair[0], pair[1], rtol=1e-12, atol=1e-12)

    adjoint(ops.moe_dispatch(x, *args, 2, name), [x])
    w.requires_grad_(False)
    adjoint(ops.moe_combine(y, w, *args, name), [y])
    y.requires_grad_(False)
    w.requires_grad_(True)
    adjoint(ops.moe_combine(y, w, *args, name), [w])
    return True


def test_dispatch_and_combine_pass_opcheck_and_are_adjoint():
    run_ranks(_opcheck_body, 2, timeout=300)


def _bad_input_body(rank, world):
    expect = expect_raises
    group = dist.group.WORLD
    expect(ValueError, lambda: MoE(H, FFN, 6, 1, group=group), "num_experts (6)", "size (4)")
    expect(ValueError, lambda: MoE(H, FFN, 4, 5, group=group), "top_k (5)", "num_experts (4)")
    expect(
        ValueError,
        lambda: MoE(H, FFN, 8 if rank == 2 else 4, 1, group=group),
        "num_experts is 8 on group rank 2",
    )
    # An index outside the experts on one rank: every rank raises.
    idx = torch.zeros(3, 1, dtype=torch.long)
    if rank == 1:
        idx[2, 0] = 9
    expect(
        RuntimeError,
        lambda: torch.ops.dsparallel.moe_plan(idx, 4, group.group_name),
        "rank 1 of the expert-parallel group passed an expert index",
    )
    expect(
        ValueError,
        lambda: dsparallel.init_parallel(expert_parallel_size=3),
        "expert_parallel_size (3) must divide the data-parallel size (4",
    )
    expect(
        ValueError,
        lambda: dsparallel.init_parallel(2, expert_parallel_size=4),
        "must divide the data-parallel size (2",
        "pass experts_over_tp=True",
    )
    expect(
        ValueError,
        lambda: dsparallel.init_parallel(2, expert_parallel_size=3, experts_over_tp=True),
        "with experts_over_tp, expert_parallel_size (3) must be the tensor-parallel size (2)",
    )
    # Our MoE layer routes the tokens it is given (alike on every tp rank).
    dsparallel.init_parallel(2, expert_parallel_size=4, experts_over_tp=True)
    expect(NotImplementedError, lambda: MoE(H, FFN, 4, 1), "experts_over_tp=True")
    dsparallel.destroy_parallel()
    return True


def test_bad_input_raises_on_every_rank():
    run_ranks(_bad_input_body, 4, timeout=120)


# ---------------------------------------------------------------- the MoE GPT


@pytest.fixture(scope="module")
def moe_reference():
    from test_hybrid import STEPS, _one_process_losses

    return run_ranks(_one_process_losses, 1, STEPS, MOE_CFG)[0]


MOE_CFG = {"moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1}
MOE_FLAGS = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1"]


@pytest.mark.parametrize(
    "layout",
    [
        ("--tensor-parallel", "1", "--pipeline-parallel", "1"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "1", "--zero-stage", "2"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "2", "--zero-stage", "1"),
    ],
    ids=["ep2-dp4", "ep2-dp4-zero2", "pp2-ep2-dp2-zero1"],
)
def test_moe_gpt_expert_parallel_matches_one_process(tmp_path, moe_reference, layout):
    """examples/train_gpt.py with 4 experts (top 2, one shared) and expert
    parallel 2 inside the data-parallel ranks (our DDP reduces the experts over
    the ranks holding the same ones; ZeRO shards them there) equals one
    process holding every expert, over 10 steps of AdamW and balancing-bias
    updates; also under a pipeline."""
    from test_hybrid import STEPS, _run_job

    layout = [*layout, "--expert-parallel", "2", "--micro-batches", "2"]
    history = _run_job(tmp_path, "moe", "--steps", str(STEPS), *layout, *MOE_FLAGS)
    got = [loss for _, loss in history]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(moe_reference), rtol=1e-4, atol=0)
    assert got[-1] < got[0]


def _ddp_body(rank, world, ep, zero_stage):
    """Our DDP over init_parallel's groups: dense gradients averaged over the
    data-parallel ranks, expert gradients over the ranks holding the same
    experts (scaled by 1/ep): every gradient equals one process's on the
    global batch. With ZeRO (stage 1: sharded optimizer state, stage 2:
    sharded gradients too) the expert parameters are sharded over the ranks
    holding them; AdamW with global-norm clipping then equals one process."""
    ref = _build(None, 2, 4, num_shared_experts=1)  # before init_parallel: every expert
    state = dsparallel.init_parallel(expert_parallel_size=ep)
    model = _build(state.ep_group, 2, 4, num_shared_experts=1)
    ddp = dsparallel.DistributedDataParallel(
        model, process_group=state.dp_group, zero_stage=zero_stage
    )
    per_rank = model.num_local_experts
    local = slice(state.ep_rank * per_rank, (state.ep_rank + 1) * per_rank)

    def mine(name, t):
        return t[local] if name.startswith("experts.") else t

    if zero_stage:
        opt = dsparallel.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, process_group=state.dp_group, lr=1e-2
        )
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        ddp(_tokens(rank, step)).pow(2).mean().backward()
        everyone = torch.cat([_tokens(r, step) for r in range(world)])
        ref(everyone).pow(2).mean().backward()
        if not zero_stage:
            for (n, got), want in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(got.grad, mine(n, want.grad), rtol=1e-5, atol=1e-7)
            model.zero_grad()
        else:
            norm = opt.clip_grad_norm_(1e-3)
            want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
            torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=0)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
        ref.zero_grad()
        update_expert_bias(model)
        ref.router.apply_load(ref.router.pending_load.clone())
    for (n, got), want in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got, mine(n, want), rtol=1e-5, atol=1e-6, msg=n)
    torch.testing.assert_close(model.router.expert_bias, ref.router.expert_bias)
    dsparallel.destroy_parallel()
    return True


@pytest.mark.parametrize("ep,zero_stage", [(2, 0), (4, 0), (2, 1), (2, 2), (4, 2)])
def test_ddp_and_zero_reduce_expert_parameters_over_their_holders(ep, zero_stage):
    run_ranks(_ddp_body, 4, ep, zero_stage, timeout=120)
