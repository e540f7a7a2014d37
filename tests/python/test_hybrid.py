"""Hybrid DP x TP x PP: the layout, and the GPT job held against one process.

The GPT job (examples/train_gpt.py) runs under torchrun on 4 processes in
several layouts; the same model and batches trained in one process with a
plain loop (no pipeline, no DDP, groups of one) must give the same losses
(float32, within 1e-4 relative, as the issue states).
"""

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks, run_script
from test_examples import ROOT, _torchrun

import dsparallel

STEPS = 10
SMALL = ["--hidden", "64", "--layers", "4", "--seq", "32", "--batch-size", "8"]


def _train_gpt_module():
    examples = os.path.join(ROOT, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import train_gpt

    return train_gpt


def _one_process_losses(rank, world, steps, moe=None):
    """The GPT job's losses in one process (``moe``: GPTConfig's moe_* fields)."""
    from dsparallel.models import GPTConfig, build_stage, gpt_loss
    from dsparallel.moe import update_expert_bias

    job = _train_gpt_module()
    cfg = GPTConfig(seq_len=32, hidden=64, heads=4, layers=4, **(moe or {}))
    model = build_stage(cfg)  # the whole model; the world is one process
    loss_fn = gpt_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    corpus = job.load_corpus()
    losses = []
    for step in range(steps):
        ids, target = job.batch(corpus, step, 8, 32)
        loss = loss_fn(model(ids), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_expert_bias(model)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_one_process_losses, 1, STEPS)[0]


def _assert_same_losses(got, want, rtol):
    """Two runs' [step, loss] histories agree loss by loss."""
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), rtol=rtol, atol=0
    )


def _run_job(tmp_path, name, *args, nproc=4):
    out_file = tmp_path / f"{name}.json"
    job = os.path.join(ROOT, "examples", "train_gpt.py")
    run_script(job, *SMALL, "--plot", "", "--losses", str(out_file), *args, nproc=nproc)
    return json.loads(out_file.read_text())


@pytest.mark.parametrize(
    "layout",
    [
        ("--tensor-parallel", "2", "--pipeline-parallel", "2"),
        ("--tensor-parallel", "2", "--pipeline-parallel", "1"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "2"),
        ("--tensor-parallel", "2", "--pipeline-parallel", "2", "--schedule", "zb1p"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "2", "--schedule", "zb1p"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "2", "--schedule", "zbv"),
        ("--tensor-parallel", "2", "--pipeline-parallel", "2", "--schedule", "dualpipev"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "2", "--schedule", "dualpipev"),
        ("--tensor-parallel", "2", "--pipeline-parallel", "2", "--schedule", "interleaved_1f1b"),
        ("--tensor-parallel", "2", "--pipeline-parallel", "2", "--schedule", "zb1p")
        + ("--stages-per-rank", "2"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "2", "--schedule", "zb1p")
        + ("--stages-per-rank", "2"),
        ("--tensor-parallel", "2", "--pipeline-parallel", "1", "--context-parallel", "2"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "2", "--context-parallel", "2")
        + ("--zero-stage", "2"),
        ("--tensor-parallel", "1", "--pipeline-parallel", "1", "--context-parallel", "2")
        + ("--cp-mode", "ulysses"),
    ],
    ids=[
        "tp2-pp2",
        "tp2-dp2",
        "pp2-dp2",
        "tp2-pp2-zb1p",
        "pp2-dp2-zb1p",
        "pp2-dp2-zbv",
        "tp2-pp2-dualpipev",
        "pp2-dp2-dualpipev",
        "tp2-pp2-interleaved",
        "tp2-pp2-zb1p-interleaved",
        "pp2-dp2-zb1p-interleaved",
        "tp2-cp2",
        "pp2-cp2-zero2",
        "dp2-cp2-ulysses",
    ],
)
def test_gpt_layouts_match_one_process(tmp_path, reference, layout):
    history = _run_job(tmp_path, "run", "--steps", str(STEPS), *layout)
    losses = [loss for _, loss in history]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=0)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("stage", ["1", "2"])
