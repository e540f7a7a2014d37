"""DeepSeek-V3's multi-token prediction (paper, section 2.2), depth D = 1,
in the released checkpoints' layout (the MTP module is checkpoint layer
``num_hidden_layers``: ``enorm``, ``hnorm``, ``eh_proj``, a decoder layer,
``shared_head.norm``, and copies of the embedding and LM head), against a
reference written in the test from plain torch ops around ``transformers``'
model and one of its decoder layers:

    h'  = eh_proj [enorm(emb(t_{i+1})) ; hnorm(h_i)]     h: the main model's
    h'' = block(h')                                      last layer's output
    L_mtp = CE(head(shared_head.norm(h'')) at i, t_{i+2})
    loss = L_main + lambda * L_mtp

The test writes the checkpoint (``transformers`` drops the layer at load, so
its model is the main model), loads it with ``from_pretrained`` at several
layouts, takes one SGD step (lr 1) of ``model(ids, labels=ids).loss`` and
compares every saved tensor's change with the reference's gradient; the
loss itself too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from test_deepseek_training import CONFIG as TRAINING_CONFIG

# The balance-loss test's tiny DeepSeek-V3 (group-limited routing, a dense
# first layer, shared experts), two layers and one MTP layer.
CONFIG = dict(TRAINING_CONFIG, num_hidden_layers=2, num_nextn_predict_layers=1)
L = CONFIG["num_hidden_layers"]
BATCH, SEQ, LAMBDA = 4, 12, 0.3


def _ids():
    ids = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    # Masked prompts: their tokens still feed the MTP embedding. (Alike in
    # both halves of the batch, which the dp 2 layout splits.)
    labels[1, :5] = -100
    labels[3, :5] = -100
    return ids, labels


def _rms(x, w, eps=1e-6):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _mtp_tensors(main, block):
    """The MTP layer's tensors under checkpoint names: ``block``'s (a
    decoder layer of a deeper ``transformers`` model), random norms and
    projection, and the embedding and head copies."""
    h = CONFIG["hidden_size"]
    g = torch.Generator().manual_seed(3)
    pre = f"model.layers.{L}"
    out = {
        f"{pre}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{pre}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{pre}.eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
        f"{pre}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{pre}.embed_tokens.weight": main.model.embed_tokens.weight.detach().clone(),
        f"{pre}.shared_head.head.weight": main.lm_head.weight.detach().clone(),
    }
    from test_models import _per_expert

    for name, t in _per_expert(dict(block.named_parameters())).items():
        out[f"{pre}.{name}"] = t.detach().clone()
    for name, t in block.named_buffers():
        out[f"{pre}.{name}"] = t.detach().clone()
    return out


def _reference_loss(main, block, mtp, ids, labels):
    """(main loss, MTP loss): ``transformers``' model and decoder layer,
    the MTP module's other parts from plain torch ops."""
    seen = []
    hook = main.model.layers[-1].register_forward_hook(
        lambda mod, args, out: seen.append(out[0] if isinstance(out, tuple) else out)
    )
    lm = main(ids, labels=labels).loss
    hook.remove()
    h = seen[0]  # the last decoder layer's output, before the final norm
    pre = f"model.layers.{L}"
    nxt = F.pad(ids, (0, 1))[:, 1:]  # t_{i+1}; past the end a pad whose loss is masked
    emb = main.model.embed_tokens(nxt)
    x = torch.cat([_rms(emb, mtp[f"{pre}.enorm.weight"]), _rms(h, mtp[f"{pre}.hnorm.weight"])], -1)
    x = F.linear(x, mtp[f"{pre}.eh_proj.weight"])
    positions = torch.arange(SEQ)[None]
    cos_sin = main.model.rotary_emb(x, positions)
    y = block(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    y = y[0] if isinstance(y, tuple) else y
    logits = main.lm_head(_rms(y, mtp[f"{pre}.shared_head.norm.weight"]))
    target = F.pad(labels, (0, 2), value=-100)[:, 2:]  # position i predicts t_{i+2}
    mtp_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    return lm, mtp_loss


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint path, the reference's loss, its gradients by checkpoint
    name)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = str(tmp_path_factory.mktemp("mtp") / "model")
    torch.manual_seed(0)
    main = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).float()
    torch.manual_seed(1)
    deeper = DeepseekV3ForCausalLM(DeepseekV3Config(**dict(CONFIG, num_hidden_layers=L + 1)))
    block = deeper.float().model.layers[L]
    with torch.no_grad():
        for m in (main, deeper):
            for name, b in m.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.05)
    main.save_pretrained(path)
    mtp = _mtp_tensors(main, block)
    # The released layout: the MTP tensors in the same safetensors file.
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1

    own = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    params = {k: v.clone().requires_grad_() for k, v in mtp.items() if k.endswith(own)}
    ids, labels = _ids()
    lm, mtp_loss = _reference_loss(main, block, params, ids, labels)
    (lm + LAMBDA * mtp_loss).backward()
    grads = {n: p.grad.clone() for n, p in main.named_parameters()}
    from test_models import _per_expert

    grads = _per_expert(grads)
    pre = f"model.layers.{L}"
    block_grads = {
        n: p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in block.named_parameters()
    }
    for name, g in _per_expert(block_grads).items():
        grads[f"{pre}.{name}"] = g.clone()
    for name, p in params.items():
        grads[name] = p.grad.clone()
    # The copies move as the tensors they copy.
    grads[f"{pre}.embed_tokens.weight"] = grads["model.embed_tokens.weight"]
    grads[f"{pre}.shared_head.head.weight"] = grads["lm_head.weight"]
    return path, (lm.item(), mtp_loss.item()), grads


