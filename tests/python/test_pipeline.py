"""Pipeline parallelism: the C++ plans from Python, and real multi-process
runs held against the unsplit model in one process.

Tolerance: losses and every parameter gradient within rtol 1e-5, atol 1e-6
(float32; micro-batching only reorders the sums)."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

import dsparallel.pipeline as pp
from dsparallel import _C

TOL = dict(rtol=1e-5, atol=1e-6)
BATCH = 8


def test_get_schedule_from_python():
    s = pp.get_schedule("1f1b", 4, 8)
    assert s.num_ranks == 4 and s.num_microbatches == 8
    assert [str(a) for a in s.ranks[3][:4]] == ["3RECV_F0", "3F0", "3B0", "3SEND_B0"]
    stats = s.validate()
    assert stats.peak_in_flight == [4, 3, 2, 1]
    assert stats.bubble == pytest.approx(3 / 11)
    assert pp.get_schedule("gpipe", 4, 8).validate().peak_in_flight == [8] * 4
    # Per-stage costs (F, B, I, W): the last of two stages twice as slow.
    gpipe = pp.get_schedule("gpipe", 2, 2)
    assert gpipe.validate(costs=[(1, 1, 1, 1), (2, 2, 1, 1)]).makespan == 10
    with pytest.raises(ValueError, match="1 stages, the schedule has 2"):
        gpipe.validate(costs=[(1, 1, 1, 1)])
    inter = pp.get_schedule("interleaved_1f1b", 4, 4, stages_per_rank=2)
    assert {a.stage for a in inter.ranks[0]} == {0, 2}
    assert pp.Action.parse("2SEND_B5").kind == "SEND_B"
    with pytest.raises(ValueError, match=r"\(3\).*\(2\)"):
        pp.get_schedule("interleaved_1f1b", 4, 3, stages_per_rank=2)
    with pytest.raises(ValueError, match="unknown"):
        pp.get_schedule("zero_bubble", 2, 2)
    with pytest.raises(ValueError, match=r"zb1p with 2 stages per rank .*\(3\).*\(2\)"):
        pp.get_schedule("zb1p", 4, 3, stages_per_rank=2)
    broken = pp.Schedule(2, 1, [["0F0", "0B0", "0SEND_F0"], ["1RECV_F0", "1F0", "1B0"]])
    with pytest.raises(ValueError, match="not matched"):
        broken.validate()


def _blocks(n_blocks):
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.0)) for _ in range(n_blocks)
    )


def _data():
    g = torch.Generator().manual_seed(42)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 6, generator=g)


def _reference(n_stages):
    blocks = _blocks(n_stages)
    x, y = _data()
    h = x
    for b in blocks:
        h = b(h)
    loss = nn.functional.mse_loss(h, y)
    loss.backward()
    return loss.detach(), [[p.grad.clone() for p in b.parameters()] for b in blocks]


def _schedule(rank, world, name, n_stages, m, checkpoint, modules):
    """This rank's stages of `modules` and the schedule `name` over them."""
    per_rank = n_stages // world
    my_stages = [s for s in range(n_stages) if s % world == rank]
    if name in ("zbv", "dualpipev"):
        my_stages = [rank, 2 * world - 1 - rank]
    stages = [pp.PipelineStage(modules[s], s, n_stages, checkpoint=checkpoint) for s in my_stages]
    loss_fn = nn.functional.mse_loss
    if name == "gpipe":
        sched = pp.ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    elif name == "1f1b":
        sched = pp.Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    elif name == "zb1p":
        sched = pp.ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
    elif name == "zbv":
        sched = pp.ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn)
    elif name == "dualpipev":
        sched = pp.ScheduleDualPipeV(stages, m, loss_fn=loss_fn)
    else:
        assert per_rank > 1
        sched = pp.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    return my_stages, sched


def _pipeline_body(rank, world, name, n_stages, m, checkpoint, steps):
    blocks = _blocks(n_stages)
    my_stages, sched = _schedule(rank, world, name, n_stages, m, checkpoint, blocks)
    x, y = _data()
    losses = []
    for _ in range(steps):
        losses.clear()
        args = (x,) if 0 in my_stages else ()
        has_last = n_stages - 1 in my_stages
        sched.step(*args, target=y if has_last else None, losses=losses if has_last else None)
    ref_loss, ref_grads = _reference(n_stages)
    if n_stages - 1 in my_stages:
        assert len(losses) == m
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, **TOL)
    for s in my_stages:
        for p, g in zip(blocks[s].parameters(), ref_grads[s]):
            torch.testing.assert_close(p.grad, steps * g, **TOL)


