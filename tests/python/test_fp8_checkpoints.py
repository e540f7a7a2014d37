"""Block-quantized fp8 checkpoints (DeepSeek-V3's release format) load
dequantized.

The test writes a tiny random DeepSeek-V3 from ``transformers`` in the
release's format: every ``*_proj`` weight ``float8_e4m3fn``, quantized by
128 x 128 blocks, beside its float32 ``weight_scale_inv``, and the config's
``quantization_config``. Beside it the same model with those weights
dequantized in the test (fp8 times the block's scale, in float32) as an
ordinary checkpoint. Sizes exceed 128 and are not multiples of it, so blocks
are partial and tensor-parallel slices start inside a block. Loaded at
tp 1 and tp 2, both give the same parameters bit for bit.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from dist_utils import run_ranks

BLOCK = 128
CONFIG = dict(
    vocab_size=96,
    hidden_size=192,
    intermediate_size=272,
    moe_intermediate_size=144,
    num_hidden_layers=2,
    num_attention_heads=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=136,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=64,
)
QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv per block, the dequantized weight)."""
    rows, cols = w.shape
    sr, sc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(sr * BLOCK, sc * BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(sr, BLOCK, sc, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).float()
    plain_dir, fp8_dir = root / "plain", root / "fp8"
    model.save_pretrained(plain_dir)  # config.json, then the tensors below
    model.save_pretrained(fp8_dir)
    # The tensors as saved (experts one by one, as the release has them).
    state = load_file(str(plain_dir / "model.safetensors"))
    plain, quantized = dict(state), dict(state)
    for key, w in state.items():
        if key.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            q, scale, deq = _quantize(w)
            quantized[key], quantized[key + "_scale_inv"] = q, scale
            plain[key] = deq
    assert sum(v.dtype == torch.float8_e4m3fn for v in quantized.values()) > 10
    save_file(plain, str(plain_dir / "model.safetensors"))
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    cfg = json.load(open(fp8_dir / "config.json"))
    json.dump(dict(cfg, quantization_config=QUANTIZATION), open(fp8_dir / "config.json", "w"))
    return str(plain_dir), str(fp8_dir)


def _load_body(rank, world, plain_dir, fp8_dir, out):
    import dsparallel
    from dsparallel.models import from_pretrained

    state = dsparallel.init_parallel(world, 1) if world > 1 else None
    a = dict(from_pretrained(plain_dir, state, dtype=torch.float32).named_parameters())
    model = from_pretrained(fp8_dir, state, dtype=torch.float32)
    b = dict(model.named_parameters())
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    model.save_pretrained(out)
    if world > 1:
        dsparallel.destroy_parallel()
    return differ


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(checkpoints, tmp_path, world):
    plain_dir, fp8_dir = checkpoints
    out = str(tmp_path / "saved")
    if world == 1:
        differ = _load_body(0, 1, plain_dir, fp8_dir, out)
    else:
        differ = run_ranks(_load_body, world, plain_dir, fp8_dir, out, timeout=120)[0]
    assert differ == []
    # What is saved is the dequantized model: no fp8 left, and no
    # quantization_config that would make a reader expect it.
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))
    from safetensors import safe_open

    for name in glob.glob(os.path.join(out, "*.safetensors")):
        with safe_open(name, "pt") as f:
            assert not any(k.endswith("_scale_inv") for k in f.keys())
            assert not any(f.get_slice(k).get_dtype().startswith("F8") for k in f.keys())


def _rewrite(src: str, dst, change) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_bad_scales_are_named(checkpoints, tmp_path):
    from dsparallel.models import from_pretrained

    _, fp8_dir = checkpoints
    key = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"

    def wrong_shape(t):
        t[key] = torch.ones(1, 1)

    path = _rewrite(fp8_dir, tmp_path / "shape", wrong_shape)
    with pytest.raises(ValueError, match=r"q_b_proj.weight_scale_inv has shape \(1, 1\)"):
        from_pretrained(path)
    path = _rewrite(fp8_dir, tmp_path / "missing", lambda t: t.pop(key))
    with pytest.raises(ValueError, match=f"lacks {key}"):
        from_pretrained(path)
    other = _rewrite(fp8_dir, tmp_path / "gptq", lambda t: None)
    cfg = json.load(open(os.path.join(other, "config.json")))
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(cfg, open(os.path.join(other, "config.json"), "w"))
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        from_pretrained(other)