LAYOUTS = {  # processes, tp, ep, cp, sequence parallel, experts over tp
    "one-process": (1, 1, 1, 1, False, False),
    "tp2": (2, 2, 1, 1, False, False),
    "tp2-sp": (2, 2, 1, 1, True, False),
    "cp2": (2, 1, 1, 2, False, False),
    "dp2-ep2": (2, 1, 2, 1, False, False),
    "tp2-ep2-over-tp": (2, 2, 2, 1, False, True),
}
# bf16 compute with float32 masters (dsparallel.MixedPrecision): the same
# step within bf16's rounding.
MIXED = ["one-process-mixed", "tp2-ep2-over-tp-mixed"]


def _step_body(rank, world, path, out, layout):
    import dsparallel
    from dsparallel.models import from_pretrained

    mixed = layout.endswith("-mixed")
    _, tp, ep, cp, sp, fold = LAYOUTS[layout.removesuffix("-mixed")]
    state = dsparallel.init_parallel(
        tp, expert_parallel_size=ep, context_parallel_size=cp, experts_over_tp=fold
    )
    policy = {"mixed_precision": dsparallel.MixedPrecision()} if mixed else {}
    model = from_pretrained(path, state, dtype=torch.float32, sequence_parallel=sp, **policy)
    assert model.mtp_depth == 1
    if mixed:
        assert model.precision == "mixed bfloat16 (float32 masters)"
    model.mtp_loss_weight = LAMBDA
    for m in model.modules():
        if hasattr(m, "bias_update_rate"):
            m.bias_update_rate = 0.0
    runner = model
    if state.dp_size * state.cp_size > 1:
        runner = dsparallel.DistributedDataParallel(model, process_group=state.dp_cp_group)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ids, labels = _ids()
    rows = slice(None)
    if state.dp_size > 1:  # each data-parallel rank its half of the rows
        n = BATCH // state.dp_size
        rows = slice(state.dp_rank * n, (state.dp_rank + 1) * n)
    loss = runner(ids[rows], labels=labels[rows]).loss
    loss.backward()
    opt.step()
    model.save_pretrained(out)
    got = (loss.item(), model.mtp_loss.item())
    dsparallel.destroy_parallel()
    return got