def test_gpt_zero_matches_one_process_and_resumes(tmp_path, reference, stage):
    """ZeRO stages 1 and 2 over the data-parallel group of tp 2 x dp 2: the
    same losses as one process (as --zero-stage 0 is; stage 2 within 1e-5 of
    --zero-stage 0's), and a resume from its sharded optimizer state
    continues the run exactly, also at another data-parallel size."""
    plain = ("--tensor-parallel", "2", "--pipeline-parallel", "1")
    layout = (*plain, "--zero-stage", stage)
    history = _run_job(tmp_path, "zero", "--steps", str(STEPS), *layout)
    torch.testing.assert_close(
        torch.tensor([v for _, v in history]), torch.tensor(reference), rtol=1e-4, atol=0
    )
    if stage == "2":
        stage0 = _run_job(tmp_path, "zero0", "--steps", str(STEPS), *plain)
        _assert_same_losses(history, stage0, rtol=1e-5)
    ckpt = tmp_path / "zckpt"
    _run_job(tmp_path, "zfirst", "--steps", "5", "--save", str(ckpt), *layout)
    resumed = _run_job(tmp_path, "zresumed", "--steps", str(STEPS), "--resume", str(ckpt), *layout)
    _assert_same_losses(resumed, history, rtol=1e-6)
    # At another data-parallel size (2 ranks: tp 2 x dp 1) the optimizer
    # state is resharded from both saved replicas' shards.
    dp1 = _run_job(tmp_path, "zdp1", "--steps", str(STEPS), "--resume", str(ckpt), *layout, nproc=2)
    assert [s for s, _ in dp1] == list(range(1, STEPS + 1))
    _assert_same_losses(dp1, history, rtol=1e-5)


def test_gpt_checkpointing_matches(tmp_path, reference):
    history = _run_job(tmp_path, "ckpt", "--steps", "4", "--checkpoint-activations")
    torch.testing.assert_close(
        torch.tensor([v for _, v in history]), torch.tensor(reference[:4]), rtol=1e-4, atol=0
    )


def test_gpt_resume_equals_uninterrupted_run(tmp_path):
    whole = _run_job(tmp_path, "whole", "--steps", "6")
    ckpt = tmp_path / "ckpt"
    _run_job(tmp_path, "first", "--steps", "3", "--save", str(ckpt))
    resumed = _run_job(tmp_path, "resumed", "--steps", "6", "--resume", str(ckpt))
    assert [s for s, _ in resumed] == [1, 2, 3, 4, 5, 6]
    _assert_same_losses(resumed, whole, rtol=1e-6)
    refused = _torchrun(
        "train_gpt.py",
        *SMALL,
        *("--steps", "6", "--resume", str(ckpt), "--tensor-parallel", "1"),
        nproc=4,
        check=False,
    )
    assert refused.returncode != 0
    assert "saved with layout {'tp': 2, 'pp': 2, 'dp': 1, 'ep': 1, 'cp': 1}" in refused.stderr
    needed = "Resharding works for the data-parallel size with --zero-stage 1 or 2 (and no"
    assert needed in refused.stderr


# ------------------------------------------------------------------ layout


