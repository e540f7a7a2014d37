"""The grouped expert op against the per-expert Python loop it replaced and
against torch._grouped_mm, in one process.

    python benchmarks/grouped_mlp.py [--rounds 5] [--steps 5]

A rank's routed experts over the rows dispatched to them, at the expert
shapes of the ~100M DeepSeek-V3 of ``models.py`` (SwiGLU, hidden 512, 512
per expert, weights stored as ``nn.Linear`` holds them) and of the GPT
job's MoE (GELU, hidden 256, 1024 per expert), 8 local experts, 4096 rows.
Every call routes anew: the rows per expert are drawn from a skewed
distribution, as a router's load is, so block sizes change call to call as
they do in training.

  ours         ``torch.ops.dsparallel.grouped_mlp`` (C++, one op)
  loop         the Python loop it replaced: per expert and block, F.linear,
               the activation, F.linear; the weights unbound from the stack
  _grouped_mm  torch._grouped_mm for both projections (blocks by expert,
               offsets): forward only, as torch 2.13 has no CPU backward

Forward, and forward + backward, in float32 and bfloat16; 2 threads. The
configurations are timed in interleaved rounds (median of each round's
steps; reported: median, min, max over rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import save, stats  # noqa: E402

LOCAL, ROWS = 8, 4096
# (name, hidden, ffn per expert, activation, weights stored transposed)
SHAPES = [
    ("DeepSeek-V3 ~100M experts", 512, 512, "swiglu", True),
    ("GPT job MoE experts", 256, 1024, "gelu", False),
]


def _routings(n: int, seed: int) -> list[list[tuple[int, int]]]:
    """n block layouts: one block per local expert, rows drawn from a skewed
    load (a Dirichlet draw per call), some experts nearly idle."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.distributions.Dirichlet(torch.full((LOCAL,), 2.0)).sample()
        counts = torch.multinomial(p, ROWS, replacement=True, generator=g)
        counts = torch.bincount(counts, minlength=LOCAL).tolist()
        out.append(list(enumerate(counts)))
    return out


def _loop(x, w1, w2, chunks, activation, transposed):
    import torch
    import torch.nn.functional as F

    parts = x.split([n for _, n in chunks])
    w1, w2 = w1.unbind(0), w2.unbind(0)
    out = []
    for (e, _), part in zip(chunks, parts):
        h = F.linear(part, w1[e]) if transposed else part @ w1[e]
        if activation == "gelu":
            a = F.gelu(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        out.append(F.linear(a, w2[e]) if transposed else a @ w2[e])
    return torch.cat(out)


def _grouped_mm(x, w1, w2, chunks, activation, transposed):
    import torch
    import torch.nn.functional as F

    offs = torch.tensor([n for _, n in chunks]).cumsum(0).to(torch.int32)
    a_w = w1.transpose(1, 2) if transposed else w1
    b_w = w2.transpose(1, 2) if transposed else w2
    h = torch._grouped_mm(x, a_w, offs=offs)
    if activation == "gelu":
        a = F.gelu(h)
    else:
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
    return torch._grouped_mm(a, b_w, offs=offs)


def _time(fn, routings, steps, cursor) -> float:
    samples = []
    for _ in range(steps):
        chunks = routings[cursor[0] % len(routings)]
        cursor[0] += 1
        t0 = time.perf_counter()
        fn(chunks)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(rounds: int, steps: int) -> list[dict]:
    import torch

    from dsparallel.moe.ops import grouped_mlp

    torch.set_num_threads(2)
    rows = []
    for name, hidden, ffn, activation, transposed in SHAPES:
        width = 2 * ffn if activation == "swiglu" else ffn
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            w1_shape = (LOCAL, width, hidden) if transposed else (LOCAL, hidden, width)
            w2_shape = (LOCAL, hidden, ffn) if transposed else (LOCAL, ffn, hidden)
            w1 = (torch.randn(w1_shape, generator=g) * 0.02).to(dtype).requires_grad_()
            w2 = (torch.randn(w2_shape, generator=g) * 0.02).to(dtype).requires_grad_()
            x = torch.randn(ROWS, hidden, generator=g).to(dtype).requires_grad_()
            grad = torch.randn(ROWS, hidden, generator=g).to(dtype)
            impls = {
                "ours": lambda c: grouped_mlp(x, w1, w2, c, activation, transposed),  # noqa: B023
                "loop": lambda c: _loop(x, w1, w2, c, activation, transposed),  # noqa: B023
                "_grouped_mm": lambda c: _grouped_mm(x, w1, w2, c, activation, transposed),  # noqa: B023
            }

            def forward(impl):
                def run(chunks):
                    with torch.no_grad():
                        impl(chunks)

                return run

            def both(impl):
                def run(chunks):
                    torch.autograd.grad(impl(chunks), (x, w1, w2), grad)  # noqa: B023

                return run

            configs = {(k, "forward"): forward(f) for k, f in impls.items()}
            configs.update({(k, "forward + backward"): both(impls[k]) for k in ("ours", "loop")})
            routings = _routings(64, seed=1)
            cursor = [0]
            for fn in configs.values():  # warm-up: a few routings each
                for c in routings[:3]:
                    fn(c)
            per_round = {k: [] for k in configs}
            keys = list(configs)
            for r in range(rounds):
                for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
                    per_round[k].append(_time(configs[k], routings, steps, cursor))
            for pass_ in ("forward", "forward + backward"):
                row = {
                    "shape": name,
                    "hidden": hidden,
                    "ffn": ffn,
                    "activation": activation,
                    "dtype": str(dtype).removeprefix("torch."),
                    "pass": pass_,
                }
                for impl in impls:
                    if (impl, pass_) in per_round:
                        row[f"{impl}_s"] = stats(per_round[(impl, pass_)])
                rows.append(row)
                print(
                    f"{name:28s} {row['dtype']:9s} {pass_:19s} "
                    + "  ".join(
                        f"{impl} {row[f'{impl}_s']['median'] * 1e3:7.2f} ms"
                        for impl in impls
                        if f"{impl}_s" in row
                    ),
                    flush=True,
                )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    rows = measure(a.rounds, a.steps)
    save(
        "grouped_mlp",
        rows,
        {"rounds": a.rounds, "steps": a.steps, "local_experts": LOCAL, "rows": ROWS, "threads": 2},
    )


if __name__ == "__main__":
    main()
