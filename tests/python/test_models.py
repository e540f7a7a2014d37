"""Llama and DeepSeek-V3 from Hugging Face checkpoints, at every layout,
held against ``transformers`` in one process.

The references are tiny random ``transformers`` models built from a
config (nothing downloaded), seeded and saved: their logits on a padded
batch, and the loss and every gradient of one training step. Each layout
loads the checkpoint with ``from_pretrained`` and must give the same
logits (fp32, 1e-5), loss and gradients, and save a checkpoint equal to
the original bit for bit.

The configs exercise: grouped-query attention with fewer key/value heads
than tensor-parallel ranks (replicated), llama3 RoPE, tied embeddings
across the first and last pipeline stage; for DeepSeek-V3 the q low-rank
projection, YaRN with mscale, group-limited routing with two groups, a
dense first layer, shared experts.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LOGITS_TOL = 1e-5
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)

LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    ),
)
LLAMA_TIED = dict(LLAMA, tie_word_embeddings=True, rope_parameters=None)
DEEPSEEK = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=64,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)
# GPT-2 in its own field names; no dropout, so that train mode is eval's maths.
GPT2 = dict(
    vocab_size=96,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=64,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
MODELS = {"llama": LLAMA, "llama_tied": LLAMA_TIED, "deepseek": DEEPSEEK, "gpt2": GPT2}
BATCH, SEQ = 4, 12


def _hf_model(kind: str):
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    values = {k: v for k, v in MODELS[kind].items() if v is not None}
    if kind == "deepseek":
        return DeepseekV3ForCausalLM(DeepseekV3Config(**values))
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(**values))
    return LlamaForCausalLM(LlamaConfig(**values))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per model: a saved checkpoint; logits of a padded batch; loss and
    gradients (under checkpoint names) of one step on the unpadded batch."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    ref = {"ids": ids, "mask": mask, "logits": {}, "loss": {}, "grads": {}, "dirs": {}}
    for i, kind in enumerate(MODELS):
        torch.manual_seed(10 + i)
        model = _hf_model(kind).float()
        path = str(root / kind)
        model.save_pretrained(path)
        model.eval()  # no dropout; the same maths in train mode
        with torch.no_grad():
            ref["logits"][kind] = model(ids, attention_mask=mask).logits
        loss = model(ids, labels=ids).loss
        loss.backward()
        ref["loss"][kind] = loss.detach()
        names = dict(model.named_parameters())
        grads = {}
        for name, p in names.items():
            grads[name] = p.grad.clone()
        ref["grads"][kind] = _per_expert(grads)
        ref["dirs"][kind] = path
    torch.save(ref, root / "ref.pt")
    return ref, str(root / "ref.pt")


def _per_expert(grads: dict) -> dict:
    """The fused in-memory expert tensors of ``transformers`` under the
    per-expert names they have on disk (and in our checkpoints)."""
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for j, block in enumerate(g):
                gate, up = block.chunk(2, dim=0)
                out[f"{base}{j}.gate_proj.weight"] = gate
                out[f"{base}{j}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for j, block in enumerate(g):
                out[f"{base}{j}.down_proj.weight"] = block
        else:
            out[name] = g
    return out


def _layout_body(rank, world, tp, pp, ep, sp, ref_path, out_dir, fold=False):
    import torch.distributed as dist

    import dsparallel
    from dsparallel.models import from_pretrained
    from dsparallel.pipeline import Schedule1F1B

    ref = torch.load(ref_path)
    state = dsparallel.init_parallel(tp, pp, expert_parallel_size=ep, experts_over_tp=fold)
    ids, mask = ref["ids"], ref["mask"]
    report = {}
    for kind, path in ref["dirs"].items():
        if ep > 1 and kind != "deepseek":
            continue
        model = from_pretrained(path, state, sequence_parallel=sp)
        # Logits of the padded batch, compared where the mask keeps a token.
        out = model(ids, attention_mask=mask)
        if model.is_last:
            keep = mask.bool()
            err = (out.logits - ref["logits"][kind])[keep].abs().max().item()
            assert err < LOGITS_TOL, f"{kind}: logits differ by {err}"
            report[f"{kind}_logits_err"] = err
        saved = os.path.join(out_dir, kind)
        model.save_pretrained(saved)
        # One training step on the unpadded batch; with expert parallelism
        # each data-parallel rank takes its rows, as a data loader would.
        dp, d = state.dp_size, state.dp_rank
        rows = ids.chunk(dp)[d] if ep > 1 else ids
        if pp == 1:
            loss = model(rows, labels=rows).loss
            (loss / (dp if ep > 1 else 1)).backward()
        else:
            stage = model.pipeline_stage()
            schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=model.loss_fn)
            losses = []
            if model.is_first:
                schedule.step(rows, target=rows if model.is_last else None)
            else:
                schedule.step(target=rows, losses=losses)
            loss = torch.stack(losses).mean() if losses else None
            model.allreduce_tied_grads()
        if ep > 1:
            # Expert gradients already hold every rank's tokens (through
            # the dispatch backward); the others are summed over the ranks.
            if loss is not None:  # the last stage
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=state.dp_group)
                loss /= dp
            for p in model.parameters():
                if not hasattr(p, "_dsp_expert_group"):
                    dist.all_reduce(p.grad, group=state.dp_group)
        if loss is not None:
            err = abs(loss.item() - ref["loss"][kind].item())
            assert err < 1e-5, f"{kind}: loss {loss.item()} vs {ref['loss'][kind].item()}"
        grads = model.hf_state_dict(grads=True)
        expected = ref["grads"][kind]
        assert grads.keys() == expected.keys(), (
            f"{kind}: gradient names differ: {sorted(grads.keys() ^ expected.keys())[:5]}"
        )
        for key, g in grads.items():
            torch.testing.assert_close(
                g, expected[key], **GRAD_TOL, msg=f"{kind}: gradient of {key}"
            )
        report[f"{kind}_grads"] = len(grads)
    dsparallel.destroy_parallel()
    return report


LAYOUTS = [
    # (tp, pp, ep, sequence parallel): world = tp * pp * ep (ep carved from dp)
    (1, 1, 1, False),
    (2, 1, 1, False),
    (4, 1, 1, False),
    (1, 2, 1, False),
    (2, 2, 1, False),
    (1, 1, 2, False),
    (2, 1, 2, False),
    (1, 1, 4, False),
    (4, 2, 1, False),
    (2, 1, 1, True),
    (4, 1, 1, True),
    (2, 2, 1, True),
    (2, 1, 2, True),
]


@pytest.mark.parametrize(
    "tp,pp,ep,sp", LAYOUTS, ids=[f"tp{t}-pp{p}-ep{e}{'-sp' * s}" for t, p, e, s in LAYOUTS]
)
def test_hf_models_match_transformers_at_every_layout(reference, tmp_path, tp, pp, ep, sp):
    ref, ref_path = reference
    world = tp * pp * ep
    run_ranks(_layout_body, world, tp, pp, ep, sp, ref_path, str(tmp_path), timeout=240)
    for kind, path in ref["dirs"].items():
        if ep > 1 and kind != "deepseek":
            continue
        original, ours = _tensors(path), _tensors(str(tmp_path / kind))
        assert original.keys() == ours.keys(), sorted(original.keys() ^ ours.keys())[:5]
        for key, t in original.items():
            assert t.dtype == ours[key].dtype and torch.equal(t, ours[key]), key


FOLDED = [
    # (tp, pp, ep, sequence parallel) with experts_over_tp: ep spans the tp
    # ranks, world = pp * dp * tp with dp = ep / tp
    (2, 1, 2, False),
    (2, 1, 2, True),
    (2, 1, 4, False),
    (2, 1, 4, True),
    (2, 2, 2, True),
]


@pytest.mark.parametrize(
    "tp,pp,ep,sp", FOLDED, ids=[f"tp{t}-pp{p}-ep{e}{'-sp' * s}" for t, p, e, s in FOLDED]
)
def test_deepseek_with_experts_over_tp_matches_transformers(reference, tmp_path, tp, pp, ep, sp):
    """No expert is replicated over the tp ranks: each routes its own tokens."""
    ref, ref_path = reference
    run_ranks(_layout_body, pp * ep, tp, pp, ep, sp, ref_path, str(tmp_path), True, timeout=240)
    original, ours = _tensors(ref["dirs"]["deepseek"]), _tensors(str(tmp_path / "deepseek"))
    assert original.keys() == ours.keys(), sorted(original.keys() ^ ours.keys())[:5]
    for key, t in original.items():
        assert torch.equal(t, ours[key]), key


def _context_parallel_body(rank, world, tp, pp, ep, cp, mode, sp, ref_path):
    import dsparallel
    from dsparallel.models import from_pretrained
    from dsparallel.pipeline import Schedule1F1B

    ref = torch.load(ref_path)
    state = dsparallel.init_parallel(tp, pp, expert_parallel_size=ep, context_parallel_size=cp)
    ids, mask = ref["ids"], ref["mask"]
    errors = {}
    for kind, path in ref["dirs"].items():
        if ep > 1 and kind != "deepseek":
            continue
        model = from_pretrained(path, state, cp_mode=mode, sequence_parallel=sp)
        # The padded batch: the attention mask travels as document ids.
        out = model(ids, attention_mask=mask)
        if model.is_last:
            keep = mask.bool()
            errors[f"{kind} logits"] = (out.logits - ref["logits"][kind])[keep].abs().max().item()

        def ddp(m):
            return dsparallel.DistributedDataParallel(m, process_group=state.dp_cp_group)

        if pp == 1:
            runner = ddp(model)  # kept: its reducer reduces in backward
            loss = runner(ids, labels=ids).loss
            loss.backward()
        else:
            schedule = Schedule1F1B(
                model.pipeline_stage(wrap=ddp), n_microbatches=2, loss_fn=model.loss_fn
            )
            losses = []
            if model.is_first:
                schedule.step(ids)
            else:
                schedule.step(target=ids, losses=losses)
            loss = torch.stack(losses).mean() if losses else None
            model.allreduce_tied_grads()
        if loss is not None:
            errors[f"{kind} loss"] = abs(loss.item() - ref["loss"][kind].item())
        grads = model.hf_state_dict(grads=True)
        assert grads.keys() == ref["grads"][kind].keys()
        for key, g in grads.items():
            torch.testing.assert_close(
                g, ref["grads"][kind][key], **GRAD_TOL, msg=f"{kind}: gradient of {key}"
            )
    dsparallel.destroy_parallel()
    return errors


CP_LAYOUTS = [
    # (tp, pp, ep, cp, cp_mode, sequence parallel): world = tp * pp * cp
    (1, 1, 1, 2, "ring", False),
    (2, 1, 1, 2, "ulysses", True),
    (1, 2, 1, 2, "ring", False),
    (1, 1, 2, 2, "ring", False),
]


@pytest.mark.parametrize(
    "tp,pp,ep,cp,mode,sp",
    CP_LAYOUTS,
    ids=[f"tp{t}-pp{p}-ep{e}-cp{c}-{m}{'-sp' * s}" for t, p, e, c, m, s in CP_LAYOUTS],
)
def test_hf_models_under_context_parallelism_match_transformers(
    reference, tp, pp, ep, cp, mode, sp
):
    """Every rank of a cp group is given the whole batch and takes its part
    of each sequence: the logits of the padded batch, the loss and every
    gradient (averaged by our DDP over dp x cp) are those of
    ``transformers`` on the whole sequences. With ep the experts are split
    over the cp ranks."""
    ref, ref_path = reference
    errors = run_ranks(
        _context_parallel_body, tp * pp * cp, tp, pp, ep, cp, mode, sp, ref_path, timeout=240
    )
    for rank_errors in errors:
        for what, err in rank_errors.items():
            assert err < (LOGITS_TOL if "logits" in what else 1e-5), f"{what} differ by {err}"
    assert any("loss" in k for e in errors for k in e)


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _save_body(rank, world, path, out):
    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(2, 2)
    from_pretrained(path, state).save_pretrained(out)
    dsparallel.destroy_parallel()


@pytest.mark.parametrize("kind", ["llama_tied", "deepseek", "gpt2"])
def test_transformers_loads_what_we_save(reference, tmp_path, kind):
    """Saved at tp 2 x pp 2 (two files and an index), loaded by
    ``transformers``: the same logits as the original model."""
    ref, _ = reference
    out = str(tmp_path / "saved")
    run_ranks(_save_body, 4, ref["dirs"][kind], out, timeout=120)
    assert len(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"])
    assert len(glob.glob(os.path.join(out, "*.safetensors"))) == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(ref["ids"], attention_mask=ref["mask"]).logits
    keep = ref["mask"].bool()
    assert (logits - ref["logits"][kind])[keep].abs().max() < LOGITS_TOL


def test_fresh_models_are_the_same_in_every_layout():
    """``Llama(config)`` without a checkpoint: each tensor drawn from the
    seed and its name, so a layout's shards are slices of the one-process
    model."""
    from dsparallel.models import DeepseekV3, Llama

    for cls, cfg in ((Llama, LLAMA), (DeepseekV3, DEEPSEEK)):
        values = dict(cfg, model_type=cls.model_type)
        a = cls(values, seed=3).hf_state_dict()
        b = cls(values, seed=3).hf_state_dict()
        c = cls(values, seed=4).hf_state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        drawn = [k for k in a if not k.endswith(("norm.weight", "e_score_correction_bias"))]
        assert not any(torch.equal(a[k], c[k]) for k in drawn)
    run_ranks(_fresh_body, 4, timeout=120)


def _fresh_body(rank, world):
    import dsparallel
    from dsparallel.models import DeepseekV3, Llama

    whole = {
        cls: cls(dict(cfg, model_type=cls.model_type), seed=3).hf_state_dict()
        for cls, cfg in ((Llama, LLAMA), (DeepseekV3, DEEPSEEK))
    }
    for tp, pp, ep in ((2, 2, 1), (4, 1, 1), (1, 1, 4)):
        state = dsparallel.init_parallel(tp, pp, expert_parallel_size=ep)
        for cls, full in whole.items():
            if ep > 1 and cls is Llama:
                continue
            cfg = LLAMA if cls is Llama else DEEPSEEK
            split = cls(dict(cfg, model_type=cls.model_type), state, seed=3).hf_state_dict()
            assert split.keys() == full.keys()
            assert all(torch.equal(split[k], full[k]) for k in full)
        dsparallel.destroy_parallel()


# ---------------------------------------------------------------- bad input


def _bad_layout_body(rank, world):
    import dsparallel
    from dsparallel.models import DeepseekV3, Llama

    errors = []
    state = dsparallel.init_parallel(4, 1)
    for cfg, what in (
        (dict(LLAMA, num_attention_heads=6, num_key_value_heads=3), "num_attention_heads=6"),
        # (A vocabulary tp does not divide is padded: test_real_runs.)
        (dict(LLAMA, intermediate_size=98), "intermediate_size=98"),
    ):
        try:
            Llama(dict(cfg, model_type="llama"), state)
        except ValueError as e:
            assert what in str(e), str(e)
            errors.append(str(e))
    dsparallel.destroy_parallel()
    state = dsparallel.init_parallel(2, 1)
    try:
        Llama(dict(LLAMA, num_attention_heads=6, num_key_value_heads=3, model_type="llama"), state)
    except ValueError as e:
        assert "num_key_value_heads=3" in str(e), str(e)
        errors.append(str(e))
    dsparallel.destroy_parallel()
    state = dsparallel.init_parallel(1, 1, expert_parallel_size=4)
    try:
        DeepseekV3(dict(DEEPSEEK, n_routed_experts=6, n_group=1, model_type="deepseek_v3"), state)
    except ValueError as e:
        assert "n_routed_experts=6" in str(e) and "expert-parallel size 4" in str(e), str(e)
        errors.append(str(e))
    dsparallel.destroy_parallel()
    # Context parallelism: Ulysses over more ranks than heads; a sequence
    # that is not a multiple of 2 x cp.
    state = dsparallel.init_parallel(1, 1, context_parallel_size=4)
    try:
        Llama(dict(LLAMA, num_attention_heads=2, model_type="llama"), state, cp_mode="ulysses")
    except ValueError as e:
        assert "2 heads over the 4 context-parallel ranks" in str(e), str(e)
        errors.append(str(e))
    model = Llama(dict(LLAMA, model_type="llama"), state)
    try:
        model(torch.zeros(2, 12, dtype=torch.long))
    except ValueError as e:
        assert "12 tokens" in str(e) and "multiple of 2 x 4 = 8" in str(e), str(e)
        errors.append(str(e))
    dsparallel.destroy_parallel()
    return errors


def test_a_layout_that_cannot_split_the_model_is_refused_on_every_rank():
    for errors in run_ranks(_bad_layout_body, 4, timeout=120):
        assert len(errors) == 6, errors


def _bad_checkpoints_body(rank, world, paths):
    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(1, 2)
    errors = []
    for path in paths:
        try:
            from_pretrained(path, state)
        except Exception as e:  # noqa: BLE001 (the test reads the type)
            errors.append(f"{type(e).__name__}: {e}")
    dsparallel.destroy_parallel()
    return errors


def test_bad_checkpoints_are_refused_on_every_rank(reference, tmp_path):
    import shutil

    ref, _ = reference
    other = tmp_path / "qwen2"
    shutil.copytree(ref["dirs"]["llama"], other)
    cfg = json.load(open(other / "config.json"))
    json.dump(dict(cfg, model_type="qwen2"), open(other / "config.json", "w"))
    # A sharded checkpoint whose index names a file that is not there: the
    # missing part is the last stage's, yet the first stage raises too.
    sharded = tmp_path / "sharded"
    shutil.copytree(ref["dirs"]["llama"], sharded)
    keys = sorted(_tensors(str(sharded)))
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "model.safetensors")}
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    json.dump(index, open(sharded / "model.safetensors.index.json", "w"))
    # A checkpoint of the same family but other sizes than its config says.
    wrong = tmp_path / "wrong"
    shutil.copytree(ref["dirs"]["llama"], wrong)
    json.dump(dict(cfg, intermediate_size=128), open(wrong / "config.json", "w"))
    # A tensor only the last stage reads has the wrong shape: that rank
    # names it, the first stage names the rank.
    bad_norm = tmp_path / "bad_norm"
    shutil.copytree(ref["dirs"]["llama"], bad_norm)
    from safetensors.torch import save_file

    tensors = _tensors(str(bad_norm))
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, str(bad_norm / "model.safetensors"))
    # A corrupt shard (cut short) that only the last stage reads: every
    # rank raises safetensors' own error, naming the rank.
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    tensors = _tensors(ref["dirs"]["llama"])
    last_stage = {k for k in tensors if k in ("model.norm.weight", "lm_head.weight")}
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for key, t in tensors.items():
        files[f"model-0000{1 + (key in last_stage)}-of-00002.safetensors"][key] = t
    for name, part in files.items():
        save_file(part, str(corrupt / name))
    index = {"metadata": {}, "weight_map": {k: n for n, part in files.items() for k in part}}
    json.dump(index, open(corrupt / "model.safetensors.index.json", "w"))
    json.dump(cfg, open(corrupt / "config.json", "w"))
    broken = corrupt / "model-00002-of-00002.safetensors"
    broken.write_bytes(broken.read_bytes()[:-100])
    cases = [str(other), str(sharded), str(wrong), str(bad_norm), str(corrupt)]
    first, last = run_ranks(_bad_checkpoints_body, 2, cases, timeout=120)
    for errors in (first, last):
        assert len(errors) == 5, errors
        assert errors[0].startswith("ValueError") and "'qwen2' model" in errors[0], errors[0]
        assert errors[1].startswith("FileNotFoundError"), errors[1]
        assert "model-00002-of-00002.safetensors" in errors[1], errors[1]
        assert "gate_proj.weight has shape (96, 64)" in errors[2], errors[2]
        assert errors[3].startswith(
            "ValueError: from_pretrained failed on rank 1: from_pretrained: model.norm.weight "
            "has shape (65,)"
        ), errors[3]
        assert errors[4].startswith("SafetensorError: from_pretrained failed on rank 1"), errors[4]


# ------------------------------------------------- resume in another layout

STEPS = 5  # before and after the checkpoint


def _batches():
    """The global batches of the run, the same in every layout: rows
    counting up in steps of 3 from random starts (learnable)."""
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 96, (2 * STEPS, 8, 1), generator=g)
    return list((starts + 3 * torch.arange(SEQ)) % 96)


def _trainer(path, tp, pp, ep, zero, cp=1, cp_mode="ring", recompute=False, fold=False):
    """(model, optimizer, step function) at one layout as the trainer's step
    trains it (``make_trainer``), fp64 (so that layouts differ by rounding
    only), ZeRO ``zero`` (0: none, 1, 2; "fsdp": torch's FSDP2 over the
    data-parallel ranks, per decoder layer and the root), context
    parallelism ``cp`` (gradients reduced over dp x cp), ``fold``: the
    experts split over the tp ranks too (``experts_over_tp``). The step returns
    the mean loss over the ranks that computed one."""
    from train_steps import make_trainer

    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(
        tp, pp, expert_parallel_size=ep, context_parallel_size=cp, experts_over_tp=fold
    )
    model = from_pretrained(path, state, dtype=torch.float64, checkpoint=recompute, cp_mode=cp_mode)
    if zero == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=state.mesh["dp"])
        fully_shard(model, mesh=state.mesh["dp"])
        zero = 0
    trainer = make_trainer(model, state, zero, micro_batches=2, lr=1e-2)

    def step(batch):
        losses = trainer.step(batch.chunk(state.dp_size)[state.dp_rank])
        mine = torch.stack(losses).mean().item() if losses else None
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, mine)
        return sum(v for v in every if v is not None) / sum(v is not None for v in every)

    return model, trainer.opt, step


def _resume_body(rank, world, path, before, after, ckpt):
    import dsparallel

    batches, losses = _batches(), []
    if before is None:  # the uninterrupted run
        model, opt, step = _trainer(path, 1, 1, 1, 0)
        losses = [step(b) for b in batches]
        dsparallel.destroy_parallel()
        return losses
    model, opt, step = _trainer(path, *before)
    losses = [step(b) for b in batches[:STEPS]]
    dsparallel.save_checkpoint(ckpt, model, opt)
    dsparallel.destroy_parallel()
    model, opt, step = _trainer(path, *after)
    dsparallel.load_checkpoint(ckpt, model, opt)
    losses += [step(b) for b in batches[STEPS:]]
    dsparallel.destroy_parallel()
    return losses


RESUMES = [
    # (model, (tp, pp, ep, zero[, cp, cp_mode]) saved, ... loaded), 4 processes
    ("llama", (2, 2, 1, 1), (1, 1, 1, 2)),
    ("llama", (1, 1, 1, 2), (4, 1, 1, 0)),
    ("llama_tied", (1, 2, 1, 1), (2, 1, 1, 2)),
    ("deepseek", (2, 1, 2, 1), (1, 2, 1, 0)),
    ("llama", (2, 1, 1, 2, 2, "ulysses"), (1, 2, 1, 0, 2, "ring")),
    ("deepseek", (1, 1, 2, 1, 2, "ring"), (2, 1, 1, 0)),
    # experts_over_tp (the experts over tp x dp) to and from experts replicated over tp
    ("deepseek", (2, 1, 4, 2, 1, "ring", False, True), (2, 1, 2, 1)),
    ("deepseek", (2, 1, 2, 0), (2, 1, 2, 1, 1, "ring", False, True)),
]


def _variants_body(rank, world, llama, deepseek):
    """Llama under FSDP2 at dp 2, DeepSeek-V3 at tp 2 with every layer
    recomputed in backward: the losses of the run."""
    import dsparallel

    out = {}
    for kind, path, setup in (
        ("llama", llama, dict(tp=1, zero="fsdp")),
        ("deepseek", deepseek, dict(tp=2, zero=0, recompute=True)),
    ):
        _, _, step = _trainer(
            path, setup["tp"], 1, 1, setup["zero"], recompute=setup.get("recompute", False)
        )
        out[kind] = [step(b) for b in _batches()]
        dsparallel.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def uninterrupted(reference):
    ref, _ = reference
    return {
        kind: run_ranks(_resume_body, 1, ref["dirs"][kind], None, None, None, timeout=120)[0]
        for kind in sorted({k for k, _, _ in RESUMES})
    }


@pytest.mark.parametrize(
    "kind,before,after", RESUMES, ids=[f"{k}-{b}-to-{a}".replace(" ", "") for k, b, a in RESUMES]
)
def test_resume_in_another_layout_equals_the_uninterrupted_run(
    reference, uninterrupted, tmp_path, kind, before, after
):
    ref, _ = reference
    ckpt = str(tmp_path / "ckpt")
    losses = run_ranks(_resume_body, 4, ref["dirs"][kind], before, after, ckpt, timeout=240)[0]
    expected = uninterrupted[kind]
    for i, (got, want) in enumerate(zip(losses, expected)):
        assert abs(got - want) < 1e-6, f"step {i}: {got} vs uninterrupted {want}"
    assert losses[-1] < 0.9 * losses[0]  # it trains


def test_fsdp2_and_recomputation_train_as_one_process(reference, uninterrupted):
    ref, _ = reference
    got = run_ranks(_variants_body, 2, ref["dirs"]["llama"], ref["dirs"]["deepseek"], timeout=240)[
        0
    ]
    for kind, losses in got.items():
        for i, (a, b) in enumerate(zip(losses, uninterrupted[kind])):
            assert abs(a - b) < 1e-6, f"{kind} step {i}: {a} vs one process {b}"
