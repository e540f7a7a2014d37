"""The conditions of a real run, each held against something we did not
write: labels with -100 spread unevenly over micro-batches, accumulation
steps and data-parallel ranks (``transformers``' loss on the whole batch),
tied embeddings over pipeline stages under every ZeRO stage
(``transformers``' AdamW steps in one process), a bf16 run resumed from a
checkpoint (the same run uninterrupted), and configs whose fields are null
(``transformers``' own config of what we save).

Tolerances: fp64 runs agree to 1e-6 relative (rounding order only); the
resumed bf16 losses are bit-equal.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from dist_utils import run_ranks
from test_models import DEEPSEEK  # the tiny DeepSeek-V3 the model tests use

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP64_TOL = 1e-6  # of the largest element of the tensor compared


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= FP64_TOL * scale, f"{what}: off by {err:.3g} (largest element {scale:.3g})"


LLAMA = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
BATCH, SEQ = 4, 12


def _save_hf(path: str, **overrides) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    values = {k: v for k, v in {**LLAMA, **overrides}.items() if k != "model_type"}
    LlamaForCausalLM(LlamaConfig(**values)).save_pretrained(path)


def _hf_fp64(path: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float64)


def _whole_batch_loss(hf, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``transformers``' causal LM loss on the whole batch (shifted labels,
    -100 ignored, the mean over the rest), kept in fp64: its own loss
    function casts the logits to fp32 first."""
    logits = hf(ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


def _by_value(tensors: dict) -> dict:
    """Tensors as numpy arrays: what a rank returns travels by value (a
    tensor would travel as shared memory the exiting rank takes away)."""
    return {k: v.detach().numpy() for k, v in tensors.items()}


def _uneven_labels() -> tuple[torch.Tensor, torch.Tensor]:
    """ids [4, 12] and labels where rows 0-1 (the first micro-batch, or
    the first rank's rows) keep 5 labels and rows 2-3 keep every one."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100
    labels[1, 3:] = -100
    return ids, labels


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("llama"))
    _save_hf(path)
    return path


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    """Four layers: one for each stage at two stages a rank on two ranks."""
    pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("llama4"))
    _save_hf(path, num_hidden_layers=4)
    return path


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("llama_tied"))
    _save_hf(path, tie_word_embeddings=True)
    return path


# ------------------------------------------------------------ per-token loss


# Two stages a rank: "pp-<schedule>" runs it (DualPipeV over 4
# micro-batches, a row each; the others over 2).
MULTI_STAGE = {"pp-zbv": "zbv", "pp-dualpipev": "dualpipev", "pp-interleaved": "interleaved_1f1b"}


def _per_token_body(rank, world, path, layout):
    """One step of the uneven batch at ``layout``: "pp" (2 stages, 2
    micro-batches under 1F1B), "dp-accum" (2 data-parallel ranks, each
    accumulating its 2 rows as 2 steps under no_sync), "pp-dp" (both), or a
    schedule of ``MULTI_STAGE`` at pp 2; returns the loss this rank reports
    and every gradient."""
    import contextlib

    import torch.distributed as dist

    import dsparallel
    from dsparallel.models import from_pretrained
    from dsparallel.train.step import pipeline_schedule, stage_layout

    ids, labels = _uneven_labels()
    pp = 2 if layout.startswith("pp") else 1
    schedule_name = MULTI_STAGE.get(layout, "1f1b")
    per_rank, placement = stage_layout(schedule_name)
    state = dsparallel.init_parallel(1, pp)
    model = from_pretrained(
        path, state, dtype=torch.float64, stages_per_rank=per_rank, stage_placement=placement
    )
    dp = state.dp_size
    rows, rlabels = ids.chunk(dp)[state.dp_rank], labels.chunk(dp)[state.dp_rank]
    loss = None
    if pp > 1:

        def wrap(module):
            return dsparallel.DistributedDataParallel(module, process_group=state.dp_group)

        stages = model.pipeline_stages(wrap=wrap if dp > 1 else None)
        micro = 4 if schedule_name == "dualpipev" else 2
        schedule = pipeline_schedule(schedule_name, stages, micro, model.loss_fn)
        losses = []
        if model.is_first:
            schedule.step(rows, target=rlabels if model.is_last else None, losses=losses)
        else:
            schedule.step(target=rlabels, losses=losses)
        if model.is_last:
            loss = torch.stack(losses).mean()
    else:
        ddp = dsparallel.DistributedDataParallel(model)
        steps = list(zip(rows.chunk(2), rlabels.chunk(2)))
        n = model.count_items([lab for _, lab in steps])
        loss = 0
        for i, (x, lab) in enumerate(steps):
            with contextlib.nullcontext() if i == len(steps) - 1 else ddp.no_sync():
                part = ddp(x, labels=lab, num_items_in_batch=n).loss
                part.backward()
                loss = loss + part.detach()
    if loss is not None and dp > 1:  # the reported loss: its mean over the replicas
        group = dsparallel.get_parallel_state().dp_group
        dist.all_reduce(loss, group=group)
        loss /= dp
    grads = _by_value(model.hf_state_dict(grads=True))
    dsparallel.destroy_parallel()
    return (None if loss is None else loss.item()), grads


@pytest.mark.parametrize(
    "layout,world",
    [("pp", 2), ("dp-accum", 2), ("pp-dp", 4), *((k, 2) for k in MULTI_STAGE)],
)
def test_per_token_loss_equals_the_whole_batch_loss(llama_dir, llama4_dir, layout, world):
    if layout in MULTI_STAGE:
        llama_dir = llama4_dir
    ids, labels = _uneven_labels()
    hf = _hf_fp64(llama_dir)
    whole = _whole_batch_loss(hf, ids, labels)
    whole.backward()
    expected = {n: p.grad for n, p in hf.named_parameters()}
    # The bug this guards against, the mean of the two halves' means, is
    # far outside the tolerance.
    halves = [_whole_batch_loss(hf, i, lab).item() for i, lab in zip(ids.chunk(2), labels.chunk(2))]
    assert abs(sum(halves) / 2 - whole.item()) > 1e-3
    results = run_ranks(_per_token_body, world, llama_dir, layout, timeout=240)
    reported = [loss for loss, _ in results if loss is not None]
    assert reported
    for loss in reported:
        assert abs(loss - whole.item()) <= 1e-6 * abs(whole.item()), (loss, whole.item())
    grads = {k: torch.from_numpy(v) for k, v in results[0][1].items()}
    assert grads.keys() == expected.keys()
    for name, g in grads.items():
        _assert_close(g, expected[name], f"gradient of {name}")


# ------------------------------------------------------- tied x pp x ZeRO


TIED_STEPS, TIED_LR = 3, 1e-2


def _tied_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 96, (8, SEQ), generator=g) for _ in range(TIED_STEPS)]


def _tied_body(rank, world, path, zero):
    """3 AdamW steps at pp 2 x dp 2 as the trainer's step trains (our DDP
    around each stage, ZeRO ``zero``), or at dp 4 under torch's FSDP2
    ("fsdp": the one tied tensor sharded; FSDP2 under a pipeline is
    refused, ``test_fsdp2_under_a_pipeline_is_refused``); the whole
    model's weights after them."""
    from train_steps import make_trainer

    import dsparallel
    from dsparallel.models import from_pretrained

    pp = 1 if zero == "fsdp" else 2
    state = dsparallel.init_parallel(1, pp)
    model = from_pretrained(path, state, dtype=torch.float64)
    if zero == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=state.mesh["dp"])
        fully_shard(model, mesh=state.mesh["dp"])
        zero = 0
    trainer = make_trainer(model, state, zero, micro_batches=2, lr=TIED_LR)
    for batch in _tied_batches():
        trainer.step(batch.chunk(state.dp_size)[state.dp_rank])
    if pp == 1:  # FSDP2: every module's parameters whole
        for module in model.modules():
            if hasattr(module, "unshard"):
                module.unshard()
    weights = _by_value(model.hf_state_dict())
    dsparallel.destroy_parallel()
    return weights


