"""Writes docs/performance.md and the README's headline table from the JSON
under benchmarks/results/ (one file per benchmark and machine class, written
by the benchmarks through benchmarks/common.py).

    python benchmarks/report.py           # regenerate both
    python benchmarks/report.py --check   # exit 1 if either differs from what it would write

Nothing here measures: every number printed comes from a results file, so
the same files always give the same bytes. A result whose measured sources
(benchmarks/sources.py) have changed since it was measured is marked stale
on both pages. Times are medians over the
repeats with [min-max]; a ratio a / b is the ratio of the medians with the
range min(a) / max(b) to max(a) / min(b) beside it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from sources import sources, sources_hash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PERFORMANCE = os.path.join(ROOT, "docs", "performance.md")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- performance table: begin -->", "<!-- performance table: end -->"
MODELS_GUIDE = os.path.join(ROOT, "docs", "guides", "models.md")
DEEPSEEK_BEGIN = "<!-- deepseek layouts: begin -->"
DEEPSEEK_END = "<!-- deepseek layouts: end -->"
SERVING_GUIDE = os.path.join(ROOT, "docs", "guides", "serving.md")
SERVING_BEGIN = "<!-- serving measurements: begin -->"
SERVING_END = "<!-- serving measurements: end -->"


# --- formatting -------------------------------------------------------------


def size(b: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def num(x: float) -> str:
    """Three significant figures, no exponent for the ranges we print."""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def t(s: dict, scale: float = 1.0) -> str:
    """A quantity's median [min-max], each times ``scale``."""
    return f"{num(s['median'] * scale)} [{num(s['min'] * scale)}-{num(s['max'] * scale)}]"


def ratio(a: dict, b: dict) -> str:
    """a / b: the medians' ratio and its range."""
    mid = a["median"] / b["median"]
    return f"{mid:.2f}x ({a['min'] / b['max']:.2f}-{a['max'] / b['min']:.2f})"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def machine_line(m: dict) -> str:
    return (
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']:g} GiB; torch {m['torch']}; "
        f"commit {m['commit']}, {m['date']}"
    )


# --- the results ------------------------------------------------------------


def load() -> dict[str, list[dict]]:
    """benchmark -> its result files (one per machine class), by file name."""
    out: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as f:
            r = json.load(f)
        r["file"] = os.path.relpath(path, ROOT)
        r["stale"] = stale(r)
        out.setdefault(r["benchmark"], []).append(r)
    return out


def stale(r: dict) -> str | None:
    """Why the result no longer measures the code in this tree, or None:
    the files its benchmark measures (benchmarks/sources.py) differ from
    what they were when it was measured. A result measured on a commit is
    held against that commit's files (through the lists as they are now);
    one measured on uncommitted code against the hash it recorded."""
    commit = r["machine"]["commit"]
    if "+" in commit or commit == "unknown":
        then = r.get("sources")
        if then is None:
            return f"measured on uncommitted code ({commit}) and recorded no source hash"
        if then != sources_hash(r["benchmark"]):
            return f"the files it measures have changed since {commit}"
        return None
    before, now = sources(r["benchmark"], commit), sources(r["benchmark"])
    changed = sorted(p for p in before.keys() | now.keys() if before.get(p) != now.get(p))
    if not changed:
        return None
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    named = ", ".join(f"`{p}`" for p in changed[:3])
    return f"{named}{more} changed since {commit}, where it was measured"


def _floor(r):
    lines = [
        "An 8-byte all-reduce between two processes over gloo, beside the loopback",
        "TCP round trip of 8 bytes between two Python processes on the same machine",
        '(the least any TCP transport can take for an exchange) and over "dsp".',
        "",
    ]
    rows = []
    for row in r["rows"]:
        tcp = row["tcp_round_trip"]
        for name, label in (
            ("tcp_round_trip", "loopback TCP round trip"),
            ("gloo_all_reduce", "gloo all-reduce"),
            ("dsp_all_reduce", '"dsp" all-reduce'),
        ):
            rows.append([label, t(row[name]), ratio(row[name], tcp)])
    return lines + table(["8 bytes, 2 processes", "us per call", "/ TCP round trip"], rows)


def _collectives(r):
    rows_in = r["rows"]
    engines = [
        ("dsp", '"dsp"'),
        ("dsp-op", "direct op"),
        ("gloo", "gloo"),
        ("mpi", "Open MPI"),
        ("deepspeed", "DeepSpeed shm"),
    ]
    present = [(k, n) for k, n in engines if any(k in row for row in rows_in)]
    lines = [
        'Time per call in microseconds (`dist.all_reduce` for "dsp" and gloo;',
        "`dsparallel.ops.all_reduce_` for the direct op; mpi4py for Open MPI;",
        "DeepSpeed's CPU shared-memory all-reduce), float32, same run. Ratios are",
        '"dsp"\'s time over the other\'s: below 1.0x "dsp" is faster.',
        "",
    ]
    for coll in sorted({row["collective"] for row in rows_in}):
        for world in sorted({row["world"] for row in rows_in}):
            sel = [x for x in rows_in if x["collective"] == coll and x["world"] == world]
            if not sel:
                continue
            lines.append(f"**{coll}, {world} ranks**")
            lines.append("")
            others = [(k, n) for k, n in present if k not in ("dsp", "dsp-op")]
            # DeepSpeed's op skips torch.distributed's call, as our direct op does.
            pairs = [("dsp", k, f'"dsp" / {n}') for k, n in others]
            pairs += [("dsp-op", "deepspeed", "direct op / DeepSpeed shm")] * any(
                k == "deepspeed" for k, _ in others
            )
            head = ["size"] + [n for _, n in present] + [label for _, _, label in pairs]
            body = []
            for row in sel:
                cells = [size(row["bytes"])]
                cells += [t(row[k]["us"]) if k in row else "-" for k, _ in present]
                cells += [
                    ratio(row[a]["us"], row[b]["us"]) if a in row and b in row else "-"
                    for a, b, _ in pairs
                ]
                body.append(cells)
            lines += table(head, body)
    return lines


def _p2p(r):
    names = [n for n in ("dsp", "dsp-gloo", "gloo", "MPI") if n in r["rows"][0]]
    lines = [
        'Ping-pong between two ranks: one-way latency in microseconds. "dsp-gloo" is',
        '"dsp" with `DSP_P2P_SINGLE_COPY=0` (large messages over gloo). Ratios:',
        '"dsp" over the other.',
        "",
    ]
    head = ["size"] + names + [f'"dsp" / {n}' for n in names[1:]]
    body = []
    for row in r["rows"]:
        cells = [size(row["bytes"])] + [t(row[n], 1e6) for n in names]
        cells += [ratio(row["dsp"], row[n]) for n in names[1:]]
        body.append(cells)
    return lines + table(head, body)