CASES = [
    # (name, world, stages, micro-batches)
    ("gpipe", 2, 2, 2),
    ("1f1b", 2, 2, 2),
    ("1f1b", 2, 2, 8),
    ("gpipe", 4, 4, 4),
    ("1f1b", 4, 4, 4),
    ("1f1b", 4, 4, 8),
    ("interleaved_1f1b", 2, 4, 2),
    ("interleaved_1f1b", 2, 4, 4),
    ("zb1p", 2, 2, 4),
    ("zb1p", 2, 2, 8),
    ("zb1p", 4, 4, 4),
    ("zb1p", 4, 4, 8),
    ("zb1p", 2, 4, 2),  # two stages per rank: zero bubble over interleaved 1F1B
    ("zb1p", 2, 4, 8),
    ("zb1p", 2, 6, 4),  # three per rank
    ("zbv", 2, 4, 2),
    ("zbv", 2, 4, 4),
    ("zbv", 2, 4, 8),
    ("zbv", 4, 8, 8),
    ("dualpipev", 2, 4, 4),
    ("dualpipev", 2, 4, 8),
    ("dualpipev", 4, 8, 8),
    ("dualpipev", 3, 6, 8),
]


@pytest.mark.parametrize("name,world,n_stages,m", CASES)
def test_gradients_equal_unsplit_model(name, world, n_stages, m):
    run_ranks(_pipeline_body, world, name, n_stages, m, False, 1)


@pytest.mark.parametrize(
    "name,n_stages",
    [("1f1b", 2), ("interleaved_1f1b", 4), ("zb1p", 2), ("zb1p", 4), ("zbv", 4), ("dualpipev", 4)],
)
def test_checkpointing_gives_the_same_gradients(name, n_stages):
    run_ranks(_pipeline_body, 2, name, n_stages, 4, True, 1)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 4, 8, 13])
def test_zbv_order_equals_torchs(p, m):
    """Our C++ ZBV generator gives torch's ScheduleZBVZeroBubble compute
    order, rank by rank (torch's padding slots left out)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    me = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
    plan = pp.get_schedule("zbv", 2 * p, m, stages_per_rank=2)
    assert plan.placement == "v"
    for r in range(p):
        theirs = ScheduleZBVZeroBubble._calculate_single_rank_operations(me, r)
        theirs = [str(a) for a in theirs if a is not None]
        ours = [str(a) for a in plan.ranks[r] if a.kind in ("F", "I", "W")]
        assert ours == theirs, (r, ours, theirs)


def _with_transfers(orders, n_stages, p):
    """Compute orders (per rank, printed actions; stage s on rank s % p) with
    a receive before and a send after each action whose data crosses ranks."""
    out = []
    for r, order in enumerate(orders):
        actions = []
        for text in order:
            a = pp.Action.parse(text)
            s, mb = a.stage, a.microbatch
            before = after = None
            if a.kind == "F":
                before = s > 0 and (s - 1) % p != r and f"{s}RECV_F{mb}"
                after = s < n_stages - 1 and (s + 1) % p != r and f"{s}SEND_F{mb}"
            elif a.kind in ("B", "I"):
                before = s < n_stages - 1 and (s + 1) % p != r and f"{s}RECV_B{mb}"
                after = s > 0 and (s - 1) % p != r and f"{s}SEND_B{mb}"
            actions += [x for x in (before, text, after) if x]
        out.append(actions)
    return out


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_zero_bubble_against_torchs(p, v, rounds):
    """Our zb1p with v stages per rank against torch's
    ScheduleInterleavedZeroBubble order, both simulated by our validator with
    the paper's unit costs (F = I = W = 1): the same makespan, the 3vm + (p -
    1) lower bound, and no more activations in flight on any rank."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    m, n_stages = rounds * p, v * p
    me = SimpleNamespace(
        n_local_stages=v,
        pp_group_size=p,
        _n_microbatches=m,
        number_of_rounds=rounds,
        microbatches_per_round=p,
    )
    theirs = [
        [
            str(a)
            for a in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(me, r)
            if a
        ]
        for r in range(p)
    ]
    costs = [(1, 2, 1, 1)] * n_stages
    torch_stats = pp.Schedule(n_stages, m, _with_transfers(theirs, n_stages, p)).validate(
        costs=costs
    )
    ours = pp.get_schedule("zb1p", n_stages, m, stages_per_rank=v).validate(costs=costs)
    assert ours.makespan == torch_stats.makespan == 3 * v * m + p - 1
    assert all(a <= b for a, b in zip(ours.peak_in_flight, torch_stats.peak_in_flight))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [8, 9, 16])
