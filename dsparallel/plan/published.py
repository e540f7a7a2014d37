"""Published figures the planner's accounting reproduces, side by side:

- ZeRO (Rajbhandari et al., arXiv 1910.02054): model-state memory per
  device for 7.5B parameters on 64 devices with mixed-precision Adam;
- Korthikanti et al. (arXiv 2205.05198), Table 2: activation bytes per
  transformer layer under tensor parallelism, sequence parallelism and
  selective or full recomputation, for the paper's GPT configurations
  (Table 3: 22B, 175B, 530B, 1T; sequence 2048, tensor-parallel size 8).

``python -m dsparallel.plan published`` prints both tables; the planner's
docs page shows that output and tests/python/test_plan.py checks it.
"""

from __future__ import annotations

from .activations import layer_bytes, megatron_layer
from .layout import Layout
from .memory import model_state
from .model import rank_tensors, read_model

TOLERANCE = 0.02  # what "reproduced" means here

# ZeRO's 7.5B example: (stage, the model's dtype, GB per device in the paper).
# Without ZeRO, 16 bytes a parameter is float32 throughout here (dsparallel's
# plain AdamW), the paper's 2 + 2 + 12 in mixed precision: the same bytes.
ZERO_ROWS = ((0, "float32", 120.0), (1, "bfloat16", 31.4), (2, "bfloat16", 16.6))

# Korthikanti et al., Table 3: attention heads, hidden size, layers.
GPTS = {
    "22B": (64, 6144, 48),
    "175B": (96, 12288, 96),
    "530B": (128, 20480, 105),
    "1T": (160, 25600, 128),
}
SEQ, TP = 2048, 8
# (setting, tp, sequence parallel, recomputation)
SETTINGS = (
    ("no parallelism", 1, False, "none"),
    ("tp", TP, False, "none"),
    ("tp + sp", TP, True, "none"),
    ("tp + selective", TP, False, "selective"),
    ("tp + sp + selective", TP, True, "selective"),
    ("full recompute", TP, False, "full"),
)


def korthikanti_formula(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Table 2 of the paper, bytes per layer."""
    if recompute == "full":
        return 2 * s * b * h
    core = 0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + core)


def activation_rows(b: int = 1) -> list[tuple[str, str, float, float]]:
    """(model, setting, paper's bytes, the planner's bytes) per layer for a
    micro-batch of ``b`` sequences."""
    rows = []
    for name, (a, h, _layers) in GPTS.items():
        for setting, t, sp, recompute in SETTINGS:
            lay = Layout(tp=t, sequence_parallel=sp, dtype="float16")
            ours = layer_bytes(
                megatron_layer(h, a, SEQ, recompute),
                lay,
                SEQ * b,
                selective=recompute == "selective",
            )
            rows.append((name, setting, korthikanti_formula(SEQ, b, h, a, t, sp, recompute), ours))
    return rows


def zero_rows() -> list[tuple[int, float, float]]:
    """(stage, the paper's GB per device, the planner's): a GPT of 7.47B
    parameters on 64 devices, scaled to 7.5B."""
    from ..models.gpt import GPTConfig

    m = read_model(GPTConfig(vocab_size=50304, seq_len=2048, hidden=4096, heads=32, layers=35))
    psi = sum(t.numel for t in rank_tensors(m, 1, 1, 1, 0))
    return [
        (
            stage,
            paper,
            model_state(m, Layout(dp=64, zero=stage, dtype=dtype)).total * 7.5e9 / psi / 1e9,
        )
        for stage, dtype, paper in ZERO_ROWS
    ]


def _diff(ours: float, paper: float) -> str:
    return f"{round(ours / paper - 1, 4) + 0.0:+10.2%}"  # + 0.0: no "-0.00%"


def report() -> str:
    lines = [
        "ZeRO (arXiv 1910.02054): 7.5B parameters on 64 devices, mixed-precision Adam; "
        "GB per device",
        "ZeRO stage   paper  planner  difference",
    ]
    for stage, paper, ours in zero_rows():
        lines.append(f"{stage:>10}  {paper:6.1f}  {ours:7.1f}  {_diff(ours, paper)}")
    lines += [
        "",
        f"Korthikanti et al. (arXiv 2205.05198) Table 2: activations per layer, s = {SEQ}, b = 1, "
        f"t = {TP} where parallel; MB",
        "model  setting               paper    planner  difference",
    ]
    for name, setting, paper, ours in activation_rows():
        lines.append(
            f"{name:<5}  {setting:<20} {paper / 1e6:7.1f}  {ours / 1e6:9.1f}  {_diff(ours, paper)}"
        )
    return "\n".join(lines)