DDP_CONFIGS = ["torch/gloo", "torch/dsp", "dsparallel/gloo", "dsparallel/dsp"]


def _ddp(r):
    lines = [
        "Training step (forward, backward with gradient sync, SGD) in milliseconds,",
        "slowest rank; `local` is the same step with no communication. Ratios",
        'against torch\'s DDP over gloo (what users run by default) and over "dsp".',
        "",
    ]
    body = []
    for row in r["rows"]:
        for c in DDP_CONFIGS:
            s = row[f"{c}_s"]
            body.append(
                [
                    row["model"],
                    c.replace("/", " DDP / "),
                    t(s, 1e3),
                    ratio(s, row["torch/gloo_s"]),
                    ratio(s, row["torch/dsp_s"]),
                ]
            )
        body.append([row["model"], "local (no communication)", t(row["local_s"], 1e3), "", ""])
    return lines + table(
        ["model", "configuration", "step ms", "/ torch DDP, gloo", "/ torch DDP, dsp"], body
    )


ZERO_NAMES = {
    "ddp+adamw": "torch DDP + AdamW (no sharding)",
    "ddp+torch-zero1": "torch DDP + torch ZeroRedundancyOptimizer (default AdamW)",
    "ddp+torch-zero1-fused": "torch DDP + torch ZeroRedundancyOptimizer (fused AdamW)",
    "ours-ddp+adamw": "our DDP + AdamW",
    "ours-zero1": "our DDP + our ZeroRedundancyOptimizer (stage 1)",
    "ours-zero2": "our DDP(zero_stage=2) + our ZeroRedundancyOptimizer",
    "ours-zero2-overlap": "the same, overlap_param_gather=True",
    "fsdp2": "torch FSDP2 over dsp",
    "fsdp2-gloo": "torch FSDP2 over gloo",
}


def _zero(r):
    lines = [
        f"An MLP of {r['config']['layers']} x Linear({r['config']['width']}, "
        f'{r["config"]["width"]}), AdamW, over "dsp" unless named. Step time in',
        "milliseconds; optimizer state and gradients held by rank 0 in MB. The",
        "baseline at its best is torch's ZeroRedundancyOptimizer with fused AdamW.",
        "",
    ]
    for world in sorted({row["world"] for row in r["rows"]}):
        sel = {row["config"]: row for row in r["rows"] if row["world"] == world}
        best = sel.get("ddp+torch-zero1-fused")
        default = sel.get("ddp+torch-zero1")
        lines += [f"**{world} ranks**", ""]
        body = []
        for config, row in sel.items():
            body.append(
                [
                    ZERO_NAMES.get(config, config),
                    t(row["step_s"], 1e3),
                    ratio(row["step_s"], best["step_s"]) if best else "-",
                    ratio(row["step_s"], default["step_s"]) if default else "-",
                    f"{row['state'][0] / 1e6:.1f}",
                    f"{row['grads'][0] / 1e6:.1f}",
                ]
            )
        lines += table(
            [
                "configuration",
                "step ms",
                "/ torch ZeRO, fused",
                "/ torch ZeRO, default",
                "opt state MB",
                "grads MB",
            ],
            body,
        )
    if os.path.exists(os.path.join(ROOT, "docs", "figures", "zero-memory.png")):
        lines += ["![memory per rank by configuration](figures/zero-memory.png)", ""]
    return lines


def _pipeline(r):
    c = r["config"]
    rows = r["rows"]
    torch_rows = {x["schedule"]: x for x in rows if x["lib"] == "torch"}
    fastest = min(torch_rows, key=lambda k: torch_rows[k]["step_s"]["median"])
    lines = [
        f"{c['ranks']} ranks, {c['micro_batches']} micro-batches of "
        f"{c['batch_size'] // c['micro_batches']}, an MLP of width {c['width']}; the same",
        "model under every schedule of both libraries, timed in interleaved rounds.",
        "Step time in milliseconds; ratios against torch's schedule of the same name",
        f"and against torch's fastest schedule on this model ({fastest}). Bubbles: our",
        "measured one (median step) and the C++ simulator's plan from the step's mean",
        "action costs. Saved: bytes autograd held for backward on the first stage.",
        "",
    ]
    body = []
    for x in rows:
        same = torch_rows[x["schedule"]]
        bubble = (
            f"{x['bubble_measured']:.1%} / {x['bubble_planned']:.1%}"
            if "bubble_measured" in x
            else "-"
        )
        body.append(
            [
                x["lib"],
                x["schedule"],
                t(x["step_s"], 1e3),
                ratio(x["step_s"], same["step_s"]),
                ratio(x["step_s"], torch_rows[fastest]["step_s"]),
                bubble,
                f"{x['peak_saved_bytes'] / 2**20:.2f}",
            ]
        )
    lines += table(
        [
            "library",
            "schedule",
            "step ms",
            "/ torch, same schedule",
            f"/ torch {fastest}",
            "bubble measured / planned",
            "saved MiB",
        ],
        body,
    )
    figures = [x["schedule"] for x in rows if x["lib"] == "dsparallel"]
    for name in figures:
        path = f"figures/pipeline_{name}.png"
        if os.path.exists(os.path.join(ROOT, "docs", path)):
            lines += [f"![our {name}: a step under its plan]({path})", ""]
    return lines


def _tensor_parallel(r):
    lines = [
        "A transformer block (attention + MLP), forward and backward, in",
        "milliseconds: our layers against torch's `parallelize_module` on the same",
        "backend, and our layers on a group of one against the plain block.",
        "",
    ]
    body = []
    for row in r["rows"]:
        shape = f"{row['batch']} x {row['seq']} x {row['hidden']} ({row['heads']} heads)"
        for backend in ("dsp", "gloo"):
            theirs, ours = row[f"torch TP / {backend}"], row[f"ours TP / {backend}"]
            body.append([shape, backend, t(theirs, 1e3), t(ours, 1e3), ratio(ours, theirs)])
        plain, one = row["plain"], row["ours, group of 1"]
        body.append([shape, "group of 1", t(plain, 1e3), t(one, 1e3), ratio(one, plain)])
    return lines + table(
        ["batch x seq x hidden", "backend", "torch (or plain) ms", "ours ms", "ours / torch"],
        body,
    )