@pytest.mark.parametrize("zero", [0, 1, 2, "fsdp"])
def test_tied_embeddings_train_as_transformers_under_every_zero_stage(tied_dir, zero):
    hf = _hf_fp64(tied_dir)
    opt = torch.optim.AdamW(hf.parameters(), lr=TIED_LR)
    for batch in _tied_batches():
        _whole_batch_loss(hf, batch, batch).backward()
        opt.step()
        opt.zero_grad()
    expected = {k: v.detach() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    weights = run_ranks(_tied_body, 4, tied_dir, zero, timeout=240)[0]
    weights = {k: torch.from_numpy(v) for k, v in weights.items()}
    assert weights.keys() == expected.keys()
    for name, w in weights.items():
        _assert_close(w, expected[name], f"{name} (ZeRO {zero})")


def _fsdp_pipeline_body(rank, world, path):
    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(1, 2)
    model = from_pretrained(path, state)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=state.mesh["dp"])
    try:
        model.pipeline_stage()
    except NotImplementedError as e:
        return str(e)
    finally:
        dsparallel.destroy_parallel()


def test_fsdp2_under_a_pipeline_is_refused(tied_dir):
    for message in run_ranks(_fsdp_pipeline_body, 4, tied_dir, timeout=120):
        assert message and "FSDP2" in message and "zero_stage=2" in message


# ------------------------------------------------------------ clipping


MAX_NORM = 0.05  # well below the batch's gradient norm: it clips


def _clip_body(rank, world, path, tp, pp, zero):
    """One backward of the clip batch at (tp, pp, dp = the rest), ZeRO
    ``zero``; the model's norm before clipping and after it, and (without
    ZeRO-2, which keeps no .grad) the clipped gradients."""
    from train_steps import make_trainer

    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(tp, pp)
    model = from_pretrained(path, state, dtype=torch.float64)
    trainer = make_trainer(model, state, zero, micro_batches=2, lr=1e-2)
    trainer.backward(_tied_batches()[0].chunk(state.dp_size)[state.dp_rank])
    model.allreduce_tied_grads()
    opt = trainer.opt if zero else None
    total = model.clip_grad_norm_(MAX_NORM, optimizer=opt).item()
    after = model.clip_grad_norm_(float("inf"), optimizer=opt).item()
    grads = None if zero == 2 else _by_value(model.hf_state_dict(grads=True))
    dsparallel.destroy_parallel()
    return total, after, grads