def _layout_body(rank, world):
    state = dsparallel.init_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (state.tp_size, state.pp_size, state.dp_size) == (2, 2, 1)
    # (pp, dp, tp) row-major: tensor-parallel ranks are adjacent.
    assert dist.get_process_group_ranks(state.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(state.pp_group) == [rank % 2, rank % 2 + 2]
    assert (state.tp_rank, state.pp_rank, state.dp_rank) == (rank % 2, rank // 2, 0)
    assert state.mesh.mesh_dim_names == ("pp", "dp", "tp")
    # The tensor-parallel layers now default to the tp group.
    layer = dsparallel.tensor_parallel.ColumnParallelLinear(4, 8)
    assert layer.tp_size == 2 and layer.weight.shape == (4, 4)
    with pytest.raises(RuntimeError, match="already called"):
        dsparallel.init_parallel(2)
    dsparallel.destroy_parallel()
    assert dist.is_initialized()  # it did not create the default group
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by .* \(3\) x .* = 3"):
        dsparallel.init_parallel(tensor_parallel_size=3)
    state = dsparallel.init_parallel(tensor_parallel_size=1, pipeline_parallel_size=1)
    assert state.dp_size == 4
    dsparallel.destroy_parallel()
    return True


def test_init_parallel_layout():
    run_ranks(_layout_body, 4)


def _cp_gradients_body(rank, world, mode):
    """One step of the GPT at tp 2 x cp 2 on fp64, every parameter's
    gradient (tensor-parallel shards put back together through the
    layers' checkpoint specs, context-parallel parts summed as DDP's
    reduction over dp x cp would) against the same model in one process on
    the whole sequences: the largest difference relative to the gradient's
    largest value, per tensor, and the two losses."""
    from dsparallel.context_parallel import shard_sequence
    from dsparallel.models import GPTConfig, build_stage, gpt_loss
    from dsparallel.models.checkpoint_io import _assemble
    from dsparallel.models.hf_map import specs_of, split

    solo = [dist.new_group([r]) for r in range(world)][rank]
    state = dsparallel.init_parallel(2, 1, context_parallel_size=2)
    cfg = GPTConfig(seq_len=32, hidden=64, heads=4, layers=2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=g)
    target = torch.randint(0, cfg.vocab_size, (4, 32), generator=g)

    def grads(module, group, cp):
        module.double()
        x, y = ids, target
        if cp is not None:
            x, y = shard_sequence(ids, cp), shard_sequence(target, cp)
        loss = gpt_loss(group)(module(x), y)
        loss.backward()
        params = dict(module.named_parameters())
        if cp is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=cp)
            loss /= cp.size()
            for p in params.values():
                dist.all_reduce(p.grad, group=cp)
                p.grad /= cp.size()
        blocks = [
            (piece, block.detach().clone())
            for name, node in specs_of(module).items()
            for piece, block in split(node, params[name].grad)
        ]
        return loss.item(), blocks

    ref_loss, ref_blocks = grads(build_stage(cfg, group=solo), solo, None)
    ref = _assemble([ref_blocks])
    module = build_stage(
        cfg, group=state.tp_group, context_parallel_group=state.cp_group, cp_mode=mode
    )
    loss, blocks = grads(module, state.tp_group, state.cp_group)
    everyone = [None] * world
    dist.all_gather_object(everyone, blocks)
    got = _assemble(everyone)
    assert set(got) == set(ref)
    worst = {k: ((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}
    dsparallel.destroy_parallel()
    return {"loss": loss, "ref_loss": ref_loss, "worst": worst}


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_gpt_context_parallel_gradients_match_one_process(mode):
    for got in run_ranks(_cp_gradients_body, 4, mode, init=True, timeout=120):
        assert abs(got["loss"] - got["ref_loss"]) < 1e-12, got["loss"]
        assert len(got["worst"]) == 2 + 2 * 12 + 3, sorted(got["worst"])
        for key, rel in got["worst"].items():
            assert rel < 1e-10, f"{key}: off by {rel:.3g} of its largest value"


def _cp_bad_layout_body(rank, world):
    from dsparallel.models import GPTConfig, build_stage

    errors = []
    try:
        dsparallel.init_parallel(1, 1, context_parallel_size=3)
    except ValueError as e:
        errors.append(str(e))
    state = dsparallel.init_parallel(1, 1, context_parallel_size=2)
    try:  # 3 heads over 2 ranks
        build_stage(
            GPTConfig(hidden=48, heads=3, layers=1),
            context_parallel_group=state.cp_group,
            cp_mode="ulysses",
        )
    except ValueError as e:
        errors.append(str(e))
    dsparallel.destroy_parallel()
    return errors


def test_gpt_context_parallel_bad_layout_is_refused_on_every_rank():
    for errors in run_ranks(_cp_bad_layout_body, 2, timeout=60):
        assert len(errors) == 2, errors
        assert "context_parallel_size (3) = 3" in errors[0]
        assert "Ulysses splits this rank's 3 heads over the 2 context-parallel ranks" in errors[1]