def test_dualpipev_order_equals_torchs(p, m):
    """Our C++ DualPipeV generator gives torch's ScheduleDualPipeV compute
    order, rank by rank (an overlapped pair as its forward, then its backward)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    me = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    plan = pp.get_schedule("dualpipev", 2 * p, m, stages_per_rank=2)
    for r in range(p):
        theirs = []
        for a in ScheduleDualPipeV._calculate_single_rank_operations(me, r):
            theirs += [str(x) for x in (a.sub_actions or (a,))]
        ours = [str(a) for a in plan.ranks[r] if a.kind in ("F", "B", "I", "W")]
        assert ours == theirs, (r, ours, theirs)


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "zbv", "dualpipev"])
def test_two_steps_accumulate(name):
    run_ranks(_pipeline_body, 2, name, 4 if name in ("zbv", "dualpipev") else 2, 4, False, 2)


def test_split_linear_defers_the_weight_gradient():
    """dsparallel.pipeline.split_linear: outside a capture, F.linear with its
    gradients; inside one, only the input gradient, the weight and bias
    gradients arriving when the capture runs (through AccumulateGrad, so
    hooks fire), equal to autograd's, for 3-D inputs too."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(2, 4, 5, requires_grad=True)
    ref = nn.Linear(5, 3)
    ref.load_state_dict(lin.state_dict())
    xr = x.detach().clone().requires_grad_()
    ref(xr).square().sum().backward()
    fired = []  # whether .grad held a gradient each time the hook ran
    lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
    _C.weight_grad_begin()
    pp.split_linear(x, lin.weight, lin.bias).square().sum().backward()
    key = _C.weight_grad_end()
    assert lin.weight.grad is None and lin.bias.grad is None and not any(fired)
    torch.testing.assert_close(x.grad, xr.grad)
    assert _C.weight_grad_run(key) == 1
    assert fired[-1] is True
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
    # Not capturing: an ordinary backward.
    lin.zero_grad()
    pp.split_linear(x.detach(), lin.weight).sum().backward()
    assert lin.weight.grad is not None and _C.weight_grad_pending() == 0


def test_bubble_breakdown_adds_up():
    """Two stages: rank 1 waits for F0 (wait), starts F1 half a unit after its
    input and the rank were ready (overhead), ends a unit before rank 0
    (tail); rank 0 waits twice for the gradient."""
    trace = [
        [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 3.0, 4.0), ("0B1", 5.0, 6.0)],
        [("1F0", 1.0, 2.0), ("1B0", 2.0, 3.0), ("1F1", 3.5, 4.5), ("1B1", 4.5, 5.0)],
    ]
    parts = pp.bubble_breakdown(trace)
    total = 2 * 6.0
    want = {"wait": 3.0 / total, "overhead": 0.5 / total, "tail": 1.0 / total}
    assert parts == pytest.approx(want)
    assert sum(parts.values()) == pytest.approx(pp.bubble(trace))
    # Given the transfers: rank 1 spent 0.2 of its 0.5 overhead receiving F1's
    # input; its receive of F0's input (during the wait) is not overhead.
    transfers = [[("0SEND_F1", 2.0, 2.1)], [("1RECV_F0", 0.5, 1.0), ("1RECV_F1", 3.2, 3.4)]]
    split = pp.bubble_breakdown(trace, transfers)
    assert split == pytest.approx({**want, "in_transfers": 0.2 / total, "between": 0.3 / total})