@pytest.mark.parametrize("layout", list(LAYOUTS) + MIXED)
def test_one_step_with_mtp_equals_the_reference(reference, tmp_path, layout):
    from safetensors.torch import load_file

    path, (lm, mtp_loss), grads = reference
    out = str(tmp_path / "out")
    mixed = layout.endswith("-mixed")
    world, tp, _, cp, _, _ = LAYOUTS[layout.removesuffix("-mixed")]
    losses = run_ranks(_step_body, world, path, out, layout, timeout=180)
    # bf16 keeps 8 bits: its losses and gradients agree to about 1%.
    loss_tol, grad_tol = (2e-2, 3e-2) if mixed else (1e-5, 2e-5)
    if world == tp * cp:  # no data parallelism: every rank's loss is the whole batch's
        loss, mtp = losses[0]
        assert abs(mtp - mtp_loss) < loss_tol * max(1, mtp_loss), (mtp, mtp_loss)
        want = lm + LAMBDA * mtp_loss
        assert abs(loss - want) < loss_tol * max(1, want), (loss, lm, mtp_loss)
    before, after = load_file(os.path.join(path, "model.safetensors")), {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            after.update(load_file(os.path.join(out, f)))
    assert before.keys() == after.keys(), sorted(before.keys() ^ after.keys())[:5]
    assert any(k.startswith(f"model.layers.{L}.") for k in after)
    for name, g in grads.items():
        got = before[name] - after[name]  # SGD at lr 1: the gradient
        scale = g.abs().max().item()
        torch.testing.assert_close(
            got.float(), g, rtol=0, atol=grad_tol * max(scale, 1e-2), msg=name
        )
    # The MTP loss moved the main model's weights too (through h).
    assert grads["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].abs().max() > 0


def _pipeline_body(rank, world, path, out):
    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(1, 2)
    model = from_pretrained(path, state)
    try:
        model.pipeline_stage()
    except NotImplementedError as e:
        message = str(e)
    else:
        message = ""
    model.eval()
    model.pipeline_stage()  # forward-only stages run without it
    model.save_pretrained(out)  # the MTP layer and its copies kept
    dropped = from_pretrained(path, state, mtp_depth=0)
    dropped.pipeline_stage()
    dropped.save_pretrained(out + "-dropped")
    depths = (model.mtp_depth, dropped.mtp_depth)
    dsparallel.destroy_parallel()
    return message, depths


def test_mtp_under_a_pipeline_is_kept_and_its_training_refused_by_name(reference, tmp_path):
    from safetensors.torch import load_file

    path, _, _ = reference
    out = str(tmp_path / "out")
    message, depths = run_ranks(_pipeline_body, 2, path, out, timeout=120)[0]
    assert "multi-token prediction" in message and "mtp_depth=0" in message, message
    assert depths == (1, 0)

    def tensors(d):
        got = {}
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                got.update(load_file(os.path.join(d, f)))
        return got

    original, saved = tensors(path), tensors(out)
    assert original.keys() == saved.keys(), sorted(original.keys() ^ saved.keys())
    for key, t in original.items():
        assert torch.equal(t, saved[key]), key
    dropped = tensors(out + "-dropped")
    assert sorted(original.keys() - dropped.keys()) == sorted(
        k for k in original if k.startswith(f"model.layers.{L}.")
    )
    with open(os.path.join(out + "-dropped", "config.json")) as f:  # as transformers keeps it
        assert json.load(f)["num_nextn_predict_layers"] == 1


def test_a_training_checkpoint_with_mtp_converts_with_its_layers(reference, tmp_path):
    """``python -m dsparallel.convert`` builds as many MTP layers as the
    training checkpoint holds and writes them back, copies included."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    import dsparallel
    from dsparallel.models import from_pretrained

    path, _, _ = reference
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    dsparallel.save_checkpoint(ckpt, from_pretrained(path))
    done = subprocess.run(
        [sys.executable, "-m", "dsparallel.convert", ckpt, out, "--to", "hf", "--model", path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    original, converted = load_file(os.path.join(path, "model.safetensors")), {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            converted.update(load_file(os.path.join(out, f)))
    assert original.keys() == converted.keys(), sorted(original.keys() ^ converted.keys())[:5]
    for key, t in original.items():
        assert torch.equal(t, converted[key]), key