def _moe(r):
    timed = [x for x in r["rows"] if "world" in x]
    loads = [x for x in r["rows"] if "load" in x]
    lines = [
        "Dispatch + combine (forward and backward, the experts left out) in",
        "milliseconds: our C++ ops against the same built from torch's ops",
        "(Megatron's recipe), 8 experts, top-2.",
        "",
    ]
    body = []
    for x in timed:
        body.append(
            [
                f"{x['world']}",
                f"{x['tokens']} x {x['hidden']}",
                t(x["ours / dsp"], 1e3),
                t(x["torch / gloo"], 1e3),
                t(x["torch / dsp"], 1e3),
                ratio(x["ours / dsp"], x["torch / gloo"]),
                ratio(x["ours / dsp"], x["torch / dsp"]),
            ]
        )
    lines += table(
        [
            "ranks",
            "tokens x hidden",
            "ours / dsp",
            "torch ops / gloo",
            "torch ops / dsp",
            "ours / torch gloo",
            "ours / torch dsp",
        ],
        body,
    )
    if loads:
        lines += ["Busiest expert over the mean load, last tenth of training:", ""]
        lines += table(
            ["router", "busiest / mean"],
            [[x["load"], f"{x['busiest_over_mean']:.2f}"] for x in loads],
        )
    if os.path.exists(os.path.join(ROOT, "docs", "figures", "moe-load.png")):
        lines += ["![expert load over training](figures/moe-load.png)", ""]
    return lines


def _hybrid(r):
    lines = [
        "The GPT job in 4-process layouts: training tokens/s per step, and the",
        "peak MiB held for backward on the busiest rank.",
        "",
    ]
    base = r["rows"][0]["tokens_per_s"]
    body = [
        [
            x["layout"],
            "yes" if x["checkpoint"] else "no",
            t(x["tokens_per_s"]),
            ratio(x["tokens_per_s"], base),
            f"{max(x['saved_mb']):.1f}",
        ]
        for x in r["rows"]
    ]
    lines += table(["layout", "checkpointing", "tokens/s", "/ dp 4", "held MiB"], body)
    if os.path.exists(os.path.join(ROOT, "docs", "figures", "hybrid.png")):
        lines += ["![layouts](figures/hybrid.png)", ""]
    return lines


def _fastest_baseline(rows):
    return max(
        (x for x in rows if x["system"] == "baseline"),
        key=lambda x: x["tokens_per_s"]["median"],
    )


def _model_table(r, kind: str) -> list[str]:
    """One model's rows of a models result: tokens/s, the ratio to the best
    baseline, peak RSS."""
    rows = [x for x in r["rows"] if x["model"] == kind]
    base = _fastest_baseline(rows)
    body = [
        [
            x["system"],
            x["layout"],
            t(x["tokens_per_s"]),
            ratio(x["tokens_per_s"], base["tokens_per_s"]),
            f"{x['peak_rss_mb']:.0f}",
        ]
        for x in rows
    ]
    return table(["system", "layout", "tokens/s", "/ best baseline", "peak RSS MiB"], body)


def deepseek_layouts(results) -> str:
    """The DeepSeek-V3 layouts' rows for the models guide."""
    (r,) = results["models"][:1]
    cfg = r["config"]
    lines = [
        DEEPSEEK_BEGIN,
        "",
        f"Measured (`{r['file']}`; {machine_line(r['machine'])}): DeepSeek-V3 of about",
        f"100M parameters trained with AdamW on 4 processes, global batch {cfg['batch']} x",
        f"{cfg['seq']} tokens; ratios against the fastest `transformers` + torch DDP run.",
        "",
        *_model_table(r, "deepseek"),
        "",
        DEEPSEEK_END,
    ]
    return "\n".join(lines)


def serving_measurements(results) -> str:
    """The serving guide's measurements: the serve benchmark's table and
    plot, and int8's accuracy."""
    lines = [SERVING_BEGIN, ""]
    for r in results.get("serve", [])[:1]:
        lines += [f"Measured (`{r['file']}`; {machine_line(r['machine'])}):", ""]
        body = _serve(r)
        lines += [x.replace("](figures/", "](../figures/") for x in body]
    for r in results.get("quantization", [])[:1]:
        lines += [f"Accuracy (`{r['file']}`; {machine_line(r['machine'])}):", ""]
        lines += _quantization(r)
    if len(lines) == 2:
        lines += ["Not measured yet: run `python benchmarks/serve.py`.", ""]
    lines.append(SERVING_END)
    return "\n".join(lines)


def _quantization(r):
    cfg = r["config"]
    lines = [
        f"The main job's Llama (`{cfg['model']}`, trained on the docs) scored on the held-out",
        f"`{cfg['text']}` in windows of {cfg['window']} tokens ({r['rows'][0]['tokens']} predicted"
        " tokens): perplexity, and against our float32 the largest logit difference (over the",
        "largest logit) and the share of positions whose most likely next token is unchanged.",
        "",
    ]
    body = [
        [
            x["system"],
            f"{x['perplexity']:.3f}",
            f"{x['perplexity_over_float32']:.4f}x",
            f"{x['max_logit_error']:.2%}" if "max_logit_error" in x else "-",
            f"{x['top1_agreement']:.1%}" if "top1_agreement" in x else "-",
        ]
        for x in r["rows"]
    ]
    return lines + table(
        ["weights", "perplexity", "over our float32", "largest logit change", "same top-1"], body
    )


def _models(r):
    cfg = r["config"]
    lines = [
        "Llama and DeepSeek-V3 of about 100M parameters (configs in the results file),",
        f"trained with AdamW on 4 processes, global batch {cfg['batch']} x {cfg['seq']} tokens:",
        "training tokens/s and the largest rank's peak RSS. Ratios are against the best",
        "baseline of the same model: the `transformers` model under torch's DDP over gloo.",
        "",
    ]
    for kind in ("llama", "deepseek"):
        lines += [f"**{kind}**", ""]
        lines += _model_table(r, kind)
    load = cfg.get("load_memory_tp4")
    if load:
        lines += [
            "`from_pretrained` of the Llama checkpoint at tp 4, per rank: the peak rise of",
            "private (anonymous) memory while loading, sampled every millisecond, against",
            "the shard the rank keeps and the largest checkpoint tensor; apart, the",
            "checkpoint's pages the memory-mapped reads brought in (page cache: shared,",
            "reclaimable) (MiB):",
            "",
        ]
        lines += table(
            ["rank", "private rise", "shard", "largest tensor", "checkpoint pages"],
            [
                [str(i), f"{a:.0f}", f"{s:.0f}", f"{load['largest_tensor_mb']:.0f}", f"{f:.0f}"]
                for i, (a, f, s) in enumerate(
                    zip(load["anon_rise_mb"], load["file_pages_mb"], load["shard_mb"])
                )
            ],
        )
    return lines