CLIPS = [
    # (model, tp, pp, zero) at 4 processes; tp 4 replicates Llama's 2 key/value heads
    ("tied", 2, 2, 1),
    ("tied", 1, 2, 2),
    ("llama", 4, 1, 0),
    ("llama", 2, 1, 2),
    # ZeRO-1 at dp 4: every rank keeps every whole .grad, and counts only its slices
    ("llama", 1, 1, 1),
]


@pytest.mark.parametrize(
    "kind,tp,pp,zero", CLIPS, ids=[f"{k}-tp{t}-pp{p}-zero{z}" for k, t, p, z in CLIPS]
)
def test_clipping_uses_the_whole_models_norm(llama_dir, tied_dir, kind, tp, pp, zero):
    path = tied_dir if kind == "tied" else llama_dir
    batch = _tied_batches()[0]
    hf = _hf_fp64(path)
    _whole_batch_loss(hf, batch, batch).backward()
    expected = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM).item()
    assert expected > 2 * MAX_NORM
    clipped = {n: p.grad for n, p in hf.named_parameters()}
    for total, after, grads in run_ranks(_clip_body, 4, path, tp, pp, zero, timeout=240):
        assert abs(total - expected) <= 1e-6 * expected, (total, expected)
        want = MAX_NORM * expected / (expected + 1e-6)  # torch's guard against zero
        assert abs(after - want) <= 1e-6 * want, (after, want)
        for name, g in (grads or {}).items():
            _assert_close(torch.from_numpy(g), clipped[name], f"clipped gradient of {name}")


# ------------------------------------------------------------ bf16 resume


RESUME_STEPS = 3  # before and after the checkpoint


def _bf16_run(path, tp, pp, zero, batches, ckpt=None, load=False, mixed=False):
    """The losses of ``batches`` trained in bf16 (pure, or ``mixed`` with
    float32 masters) at (tp, pp, dp = the rest) with ZeRO ``zero`` (0:
    torch's AdamW); saves a checkpoint after them (``ckpt``) or loads one
    before them (``load``)."""
    from train_steps import make_trainer

    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(tp, pp)
    if mixed:
        model = from_pretrained(path, state, mixed_precision=dsparallel.MixedPrecision())
    else:
        model = from_pretrained(path, state, dtype=torch.bfloat16)
    trainer = make_trainer(model, state, zero, micro_batches=2, lr=1e-2)
    if load:
        dsparallel.load_checkpoint(ckpt, model, trainer.opt)
    losses = []
    for batch in batches:
        mine = trainer.step(batch.chunk(state.dp_size)[state.dp_rank])
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, [v.item() for v in mine])
        losses.append([v for vs in every for v in vs])
    if ckpt is not None and not load:
        dsparallel.save_checkpoint(ckpt, model, trainer.opt)
    dsparallel.destroy_parallel()
    return losses


def _bf16_resume_body(rank, world, path, tp, pp, zeros, root):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 96, (8, SEQ), generator=g) for _ in range(2 * RESUME_STEPS)]
    out = {}
    for zero in zeros:
        for mixed in (False, True):
            run = functools.partial(_bf16_run, path, tp, pp, zero, mixed=mixed)
            ckpt = os.path.join(root, f"ckpt-{zero}-{mixed}")
            whole = run(batches)
            first = run(batches[:RESUME_STEPS], ckpt)
            dist.barrier()
            resumed = run(batches[RESUME_STEPS:], ckpt, load=True)
            out["mixed" if mixed else "pure", zero] = whole, first + resumed
    return out


@pytest.mark.parametrize(
    "tp,pp,zeros", [(2, 1, (0, 1, 2)), (1, 2, (1, 2)), (1, 1, (1, 2))], ids=["tp2", "pp2", "dp4"]
)
def test_bf16_resume_continues_bit_for_bit(llama_dir, tmp_path, tp, pp, zeros):
    out = run_ranks(_bf16_resume_body, 4, llama_dir, tp, pp, zeros, str(tmp_path), timeout=300)[0]
    for (kind, zero), (whole, resumed) in out.items():
        assert whole == resumed, f"{kind} bf16, ZeRO {zero}: resumed {resumed} vs {whole}"
        assert whole[-1] != whole[0]  # it steps


# ------------------------------------------------------------ mixed precision

