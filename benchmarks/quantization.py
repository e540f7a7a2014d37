"""What bfloat16 and int8 weights cost in accuracy, on a trained model: the
main job's Llama (``bash scripts/train.sh``, trained on the docs; run first
if its export is missing) scored on the held-out README.

    python benchmarks/quantization.py [--model runs/llama-docs/hf] [--text README.md]

The text is tokenized with the model's tokenizer and cut into windows of
``--window`` tokens; the perplexity is exp of the mean next-token cross
entropy over every window's tokens. Rows: ``transformers`` in float32 (the
reference), ours in float32, bfloat16, int8 weight-only with bfloat16
activations (what ``dsparallel.serve --quantize int8`` runs) and with
float32 activations. For each: the perplexity, its change over float32,
the largest logit difference from float32 (relative to the largest float32
logit), and the share of positions whose top-1 token is float32's.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import save  # noqa: E402


def _windows(path: str, text: str, window: int):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with open(text) as f:
        ids = tok.encode(f.read())
    n = len(ids) // window
    return torch.tensor(ids[: n * window]).view(n, window)


def _logits(model, windows, ours: bool):
    import torch

    from dsparallel.inference.fast_linear import fast_decoding

    out = []
    with torch.no_grad():
        for w in windows.split(4):
            if ours:
                with fast_decoding(model):
                    out.append(model(w).logits.float())
            else:
                out.append(model(w).logits.float())
    return torch.cat(out)


def _score(logits, windows, reference) -> dict:
    import torch.nn.functional as F

    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)
    ).item()
    row = {"perplexity": math.exp(loss), "tokens": int(windows[:, 1:].numel())}
    if reference is not None:
        row["max_logit_error"] = float((logits - reference).abs().max() / reference.abs().max())
        row["top1_agreement"] = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "runs", "llama-docs", "hf"))
    ap.add_argument("--text", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--window", type=int, default=128)
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        print(f"{a.model} is missing: running the main job (bash scripts/train.sh) first")
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "train.sh")], check=True)
    import torch
    from transformers import AutoModelForCausalLM

    from dsparallel.inference.fast_linear import quantize_int8
    from dsparallel.models import from_pretrained

    torch.set_num_threads(2)
    windows = _windows(a.model, a.text, a.window)
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    rows = [
        {"system": "transformers, float32", **_score(_logits(hf, windows, False), windows, None)}
    ]
    del hf
    reference = None
    for name, dtype, int8 in (
        ("ours, float32", torch.float32, False),
        ("ours, bfloat16", torch.bfloat16, False),
        ("ours, int8 weights, bfloat16 activations", torch.bfloat16, True),
        ("ours, int8 weights, float32 activations", torch.float32, True),
    ):
        model = from_pretrained(a.model, dtype=dtype).eval()
        if int8:
            quantize_int8(model)
        logits = _logits(model, windows, True)
        row = {"system": name, **_score(logits, windows, reference)}
        reference = logits if reference is None else reference
        rows.append(row)
    base = rows[1]["perplexity"]
    for row in rows:
        row["perplexity_over_float32"] = row["perplexity"] / base
        extra = ""
        if "top1_agreement" in row:
            extra = (
                f", logits within {row['max_logit_error']:.2%}, "
                f"top-1 as float32 at {row['top1_agreement']:.1%} of positions"
            )
        print(f"{row['system']:<45} perplexity {row['perplexity']:.3f}{extra}")
    save(
        "quantization",
        rows,
        {
            "model": os.path.relpath(a.model, ROOT),
            "text": os.path.relpath(a.text, ROOT),
            "window": a.window,
        },
    )


if __name__ == "__main__":
    main()