def _trainer(r):
    cfg = r["config"]
    base = _fastest_baseline(r["rows"])
    lines = [
        f"A Llama of about 90M parameters trained on the docs by the trainer, on {cfg['world']}",
        f"processes, global batch {cfg['batch']} x {cfg['seq']} tokens, the same tokenizer,",
        "packed sequences, AdamW, schedule and clipping for every system: training",
        "tokens/s per optimizer step (everything the trainer does included). Ratios are",
        "against the fastest `transformers` `Trainer`; for ours, the share of a step the",
        "trainer's own work takes (reading data, reporting metrics).",
        "",
    ]
    body = [
        [
            x["layout"],
            t(x["tokens_per_s"]),
            ratio(x["tokens_per_s"], base["tokens_per_s"]),
            f"{100 * x['own_share']:.1f}%" if "own_share" in x else "",
        ]
        for x in r["rows"]
    ]
    lines += table(["system", "tokens/s", "/ best baseline", "own work"], body)
    return lines


def _inference(r):
    cfg = r["config"]
    ok = [x for x in r["rows"] if "error" not in x]
    dtypes = list(dict.fromkeys(x.get("dtype", "float32") for x in ok))
    lines = [
        f"Greedy decoding of a Llama of about 300M parameters, {cfg['prompt']}-token prompts,",
        f"{cfg['new']} new tokens: decode latency per token (slowest rank) and decode tokens/s.",
        "Each dtype is a group timed together; ratios are our tp 2 latency over each",
        "system's of the same dtype (below 1.0x ours is faster). int8 is ours only:",
        "weight-only int8 with bfloat16 activations.",
        "",
    ]
    head = [
        "system",
        "batch 1 ms/token",
        "ours tp 2 / this",
        "batch 8 ms/token",
        "ours tp 2 / this",
        "batch 8 tokens/s",
    ]
    for dtype in dtypes:
        rows = [x for x in ok if x.get("dtype", "float32") == dtype]
        ours = rows[0]
        body = []
        for x in rows:
            cells = [x["system"]]
            for b in (1, 8):
                lat = x[f"batch{b}"]["latency_s"]
                cells += [t(lat, 1e3), ratio(ours[f"batch{b}"]["latency_s"], lat)]
            cells.append(num(x["batch8"]["tokens_per_s"]["median"]))
            body.append(cells)
        lines += [f"**{dtype}**", ""] + table(head, body)
    for x in r["rows"]:
        if "error" in x:
            lines += [
                f"{x['system']} ({x.get('dtype', 'float32')}): did not run ({x['error']}).",
                "",
            ]
    floors = [x for x in ok if "floor" in x]
    if floors:
        body = []
        for x in floors:
            f = x["floor"]
            lat = x["batch1"]["latency_s"]["median"]
            body.append(
                [
                    x.get("dtype", "float32"),
                    num(f["weight_bytes_per_rank"] / 2**20),
                    num(f["bandwidth_bytes_per_s"]["median"] / 1e9),
                    num(f["floor_s"] * 1e3),
                    num(lat * 1e3),
                    f"{lat / f['floor_s']:.2f}x",
                ]
            )
        lines += [
            "The floor of our tp 2 batch-1 step: the weight bytes one rank reads per step",
            "over the memory bandwidth one process of one thread gets while the other reads",
            "too (each summing 512 MB, measured in every round of the same run).",
            "",
        ]
        lines += table(
            [
                "dtype",
                "weights a rank (MiB)",
                "bandwidth a process (GB/s)",
                "floor (ms/token)",
                "ours tp 2, batch 1",
                "over the floor",
            ],
            body,
        )
    by_dtype = {x.get("dtype", "float32"): x for x in ok if x["system"].startswith("ours, tp 2")}
    if "float32" in by_dtype and len(by_dtype) > 1:
        body = []
        for dtype, x in by_dtype.items():
            if dtype == "float32":
                continue
            cells = [dtype]
            for b in (1, 8):
                cells.append(
                    ratio(
                        x[f"batch{b}"]["latency_s"], by_dtype["float32"][f"batch{b}"]["latency_s"]
                    )
                )
            rest = [
                y
                for y in ok
                if y.get("dtype", "float32") == dtype and not y["system"].startswith("ours")
            ]
            for b in (1, 8):
                if rest:
                    best = min(rest, key=lambda y, b=b: y[f"batch{b}"]["latency_s"]["median"])
                    cells.append(ratio(x[f"batch{b}"]["latency_s"], best[f"batch{b}"]["latency_s"]))
                else:
                    cells.append("-")
            body.append(cells)
        lines += [
            "Our tp 2 in each dtype over our float32 tp 2 (across groups, so measured",
            "apart), and over the fastest other system of the same dtype (the same group):",
            "",
        ]
        lines += table(
            [
                "dtype",
                "batch 1 / our float32",
                "batch 8 / our float32",
                "batch 1 / fastest other",
                "batch 8 / fastest other",
            ],
            body,
        )
    ours = ok[0]
    share = ours.get("collective_share", {}).get("decode_share")
    if share is not None:
        lines += [
            f"Our {ours.get('dtype', 'float32')} tp 2 batch-1 decode spends {share:.0%} of its "
            "time in the tensor-parallel",
            "collectives (torch profiler, CPU time of the ops over the wall time).",
            "",
        ]
    memory = ours.get("decode_memory")
    if memory is not None:
        lines += [
            f"Over {memory['steps']} batch-1 decode steps after the first three, the bytes in use "
            f"of our tp 2 ranks grew by at most {memory['in_use_growth_bytes']} B (a token's KV "
            f"cache is {memory['per_rank'][0]['cache_bytes_per_token']} B per rank) and glibc "
            f"took {memory['held_growth_bytes']} B more from the system (its counters, "
            "`mallinfo2`, in processes without its caches of freed chunks); the KV cache "
            "never moved.",
            "",
        ]
    return lines