MP_STEPS, MP_LR = 5, 1e-3
# Of the distance the reference's weights moved in MP_STEPS: one process's
# bf16 compute differs from ours by rounding order (0.03 over the whole
# model, 0.06 for the worst tensor, in one process); pure bf16, whose norm
# weights do not move at all (their updates are under half a bf16 step),
# is 0.08 and 1.0.
MP_TOL_MODEL, MP_TOL_TENSOR = 0.1, 0.25
MP_LAYOUTS = {  # name: (model, tp, pp, ep, cp, zero, model kwargs)
    "dp2-zero0": ("llama", 1, 1, 1, 1, 0, {}),
    "dp2-zero1": ("llama", 1, 1, 1, 1, 1, {}),
    "dp2-zero2": ("llama", 1, 1, 1, 1, 2, {}),
    "tp2-sp": ("llama", 2, 1, 1, 1, 0, {"sequence_parallel": True}),
    "pp2-recompute": ("llama", 1, 2, 1, 1, 0, {"checkpoint": True}),
    "cp2": ("llama", 1, 1, 1, 2, 0, {}),
    "dp2-zero2-reduce-bf16": ("llama", 1, 1, 1, 1, 2, {"reduce_dtype": torch.bfloat16}),
    # The all-gather of a step's parameters overlapping the next forward.
    "dp2-zero2-overlap": ("llama", 1, 1, 1, 1, 2, {"overlap_param_gather": True}),
    "ep2-zero1": ("deepseek", 1, 1, 2, 1, 1, {}),
    "deepseek-dp2-zero0": ("deepseek", 1, 1, 1, 1, 0, {}),
    "deepseek-dp2-zero2": ("deepseek", 1, 1, 1, 1, 2, {}),
    "deepseek-tp2-sp": ("deepseek", 2, 1, 1, 1, 0, {"sequence_parallel": True}),
    "deepseek-pp2-recompute": ("deepseek", 1, 2, 1, 1, 0, {"checkpoint": True}),
    "deepseek-cp2": ("deepseek", 1, 1, 1, 2, 1, {}),
    # The routed experts split over the two tensor-parallel ranks.
    "deepseek-tp2-ep2-over-tp": ("deepseek", 2, 1, 2, 1, 0, {"experts_over_tp": True}),
    "deepseek-tp2-sp-ep2-over-tp": (
        "deepseek",
        2,
        1,
        2,
        1,
        0,
        {"experts_over_tp": True, "sequence_parallel": True},
    ),
    # torch's FSDP2 over "dsp" with torch's own MixedPrecisionPolicy.
    "fsdp2-torch-policy": ("llama", 1, 1, 1, 1, 0, {"fsdp": True}),
    # Two stages per rank (four layers): in a V under ZBV (whose backward
    # splits input and weight gradients) and DualPipeV, looped under
    # interleaved 1F1B.
    "pp2-zbv": ("llama4", 1, 2, 1, 1, 0, {"schedule": "zbv"}),
    "pp2-dualpipev": ("llama4", 1, 2, 1, 1, 0, {"schedule": "dualpipev"}),
    "pp2-interleaved": ("llama4", 1, 2, 1, 1, 0, {"schedule": "interleaved_1f1b"}),
}
# The model tests' DeepSeek-V3 with four experts and default RoPE: with
# eight experts (or YaRN) a rarely chosen expert's (or a norm's) distance
# from the reference comes near the bound, a matter of which tokens bf16
# rounding routes where.
MP_DEEPSEEK = {k: v for k, v in DEEPSEEK.items() if k != "rope_parameters"}
MP_DEEPSEEK["n_routed_experts"] = 4


def _mp_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 96, (BATCH, SEQ), generator=g) for _ in range(MP_STEPS)]


def _by_hand(hf) -> dict[str, torch.Tensor]:
    """Trains ``hf`` (float32) MP_STEPS AdamW steps with bf16 compute and
    float32 masters, written out: before each step the masters are rounded
    into a bf16 copy (DeepSeek's router weight, which transformers computes
    in float32, stays float32), its loss on the whole batch is
    back-propagated in bf16, and the bf16 gradients step the masters.
    DeepSeek-V3's correction bias (float32 too) then moves by the paper's
    rule: + 0.001 * sign(mean load - load), the load read from the
    router's choices."""
    import copy

    work = copy.deepcopy(hf).to(torch.bfloat16)
    gates, chosen = {}, {}
    for name, module in work.named_modules():
        if name.endswith("mlp.gate"):
            module.float()  # its weight and correction bias
            gates[name] = module, hf.get_submodule(name)
            module.register_forward_hook(
                lambda mod, args, out, name=name: chosen.__setitem__(name, out[2])
            )
    opt = torch.optim.AdamW(hf.parameters(), lr=MP_LR)
    for batch in _mp_batches():
        with torch.no_grad():
            for w, m in zip(work.parameters(), hf.parameters()):
                w.copy_(m)
        chosen.clear()
        work(batch, labels=batch).loss.backward()
        for w, m in zip(work.parameters(), hf.parameters()):
            m.grad, w.grad = w.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, (gate, master) in gates.items():
                idx = chosen[name]
                load = torch.bincount(idx.flatten(), minlength=gate.num_experts).float()
                gate.e_score_correction_bias += 1e-3 * torch.sign(load.mean() - load)
                master.e_score_correction_bias.copy_(gate.e_score_correction_bias)