def test_replayed_removes_the_runtime_keeps_the_waits():
    """The trace above without its half-unit overhead: rank 1's F1 starts when
    rank 0's F1 ends and rank 1 is free, every later action moves up, and the
    waits the schedule forces stay."""
    trace = [
        [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 3.0, 4.0), ("0B1", 5.0, 6.0)],
        [("1F0", 1.0, 2.0), ("1B0", 2.0, 3.0), ("1F1", 3.5, 4.5), ("1B1", 4.5, 5.0)],
    ]
    assert pp.replayed(trace) == [
        [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 3.0, 4.0), ("0B1", 4.5, 5.5)],
        [("1F0", 1.0, 2.0), ("1B0", 2.0, 3.0), ("1F1", 3.0, 4.0), ("1B1", 4.0, 4.5)],
    ]
    assert pp.bubble(pp.replayed(trace)) == pytest.approx(1 - 7.5 / 11)
    # Split backward: a W waits for its own I only, an I for the next stage's
    # I: rank 0's I0 moves up to the end of rank 1's I0.
    zb = [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0I0", 4, 5), ("0W0", 5, 6), ("0I1", 6, 7), ("0W1", 7, 8)],
        [("1F0", 1, 2), ("1I0", 2, 3), ("1W0", 3, 4), ("1F1", 4, 5), ("1I1", 5, 6), ("1W1", 6, 7)],
    ]
    assert pp.replayed(zb) == [
        [("0F0", 0, 1), ("0F1", 1, 2), ("0I0", 3, 4), ("0W0", 4, 5), ("0I1", 6, 7), ("0W1", 7, 8)],
        [("1F0", 1, 2), ("1I0", 2, 3), ("1W0", 3, 4), ("1F1", 4, 5), ("1I1", 5, 6), ("1W1", 6, 7)],
    ]
    # Ranks that wait on each other: rank 0's B0 needs rank 1's B0, which
    # comes after rank 1's F0, which needs rank 0's F0, which comes after B0.
    with pytest.raises(ValueError, match="cannot be replayed"):
        pp.replayed([[("0B0", 0, 1), ("0F0", 1, 2)], [("1F0", 0, 1), ("1B0", 1, 2)]])


def test_split_linear_passes_opcheck():
    x, w, b = torch.randn(4, 5), torch.randn(3, 5), torch.randn(3)
    torch.library.opcheck(torch.ops.dsparallel.split_linear, (x, w, b))
    torch.library.opcheck(
        torch.ops.dsparallel.split_linear,
        (x.requires_grad_(), w.requires_grad_(), b.requires_grad_()),
    )


def test_split_linear_saves_what_linear_saves():
    """Saved-tensor hooks see from split_linear what they see from F.linear:
    the input only for the weight's gradient, the weight only for the
    input's. A first stage's input needs no gradient, so its weight is not
    saved (an offloading hook would otherwise copy it per micro-batch), and
    the gradients are still right."""

    def saved_by(fn, x, w, b):
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            out = fn(x, w, b)
        return out, {t.untyped_storage().data_ptr() for t in seen}

    torch.manual_seed(0)
    w, b = torch.randn(3, 5, requires_grad=True), torch.randn(3, requires_grad=True)
    for x in (torch.randn(4, 5), torch.randn(4, 5, requires_grad=True)):
        ours, ours_saved = saved_by(torch.ops.dsparallel.split_linear, x, w, b)
        _, theirs_saved = saved_by(nn.functional.linear, x, w, b)
        assert ours_saved == theirs_saved
        assert (w.untyped_storage().data_ptr() in ours_saved) == x.requires_grad
        ours.square().sum().backward()
        got = [t.grad.clone() for t in (w, b, x) if t.grad is not None]
        for t in (w, b, x):
            t.grad = None
        nn.functional.linear(x, w, b).square().sum().backward()
        for g, t in zip(got, [t for t in (w, b, x) if t.grad is not None]):
            torch.testing.assert_close(g, t.grad)
        for t in (w, b, x):
            t.grad = None


def _step_two_stages(sched, rank, x, y):
    """One step of a 2-stage pipeline: rank 0 feeds x, rank 1 scores against y."""
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y)


def _bad_batch_body(rank, world):
    stage = pp.PipelineStage(nn.Linear(3, 3), rank, world)
    sched = pp.Schedule1F1B(stage, 3, loss_fn=nn.functional.mse_loss)
    try:
        _step_two_stages(sched, rank, torch.randn(8, 3), torch.randn(8, 3))
    except ValueError as e:
        assert "8" in str(e) and "3" in str(e), str(e)
    else:
        raise AssertionError("an indivisible batch was accepted")


def test_batch_not_divisible_is_refused_on_every_rank():
    run_ranks(_bad_batch_body, 2)