def _serve(r):
    cfg = r["config"]
    ok = [x for x in r["rows"] if "error" not in x]
    lines = [
        f"A Llama of about 300M parameters in {cfg['dtype']}: every client sends one request at",
        f"once ({cfg['prompt']}-token prompt, {cfg['new']} tokens generated greedily). Throughput",
        "is the tokens generated over the time to the last request's end; time to first",
        "token the median over the clients. Ratios are each system's throughput over",
        "ours with as many clients (below 1.0x ours serves more). The baselines are",
        "given their requests in hand, without HTTP.",
        "",
    ]
    ours = {x["clients"]: x for x in ok if x["system"].startswith("ours")}
    body = []
    for x in ok:
        mine = ours.get(x["clients"])
        body.append(
            [
                x["system"],
                str(x["clients"]),
                t(x["tokens_per_s"]),
                ratio(x["tokens_per_s"], mine["tokens_per_s"]) if mine else "-",
                t(x["ttft_s"], 1e3),
            ]
        )
    lines += table(
        ["system", "clients", "tokens/s", "this / ours", "time to first token (ms)"], body
    )
    for x in r["rows"]:
        if "error" in x:
            lines += [f"{x['system']}: did not run ({x['error']}).", ""]
    if os.path.exists(os.path.join(ROOT, "docs", "figures", "serve-throughput.png")):
        lines += ["![throughput against clients](figures/serve-throughput.png)", ""]
    return lines


def _context_parallel(r):
    cfg, rows = r["config"], r["rows"]
    memory = [x for x in rows if x["kind"] == "memory"]
    one = next(x for x in memory if x["cp"] == 1)
    lines = [
        f"The GPT (hidden {cfg['model']['hidden']}, {cfg['model']['heads']} heads, "
        f"{cfg['model']['layers']} layers), batch 1. Activations saved for backward per rank",
        f"(saved-tensor hooks, parameters excluded) at {cfg['seq']} tokens, and the longest "
        f"sequence whose saved activations fit {cfg['cap_mib']} MiB per rank:",
        "",
    ]
    body = [
        [
            str(x["cp"]),
            f"{x['saved_bytes'] / 2**20:.1f}",
            f"{x['saved_bytes'] / one['saved_bytes']:.2f}x",
            str(x["longest_seq"]),
            f"{x['longest_seq'] / one['longest_seq']:.2f}x",
        ]
        for x in memory
    ]
    lines += table(
        ["cp", "MiB saved per rank", "/ one process", "longest sequence", "/ one process"],
        body,
    )
    steps = [x for x in rows if x["kind"] == "step"]
    if steps:
        ring = next(x for x in steps if "ring" in x["system"])
        lines += [
            f"A training step (forward and backward) at {cfg['seq']} tokens, interleaved rounds;",
            "ratios are ring attention's time over each system's:",
            "",
        ]
        lines += table(
            ["system", "ms per step", "ring cp 2 / this"],
            [[x["system"], t(x["step_s"], 1e3), ratio(ring["step_s"], x["step_s"])] for x in steps],
        )
    overlap = next((x for x in rows if x["kind"] == "ring_overlap"), None)
    if overlap is not None:
        op, alone = overlap["ring_op_s"], overlap["messages_alone_s"]
        waits = overlap.get("waits_s")
        lines.append(
            f"Ring attention at cp {overlap['cp']}, one layer's attention forward and backward: "
            f"{op * 1e3:.1f} ms, of which {overlap['outside_kernels_s'] * 1e3:.1f} ms outside "
            "its kernels and their waits. The same messages sent around the ring alone take "
            f"{alone * 1e3:.2f} ms, {alone / op:.1%} of the op."
        )
        if waits is not None:
            least = min(waits)
            lines.append(
                "The op waits at its exchanges (`dsparallel::ring_wait`) "
                + " and ".join(f"{w * 1e3:.1f}" for w in waits)
                + f" ms on the two ranks: even the rank that waits least waits "
                f"{least / alone:.0f}x what the transfers alone take. The waits are the ranks "
                "waiting for each other: the load-balanced blocks have equal FLOPs but not "
                "equal shapes, and the kernel's speed differs between them. On one host a "
                "transfer is a shared-memory copy done by the ranks' own threads, so no share "
                "of it can be hidden or told apart from that lag here; the op posts each "
                "transfer before the block's attention (forward and backward) for backends "
                "whose transfers progress on their own (gloo between hosts)."
            )
        lines.append("")
    torch_cp = next((x for x in rows if x["kind"] == "torch_context_parallel"), None)
    if torch_cp is not None:
        lines += [
            "torch's `context_parallel` on the same model and processes: "
            + ("ran." if torch_cp["ran"] else f"did not run ({torch_cp['error']})."),
            "",
        ]
    return lines


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def _plan(r):
    cfg, rows = r["config"], r["rows"]
    c, n = cfg["cluster"], cfg.get("devices", 4)
    cores = r["machine"]["cores"]
    share = f"{n} ranks on {cores} cores" if n > cores else "a core per rank"
    lines = [
        f"The GPT job (hidden {cfg['model']['hidden']}, {cfg['model']['heads']} heads, "
        f"{cfg['model']['layers']} layers, {cfg['model']['seq_len']} tokens, global batch "
        f"{cfg['batch']} in {cfg['micro_batches']} micro-batches) at every layout of {n} "
        f"processes ({share}), planned by `dsparallel.plan` for this machine as "
        f"`calibrate({n})` measured it (matmul "
        f"{max(f for _, f in c['flops_by_size']) / 1e9:.0f} GFLOP/s per rank at best, "
        f"all-reduce {c['intra_bandwidth'] / 1e9:.2f} GB/s, "
        f"{c['op_overhead'] * 1e6:.1f} us per op) and as run: the model state (parameters, "
        "gradients, AdamW) and the activations saved for backward, each the most over the "
        "ranks, and the step time (slowest rank; median [min-max] of "
        f"{cfg['steps'] * cfg['rounds']} steps in {cfg['rounds']} rounds).",
        "",
    ]
    body, predicted, measured = [], [], []
    for x in rows:
        lay, e = x["layout"], x["predicted"]
        name = (
            f"tp {lay['tp']} pp {lay['pp']} dp {lay['dp']}"
            + (f" cp {lay['cp']}" if lay["cp"] > 1 else "")
            + (f" zero {lay['zero']}" if lay["zero"] else "")
            + (f" {lay['schedule']}" if lay["pp"] > 1 else "")
            + (" recompute" if lay["recompute"] else "")
        )
        predicted.append(e["time"]["total"])
        measured.append(x["step_s"]["median"])
        body.append(
            [
                name,
                f"{e['model_state_bytes'] / 2**20:.2f} / {x['model_state_bytes'] / 2**20:.2f}",
                f"{e['saved_bytes'] / 2**20:.2f} / {x['saved_bytes'] / 2**20:.2f}",
                f"{e['time']['total'] * 1e3:.0f}",
                t(x["step_s"], 1e3),
            ]
        )
    lines += table(
        [
            "layout",
            "model state MiB, planned / held",
            "activations MiB, planned / saved",
            "step ms, planned",
            "step ms, measured",
        ],
        body,
    )
    best_planned = min(range(len(rows)), key=lambda i: predicted[i])
    best = min(measured)
    under = sorted(p / m for p, m in zip(predicted, measured))
    lines += [
        "",
        f"Spearman's rho between the planned and the measured step times: "
        f"{_spearman(predicted, measured):.2f} over {len(rows)} layouts. The planned best "
        f"({body[best_planned][0]}) measured {measured[best_planned] * 1e3:.0f} ms, "
        f"{measured[best_planned] / best:.2f}x the measured best ({best * 1e3:.0f} ms). "
        f"Planned over measured step time: {under[len(under) // 2]:.2f} "
        f"[{under[0]:.2f}-{under[-1]:.2f}].",
        "",
    ]
    return lines