def _mp_body(rank, world, paths, layouts):
    """MP_STEPS AdamW steps of bf16 mixed precision at each layout (as
    the trainer's step trains); the float32 masters after them."""
    from train_steps import make_trainer

    import dsparallel
    from dsparallel.models import from_pretrained
    from dsparallel.train.step import stage_layout

    out = {}
    for name in layouts:
        kind, tp, pp, ep, cp, zero, kwargs = MP_LAYOUTS[name]
        kwargs = dict(kwargs)
        state = dsparallel.init_parallel(
            tp,
            pp,
            expert_parallel_size=ep,
            context_parallel_size=cp,
            experts_over_tp=kwargs.pop("experts_over_tp", False),
        )
        policy = dsparallel.MixedPrecision(reduce_dtype=kwargs.pop("reduce_dtype", torch.float32))
        fsdp = kwargs.pop("fsdp", False)
        overlap = kwargs.pop("overlap_param_gather", False)
        schedule = kwargs.pop("schedule", "1f1b")
        per_rank, placement = stage_layout(schedule, 0)
        kwargs.update(stages_per_rank=per_rank, stage_placement=placement)
        if fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            model = from_pretrained(paths[kind], state, dtype=torch.float32)
            torch_policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
            for layer in model.layers.values():
                fully_shard(layer, mesh=state.mesh["dp"], mp_policy=torch_policy)
            fully_shard(model, mesh=state.mesh["dp"], mp_policy=torch_policy)
        else:
            model = from_pretrained(paths[kind], state, mixed_precision=policy, **kwargs)
            assert model.precision == "mixed bfloat16 (float32 masters)"
        options = {"overlap_param_gather": True} if overlap else {}
        if pp > 1:
            options["schedule"] = schedule
        micro = 4 if schedule == "dualpipev" else 2  # DualPipeV: 2 per rank and direction
        trainer = make_trainer(model, state, zero, micro_batches=micro, lr=MP_LR, **options)
        assert all(ddp.mixed_precision == policy for ddp in trainer.ddps)
        computed = set()  # the dtype each decoder layer computed in
        hooks = [
            layer.register_forward_hook(lambda m, i, o, seen=computed: seen.add(o.dtype))
            for layer in model.layers.values()
        ]
        for batch in _mp_batches():
            trainer.step(batch.chunk(state.dp_size)[state.dp_rank])
        assert computed == {torch.bfloat16}, (name, computed)
        for hook in hooks:
            hook.remove()
        for ddp in trainer.ddps:
            ddp.wait_param_gather()
        if fsdp:  # the float32 shards, whole, in a model without FSDP2
            whole = from_pretrained(paths[kind], state, dtype=torch.float32)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    whole.get_parameter(n).copy_(p.full_tensor())
            model = whole
        out[name] = _by_value(model.hf_state_dict())
        dsparallel.destroy_parallel()
    return out


def _distance(got: dict, want: dict, start: dict) -> tuple[float, str, float]:
    """(over the whole model, the worst tensor, its distance): how far
    ``got`` is from ``want``, in units of how far ``want`` moved from
    ``start``."""
    num = sum(((got[k] - want[k]) ** 2).sum() for k in want)
    den = sum(((want[k] - start[k]) ** 2).sum() for k in want)
    each = {k: ((got[k] - want[k]).norm() / (want[k] - start[k]).norm()).item() for k in want}
    worst = max(each, key=each.get)
    return (num / den).sqrt().item(), worst, each[worst]


