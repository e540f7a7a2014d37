"""``python -m dsparallel.convert``: a training checkpoint written at tp 2
by two processes, converted in one process with no process group, to a
Hugging Face checkpoint that ``transformers`` loads (equal to the trained
model's weights, gathered from the ranks) and to one ``torch.save`` file;
and its errors named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from dist_utils import run_ranks
from test_models import LLAMA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _convert(*args):
    return subprocess.run(
        [sys.executable, "-m", "dsparallel.convert", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def _train_body(rank, world, hf, ckpt):
    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(2)
    model = from_pretrained(hf, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()
    dsparallel.save_checkpoint(ckpt, model, opt)
    trained = {k: v.tolist() for k, v in model.hf_state_dict().items()}
    dsparallel.destroy_parallel()
    return trained


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("convert")
    hf, ckpt = str(root / "hf"), str(root / "ckpt")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(hf)
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        f.write("{}")
    weights = run_ranks(_train_body, 2, hf, ckpt, timeout=180)[0]
    return hf, ckpt, {k: torch.tensor(v) for k, v in weights.items()}


def test_a_training_checkpoint_converts_to_hugging_face_and_one_file(trained, tmp_path):
    from transformers import LlamaForCausalLM

    hf, ckpt, weights = trained
    out = str(tmp_path / "out")
    done = _convert(ckpt, out, "--to", "hf", "--model", hf)
    assert done.returncode == 0, done.stderr
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))  # copied along
    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    for key, w in weights.items():
        assert torch.equal(loaded[key], w), key
    # The trained weights, not the original ones.
    original = LlamaForCausalLM.from_pretrained(hf).state_dict()
    assert not torch.equal(original["model.norm.weight"], loaded["model.norm.weight"])

    file = str(tmp_path / "ckpt.pt")
    done = _convert(ckpt, file, "--to", "torch")
    assert done.returncode == 0, done.stderr
    sd = torch.load(file)
    for key, w in weights.items():
        assert torch.equal(sd[f"model.{key}"], w), key
    assert any(k.startswith("optim.") and k.endswith("exp_avg") for k in sd)


def test_convert_errors_are_named(trained, tmp_path):
    hf, ckpt, _ = trained
    done = _convert(str(tmp_path), str(tmp_path / "x"), "--to", "torch")
    assert done.returncode == 2 and "neither a training checkpoint" in done.stderr
    done = _convert(ckpt, str(tmp_path / "x"), "--to", "hf")
    assert done.returncode == 2 and "--to hf needs --model" in done.stderr
    done = _convert(ckpt, str(tmp_path / "x"), "--to", "hf", "--model", str(tmp_path / "none"))
    assert done.returncode == 2 and "none does not exist" in done.stderr