def _call_cpu(r):
    lines = [
        "An 8-byte all-reduce, per call and rank: wall and CPU microseconds.",
        "`fake` is `dist.all_reduce` on torch's fake group (no communication: torch's",
        'own per-call cost); `op` our direct op; `dist` `dist.all_reduce` on "dsp".',
        "",
    ]
    body = [
        [
            str(x["world"]),
            x["engine"],
            t(x["wall_us"]),
            t(x["cpu_us"]) if "cpu_us" in x else "-",
        ]
        for x in r["rows"]
    ]
    return lines + table(["ranks", "engine", "wall us", "CPU us"], body)


def _core_latency(r):
    lines = [
        "The C++ core (`dsp::ShmComm`) against Open MPI, both called from C, no",
        "Python: microseconds per call.",
        "",
    ]
    body = [
        [
            x["collective"],
            x["data"],
            str(x["world"]),
            size(x["bytes"]),
            t(x["dsp"]),
            t(x["mpi"]),
            ratio(x["dsp"], x["mpi"]),
        ]
        for x in r["rows"]
    ]
    return lines + table(
        ["collective", "data", "ranks", "size", "core us", "Open MPI us", "core / MPI"], body
    )


def _models_dtype(r):
    cfg = r["config"]
    seqs = sorted({x.get("seq", cfg["seq"]) for x in r["rows"]})
    lines = [
        "The same models at one fast float32 layout each (Llama: tp 4 with sequence",
        "parallelism; DeepSeek-V3: dp 4, ep 4), global batch",
        f"{cfg['batch']} sequences of {' and of '.join(map(str, seqs))} tokens"
        + (" (the longer with fused AdamW only)" if len(seqs) > 1 else "")
        + ": float32, bf16 mixed precision",
        "(`dsparallel.MixedPrecision()`: float32 masters, gradients and AdamW state) and",
        'pure bf16, against `transformers` under `torch.autocast("cpu", bfloat16)` over',
        "torch's DDP/gloo (bucket views, static graph; DeepSeek-V3 with grouped_mm",
        "experts). AdamW at torch's default (foreach) and fused; under data parallelism",
        "also ZeRO-1 (ours, and torch's ZeroRedundancyOptimizer for the baseline):",
        "AdamW's float32 state and step sharded, as Megatron's distributed optimizer.",
        "Ratios: against our float32 with the same optimizer, and against the best",
        "`transformers` bf16 row.",
        "",
    ]
    for kind, seq in ((k, q) for k in ("llama", "deepseek") for q in seqs):
        rows = [x for x in r["rows"] if x["model"] == kind and x.get("seq", cfg["seq"]) == seq]
        base = _fastest_baseline(rows)

        def optimizer(x):
            return (x["fused"], x.get("zero", False))

        fp32 = {
            optimizer(x): x["tokens_per_s"]
            for x in rows
            if x["system"] == "dsparallel" and x["precision"] == "fp32"
        }
        body = [
            [
                x["system"],
                x["precision"],
                ("fused" if x["fused"] else "foreach") + (", ZeRO-1" if x.get("zero") else ""),
                t(x["tokens_per_s"]),
                ratio(x["tokens_per_s"], fp32[optimizer(x)]) if x["system"] == "dsparallel" else "",
                ratio(x["tokens_per_s"], base["tokens_per_s"]),
                f"{x['peak_rss_mb']:.0f}",
            ]
            for x in rows
        ]
        lines += [f"**{kind}, {cfg['batch']} x {seq} tokens a step**", ""]
        lines += table(
            [
                "system",
                "precision",
                "AdamW",
                "tokens/s",
                "/ our fp32",
                "/ best transformers bf16",
                "peak RSS MiB",
            ],
            body,
        )
    return lines


def _grouped_mlp(r):
    cfg = r["config"]
    lines = [
        f"A rank's {cfg['local_experts']} routed experts over {cfg['rows']} dispatched rows, one",
        "process, 2 threads, the rows per expert drawn anew every call (a skewed",
        "load): our C++ op against the Python loop it replaced and against",
        "`torch._grouped_mm` (forward only: torch has no CPU backward for it).",
        "Milliseconds; ratios below 1.0x mean ours takes less time.",
        "",
    ]
    body = []
    for x in r["rows"]:
        gm = x.get("_grouped_mm_s")
        body.append(
            [
                x["shape"],
                x["dtype"],
                x["pass"],
                t(x["ours_s"], 1e3),
                t(x["loop_s"], 1e3),
                t(gm, 1e3) if gm else "",
                ratio(x["ours_s"], x["loop_s"]),
                ratio(x["ours_s"], gm) if gm else "",
            ]
        )
    return lines + table(
        [
            "experts",
            "dtype",
            "pass",
            "ours ms",
            "loop ms",
            "_grouped_mm ms",
            "ours / loop",
            "ours / _grouped_mm",
        ],
        body,
    )


def _shm_size(r):
    lines = ['Shared memory a "dsp" group reserves on a host (default settings).', ""]
    body = [[str(x["world"]), f"{x['segment_bytes'] / 1e6:.1f}"] for x in r["rows"] if "world" in x]
    return lines + table(["ranks", "MB per group"], body)


def _gpu(r):
    row = r["rows"][0]
    lines = [f'{row["world"]} GPU(s): all-reduce, "dsp" (NCCL underneath) against NCCL.', ""]
    body = [
        [size(x["bytes"]), t(x["dsp"], 1e6), t(x["nccl"], 1e6), ratio(x["dsp"], x["nccl"])]
        for x in row["all_reduce"]
    ]
    lines += table(["size", '"dsp" us', "nccl us", '"dsp" / nccl'], body)
    d = row["ddp_step_s"]
    lines += table(
        ["DDP step", "ms"],
        [["torch DDP / nccl", t(d["torch"], 1e3)], ['ours / "dsp"', t(d["ours"], 1e3)]],
    )
    return lines