@pytest.fixture(scope="module")
def mp_reference(llama_dir, tmp_path_factory):
    """Per model: its checkpoint, its weights, and its weights after the
    steps by hand."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("deepseek"))
    torch.manual_seed(3)
    DeepseekV3ForCausalLM(DeepseekV3Config(**MP_DEEPSEEK)).save_pretrained(path)
    four = str(tmp_path_factory.mktemp("llama4"))
    _save_hf(four, num_hidden_layers=4)  # a layer for each of four stages
    out = {}
    for kind, cls, where in (
        ("llama", LlamaForCausalLM, llama_dir),
        ("llama4", LlamaForCausalLM, four),
        ("deepseek", DeepseekV3ForCausalLM, path),
    ):
        hf = cls.from_pretrained(where, dtype=torch.float32)
        _by_hand(hf)
        after = str(tmp_path_factory.mktemp(f"{kind}_after"))
        hf.save_pretrained(after)
        # Under checkpoint names (transformers stacks experts in memory).
        out[kind] = where, _safetensors(where), _safetensors(after)
    return out


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}


def test_mixed_precision_steps_as_masters_by_hand_at_every_layout(mp_reference):
    paths = {kind: where for kind, (where, _, _) in mp_reference.items()}
    got = run_ranks(_mp_body, 2, paths, list(MP_LAYOUTS), timeout=400)[0]
    for name, weights in got.items():
        _, start, want = mp_reference[MP_LAYOUTS[name][0]]
        want = {k: v for k, v in want.items() if k in weights}  # a tied head: once
        assert weights.keys() == want.keys(), name
        weights = {k: torch.from_numpy(v).float() for k, v in weights.items()}
        assert all(w.dtype == torch.float32 for w in weights.values())
        whole, worst, off = _distance(weights, want, start)
        print(f"{name}: {whole:.3f} over the model, {off:.3f} for {worst}")
        assert whole <= MP_TOL_MODEL and off <= MP_TOL_TENSOR, (name, whole, worst, off)


def _plain_module_body(rank, world):
    """A module of the user's own under our DDP with ZeRO-2 and a policy,
    3 SGD steps on half the batch each, against the same module under the
    same policy in this process on the whole batch: how far apart, in units
    of how far the weights moved."""
    import copy

    import dsparallel
    from dsparallel.mixed_precision import apply

    policy = dsparallel.MixedPrecision()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)
    ).bfloat16()  # upcast exactly by the policy
    ref = apply(copy.deepcopy(net), policy)
    start = [p.detach().clone() for p in ref.parameters()]
    model = dsparallel.DistributedDataParallel(net, zero_stage=2, mixed_precision=policy)
    opt = dsparallel.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        out = model(x.chunk(world)[rank])  # a float32 input, cast by the policy
        (out.float() - y.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        (ref(x).float() - y).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert out.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in net.parameters())
    moved = sum(((r - s) ** 2).sum() for r, s in zip(ref.parameters(), start)).sqrt()
    off = sum(((p - r) ** 2).sum() for p, r in zip(net.parameters(), ref.parameters())).sqrt()
    return (off / moved).item()


def test_our_ddp_puts_a_plain_module_under_the_policy():
    for off in run_ranks(_plain_module_body, 2):
        assert off <= 0.02, off


def _loss_curve(path: str, steps: int, **kwargs) -> list[float]:
    from dsparallel.models import from_pretrained

    model = from_pretrained(path, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=MP_LR)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 96, (16, SEQ), generator=g)  # a small corpus, learned
    losses = []
    for step in range(steps):
        batch = ids[(step % 4) * 4 :][:4]
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_mixed_precision_follows_the_float32_loss_curve(llama_dir):
    """50 steps: the float32 masters keep the float32 run's losses within
    1%; they train (the curve falls by a third)."""
    import dsparallel

    fp32 = _loss_curve(llama_dir, 50, dtype=torch.float32)
    mixed = _loss_curve(llama_dir, 50, mixed_precision=dsparallel.MixedPrecision())
    assert fp32[-1] < 0.67 * fp32[0]
    worst = max(abs(m / f - 1) for m, f in zip(mixed, fp32))
    assert worst <= 0.01, (worst, mixed, fp32)


def test_mixed_precision_policies_and_their_errors(llama_dir):
    import dsparallel
    from dsparallel.mixed_precision import apply, compute_dtype
    from dsparallel.models import Llama, from_pretrained

    with pytest.raises(ValueError, match="param_dtype"):
        dsparallel.MixedPrecision(param_dtype=torch.float32)
    with pytest.raises(ValueError, match="mixed_precision keeps float32 master"):
        from_pretrained(
            llama_dir, dtype=torch.bfloat16, mixed_precision=dsparallel.MixedPrecision()
        )
    pure = from_pretrained(llama_dir, dtype=torch.bfloat16)
    assert pure.precision == "pure bfloat16"
    policy = dsparallel.MixedPrecision()
    apply(pure, policy)  # a bf16 model put under a policy: its weights upcast exactly
    assert pure.precision.startswith("mixed") and compute_dtype(pure) == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in pure.parameters())
    apply(pure, policy)  # the same policy again: nothing
    with pytest.raises(ValueError, match="already under"):
        apply(pure, dsparallel.MixedPrecision(reduce_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="loss scaler"):
        dsparallel.MixedPrecision(param_dtype=torch.float16)
    model = Llama(dict(LLAMA, tie_word_embeddings=True), mixed_precision=policy)
    ids = torch.randint(0, 96, (2, SEQ))
    out = model(ids, labels=ids, return_logits=True)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    out.loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    # Outside a forward, module.weight is the master again.
    assert model.embed_tokens.weight is dict(model.named_parameters())["embed_tokens.weight"]
    with pytest.raises(IndexError):
        model(torch.full((2, SEQ), 500))  # past the vocabulary: the embedding raises
    assert "weight" not in model.embed_tokens.__dict__
    for module in model.modules():
        for name in getattr(module, "_dsp_cast", ((), None))[0]:
            assert name not in module.__dict__, name


# ------------------------------------------------------------ vocabulary padding

ODD_VOCAB = 97  # prime: no tensor-parallel size divides it
PAD_LAYOUTS = [("tp2", 2, False), ("tp4", 4, False), ("tp4-tied", 4, True)]


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    """Per tying: the checkpoint of a Llama whose vocabulary is 97, and
    transformers' logits, loss and gradients (fp64) of a batch with -100
    labels, and its greedy continuation of the batch (5 tokens)."""
    pytest.importorskip("transformers")
    ids, labels = _uneven_labels()
    ids = ids * ODD_VOCAB // 96 + 1  # ids up to 96, the last real row
    ref = {}
    for tied in (False, True):
        path = str(tmp_path_factory.mktemp(f"vocab97-{tied}"))
        _save_hf(path, vocab_size=ODD_VOCAB, tie_word_embeddings=tied)
        hf = _hf_fp64(path)
        out = hf(ids)
        loss = _whole_batch_loss(hf, ids, labels)
        loss.backward()
        grads = {n: p.grad for n, p in hf.named_parameters() if n != "lm_head.weight" or not tied}
        new = ids
        with torch.no_grad():
            for _ in range(5):
                new = torch.cat([new, hf(new).logits[:, -1:].argmax(-1)], 1)
        ref[tied] = path, out.logits.detach(), loss.detach(), grads, new
    return ids, labels, ref


def _padded_body(rank, world, ids, labels, paths, root):
    """Per layout: logits, loss and gradients of the batch, the greedy
    continuation, and the weights of a save_pretrained; then a training
    checkpoint saved at tp 4 and loaded at tp 2 x dp 2."""
    import dsparallel
    from dsparallel.inference import generate
    from dsparallel.models import from_pretrained

    out = {}
    for name, tp, tied in PAD_LAYOUTS:
        state = dsparallel.init_parallel(tp, 1)
        model = from_pretrained(paths[tied], state, dtype=torch.float64)
        assert model.padded_vocab == tp * 64 * -(-ODD_VOCAB // (tp * 64))
        logits = model(ids).logits
        result = model(ids, labels=labels)
        result.loss.backward()
        grads = model.hf_state_dict(grads=True)
        continued = generate(model, ids, max_new_tokens=5)
        saved = os.path.join(root, name)
        model.save_pretrained(saved)
        try:  # an id of a padded row
            model(torch.full((1, SEQ), ODD_VOCAB))
            bad = None
        except IndexError as e:
            bad = str(e)
        out[name] = {
            "logits": logits.detach().numpy(),
            "loss": result.loss.item(),
            "grads": _by_value(grads),
            "generated": continued.numpy(),
            "bad": bad,
        }
        if name == "tp4":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            opt.step()
            out["stepped"] = _by_value(model.hf_state_dict())
            dsparallel.save_checkpoint(os.path.join(root, "train"), model, opt)
        dsparallel.destroy_parallel()
    state = dsparallel.init_parallel(2, 1)
    model = from_pretrained(paths[False], state, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dsparallel.load_checkpoint(os.path.join(root, "train"), model, opt)
    out["resumed"] = _by_value(model.hf_state_dict())
    dsparallel.destroy_parallel()
    return out


def test_a_vocabulary_tp_does_not_divide_is_padded_and_equals_transformers(odd_vocab, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    ids, labels, ref = odd_vocab
    paths = {tied: path for tied, (path, *_) in ref.items()}
    every = run_ranks(_padded_body, 4, ids, labels, paths, str(tmp_path), timeout=300)
    for out in every:
        for name, _, tied in PAD_LAYOUTS:
            path, logits, loss, grads, generated = ref[tied]
            got = out[name]
            assert got["logits"].shape == (BATCH, SEQ, ODD_VOCAB), name
            _assert_close(torch.from_numpy(got["logits"]), logits, f"{name}: logits")
            assert abs(got["loss"] - loss.item()) <= FP64_TOL * loss.item(), name
            assert got["grads"].keys() == grads.keys(), name
            for k, g in got["grads"].items():
                _assert_close(torch.from_numpy(g), grads[k], f"{name}: gradient of {k}")
            assert (torch.from_numpy(got["generated"]) == generated).all(), name
            assert "token id 97 is outside the vocabulary [0, 97)" in got["bad"], name
        for k, w in out["resumed"].items():
            assert (w == out["stepped"][k]).all(), f"{k}: resumed at tp 2 from tp 4"
    for name, _, tied in PAD_LAYOUTS:
        path = ref[tied][0]
        (shard,) = (tmp_path / name).glob("*.safetensors")
        saved = load_file(str(shard))
        original = load_file(os.path.join(path, "model.safetensors"))
        assert saved.keys() == original.keys(), name
        for k, v in original.items():
            assert saved[k].shape == v.shape and (saved[k] == v).all(), f"{name}: saved {k}"
        LlamaForCausalLM.from_pretrained(str(tmp_path / name))  # loads, vocabulary 97


def test_the_padded_size_is_a_multiple_of_tp_times_64():
    from dsparallel.models.causal_lm import padded_vocab

    assert padded_vocab(97, 1, 64) == 97  # one process: nothing to pad
    assert padded_vocab(96, 2, 64) == 96  # divisible: nothing to pad
    assert padded_vocab(97, 2, 64) == 128
    assert padded_vocab(50257, 8, 64) == 50688
    assert padded_vocab(151665, 4, 64) == 151808
    with pytest.raises(ValueError, match="pad_vocab_to"):
        padded_vocab(97, 2, 0)


def _own_steps_body(rank, world, path, root):
    """3 AdamW steps at tp 2 in which the final norm has no gradient in the
    second: its own step count (2) and the others' (3) come back from a
    checkpoint, and so does each rank's random generator state."""
    import dsparallel
    from dsparallel.models import from_pretrained

    def build():
        state = dsparallel.init_parallel(2, 1)
        model = from_pretrained(path, state)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = build()
    batch = _tied_batches()[0][:2]
    for i in range(3):
        model(batch, labels=batch).loss.backward()
        if i == 1:
            model.norm.weight.grad = None  # torch's AdamW skips it
        opt.step()
        opt.zero_grad()
    steps = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}
    torch.manual_seed(100 + rank)
    dsparallel.save_checkpoint(os.path.join(root, "ckpt"), model, opt)
    drawn = torch.rand(3)
    dsparallel.destroy_parallel()
    model, opt = build()
    torch.manual_seed(0)
    dsparallel.load_checkpoint(os.path.join(root, "ckpt"), model, opt)
    again = torch.rand(3)
    loaded = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}
    dsparallel.destroy_parallel()
    return steps, loaded, drawn.tolist(), again.tolist()


