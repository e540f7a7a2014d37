"""ZeRO stages 1 and 2 (dsparallel.ZeroRedundancyOptimizer, stage 2 with
DistributedDataParallel(zero_stage=2)), held against the plain
single-process computation: AdamW with weight decay and global-norm clipping
on a model whose parameter sizes do not divide by the world size, checkpoints
resharded across world sizes, consolidation into a plain AdamW, comm hooks,
bad input; and torch's FSDP2 (fully_shard) over "dsp"."""

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import expect_raises, run_ranks
from torch import nn

import dsparallel

STEPS = 20
LR = dict(lr=3e-3, weight_decay=0.1)
CLIP = 0.5


def _model():
    torch.manual_seed(0)  # sizes 7x13+13, 5x7+5, 3x5+3: none divides by 2, 3 or 4
    return nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(step, n=24):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 13, generator=g), torch.randn(n, 3, generator=g)


def _reference(steps=STEPS):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **LR)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return model


def _train(rank, world, ddp_class, opt_factory, steps=STEPS, clip=None):
    model = _model()
    ddp = ddp_class(model)
    opt = opt_factory(model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        clip(model, opt)
        opt.step()
    return model


def _ddp(stage):
    """Our DDP for ZeRO stage ``stage`` (1: all-reduce, 2: reduce-scatter)."""
    return lambda m, **kw: dsparallel.DistributedDataParallel(
        m, zero_stage=2 if stage == 2 else 0, **kw
    )


def _close(a, b, rtol=1e-6, atol=1e-7):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


def _equivalence_body(rank, world, stage):
    ref = _reference()
    ours = _train(
        rank,
        world,
        _ddp(stage),
        lambda ps: dsparallel.ZeroRedundancyOptimizer(ps, torch.optim.AdamW, **LR),
        clip=lambda m, opt: opt.clip_grad_norm_(CLIP),
    )
    _close(ours, ref)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    theirs = _train(
        rank,
        world,
        nn.parallel.DistributedDataParallel,
        lambda ps: TorchZero(ps, torch.optim.AdamW, **LR),
        clip=lambda m, opt: nn.utils.clip_grad_norm_(m.parameters(), CLIP),
    )
    _close(ours, theirs)
    # Each rank holds 1/world of the state (the slices cover every element
    # once), and under stage 2 only its shard of the gradients.
    model = _model()
    ddp = _ddp(stage)(model)
    opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW)
    total = sum(p.numel() for p in model.parameters())
    mine = sum(r.param.numel() for r in opt._pieces)
    assert mine <= -(-total // world)
    covered = torch.tensor([mine])
    dist.all_reduce(covered)
    assert covered.item() == total
    x, y = _batch(0)
    nn.functional.mse_loss(ddp(x), y).backward()
    if stage == 2:
        assert all(p.grad is None for p in model.parameters())
        shards = ddp.reducer.grad_shards()
        held = sum(g.numel() for g in shards)
        assert held == sum(b.flat.numel() // world for b in opt._buffers)
        assert held <= total // world + len(shards)
    else:
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_adamw_with_clipping_equals_one_process_and_torch_zero(world, stage):
    run_ranks(_equivalence_body, world, stage)


def _consolidate_body(rank, world, stage):
    model = _model()
    ddp = _ddp(stage)(model)
    opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **LR)
    for step in range(5):
        x, y = _batch(step)
        mine = slice(rank * 12, rank * 12 + 12)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        # The consolidated state loads into a plain AdamW, which continues
        # exactly as the one-process run does.
        plain_model = _model()
        plain_model.load_state_dict(model.state_dict())
        plain = torch.optim.AdamW(plain_model.parameters(), **LR)
        plain.load_state_dict(opt.state_dict())
        ref = _model()
        ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
        for step in range(8):
            for m, o in ((ref, ref_opt), (plain_model, plain)) if step >= 5 else ((ref, ref_opt),):
                x, y = _batch(step)
                o.zero_grad()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
        _close(plain_model, ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_consolidated_state_loads_into_plain_adamw(stage):
    run_ranks(_consolidate_body, 2, stage)


def _resume_body(rank, world, path, save, stage):
    model = _model()
    ddp = _ddp(stage)(model)
    opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **LR)
    first = 0
    if not save:
        model.load_state_dict(torch.load(os.path.join(path, "model.pt")))
        shards = [torch.load(os.path.join(path, f)) for f in sorted(os.listdir(path)) if "opt" in f]
        opt.load_state_dict(shards)
        first = 5
    losses = []
    for step in range(first, 10):
        x, y = _batch(step)
        mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole, op=dist.ReduceOp.AVG)
        losses.append(whole.item())
        if save and step == 4:
            torch.save(opt.state_dict(), os.path.join(path, f"opt{rank}.pt"))
            if rank == 0:
                torch.save(model.state_dict(), os.path.join(path, "model.pt"))
    return losses


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("resume_world", [4, 1])
def test_save_at_two_ranks_resume_at_another_world_size(tmp_path, resume_world, stage):
    uninterrupted = run_ranks(_resume_body, 2, str(tmp_path), True, stage)[0]
    resumed = run_ranks(_resume_body, resume_world, str(tmp_path), False, stage)[0]
    torch.testing.assert_close(resumed, uninterrupted[5:], rtol=1e-6, atol=1e-7)