SECTIONS = [
    ("floor", "gloo's floor", "floor.py", _floor),
    ("collectives", "Collectives", "collectives.py", _collectives),
    ("p2p", "Point-to-point", "p2p.py", _p2p),
    ("ddp", "Data parallel (DDP)", "ddp.py", _ddp),
    ("zero", "ZeRO and FSDP2", "zero.py", _zero),
    ("pipeline", "Pipeline schedules", "pipeline.py", _pipeline),
    ("tensor_parallel", "Tensor parallel", "tensor_parallel.py", _tensor_parallel),
    ("moe", "Expert parallel", "moe.py", _moe),
    ("grouped_mlp", "Grouped expert GEMMs", "grouped_mlp.py", _grouped_mlp),
    ("hybrid", "Hybrid layouts of the GPT job", "hybrid.py", _hybrid),
    ("models", "Llama and DeepSeek-V3", "models.py", _models),
    ("models_dtype", "Llama and DeepSeek-V3 in bf16", "models.py --part dtype", _models_dtype),
    ("trainer", "The trainer against the transformers Trainer", "trainer.py", _trainer),
    ("inference", "Inference (generation with a KV cache)", "inference.py", _inference),
    ("serve", "Serving (continuous batching)", "serve.py", _serve),
    ("quantization", "Accuracy of bfloat16 and int8 weights", "quantization.py", _quantization),
    ("context_parallel", "Context parallel", "context_parallel.py", _context_parallel),
    (
        "plan_2",
        "The split planner against measurement: a core per rank",
        "plan.py --devices 2",
        _plan,
    ),
    ("plan", "The split planner against measurement: 4 ranks on 2 cores", "plan.py", _plan),
    ("call_cpu", "Where a small call's time goes", "call_cpu.py", _call_cpu),
    ("core_latency", "The C++ core against Open MPI", "core_latency.py", _core_latency),
    ("shm_size", "Shared memory per group", "shm_size.py", _shm_size),
    ("gpu", "GPU", "gpu.py", _gpu),
]


def performance_md(results: dict[str, list[dict]]) -> str:
    lines = [
        "# Performance",
        "",
        "<!-- Generated by benchmarks/report.py from benchmarks/results/*.json: do not edit. -->",
        "",
        "Every number on this page comes from the results files under",
        "`benchmarks/results/`, one per benchmark and machine class, written by the",
        "benchmark named in each section (`python benchmarks/<name>.py`); `python",
        "benchmarks/report.py` turns them into this page. A time is the median over at",
        "least five repeats with [min-max]; a ratio a / b is the ratio of the medians,",
        "with the range min(a) / max(b) to max(a) / min(b) in brackets. Below 1.0x the",
        "first named takes less time. Each baseline runs in the same processes and run",
        "as ours, at its defaults and, where it has them, at its best settings.",
        "A section marked **Stale** was measured on code that has changed since:",
        "each result records a hash of the files its benchmark measures (listed in",
        "`benchmarks/sources.py`), and the page is regenerated against the tree.",
        "",
        "## Machines",
        "",
    ]
    machines = {}
    for files in results.values():
        for r in files:
            m = r["machine"]
            machines.setdefault((m["cpu"], m["cores"], m["memory_gib"]), set()).add(
                (m["torch"], m["commit"], m["date"])
            )
    body = [
        [cpu, str(cores), f"{mem:g}", ", ".join(sorted({x[0] for x in runs}))]
        for (cpu, cores, mem), runs in sorted(machines.items())
    ]
    lines += table(["CPU", "cores", "memory GiB", "torch"], body)
    for key, title, script, render in SECTIONS:
        for r in results.get(key, []):
            lines += [f"## {title}", ""]
            lines += [f"`benchmarks/{script}` on {machine_line(r['machine'])}.", ""]
            if r["stale"]:
                lines += [
                    f"**Stale:** {r['stale']}: re-run `python benchmarks/{script}` on this"
                    " machine class to refresh these numbers.",
                    "",
                ]
            lines += render(r)
    return "\n".join(lines).rstrip() + "\n"


def _pick(rows, **want):
    return next((r for r in rows if all(r.get(k) == v for k, v in want.items())), None)


def per_token(tokens_per_s: dict) -> dict:
    """Seconds per token from tokens/s statistics (min and max swap)."""
    return {
        "median": 1 / tokens_per_s["median"],
        "min": 1 / tokens_per_s["max"],
        "max": 1 / tokens_per_s["min"],
    }


def verdict(a: dict, b: dict) -> str:
    """What a / b of times says once its range is read: a range across
    1.0 is no clear difference, whichever side the median falls."""
    if a["max"] / b["min"] < 1:
        return "faster"
    if a["min"] / b["max"] > 1:
        return "slower"
    return "no clear difference"