def test_a_checkpoint_keeps_each_parameters_step_and_the_rng(llama_dir, tmp_path):
    for steps, loaded, drawn, again in run_ranks(_own_steps_body, 2, llama_dir, str(tmp_path)):
        assert steps["norm.weight"] == 2.0 and steps["embed_tokens.weight"] == 3.0
        assert loaded == steps
        assert again == drawn


# ------------------------------------------------------------ config round trip


def test_a_saved_config_round_trips_through_transformers(tmp_path):
    """A DeepSeek-V3 without a low-rank q (``q_lora_rank: null``) and
    with null token ids: transformers' config of what we save equals the
    original's field for field, and its model loads our weights with no
    key missing or unexpected."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from dsparallel.models import DeepseekV3

    original = DeepseekV3Config(
        **dict(DEEPSEEK, q_lora_rank=None, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    )
    model = DeepseekV3(original.to_dict())
    model.save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)
    for key in ("q_lora_rank", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert key in saved and saved[key] is None, key
    again = DeepseekV3Config.from_pretrained(str(tmp_path)).to_dict()
    skip = {"architectures", "dtype", "transformers_version", "_name_or_path"}
    want = original.to_dict()
    differ = {
        k for k in want.keys() | again.keys() if k not in skip and want.get(k) != again.get(k)
    }
    assert not differ, {k: (want.get(k), again.get(k)) for k in differ}
    _, info = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_deepseek_defaults_are_transformers_defaults():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config

    from dsparallel.models import DeepseekV3

    theirs = DeepseekV3Config().to_dict()
    for key, value in DeepseekV3.defaults.items():
        assert theirs[key] == value, f"{key}: ours {value}, transformers {theirs[key]}"
    for key in ("n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor"):
        assert key in DeepseekV3.defaults, key


def test_generate_leaves_the_model_as_it_was():
    """generate reads wide weights from column-major copies while it runs;
    the model keeps its own storage (a ZeRO buffer may own it)."""
    from dsparallel.inference import generate
    from dsparallel.models import Llama

    model = Llama(LLAMA)
    before = {
        n: (p.data_ptr(), p.stride(), p.detach().clone()) for n, p in model.named_parameters()
    }
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    first = generate(model, ids, max_new_tokens=4)
    for name, p in model.named_parameters():
        ptr, stride, value = before[name]
        assert p.data_ptr() == ptr and p.stride() == stride, name
        assert torch.equal(p.detach(), value), name
    assert torch.equal(generate(model, ids, max_new_tokens=4), first)


# ------------------------------------------------------------ faults


def _fault_body(rank, world, path, root):
    """pp 2: a full disk on rank 0 while it writes its stage's file of
    ``save_pretrained``, over a complete checkpoint saved before; then a
    training checkpoint loaded into a model with more layers, whose second
    stage's are missing from it. The error each rank raised, per case."""
    import errno

    import safetensors.torch

    import dsparallel
    from dsparallel.models import Llama, from_pretrained

    state = dsparallel.init_parallel(1, 2)
    model = from_pretrained(path, state)
    out = {}
    target = os.path.join(root, "hf")
    model.save_pretrained(target)
    real = safetensors.torch.save_file

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 0:
        safetensors.torch.save_file = full_disk
    try:
        model.save_pretrained(target)
    except Exception as e:  # noqa: BLE001 (the test reads the type)
        out["save_pretrained"] = f"{type(e).__name__}: {e}"
    finally:
        safetensors.torch.save_file = real
    ckpt = os.path.join(root, "train")
    dsparallel.save_checkpoint(ckpt, model)
    deeper = Llama(dict(LLAMA, num_hidden_layers=4), state)
    try:
        dsparallel.load_checkpoint(ckpt, deeper)
    except Exception as e:  # noqa: BLE001
        out["load_checkpoint"] = f"{type(e).__name__}: {e}"
    dsparallel.destroy_parallel()
    return out


def test_a_failing_rank_makes_every_rank_raise_and_keeps_the_previous_checkpoint(
    llama_dir, tmp_path
):
    from safetensors.torch import load_file

    out = run_ranks(_fault_body, 2, llama_dir, str(tmp_path), timeout=120)
    for errors in out:
        assert errors["save_pretrained"].startswith(
            "OSError: save_pretrained failed on rank 0: [Errno 28] No space left on device"
        ), errors
        assert errors["load_checkpoint"].startswith("KeyError"), errors
        assert "load_checkpoint failed on rank 1" in errors["load_checkpoint"], errors
        assert "model.layers.2." in errors["load_checkpoint"], errors
    # The checkpoint saved before the failure is whole and loads.
    saved = tmp_path / "hf"
    assert not list(saved.glob("*.partial"))
    index = json.load(open(saved / "model.safetensors.index.json"))
    original = load_file(os.path.join(llama_dir, "model.safetensors"))
    ours = {}
    for name in set(index["weight_map"].values()):
        ours.update(load_file(str(saved / name)))
    assert ours.keys() == original.keys()
    for key, t in original.items():
        assert torch.equal(ours[key], t), key