def _wrong_stage_body(rank, world):
    try:
        pp.PipelineStage(nn.Linear(3, 3), (rank + 1) % world, world)
    except ValueError as e:
        assert "belongs to group rank" in str(e)
    else:
        raise AssertionError("a stage on the wrong rank was accepted")
    dist.barrier()


def test_stage_on_wrong_rank_is_refused():
    run_ranks(_wrong_stage_body, 2)


def _traces_body(rank, world):
    stage = pp.PipelineStage(nn.Linear(3, 3), rank, world)
    sched = pp.Schedule1F1B(stage, 3, loss_fn=nn.functional.mse_loss)
    _step_two_stages(sched, rank, torch.randn(6, 3), torch.randn(6, 3))
    names = [str(a) for a in sched.actions]
    compute = [n for n in names if "SEND" not in n and "RECV" not in n]
    moving = [n for n in names if n not in compute]
    assert [t[0] for t in sched.trace] == compute
    assert [t[0] for t in sched.transfer_trace] == moving and moving
    # One clock, in the order the actions ran.
    spans = sorted(sched.trace + sched.transfer_trace, key=lambda t: t[1])
    assert [t[0] for t in spans] == names
    assert all(s <= e <= nxt for (_, s, e), (_, nxt, _) in zip(spans, spans[1:]))
    everyone = pp.gather_trace(sched, transfers=True)
    assert everyone[rank] == sched.transfer_trace and len(everyone) == world


def test_step_records_its_compute_and_transfer_actions():
    run_ranks(_traces_body, 2)


class _ColumnMajor(nn.Module):
    """The same values, laid out column-major: a non-contiguous stage output."""

    def forward(self, x):
        return x.t().contiguous().t()


def _non_contiguous_body(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), _ColumnMajor(), nn.Linear(6, 6))
    x, y = _data()
    nn.functional.mse_loss(model(x), y).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    stage = pp.PipelineStage(model[:2] if rank == 0 else model[2:], rank, world)
    assert rank or not model[:2](x).is_contiguous()
    _step_two_stages(pp.Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss), rank, x, y)
    mine = model[:2] if rank == 0 else model[2:]
    theirs = ref[:2] if rank == 0 else ref[2:]
    for p, g in zip(mine.parameters(), theirs):
        torch.testing.assert_close(p.grad, g, **TOL)


def test_non_contiguous_stage_output_travels_intact():
    run_ranks(_non_contiguous_body, 2)