def _bad_input_body(rank, world):
    expect = expect_raises
    model = _model()
    expect(TypeError, lambda: dsparallel.ZeroRedundancyOptimizer(model.parameters(), nn.Linear))
    opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW)
    expect(TypeError, lambda: opt.step(closure=3), "closure must be callable")
    other = nn.Linear(13, 7 if rank == 0 else 8)
    expect(
        ValueError,
        lambda: dsparallel.ZeroRedundancyOptimizer(other.parameters(), torch.optim.AdamW),
        "parameter 0 of group 0",
        "on rank 1",
    )
    wrong = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 3)}}}
    wrong["param_groups"] = opt.state_dict()["param_groups"]
    expect(ValueError, lambda: opt.load_state_dict(wrong), "parameter 0", "(7, 13)")
    # DDP's zero_stage: its values, and what stage 2 cannot do.
    DDP = dsparallel.DistributedDataParallel
    expect(ValueError, lambda: DDP(_model(), zero_stage=3), "zero_stage must be 0, 1 or 2")
    expect(ValueError, lambda: DDP(_model(), overlap_param_gather=True), "needs zero_stage=2")
    expect(
        ValueError,
        lambda: DDP(_model(), zero_stage=2, gradient_as_bucket_view=True),
        "gradient_as_bucket_view",
    )
    # Stage 2 keeps no .grad: a plain optimizer would step nothing, silently.
    model = _model()
    ddp = DDP(model, zero_stage=2)
    torch.optim.AdamW(model.parameters())
    expect(RuntimeError, lambda: ddp(torch.randn(2, 13)), "ZeroRedundancyOptimizer")


def test_bad_input_raises_on_every_rank():
    run_ranks(_bad_input_body, 2)


def _fsdp2_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # A CPU mesh, given explicitly: on a machine with a GPU the default is a CUDA mesh
    # (NCCL refuses two ranks on one GPU).
    mesh = init_device_mesh("cpu", (world,))

    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    model = _model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **LR)
    for step in range(10):
        x, y = _batch(step)
        mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        for m, o, xs, ys in ((model, opt, x[mine], y[mine]), (ref, ref_opt, x, y)):
            o.zero_grad()
            nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-5)


def test_fsdp2_over_dsp_equals_one_process():
    run_ranks(_fsdp2_body, 2)


def _mixed_dtypes_body(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 5).to(torch.bfloat16))
    before = [p.detach().clone() for p in model.parameters()]
    opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    # One buffer per dtype; the bf16 slice is stepped in an fp32 master copy,
    # and the parameters are views into the buffers.
    assert sorted(str(b.dtype) for b in opt._buffers) == ["torch.bfloat16", "torch.float32"]
    assert all(r.param.dtype == torch.float32 for r in opt._pieces)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert not torch.equal(p, b), "a parameter was not updated"
        torch.testing.assert_close(
            p.float(), b.float() - 1e-2 * (1 + 0.01 * b.float()), atol=2e-2, rtol=0
        )


def test_mixed_dtypes_are_sharded_per_dtype():
    run_ranks(_mixed_dtypes_body, 2)