def headline(results: dict[str, list[dict]]) -> str:
    """The README's table: one line per strategy, ours against the baseline
    users would otherwise run, at its best, like for like where the layouts
    differ; and what each ratio's range says."""
    body = []

    def row_(r: dict, what: str, against: str, ours: dict, theirs: dict) -> None:
        read = verdict(ours, theirs) + (" (**stale**)" if r["stale"] else "")
        body.append([what, against, ratio(ours, theirs), read])

    def first(key):
        return results[key][0] if results.get(key) else None

    if r := first("collectives"):
        # dist.all_reduce against gloo and MPI; against DeepSpeed's op (no
        # torch.distributed call on its way) our direct op, which skips it too.
        for nbytes, against in ((8, ("gloo", "mpi", "deepspeed")), (1 << 20, ("mpi", "deepspeed"))):
            picked = _pick(r["rows"], collective="all_reduce", world=2, bytes=nbytes)
            for k in [k for k in against if picked and k in picked]:
                ours = "dsp-op" if k == "deepspeed" else "dsp"
                row_(
                    r,
                    f"all-reduce {size(nbytes)}, 2 ranks"
                    + (" (direct op)" if ours == "dsp-op" else ""),
                    {"gloo": "gloo", "mpi": "Open MPI", "deepspeed": "DeepSpeed's shm op"}[k],
                    picked[ours]["us"],
                    picked[k]["us"],
                )
    if r := first("p2p"):
        picked = _pick(r["rows"], bytes=64 << 10)
        if picked:
            for k in ("gloo", "MPI"):
                if k in picked:
                    row_(r, "send/recv 64 KiB, one way", k, picked["dsp"], picked[k])
    if r := first("ddp"):
        for x in r["rows"]:
            what = f"DDP step, {x['model']}, {r['config']['world']} ranks"
            row_(r, what, "torch DDP over gloo", x["dsparallel/dsp_s"], x["torch/gloo_s"])
            # The same backend under both: what our reducer itself gives.
            row_(r, what, 'torch DDP over "dsp"', x["dsparallel/dsp_s"], x["torch/dsp_s"])
    if r := first("zero"):
        for world in sorted({x["world"] for x in r["rows"]}):
            ours = _pick(r["rows"], world=world, config="ours-zero2")
            best = _pick(r["rows"], world=world, config="ddp+torch-zero1-fused")
            if ours and best:
                row_(
                    r,
                    f"ZeRO-2 step, {world} ranks",
                    "torch ZeroRedundancyOptimizer, fused AdamW",
                    ours["step_s"],
                    best["step_s"],
                )
    if r := first("pipeline"):
        ours = [x for x in r["rows"] if x["lib"] == "dsparallel"]
        theirs = [x for x in r["rows"] if x["lib"] == "torch"]
        a = min(ours, key=lambda x: x["step_s"]["median"])
        b = min(theirs, key=lambda x: x["step_s"]["median"])
        row_(
            r,
            f"pipeline step, {r['config']['ranks']} ranks, fastest schedule ({a['schedule']})",
            f"torch.distributed.pipelining, fastest ({b['schedule']})",
            a["step_s"],
            b["step_s"],
        )
    if r := first("tensor_parallel"):
        x = r["rows"][-1]
        row_(
            r,
            f"tensor-parallel block, hidden {x['hidden']}, 2 ranks",
            'torch `parallelize_module` over "dsp"',
            x["ours TP / dsp"],
            x["torch TP / dsp"],
        )
    if r := first("moe"):
        timed = [x for x in r["rows"] if x.get("world") == 2]
        if timed:
            x = timed[-1]
            row_(
                r,
                f"MoE dispatch + combine, {x['tokens']} x {x['hidden']}, 2 ranks",
                "torch ops over gloo",
                x["ours / dsp"],
                x["torch / gloo"],
            )
    _end_to_end(first, row_)
    machines = sorted(
        {machine_line(f["machine"]).split(";")[0] for v in results.values() for f in v}
    )
    lines = [BEGIN]
    lines += table(["measurement", "against", "our time / theirs (range)", "read"], body)
    lines.append(
        f"Measured on {'; '.join(machines)}; medians of at least five repeats"
        " ([docs/performance.md](docs/performance.md) has every table)."
    )
    lines.append(END)
    return "\n".join(lines)


def _end_to_end(first, row_) -> None:
    """Whole models, time per token: like for like (data parallel against
    data parallel) and our best layout, against transformers + torch DDP at
    its best; bf16 against transformers under autocast; the trainer
    against the transformers Trainer; decoding against transformers."""

    def fastest(rows):
        return max(rows, key=lambda x: x["tokens_per_s"]["median"]) if rows else None

    if r := first("models"):
        plain = {"llama": "dp 4", "deepseek": "dp 4, ep 4"}  # like for like
        for model, name in (("llama", "Llama"), ("deepseek", "DeepSeek-V3")):
            rows = [x for x in r["rows"] if x["model"] == model]
            theirs = fastest([x for x in rows if x["system"] == "baseline"])
            ours = [x for x in rows if x["system"] == "dsparallel"]
            same = next((x for x in ours if x["layout"] == plain[model]), None)
            best = fastest(ours)
            if not theirs:
                continue
            for x in [same] + ([best] if best is not same else []):
                if x:
                    row_(
                        r,
                        f"{name} training step, 4 ranks, {x['layout']}",
                        "transformers + torch DDP, its best",
                        per_token(x["tokens_per_s"]),
                        per_token(theirs["tokens_per_s"]),
                    )
    if r := first("models_dtype"):
        for model, name in (("llama", "Llama"), ("deepseek", "DeepSeek-V3")):
            rows = [x for x in r["rows"] if x["model"] == model and x["seq"] == r["config"]["seq"]]
            theirs = fastest([x for x in rows if x["system"] == "baseline"])
            ours = fastest([x for x in rows if x["precision"] == "mixed bf16"])
            if theirs and ours:
                row_(
                    r,
                    f"{name} bf16 training step, 4 ranks, {ours['layout']}",
                    "transformers + torch DDP under autocast, its best",
                    per_token(ours["tokens_per_s"]),
                    per_token(theirs["tokens_per_s"]),
                )
    if r := first("trainer"):
        theirs = fastest([x for x in r["rows"] if x["system"] == "baseline"])
        ours = fastest([x for x in r["rows"] if x["system"] == "dsparallel"])
        if theirs and ours:
            row_(
                r,
                f"the trainer, 2 ranks, {ours['layout'].split(', ', 1)[-1]}",
                "the transformers Trainer, its best",
                per_token(ours["tokens_per_s"]),
                per_token(theirs["tokens_per_s"]),
            )
    if r := first("inference"):
        # bfloat16, what people serve in, where the file has it.
        ok = [x for x in r["rows"] if "error" not in x]
        dtype = "bfloat16" if any(x.get("dtype") == "bfloat16" for x in ok) else None
        ok = [x for x in ok if x.get("dtype") == dtype]
        ours = _pick(ok, system="ours, tp 2 (2 processes)")
        rest = [x for x in ok if not x["system"].startswith("ours")]
        theirs = min(rest, key=lambda x: x["batch1"]["latency_s"]["median"]) if rest else None
        if ours and theirs:
            row_(
                r,
                f"decoding, batch 1, tp 2{', ' + dtype if dtype else ''}",
                f"the fastest other: {theirs['system']}",
                ours["batch1"]["latency_s"],
                theirs["batch1"]["latency_s"],
            )


def with_block(path: str, begin: str, end: str, block: str) -> str:
    """The file at ``path`` with its ``begin`` ... ``end`` block replaced by
    ``block`` (which carries the markers)."""
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{os.path.relpath(path, ROOT)} has no {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + block + tail


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args()
    results = load()
    outputs = {
        PERFORMANCE: performance_md(results),
        README: with_block(README, BEGIN, END, headline(results)),
        MODELS_GUIDE: with_block(
            MODELS_GUIDE, DEEPSEEK_BEGIN, DEEPSEEK_END, deepseek_layouts(results)
        ),
        SERVING_GUIDE: with_block(
            SERVING_GUIDE, SERVING_BEGIN, SERVING_END, serving_measurements(results)
        ),
    }
    stale = []
    for path, text in outputs.items():
        with open(path) as f:
            current = f.read()
        if current != text:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(text)
    if args.check and stale:
        print(f"out of date (run python benchmarks/report.py): {', '.join(stale)}")
        sys.exit(1)
    if not args.check:
        print(f"wrote {', '.join(stale) or 'nothing (up to date)'}")


if __name__ == "__main__":
    main()