def test_plot_planned_schedule(tmp_path):
    path = pp.plot_schedule(pp.get_schedule("interleaved_1f1b", 4, 4, 2), str(tmp_path / "p.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    trace = pp.planned_trace(pp.get_schedule("gpipe", 3, 5))
    assert pp.bubble(trace) == pytest.approx(2 / 7)


def test_plot_plan_beside_measured_step(tmp_path):
    # GPipe on 2 stages, F = 2 and B = 3 slots: the simulator's placement.
    gpipe = pp.get_schedule("gpipe", 2, 2)
    assert pp.planned_trace(gpipe, (2, 3, 1, 1)) == [
        [("0F0", 0, 2), ("0F1", 2, 4), ("0B0", 9, 12), ("0B1", 12, 15)],
        [("1F0", 2, 4), ("1F1", 4, 6), ("1B0", 6, 9), ("1B1", 9, 12)],
    ]
    # Per-stage costs: the trace's bubble is the simulator's, and a "measured"
    # step that ran exactly to plan (in seconds) gives back those costs.
    sched = pp.get_schedule("dualpipev", 4, 8, stages_per_rank=2)
    costs = [(400, 700, 410, 300), (350, 690, 400, 260), (355, 694, 404, 289), (436, 744, 571, 459)]
    plan = pp.planned_trace(sched, costs)
    assert pp.bubble(plan) == pytest.approx(sched.validate(costs=costs).bubble)
    measured = [[(a, 5.0 + 1e-6 * s, 5.0 + 1e-6 * e) for a, s, e in rank] for rank in plan]
    assert pp.mean_costs(measured, 4) == costs
    path = pp.plot_schedule(sched, str(tmp_path / "pm.png"), title="t", measured=measured)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="beside a Schedule's plan"):
        pp.plot_schedule(measured, str(tmp_path / "x.png"), measured=measured)


class _Growing(nn.Module):
    """Outputs one row fewer on each call: the shape changes between micro-batches."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)[: max(1, x.shape[0] - self.calls + 1)]


def _shape_change_body(rank, world, rows, width):
    module = _Growing(width) if rank == 0 else nn.Linear(width, width)
    stage = pp.PipelineStage(module, rank, world)
    sched = pp.ScheduleGPipe(stage, 2, loss_fn=lambda out, y: out.sum())
    x = torch.randn(2 * rows, width)
    try:
        _step_two_stages(sched, rank, x, x)
    except RuntimeError as e:
        assert "changed shape between micro-batches" in str(e), str(e)
        assert f"[{rows}, {width}]" in str(e) and f"[{rows - 1}, {width}]" in str(e), str(e)
    else:
        raise AssertionError("a changing stage output was accepted")


# Small outputs travel as one message; from 512 KiB (300 x 512 floats) the
# header and the payload travel apart.
@pytest.mark.parametrize("rows,width", [(2, 3), (300, 512)])
def test_stage_output_shape_change_raises_on_both_ends(rows, width):
    run_ranks(_shape_change_body, 2, rows, width, pg_timeout_s=20)


def _activation_route_body(rank, world, name, rows, width, hosts):
    """Activations of rows x width floats per micro-batch, over the route that
    size (and host layout) takes; loss and gradients against one process."""
    if hosts:  # two simulated hosts: activations go over gloo
        os.environ["DSP_NODE_ID"] = f"host{rank}"
        dist.init_process_group("dsp")
    torch.manual_seed(0)
    m = 4
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(4))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows * m, width, generator=g), torch.randn(rows * m, width, generator=g)
    ref = nn.Sequential(*[copy.deepcopy(b) for b in blocks])
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = [[p.grad for p in b.parameters()] for b in ref]
    mine = [rank, 3 - rank] if name == "zbv" else [2 * rank, 2 * rank + 1]
    loss_fn = nn.functional.mse_loss
    if name == "zbv":
        stages = [pp.PipelineStage(blocks[s], s, 4) for s in mine]
        sched = pp.ScheduleZBVZeroBubble(stages, m, loss_fn=loss_fn)
    else:
        stage = pp.PipelineStage(nn.Sequential(blocks[mine[0]], blocks[mine[1]]), rank, 2)
        sched = pp.Schedule1F1B(stage, m, loss_fn=loss_fn)
    losses = []
    last = 3 in mine
    sched.step(*((x,) if 0 in mine else ()), target=y if last else None, losses=losses)
    if last:
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), **TOL)
    for s in mine:
        for p, want in zip(blocks[s].parameters(), ref_grads[s]):
            torch.testing.assert_close(p.grad, want, **TOL)
    if hosts:
        dist.destroy_process_group()


# 512 KiB (256 x 512 floats): header and payload travel as two messages, the
# payload read in place. 255 x 514 floats (8 bytes under 512 KiB): header and
# payload together overflow a ring, so they are put together and read in
# place. Small ones go through the ring as one message without being put
# together first; between hosts they are put together and go over gloo.
@pytest.mark.parametrize(
    "name,rows,width,hosts",
    [
        ("1f1b", 256, 512, False),
        ("zbv", 256, 512, False),
        ("1f1b", 255, 514, False),
        ("zbv", 8, 64, False),
        ("zbv", 8, 64, True),
    ],
)
def test_activation_routes_give_the_same_gradients(name, rows, width, hosts):
    run_ranks(_activation_route_body, 2, name, rows, width, hosts, init=not hosts)


class _Failing(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom in stage 1")


def _stage_exception_body(rank, world):
    import time

    module = _Failing() if rank == 1 else nn.Linear(3, 3)
    stage = pp.PipelineStage(module, rank, world)
    sched = pp.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom in stage 1") as failed:
        _step_two_stages(sched, rank, torch.randn(4, 3), torch.randn(4, 3))
    if rank == 0:
        assert "failed on rank 1 (stage 1, micro-batch 0, forward" in str(failed.value)
    # rank 0 hears of it from rank 1, not from the group's timeout
    assert time.monotonic() - t0 < 10, time.monotonic() - t0


def test_exception_in_one_stage_raises_everywhere():
    run_ranks(_stage_exception_body, 2, pg_timeout_s=60)


class _FailOnce(nn.Module):
    """`inner`, except that its call number `at` raises, in its forward or,
    with `where="backward"`, in the backward through its output."""

    def __init__(self, inner, at, where):
        super().__init__()
        self.inner, self.at, self.where, self.calls = inner, at, where, 0

    def forward(self, x):
        self.calls += 1
        if self.calls != self.at:
            return self.inner(x)
        if self.where == "forward":
            raise RuntimeError("injected fault in the forward")
        out = self.inner(x)

        def boom(grad):
            raise RuntimeError("injected fault in the backward")

        out.register_hook(boom)
        return out


def _fault_body(rank, world, name, n_stages, m, fail_rank, fail_stage, at, where):
    """One step fails on one rank mid-way: every rank raises naming it, and
    the next step on the same group gives the uninterrupted gradients."""
    blocks = _blocks(n_stages)
    modules = list(blocks)
    if rank == fail_rank:
        modules[fail_stage] = _FailOnce(blocks[fail_stage], at, where)
    my_stages, sched = _schedule(rank, world, name, n_stages, m, False, modules)
    assert fail_rank != rank or fail_stage in my_stages
    x, y = _data()
    args = (x,) if 0 in my_stages else ()
    last = n_stages - 1 in my_stages
    with pytest.raises(RuntimeError) as failed:
        sched.step(*args, target=y if last else None)
    text = str(failed.value)
    assert f"injected fault in the {where}" in text, text
    if rank != fail_rank:
        assert f"failed on rank {fail_rank} (stage {fail_stage}" in text, text
    for b in blocks:
        b.zero_grad(set_to_none=True)
    losses = []
    sched.step(*args, target=y if last else None, losses=losses if last else None)
    ref_loss, ref_grads = _reference(n_stages)
    if last:
        torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, **TOL)
    for s in my_stages:
        for p, g in zip(blocks[s].parameters(), ref_grads[s]):
            torch.testing.assert_close(p.grad, g, **TOL)


FAULTS = [
    # (schedule, world, stages, micro-batches, failing rank, its stage, call, where)
    ("gpipe", 2, 2, 4, 0, 0, 2, "forward"),
    ("1f1b", 4, 4, 4, 2, 2, 3, "forward"),
    ("1f1b", 2, 2, 4, 1, 1, 1, "forward"),  # the first activation's receiver
    ("1f1b", 2, 2, 4, 0, 0, 1, "forward"),  # before any shape is known
    ("1f1b", 4, 4, 4, 1, 1, 2, "backward"),
    ("zb1p", 2, 2, 4, 1, 1, 2, "backward"),
    ("zbv", 2, 4, 4, 1, 2, 2, "forward"),
    ("dualpipev", 2, 4, 4, 0, 3, 3, "backward"),
    ("interleaved_1f1b", 2, 4, 4, 1, 3, 4, "forward"),
]


@pytest.mark.parametrize("name,world,n_stages,m,fail_rank,fail_stage,at,where", FAULTS)
def test_a_failed_step_raises_everywhere_and_the_next_step_is_exact(
    name, world, n_stages, m, fail_rank, fail_stage, at, where
):
    run_ranks(
        _fault_body, world, name, n_stages, m, fail_rank, fail_stage, at, where, pg_timeout_s=20
    )


def _two_pipelines_body(rank, world, steps):
    """Two zero-bubble pipelines, each on its own group, stepped by two
    threads of each process at once: each one's weight gradients are its own
    (one process-wide store mixed or dropped them)."""
    import threading

    groups = [dist.new_group(backend="dsp") for _ in range(2)]
    x, y = _data()
    # Built here, not in the threads: both draw from the global generator,
    # and every rank must draw the same weights.
    models = []
    for i in range(2):
        torch.manual_seed(i)
        models.append(nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)))
    refs = [copy.deepcopy(blocks) for blocks in models]
    for ref in refs:
        h = x
        for b in ref:
            h = b(h)
        nn.functional.mse_loss(h, y).backward()
    results, errors = {}, []

    def train(i):
        try:
            blocks, mine = models[i], [rank, 3 - rank]
            stages = [pp.PipelineStage(blocks[s], s, 4, group=groups[i]) for s in mine]
            sched = pp.ScheduleZBVZeroBubble(stages, 4, loss_fn=nn.functional.mse_loss)
            for _ in range(steps):
                sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
            for s in mine:
                for p, want in zip(blocks[s].parameters(), refs[i][s].parameters()):
                    torch.testing.assert_close(p.grad, steps * want.grad, **TOL)
            results[i] = True
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"pipeline {i}: {e!r}")

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: True, 1: True}


def test_two_pipelines_in_one_process_keep_their_weight_gradients_apart():
    run_ranks(_two_pipelines_body, 2, 20, pg_timeout_s=60)


def _tied_body(rank, world, name):
    """A weight shared by the first and the last stage, which a V puts on
    the same rank (as a tied embedding and LM head would be): its gradient
    is the sum of both uses, counted once each (torch's graph-walking split
    counted a weight used twice twice, pytorch#180952)."""
    torch.manual_seed(0)
    tied = nn.Linear(6, 6)
    middle = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)]
    first = nn.Sequential(tied, nn.Tanh())
    last = nn.Sequential(tied, nn.Tanh())
    x, y = _data()
    ref = last(middle[1](middle[0](first(x))))
    nn.functional.mse_loss(ref, y).backward()
    want = [p.grad.clone() for p in tied.parameters()]
    want_mid = [[p.grad.clone() for p in b.parameters()] for b in middle]
    for module in (tied, *middle):
        module.zero_grad(set_to_none=True)
    modules = {0: first, 1: middle[0], 2: middle[1], 3: last}
    mine = [rank, 2 * world - 1 - rank]
    stages = [pp.PipelineStage(modules[s], s, 4) for s in mine]
    cls = pp.ScheduleZBVZeroBubble if name == "zbv" else pp.ScheduleDualPipeV
    sched = cls(stages, 4, loss_fn=nn.functional.mse_loss)
    if rank == 0:
        sched.step(x, target=y, losses=[])
        for got, w in zip(tied.parameters(), want):
            torch.testing.assert_close(got.grad, w, **TOL)
    else:
        sched.step()
        for b, ws in zip(middle, want_mid):
            for got, w in zip(b.parameters(), ws):
                torch.testing.assert_close(got.grad, w, **TOL)
    return True


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_weight_tied_between_first_and_last_stage_is_counted_once(name):
    run_ranks(_tied_body, 2, name)