def _no_sync_frozen_body(rank, world, stage):
    """no_sync accumulation over 3 micro-batches equals the big batch, with a
    frozen layer that ZeRO leaves alone."""
    ref = _model()
    ref[0].requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **LR)
    model = _model()
    model[0].requires_grad_(False)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    ddp = _ddp(stage)(model)
    opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **LR)
    for step in range(5):
        x, y = _batch(step)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        mine_x, mine_y = x.chunk(world)[rank].chunk(3), y.chunk(world)[rank].chunk(3)
        for i, (xs, ys) in enumerate(zip(mine_x, mine_y)):
            if i < 2:
                with ddp.no_sync():
                    (nn.functional.mse_loss(ddp(xs), ys) / 3).backward()
            else:
                (nn.functional.mse_loss(ddp(xs), ys) / 3).backward()
        opt.step()
    _close(model, ref)
    assert all(torch.equal(p, f) for p, f in zip(model[0].parameters(), frozen))


@pytest.mark.parametrize("stage", [1, 2])
def test_no_sync_accumulation_and_frozen_parameters(stage):
    run_ranks(_no_sync_frozen_body, 2, stage)


def _stage2_options_body(rank, world):
    """Stage 2 with unused parameters, with several buckets, with accumulation
    over synced backwards (each reduce-scatter adds into the shard), with
    parameter groups of their own, with the parameter all-gathers overlapped
    with the next forward, and with a comm hook of all-reduce semantics:
    every one equals the one-process run."""

    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _model()
            self.unused = nn.Linear(3, 3)

        def forward(self, x):
            return self.body(x)

    def run(distributed, hook=None, **ddp_kw):
        torch.manual_seed(0)
        model = WithUnused()
        groups = [
            {"params": [p for n, p in model.named_parameters() if "bias" not in n]},
            {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0},
        ]
        if distributed:
            ddp = dsparallel.DistributedDataParallel(model, zero_stage=2, **ddp_kw)
            if hook is not None:
                ddp.register_comm_hook(None, hook)
            opt = dsparallel.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **LR)
        else:
            ddp, opt = model, torch.optim.AdamW(groups, **LR)
        for step in range(6):
            x, y = _batch(step)
            opt.zero_grad()
            for half in (0, 1):  # two synced backwards accumulate
                xs, ys = x.chunk(2)[half], y.chunk(2)[half]
                if distributed:
                    xs, ys = xs.chunk(world)[rank], ys.chunk(world)[rank]
                (nn.functional.mse_loss(ddp(xs), ys) / 2).backward()
            opt.step()
            if step == 3:
                # A step on zeroed gradients: the shards' zeros, deferred by
                # zero_grad, must be what the optimizer reads.
                opt.zero_grad(set_to_none=False)
                opt.step()
        if distributed:
            ddp.wait_param_gather()  # overlap_param_gather: the last step's gathers
        return model

    ref = run(False)
    _close(run(True, find_unused_parameters=True, bucket_cap_mb=0.0003), ref)

    # One bucket per parameter: gradients are read where
    # autograd left them, and at most two buckets' worth are held at once.
    model = _model()
    ddp = dsparallel.DistributedDataParallel(model, zero_stage=2, bucket_cap_mb=1e-6)
    dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **LR)
    assert len(ddp.reducer.padded_numels()) == 6
    nn.functional.mse_loss(ddp(_batch(0)[0]), _batch(0)[1]).backward()
    assert 0 < ddp.reducer.staging_bytes <= 2 * 4 * max(ddp.reducer.padded_numels())
    # Each step's all-gathers left running, waited for by each layer's forward.
    small = dict(find_unused_parameters=True, bucket_cap_mb=0.0003)
    _close(run(True, overlap_param_gather=True, **small), ref)
    _close(run(True, hook=dsparallel.comm_hooks.allreduce_hook, find_unused_parameters=True), ref)


def test_stage2_unused_buckets_accumulation_groups_overlap_and_hooks():
    run_ranks(_stage2_options_body, 2)


def _compress_body(rank, world):
    """A bf16 compress hook under stage 2 reduce-scatters in bf16 and gives what
    the same hook gives under all-reduce (stage 1)."""

    def run(stage, hook):
        model = _model()
        ddp = _ddp(stage)(model)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **LR)
        for step in range(5):
            x, y = _batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
        return model

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    exact = run(1, None)
    for hook in (dsparallel.comm_hooks.bf16_compress_hook, default_hooks.bf16_compress_hook):
        stage1, stage2 = run(1, hook), run(2, hook)
        _close(stage2, stage1, rtol=1e-5, atol=1e-6)
        assert any(not torch.equal(p, q) for p, q in zip(stage2.parameters(), exact.parameters()))


def test_stage2_bf16_compress_hook_reduce_scatters_in_bf16():
    run_ranks(_compress_body, 2)