def test_v_schedules_refuse_bad_shapes():
    with pytest.raises(
        ValueError, match=r"at least twice as many micro-batches \(3\) as ranks \(2\)"
    ):
        pp.get_schedule("dualpipev", 4, 3, stages_per_rank=2)
    with pytest.raises(ValueError, match="5 stages cannot be split into 2 stages per rank"):
        pp.get_schedule("zbv", 5, 8, stages_per_rank=2)
    for name in ("zbv", "dualpipev"):
        with pytest.raises(ValueError, match="two stages per rank"):
            pp.get_schedule(name, 4, 8, stages_per_rank=1)
    with pytest.raises(ValueError, match="needs two stages per rank, got 1"):
        pp.ScheduleZBVZeroBubble([object()], 4)
    with pytest.raises(ValueError, match="needs two stages per rank, got 3"):
        pp.ScheduleDualPipeV([object()] * 3, 8)


class _Scale(nn.Module):
    """A parameter that reaches the loss without F.linear: its gradient cannot
    be deferred."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.scale


def _split_report_body(rank, world, name):
    torch.manual_seed(0)
    stage = pp.PipelineStage(nn.Sequential(nn.Linear(6, 6), _Scale(6)), rank, world)
    cls = pp.ScheduleInterleavedZeroBubble if name == "zb1p" else pp.Schedule1F1B
    sched = cls(stage, 4, loss_fn=nn.functional.mse_loss)
    x, y = _data()
    _step_two_stages(sched, rank, x, y)
    report = sched.split_report()
    if name == "1f1b":
        assert report == {}
        return
    entry = report[rank]
    assert entry["not_deferred"] == ["1.scale"], entry
    assert entry["not_deferred_numel"] == pytest.approx(6 / (36 + 6 + 6))
    assert entry["backward_s"] > 0 and entry["weight_s"] > 0
    share = entry["weight_s"] / (entry["backward_s"] + entry["weight_s"])
    assert entry["deferred_share"] == pytest.approx(share)


@pytest.mark.parametrize("name", ["zb1p", "1f1b"])
def test_split_report_names_what_was_not_deferred(name):
    """split_report: the Linear's weight and bias wait for W, the elementwise
    scale is computed inside I and named; W's share of the backward time is
    measured; schedules without W report nothing."""
    run_ranks(_split_report_body, 2, name)
